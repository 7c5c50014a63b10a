"""``ptx/model.cu``'s decoder kernels (hss.model: the small kernels between the GEMMs) compiled for the CPU and run
through the SIMT harness, against their emulations (the float64 references of :mod:`hss.reference.model`, rounded once
to the output's dtype) on the same inputs:

* exactly where the kernel's value is one IEEE rounding of the exact one (x = f32(embed row); x + f32(delta); the
  argmax's token and the state words it advances);
* under docs/design.md §0's bf16 rule (2^-7 |ref| + 1e-5 max|ref| per row) where libm (rsqrtf, expf) or an f32
  chain enters: the row norms (rows in registers and wider, vectorised and element by element), RoPE with K / V
  written into a strided cache, SiLU-mul, the causal prefill attention;
and nothing written where the kernel must leave memory alone (an id outside the vocabulary, a position past max_pos).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import simt

from hss.decls import model as km
from hss.decls._decl import Launch

from helpers import BF16, assert_close

EPS = 1e-5


@pytest.fixture(scope="module")
def program() -> simt.Program:
    simt.require()
    return simt.build(simt.PTX_DIR / "model.cu")


def both(program, decl, geom, **args) -> tuple[dict, dict]:
    """Run ``decl``'s kernel on the harness and its emulation, each on its own copy of the array arguments; returns
    (harness arrays, emulation arrays) by name."""
    sim = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in args.items()}
    emu = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in args.items()}
    program.kernel(decl.name, decl)(geom.grid, geom.block, geom.shared, **sim)
    launch = Launch(geom.grid, geom.block, geom.shared)
    a = SimpleNamespace(**{k: v.reshape(-1).view(np.uint8) if isinstance(v, np.ndarray) else v
                           for k, v in emu.items()})
    assert decl.check is None or decl.check(a, launch) is None
    decl.emulate(a, launch)
    return ({k: v for k, v in sim.items() if isinstance(v, np.ndarray)},
            {k: v for k, v in emu.items() if isinstance(v, np.ndarray)})


def bf16(rng, shape, std=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(BF16)


def nan_bf16(shape) -> np.ndarray:
    return np.full(shape, 0xFFFF, np.uint16).view(BF16)


@pytest.mark.parametrize("dim", [64, 576, 70, 4100])   # SmolLM2's 576; not a multiple of 4; past NORM_HELD_DIM
def test_embed_norm_and_add_norm(program, rng, dim):
    m, vocab = 4, 50
    embed, gain = bf16(rng, (vocab, dim)), (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    ids = np.array([3, 49, 50, 0], np.int32)   # 50: outside the vocabulary, its row left alone
    x0, h0 = np.full((m, dim), np.nan, np.float32), nan_bf16((m, dim))
    sim, emu = both(program, km.MODEL_EMBED_NORM, km.row_geometry(m), ids=ids, embed=embed, gain=gain, x=x0, h=h0,
                    m=m, dim=dim, vocab=vocab, eps=EPS, next_gain=None)
    assert sim["x"].tobytes() == emu["x"].tobytes(), "x = f32(embed row), untouched rows included"
    assert np.isnan(sim["h"][2].astype(np.float32)).all(), "a row outside the vocabulary is left alone"
    for r in (0, 1, 3):
        assert_close(sim["h"][r].astype(np.float32), emu["h"][r].astype(np.float64), "bf16", (0,), f"h row {r}")
    x = rng.standard_normal((m, dim)).astype(np.float32)
    delta = bf16(rng, (m, dim), 0.5)
    sim, emu = both(program, km.MODEL_ADD_NORM, km.row_geometry(m), x=x, delta=delta, gain=gain, h=h0, m=m, dim=dim,
                    eps=EPS, next_gain=gain)
    assert sim["x"].tobytes() == emu["x"].tobytes(), "x += f32(delta): one rounding"
    assert_close(sim["h"].astype(np.float32), emu["h"].astype(np.float64), "bf16", (1,), "add_norm h")


def test_rope_kv_into_a_strided_cache(program, rng):
    m, nq, nkv, hd, max_pos, cache_rows = 3, 6, 2, 64, 40, 16
    width = (nq + 2 * nkv) * hd
    qkv = bf16(rng, (m, width))
    ang = np.arange(max_pos)[:, None] * (10000.0 ** (-np.arange(hd // 2) / (hd // 2)))[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    state = np.array([7, 37, 38, 0], np.int32)     # rows at positions 37, 38, 39 (cache rows 5, 6, 7); then 40: none
    cache = nan_bf16((cache_rows, nkv, hd))
    for start, live in ((37, 3), (38, 2)):
        state[1] = start
        sim, emu = both(program, km.MODEL_ROPE_KV, km.row_geometry(m), qkv=qkv, cos_t=cos, sin_t=sin, state=state,
                        q_out=nan_bf16((m, nq, hd)), k_cache=cache, v_cache=cache.copy(), m=m, n_head=nq,
                        n_kv_head=nkv, head_dim=hd, max_pos=max_pos, cache_rows=cache_rows, row_stride=nkv * hd,
                        kvh_stride=hd)
        for name in ("q_out", "k_cache", "v_cache"):
            g, w = sim[name].astype(np.float32), emu[name].astype(np.float32)
            assert np.array_equal(np.isnan(g), np.isnan(w)), f"{name}: written where the reference is not"
            ok = ~np.isnan(w)
            assert_close(g[ok], w[ok].astype(np.float64), "bf16", (0,), f"{name} from position {start}")
        assert np.isnan(sim["q_out"][live:].astype(np.float32)).all(), "rows past max_pos are left alone"
        assert sim["v_cache"].tobytes() == emu["v_cache"].tobytes(), "v is copied"


def test_silu_mul(program, rng):
    m, ffn = 3, 1536
    sim, emu = both(program, km.MODEL_SILU_MUL, km.silu_geometry(m, ffn), gu=bf16(rng, (m, 2 * ffn), 2.0),
                    act=nan_bf16((m, ffn)), m=m, ffn=ffn)
    assert_close(sim["act"].astype(np.float32), emu["act"].astype(np.float64), "bf16", (1,), "silu_mul")


def test_argmax_advances_the_state(program, rng):
    m, vocab, dim, stride = 3, 5000, 64, 4
    weight, h = bf16(rng, (vocab, dim)), bf16(rng, (m, dim))
    logits = (h.astype(np.float64) @ weight.astype(np.float64).T).astype(BF16)   # the LM head GEMM's output
    state = np.full((km.STATE_WORDS, stride), -5, np.int32)
    state[1, :m], state[2, :m] = [10, 20, 30], [11, 21, 31]
    sim, emu = both(program, km.MODEL_ARGMAX, km.argmax_geometry(m), logits=logits, h=h, weight=weight, vocab=vocab,
                    dim=dim, state=state, advance=1, m=m, state_stride=stride, rows=np.array([2], np.int32))
    assert sim["state"].tobytes() == emu["state"].tobytes(), (sim["state"], emu["state"])
    assert (sim["state"][:, 2] == state[:, 2]).all(), "a row past rows[0] is left alone"


def test_prefill_attn(program, rng):
    m, nq, nkv, hd, q0 = 70, 6, 2, km.ATTN_HEAD_DIM, 5
    keys = q0 + m
    sim, emu = both(program, km.MODEL_PREFILL_ATTN, km.prefill_attn_geometry(m, nq), q=bf16(rng, (m, nq, hd)),
                    k_cache=bf16(rng, (keys, nkv, hd)), v_cache=bf16(rng, (keys, nkv, hd)), out=nan_bf16((m, nq, hd)),
                    m=m, n_head=nq, n_kv_head=nkv, head_dim=hd, q_start=q0)
    assert_close(sim["out"].astype(np.float32), emu["out"].astype(np.float64), "bf16", (2,), "causal prefill")
