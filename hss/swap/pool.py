"""The HBM scratch pool (docs/design.md §7.4): :class:`ScratchPool`, page slots in one device buffer and who holds them.

A slot holds one KV page in the backing stores' page layout (:class:`~hss.swap.layout.GroupLayout`):
``[K|V][kv_head][stripe]``, stripes ``group_stride`` bytes apart (padded to 4 KiB), each bf16
``[block_size, head_dim]``. The tiled-attention strides come from
:meth:`TiledAttention.scratch_pool_strides(group_stride) <hss.attention.TiledAttention.scratch_pool_strides>`,
so padded stripes are addressed correctly (docs/design.md §7.4's latent assumption gs == block_size*head_dim*2 is gone).

Bookkeeping covers the first ``num_slots - reserved_slots`` slots: residents[slot] = (layer, page) or free (two
int arrays), a lookup table, and a FIFO free list (initially 0, 1, ...). :meth:`ScratchPool.put_many` places many
pages at once, vectorized (a decode step's promotions). The last ``reserved_slots`` slots are never
assigned: the orchestrator streams pages through them. Bookkeeping is host-only and immediate; the
device contents change only through copies the caller orders on its streams.

:attr:`ScratchPool.slot_table` and the ``*_planned`` calls are internal API of the swap step
(:mod:`hss.swap.step`): the checked calls' work, unchecked, for values the step planned from this pool's own state.
"""
from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._util import Closeable
from hss.errors import HssError, PoolExhausted
from hss.swap.layout import GroupLayout, K, V

__all__ = ["ScratchPool", "PoolExhausted"]

Key = tuple[int, int]   # (layer, page)


class ScratchPool(Closeable):
    """``num_slots`` page slots of ``layout`` in one device buffer (not zeroed), keys (layer, page).

    ``num_layers`` bounds the layer of a key (pages are bounded by ``layout.num_blocks``). ``ctx`` None
    allocates in the current device's primary context. ``close()`` frees the buffer once.
    """

    def __init__(self, layout: GroupLayout, num_slots: int, *, num_layers: int = 1, reserved_slots: int = 0,
                 ctx: cm.CudaCtx | None = None) -> None:
        if not isinstance(layout, GroupLayout):
            raise TypeError(f"layout must be a GroupLayout, not {type(layout).__name__}")
        n, r = _args.as_int("num_slots", num_slots), _args.as_int("reserved_slots", reserved_slots)
        nl = _args.as_int("num_layers", num_layers)
        if n < 1:
            raise HssError(f"num_slots must be >= 1 (got {n})")
        if not 0 <= r <= n:
            raise HssError(f"reserved_slots ({r}) must be in 0..num_slots ({n})")
        if nl < 1:
            raise HssError(f"num_layers must be >= 1 (got {nl})")
        self.layout, self.num_slots, self.reserved_slots, self.num_layers = layout, n, r, nl
        self.slot_bytes = layout.block_bytes
        self.buffer = cm.DeviceBuffer(n * self.slot_bytes, ctx)
        #: the slots' device addresses as a pointer table (internal API: the swap step's reads into slots)
        self.slot_table = cm.PointerTable(self.buffer.ptr, self.slot_bytes, n)
        self._slot_of = np.full((nl, layout.num_blocks), -1, dtype=np.int32)
        self._layer_of = np.full(n - r, -1, dtype=np.int64)      # residents[slot] = (layer, page); -1: free
        self._page_of = np.full(n - r, -1, dtype=np.int64)
        self._free: collections.deque[int] = collections.deque(range(n - r))

    # -- device addresses ------------------------------------------------------------------------
    @property
    def ptr(self) -> int:
        """Device address of slot 0."""
        return self.buffer.ptr

    @property
    def poolable_slots(self) -> int:
        """Slots the bookkeeping hands out: num_slots - reserved_slots."""
        return self.num_slots - self.reserved_slots

    @property
    def _slot_ptrs(self) -> cm.PointerTable:
        """:attr:`slot_table` under the name :mod:`hss.bench.swap` still uses."""
        return self.slot_table

    def slot_ptr(self, slot: int) -> int:
        """Device address of ``slot`` (any slot, reserved ones included)."""
        s = _args.as_int("slot", slot)
        if not 0 <= s < self.num_slots:
            raise HssError(f"slot {s} is out of range 0..{self.num_slots - 1}")
        return self.buffer.ptr + s * self.slot_bytes

    def stripe_ptr(self, slot: int, kind: int, kv_head: int) -> int:
        """Device address of the K (kind 0) or V (kind 1) stripe of ``kv_head`` in ``slot``."""
        kind, kv_head = _args.as_int("kind", kind), _args.as_int("kv_head", kv_head)
        if kind not in (K, V) or not 0 <= kv_head < self.layout.num_kv_heads:
            raise HssError(f"kind must be 0 (K) or 1 (V) and kv_head in 0..{self.layout.num_kv_heads - 1}")
        return self.slot_ptr(slot) + (kind * self.layout.num_kv_heads + kv_head) * self.layout.group_stride

    def attention_operands(self, attn: Any) -> tuple[int, int, int, int, int]:
        """(k_pool, v_pool, blk, tok, kvh) for ``attn.step_tile`` over these slots (``attn`` a TiledAttention)."""
        blk, tok, kvh, v_off = attn.scratch_pool_strides(self.layout.group_stride)
        return self.buffer.ptr, self.buffer.ptr + 2 * v_off, blk, tok, kvh

    # -- bookkeeping -----------------------------------------------------------------------------
    def _key(self, key: Any) -> Key:
        try:
            layer, page = key
        except (TypeError, ValueError):
            raise TypeError(f"a key is (layer, page), got {key!r}") from None
        layer, page = _args.as_int("key[0] (layer)", layer), _args.as_int("key[1] (page)", page)
        if not 0 <= layer < self.num_layers or not 0 <= page < self.layout.num_blocks:
            raise HssError(f"key (layer {layer}, page {page}) is out of range: layers 0..{self.num_layers - 1}, "
                           f"pages 0..{self.layout.num_blocks - 1}")
        return layer, page

    def lookup(self, key: Key) -> int | None:
        """The slot holding ``key``, or None."""
        layer, page = self._key(key)
        s = int(self._slot_of[layer, page])
        return s if s >= 0 else None

    def lookup_many(self, layer: int, pages: Any) -> np.ndarray:
        """Slots holding (layer, pages[i]) (int32; -1 where not resident)."""
        layer = _args.as_int("layer", layer)
        if not 0 <= layer < self.num_layers:
            raise HssError(f"layer {layer} is out of range 0..{self.num_layers - 1}")
        return self._slot_of[layer, self._ints("pages", pages, self.layout.num_blocks)]   # fancy indexing: a copy

    def lookup_planned(self, layer: int, pages: np.ndarray) -> np.ndarray:
        """:meth:`lookup_many` of values the caller checked (``layer`` in range; ``pages`` int64, in range). Internal
        API: the swap step's hit lookup."""
        return self._slot_of[layer].take(pages)     # (a row, then a 1-D take: a third of the 2-D fancy index's time)

    def key_of(self, slot: int) -> Key | None:
        """The (layer, page) that ``slot`` holds, or None (free)."""
        s = self._poolable(slot)
        layer = int(self._layer_of[s])
        return None if layer < 0 else (layer, int(self._page_of[s]))

    def keys_of(self, slots: Any) -> tuple[np.ndarray, np.ndarray]:
        """(layers, pages) held by each of ``slots`` (poolable slots, an int array): int64 arrays, -1 where free."""
        arr = self._ints("slots", slots, self.poolable_slots)
        return self._layer_of[arr], self._page_of[arr]

    def keys_planned(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`keys_of` without the checks, for poolable slots (int64) the caller computed. Internal API: the swap
        step's promotions (what each slot they take holds)."""
        return self._layer_of[slots], self._page_of[slots]

    def holds(self, slots: Any) -> np.ndarray:
        """Whether each of ``slots`` (poolable slots, an int array) holds a page (bool array)."""
        return self._layer_of[self._ints("slots", slots, self.poolable_slots)] >= 0

    def _poolable(self, slot: Any) -> int:
        s = _args.as_int("slot", slot)
        if not 0 <= s < self.poolable_slots:
            raise HssError(f"slot {s} is not a poolable slot (0..{self.poolable_slots - 1})")
        return s

    @staticmethod
    def _ints(name: str, values: Any, size: int) -> np.ndarray:
        """``values`` (an int sequence or array) as int64, each in 0..size-1."""
        arr = np.asarray(values)
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must be integers, got {arr.dtype}")
        arr = arr.astype(np.int64, copy=False).reshape(-1)
        if arr.size and arr.view(np.uint64).max() >= size:      # a negative value wraps to a huge one
            bad = arr[(arr < 0) | (arr >= size)]
            raise HssError(f"{name} {bad[:8].tolist()} are out of range 0..{size - 1}")
        return arr

    @staticmethod
    def _repeats(values: np.ndarray, size: int) -> bool:
        """Whether ``values`` (int64, each in 0..size-1) holds a value twice (a mark per value: no sort, no hash)."""
        seen = np.zeros(size, dtype=bool)
        seen[values] = True
        return int(np.count_nonzero(seen)) != values.size

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def resident_count(self) -> int:
        return self.poolable_slots - len(self._free)

    def free_slots(self) -> list[int]:
        """The free list, front (next to be assigned) first."""
        return list(self._free)

    def residents(self) -> dict[Key, int]:
        """{(layer, page): slot} of every resident page, by slot."""
        held = np.flatnonzero(self._layer_of >= 0)
        return dict(zip(zip(self._layer_of[held].tolist(), self._page_of[held].tolist()), held.tolist()))

    def assign(self, key: Key, candidates: Iterable[int] = ()) -> int:
        """The slot for ``key``: its own if resident; else the front of the free list; else the first of
        ``candidates`` (an eviction ranking) that holds a page, whose key is dropped. Raises
        :class:`PoolExhausted` when there is none."""
        key = self._key(key)
        s = int(self._slot_of[key])
        if s >= 0:
            return s
        if self._free:
            slot = self._free.popleft()
        else:
            for i, c in enumerate(candidates):
                c = _args.as_int(f"candidates[{i}]", c)
                if 0 <= c < self.poolable_slots and self._layer_of[c] >= 0:
                    slot = c
                    break
            else:
                raise PoolExhausted(
                    f"no slot available and no eviction candidate is resident: all {self.poolable_slots} slots "
                    "are taken and every candidate is pinned or free; raise HighSpeedSwapConfig.resident_blocks "
                    "(scratch slots) or pin fewer slots")
            self._drop(slot)
        self._set(key, slot)
        return slot

    def put(self, key: Key, slot: int) -> Key | None:
        """Place ``key`` in ``slot`` (free or resident); return the key it evicted, if any."""
        key, slot = self._key(key), self._poolable(slot)
        if self._slot_of[key] >= 0:
            raise HssError(f"{key} is already resident in slot {int(self._slot_of[key])}")
        old = self.key_of(slot)
        if old is None:
            if self._free and self._free[0] == slot:
                self._free.popleft()
            else:
                self._free.remove(slot)
        else:
            self._drop(slot)
        self._set(key, slot)
        return old

    def put_many(self, layer: int, pages: Any, slots: Any) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`put` of (layer, pages[i]) into slots[i] for every i, at once (vectorized): ``pages`` distinct and
        none resident, ``slots`` distinct poolable slots (free or resident). Returns the (layers, pages) each slot held
        before (int64 arrays, -1 where it was free). Everything is checked first; an error changes nothing."""
        layer = _args.as_int("layer", layer)
        if not 0 <= layer < self.num_layers:
            raise HssError(f"layer {layer} is out of range 0..{self.num_layers - 1}")
        pages = self._ints("pages", pages, self.layout.num_blocks)
        slots = self._ints("slots", slots, self.poolable_slots)
        if pages.size != slots.size:
            raise HssError(f"{pages.size} pages but {slots.size} slots")
        if not pages.size:
            return pages, pages
        if self._repeats(pages, self.layout.num_blocks) or self._repeats(slots, self.poolable_slots):
            raise HssError("put_many: pages and slots must each be distinct")
        if self._slot_of[layer, pages].max() >= 0:
            bad = pages[self._slot_of[layer, pages] >= 0]
            raise HssError(f"pages {bad[:8].tolist()} of layer {layer} are already resident")
        old_layer, old_page = self._layer_of[slots], self._page_of[slots]
        self.put_planned(layer, pages, slots, old_layer, old_page)
        return old_layer, old_page

    def put_planned(self, layer: int, pages: np.ndarray, slots: np.ndarray, old_layer: np.ndarray,
                     old_page: np.ndarray) -> int:
        """:meth:`put_many` without its checks, for a placement the caller planned from this pool's own state:
        ``pages`` (int64) distinct and not resident in ``layer``, ``slots`` (int64) distinct poolable slots holding
        (``old_layer``, ``old_page``) now (-1 where free). Returns how many pages it evicted. Internal API: the swap
        step's promotions, placed at once."""
        held = old_layer >= 0
        evicted = int(np.count_nonzero(held))
        if evicted != held.size:
            self._take_free(slots[~held])
            self._slot_of[old_layer[held], old_page[held]] = -1
        else:
            self._slot_of[old_layer, old_page] = -1
        self._slot_of[layer, pages] = slots
        self._layer_of[slots] = layer
        self._page_of[slots] = pages
        return evicted

    def _take_free(self, slots: np.ndarray) -> None:
        """Remove ``slots`` (free ones, distinct) from the free list, keeping the others' order."""
        k = int(slots.size)
        free = self._free
        if sorted(itertools.islice(free, k)) == sorted(slots.tolist()):     # the usual case: the front of the list
            self._free = collections.deque(itertools.islice(free, k, None))
        else:
            gone = set(slots.tolist())
            self._free = collections.deque(s for s in free if s not in gone)

    def invalidate_slots(self, slots: Any) -> None:
        """:meth:`invalidate` the page held by each of ``slots`` (poolable slots; free ones are skipped), in order."""
        arr = self._ints("slots", slots, self.poolable_slots)
        for s in arr[self._layer_of[arr] >= 0].tolist():    # failure path only
            self._drop(s)
            self._free.append(s)

    def invalidate(self, key: Key) -> int | None:
        """Forget ``key``; its slot goes to the BACK of the free list. Returns the slot, or None."""
        key = self._key(key)
        s = int(self._slot_of[key])
        if s < 0:
            return None
        self._drop(s)
        self._free.append(s)
        return s

    def invalidate_page(self, page: int) -> list[int]:
        """:meth:`invalidate` ``page`` in every layer (a disk block id was freed); returns the freed slots."""
        page = _args.as_int("page", page)
        if not 0 <= page < self.layout.num_blocks:
            raise HssError(f"page {page} is out of range 0..{self.layout.num_blocks - 1}")
        slots = []
        for layer in range(self.num_layers):
            s = self.invalidate((layer, page))
            if s is not None:
                slots.append(s)
        return slots

    def clear(self) -> None:
        """Everything free, in order 0..n-1."""
        self._slot_of.fill(-1)
        self._layer_of.fill(-1)
        self._page_of.fill(-1)
        self._free = collections.deque(range(self.poolable_slots))

    def _set(self, key: Key, slot: int) -> None:
        self._slot_of[key] = slot
        self._layer_of[slot], self._page_of[slot] = key

    def _drop(self, slot: int) -> None:
        layer = self._layer_of[slot]
        if layer >= 0:
            self._slot_of[layer, self._page_of[slot]] = -1
            self._layer_of[slot] = self._page_of[slot] = -1

    # -- lifetime --------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.buffer.closed

    def close(self) -> None:
        """Free the device buffer (the driver waits for work using it); later calls do nothing."""
        self.buffer.close()

    def __repr__(self) -> str:
        return (f"ScratchPool({self.num_slots} slots of {self.slot_bytes} bytes, {self.reserved_slots} reserved, "
                f"{self.resident_count} resident, {self.free_count} free)")
