"""Declarations of ``ptx/model.cu`` (the decoder forward's small kernels: embedding + RMSNorm, residual add + RMSNorm,
RoPE + KV write (positional, or into a batch's pages), SiLU·up, argmax, causal prefill attention), their launch
geometry, and their emulation through :mod:`hss.reference.model` (float64, stored rounded once to the kernels'
dtypes).

``state`` is i32 ``[STATE_WORDS]`` = {token, pos, visible, 0}; the emulations read it when they run (so a replayed
graph follows the positions the step advances), as the kernels do. A batch keeps one state per row, word-major
(word w of row r at ``w * state_stride + r``; ``state_stride`` 1 is the one-sequence layout), so its tokens and its
visible counts are contiguous i32 rows (``model_embed_norm``'s ids, the attention's token counts); a row not in use
holds {-1, -1, 0} (:data:`IDLE_STATE`), which every kernel leaves alone.

Geometry (``*_geometry``; the ``check`` functions hold emulated launches to it): ``model_embed_norm``,
``model_add_norm``, ``model_rope_kv``, ``model_rope_kv_paged``: grid (m), block (``THREADS``); ``model_silu_mul``:
grid (ceil(ffn / ``THREADS``), m); ``model_argmax``: grid (m), block (``ARGMAX_THREADS``); ``model_prefill_attn``:
grid (ceil(m / ``ATTN_ROWS``), n_head), block (``ATTN_THREADS``); no dynamic shared memory.
"""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np

from hss._util import ceil_div
from hss.decls._decl import Launch, declare, f32
from hss.decls.qsa_prefill import Geometry
from hss.errors import MemoryFault
from hss.reference import model as ref
from hss.reference.numerics import to_bf16, to_f32

__all__ = ["MODULE", "THREADS", "ARGMAX_THREADS", "ARGMAX_CANDIDATES", "ARGMAX_HELD", "ARGMAX_BATCH", "NORM_HELD",
           "NORM_HELD_DIM", "STATE_WORDS", "ATTN_HEAD_DIM", "ATTN_ROWS", "ATTN_KEYS", "ATTN_THREADS", "row_geometry",
           "silu_geometry", "argmax_geometry", "prefill_attn_geometry", "positional_strides", "IDLE_STATE",
           "MODEL_EMBED_NORM", "MODEL_ADD_NORM", "MODEL_ROPE_KV", "MODEL_ROPE_KV_PAGED", "MODEL_SILU_MUL",
           "MODEL_ARGMAX", "MODEL_PREFILL_ATTN"]

BF16 = ml_dtypes.bfloat16
MODULE = "model"
THREADS = 256           # MODEL_THREADS: block of the row kernels
ARGMAX_THREADS = 1024   # MODEL_ARGMAX_THREADS
ARGMAX_CANDIDATES = 1024   # MODEL_ARGMAX_CANDIDATES: near ties model_argmax recomputes in f32, at most
ARGMAX_HELD = 8         # MODEL_ARGMAX_HELD: 16-byte logit chunks a model_argmax thread holds per batch
ARGMAX_BATCH = 8 * ARGMAX_HELD * ARGMAX_THREADS   # logits held in registers in one pass; larger vocabs read twice
NORM_HELD = 4           # MODEL_NORM_HELD: 4-element chunks a row-norm thread keeps in registers
NORM_HELD_DIM = 4 * NORM_HELD * THREADS           # the widest row model_embed_norm / model_add_norm keep in registers
STATE_WORDS = 4         # MODEL_STATE_WORDS: token, pos, visible, 0
IDLE_STATE = (-1, -1, 0, 0)   # the state words of a batch row not in use: no token, no position, nothing visible
ATTN_HEAD_DIM = 64      # MODEL_HD: the only head_dim model_prefill_attn takes
ATTN_ROWS = 64          # MODEL_ATTN_ROWS: query rows per CTA
ATTN_KEYS = 64          # MODEL_ATTN_KEYS: keys per staged tile
ATTN_THREADS = 256      # MODEL_ATTN_THREADS


# -- geometry (one place; the emulator's checks hold launches to it) --------------------------------
def row_geometry(m: int) -> Geometry:
    """``model_embed_norm``, ``model_add_norm``, ``model_rope_kv``: one CTA per row."""
    return Geometry((m, 1, 1), (THREADS, 1, 1), 0)


def silu_geometry(m: int, ffn: int) -> Geometry:
    return Geometry((ceil_div(ffn, THREADS), m, 1), (THREADS, 1, 1), 0)


def argmax_geometry(m: int = 1) -> Geometry:
    """``model_argmax``: one CTA per row (one sequence: 1)."""
    return Geometry((m, 1, 1), (ARGMAX_THREADS, 1, 1), 0)


def prefill_attn_geometry(m: int, n_head: int) -> Geometry:
    return Geometry((ceil_div(m, ATTN_ROWS), n_head, 1), (ATTN_THREADS, 1, 1), 0)


def _held_to(want: Geometry, launch: Launch) -> str | None:
    if (launch.grid, launch.block, launch.shared) != (want.grid, want.block, want.shared):
        return f"needs grid {want.grid}, block {want.block} and no dynamic shared memory"
    return None


# -- emulation ------------------------------------------------------------------------------------
def _bf16(view: np.ndarray, n: int) -> np.ndarray:
    return view[: 2 * n].view(BF16)


def _i32(view: np.ndarray) -> np.ndarray:
    return view[: view.size // 4 * 4].view(np.int32)


def _emulate_embed_norm(a: SimpleNamespace, launch: Launch) -> None:
    m, dim, vocab = a.m, a.dim, a.vocab
    ids = _i32(a.ids)[:m].astype(np.int64)
    live = np.flatnonzero((ids >= 0) & (ids < vocab))
    if not live.size:
        return
    embed = _bf16(a.embed, vocab * dim).reshape(vocab, dim)
    x, h = ref.embed_norm(ids[live], embed, f32(a.gain)[:dim], a.eps)
    f32(a.x)[: m * dim].reshape(m, dim)[live] = to_f32(x)
    _bf16(a.h, m * dim).reshape(m, dim)[live] = to_bf16(h)


def _emulate_add_norm(a: SimpleNamespace, launch: Launch) -> None:
    m, dim = a.m, a.dim
    x = f32(a.x)[: m * dim].reshape(m, dim)
    s, h = ref.add_norm(x, _bf16(a.delta, m * dim).reshape(m, dim), f32(a.gain)[:dim], a.eps)
    x[:] = to_f32(s)
    _bf16(a.h, m * dim).reshape(m, dim)[:] = to_bf16(h)


def _emulate_rope_kv(a: SimpleNamespace, launch: Launch) -> None:
    m, nq, nkv, hd = a.m, a.n_head, a.n_kv_head, a.head_dim
    if a.cache_rows < 1:
        return
    pos = int(_i32(a.state)[1]) + np.arange(m)
    live = np.flatnonzero((pos >= 0) & (pos < a.max_pos))
    if not live.size:
        return
    width = (nq + 2 * nkv) * hd
    qkv = _bf16(a.qkv, m * width).reshape(m, width)[live]
    half = hd // 2
    cos = f32(a.cos_t)[: a.max_pos * half].reshape(a.max_pos, half)[pos[live]]
    sin = f32(a.sin_t)[: a.max_pos * half].reshape(a.max_pos, half)[pos[live]]
    q, k, v = ref.rope_kv(qkv, cos, sin, 0, nq, nkv, hd)
    rows = pos[live] % a.cache_rows
    _bf16(a.q_out, m * nq * hd).reshape(m, nq, hd)[live] = to_bf16(q)
    at = (rows[:, None, None] * a.row_stride + np.arange(nkv)[None, :, None] * a.kvh_stride
          + np.arange(hd)[None, None, :])   # element (row, kv head, d) of the strided cache
    n = _cache(a) // 2
    _bf16(a.k_cache, n)[at] = to_bf16(k)
    _bf16(a.v_cache, n)[at] = to_bf16(v)


def _emulate_silu_mul(a: SimpleNamespace, launch: Launch) -> None:
    m, ffn = a.m, a.ffn
    gu = _bf16(a.gu, 2 * m * ffn).reshape(m, 2 * ffn)
    _bf16(a.act, m * ffn).reshape(m, ffn)[:] = to_bf16(ref.silu_mul(gu, ffn))


def _state_rows(a: SimpleNamespace) -> np.ndarray:
    """The state words of the launch's rows as an i32 ``[STATE_WORDS - 1, m]`` view (word w of row r at
    ``w * state_stride + r``)."""
    words = _i32(a.state)
    return np.lib.stride_tricks.as_strided(words, (STATE_WORDS - 1, a.m), (4 * a.state_stride, 4), writeable=True)


def _emulate_rope_kv_paged(a: SimpleNamespace, launch: Launch) -> None:
    m, nq, nkv, hd, bs = a.m, a.n_head, a.n_kv_head, a.head_dim, a.block_size
    if bs < 1 or a.state_stride < 1 or a.table_stride < 0:
        return
    pos = _i32(a.state)[a.state_stride:a.state_stride + m].astype(np.int64)
    tables = _i32(a.tables)[: m * a.table_stride].reshape(m, a.table_stride)
    page, slot, live = ref.paged_slots(tables, pos, bs, a.max_pos)
    if not live.any():
        return
    width = (nq + 2 * nkv) * hd
    qkv = _bf16(a.qkv, m * width).reshape(m, width)[live]
    half = hd // 2
    cos = f32(a.cos_t)[: a.max_pos * half].reshape(a.max_pos, half)[pos[live]]
    sin = f32(a.sin_t)[: a.max_pos * half].reshape(a.max_pos, half)[pos[live]]
    q, k, v = ref.rope_kv(qkv, cos, sin, 0, nq, nkv, hd)
    _bf16(a.q_out, m * nq * hd).reshape(m, nq, hd)[live] = to_bf16(q)
    at = ((page[live] * a.blk_stride + slot[live] * a.tok_stride)[:, None, None]
          + np.arange(nkv)[None, :, None] * a.kvh_stride + np.arange(hd)[None, None, :])
    kpool, vpool = _bf16(a.k_pool, a.k_pool.size // 2), _bf16(a.v_pool, a.v_pool.size // 2)
    if at.max() >= min(kpool.size, vpool.size):
        bad = int(page[live][np.flatnonzero((at >= min(kpool.size, vpool.size)).any(axis=(1, 2)))[0]])
        raise MemoryFault(f"model_rope_kv_paged parameter k_pool / v_pool: page {bad} is outside the pool "
                          "allocation")
    kpool[at] = to_bf16(k)
    vpool[at] = to_bf16(v)


def _emulate_argmax(a: SimpleNamespace, launch: Launch) -> None:
    m, vocab, dim = a.m, a.vocab, a.dim
    live = m if a.rows is None else min(m, int(_i32(a.rows)[0]))
    if live <= 0 or a.state_stride < 1:
        return
    weight = _bf16(a.weight, vocab * dim).reshape(vocab, dim)
    logits = _bf16(a.logits, m * vocab).reshape(m, vocab)
    h = _bf16(a.h, m * dim).reshape(m, dim)
    state = _state_rows(a)[:, :live]
    pos = state[1] + np.int32(a.advance)    # int32 arithmetic, as the kernel's
    state[0], state[1], state[2] = ref.argmax_rows(logits[:live], h[:live], weight, ARGMAX_CANDIDATES), pos, pos + 1


def _emulate_prefill_attn(a: SimpleNamespace, launch: Launch) -> None:
    m, nq, nkv, hd, q0 = a.m, a.n_head, a.n_kv_head, a.head_dim, a.q_start
    if hd != ATTN_HEAD_DIM or nkv <= 0 or nq % nkv or q0 < 0:
        return
    keys = q0 + m
    q = _bf16(a.q, m * nq * hd).reshape(m, nq, hd)
    k = _bf16(a.k_cache, keys * nkv * hd).reshape(keys, nkv, hd)
    v = _bf16(a.v_cache, keys * nkv * hd).reshape(keys, nkv, hd)
    _bf16(a.out, m * nq * hd).reshape(m, nq, hd)[:] = to_bf16(ref.causal_attention(q, k, v, q0))


# -- declarations -----------------------------------------------------------------------------------
def _rows(a: SimpleNamespace, width: int, size: int) -> int:
    return size * max(a.m, 0) * max(width, 0)


def _next_gain(a: SimpleNamespace) -> int:
    return 4 * max(a.dim, 0) if a.next_gain else 0   # optional: null = nothing prefetched


MODEL_EMBED_NORM = declare(
    MODULE, "model_embed_norm",
    "ptr ids, ptr embed, ptr gain, ptr x, ptr h, i32 m, i32 dim, i32 vocab, f32 eps, ptr next_gain",
    reads={"ids": lambda a: 4 * max(a.m, 0), "embed": lambda a: 2 * max(a.vocab, 0) * max(a.dim, 0),
           "gain": lambda a: 4 * max(a.dim, 0), "next_gain": _next_gain},
    writes={"x": lambda a: _rows(a, a.dim, 4), "h": lambda a: _rows(a, a.dim, 2)},
    emulate=_emulate_embed_norm, check=lambda a, launch: _held_to(row_geometry(a.m), launch))

MODEL_ADD_NORM = declare(
    MODULE, "model_add_norm", "ptr x, ptr delta, ptr gain, ptr h, i32 m, i32 dim, f32 eps, ptr next_gain",
    reads={"x": lambda a: _rows(a, a.dim, 4), "delta": lambda a: _rows(a, a.dim, 2),
           "gain": lambda a: 4 * max(a.dim, 0), "next_gain": _next_gain},
    writes={"x": lambda a: _rows(a, a.dim, 4), "h": lambda a: _rows(a, a.dim, 2)},
    emulate=_emulate_add_norm, check=lambda a, launch: _held_to(row_geometry(a.m), launch))


def _cache(a: SimpleNamespace) -> int:
    """Bytes from k_cache (v_cache) to the end of its last element: (row, kv head, d) at row * row_stride +
    kv_head * kvh_stride + d."""
    if min(a.cache_rows, a.n_kv_head, a.head_dim) < 1:
        return 0
    return 2 * ((a.cache_rows - 1) * a.row_stride + (a.n_kv_head - 1) * a.kvh_stride + a.head_dim)


def _rope_check(a: SimpleNamespace, launch: Launch) -> str | None:
    if a.row_stride < 0 or a.kvh_stride < 0:
        return f"needs row_stride and kvh_stride >= 0 (got {a.row_stride}, {a.kvh_stride})"
    return _held_to(row_geometry(a.m), launch)


def positional_strides(n_kv_head: int, head_dim: int) -> dict[str, int]:
    """``model_rope_kv``'s ``row_stride`` / ``kvh_stride`` of positional ``[cache_rows, n_kv_head, head_dim]``
    caches."""
    return {"row_stride": n_kv_head * head_dim, "kvh_stride": head_dim}


def _table(a: SimpleNamespace) -> int:
    return 4 * max(a.max_pos, 0) * max(a.head_dim, 0) // 2


MODEL_ROPE_KV = declare(
    MODULE, "model_rope_kv",
    "ptr qkv, ptr cos_t, ptr sin_t, ptr state, ptr q_out, ptr k_cache, ptr v_cache, i32 m, i32 n_head, "
    "i32 n_kv_head, i32 head_dim, i32 max_pos, i32 cache_rows, i64 row_stride, i64 kvh_stride",
    reads={"qkv": lambda a: _rows(a, (a.n_head + 2 * a.n_kv_head) * a.head_dim, 2), "cos_t": _table,
           "sin_t": _table, "state": lambda a: 4 * STATE_WORDS},
    writes={"q_out": lambda a: _rows(a, a.n_head * a.head_dim, 2), "k_cache": _cache, "v_cache": _cache},
    emulate=_emulate_rope_kv, check=_rope_check)

def _pool(a: SimpleNamespace) -> None:
    return None   # page ids decide: the emulation checks every written page against the allocation


def _paged_check(a: SimpleNamespace, launch: Launch) -> str | None:
    if min(a.blk_stride, a.tok_stride, a.kvh_stride) < 0:
        return f"needs blk_stride, tok_stride and kvh_stride >= 0 (got {a.blk_stride}, {a.tok_stride}, {a.kvh_stride})"
    if a.state_stride < a.m:
        return f"needs state_stride >= m (got {a.state_stride} < {a.m}): the rows' state words would overlap"
    return _held_to(row_geometry(a.m), launch)


MODEL_ROPE_KV_PAGED = declare(
    MODULE, "model_rope_kv_paged",
    "ptr qkv, ptr cos_t, ptr sin_t, ptr state, ptr q_out, ptr k_pool, ptr v_pool, ptr tables, i32 m, i32 n_head, "
    "i32 n_kv_head, i32 head_dim, i32 max_pos, i32 state_stride, i32 block_size, i32 table_stride, i64 blk_stride, "
    "i64 tok_stride, i64 kvh_stride",
    reads={"qkv": lambda a: _rows(a, (a.n_head + 2 * a.n_kv_head) * a.head_dim, 2), "cos_t": _table,
           "sin_t": _table, "state": lambda a: 4 * (max(a.state_stride, 0) + max(a.m, 0)),
           "tables": lambda a: _rows(a, a.table_stride, 4)},
    writes={"q_out": lambda a: _rows(a, a.n_head * a.head_dim, 2), "k_pool": _pool, "v_pool": _pool},
    emulate=_emulate_rope_kv_paged, check=_paged_check)

MODEL_SILU_MUL = declare(
    MODULE, "model_silu_mul", "ptr gu, ptr act, i32 m, i32 ffn",
    reads={"gu": lambda a: _rows(a, 2 * a.ffn, 2)}, writes={"act": lambda a: _rows(a, a.ffn, 2)},
    emulate=_emulate_silu_mul, check=lambda a, launch: _held_to(silu_geometry(a.m, a.ffn), launch))

def _argmax_state(a: SimpleNamespace) -> int:
    """Bytes from ``state`` to the end of the launch's rows' words (word w of row r at w * state_stride + r)."""
    return 4 * ((STATE_WORDS - 1) * max(a.state_stride, 0) + max(a.m, 0))


MODEL_ARGMAX = declare(
    MODULE, "model_argmax",
    "ptr logits, ptr h, ptr weight, i32 vocab, i32 dim, ptr state, i32 advance, i32 m, i32 state_stride, ptr rows",
    reads={"logits": lambda a: _rows(a, a.vocab, 2), "h": lambda a: _rows(a, a.dim, 2),
           "weight": lambda a: 2 * max(a.vocab, 0) * max(a.dim, 0), "state": _argmax_state,
           "rows": lambda a: 4 if a.rows else 0},   # optional: null = every row
    writes={"state": _argmax_state},
    emulate=_emulate_argmax, check=lambda a, launch: _held_to(argmax_geometry(a.m), launch))


def _attn_rows(a: SimpleNamespace) -> int:
    return _rows(a, a.n_head * a.head_dim, 2)


def _attn_keys(a: SimpleNamespace) -> int:
    return 2 * max(a.q_start + a.m, 0) * max(a.n_kv_head, 0) * max(a.head_dim, 0)


MODEL_PREFILL_ATTN = declare(
    MODULE, "model_prefill_attn",
    "ptr q, ptr k_cache, ptr v_cache, ptr out, i32 m, i32 n_head, i32 n_kv_head, i32 head_dim, i32 q_start",
    reads={"q": _attn_rows, "k_cache": _attn_keys, "v_cache": _attn_keys}, writes={"out": _attn_rows},
    emulate=_emulate_prefill_attn, check=lambda a, launch: _held_to(prefill_attn_geometry(a.m, a.n_head), launch))
