"""Exploration (GPU, not part of the bench suite): qsa_score_rows_tc against its speed variants x1..x4
(ptx/qsa_prefill.cuh), each at a few grid.y choices, on the 16K and 32K slabs of ``hss.bench.qsa_prefill``
(real qsa_qprep_rows output as q, random keys, rows 2048, first_pos L - rows, n_blocks L // 4).

    python -m hss.bench._tc_variants            # H200: one markdown table, well under a minute
    HSS_DRIVER=emulator python -m hss.bench._tc_variants --smoke    # code paths only; numbers mean nothing

Each configuration is timed (median, as the bench) into a buffer laid out as the bench's (stride n_blocks), then
launched once more into a NaN-poisoned [rows + 1, n_blocks + 8] buffer and compared with the shipped kernel's
output at its default geometry in the same layout: per row max|diff| <= 2e-4 * max|ref| over valid entries
(b < complete_r), every other entry (masked -1e30, unwritten NaN) bit-identical. A failing configuration is
reported as FAIL and the run goes on.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, NamedTuple

import numpy as np

from hss import cuda_min as cm
from hss import ptx
from hss._driver import api, check
from hss.bench.qsa_prefill import _Dev, _matmul_tflops, _time_ms
from hss.kernels import qsa_prefill as kq

SHIPPED = kq.QSA_SCORE_ROWS_TC.name
TOL = 2e-4          # per-row max|diff| / max|ref| against the shipped kernel
PAD = 8             # extra columns (and one extra row) in the checked layout: must stay NaN
OPT_IN = 48 * 1024  # dynamic shared memory beyond this needs the function attribute


class Config(NamedTuple):
    name: str        # kernel
    bpc: int | None  # blocks per CTA along grid.y (None: the geometry's default)


def _configs() -> list[Config]:
    # shipped: default (8 chunks of 64 per CTA), chunks/16 -> 16 per CTA, chunks/32 -> 32, chunks/4 -> 4
    out = [Config(SHIPPED, None), Config(SHIPPED, 1024), Config(SHIPPED, 2048), Config(SHIPPED, 256)]
    out += [Config("qsa_score_rows_tc_x1", None), Config("qsa_score_rows_tc_x1", 256),
            Config("qsa_score_rows_tc_x2", None), Config("qsa_score_rows_tc_x2", 1024),
            Config("qsa_score_rows_tc_x2", 256),
            Config("qsa_score_rows_tc_x3", None), Config("qsa_score_rows_tc_x3", 1024),
            Config("qsa_score_rows_tc_x3", 2048), Config("qsa_score_rows_tc_x3", 256),
            Config("qsa_score_rows_tc_x4", None), Config("qsa_score_rows_tc_x4", 1024),
            Config("qsa_score_rows_tc_x4", 2048)]
    return out


def _geometry(cfg: Config, rows: int, n_blocks: int) -> kq.Geometry:
    chunk = kq.TC_BLOCKS if cfg.name == SHIPPED else kq.TC_VARIANTS[cfg.name].blocks
    gy = None if cfg.bpc is None else -(-max(n_blocks, 1) // max(cfg.bpc, chunk))
    if cfg.name == SHIPPED:
        return kq.score_rows_tc_geometry(rows, n_blocks, gy)
    return kq.score_rows_tc_variant_geometry(cfg.name, rows, n_blocks, gy)


def _decl(name: str) -> Any:
    return kq.QSA_SCORE_ROWS_TC if name == SHIPPED else kq.QSA_SCORE_ROWS_TC_VARIANTS[name]


def _prepare(func: Any, shared: int) -> None:
    """Opt ``func`` in to ``shared`` dynamic bytes (and the largest smem carveout) when over 48 KiB."""
    if shared <= OPT_IN:
        return
    set_attr = getattr(api, "cuFuncSetAttribute", None)
    if set_attr is None:
        raise RuntimeError("this driver (the emulator) has no opt-in shared memory")
    func._ctx.make_current()
    attr = api.CUfunction_attribute
    check(set_attr(func.handle, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared), "cuFuncSetAttribute")
    carveout = getattr(attr, "CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT", None)   # absent on the emulator
    if carveout is not None:
        check(set_attr(func.handle, carveout, 100), "cuFuncSetAttribute")


class Case:
    """One scoring problem's inputs and buffers (device memory kept by ``dev``): ``q`` a device pointer to
    [rows, 4, 128] f32, keys random bf16; the checked layout is [rows + 1, stride] with stride >= n_blocks."""

    def __init__(self, dev: _Dev, q: int, rows: int, first_pos: int, ratio: int, n_blocks: int, stride: int) -> None:
        self.rows, self.first_pos, self.ratio, self.n_blocks, self.stride = rows, first_pos, ratio, n_blocks, stride
        self.q = q
        self.keys = dev.randn((max(n_blocks, 1), kq.TC_HD))
        self.check_bytes = 4 * (rows + 1) * stride
        self.timed = dev.empty(4 * rows * n_blocks)     # the bench's layout (stride n_blocks)
        self.checked = dev.empty(self.check_bytes)
        dev.ready()
        comp = (first_pos + np.arange(rows + 1) + 1) // ratio
        self.valid = np.arange(stride)[None, :] < np.minimum(comp, n_blocks)[:, None]
        self.valid[rows:] = False
        self.ref: np.ndarray | None = None

    @classmethod
    def slab(cls, mod: Any, stream: int, dev: _Dev, c: dict, L: int) -> "Case":
        """The bench's slab at context L: q is real qsa_qprep_rows output."""
        rows, n_heads, hd = c["rows"], c["n_heads"], c["hd"]
        qkw = (n_heads + 1) * hd
        qk, w = dev.randn((rows, qkw)), dev.randn((hd,), 0.1)
        q = dev.empty(4 * rows * n_heads * hd)
        g = kq.qprep_rows_geometry(rows, n_heads, hd)
        p = kq.QSA_QPREP_ROWS.pack(qk, w, q, L - rows, qkw, n_heads, hd, hd // 2, 1e7, 1e-6)
        cm.launch_kernel(mod.function(kq.QSA_QPREP_ROWS.name), g.grid, g.block, g.shared, stream, p)
        return cls(dev, q, rows, L - rows, c["ratio"], L // c["ratio"], L // c["ratio"] + PAD)

    @classmethod
    def edge(cls, dev: _Dev, rows: int, first_pos: int, ratio: int, n_blocks: int, stride: int) -> "Case":
        """Small odd shapes (partial row tiles and chunks, odd stride, masked tails)."""
        return cls(dev, dev.randn((rows, kq.TC_HEADS, kq.TC_HD), dtype=np.float32), rows, first_pos, ratio,
                   n_blocks, stride)

    def pack(self, decl: Any, scores: int, stride: int) -> Any:
        return decl.pack(self.q, self.keys, scores, self.first_pos, stride, self.ratio, self.n_blocks, self.rows)

    def run_checked(self, func: Any, decl: Any, geom: kq.Geometry, stream: int) -> np.ndarray:
        cm.memset_d8_async(self.checked, 0xFF, self.check_bytes, stream)   # NaN poison
        cm.launch_kernel(func, geom.grid, geom.block, geom.shared, stream, self.pack(decl, self.checked, self.stride))
        out = np.empty((self.rows + 1, self.stride), np.float32)
        cm.copy_d_to_h_async(out, self.checked, self.check_bytes, stream)
        cm.stream_sync(stream)
        return out

    def set_ref(self, mod: Any, stream: int) -> None:
        """The shipped kernel at its default geometry, in the checked layout."""
        geom = kq.score_rows_tc_geometry(self.rows, self.n_blocks)
        self.ref = self.run_checked(mod.function(SHIPPED), kq.QSA_SCORE_ROWS_TC, geom, stream)

    def compare(self, got: np.ndarray) -> tuple[bool, str]:
        ref = self.ref
        assert ref is not None
        inv = ~self.valid
        if not np.array_equal(got.view(np.uint32)[inv], ref.view(np.uint32)[inv]):
            bad = int(np.count_nonzero(got.view(np.uint32)[inv] != ref.view(np.uint32)[inv]))
            return False, f"FAIL ({bad} masked/unwritten entries differ)"
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(got - ref)
        d[inv] = 0.0
        err = d.max(axis=1)   # NaN (a non-finite valid entry) propagates
        a = np.abs(ref)
        a[inv] = 0.0
        rowmax = a.max(axis=1)
        if not np.isfinite(err).all():
            return False, "FAIL (non-finite valid entry)"
        rel = np.divide(err, rowmax, out=np.zeros_like(err), where=rowmax > 0)
        worst = float(rel.max()) if rel.size else 0.0
        ok = bool((err <= TOL * rowmax).all())
        return ok, f"{'ok' if ok else 'FAIL'} ({worst:.1e})"


# (rows, first_pos, ratio, n_blocks, stride): partial row tiles for 16/32/64-row CTAs, partial chunks, odd strides,
# chunks past every row's complete count (masked tails), n_blocks below the complete count.
EDGE_CASES = ((100, 300, 3, 133, 136), (77, 0, 1, 77, 82), (37, 450, 4, 90, 93), (130, 1000, 4, 220, 223),
              (200, 10, 2, 105, 107))


def _edge_check(mod: Any, stream: int, dev: _Dev, name: str, funcs: dict) -> str:
    """Every EDGE_CASE at grid.y 1, default and max against the shipped kernel; 'ok' or the first failure."""
    try:
        func, decl = _function(mod, funcs, name), _decl(name)
        for shape in EDGE_CASES:
            case = Case.edge(dev, *shape)
            case.set_ref(mod, stream)
            chunk = kq.TC_BLOCKS if name == SHIPPED else kq.TC_VARIANTS[name].blocks
            for gy in sorted({1, None, -(-case.n_blocks // chunk)}, key=lambda v: -1 if v is None else v):
                geom = _geometry(Config(name, None), case.rows, case.n_blocks)
                if gy is not None:
                    geom = geom._replace(grid=(geom.grid[0], gy, 1))
                _prepare(func, geom.shared)
                ok, msg = case.compare(case.run_checked(func, decl, geom, stream))
                if not ok:
                    return f"{msg} at {shape}, grid.y {geom.grid[1]}"
        return "ok"
    except Exception as exc:   # report and go on
        return f"FAIL ({type(exc).__name__}: {str(exc)[:80]})"


def _function(mod: Any, funcs: dict, name: str) -> Any:
    if name not in funcs:
        funcs[name] = mod.function(name)
    return funcs[name]


def _cfg(smoke: bool) -> dict[str, Any]:
    if smoke:   # rows not a multiple of 16/32/64, two 64-block chunks: bounds and runs are exercised
        return dict(contexts=(512,), rows=40, n_heads=4, hd=128, ratio=4, reps=1, warmup=0)
    return dict(contexts=(16384, 32768), rows=2048, n_heads=4, hd=128, ratio=4, reps=10, warmup=2)


def run(smoke: bool) -> str:
    c = _cfg(smoke)
    torch = None
    if not smoke:
        try:
            import torch as _torch
            torch = _torch if _torch.cuda.is_available() else None
        except ImportError:
            pass
    ctx = cm.CudaCtx(0)
    stream = ctx.stream
    mod = ptx.load_module(kq.MODULE, ctx)
    dev = _Dev(torch, np.random.default_rng(0), stream)
    mm = _matmul_tflops(torch, c["reps"]) if torch is not None else None
    configs = _configs()
    res: dict[tuple[Config, int], tuple[float | None, str, tuple]] = {}
    funcs: dict[str, Any] = {}
    edge = {name: _edge_check(mod, stream, dev, name, funcs) for name in dict.fromkeys(cfg.name for cfg in configs)}
    dev.close()
    for L in c["contexts"]:
        case = Case.slab(mod, stream, dev, c, L)
        case.set_ref(mod, stream)
        for cfg in configs:
            geom = _geometry(cfg, case.rows, case.n_blocks)
            try:
                func, decl = _function(mod, funcs, cfg.name), _decl(cfg.name)
                _prepare(func, geom.shared)
                pt = case.pack(decl, case.timed, case.n_blocks)
                ms = _time_ms(lambda: cm.launch_kernel(func, geom.grid, geom.block, geom.shared, stream, pt), stream,
                              c["reps"], c["warmup"])
                res[(cfg, L)] = (ms, case.compare(case.run_checked(func, decl, geom, stream))[1], geom.grid)
            except Exception as exc:   # report and go on
                try:
                    cm.stream_sync(stream)
                except Exception:
                    pass
                res[(cfg, L)] = (None, f"FAIL ({type(exc).__name__}: {str(exc)[:80]})", geom.grid)
        dev.close()
    mod.close()
    ctx.close()
    return _table(configs, c, res, mm, edge)


def _table(configs: list[Config], c: dict, res: dict, mm: float | None, edge: dict) -> str:
    Ls = c["contexts"]
    big = Ls[-1]
    head = f"bf16 torch.matmul 8192^3: {mm:.1f} TFLOP/s" if mm else "bf16 torch.matmul: not measured"
    out = [head, "", f"| variant | blocks/CTA | grid @{big} | " + " | ".join(f"µs @{L}" for L in Ls) +
           f" | TFLOP/s @{big} | % of bf16 | check (worst rel) | edge shapes |",
           "|---|---:|---|" + "---:|" * len(Ls) + "---:|---:|---|---|"]
    for cfg in configs:
        cells, checks = [], []
        for L in Ls:
            ms, chk, _ = res[(cfg, L)]
            cells.append("—" if ms is None else f"{ms * 1e3:.1f}")
            checks.append(chk if len(Ls) == 1 else f"{L // 1024}K {chk}")
        ms, _, grid = res[(cfg, big)]
        n_blocks = big // c["ratio"]
        tf = 2 * c["rows"] * n_blocks * kq.TC_HEADS * kq.TC_HD / (ms * 1e-3) / 1e12 if ms else None
        pct = f"{tf / mm * 100:.1f}" if tf and mm else "—"
        out.append(f"| {cfg.name.replace('qsa_score_rows_', '')} | {cfg.bpc or 'default'} | {grid[:2]} | " +
                   " | ".join(cells) + f" | {'—' if tf is None else f'{tf:.1f}'} | {pct} | {'; '.join(checks)} | {edge[cfg.name]} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hss.bench._tc_variants", description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, any driver (emulator included)")
    args = ap.parse_args(argv)
    print(run(args.smoke), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
