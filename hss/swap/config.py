"""What a :class:`~hss.swap.orchestrator.HighSpeedSwap` is built from (docs/design.md §8.1, §8.2, §8.4, §8.5):
:class:`HighSpeedSwapConfig`, :class:`ModelDims`, the disk block-id allocator and the diagnostic record.
Pure host code."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hss import _args
from hss.errors import HssError

__all__ = ["HighSpeedSwapConfig", "ModelDims", "DiskBlockAllocator", "HighSpeedSwapDiagnostic", "STORES"]

STORES = ("file", "host")
_I32_MAX = 2**31 - 1


@dataclass(frozen=True)
class HighSpeedSwapConfig:
    """The original's fields (all required) and hss's additions (keywords with defaults).

    ``dir``: where the layer files go (created); ``bytes``: the most the backing store may take (> 0;
    construction fails naming the size needed if the layout is larger); ``resident_blocks``: scratch slots
    in HBM (> 0); ``rank``: predictor rank r (1..128); ``qd``: file reads in flight (1..64); ``graph``: kept
    for parity (unused, as in the original); ``projection_seed``: u64 seed of P.

    hss: ``store``: "file" (one file per layer under ``dir``) or "host" (one pinned host buffer);
    ``stream_tile_blocks``: pages per streamed tile T; the scratch is ``resident_blocks - 2*T`` resident
    slots plus a double buffer of 2*T slots (default T = max(1, resident_blocks // 4)); ``direct``: the
    FileStore's O_DIRECT choice (None: where the filesystem allows it); ``run_cap_bytes``: the FileStore's largest
    read (consecutive pages in one pread; default 1 MiB; at least one page is read at a time); ``projection``: the
    predictor's P per layer and kv head (bf16 ``[num_layers, num_kv_heads, head_dim, rank]``, e.g. from
    :func:`hss.predictor.calibrate_projection`; None: the seeded P of ``projection_seed``); ``head_temperature``: the
    predictor's per-head normalised scores (docs/design.md §17.5; None: max over heads).
    """

    dir: str | os.PathLike
    bytes: int
    resident_blocks: int
    rank: int
    qd: int
    graph: bool
    projection_seed: int
    store: str = "file"
    stream_tile_blocks: int | None = None
    direct: bool | None = None
    run_cap_bytes: int = 1 << 20
    projection: Any = field(default=None, compare=False, repr=False)
    head_temperature: float | None = None

    def __post_init__(self) -> None:
        _args.int_fields(self)      # numpy integers become Python ints; float, bool, str: TypeError naming the field
        if self.stream_tile_blocks is not None:
            object.__setattr__(self, "stream_tile_blocks",
                               _args.as_int("HighSpeedSwapConfig.stream_tile_blocks", self.stream_tile_blocks))

    def validate(self) -> None:
        """Raise :class:`HssError` (``TypeError`` for wrong types) naming the first bad field."""
        if not isinstance(self.dir, (str, os.PathLike)) or not str(self.dir):
            raise HssError(f"HighSpeedSwapConfig.dir must be a non-empty path, got {self.dir!r}")
        checks = (("bytes", 1, None), ("resident_blocks", 1, None), ("rank", 1, 128), ("qd", 1, 64),
                  ("projection_seed", 0, 2**64 - 1), ("run_cap_bytes", 1, None))
        for name, lo, hi in checks:
            v = getattr(self, name)        # an int: __post_init__ converted it
            if v < lo or (hi is not None and v > hi):
                span = f">= {lo}" if hi is None else f"in {lo}..{hi}"
                raise HssError(f"HighSpeedSwapConfig.{name} must be {span} (got {v})")
        if not isinstance(self.graph, bool):
            raise TypeError(f"HighSpeedSwapConfig.graph must be a bool, got {type(self.graph).__name__}")
        if self.store not in STORES:
            raise HssError(f"HighSpeedSwapConfig.store must be one of {STORES}, got {self.store!r}")
        if self.direct not in (None, True, False):
            raise TypeError(f"HighSpeedSwapConfig.direct must be None, True or False, got {self.direct!r}")
        t = self.tile_blocks
        if not 1 <= t or 2 * t > self.resident_blocks:
            raise HssError(f"HighSpeedSwapConfig.stream_tile_blocks ({t}) must be in 1..resident_blocks // 2 "
                           f"({self.resident_blocks // 2}): the scratch holds the resident set plus two streamed "
                           "tiles; raise resident_blocks or lower stream_tile_blocks")

    @property
    def tile_blocks(self) -> int:
        """T: pages per streamed tile."""
        if self.stream_tile_blocks is None:
            return max(1, self.resident_blocks // 4)
        return self.stream_tile_blocks

    @property
    def resident_capacity(self) -> int:
        """Slots of the resident set: resident_blocks - 2*T."""
        return self.resident_blocks - 2 * self.tile_blocks

    def validate_and_prepare(self) -> Path:
        """:meth:`validate`, then create ``dir`` (mkdir -p); returns it. A ``dir`` (or a parent of it) that exists
        but is not a directory is an :class:`HssError` naming it."""
        self.validate()
        path = Path(self.dir)
        for p in (path, *path.parents):
            if p.exists():
                if not p.is_dir():
                    raise HssError(f"HighSpeedSwapConfig.dir {path}: {p} exists but is not a directory; pass a "
                                   "directory, or a path that does not exist yet")
                break
        path.mkdir(parents=True, exist_ok=True)
        return path


@dataclass(frozen=True)
class ModelDims:
    """The model shape the swap serves: ``num_layers``, ``max_blocks_per_layer`` (disk block ids per layer),
    q / kv heads, ``head_dim``, ``block_size`` tokens per page; ``model_fp`` an optional fingerprint."""

    num_layers: int
    max_blocks_per_layer: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    model_fp: str | None = None

    def __post_init__(self) -> None:
        _args.int_fields(self)      # numpy integers become Python ints; float, bool, str: TypeError naming the field

    def validate(self) -> None:
        limits = {"num_layers": 2**32 - 1, "max_blocks_per_layer": _I32_MAX, "num_q_heads": 65535,
                  "num_kv_heads": 65535, "head_dim": 256, "block_size": 65535}
        for f in dataclasses.fields(self):
            if f.name == "model_fp":
                continue
            v = getattr(self, f.name)      # an int: __post_init__ converted it
            if not 1 <= v <= limits[f.name]:
                raise HssError(f"ModelDims.{f.name} must be in 1..{limits[f.name]} (got {v})")
        if self.num_q_heads % self.num_kv_heads:
            raise HssError(f"ModelDims.num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                           f"({self.num_kv_heads})")
        if self.model_fp is not None and not isinstance(self.model_fp, str):
            raise TypeError(f"ModelDims.model_fp must be a str or None, got {type(self.model_fp).__name__}")


class DiskBlockAllocator:
    """Disk block ids 0..capacity-1 with reference counts (docs/design.md §8.4); an id names the same page in every
    layer.

    ``alloc`` pops the free list (LIFO) or takes the next never-used id (None when all are taken);
    ``inc_ref`` of a free id raises; ``dec_ref`` saturates at 0 and frees the id when it reaches 0
    (returning True then).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = _args.as_int("capacity", capacity)
        if self.capacity < 0:
            raise HssError(f"capacity must be >= 0 (got {self.capacity})")
        self.next_id = 0
        self.free: list[int] = []
        self.refs: list[int] = []

    def alloc(self) -> int | None:
        if self.free:
            i = self.free.pop()
        elif self.next_id < self.capacity:
            i = self.next_id
            self.next_id += 1
            self.refs.append(0)
        else:
            return None
        self.refs[i] = 1
        return i

    def _id(self, block: int) -> int:
        b = _args.as_int("block", block)
        if not 0 <= b < self.next_id:
            raise HssError(f"disk block id {b} was never allocated (ids so far: 0..{self.next_id - 1})")
        return b

    def refcount(self, block: int) -> int:
        return self.refs[self._id(block)]

    def inc_ref(self, block: int) -> None:
        b = self._id(block)
        if self.refs[b] == 0:
            raise HssError(f"inc_ref of disk block id {b}, which is free: allocate it first")
        self.refs[b] += 1

    def dec_ref(self, block: int) -> bool:
        b = self._id(block)
        if self.refs[b] == 0:
            return False               # saturates: already free
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free.append(b)
            return True
        return False

    @property
    def free_count(self) -> int:
        """Ids available: the free list plus the never-used tail."""
        return len(self.free) + self.capacity - self.next_id

    @property
    def active(self) -> int:
        """Ids in use: next_id - len(free) (saturating)."""
        return max(self.next_id - len(self.free), 0)


@dataclass(frozen=True)
class HighSpeedSwapDiagnostic:
    """``diagnostic_summary()``: the original's fields, then hss's counters (totals since construction).

    ``scratch_pool_resident`` keeps the original's meaning (the number of scratch slots, misnamed);
    ``resident_pages`` is the number of pages actually resident. Counters: ``hits`` (pages attended in
    place), ``misses`` (pages streamed from the store), ``bytes_read`` (store -> device), ``promotions``
    (streamed pages copied into the resident set), ``evictions`` (resident pages replaced),
    ``read_stall_ms`` (device time the attention stream waited for reads: of exact steps, and of sparse steps only
    where ``HighSpeedSwap.time_sparse_stalls`` is set), ``host_read_ms`` (host time in
    store reads: planning and checking a step's reads, issuing them, file I/O, bounce waits),
    ``score_wait_ms`` (host time blocked on the predictor scores event), ``sparse_steps`` (steps in the sparse
    mode, docs/design.md §17.6) and ``skipped`` (pages those steps did not attend; hits and misses count attended
    pages).
    """

    num_layers: int
    active_disk_blocks: int
    disk_block_capacity: int
    scratch_pool_resident: int
    scratch_pool_free: int
    resident_pages: int = 0
    resident_capacity: int = 0
    stream_tile_blocks: int = 0
    store: str = ""
    steps: int = 0
    tiles: int = 0
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    evictions: int = 0
    bytes_read: int = 0
    read_stall_ms: float = 0.0
    host_read_ms: float = 0.0
    score_wait_ms: float = 0.0
    sparse_steps: int = 0
    skipped: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0
