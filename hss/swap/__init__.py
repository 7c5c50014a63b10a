"""High-speed swap: scratch pool, predictor-driven eviction, backing stores, streamed exact attention (docs/design.md
§7-§8).

Modules: :mod:`~hss.swap.layout` (GroupLayout: where a page's stripes live), :mod:`~hss.swap.eviction`
(EvictionPolicy), :mod:`~hss.swap.pool` (ScratchPool), :mod:`~hss.swap.backing` (BackingStore, PreparedReads: the
store interface), :mod:`~hss.swap.stores` (HostStore; the store names), :mod:`~hss.swap.file_store` (FileStore),
:mod:`~hss.swap.gather` (the HostStore's page_gather launches from its mapped pinned buffer, and its read fences),
:mod:`~hss.swap.config` (HighSpeedSwapConfig, ModelDims, DiskBlockAllocator, HighSpeedSwapDiagnostic),
:mod:`~hss.swap.orchestrator` (HighSpeedSwap: a resident set attended in place plus a double-buffered stream
of the other pages, reads overlapping attention through CUDA events on a copy stream), :mod:`~hss.swap.step`
(SwapStep and StepRecord: one step, plan -> issue -> settle), :mod:`~hss.swap.plans` (its exact and sparse plans),
:mod:`~hss.swap.promotion` (which misses enter the resident set), :mod:`~hss.swap.stall` (read-stall timers),
:mod:`~hss.swap.sparse` (the sparse mode's page choice, docs/design.md §17.6), :mod:`~hss.swap.tp` (kv heads split
across devices), :mod:`~hss.swap.device_step` (the sparse step on the device).
"""
from hss.swap.config import DiskBlockAllocator, HighSpeedSwapConfig, HighSpeedSwapDiagnostic, ModelDims
from hss.swap.eviction import EvictionPolicy
from hss.swap.layout import KIND_NAMES, GroupLayout, K, V
from hss.swap.orchestrator import HighSpeedSwap
from hss.swap.pool import PoolExhausted, ScratchPool
from hss.swap.sparse import SparseBudget, select_pages, sparse_budget
from hss.swap.step import StepRecord, TileRecord
from hss.swap.stores import BackingStore, FileStore, HostStore, PreparedReads, StoreError, StoreIOError, layer_path
from hss.swap.tp import KvHeadShard, shard_kv_heads

__all__ = [
    "GroupLayout", "K", "V", "KIND_NAMES", "EvictionPolicy", "ScratchPool", "PoolExhausted", "BackingStore",
    "HostStore", "FileStore", "PreparedReads", "StoreError", "StoreIOError", "layer_path", "HighSpeedSwapConfig",
    "ModelDims", "DiskBlockAllocator", "HighSpeedSwapDiagnostic", "HighSpeedSwap", "StepRecord", "TileRecord",
    "SparseBudget", "select_pages", "sparse_budget", "KvHeadShard", "shard_kv_heads",
]
