"""The predictor's random projection matrix P (docs/design.md §2), bit-exact with the Rust original.

P is a plain scaled Gaussian `[head_dim, r]` bf16 matrix (no orthogonalisation). The original drew it
with `ChaCha8Rng::seed_from_u64(seed)` and rand_distr's Ziggurat `StandardNormal`; this module replays
that exact draw sequence with numpy: the ChaCha8 keystream is generated many blocks at a time, the
Ziggurat's fast path is evaluated for every draw at once, and the rare slow paths (wedge test, tail)
are walked in order so that every sample consumes exactly the draws it consumed in Rust.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from hss import _args
from hss._util import ceil_div

__all__ = ["PredictorShape", "build_projection", "fnv1a64_bf16"]

_U64_MASK = (1 << 64) - 1
_MIN_BLOCKS = 64  # smallest keystream batch (ChaCha blocks of 8 u64 draws)
_HEAD_DIM_MAX = 256
_R_MAX = 128


@dataclass(frozen=True)
class PredictorShape:
    """Projection shape: `head_dim` (rows of P, 1..256) and `r` (low-rank width, 1..128)."""

    head_dim: int
    r: int

    def __post_init__(self) -> None:
        _args.int_fields(self)   # numpy integers become Python ints; float, bool, str: TypeError naming the field
        for name, hi in (("head_dim", _HEAD_DIM_MAX), ("r", _R_MAX)):
            v = getattr(self, name)
            if v <= 0:
                raise ValueError(f"{name} must be > 0 (got {v})")
            if v > hi:
                raise ValueError(f"{name} must be <= {hi} (got {v})")


# ---------------------------------------------------------------------------------------------
# rand_core seed_from_u64 and ChaCha8 (rand_chacha ChaCha8Rng: 64-bit counter, stream 0)
# ---------------------------------------------------------------------------------------------

_CHACHA_CONST = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)


def _pcg32_key(seed: int) -> list[int]:
    """Expand a u64 seed into 8 u32 key words the way rand_core's `seed_from_u64` does (PCG32 XSH-RR)."""
    state = seed
    words = []
    for _ in range(8):
        state = (state * 6364136223846793005 + 11634580027462260723) & _U64_MASK
        xorshifted = (((state >> 18) ^ state) >> 27) & 0xFFFFFFFF
        rot = state >> 59
        words.append(((xorshifted >> rot) | (xorshifted << ((32 - rot) & 31))) & 0xFFFFFFFF)
    return words


def _chacha8_u64(key: list[int], first_block: int, n_blocks: int) -> np.ndarray:
    """ChaCha8 keystream blocks `first_block ..` as u64 draws (low word first), shape [n_blocks * 8]."""
    counter = np.arange(first_block, first_block + n_blocks, dtype=np.uint64)
    inp = [np.full(n_blocks, c, np.uint32) for c in _CHACHA_CONST]
    inp += [np.full(n_blocks, k, np.uint32) for k in key]
    inp += [(counter & np.uint64(0xFFFFFFFF)).astype(np.uint32), (counter >> np.uint64(32)).astype(np.uint32)]
    inp += [np.zeros(n_blocks, np.uint32), np.zeros(n_blocks, np.uint32)]
    s = [w.copy() for w in inp]

    def qr(a: int, b: int, c: int, d: int) -> None:
        for x, y, z, n in ((a, b, d, 16), (c, d, b, 12), (a, b, d, 8), (c, d, b, 7)):
            s[x] += s[y]
            t = s[z] ^ s[x]
            s[z] = (t << np.uint32(n)) | (t >> np.uint32(32 - n))

    for _ in range(4):  # 8 rounds = 4 double rounds
        qr(0, 4, 8, 12), qr(1, 5, 9, 13), qr(2, 6, 10, 14), qr(3, 7, 11, 15)
        qr(0, 5, 10, 15), qr(1, 6, 11, 12), qr(2, 7, 8, 13), qr(3, 4, 9, 14)
    words = np.stack([s[j] + inp[j] for j in range(16)], axis=1)  # [n_blocks, 16]
    return (words[:, 0::2].astype(np.uint64) | (words[:, 1::2].astype(np.uint64) << np.uint64(32))).ravel()


# ---------------------------------------------------------------------------------------------
# rand_distr Ziggurat tables (Doornik's ZIGNOR construction, 256 boxes)
# ---------------------------------------------------------------------------------------------

_ZIG_R = 3.6541528853610088
_ZIG_V = 0.00492867323399


def _zig_tables() -> tuple[np.ndarray, np.ndarray]:
    """X and F (257 entries each) as in rand_distr, including its three off-by-one-ulp F literals."""
    f = lambda x: math.exp(-x * x / 2.0)  # noqa: E731
    x = [0.0] * 257
    x[0] = _ZIG_V / f(_ZIG_R)
    x[1] = _ZIG_R
    for i in range(2, 256):
        x[i] = math.sqrt(-2.0 * math.log(_ZIG_V / x[i - 1] + f(x[i - 1])))
    fx = [f(v) for v in x]
    fx[0], fx[3], fx[94] = 0.000477467764586655, 0.004037972593371872, 0.2064054063986793
    return np.array(x, np.float64), np.array(fx, np.float64)


_ZIG_X, _ZIG_F = _zig_tables()
_XL, _FL = _ZIG_X.tolist(), _ZIG_F.tolist()


def _u64_to_f64(bits: int) -> float:
    """Reinterpret a u64 bit pattern as an IEEE double."""
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _attempt(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ziggurat first step for every draw: candidate x = u * X[i] and whether it is a fast accept."""
    i = (bits & np.uint64(0xFF)).astype(np.intp)
    u = ((bits >> np.uint64(12)) | np.uint64(0x400 << 52)).view(np.float64) - 3.0  # [2,4) - 3
    x = u * _ZIG_X[i]
    return x, np.abs(x) < _ZIG_X[i + 1]


class _Draws:
    """The u64 draw stream of one ChaCha8Rng, extended lazily in large batches.

    Alongside the raw draws it keeps each draw's fast-path candidate `x` and accept flag, valid for
    draws that start a Ziggurat attempt (the others are simply never looked at as such).
    """

    def __init__(self, seed: int, n_hint: int) -> None:
        self.key = _pcg32_key(seed)
        self.blocks = 0
        self.bits = np.empty(0, np.uint64)
        self.x = np.empty(0, np.float64)
        self.ok = np.empty(0, bool)
        self.fail = np.empty(0, np.intp)  # positions whose fast path rejects
        self.extend(n_hint)

    def extend(self, n_draws: int) -> None:
        """Append at least `n_draws` more draws (whole ChaCha blocks)."""
        n_blocks = max(_MIN_BLOCKS, ceil_div(n_draws, 8))
        new = _chacha8_u64(self.key, self.blocks, n_blocks)
        x, ok = _attempt(new)
        self.fail = np.concatenate([self.fail, np.flatnonzero(~ok) + self.bits.size])
        self.bits = np.concatenate([self.bits, new])
        self.x = np.concatenate([self.x, x])
        self.ok = np.concatenate([self.ok, ok])
        self.blocks += n_blocks

    def u64(self, p: int) -> int:
        """Draw number `p` as a Python int."""
        while p >= self.bits.size:
            self.extend(self.bits.size // 16 + 8)
        return int(self.bits[p])


def _slow_sample(d: _Draws, p: int) -> tuple[float, int]:
    """Finish one sample whose first attempt (draw `p`) failed the fast path; return (x, next p).

    Sequential and scalar, exactly rand_distr's loop: wedge test (one extra draw), tail (two draws
    per iteration), and fresh attempts after a wedge rejection.
    """
    while True:
        bits = d.u64(p)
        p += 1
        i = bits & 0xFF
        u = _u64_to_f64((bits >> 12) | (0x400 << 52)) - 3.0
        x = u * _XL[i]
        if abs(x) < _XL[i + 1]:
            return x, p
        if i == 0:  # tail beyond R
            tx, ty = 1.0, 0.0
            while -2.0 * ty < tx * tx:
                u1 = _u64_to_f64((d.u64(p) >> 12) | (0x3FF << 52)) - (1.0 - 2.0**-53)
                u2 = _u64_to_f64((d.u64(p + 1) >> 12) | (0x3FF << 52)) - (1.0 - 2.0**-53)
                p += 2
                tx, ty = math.log(u1) / _ZIG_R, math.log(u2)
            return (tx - _ZIG_R if u < 0.0 else _ZIG_R - tx), p
        unif = (d.u64(p) >> 11) * 2.0**-53
        p += 1
        if _FL[i + 1] + (_FL[i] - _FL[i + 1]) * unif < math.exp(-x * x / 2.0):
            return x, p


def _draw_hint(n: int) -> int:
    """Draws to generate up front for n samples: ~1.5% of attempts take extra draws, so 6% spare is ample."""
    return n + n // 16 + 64


def _standard_normals(seed: int, n: int) -> np.ndarray:
    """The first `n` rand_distr StandardNormal f64 samples of `ChaCha8Rng::seed_from_u64(seed)`."""
    d = _Draws(seed, _draw_hint(n))
    parts: list[np.ndarray] = []
    done, p = 0, 0
    while done < n:
        if p >= d.bits.size:
            d.extend(n - done + 64)
        k = int(np.searchsorted(d.fail, p))
        q = int(d.fail[k]) if k < d.fail.size else d.bits.size  # next fast-path failure at or after p
        take = min(q - p, n - done)
        if take:
            parts.append(d.x[p : p + take])
            done, p = done + take, p + take
        elif q < d.bits.size:
            x, p = _slow_sample(d, p)
            parts.append(np.array([x]))
            done += 1
    return np.concatenate(parts) if parts else np.empty(0, np.float64)


def build_projection(shape: PredictorShape, seed: int) -> np.ndarray:
    """Build P, the predictor's random projection, bit-exact with the Rust original.

    shape: the `PredictorShape(head_dim, r)`; seed: u64, used verbatim.
    Returns a C-contiguous `[head_dim, r]` `ml_dtypes.bfloat16` array; element (i, o) is sample
    `i * r + o` of StandardNormal (f64 -> f32) times f32(1 / sqrt(f32(head_dim))), rounded to bf16 (RNE).
    """
    if not isinstance(shape, PredictorShape):
        raise TypeError(f"shape must be a PredictorShape (got {type(shape).__name__})")
    seed = _args.as_int("seed", seed)
    if not 0 <= seed <= _U64_MASK:
        raise ValueError(f"seed must be in [0, 2**64) (got {seed})")
    n = shape.head_dim * shape.r
    inv_sqrt_d = np.float32(1.0) / np.sqrt(np.float32(shape.head_dim))
    samples = _standard_normals(seed, n).astype(np.float32) * inv_sqrt_d
    return samples.astype(ml_dtypes.bfloat16).reshape(shape.head_dim, shape.r)


def fnv1a64_bf16(p: np.ndarray) -> int:
    """FNV-1a-64 over the u16 bit patterns of a bf16 array in C order (one XOR of the whole u16 per step)."""
    arr = np.ascontiguousarray(p)
    if arr.dtype != ml_dtypes.bfloat16:
        raise TypeError(f"p must be a bfloat16 array (got {arr.dtype})")
    h = 0xCBF29CE484222325
    for v in arr.view(np.uint16).ravel().tolist():
        h = ((h ^ v) * 0x100000001B3) & _U64_MASK
    return h
