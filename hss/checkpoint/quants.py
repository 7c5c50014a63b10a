"""GGML tensor types: their block layouts (:data:`GGML_TYPES`) and dequantisation to float32 (:func:`dequantize`).

A GGML tensor is a run of blocks along its fastest axis; a block of ``block`` elements takes ``nbytes`` bytes.
Every decoder here repeats the arithmetic of the ``gguf`` package (``gguf.quants``), in the same order and in float32,
so the two give the same bits (the tests compare them). Scales are little-endian IEEE half floats.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hss.errors import HssError

__all__ = ["GgmlType", "GGML_TYPES", "GGML_TYPE_NAMES", "type_name", "dequantize"]

QK_K = 256   # elements of a K-quant super-block


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 scale at byte ``start`` of each block, as float32 ``[n_blocks, 1]``."""
    return blocks[:, start:start + 2].copy().view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Low nibbles of each ``group`` bytes, then their high nibbles: ``[n_blocks, 2 * qs.shape[1]]`` uint8."""
    n = qs.shape[0]
    shifted = qs.reshape(n, -1, 1, group) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (shifted & np.uint8(0x0F)).reshape(n, -1)


def _f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.copy().view("<f4").astype(np.float32).reshape(-1)


def _f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.copy().view("<f2").astype(np.float32).reshape(-1)


def _bf16(blocks: np.ndarray) -> np.ndarray:
    return (blocks.copy().view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(-1)


# In place where the arithmetic allows (the same roundings, fewer temporaries).
def _q8_0(blocks: np.ndarray) -> np.ndarray:
    x = blocks[:, 2:].view(np.int8).astype(np.float32)
    x *= _half(blocks, 0)
    return x


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    q = (_nibbles(blocks[:, 2:], 16).astype(np.int8) - np.int8(8)).astype(np.float32)
    q *= _half(blocks, 0)
    return q


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 4:], 16).astype(np.float32)
    q *= _half(blocks, 0)
    q += _half(blocks, 2)
    return q


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Bit ``i`` of each block's little-endian u32 ``qh``, for i in 0..31: ``[n_blocks, 32]`` uint8."""
    word = qh.copy().view("<u4").astype(np.uint32).reshape(-1, 1)
    return ((word >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & np.uint32(1)).astype(np.uint8)


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    q = (_nibbles(blocks[:, 6:], 16) | (_fifth_bits(blocks[:, 2:6]) << np.uint8(4))).astype(np.int8) - np.int8(16)
    return _half(blocks, 0) * q.astype(np.float32)


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    q = (_nibbles(blocks[:, 8:], 16) | (_fifth_bits(blocks[:, 4:8]) << np.uint8(4))).astype(np.float32)
    return (_half(blocks, 0) * q) + _half(blocks, 2)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins packed in 12 bytes (Q4_K, Q5_K): two ``[n_blocks, 8]`` uint8 arrays."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def _k_affine(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``d * scale * q - dmin * min`` per 32-element sub-block of a Q4_K / Q5_K super-block."""
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (_half(blocks, 0) * sc.astype(np.float32)).reshape(n, -1, 1)
    dm = (_half(blocks, 2) * mn.astype(np.float32)).reshape(n, -1, 1)
    return (d * q - dm).reshape(n, QK_K)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    return _k_affine(blocks, _nibbles(blocks[:, 16:], 32).reshape(n, -1, 32).astype(np.float32))


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, 48:], 32).reshape(n, -1, 32)
    qh = blocks[:, 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    qh = (qh & np.uint8(0x01)).reshape(n, -1, 32)
    return _k_affine(blocks, (ql | (qh << np.uint8(4))).astype(np.float32))


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, :128], 64).reshape(n, -1, 32)
    qh = blocks[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(n, -1, 32)
    q = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, QK_K // 16, -1).astype(np.float32)
    d = (_half(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)).reshape(n, QK_K // 16, 1)
    return (d * q).reshape(n, QK_K)


@dataclass(frozen=True)
class GgmlType:
    """One GGML tensor type: ``block`` elements in ``nbytes`` bytes; ``decode`` (None: not readable here) maps
    ``[n_blocks, nbytes]`` uint8 to float32 values ``[n_blocks, block]`` (or flat)."""

    name: str
    block: int
    nbytes: int
    decode: Callable[[np.ndarray], np.ndarray] | None = None


# ggml's enum ggml_type; types without a decoder are listed so that errors can name them.
GGML_TYPES: dict[int, GgmlType] = {
    0: GgmlType("F32", 1, 4, _f32), 1: GgmlType("F16", 1, 2, _f16), 2: GgmlType("Q4_0", 32, 18, _q4_0),
    3: GgmlType("Q4_1", 32, 20, _q4_1), 6: GgmlType("Q5_0", 32, 22, _q5_0), 7: GgmlType("Q5_1", 32, 24, _q5_1),
    8: GgmlType("Q8_0", 32, 34, _q8_0), 9: GgmlType("Q8_1", 32, 36), 10: GgmlType("Q2_K", 256, 84),
    11: GgmlType("Q3_K", 256, 110), 12: GgmlType("Q4_K", 256, 144, _q4_k), 13: GgmlType("Q5_K", 256, 176, _q5_k),
    14: GgmlType("Q6_K", 256, 210, _q6_k), 15: GgmlType("Q8_K", 256, 292), 16: GgmlType("IQ2_XXS", 256, 66),
    17: GgmlType("IQ2_XS", 256, 74), 18: GgmlType("IQ3_XXS", 256, 98), 19: GgmlType("IQ1_S", 256, 50),
    20: GgmlType("IQ4_NL", 32, 18), 21: GgmlType("IQ3_S", 256, 110), 22: GgmlType("IQ2_S", 256, 82),
    23: GgmlType("IQ4_XS", 256, 136), 24: GgmlType("I8", 1, 1), 25: GgmlType("I16", 1, 2),
    26: GgmlType("I32", 1, 4), 27: GgmlType("I64", 1, 8), 28: GgmlType("F64", 1, 8), 29: GgmlType("IQ1_M", 256, 56),
    30: GgmlType("BF16", 1, 2, _bf16), 34: GgmlType("TQ1_0", 256, 54), 35: GgmlType("TQ2_0", 256, 66),
}
GGML_TYPE_NAMES = {t.name: i for i, t in GGML_TYPES.items()}
READABLE = ", ".join(t.name for t in GGML_TYPES.values() if t.decode is not None)


def type_name(type_id: int) -> str:
    """``Q4_1`` for 3; ``type 99`` for an id ggml does not define."""
    t = GGML_TYPES.get(type_id)
    return t.name if t is not None else f"type {type_id}"


def dequantize(raw: np.ndarray, type_id: int, n_elements: int) -> np.ndarray:
    """Float32 values ``[n_elements]`` of the GGML ``type_id`` data ``raw`` (uint8, exactly the tensor's bytes)."""
    t = GGML_TYPES.get(type_id)
    if t is None or t.decode is None:
        raise HssError(f"tensors of {type_name(type_id)} cannot be read (readable: {READABLE})")
    if n_elements % t.block or raw.size != n_elements // t.block * t.nbytes:
        raise HssError(f"{n_elements} {t.name} elements do not fill {raw.size} bytes of {t.block}-element blocks")
    out = t.decode(raw.reshape(-1, t.nbytes)).reshape(-1)
    return out if out.dtype == np.float32 else out.astype(np.float32)
