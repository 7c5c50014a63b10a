"""A sequence's keys on the device (docs/design.md §11.3, §11.6): raw keys written from the qk projection, complete
blocks pooled with ``qsa_block_pool``, and the counters committed last, together with the device position
(docs/design.md §17.2).

A restart (``prefill_ingest`` at 0) or a restore overwrites a state's first raw-key rows: they are saved first
(a device copy into a backup buffer of the indexer, allocated at the first such call) and put back if the call fails,
so every call is all or nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hss.cuda.gpu import DevicePtr, launcher
from hss.decls import qsa as kq

if TYPE_CHECKING:
    from hss.qsa.device import DeviceState
    from hss.qsa.indexer import QsaIndexer
    from hss.qsa.resources import IndexerResources
    from hss.qsa.state import QsaSeqState

__all__ = ["KeyWriter", "INGEST_SLAB"]

INGEST_SLAB = 2048          # prefill GEMM slab (rows), bounding qk_scratch


class KeyWriter:
    """The key-writing work of one indexer, on checked arguments (internal API of :mod:`hss.qsa`).

    ``gemm``: the indexer's qk projection into its ``qk_scratch``; ``pool_kernel``: ``qsa_block_pool``;
    ``positions``: the device state whose ``store_pos`` keeps ``pos_dev[slot]`` equal to ``st.ingested``;
    ``resources``: where the restart backup comes from."""

    def __init__(self, idx: QsaIndexer, resources: IndexerResources, gemm: Any, pool_kernel: Any,
                 positions: DeviceState) -> None:
        gpu, hd = idx.gpu, idx.hd
        self.gpu, self.resources, self.gemm, self.positions = gpu, resources, gemm, positions
        self.hd, self.ratio, self.hidden, self.qk_width, self.max_tokens = (
            hd, idx.ratio, idx.hidden, idx.qk_width, idx.max_tokens)
        # a plain int (an int is _args's fast path; a DevicePtr is not): the raw key, the last hd columns of a qk row
        self.key_cols = int(idx.qk_scratch) + idx.n_heads * hd * 2
        # the pack is kept here: the prepared launch reads it at every run
        pool = self.pool_pack = pool_kernel.pack(raw_keys=0, k_norm_w=idx.k_norm_w, block_keys=0, first_block=0,
                                                 ratio=idx.ratio, hd=hd, rot=idx.rot, theta=idx.theta, eps=idx.eps)
        self.pool_raw, self.pool_keys, self.pool_first = (pool.slot(n) for n in ("raw_keys", "block_keys",
                                                                                 "first_block"))
        self.run_pool = launcher(gpu, pool_kernel, (hd, 1, 1), kq.row_smem_bytes(hd), pool)
        self.backup: DevicePtr | None = None   # raw keys a restarted sequence overwrites, kept until it commits

    # -- the calls' device parts --------------------------------------------------------------------------
    def ingest(self, st: QsaSeqState, src: int, num_tokens: int, seq_start: int, s: int) -> None:
        """prefill_ingest's device part: ``num_tokens`` rows of attention inputs at ``src`` for positions
        ``seq_start ..``, their raw keys stored, every newly complete block pooled, then the commit."""
        total = seq_start + num_tokens
        old = (st.ingested, st.pooled)
        first_block = 0 if seq_start == 0 else st.pooled
        # a restart overwrites the state's first rows: keep them until the call commits
        keep = min(old[0], num_tokens) * self.hd * 2 if seq_start == 0 else 0
        saved = False
        try:
            if keep:
                backup = self._backup_buffer()
                self.gpu.copy_d2d_async(st.raw_keys, backup, keep, s)
                saved = True
            self._queue_rows(st, src, num_tokens, seq_start, s)
            self.pool(st, first_block, total // self.ratio - first_block, s)
            self.commit(st, total, total // self.ratio, s)
        except BaseException:
            if saved:
                self._put_back(st, keep, old, total // self.ratio, s)
            raise

    def restore(self, st: QsaSeqState, ingested: int, pooled: int, raw: Any, s: int) -> None:
        """restore_aux's device part on checked values: the rows it overwrites saved first, committed last."""
        old = (st.ingested, st.pooled)
        keep = min(old[0], ingested) * self.hd * 2
        saved = False
        try:
            if keep:
                self.gpu.copy_d2d_async(st.raw_keys, self._backup_buffer(), keep, s)
                saved = True
            if ingested:
                self.gpu.copy_h2d_async(raw, st.raw_keys, s)   # pageable: staged before the call returns
            self.pool(st, 0, pooled, s)
            self.commit(st, ingested, pooled, s)   # the device position follows the mirror (docs/design.md §17.2)
        except BaseException:
            if saved:
                self._put_back(st, keep, old, pooled, s)
            raise

    def token(self, st: QsaSeqState, normed: int, pos: int, s: int) -> int:
        """qk GEMV of the token into qk_scratch row 0; its raw key into raw_keys[pos]; pool a block it completes.
        Changes no counter (what it writes lies past the sequence's rows and blocks); returns the pooled count."""
        hd2 = self.hd * 2
        self.gemm(normed, 1, s)
        self.gpu.copy_d2d_async(self.key_cols, st.raw_keys + pos * hd2, hd2, s)
        complete = (pos + 1) // self.ratio
        self.pool(st, st.pooled, complete - st.pooled, s)
        return max(complete, st.pooled)

    def commit(self, st: QsaSeqState, ingested: int, pooled: int, s: int) -> None:
        """The last step of a call: the counters, then the device position (undone on the host if it fails)."""
        old = st.ingested, st.pooled
        st.ingested, st.pooled = ingested, pooled
        try:
            self.positions.store_pos(st, s)
        except BaseException:
            st.ingested, st.pooled = old
            raise

    # -- pooling -------------------------------------------------------------------------------------------
    def pool(self, st: QsaSeqState, first: int, n_new: int, s: int) -> None:
        """qsa_block_pool of blocks first .. first + n_new - 1 of ``st`` (nothing when n_new is 0)."""
        if n_new:
            self.pool_raw.value = st.raw_keys
            self.pool_keys.value = st.block_keys
            self.pool_first.value = first
            self.run_pool(s, n_new)

    def pool_new_blocks(self, st: QsaSeqState, s: int) -> None:
        """Pool the blocks of ``st`` complete by ``st.ingested`` but not yet pooled (a partial restore leaves some)."""
        complete = st.ingested // self.ratio
        if complete > st.pooled:
            self.pool(st, st.pooled, complete - st.pooled, s)
            st.pooled = complete

    # -- helpers ---------------------------------------------------------------------------------------------
    def _queue_rows(self, st: QsaSeqState, src: int, num_tokens: int, seq_start: int, s: int) -> None:
        """The qk GEMM of ``num_tokens`` rows at ``src`` in slabs, each slab's raw-key columns copied into
        ``st.raw_keys`` from row ``seq_start`` (no state change)."""
        row, hd, qkw = self.hidden * 2, self.hd, self.qk_width
        for off in range(0, num_tokens, INGEST_SLAB):
            rows = min(INGEST_SLAB, num_tokens - off)
            self.gemm(src + off * row, rows, s)
            self.gpu.copy_d2d_2d_async(self.key_cols, qkw * 2, st.raw_keys + (seq_start + off) * hd * 2, hd * 2,
                                       hd * 2, rows, s)

    def _backup_buffer(self) -> DevicePtr:
        if self.backup is None:
            self.backup = self.resources.alloc(self.max_tokens * self.hd * 2, "the indexer's restart backup")
        return self.backup

    def _put_back(self, st: QsaSeqState, keep: int, old: tuple[int, int], complete: int, s: int) -> None:
        """Undo a failed restart: the saved raw keys back, the blocks it may have pooled over pooled again (the same
        kernel on the same keys: the same bits). If even that fails the sequence is left empty (a consistent state:
        restart it), and the original error is raised."""
        try:
            self.gpu.copy_d2d_async(self.backup, st.raw_keys, keep, s)
            self.pool(st, 0, min(old[1], complete), s)
        except BaseException:
            st.ingested = st.pooled = 0
            try:
                self.positions.store_pos(st, s)
            except BaseException:
                pass
