"""Indexer snapshots (SPEC §11.6): a sequence's raw keys and counters as one blob, for prefix-cache hits and
rejected speculative drafts.

Blob: ``ingested`` u64 LE | ``pooled`` u64 LE | the raw keys of tokens ``0 .. ingested - 1`` (``ingested * hd``
bf16, little-endian). Block keys are not stored: they are a deterministic function of the raw keys, so
``restore_aux`` pools them again with ``qsa_block_pool`` (the same kernel, per block, so bit-identical).
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from hss import _args
from hss.errors import HssError

if TYPE_CHECKING:
    from hss.qsa.indexer import QsaIndexer, QsaSeqState

__all__ = ["HEADER", "snapshot_aux", "restore_aux", "parse_aux"]

HEADER = struct.Struct("<QQ")   # ingested, pooled


def snapshot_aux(idx: QsaIndexer, st: QsaSeqState, stream: Any) -> bytes:
    """See :meth:`QsaIndexer.snapshot_aux`."""
    idx._check_state(st, "snapshot_aux")
    s = _args.stream(stream)
    n = st.ingested * idx.hd * 2
    blob = bytearray(HEADER.size + n)
    HEADER.pack_into(blob, 0, st.ingested, st.pooled)
    if n:
        idx.gpu.copy_d2h_on_stream(st.raw_keys, np.frombuffer(blob, dtype=np.uint8, offset=HEADER.size), s)
    return bytes(blob)


def parse_aux(blob: Any, hd: int, ratio: int, max_tokens: int) -> tuple[int, int, memoryview]:
    """Validate a blob for an indexer of head dim ``hd``, ``ratio`` tokens per block and ``max_tokens``:
    returns (ingested, pooled, raw-key bytes). Raises HssError (TypeError for a non-bytes object)."""
    try:
        mv = memoryview(blob).cast("B")
    except TypeError:
        raise TypeError(f"restore_aux: blob must be a contiguous bytes-like object (from snapshot_aux), "
                        f"not {type(blob).__name__}") from None
    if len(mv) < HEADER.size:
        raise HssError(f"restore_aux: blob truncated: {len(mv)} bytes, shorter than its {HEADER.size}-byte header; "
                       "pass the whole bytes object snapshot_aux returned")
    ingested, pooled = HEADER.unpack_from(mv)
    if ingested > max_tokens:
        raise HssError(f"restore_aux: the blob holds {ingested} tokens but this indexer keeps at most max_tokens = "
                       f"{max_tokens}; restore into an indexer constructed with max_tokens >= {ingested}")
    want = HEADER.size + ingested * hd * 2
    if len(mv) != want:
        raise HssError(f"restore_aux: blob size mismatch: {len(mv)} bytes, but {ingested} tokens of {hd} bf16 keys "
                       f"need {want}; the blob is cut short or comes from an indexer of another head dim")
    if pooled > ingested // ratio:
        raise HssError(f"restore_aux: the blob says {pooled} blocks are pooled but {ingested} tokens make only "
                       f"{ingested // ratio} complete blocks of {ratio}; the blob is corrupt")
    return ingested, pooled, mv[HEADER.size:]


def restore_aux(idx: QsaIndexer, st: QsaSeqState, blob: Any, stream: Any) -> None:
    """See :meth:`QsaIndexer.restore_aux`."""
    idx._check_state(st, "restore_aux")
    ingested, pooled, raw = parse_aux(blob, idx.hd, idx.ratio, idx.max_tokens)
    s = _args.stream(stream)
    if ingested:
        idx.gpu.copy_h2d_async(raw, st.raw_keys, s)   # pageable: staged before the call returns
    idx._launch_pool(st, 0, pooled, s)
    st.ingested, st.pooled = ingested, pooled
    idx._dev.store_pos(st, s)   # the device position follows the mirror (SPEC §17.2)
