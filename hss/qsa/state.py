"""What the indexer hands out (docs/design.md §11.1, §11.4): :class:`QsaSeqState`, one sequence's carry, and
:class:`QsaSelection`, one host-path decode step's selection."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hss.cuda.gpu import DevicePtr
from hss.errors import HssError

if TYPE_CHECKING:
    from hss.qsa.indexer import QsaIndexer

__all__ = ["QsaSeqState", "QsaSelection"]


@dataclass(frozen=True)
class QsaSelection:
    """One decode step's selection: contiguous NHD K/V scratch ``[n_sel, nkv_attn, hd_attn]`` bf16, an
    identity block table (``max_blocks`` i32 pages) and ``seq_len`` (one i32 = n_sel) on the device, for the
    standard paged decode attention. ``tokens`` (hss addition) is the host copy of the selected positions."""
    k_scratch: DevicePtr
    v_scratch: DevicePtr
    table_dev: DevicePtr
    seq_len_dev: DevicePtr
    n_sel: int
    max_blocks: int
    tokens: np.ndarray


class QsaSeqState:
    """One sequence's indexer carry: counters and the raw / pooled key buffers (free with
    ``QsaIndexer.release_seq_state``; dropping the object frees nothing, as in the original; the indexer's
    ``close()``, or its collection, frees every state it still has and marks it released).

    ``ingested``: tokens whose raw keys are stored (contiguous from 0); ``pooled``: complete blocks pooled;
    ``table_len``: identity-table pages uploaded; ``raw_keys`` ``[max_tokens, hd]`` bf16;
    ``block_keys`` ``[max_tokens // ratio, hd]`` bf16; ``slot``: its row of the indexer's device arrays (the
    position ``pos_dev[slot]`` is the device's copy of ``ingested``; -1 once released).
    """

    __slots__ = ("ingested", "pooled", "table_len", "raw_keys", "block_keys", "_owner", "_slot", "__weakref__")

    def __init__(self, raw_keys: DevicePtr, block_keys: DevicePtr, owner: QsaIndexer, slot: int = -1) -> None:
        self.ingested = 0
        self.pooled = 0
        self.table_len = 0
        self.raw_keys = raw_keys
        self.block_keys = block_keys
        self._owner = weakref.ref(owner)
        self._slot = slot

    @property
    def released(self) -> bool:
        return self.raw_keys.is_null() and self.block_keys.is_null()

    @property
    def slot(self) -> int:
        """This state's row of the indexer's device arrays (``pos_dev``, ``desc_dev``, ...); -1 once released."""
        return self._slot

    # internal API of hss.qsa: the indexer that made the state, and its release
    @property
    def owner(self) -> QsaIndexer | None:
        """The indexer whose ``new_seq_state`` made this state (None once that indexer is gone)."""
        return self._owner()

    def drop_slot(self) -> None:
        """Forget the slot (-1): the indexer released it, or closed."""
        self._slot = -1

    def sync(self, stream: Any) -> int:
        """Refresh ``ingested`` (and ``pooled``) from the device position after the work queued on ``stream``, and
        return it. Blocking (a 4-byte D2H, then a wait). Needed only where device steps ran without hss seeing
        them: replays of a ``torch.cuda.graph`` capture (hss's own eager steps and ``CudaGraph.launch`` replays keep
        the mirrors current)."""
        owner = self._owner()
        if owner is None:
            raise HssError("QsaSeqState.sync: the indexer of this state is gone")
        owner.check_state(self, "QsaSeqState.sync")
        s = owner.resources.stream(stream, "QsaSeqState.sync")
        n = owner.device_state("QsaSeqState.sync").read_pos(self, s)
        if n != self.ingested:
            self.ingested, self.pooled = n, n // owner.ratio
        return n

    def __repr__(self) -> str:
        state = "released" if self.released else f"raw_keys={self.raw_keys!r}, block_keys={self.block_keys!r}"
        return f"QsaSeqState(ingested={self.ingested}, pooled={self.pooled}, table_len={self.table_len}, {state})"
