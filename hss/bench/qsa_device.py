"""QSA decode on the device: ``decode_select_batch`` + ``sparse_decode_attention`` at 8K, 32K, 128K and
512K visible tokens, batch 1, 8, 32 and 64, against the host path and PyTorch, in the same run.

    python -m hss.bench.qsa_device [--contexts 8192,32768,131072,524288] [--batches 1,8,32,64] [--layers 12]
    python -m hss.bench.qsa_device --smoke      tiny dims on any driver (numbers meaningless)

Dims are Qwen3.8-Flash-Next's: hidden 2560, indexer 4 heads x 128, ratio 4, budget 2048, rot 64, theta 1e7;
attention 24 q / 2 kv heads x 256, page size 16. Every sequence of a batch holds the same prefilled context
(restored from one snapshot into its own buffers; pages of its own in the pools). Per (context, batch):

* GPU time of each stage (the qk GEMM (cuBLAS), and ``qsa_dev_qk`` beside it for up to 8 rows; ``qsa_dev_prep``,
  ``qsa_dev_score``, ``qsa_dev_topk``, ``qsa_sparse_attn``, ``qsa_sparse_merge``): CUDA timing events around
  back-to-back launches queued behind a large memset;
* ``step``: GPU time of one layer's whole step with the defaults (the slots' copy, the GEMM, five kernels),
  replayed from a graph; ``step, opt-ins``: the same with ``qsa_dev_qk`` (up to 8 rows) and programmatic dependent
  launch (where the sm_90 PTX serves it), the two settings ``HSS_QSA_QK_KERNEL=1`` and ``HSS_QSA_PDL=1`` turn on;
* ``eager host``: host µs per eager step (the two calls, nothing synchronised); ``12-layer``: a graph of 12 layers'
  steps (12 indexers with their own states; the pools are shared): host µs per ``CudaGraph.launch`` and wall µs per
  token of back-to-back replays;
* peers: the hss host path (``decode_select`` per sequence: blocking D2H, host top-k, gather; then dense attention
  over the gathered scratch through ``TiledAttention``), PyTorch eager doing the same math (GEMV, norm / rope, block
  pool, bf16 score matmul, ``torch.topk``, sort, token expansion, gather through the page tables, SDPA), ``torch.topk``
  alone on the step's own scores (GPU time), and dense SDPA over all visible tokens (GPU time; the pools read as
  [R, kv heads, tokens, hd] views).

Targets (batch 1): device top-k at 32K <= 10 µs and >= 5x faster than ``torch.topk``; one layer's step <= 30 µs at
32K and <= 40 µs at 128K; a 12-layer graph replay <= 0.45 ms per token at 32K; batch 64 at 32K <= 8x batch 1's step.
A measurement that does not fit the device memory (or fails) is skipped with its reason in the notes.
"""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from hss import cuda_min as cm
from hss._util import ceil_div
from hss.bench._timer import Case, Flush, gpu_us, host_us

BF16 = ml_dtypes.bfloat16
DIMS = dict(hidden=2560, n_heads=4, hd=128, ratio=4, budget=2048, rot=64, theta=1e7, eps=1e-6, nq=24, nkv=2,
            hd_attn=256, block_size=16)
SMOKE_DIMS = dict(hidden=64, n_heads=2, hd=32, ratio=4, budget=16, rot=16, theta=1e4, eps=1e-6, nq=4, nkv=2,
                  hd_attn=64, block_size=8)
CONTEXTS, BATCHES, LAYERS, MARGIN = (8192, 32768, 131072, 524288), (1, 8, 32, 64), 12, 4096
SMOKE = dict(contexts=(40, 72), batches=(1, 3), layers=2, margin=96)
SLAB = 2048           # distinct hidden rows, reused cyclically by the prefill
STAGES = ("qk", "prep", "score", "topk", "attn", "merge")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hss.bench.qsa_device", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="visible tokens, comma-separated")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes, comma-separated")
    p.add_argument("--layers", type=int, default=LAYERS, help="QSA layers in the replayed graph")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch peers")
    p.add_argument("--smoke", action="store_true", help="tiny dims on any driver (numbers meaningless)")
    args = p.parse_args(argv)
    args.contexts = tuple(int(c) for c in args.contexts.split(","))
    args.batches = tuple(int(b) for b in args.batches.split(","))
    args.margin = MARGIN
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.no_torch = True
    return args


class _Gpu:
    """GPU µs per call: ``reps`` calls behind a blocker (a large memset: the queue fills, so no host gaps)."""

    def __init__(self, stream: int, smoke: bool) -> None:
        self.s = stream
        self.blocker = Flush(stream, 4096 if smoke else 1 << 31)
        self.reps, self.rounds = (2, 1) if smoke else (20, 5)

    def us(self, fn: Callable[[], Any], reps: int | None = None) -> float:
        return gpu_us(self.s, fn, batch=reps or self.reps, batches=self.rounds, warmup=1, prepare=self.blocker,
                      sync_each=True).us

    def close(self) -> None:
        self.blocker.close()


def _upload(arr: np.ndarray, stream: int) -> cm.DeviceBuffer:
    buf = cm.DeviceBuffer(max(arr.nbytes, 1))
    cm.copy_h_to_d_async(buf, np.ascontiguousarray(arr), arr.nbytes, stream)
    return buf


class _Context:
    """Everything one context length needs: layers of indexers with ``max_batch`` prefilled states each, the pools
    (a private run of pages per sequence), the page tables, step inputs and outputs."""

    def __init__(self, gpu: Any, stream: int, n: int, d: dict, max_batch: int, layers: int, margin: int,
                 rng: np.random.Generator) -> None:
        from hss.qsa import QsaIndexer
        self.s, self.n, self.d, self.gpu = stream, n, d, gpu
        self.owned: list[Any] = []
        H, hd, nh, bs = d["hidden"], d["hd"], d["n_heads"], d["block_size"]
        qkw = (nh + 1) * hd
        self.max_tokens = ceil_div(n + margin, d["ratio"]) * d["ratio"]
        w = (rng.standard_normal((qkw, H)) / math.sqrt(H)).astype(BF16)
        norms = [(rng.standard_normal(hd) * 0.1).astype(BF16) for _ in range(2)]
        self.host = dict(w=w, qn=norms[0], kn=norms[1])
        self.weights = [self._own(_upload(a, stream)) for a in (w, *norms)]
        slab = (rng.standard_normal((SLAB, H)) * 0.5).astype(BF16)
        self.slab = self._own(_upload(slab, stream))
        self.pps = ceil_div(self.max_tokens, bs)                      # pages per sequence
        row = d["nkv"] * d["hd_attn"] * 2
        self.k_pool, self.v_pool = (self._own(cm.DeviceBuffer(max_batch * self.pps * bs * row)) for _ in range(2))
        for pool in (self.k_pool, self.v_pool):
            cm.memset_d32_async(pool, 0x3F803F80, pool.bytes // 4, stream)   # bf16 1.0 everywhere
        tables = np.arange(max_batch * self.pps, dtype=np.int32).reshape(max_batch, self.pps)
        self.tables = self._own(_upload(tables, stream))
        self.normed = self._own(_upload(slab[:max_batch], stream))
        qa = (rng.standard_normal((max_batch, d["nq"], d["hd_attn"])) * 0.5).astype(BF16)
        self.q = self._own(_upload(qa, stream))
        self.out = self._own(cm.DeviceBuffer(qa.nbytes))

        def make() -> Any:
            idx = QsaIndexer(*self.weights, nh, hd, d["ratio"], d["budget"], d["rot"], d["theta"], d["eps"], H,
                             d["nkv"], d["hd_attn"], gpu, max_tokens=self.max_tokens, max_seqs=max_batch,
                             nq_attn=d["nq"])
            self.owned.append(idx)
            return idx

        self.make = make
        # one prefilled sequence, snapshotted into pinned memory and restored into every other state
        first = make()
        st0 = first.new_seq_state()
        for start in range(0, n - 1, SLAB):
            first.prefill_ingest(st0, self.slab, min(SLAB, n - 1 - start), start, stream)
        blob = first.snapshot_aux(st0, stream)
        self.blob = self._own(cm.PinnedBuffer(len(blob)))
        self.blob.array[:] = np.frombuffer(blob, np.uint8)
        states = [st0]
        self.layers = [(first, states)]
        self.add_states(first, states, max_batch)
        self.max_layers = 1
        self.grow(layers, max_batch)

    def _own(self, obj: Any) -> Any:
        self.owned.append(obj)
        return obj

    def add_states(self, idx: Any, states: list, count: int) -> None:
        while len(states) < count:
            st = idx.new_seq_state()
            idx.restore_aux(st, self.blob.array, self.s)
            states.append(st)
        cm.stream_sync(self.s)

    def grow(self, layers: int, max_batch: int) -> None:
        """Up to ``layers`` layers (fewer when the device memory runs short: ``max_layers`` says how many)."""
        from hss.errors import CudaError
        per_layer = max_batch * self.max_tokens * self.d["hd"] * 2 * (1 + 1 / self.d["ratio"])
        while len(self.layers) < layers:
            free, _ = cm.mem_info()
            if free < 1.3 * per_layer + (2 << 30):
                break
            try:
                idx = self.make()
                states: list = []
                self.add_states(idx, states, max_batch)
            except CudaError:
                break
            self.layers.append((idx, states))
        self.max_layers = len(self.layers)

    def normed_v(self, R: int) -> Any:
        return self.normed.view("bf16", (R, self.d["hidden"]))

    def tables_v(self, R: int) -> Any:
        return self.tables.view("i32", (R, self.pps))

    def q_v(self, R: int) -> Any:
        return self.q.view("bf16", (R, self.d["nq"], self.d["hd_attn"]))

    def step(self, R: int, layers: int = 1) -> Callable[[], None]:
        """One decode step of the first ``layers`` layers at batch R (a no-argument call)."""
        bs, s = self.d["block_size"], self.s
        work = [(idx, tuple(states[:R])) for idx, states in self.layers[:layers]]
        normed, tables, q, k, v, out = self.normed_v(R), self.tables_v(R), self.q_v(R), self.k_pool, self.v_pool, \
            self.out

        def run() -> None:
            for idx, states in work:
                sel = idx.decode_select_batch(states, normed, tables, bs, s)
                idx.sparse_decode_attention(q, k, v, None, sel, out, s)
        return run

    def close(self) -> None:
        for idx, states in self.layers:
            for st in states:
                idx.release_seq_state(st)
        for obj in reversed(self.owned):
            obj.close()


def _stages(c: _Context, R: int, gpu_t: _Gpu) -> dict[str, float]:
    """GPU µs of each stage at batch R (after a real step, so every pack holds this batch's values)."""
    idx, states = c.layers[0]
    c.step(R)()
    dev, s, d = idx._dev, c.s, c.d
    x = c.normed.ptr
    out = {
        "qk": gpu_t.us(lambda: idx._gemm(x, R, s)),
        "qk_kernel": _qk_kernel_us(dev, x, R, gpu_t),
        "prep": gpu_t.us(lambda: dev.run_prep(s, R, d["n_heads"] + 2)),
        "score": gpu_t.us(lambda: dev.run_score(s, dev.score_gx, R)),
        "topk": gpu_t.us(lambda: dev.run_topk(s, R)),
        "attn": gpu_t.us(lambda: dev.run_attn(s, R, d["nkv"], dev.splits)),
        "merge": gpu_t.us(lambda: dev.run_merge(s, R, d["nq"])),
    }
    for st in states[:R]:   # the top-k launches advanced the device positions: put them back
        dev.store_pos(st, s)
    cm.stream_sync(s)
    return out


def _graph(c: _Context, R: int, layers: int) -> Any:
    s = c.s
    step = c.step(R, layers)
    step()                       # eager first: the batch's composition is cached, every buffer touched
    cm.stream_sync(s)
    cm.begin_capture(s)
    try:
        step()
    finally:
        graph = cm.end_capture(s)
    return graph


def _qk_kernel_us(dev: Any, x: int, R: int, gpu_t: _Gpu) -> float | None:
    """GPU µs of ``qsa_dev_qk`` for the batch (None past its QK_MAX_ROWS rows)."""
    from hss.decls import qsa_device as kd
    if R > kd.QK_MAX_ROWS:
        return None
    dev.qk_act.value, dev.qk_rows.value = x, R
    return gpu_t.us(lambda: dev.run_qk(gpu_t.s, dev.qk_gx))


def _opt_in_step(c: _Context, R: int, gpu_t: _Gpu) -> float | None:
    """GPU µs of one layer's graph-replayed step with the opt-ins on: ``qsa_dev_qk`` for up to QK_MAX_ROWS rows
    (``HSS_QSA_QK_KERNEL=1``) and programmatic launches where the sm_90 PTX is served (``HSS_QSA_PDL=1``)."""
    from hss.decls import qsa_device as kd
    dev = c.layers[0][0]._dev
    rows, pdl = dev.qk_max_rows, dev.pdl
    dev.qk_max_rows = kd.QK_MAX_ROWS
    dev.use_pdl(True)
    try:
        g = _graph(c, R, 1)
        try:
            return gpu_t.us(lambda: g.launch(c.s))
        finally:
            g.close()
    finally:
        dev.qk_max_rows = rows
        dev.use_pdl(pdl)


def _host_path(c: _Context, R: int, steps: int) -> float:
    """Wall µs per step of the host path for R sequences: decode_select (each blocks on its scores' D2H), then
    TiledAttention over the gathered scratch."""
    from hss.attention import TiledAttention, TiledAttentionDims
    idx, states = c.layers[0]
    d, s, bs = c.d, c.s, c.d["block_size"]
    ta = TiledAttention(idx.gpu.ctx, TiledAttentionDims(1, d["nq"], d["nkv"], d["hd_attn"], bs,
                                                        ceil_div(idx.sel_cap, bs)))
    counts = cm.DeviceBuffer(4)
    strides = ta.paged_strides()
    row, qrow = d["hidden"] * 2, d["nq"] * d["hd_attn"] * 2
    try:
        def step() -> None:
            for r in range(R):
                st = states[r]
                sel = idx.decode_select(st, c.normed.ptr + r * row, st.ingested, c.k_pool, c.v_pool,
                                        c.tables.ptr + 4 * r * c.pps, bs, s)
                if sel is None:
                    continue
                cm.memset_d32_async(counts, sel.max_blocks, 1, s)
                ta.begin_step(s, 1)
                ta.step_tile(s, c.q.ptr + r * qrow, sel.k_scratch, sel.v_scratch, sel.table_dev, counts, 1, *strides,
                             sel.n_sel - (sel.max_blocks - 1) * bs, output=c.out.ptr + r * qrow)
        return host_us({"host": Case(step, lambda: cm.stream_sync(s))}, batch=steps, batches=1, warmup=1,
                       timed_sync=True)["host"].us
    finally:
        ta.close()
        counts.close()


def _row(c: _Context, R: int, layers: int, gpu_t: _Gpu, smoke: bool, torch_ok: bool, notes: list) -> dict:
    s = c.s
    row: dict[str, Any] = {"visible": c.n, "batch": R}
    row.update({f"{k}_us": v for k, v in _stages(c, R, gpu_t).items()})
    g1 = _graph(c, R, 1)
    row["step_us"] = gpu_t.us(lambda: g1.launch(s))
    g1.close()
    row["step_opt_us"] = _opt_in_step(c, R, gpu_t)
    n_host = (2, 1) if smoke else (20, 5)
    row["eager_host_us"] = host_us({"eager": Case(c.step(R), lambda: cm.stream_sync(s))}, batch=n_host[0],
                                   batches=n_host[1], warmup=2)["eager"].us
    row["layers"] = used = min(layers, c.max_layers)
    if used < layers:
        notes.append(f"{c.n} tokens, batch {R}: the graph holds {used} layers, not {layers} (device memory)")
    g = _graph(c, R, used)
    t = host_us({"launch": Case(lambda: g.launch(s), lambda: cm.stream_sync(s))}, batch=n_host[0],
                batches=n_host[1], warmup=2)
    row["graph_host_us"] = t["launch"].us
    row["graph_wall_us"] = host_us({"wall": Case(lambda: g.launch(s), lambda: cm.stream_sync(s))},
                                   batch=n_host[0], batches=n_host[1], warmup=1, timed_sync=True)["wall"].us
    g.close()
    row["host_path_us"] = _host_path(c, R, 2 if smoke else max(3, 40 // R))
    row.update(torch_peers(c, R, gpu_t, notes) if torch_ok else {})
    return row


# -- PyTorch peers -------------------------------------------------------------------------------------------
def torch_peers(c: _Context, R: int, gpu_t: _Gpu, notes: list) -> dict:
    """torch eager step (wall µs per step), torch.topk alone and dense SDPA (GPU µs), on the hss stream."""
    import torch
    out: dict[str, Any] = {}
    ext = torch.cuda.ExternalStream(c.s)
    with torch.cuda.stream(ext):
        for key, fn in (("torch_topk_us", _torch_topk), ("sdpa_dense_us", _sdpa_dense), ("torch_step_us", _torch_step)):
            try:
                out[key] = fn(torch, c, R, gpu_t)
            except Exception as exc:   # out of memory, a backend that refuses the layout: say so, keep going
                notes.append(f"{c.n} tokens, batch {R}: {key} skipped ({type(exc).__name__}: {str(exc)[:120]})")
                out[key] = None
            torch.cuda.empty_cache()
    return out


def _view(torch: Any, buf: Any, dtype: str, shape: tuple) -> Any:
    return torch.from_dlpack(buf.view(dtype, shape) if isinstance(buf, cm.DeviceBuffer) else buf)


def _torch_topk(torch: Any, c: _Context, R: int, gpu_t: _Gpu) -> float:
    """torch.topk alone on the step's own scores (the last step's rows of scores_b)."""
    idx = c.layers[0][0]
    c.step(R)()
    cm.stream_sync(c.s)
    complete = (c.layers[0][1][0].ingested) // c.d["ratio"]
    dev = idx._dev
    buf = cm.DeviceBuffer(4 * R * dev.max_blocks)   # a copy: torch reads no buffer the indexer owns
    try:
        cm.copy_d_to_d_async(buf, dev.scores_b, buf.bytes, c.s)
        scores = _view(torch, buf, "f32", (R, dev.max_blocks))[:, :complete]
        k = idx.block_topk
        return gpu_t.us(lambda: torch.topk(scores, k, dim=-1))
    finally:
        cm.stream_sync(c.s)
        buf.close()


def _sdpa_dense(torch: Any, c: _Context, R: int, gpu_t: _Gpu) -> float:
    d, n = c.d, c.n
    F = torch.nn.functional
    tok = c.pps * d["block_size"]
    shape = (R, tok, d["nkv"], d["hd_attn"])
    k = _view(torch, c.k_pool, "bf16", (c.k_pool.bytes // 2,))[:math.prod(shape)].view(shape)[:, :n].transpose(1, 2)
    v = _view(torch, c.v_pool, "bf16", (c.v_pool.bytes // 2,))[:math.prod(shape)].view(shape)[:, :n].transpose(1, 2)
    q = _view(torch, c.q, "bf16", (c.q.bytes // 2,))[:R * d["nq"] * d["hd_attn"]].view(R, d["nq"], 1, d["hd_attn"])
    return gpu_t.us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), reps=5)


def _torch_step(torch: Any, c: _Context, R: int, gpu_t: _Gpu) -> float:
    """The same step in PyTorch eager (every sequence at one position), wall µs per step, synchronised at the end."""
    d, dev_t, bs = c.d, torch.device("cuda"), c.d["block_size"]

    def t(a: np.ndarray) -> Any:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(dev_t)

    pages = c.k_pool.bytes // (bs * d["nkv"] * d["hd_attn"] * 2)
    step = torch_step_fn(torch, d, R, c.n, c.max_tokens, dev_t, t(c.host["w"]), t(c.host["qn"]), t(c.host["kn"]),
                         _view(torch, c.normed, "bf16", (c.normed.bytes // 2,))[:R * d["hidden"]].view(R, -1),
                         _view(torch, c.q, "bf16", (c.q.bytes // 2,))[:R * d["nq"] * d["hd_attn"]],
                         _view(torch, c.k_pool, "bf16", (pages, bs, d["nkv"], d["hd_attn"])),
                         _view(torch, c.v_pool, "bf16", (pages, bs, d["nkv"], d["hd_attn"])),
                         _view(torch, c.tables, "i32", (c.tables.bytes // 4,))[:R * c.pps].view(R, c.pps))
    steps = 20 if R <= 8 else 8
    return host_us({"torch": Case(step, torch.cuda.synchronize)}, batch=steps, batches=1, warmup=3,
                   timed_sync=True)["torch"].us


def torch_step_fn(torch: Any, d: dict, R: int, n: int, max_tokens: int, dev_t: Any, W: Any, QN: Any, KN: Any, X: Any,
                  Q: Any, kpool: Any, vpool: Any, tab: Any) -> Callable[[], None]:
    """A no-argument PyTorch eager decode step of R sequences at positions n - 1, n, ... (one per call): ``W``
    [qkw, hidden], ``QN`` / ``KN`` [hd] bf16, ``X`` [R, hidden] bf16, ``Q`` the [R * nq * hd_attn] bf16 queries,
    NHD pools, ``tab`` [R, pages] int page tables; raw and block keys are random torch tensors of its own."""
    nh, hd, ratio, bs, rot = d["n_heads"], d["hd"], d["ratio"], d["block_size"], d["rot"]
    K, half, F = d["budget"] // ratio, rot // 2, torch.nn.functional
    QN, KN, tab = QN.float(), KN.float(), tab.long()
    Q = Q.view(R, d["nq"], 1, d["hd_attn"])
    raw = torch.randn(R, max_tokens, hd, device=dev_t).to(torch.bfloat16)
    blocks = torch.randn(R, max_tokens // ratio, hd, device=dev_t).to(torch.bfloat16)
    inv_freq = torch.exp(-(2.0 * torch.arange(half, device=dev_t, dtype=torch.float64) / rot) * math.log(d["theta"]))
    ar = torch.arange(ratio, device=dev_t)

    def norm(x: Any, wt: Any) -> Any:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + d["eps"]) * (1.0 + wt)

    def rope(x: Any, p: int) -> Any:
        ang = (p * inv_freq).float()
        cos, sin = torch.cos(ang), torch.sin(ang)
        x1, x2 = x[..., :half], x[..., half:rot]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], dim=-1)

    pos = [n - 1]

    def step() -> None:
        p = pos[0]
        pos[0] += 1
        qk = X @ W.T                                                   # [R, qkw]
        raw[:, p] = qk[:, nh * hd:]
        visible = p + 1
        complete = visible // ratio
        if visible % ratio == 0:                                       # a block completed: pool it
            b = complete - 1
            blocks[:, b] = rope(norm(raw[:, b * ratio:visible].float().mean(1), KN), b * ratio).to(torch.bfloat16)
        q = rope(norm(qk[:, :nh * hd].float().view(R, nh, hd), QN), p).to(torch.bfloat16)
        scores = torch.relu(torch.matmul(blocks[:, :complete], q.transpose(1, 2)).float()).sum(-1) / math.sqrt(hd)
        chosen = torch.sort(torch.topk(scores, min(K, complete), dim=-1).indices, dim=-1).values
        tail = torch.arange(complete * ratio, visible, device=dev_t).expand(R, -1)
        sel = torch.cat([(chosen[..., None] * ratio + ar).flatten(1), tail], dim=1)       # [R, n_sel]
        page, slot = tab.gather(1, sel // bs), sel % bs
        kg = kpool[page, slot].transpose(1, 2)                         # [R, nkv, n_sel, hd]
        vg = vpool[page, slot].transpose(1, 2)
        F.scaled_dot_product_attention(Q, kg, vg, enable_gqa=True)

    return step


# -- driver ----------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.smoke:
        os.environ.setdefault("HSS_DRIVER", "emulator")
    from hss.cuda.gpu import CudaBackend
    from hss.errors import CudaError, HssError
    d = SMOKE_DIMS if args.smoke else DIMS
    torch_ok, notes = not args.no_torch, []
    if torch_ok:
        try:
            import torch
            torch_ok = torch.cuda.is_available()
            if not torch_ok:
                notes.append("PyTorch peers skipped: torch sees no CUDA device")
        except ImportError:
            torch_ok = False
            notes.append("PyTorch peers skipped: torch is not installed")
    elif args.smoke:
        notes.append("PyTorch peers skipped: --smoke")
    ctx = cm.CudaCtx(0)
    gpu = CudaBackend(ctx)
    s = cm.CudaStream(ctx)
    gpu_t = _Gpu(s.handle, args.smoke)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    try:
        for n in args.contexts:
            max_batch = max(args.batches)
            try:
                c = _Context(gpu, s.handle, n, d, max_batch, args.layers, args.margin, rng)
            except (CudaError, HssError) as exc:
                notes.append(f"{n} tokens skipped: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            try:
                for R in args.batches:
                    try:
                        rows.append(_row(c, R, args.layers, gpu_t, args.smoke, torch_ok, notes))
                    except (CudaError, HssError) as exc:
                        notes.append(f"{n} tokens, batch {R} skipped: {type(exc).__name__}: {str(exc)[:160]}")
            finally:
                c.close()
    finally:
        gpu_t.close()
        s.close()
        gpu.close()
        ctx.close()
    if rows:
        rows[0]["notes"] = notes
    return rows


def _f(v: Any, fmt: str = ".1f") -> str:
    return "—" if v is None else format(v, fmt)


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else "met" if ok else "NOT met"


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| visible | batch | qk GEMM | qsa_dev_qk | prep | score | top-k | attn | merge | step (graph) | "
           "step, opt-ins | eager host/step | graph layers | graph host/replay | graph wall/token |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['visible']} | {r['batch']} | {_f(r['qk_us'])} | {_f(r.get('qk_kernel_us'))} | " +
                   " | ".join(_f(r[f'{k}_us']) for k in STAGES[1:]) +
                   f" | {_f(r['step_us'])} | {_f(r.get('step_opt_us'))} | {_f(r['eager_host_us'])} | "
                   f"{r['layers']} | {_f(r['graph_host_us'])} | {_f(r['graph_wall_us'])} |")
    out += ["", "| visible | batch | hss device step | hss host path/step | torch eager/step | torch.topk | "
                "device top-k | dense SDPA |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['visible']} | {r['batch']} | {_f(r['step_us'])} | {_f(r['host_path_us'])} | "
                   f"{_f(r.get('torch_step_us'))} | {_f(r.get('torch_topk_us'))} | {_f(r['topk_us'])} | "
                   f"{_f(r.get('sdpa_dense_us'))} |")
    out.append("\nµs. Stage columns, step (graph), torch.topk, device top-k and dense SDPA: GPU time (CUDA events, "
               "back to back behind a blocker); eager host: host µs per step (two calls); graph host: host µs per "
               "CudaGraph.launch; graph wall, host path, torch eager: wall µs per step of back-to-back steps.")
    out.append("\n" + "\n".join(_targets(rows)))
    for note in rows[0].get("notes", []) if rows else []:
        out.append(f"\n{note}")
    return "\n".join(out)


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    at = {(r["visible"], r["batch"]): r for r in rows}
    b32, b128, b64 = at.get((32768, 1)), at.get((131072, 1)), at.get((32768, 64))
    lines = ["Targets (batch 1 unless said):"]

    def line(text: str, value: Any, ok: bool | None) -> None:
        lines.append(f"- {text}: {_verdict(ok)} ({value})")

    if b32:
        tk, tt = b32["topk_us"], b32.get("torch_topk_us")
        line("device top-k at 32K <= 10 µs", f"{tk:.1f} µs", tk <= 10)
        line("device top-k >= 5x faster than torch.topk at 32K", "—" if tt is None else f"{tt / tk:.1f}x",
             None if tt is None else tt >= 5 * tk)
        line("one layer's step <= 30 µs GPU at 32K", f"{b32['step_us']:.1f} µs", b32["step_us"] <= 30)
        full = b32["layers"] == 12
        line("12-layer graph replay <= 0.45 ms per token at 32K", f"{b32['graph_wall_us']:.0f} µs wall, "
             f"{b32['layers']} layers", b32["graph_wall_us"] <= 450 if full else None)
    if b128:
        line("one layer's step <= 40 µs GPU at 128K", f"{b128['step_us']:.1f} µs", b128["step_us"] <= 40)
    if b32 and b64:
        line("batch 64 at 32K <= 8x batch 1's step", f"{b64['step_us'] / b32['step_us']:.1f}x",
             b64["step_us"] <= 8 * b32["step_us"])
    if len(lines) == 1:
        lines.append("- (no 32K / 128K rows in this run)")
    return lines


if __name__ == "__main__":
    a = parse_args()
    print(table(run(a)))
