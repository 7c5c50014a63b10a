"""Where a KV page lives in a backing store and in a scratch slot (docs/design.md §7.1): :class:`GroupLayout`.

A *group* is one (layer, page, kind, kv_head) stripe, kind K = 0 or V = 1: bf16 ``[block_size, head_dim]``,
``group_bytes`` long, stored ``group_stride`` bytes apart (rounded up to the filesystem block, 4 KiB, so
every group and every page is O_DIRECT-aligned). A page is ``block_bytes = 2 * num_kv_heads *
group_stride``: all K stripes (kv_head ascending) then all V stripes. A layer file is ``num_blocks`` pages
back to back; a scratch slot holds one page in the same layout. Pure arithmetic: no device, no files.
:func:`host_bytes` reads a host page argument (the argument layer's host-buffer rules).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from hss import _args
from hss import cuda_min as cm
from hss._util import ceil_div
from hss.errors import HssError

__all__ = ["GroupLayout", "K", "V", "KIND_NAMES", "host_bytes"]

K, V = 0, 1
KIND_NAMES = ("K", "V")


def _round_up(n: int, to: int) -> int:
    return ceil_div(n, to) * to


def host_bytes(name: str, data: Any) -> np.ndarray:
    """The bytes of host argument ``name`` as a flat uint8 array (a view where ``data`` allows one): a numpy array
    (C-contiguous), a bytes-like object or a :class:`~hss.cuda_min.PinnedBuffer`, by the argument layer's
    host-buffer rules (device memory and closed buffers: :class:`HssError`; anything else: ``TypeError``).
    The caller checks the size."""
    if isinstance(data, (int, np.integer)) and not isinstance(data, (bool, np.bool_)):
        raise TypeError(f"{name} must be host data (a numpy array, a bytes-like object or a PinnedBuffer), not an "
                        "address: its bytes are read on the host")
    _args.host_buffer(data, 0, False, name)
    if isinstance(data, np.ndarray):
        if data.dtype.hasobject:
            raise TypeError(f"{name} holds Python objects ({data.dtype}); pass a numeric array")
        return data.reshape(-1).view(np.uint8)
    if isinstance(data, cm.PinnedBuffer):
        return data.array
    return np.frombuffer(data, dtype=np.uint8)


@dataclass(frozen=True)
class GroupLayout:
    """Byte layout of the pages of one layer (docs/design.md §7.1).

    ``num_blocks`` pages per layer, ``num_kv_heads``, ``block_size`` tokens per page, ``head_dim``,
    ``elem_bytes`` per element (2: bf16), ``fs_block_size`` the alignment of every group (4096).
    """

    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    elem_bytes: int = 2
    fs_block_size: int = 4096

    def __post_init__(self) -> None:
        _args.int_fields(self)      # numpy integers become Python ints (no int32 wrap in the sizes); else TypeError
        for name in ("num_blocks", "num_kv_heads", "block_size", "head_dim", "elem_bytes", "fs_block_size"):
            if getattr(self, name) < 1:
                raise HssError(f"GroupLayout.{name} must be >= 1 (got {getattr(self, name)})")
        fs = self.fs_block_size
        if fs & (fs - 1):
            raise HssError(f"GroupLayout.fs_block_size ({fs}) must be a power of two")

    # -- sizes (made once: the swap's hot loops read them every step) -----------------------------
    @functools.cached_property
    def group_bytes(self) -> int:
        """Bytes of one stripe's data: block_size * head_dim * elem_bytes."""
        return self.block_size * self.head_dim * self.elem_bytes

    @functools.cached_property
    def group_stride(self) -> int:
        """Bytes between consecutive stripes: group_bytes rounded up to fs_block_size."""
        return _round_up(self.group_bytes, self.fs_block_size)

    @functools.cached_property
    def block_bytes(self) -> int:
        """Bytes of one page (all K then all V stripes): 2 * num_kv_heads * group_stride."""
        return 2 * self.num_kv_heads * self.group_stride

    @functools.cached_property
    def bytes_per_layer(self) -> int:
        """Bytes of one layer file: 2 * num_blocks * num_kv_heads * group_stride."""
        return self.num_blocks * self.block_bytes

    @property
    def groups_per_layer(self) -> int:
        return self.num_blocks * 2 * self.num_kv_heads

    # -- addresses -----------------------------------------------------------------------------
    def _check(self, page: int, kind: int, kv_head: int) -> tuple[int, int, int]:
        page, kind, kv_head = _args.as_int("page", page), _args.as_int("kind", kind), _args.as_int("kv_head", kv_head)
        if not 0 <= page < self.num_blocks:
            raise HssError(f"page {page} is out of range: a layer has {self.num_blocks} pages "
                           f"(0..{self.num_blocks - 1})")
        if kind not in (K, V):
            raise HssError(f"kind {kind} must be 0 (K) or 1 (V)")
        if not 0 <= kv_head < self.num_kv_heads:
            raise HssError(f"kv_head {kv_head} is out of range 0..{self.num_kv_heads - 1}")
        return page, kind, kv_head

    def page_offset(self, page: int) -> int:
        """Byte offset of ``page`` inside its layer file."""
        return self._check(page, K, 0)[0] * self.block_bytes

    def group_offset(self, page: int, kind: int, kv_head: int) -> int:
        """Byte offset of group (page, kind, kv_head) inside its layer file:
        page*(2*nkv*gs) + kind*(nkv*gs) + kv_head*gs."""
        page, kind, kv_head = self._check(page, kind, kv_head)
        gs = self.group_stride
        return page * self.block_bytes + kind * self.num_kv_heads * gs + kv_head * gs

    def group_id(self, layer: int, page: int, kind: int, kv_head: int) -> int:
        """Dense id: layer*groups_per_layer + page*(2*nkv) + kind*nkv + kv_head."""
        layer = _args.as_int("layer", layer)
        if layer < 0:
            raise HssError(f"layer must be >= 0 (got {layer})")
        page, kind, kv_head = self._check(page, kind, kv_head)
        nkv = self.num_kv_heads
        return layer * self.groups_per_layer + page * 2 * nkv + kind * nkv + kv_head

    def locate(self, offset_in_page: int) -> tuple[int, int]:
        """(kind, kv_head) of the group holding byte ``offset_in_page`` of a page."""
        g = _args.as_int("offset_in_page", offset_in_page) // self.group_stride
        if not 0 <= g < 2 * self.num_kv_heads:
            raise HssError(f"offset {offset_in_page} is outside a {self.block_bytes}-byte page")
        return g // self.num_kv_heads, g % self.num_kv_heads

    # -- page images ---------------------------------------------------------------------------
    def _tokens(self, name: str, data: Any) -> np.ndarray:
        want = self.block_size * self.num_kv_heads * self.head_dim * 2
        raw = host_bytes(name, data)
        if raw.nbytes != want:
            raise HssError(f"{name} holds {raw.nbytes} bytes but one page is block_size*num_kv_heads*head_dim "
                           f"bf16 = {self.block_size}*{self.num_kv_heads}*{self.head_dim}*2 = {want} bytes "
                           "([tok, kv_head, dim])")
        self._page_form(name, data)
        return raw.view(np.uint16).reshape(self.block_size, self.num_kv_heads, self.head_dim)

    def _page_form(self, name: str, data: Any) -> None:
        """A host page that carries a dtype or a shape must say bf16 NHD: ``[block_size, num_kv_heads, head_dim]``
        of bf16 (or its bits as uint16). Raw bytes (uint8, bytes-like, a PinnedBuffer) and 1-D arrays of 16-bit
        elements carry no layout and are taken as NHD bf16 as they are."""
        dtype = getattr(data, "dtype", None)
        shape = getattr(data, "shape", None)
        if dtype is None or isinstance(data, (memoryview, cm.PinnedBuffer)):
            return
        try:
            kind = _args.dtype_name(dtype)
        except TypeError:
            kind = str(dtype)
        nhd = (self.block_size, self.num_kv_heads, self.head_dim)
        if kind == "u8":
            return
        if kind not in ("bf16", "u16"):
            raise HssError(f"{name} holds {kind} but a KV page is bf16 {list(nhd)} [tok, kv_head, dim]: convert it "
                           "(.astype(ml_dtypes.bfloat16)), or pass its raw bf16 bytes as uint8")
        shape = tuple(int(d) for d in shape) if shape is not None else ()
        if len(shape) > 1 and shape != nhd:
            raise HssError(f"{name} has shape {list(shape)} but a KV page is NHD [block_size, num_kv_heads, head_dim] "
                           f"= {list(nhd)} bf16 ([tok, kv_head, dim]; an HND page [kv_head, tok, dim] must be "
                           "transposed first)")

    def pack_page(self, k: Any, v: Any) -> np.ndarray:
        """The page image (uint8 ``[block_bytes]``, padding zero) of host K and V ``[block_size, nkv, hd]`` bf16.

        Typed pages must be bf16 (or uint16 bits) of exactly that NHD shape; raw bytes and flat 16-bit arrays are
        taken as NHD bf16."""
        if self.elem_bytes != 2:
            raise HssError(f"pack_page needs 2-byte (bf16) elements; this layout has elem_bytes {self.elem_bytes}")
        kt, vt = self._tokens("k_host", k), self._tokens("v_host", v)
        n = self.block_size * self.head_dim
        img = np.zeros((2, self.num_kv_heads, self.group_stride // 2), dtype=np.uint16)
        img[K, :, :n] = kt.transpose(1, 0, 2).reshape(self.num_kv_heads, n)
        img[V, :, :n] = vt.transpose(1, 0, 2).reshape(self.num_kv_heads, n)
        return img.reshape(-1).view(np.uint8)

    def unpack_page(self, image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Host K and V ``[block_size, nkv, hd]`` bf16 of a page image (the inverse of :meth:`pack_page`)."""
        raw = host_bytes("image", image)
        if raw.nbytes != self.block_bytes:
            raise HssError(f"a page image is {self.block_bytes} bytes, got {raw.nbytes}")
        n = self.block_size * self.head_dim
        img = raw.view(np.uint16).reshape(2, self.num_kv_heads, self.group_stride // 2)[:, :, :n]
        kv = img.reshape(2, self.num_kv_heads, self.block_size, self.head_dim).transpose(0, 2, 1, 3)
        kv = np.ascontiguousarray(kv).view(ml_dtypes.bfloat16)
        return kv[K], kv[V]
