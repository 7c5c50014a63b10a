"""hss against Hugging Face ``transformers`` on the same checkpoint files, written by :func:`hss.checkpoint.save_hf`.

- GPU (``gpu`` marker; torch with CUDA, and transformers): hss's device model loop (:class:`hss.model.DeviceModel`,
  ``hbm`` session with CUDA graphs) against ``LlamaForCausalLM`` in float32 on CUDA, on (a) a tiny random Llama
  checkpoint in bf16 and (b) SmolLM2-135M-Instruct converted from its GGUF to a bf16 checkpoint: the prefill logits of
  every prompt row under :func:`parity_bound` (which the same model with one layer's weight perturbed must miss), and
  greedy tokens that are transformers' argmax (teacher-forced on hss's tokens) except at near ties.
- CPU (torch and transformers where installed, no device): hss's numpy forward against transformers on the CPU, both
  float32 (:data:`F32_REL`); and, needing nothing, hss's numpy forward on a checkpoint directory against the same
  weights read from a GGUF, bit for bit.

The bound. Both sides hold the same weights: the checkpoint is bf16, so transformers' float32 copy and hss's bf16
upload are the same values (norm gains included: hss keeps them f32, they are bf16 values). What separates the logits
is hss's device arithmetic (hss/model/forward.py): f32 accumulation and an f32 residual stream, but every activation
between kernels rounded to bf16. Per layer that is ``ROUNDINGS`` = 9 roundings: the normed input of the attention,
the qkv GEMM output (k and v as cached), q after RoPE, the attention output, the o-projection's delta, the normed
input of the MLP, gate|up, silu(gate)*up, the down-projection's delta; then the logits themselves. A bf16 rounding (8
significant bits) moves a value by at most ``U`` = 2^-8 of itself, spread evenly (standard deviation U/sqrt(3)). The
layers in between are near norm-preserving (RMSNorm, residual adds), so the roundings' effects on the final hidden
state add up as a random walk: relative standard deviation sqrt(ROUNDINGS * n_layer) * U / sqrt(3), and a logit (a dot
product with that state) errs by about that fraction of its row's scale, max |logit|. Two standard deviations give

    |hss - hf| <= 2^-7 |hf| + (2 sqrt(9 n_layer) 2^-8 / sqrt(3) + 1e-4) * max_row |hf|

The first term is the final bf16 rounding of the logit (one bf16 ulp, at most 2^-7 of it); the 1e-4 covers float32
against float32 in another summation order (K 2^-24 per dot, K <= 1536, and the f32 softmax). That is 0.019 of the
row's max at 2 layers and 0.074 at SmolLM2's 30. Measured with the device loop on the emulator against transformers
on the CPU, the worst logit used 0.30 of the bound on the tiny model and 0.33 on SmolLM2 (0.024 of the row max); with
layer 0's down projection scaled by 1.25 the same logits lie 8.8 and 6.9 bounds from transformers', so the mutation
check bites with room to spare.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_model_files import gguf_bytes, tiny_metadata, tiny_tensors
from test_realmodel import TINY, TOKENS, smollm2_path, tiny_tokenizer

from hss.checkpoint import Config, Weights, english_text, forward, load_model, random_weights, save_hf

U = 2.0 ** -8       # bf16 unit roundoff
ROUNDINGS = 9       # bf16 roundings per layer on the device
F32_ORDER = 1e-4    # float32 against float32, another summation order
F32_REL = 1e-4      # the CPU comparison: hss's numpy forward and transformers, both float32
PERTURBED_LAYER, PERTURBATION = 0, 1.25   # the mutation: this layer's down projection scaled
# what the device model loop takes: head_dim 64 (model_prefill_attn's only one)
PARITY = Config(n_layer=2, dim=128, n_head=4, n_kv_head=2, head_dim=64, ffn_dim=256, vocab_size=len(TOKENS),
                rope_theta=10000.0, norm_eps=1e-5, context_length=512)


def device_rel(n_layer: int) -> float:
    """Two standard deviations of the random walk of ``ROUNDINGS * n_layer`` bf16 roundings (the docstring)."""
    return 2 * math.sqrt(ROUNDINGS * n_layer) * U / math.sqrt(3)


def parity_bound(ref: np.ndarray, n_layer: int) -> np.ndarray:
    """The per-entry bound of the docstring for transformers' logits ``ref [..., vocab]``."""
    a = np.abs(np.asarray(ref, np.float64))
    return 2.0 ** -7 * a + (device_rel(n_layer) + F32_ORDER) * a.max(axis=-1, keepdims=True)


def outside(got: np.ndarray, ref: np.ndarray, bound: np.ndarray) -> np.ndarray:
    return np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64)) > bound


def describe_outside(got: np.ndarray, ref: np.ndarray, bound: np.ndarray, what: str) -> str:
    bad = outside(got, ref, bound)
    where = [tuple(int(i) for i in w) for w in np.argwhere(bad)[:4]]
    return f"{what}: {int(bad.sum())} of {bad.size} logits outside the bound, e.g. " + ", ".join(
        f"{w}: hss {got[w]:.5g} hf {ref[w]:.5g} bound {bound[w]:.3g}" for w in where)


def judge_greedy(forced: np.ndarray, tokens: Sequence[int], bound: np.ndarray) -> tuple[int, int, list[int]]:
    """(exact, near ties, wrong positions) of hss's greedy ``tokens`` against transformers' logits ``forced`` (row i
    predicted tokens[i], teacher-forced on hss's tokens): a token that is not the argmax is a near tie when its logit
    is within the two entries' bounds of the max."""
    exact, near, wrong = 0, 0, []
    for i, t in enumerate(tokens):
        row, top = forced[i], int(np.argmax(forced[i]))
        if t == top:
            exact += 1
        elif row[t] >= row[top] - bound[i, top] - bound[i, t]:
            near += 1
        else:
            wrong.append(i)
    return exact, near, wrong


# ---- transformers ------------------------------------------------------------------------------------------------
def _torch_and_transformers(device: str) -> tuple[Any, Any]:
    torch = pytest.importorskip("torch", reason="the parity tests run Hugging Face transformers on torch")
    transformers = pytest.importorskip("transformers", reason="the parity tests compare with Hugging Face "
                                       "transformers (pip install transformers)")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch, transformers


class HfLlama:
    """``LlamaForCausalLM`` from ``directory`` in float32 on ``device`` (eager attention, no TF32): :meth:`logits`
    of one sequence, :meth:`perturb` scales one layer's down projection in place."""

    def __init__(self, directory: Path, device: str) -> None:
        self.torch, transformers = _torch_and_transformers(device)
        major = int(transformers.__version__.split(".")[0])
        dtype = {"dtype" if major >= 5 else "torch_dtype": self.torch.float32}
        self.model = transformers.LlamaForCausalLM.from_pretrained(str(directory), attn_implementation="eager",
                                                                   **dtype).to(device).eval()
        assert next(self.model.parameters()).dtype == self.torch.float32
        self.device = device

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        torch = self.torch
        with torch.no_grad():
            out = self.model(torch.tensor([list(ids)], device=self.device)).logits[0]
        return out.double().cpu().numpy()

    def perturb(self, layer: int, factor: float) -> None:
        with self.torch.no_grad():
            self.model.model.layers[layer].mlp.down_proj.weight.mul_(factor)


@contextlib.contextmanager
def hf_llama(directory: Path, device: str) -> Iterator[HfLlama]:
    torch, _ = _torch_and_transformers(device)
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = None
    try:
        model = HfLlama(directory, device)
        yield model
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


def parity_weights(seed: int) -> Weights:
    """Random weights of :data:`PARITY` with an untied LM head (tied random embeddings favour one token)."""
    w = random_weights(PARITY, seed, scale=1.0)
    head = np.random.default_rng(seed + 1).standard_normal((PARITY.vocab_size, PARITY.dim))
    return dataclasses.replace(w, lm_head=(0.5 * head).astype(np.float32))


def tiny_prompt(n: int = 48) -> list[int]:
    return tiny_tokenizer().encode(english_text("zen"))[:n]


def smollm2_prompt(tokenizer, n: int = 128) -> list[int]:
    ids = tokenizer.encode(english_text("python"))[:n]
    if len(ids) < n:
        pytest.skip(f"the English text gave only {len(ids)} tokens")
    return ids


# ---- the device model loop against transformers (GPU) --------------------------------------------------------------
def device_parity(ctx: Any, directory: Path, ids: list[int], n: int, device: str = "cuda") -> tuple[int, int]:
    """hss's device loop and transformers on the checkpoint in ``directory``: prefill logits under the bound (and
    the perturbed model outside it), ``n`` greedy tokens judged. Returns (exact, near ties)."""
    from hss.model import DeviceModel

    weights = load_model(directory).weights
    with DeviceModel(weights, ctx) as model, model.session("hbm", max_tokens=len(ids) + n + 1, graph=True) as sess:
        got = sess.prefill(ids, all_logits=True)
        tokens = sess.generate(n)
    with hf_llama(directory, device) as hf:
        ref = hf.logits(ids)
        forced = hf.logits(ids + tokens[:-1])[len(ids) - 1:]
        hf.perturb(PERTURBED_LAYER, PERTURBATION)
        mutated = hf.logits(ids)
    n_layer = weights.config.n_layer
    bound = parity_bound(ref, n_layer)
    assert not outside(got, ref, bound).any(), describe_outside(got, ref, bound, "prefill logits")
    assert outside(got, mutated, parity_bound(mutated, n_layer)).any(), \
        "the bound does not bite: the model with a perturbed layer passes too"
    exact, near, wrong = judge_greedy(forced, tokens, parity_bound(forced, n_layer))
    assert not wrong, f"greedy tokens {wrong} are neither transformers' argmax nor near ties ({exact} exact of {n})"
    return exact, near


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_device_loop_matches_transformers_on_a_tiny_checkpoint(ctx, tmp_path, seed):
    directory = save_hf(parity_weights(seed), tiny_tokenizer(), tmp_path / "tiny", "bf16")
    exact, _ = device_parity(ctx, directory, tiny_prompt(), 16)
    assert exact >= 14


@pytest.mark.gpu
def test_device_loop_matches_transformers_on_smollm2(ctx, tmp_path):
    gguf_model = load_model(smollm2_path())
    directory = save_hf(gguf_model, None, tmp_path / "smollm2", "bf16")
    ids = smollm2_prompt(gguf_model.tokenizer)
    _, transformers = _torch_and_transformers("cuda")
    hf_ids = transformers.AutoTokenizer.from_pretrained(str(directory))(english_text("python"),
                                                                         add_special_tokens=False).input_ids
    assert hf_ids[:len(ids)] == ids, "transformers' tokenizer disagrees with hss's on the written tokenizer.json"
    exact, _ = device_parity(ctx, directory, ids, 32)
    assert exact >= 28


# ---- hss's numpy forward against transformers (CPU) -----------------------------------------------------------------
def numpy_parity(directory: Path, ids: list[int]) -> None:
    weights = load_model(directory).weights
    ours = forward(weights, ids).astype(np.float64)
    with hf_llama(directory, "cpu") as hf:
        ref = hf.logits(ids)
    bound = F32_REL * np.abs(ref).max(axis=-1, keepdims=True)
    assert not outside(ours, ref, bound).any(), describe_outside(ours, ref, bound, "numpy forward logits")
    mutated = dataclasses.replace(weights.layers[PERTURBED_LAYER], w_down=weights.layers[PERTURBED_LAYER].w_down
                                  * np.float32(PERTURBATION))
    layers = list(weights.layers)
    layers[PERTURBED_LAYER] = mutated
    other = forward(dataclasses.replace(weights, layers=tuple(layers)), ids)
    assert outside(other, ref, bound).any(), "the bound does not bite"


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_numpy_forward_matches_transformers_on_a_tiny_checkpoint(tmp_path, dtype):
    numpy_parity(save_hf(parity_weights(3), tiny_tokenizer(), tmp_path / "tiny", dtype), tiny_prompt())


def test_numpy_forward_matches_transformers_on_smollm2(tmp_path):
    _torch_and_transformers("cpu")
    gguf_model = load_model(smollm2_path())
    directory = save_hf(gguf_model, None, tmp_path / "smollm2", "bf16")
    numpy_parity(directory, smollm2_prompt(gguf_model.tokenizer, 64))


# ---- the numpy forward on a checkpoint directory and on the GGUF (CPU, nothing optional) -----------------------------
def test_numpy_forward_of_a_checkpoint_equals_the_gguf_one(tmp_path):
    tensors, _ = tiny_tensors(random_weights(TINY, seed=9))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(gguf_bytes(tiny_metadata(), tensors))
    from_gguf = load_model(path)
    from_dir = load_model(save_hf(from_gguf, None, tmp_path / "hf", "f32"))
    ids = from_gguf.tokenizer.encode("hello world, hello 42")
    assert from_dir.tokenizer.encode("hello world, hello 42") == ids
    assert np.array_equal(forward(from_dir.weights, ids), forward(from_gguf.weights, ids))


def test_smollm2_numpy_forward_of_a_checkpoint_equals_the_gguf_one(tmp_path):
    from_gguf = load_model(smollm2_path())
    from_dir = load_model(save_hf(from_gguf, None, tmp_path / "hf", "f32"))
    text = english_text("zen")
    ids = from_gguf.tokenizer.encode(text)[:48]
    assert from_dir.tokenizer.encode(text)[:48] == ids
    assert np.array_equal(forward(from_dir.weights, ids), forward(from_gguf.weights, ids))
