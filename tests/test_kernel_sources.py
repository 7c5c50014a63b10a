"""The kernel sources against the Python side, no GPU or nvcc needed: every ``extern "C" __global__`` signature in
``ptx/*.cu`` / ``*.cuh`` against its declaration in :data:`hss.decls.DECLARATIONS` (parameter names and C types),
and the ``#define``d constants (and launch bounds) against the Python constants that mirror them.

``tests/test_build_ptx.py`` compares the declarations with the committed PTX's ``.entry`` parameter types; this
module reads the sources, so it also sees parameter names, the constants and which file a kernel lives in.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import pytest

from hss.cuda import ptx
from hss.decls import DECLARATIONS, attention, gather, model, predictor, qsa, qsa_device, qsa_prefill, sample
from hss.reference import qsa_prefill as ref_qsa_prefill

PTX_DIR = ptx.ptx_dir()
SOURCES = sorted([*PTX_DIR.glob("*.cu"), *PTX_DIR.glob("*.cuh")])
KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+'
                    r"(?:__launch_bounds__\s*\((?P<bounds>(?:[^()]|\([^()]*\))*)\)\s*)?"
                    r"(?P<name>\w+)\s*\((?P<params>[^)]*)\)")
DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(?![\w(])[ \t]*(.*?)[ \t]*$", re.MULTILINE)
TYPEDEF = re.compile(r"\btypedef\s+([\w\s]+?)\s+(\w+)\s*;")
SCALAR_KINDS = {"int": "i32", "int32_t": "i32", "unsigned": "u32", "unsigned int": "u32", "uint32_t": "u32",
                "long long": "i64", "long long int": "i64", "int64_t": "i64", "float": "f32"}


def code(path: Path) -> str:
    """The source without its comments (no kernel source puts // or /* inside a string), continued lines joined."""
    text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text).replace("\\\n", " ")


def expand(text: str, table: dict[str, str], depth: int = 0) -> str:
    """``text`` with its object-like macros (a shared parameter list) replaced by their values, recursively."""
    assert depth < 16, f"#define cycle in {text!r}"
    out = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: table.get(m.group(0), m.group(0)), text)
    return out if out == text else expand(out, table, depth + 1)


def param_kind(decl: str, typedefs: dict[str, str]) -> tuple[str, str]:
    """(name, kind) of one C parameter declaration such as ``const float* __restrict__ q``."""
    words = re.sub(r"\b(?:const|volatile|__restrict__)\b", " ", decl).replace("*", " * ").split()
    name, ctype = words[-1], words[:-1]
    if "*" in ctype:
        return name, "ptr"
    spelled = " ".join(ctype)
    spelled = typedefs.get(spelled, spelled)
    assert spelled in SCALAR_KINDS, f"parameter {name}: C type {spelled!r} has no declaration kind"
    return name, SCALAR_KINDS[spelled]


@functools.cache
def source_kernels() -> dict[str, dict]:
    """Every extern "C" kernel in ptx/: its file, (name, kind) parameters and __launch_bounds__ text."""
    typedefs = {name: " ".join(t.split()) for path in SOURCES for t, name in TYPEDEF.findall(code(path))}
    found: dict[str, dict] = {}
    for path in SOURCES:
        for m in KERNEL.finditer(code(path)):
            name = m.group("name")
            assert name not in found, f"kernel {name} is defined in {found.get(name, {}).get('file')} and {path.name}"
            params = [param_kind(p, typedefs) for p in expand(m.group("params"), defines()).split(",") if p.strip()]
            found[name] = {"file": path.name, "params": params, "bounds": m.group("bounds")}
    return found


@functools.cache
def defines() -> dict[str, str]:
    """Every object-like ``#define`` in ptx/ (the default where ``#ifndef`` lets a build-time flag override it)."""
    out: dict[str, str] = {}
    for path in SOURCES:
        for name, value in DEFINE.findall(code(path)):
            assert out.get(name, value) == value, f"#define {name} differs between files"
            out[name] = value
    return out


def evaluate(expr: str, table: dict[str, str], depth: int = 0) -> int | float:
    """The value of a constant expression over the #defines (C literal suffixes dropped; / on integers is C's)."""
    assert depth < 16, f"#define cycle at {expr!r}"
    expr = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+\.?\d*(?:[eE][+-]?\d+)?)[uUlLfF]+\b", r"\1", expr)
    expr = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: f"({evaluate(table[m.group(0)], table, depth + 1)!r})", expr)
    floating = re.search(r"[.eE]", re.sub(r"0[xX][0-9a-fA-F]+", "", expr))
    return eval(expr if floating else expr.replace("/", "//"), {"__builtins__": {}})


def test_every_source_kernel_is_declared():
    missing = sorted(set(source_kernels()) - set(DECLARATIONS))
    assert not missing, f"kernels in ptx/ without a declaration in hss.decls: {missing}"


@pytest.mark.parametrize("name", sorted(DECLARATIONS))
def test_declaration_matches_source_signature(name):
    decl = DECLARATIONS[name]
    assert name in source_kernels(), f"{name} is declared (module {decl.module}) but no ptx/ source defines it"
    kernel = source_kernels()[name]
    in_module = [p.name for p in ptx.sources(decl.module, PTX_DIR)]
    assert kernel["file"] in in_module, f"{name} is in {kernel['file']}, not part of module {decl.module} {in_module}"
    declared = list(zip(decl.names, decl.kinds, strict=True))
    differ = [(i, src, dec) for i, (src, dec) in enumerate(zip(kernel["params"], declared, strict=False)) if src != dec]
    assert len(kernel["params"]) == len(declared) and not differ, (
        f"{name}: {kernel['file']} has {len(kernel['params'])} parameters, the declaration {len(declared)}; "
        f"(index, source, declared) that differ: {differ}")


# (#define or an expression over them, the Python value that mirrors it)
MIRRORS = [
    ("ATT_THREADS", attention.STEP_THREADS),
    ("ATT_ROWS", attention.STEP_ROWS),
    ("ATT_HG", attention.HEAD_GROUP),
    ("ATT_UNIT_MIN", attention.UNIT_MIN),
    ("ATT_UNIT_MIN_128", attention.UNIT_MIN_128),
    ("ATT_WARPS * ATT_ROWS", attention.UNIT_STEP),
    ("ATT_MAX_UNITS", attention.MAX_UNITS),
    ("ATT_GROUP", attention.FOLD_GROUP),
    ("ATT_FOLD_DIRECT", attention.FOLD_DIRECT),
    ("ATT_COUNTERS", attention.COUNTERS),
    ("ATT_MAX_HD", attention.MAX_HEAD_DIM),
    ("HSS_LR_ROWS", predictor.LOWRANK_ROWS),
    ("HSS_LR_HEAD_DIM", predictor.LOWRANK_HEAD_DIM),
    ("HSS_PRED_HEAD_THREADS", predictor.HEAD_THREADS),
    ("QSA_SCORE_THREADS", qsa.SCORE_THREADS),
    ("QSA_SCORE_STEPS", qsa.SCORE_STEPS),
    ("QSP_SR_BM", qsa_prefill.SCORE_TILE),
    ("QSP_SR_BN", qsa_prefill.SCORE_TILE),
    ("QSP_TC_BM", qsa_prefill.TC_ROWS),
    ("QSP_TC_BN", qsa_prefill.TC_BLOCKS),
    ("QSP_TC_H", qsa_prefill.TC_HEADS),
    ("QSP_TC_HD", qsa_prefill.TC_HD),
    ("32 * QSP_PA_WARPS", qsa_prefill.ATTN_THREADS),   # its __launch_bounds__ says 256: both are checked
    ("QSP_PA_HG", qsa_prefill.ATTN_HEAD_GROUP),
    ("QSP_AT_MAXG", qsa_prefill.ATTN_TC_MAX_GROUP),
    ("QSA_TOPK_THREADS", qsa_device.TOPK_THREADS),
    ("QSA_TOPK_ITEMS", qsa_device.TOPK_ITEMS),
    ("QSA_TOPK_TILE", qsa_device.TOPK_TILE),
    ("QSA_SPLIT", qsa_device.SPLIT),
    ("QSA_ATTN_THREADS", qsa_device.ATTN_THREADS),
    ("QSA_ATTN_MAX_G", qsa_device.ATTN_MAX_GROUP),
    ("QSA_ATTN_MAX_HD", qsa_device.ATTN_MAX_HD),
    ("QSA_QK_THREADS", qsa_device.QK_THREADS),
    ("QSA_QK_COLS", qsa_device.QK_COLS),
    ("QSA_QK_MAX_ROWS", qsa_device.QK_MAX_ROWS),
    ("MODEL_THREADS", model.THREADS),
    ("MODEL_ARGMAX_THREADS", model.ARGMAX_THREADS),
    ("MODEL_ARGMAX_CANDIDATES", model.ARGMAX_CANDIDATES),
    ("MODEL_ARGMAX_HELD", model.ARGMAX_HELD),
    ("8 * MODEL_ARGMAX_HELD * MODEL_ARGMAX_THREADS", model.ARGMAX_BATCH),
    ("MODEL_NORM_HELD", model.NORM_HELD),
    ("4 * MODEL_NORM_HELD * MODEL_THREADS", model.NORM_HELD_DIM),
    ("MODEL_STATE_WORDS", model.STATE_WORDS),
    ("MODEL_HD", model.ATTN_HEAD_DIM),
    ("MODEL_ATTN_ROWS", model.ATTN_ROWS),
    ("MODEL_ATTN_KEYS", model.ATTN_KEYS),
    ("MODEL_ATTN_THREADS", model.ATTN_THREADS),
    ("4 * MODEL_ATTN_ROWS", model.ATTN_THREADS),   # 4 threads per query row
    ("GATHER_THREADS", gather.THREADS),
    ("GATHER_UNROLL", gather.UNROLL),
    ("GATHER_CHUNK", gather.CHUNK),
    ("SAMPLE_THREADS", sample.THREADS),
    ("SAMPLE_CANDIDATES", sample.CANDIDATES),
    ("SAMPLE_CANDIDATES", model.ARGMAX_CANDIDATES),   # the greedy rows' near-tie cap is model_argmax's
    ("SAMPLE_MASS_BITS", sample.MASS_BITS),
    ("SAMPLE_PARAM_WORDS", sample.PARAM_WORDS),
    ("SAMPLE_MAX_VOCAB", sample.MAX_VOCAB),
    ("SAMPLE_RADIX_BINS", sample.RADIX_BINS),
    ("SAMPLE_FLAG_NAN", sample.FLAG_NAN),
    ("SAMPLE_FLAG_INF", sample.FLAG_INF),
    ("SAMPLE_FLAG_EMPTY", sample.FLAG_EMPTY),
]


@pytest.mark.parametrize("expr, python", MIRRORS, ids=[m[0] for m in MIRRORS])
def test_define_matches_python_constant(expr, python):
    value = evaluate(expr, defines())
    assert value == python, f"{expr} = {value} in ptx/, {python} in Python"


def test_masked_score_matches_reference():
    assert np.float32(evaluate("QSP_MASKED", defines())) == np.float32(ref_qsa_prefill.MASKED)


# kernel -> the block size (threads) the Python side launches it with; a block above __launch_bounds__ fails
BLOCKS = {
    **{attention.step_kernel_name(hdp): attention.STEP_THREADS for hdp in attention.PADDED_HEAD_DIMS},
    "attention_finalize": attention.FINALIZE_THREADS,
    "predictor_head_max": predictor.HEAD_THREADS,
    "predictor_head_combine": predictor.HEAD_THREADS,
    "qsa_score": qsa.SCORE_THREADS,
    "qsa_score_rows": qsa_prefill.score_rows_geometry(1, 1).block[0],
    "qsa_score_rows_tc": qsa_prefill.score_rows_tc_geometry(1, 1).block[0],
    "qsa_prefill_attn": qsa_prefill.prefill_attn_geometry(1, 4, 1, 128).block[0],
    "qsa_prefill_attn_tc": qsa_prefill.prefill_attn_tc_geometry(1, 1).block[0],
    "qsa_dev_score": qsa_device.score_geometry(1, 1, 1, 128).block[0],
    "qsa_dev_topk": qsa_device.topk_geometry(1, 1).block[0],
    "qsa_sparse_attn": qsa_device.attn_geometry(1, 1, 1, 128).block[0],
    **{name: model.row_geometry(1).block[0] for name in ("model_embed_norm", "model_add_norm", "model_rope_kv")},
    "model_silu_mul": model.silu_geometry(1, 1).block[0],
    "model_argmax": model.argmax_geometry().block[0],
    "model_prefill_attn": model.prefill_attn_geometry(1, 1).block[0],
    "page_gather": gather.gather_geometry(1, 1).block[0],
    "sample_tokens": sample.sample_geometry(1, 1).block[0],
}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_launch_bounds_match_python_block(name):
    bounds = source_kernels()[name]["bounds"]
    assert bounds, f"{name} has no __launch_bounds__"
    max_threads = evaluate(bounds.split(",")[0], defines())
    assert max_threads == BLOCKS[name], f"{name}: __launch_bounds__({bounds}) but Python launches {BLOCKS[name]}"


@pytest.mark.parametrize("hd", range(32, 257, 32))
def test_sparse_attn_shared_layout_matches_python(hd):
    """qsa_sparse_attn's QsdAttnSmem<HD> (each member a constant expression over HD and the #defines, in order)
    against hss.decls.qsa_device.attn_smem_bytes: the launch must give the kernel at least BYTES."""
    body = re.search(r"struct\s+QsdAttnSmem\s*\{(.*?)\};", code(PTX_DIR / "qsa_device.cu"), re.DOTALL)
    assert body, "struct QsdAttnSmem not found in qsa_device.cu"
    table = {**defines(), "HD": str(hd)}
    for name, expr in re.findall(r"static\s+constexpr\s+u32\s+(\w+)\s*=\s*([^;]+);", body.group(1)):
        table[name] = str(evaluate(expr, table))
    assert int(table["BYTES"]) == qsa_device.attn_smem_bytes(hd)


def test_parser_sees_every_kernel_and_override():
    """The regexes above found what they should (a silent parse failure would pass the tests vacuously)."""
    text = "".join(code(p) for p in SOURCES)
    assert len(source_kernels()) == len(re.findall(r'extern\s+"C"\s+__global__', text)) == len(DECLARATIONS)
    assert defines()["ATT_UNIT_MIN"] == "128"
