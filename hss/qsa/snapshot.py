"""Indexer snapshots (docs/design.md §11.6, §17.7): a sequence's raw keys and counters as one blob, for prefix-cache
hits and rejected speculative drafts.

Blob: ``ingested`` u64 LE | ``pooled`` u64 LE | the raw keys of tokens ``0 .. ingested - 1`` (``ingested * hd``
bf16, little-endian) -- the original's layout -- then hss's trailer (:data:`TRAILER`, 20 bytes): magic ``HSSQ``,
u32 version, u64 config fingerprint (of hd, ratio, max_tokens, n_heads), u32 CRC32 of everything before the
trailer. Block keys are not stored: they are a deterministic function of the raw keys, so ``restore_aux`` pools
them again with ``qsa_block_pool`` (the same kernel, per block, so bit-identical).

``restore_aux`` verifies a trailer when present (a wrong magic, version, fingerprint or CRC is an
:class:`~hss.errors.HssError` before anything is written) and accepts the original's blob without one.
"""
from __future__ import annotations

import hashlib
import struct
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hss.errors import HssError

if TYPE_CHECKING:
    from hss.qsa.indexer import QsaIndexer, QsaSeqState

__all__ = ["HEADER", "TRAILER", "MAGIC", "VERSION", "fingerprint", "snapshot_aux", "checked_restore", "parse_aux",
           "ParsedAux"]

HEADER = struct.Struct("<QQ")      # ingested, pooled
TRAILER = struct.Struct("<4sIQI")  # magic, version, config fingerprint, CRC32 of the blob before the trailer
MAGIC = b"HSSQ"
VERSION = 1


def fingerprint(hd: int, ratio: int, max_tokens: int, n_heads: int) -> int:
    """The u64 config fingerprint a trailer carries: the first 8 bytes (LE) of BLAKE2b over the four u64s."""
    digest = hashlib.blake2b(struct.pack("<4Q", hd, ratio, max_tokens, n_heads), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _fingerprint_of(idx: QsaIndexer) -> int:
    return fingerprint(idx.hd, idx.ratio, idx.max_tokens, idx.n_heads)


def snapshot_aux(idx: QsaIndexer, st: QsaSeqState, stream: Any) -> bytes:
    """See :meth:`QsaIndexer.snapshot_aux`."""
    idx.check_state(st, "snapshot_aux")
    s = idx.resources.stream(stream, "snapshot_aux")
    n = st.ingested * idx.hd * 2
    body = HEADER.size + n
    blob = bytearray(body + TRAILER.size)
    HEADER.pack_into(blob, 0, st.ingested, st.pooled)
    if n:
        idx.gpu.copy_d2h_on_stream(st.raw_keys, np.frombuffer(blob, dtype=np.uint8, offset=HEADER.size, count=n), s)
    TRAILER.pack_into(blob, body, MAGIC, VERSION, _fingerprint_of(idx), zlib.crc32(memoryview(blob)[:body]))
    return bytes(blob)


class ParsedAux(NamedTuple):
    """A checked blob: the counters, the raw-key bytes, and whether it carried (and passed) a trailer."""
    ingested: int
    pooled: int
    raw: memoryview
    trailer: bool


def parse_aux(blob: Any, hd: int, ratio: int, max_tokens: int, n_heads: int | None = None) -> ParsedAux:
    """Validate a blob for an indexer of head dim ``hd``, ``ratio`` tokens per block, ``max_tokens`` and
    ``n_heads`` (needed to check a trailer's fingerprint; None: a trailer's fingerprint is not checked). Raises
    HssError (TypeError for a non-bytes object)."""
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
    body = HEADER.size + ingested * hd * 2
    trailer = len(mv) == body + TRAILER.size
    if len(mv) != body and not trailer:
        raise HssError(f"restore_aux: blob size mismatch: {len(mv)} bytes, but {ingested} tokens of {hd} bf16 keys "
                       f"need {body} (+ a {TRAILER.size}-byte hss trailer); the blob is cut short or comes from an "
                       "indexer of another head dim")
    if trailer:
        _check_trailer(mv, body, hd, ratio, max_tokens, n_heads)
    if pooled > ingested // ratio:
        raise HssError(f"restore_aux: the blob says {pooled} blocks are pooled but {ingested} tokens make only "
                       f"{ingested // ratio} complete blocks of {ratio}; the blob is corrupt")
    return ParsedAux(ingested, pooled, mv[HEADER.size:body], trailer)


def _check_trailer(mv: memoryview, body: int, hd: int, ratio: int, max_tokens: int, n_heads: int | None) -> None:
    magic, version, fp, crc = TRAILER.unpack_from(mv, body)
    if magic != MAGIC:
        raise HssError(f"restore_aux: the blob's last {TRAILER.size} bytes are not an hss trailer (magic {magic!r}, "
                       f"not {MAGIC!r}) though its size says they are: the blob is corrupt")
    if version != VERSION:
        raise HssError(f"restore_aux: the blob's trailer has version {version}; this hss reads version {VERSION} "
                       "(snapshot it again with this hss)")
    if n_heads is not None and fp != fingerprint(hd, ratio, max_tokens, n_heads):
        raise HssError(f"restore_aux: the blob was taken from an indexer of another configuration (its fingerprint "
                       f"{fp:#018x} is not this indexer's, of hd {hd}, ratio {ratio}, max_tokens {max_tokens}, "
                       f"n_heads {n_heads}); restore it into an indexer built like the one that took it")
    got = zlib.crc32(mv[:body])
    if got != crc:
        raise HssError(f"restore_aux: the blob is corrupt: its CRC32 is {got:#010x} but its trailer says {crc:#010x} "
                       "(a changed byte in the counters or the keys)")


def checked_restore(idx: QsaIndexer, st: QsaSeqState, blob: Any, stream: Any) -> tuple[int, int, memoryview, int]:
    """Every check of :meth:`QsaIndexer.restore_aux`, before any device write: ``(ingested, pooled, raw keys,
    raw stream)`` for the indexer to restore."""
    idx.check_state(st, "restore_aux")
    parsed = parse_aux(blob, idx.hd, idx.ratio, idx.max_tokens, idx.n_heads)
    s = idx.resources.stream(stream, "restore_aux")
    if parsed.raw.nbytes:   # host memory: the indexer's pinned staging would be overwritten under the upload
        addr = np.frombuffer(parsed.raw, dtype=np.uint8).__array_interface__["data"][0]
        idx.resources.check_caller("restore_aux", (("blob", addr, parsed.raw.nbytes, False),))
    return parsed.ingested, parsed.pooled, parsed.raw, s
