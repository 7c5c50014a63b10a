"""Model files: hss's GGUF and safetensors readers, Hugging Face checkpoint directories, the HF writer, fuzzing.

Every malformed file must give an HssError that names it (never a traceback from numpy, struct or json), in bounded
time and without allocating for lengths the file cannot hold. Tiny files are written here by a GGUF writer of the
tests' own (so nothing needs the ``gguf`` package) and by :func:`hss.checkpoint.save_hf`; the ``gguf``,
``safetensors`` and ``tokenizers`` packages, where installed, cross-check the readers and the written files. The
SmolLM2-135M tests need its GGUF (``HSS_SMOLLM2_GGUF`` or the default lookup) and skip without it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
import time
import tracemalloc
import types
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_realmodel import MERGES, TEMPLATE, TINY, TOKENS, TYPES, converter_permute, smollm2_path, tiny_tokenizer

from hss.checkpoint import forward, load_model, load_tokenizer, random_weights, save_hf
from hss.checkpoint.export import hf_tensors
from hss.checkpoint.gguf import read_gguf
from hss.checkpoint.quants import GGML_TYPE_NAMES, GGML_TYPES, dequantize
from hss.checkpoint.safetensors import read_safetensors, write_safetensors
from hss.checkpoint.tokenizer import Tokenizer
from hss.errors import HssError

F32 = np.float32
RUNS = {"emulator": 150, "gpu": 150, "sanitize": 5}
FUZZ = settings(settings.default, max_examples=RUNS.get(settings._current_profile, 150))
LOAD_SECONDS, LOAD_BYTES = 10.0, 64 << 20   # a tiny file loads or fails within these, whatever its bytes say


# ---- a GGUF writer of the tests' own ------------------------------------------------------------------------
U8, I8, U16, I16, U32, I32, FLOAT32, BOOL, STR, ARR, U64, I64, FLOAT64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", FLOAT32: "<f", BOOL: "<?", U64: "<Q",
        I64: "<q", FLOAT64: "<d"}


def gguf_value(vtype: int, value: Any) -> bytes:
    if vtype == STR:
        raw = value if isinstance(value, bytes) else value.encode("utf-8")
        return struct.pack("<Q", len(raw)) + raw
    if vtype == ARR:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(gguf_value(etype, v) for v in items)
    return struct.pack(_FMT[vtype], value)


def gguf_bytes(metadata: list[tuple[str, int, Any]], tensors: list[tuple[str, int, tuple[int, ...], bytes]],
               pack: int = 32, version: int = 3) -> bytes:
    """A GGUF: ``metadata`` (key, value type, value; arrays as (element type, items)), ``tensors`` (name, GGML type,
    numpy shape, raw bytes), the data packed at multiples of ``pack``."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata)))
    for key, vtype, value in metadata:
        out += gguf_value(STR, key) + struct.pack("<I", vtype) + gguf_value(vtype, value)
    data = bytearray()
    for name, ggml_type, shape, raw in tensors:
        ne = tuple(reversed(shape))
        out += gguf_value(STR, name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ggml_type, len(data))
        data += raw + b"\0" * (-len(raw) % pack)
    return bytes(out + b"\0" * (-len(out) % pack) + data)


def q8_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Q8_0 blocks of ``x`` and the float32 values they decode to."""
    b = x.reshape(-1, 32).astype(F32)
    d = (np.abs(b).max(1, keepdims=True) / 127).astype(np.float16)
    q = np.round(b / np.maximum(d.astype(F32), 1e-8)).clip(-127, 127).astype(np.int8)
    return np.concatenate([d.view(np.uint8), q.view(np.uint8)], 1).tobytes(), \
        (q.astype(F32) * d.astype(F32)).reshape(x.shape)


def q4_1(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Q4_1 blocks of ``x`` (low nibbles: elements 0-15, high: 16-31) and the float32 values they decode to."""
    b = x.reshape(-1, 32).astype(F32)
    lo = b.min(1, keepdims=True).astype(np.float16)
    d = ((b.max(1, keepdims=True) - lo.astype(F32)) / 15).astype(np.float16)
    q = np.round((b - lo.astype(F32)) / np.maximum(d.astype(F32), 1e-8)).clip(0, 15).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8), lo.view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], 1).tobytes()
    return raw, ((d.astype(F32) * q.astype(F32)) + lo.astype(F32)).reshape(x.shape)


def tiny_metadata(config=TINY, tokens=TOKENS, types_=TYPES) -> list[tuple[str, int, Any]]:
    c = config
    return [("general.architecture", STR, "llama"), ("general.alignment", U32, 32),
            ("llama.block_count", U32, c.n_layer), ("llama.context_length", U32, c.context_length),
            ("llama.embedding_length", U32, c.dim), ("llama.feed_forward_length", U32, c.ffn_dim),
            ("llama.attention.head_count", U32, c.n_head), ("llama.attention.head_count_kv", U32, c.n_kv_head),
            ("llama.attention.key_length", U32, c.head_dim), ("llama.rope.dimension_count", U32, c.head_dim),
            ("llama.rope.freq_base", FLOAT32, c.rope_theta),
            ("llama.attention.layer_norm_rms_epsilon", FLOAT32, c.norm_eps), ("llama.vocab_size", U32, c.vocab_size),
            ("tokenizer.ggml.model", STR, "gpt2"), ("tokenizer.ggml.pre", STR, "smollm"),
            ("tokenizer.ggml.tokens", ARR, (STR, tokens)), ("tokenizer.ggml.token_type", ARR, (I32, types_)),
            ("tokenizer.ggml.merges", ARR, (STR, MERGES)), ("tokenizer.ggml.bos_token_id", U32, 1),
            ("tokenizer.ggml.eos_token_id", U32, 2), ("tokenizer.chat_template", STR, TEMPLATE),
            ("general.tags", ARR, (STR, ["a", "b"])), ("test.flags", ARR, (BOOL, [True, False])),
            ("test.i8", I8, -5), ("test.u16", U16, 65535), ("test.i16", I16, -300), ("test.i64", I64, -2**40),
            ("test.u64", U64, 2**63), ("test.f64", FLOAT64, 0.1), ("test.bool", BOOL, True), ("test.u8", U8, 7),
            ("test.floats", ARR, (FLOAT32, [0.5, -2.0]))]


def tiny_tensors(weights) -> tuple[list[tuple[str, int, tuple[int, ...], bytes]], Any]:
    """The GGUF tensors of ``weights`` as llama.cpp's converter writes them (Q/K rows permuted; the embedding in
    Q8_0 and the up projections in Q4_1) and the float32 weights they decode to."""
    c = weights.config
    embed_raw, embed = q8_0(weights.embed)
    out = [("token_embd.weight", GGML_TYPE_NAMES["Q8_0"], embed.shape, embed_raw),
           ("output_norm.weight", 0, (c.dim,), weights.final_norm.tobytes())]
    layers = []
    for i, layer in enumerate(weights.layers):
        up_raw, up = q4_1(layer.w_up)
        p = f"blk.{i}."
        out += [(p + "attn_q.weight", 0, layer.wq.shape, converter_permute(layer.wq, c.n_head, c.n_head).tobytes()),
                (p + "attn_k.weight", 0, layer.wk.shape,
                 converter_permute(layer.wk, c.n_head, c.n_kv_head).tobytes()),
                (p + "ffn_up.weight", GGML_TYPE_NAMES["Q4_1"], up.shape, up_raw)]
        for name, a in (("attn_norm", layer.attn_norm), ("attn_v", layer.wv), ("attn_output", layer.wo),
                        ("ffn_norm", layer.ffn_norm), ("ffn_gate", layer.w_gate), ("ffn_down", layer.w_down)):
            out.append((p + name + ".weight", 0, a.shape, a.astype(F32).tobytes()))
        layers.append(dataclasses.replace(layer, w_up=up))
    return out, dataclasses.replace(weights, embed=embed, layers=tuple(layers))


@pytest.fixture(scope="module")
def tiny():
    return random_weights(TINY, seed=4)


@pytest.fixture(scope="module")
def tiny_gguf(tiny, tmp_path_factory):
    """(path, bytes, the weights the file decodes to) of a valid tiny GGUF."""
    tensors, decoded = tiny_tensors(tiny)
    raw = gguf_bytes(tiny_metadata(), tensors)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    path.write_bytes(raw)
    return path, raw, decoded


def assert_same_weights(got, want) -> None:
    assert got.config == want.config
    for name in ("embed", "final_norm", "lm_head"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == F32 and np.array_equal(a.view(np.uint32), b.view(np.uint32)), name
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
        for field in dataclasses.fields(b):
            x, y = getattr(a, field.name), getattr(b, field.name)
            assert x.dtype == F32 and np.array_equal(x.view(np.uint32), y.view(np.uint32)), f"layer {i} {field.name}"


def fails(path: Path, pattern: str) -> HssError:
    """load_model(path) raises an HssError naming ``path`` and matching ``pattern``."""
    with pytest.raises(HssError, match=pattern) as info:
        load_model(path)
    assert str(path) in str(info.value), info.value
    return info.value


# ---- GGUF: reading what was written ---------------------------------------------------------------------------
def test_gguf_reader_reads_every_value_type_and_the_tensors(tiny_gguf):
    path, raw, decoded = tiny_gguf
    with read_gguf(path) as f:
        assert f.version == 3 and f.alignment == 32 and f.data_offset % 32 == 0
        want = {key: value[1] if vtype == ARR else value for key, vtype, value in tiny_metadata()}
        want["llama.rope.freq_base"] = float(F32(TINY.rope_theta))
        want["llama.attention.layer_norm_rms_epsilon"] = float(F32(TINY.norm_eps))
        assert f.metadata == want
        assert f.value_types["tokenizer.ggml.tokens"] == "ARRAY[STRING]" and f.value_types["test.i8"] == "INT8"
        assert f.tensors["token_embd.weight"].type_name == "Q8_0"
        assert f.tensors["blk.0.attn_q.weight"].shape == (24, 32)
        np.testing.assert_array_equal(f.tensor("token_embd.weight"), decoded.embed)
        np.testing.assert_array_equal(f.tensor("blk.1.ffn_up.weight"), decoded.layers[1].w_up)
        with pytest.raises(HssError, match="no tensor 'nope'"):
            f.tensor("nope")
    with pytest.raises(HssError, match="closed"):
        f.tensor("token_embd.weight")
    f.close()   # idempotent


def test_loader_undoes_the_rope_permutation(tiny_gguf):
    path, _, decoded = tiny_gguf
    model = load_model(path)
    assert model.path == path and model.weights.lm_head is None
    assert_same_weights(model.weights, decoded)
    assert model.tokenizer.tokens == TOKENS and (model.tokenizer.bos_id, model.tokenizer.eos_id) == (1, 2)
    assert load_tokenizer(path).encode("hello world") == tiny_tokenizer().encode("hello world")


def test_gguf_package_reads_our_file_as_we_do(tiny_gguf):
    gguf = pytest.importorskip("gguf", reason="the gguf package cross-checks the test writer and the reader")
    path, _, _ = tiny_gguf
    reader = gguf.GGUFReader(str(path))
    with read_gguf(path) as f:
        assert reader.data_offset == f.data_offset and len(reader.tensors) == len(f.tensors)
        for key, field in reader.fields.items():
            if not key.startswith("GGUF."):
                assert field.contents() == f.metadata[key], key
        for t in reader.tensors:
            want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), F32)
            assert np.array_equal(f.tensor(t.name).reshape(-1).view(np.uint32), want.reshape(-1).view(np.uint32))


def _random_blocks(rng: np.random.Generator, name: str, n_blocks: int) -> np.ndarray:
    """Random blocks of GGML type ``name`` whose f16 scales are finite."""
    t = GGML_TYPES[GGML_TYPE_NAMES[name]]
    blocks = rng.integers(0, 256, (n_blocks, t.nbytes), dtype=np.uint8)
    scales = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [208]}.get(name, [])
    for at in scales:
        blocks[:, at:at + 2] = (rng.standard_normal((n_blocks, 1)) * 0.01).astype("<f2").view(np.uint8)
    return blocks


@pytest.mark.parametrize("name", [t.name for t in GGML_TYPES.values() if t.decode is not None])
def test_dequantisation_is_bit_identical_to_the_gguf_package(name):
    gguf = pytest.importorskip("gguf", reason="the gguf package is the reference dequantiser")
    rng = np.random.default_rng(GGML_TYPE_NAMES[name])
    t = GGML_TYPES[GGML_TYPE_NAMES[name]]
    blocks = _random_blocks(rng, name, 64 if t.block > 1 else 4096)
    got = dequantize(blocks.reshape(-1), GGML_TYPE_NAMES[name], blocks.shape[0] * t.block)
    want = np.asarray(gguf.quants.dequantize(blocks.reshape(1, -1), gguf.GGMLQuantizationType[name]), F32)
    assert got.dtype == F32 and np.array_equal(got.view(np.uint32), want.reshape(-1).view(np.uint32))


def test_undecodable_types_are_named():
    with pytest.raises(HssError, match=r"tensors of Q2_K cannot be read \(readable: F32, F16, Q4_0"):
        dequantize(np.zeros(84, np.uint8), GGML_TYPE_NAMES["Q2_K"], 256)
    with pytest.raises(HssError, match="type 99 cannot be read"):
        dequantize(np.zeros(4, np.uint8), 99, 1)


def test_smollm2_gguf_dequantises_as_the_gguf_package_does():
    gguf = pytest.importorskip("gguf", reason="the gguf package is the reference reader")
    path = smollm2_path()
    reader = gguf.GGUFReader(str(path))
    with read_gguf(path) as f:
        assert {t.type_name for t in f.tensors.values()} == {"Q4_1", "Q8_0", "F32"}
        for key, field in reader.fields.items():
            if not key.startswith("GGUF."):
                assert field.contents() == f.metadata[key], key
        for t in reader.tensors:
            got = f.tensor(t.name)
            want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), F32)
            assert got.shape == tuple(int(n) for n in reversed(t.shape)), t.name
            assert np.array_equal(got.reshape(-1).view(np.uint32), want.reshape(-1).view(np.uint32)), t.name


# ---- GGUF: each malformed case ---------------------------------------------------------------------------------
def _meta(replace: dict[str, tuple[int, Any]] | None = None, drop: tuple[str, ...] = (),
          add: list[tuple[str, int, Any]] | None = None) -> list[tuple[str, int, Any]]:
    out = [(k, *(replace or {}).get(k, (t, v))) for k, t, v in tiny_metadata() if k not in drop]
    return out + (add or [])


def _variant(tmp_path: Path, tiny, name: str, metadata=None, tensors=None, **kw) -> Path:
    default_tensors, _ = tiny_tensors(tiny)
    path = tmp_path / name
    path.write_bytes(gguf_bytes(metadata if metadata is not None else tiny_metadata(),
                                tensors if tensors is not None else default_tensors, **kw))
    return path


def test_malformed_gguf_bytes_name_the_file(tmp_path, tiny_gguf):
    _, good, _ = tiny_gguf
    with read_gguf(tiny_gguf[0]) as f:
        data_offset = f.data_offset
    cases = {
        "empty": (b"", "empty"),
        "garbage": (bytes(range(7, 250)) * 3, "not a GGUF file: it starts with the bytes 07 08"),
        "magic_only": (b"GGUF", "ends inside the header"),
        "truncated_header": (good[:13], "ends inside the header"),
        "truncated_header_counts": (good[:300], "claims 32 metadata entries and 20 tensors, more than the 276 bytes"),
        "truncated_metadata": (good[:2000], "metadata 'tokenizer.ggml.tokens': a count of 268 needs at least"),
        "truncated_string": (good[:3000], r"metadata 'tokenizer.ggml.tokens'\[\d+\]"),
        "truncated_tensor_infos": (good[:data_offset - 40], "ends inside the"),
        "truncated_data": (good[:-100], r"needs bytes .* the file has .* \(truncated\?\)"),
        "hostname": (b"buildhost-7\n", r"not a GGUF file: it starts with the text 'buildhost-7\\n'"),
        "version_1": (good[:4] + struct.pack("<I", 1) + good[8:], "version 1 predates"),
        "big_endian": (good[:4] + struct.pack(">I", 3) + good[8:], "big-endian"),
        "huge_kv_count": (good[:16] + struct.pack("<Q", 2**63) + good[24:], "claims 9223372036854775808 metadata"),
        "huge_tensor_count": (good[:8] + struct.pack("<Q", 2**64 - 1) + good[16:], "tensors, more than"),
        "huge_key_length": (good[:24] + struct.pack("<Q", 2**62) + good[32:], "needs 4611686018427387904 more"),
        "bad_value_type": (good[:24 + 8 + len("general.architecture")] + struct.pack("<I", 77)
                           + good[24 + 8 + len("general.architecture") + 4:], "value type 77"),
    }
    for name, (raw, pattern) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(raw)
        fails(path, pattern)


def test_malformed_gguf_structure_names_the_file(tmp_path, tiny):
    tensors, _ = tiny_tensors(tiny)
    by_name = {t[0]: t for t in tensors}
    q = by_name["blk.0.attn_q.weight"]
    cases = {
        "duplicate_key": (_meta(add=[("llama.block_count", U32, 2)]), tensors, {}, "appears twice"),
        "duplicate_tensor": (None, tensors + [tensors[1]], {}, "tensor 'output_norm.weight' appears twice"),
        "alignment": (_meta({"general.alignment": (U32, 24)}), tensors, {}, "power of two"),
        "misaligned": (_meta({"general.alignment": (U32, 64)}), tensors, {}, "not a multiple of the alignment 64"),
        "nested_array": (_meta(add=[("test.nested", ARR, (ARR, []))]), tensors, {}, "array of arrays"),
        "bad_utf8_key": (_meta(add=[(b"\xff\xfe", STR, "x")]), tensors, {},
                         f"metadata key {len(tiny_metadata())} is not valid UTF-8"),
        "five_dims": (None, tensors[:1] + [("x", 0, (1, 1, 1, 1, 1), b"\0" * 4)] + tensors[1:], {}, "5 dimensions"),
        "unknown_type": (None, [(n, 99 if n == q[0] else t, s, r) for n, t, s, r in tensors], {},
                         "GGML type 99, which ggml does not define"),
        "partial_block": (None, [("odd", GGML_TYPE_NAMES["Q8_0"], (1, 33), b"\0" * 34)] + tensors, {},
                          "not whole Q8_0 blocks"),
        "wrong_shape": (None, [(n, t, (32, 24) if n == q[0] else s, r) for n, t, s, r in tensors], {},
                        r"tensor 'blk.0.attn_q.weight' has shape \(32, 24\), the config .* needs \(24, 32\)"),
        "wrong_dtype": (None, [(n, 20, s, b"\0" * 18 * (np.prod(s) // 32)) if n == "blk.0.ffn_gate.weight"
                               else (n, t, s, r) for n, t, s, r in tensors], {},
                        "tensor 'blk.0.ffn_gate.weight': tensors of IQ4_NL cannot be read"),
        "missing_tensor": (None, [t for t in tensors if t[0] != "blk.1.ffn_down.weight"], {},
                           "missing tensor 'blk.1.ffn_down.weight'"),
        "extra_layer": (None, tensors + [("blk.2.attn_norm.weight", 0, (32,), b"\0" * 128)], {},
                        "unexpected tensor 'blk.2.attn_norm.weight'"),
        "architecture": (_meta({"general.architecture": (STR, "gpt2")}), tensors, {}, "architecture is 'gpt2'"),
        "rope_scaling": (_meta(add=[("llama.rope.scaling.type", STR, "linear")]), tensors, {}, "RoPE scaling"),
        "metadata_type": (_meta({"llama.block_count": (STR, "2")}), tensors, {},
                          "'llama.block_count' is STRING, expected int"),
        "missing_key": (_meta(drop=("llama.embedding_length",)), tensors, {}, "no metadata key"),
        "vocabulary": (_meta({"tokenizer.ggml.tokens": (ARR, (STR, TOKENS[:-1])),
                              "tokenizer.ggml.token_type": (ARR, (I32, TYPES[:-1]))}), tensors, {},
                       "the tokenizer has 267 tokens but the model's vocabulary has 268"),
        "duplicate_token": (_meta({"tokenizer.ggml.tokens": (ARR, (STR, TOKENS[:-1] + TOKENS[:1]))}), tensors, {},
                            "duplicate tokens"),
        "bad_utf8_token": (_meta({"tokenizer.ggml.tokens": (ARR, (STR, [*TOKENS[:-1], b"\xc3("]))}), tensors, {},
                           r"tokenizer.ggml.tokens'\[267\] is not valid UTF-8"),
        "token_types": (_meta({"tokenizer.ggml.token_type": (ARR, (I32, TYPES[:5]))}), tensors, {}, "5 token types"),
        "bos": (_meta({"tokenizer.ggml.bos_token_id": (U32, 10**6)}), tensors, {}, "bos_id 1000000 is outside"),
        "tokenizer_model": (_meta({"tokenizer.ggml.model": (STR, "llama")}), tensors, {}, "tokenizer is 'llama'"),
        "pre_tokenizer": (_meta({"tokenizer.ggml.pre": (STR, "llama-bpe")}), tensors, {}, "pre-tokenizer"),
        "head_count": (_meta({"llama.attention.head_count_kv": (U32, 2)}), tensors, {}, "multiple of n_kv_head"),
        "rope_theta": (_meta({"llama.rope.freq_base": (FLOAT32, float("nan"))}), tensors, {}, "rope_theta"),
    }
    for name, (metadata, tensor_list, kw, pattern) in cases.items():
        fails(_variant(tmp_path, tiny, f"{name}.gguf", metadata, tensor_list, **kw), pattern)


def test_other_files_are_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    fails(tmp_path / "model.safetensors", "a file of a Hugging Face checkpoint .* pass its directory")
    fails(tmp_path / "none.gguf", "no such file or directory")
    if os.path.exists("/dev/null"):
        with pytest.raises(HssError, match="/dev/null: not a regular file"):
            load_model("/dev/null")


# ---- safetensors --------------------------------------------------------------------------------------------------
def _arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"a.f32": rng.standard_normal((3, 5)).astype(F32), "b.f16": rng.standard_normal(7).astype(np.float16),
            "c.bf16": rng.standard_normal((2, 2, 3)).astype(ml_dtypes.bfloat16),
            "d.i32": rng.integers(-9, 9, (4,)).astype(np.int32), "e.empty": np.zeros((0, 3), F32),
            "f.scalar": np.array(2.5, F32)}


def test_safetensors_round_trip_and_float_reads(tmp_path, rng):
    arrays = _arrays(rng)
    path = write_safetensors(tmp_path / "x.safetensors", arrays, {"format": "pt"})
    assert struct.unpack("<Q", path.read_bytes()[:8])[0] % 8 == 0   # the header padded, as the package does
    with read_safetensors(path) as f:
        assert f.metadata == {"format": "pt"} and set(f.tensors) == set(arrays)
        for name, a in arrays.items():
            assert same_bytes(f.array(name), a), name
        for name in ("a.f32", "b.f16", "c.bf16"):
            assert f.tensor(name).dtype == F32 and np.array_equal(f.tensor(name), arrays[name].astype(F32))
        with pytest.raises(HssError, match=r"'d.i32' is I32; model weights must be one of F32, F16, BF16"):
            f.tensor("d.i32")


def test_safetensors_package_agrees_both_ways(tmp_path, rng):
    sn = pytest.importorskip("safetensors.numpy", reason="the safetensors package cross-checks the format")
    arrays = _arrays(rng)
    ours = write_safetensors(tmp_path / "ours.safetensors", arrays)
    for name, a in sn.load_file(str(ours)).items():
        assert same_bytes(a, arrays[name]), name
    theirs = tmp_path / "theirs.safetensors"
    sn.save_file(arrays, str(theirs), metadata={"format": "np"})
    with read_safetensors(theirs) as f:
        assert f.metadata == {"format": "np"}
        for name, a in arrays.items():
            assert same_bytes(f.array(name), a), name


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _st(header: Any, data: bytes = b"", length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def test_malformed_safetensors_name_the_file(tmp_path):
    ok = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    cases = {
        "empty": (b"", "empty"), "short": (b"\x01\x02", "too short"),
        "huge_header": (_st(b"{}", length=2**63), "more than the 2 the file has"),
        "hostname": (b"buildhost-7\n", "not a safetensors file"),
        "not_json": (_st(b"{nope"), "not valid JSON"), "list": (_st([1, 2]), "a list, not an object"),
        "deep": (_st(b"[" * 100000 + b"]" * 100000), "nests too deeply"),
        "digits": (_st(b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 8]}}'),
                   "not valid JSON"),
        "utf8": (_st(b'{"\xff": 1}'), "not UTF-8"),
        "entry": (_st({"w": {"dtype": "F32"}}), "exactly dtype, shape and data_offsets"),
        "dtype": (_st({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), "'Q4' is not"),
        "shape": (_st({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8), "non-negative"),
        "float_shape": (_st({"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}), "non-negative ints"),
        "offsets": (_st({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}), "begin <= end"),
        "span": (_st({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "takes 12"),
        "truncated_data": (_st(ok, b"\0" * 5), r"past the end .* 5 bytes of data \(truncated\?\)"),
        "huge_shape": (_st({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 2**82]}}),
                       "past the end"),
        "metadata": (_st({"__metadata__": {"a": 1}}), "strings to strings"),
    }
    for name, (raw, pattern) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(raw)
        with pytest.raises(HssError, match=pattern) as info:
            read_safetensors(path)
        assert str(path) in str(info.value), info.value


# ---- Hugging Face checkpoint directories ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def untied():
    w = random_weights(TINY, seed=5)
    head = np.random.default_rng(6).standard_normal((TINY.vocab_size, TINY.dim)).astype(F32)
    return dataclasses.replace(w, lm_head=head)


def _checkpoint(tmp_path: Path, weights, dtype: str = "f32", name: str = "ckpt") -> Path:
    return save_hf(weights, tiny_tokenizer(), tmp_path / name, dtype)


def test_hf_round_trip_f32_is_bit_identical(tmp_path, untied, tiny_gguf):
    assert_same_weights(load_model(_checkpoint(tmp_path, untied)).weights, untied)
    gguf_model = load_model(tiny_gguf[0])   # tied, from a GGUF: GGUF -> Model -> save_hf -> load_model(dir)
    directory = save_hf(gguf_model, None, tmp_path / "from_gguf", "f32")
    again = load_model(directory)
    assert_same_weights(again.weights, gguf_model.weights)
    assert again.weights.lm_head is None and again.path == directory
    tok, want = again.tokenizer, gguf_model.tokenizer
    assert (tok.tokens, tok.token_types, tok.merges) == (want.tokens, want.token_types, want.merges)
    assert (tok.bos_id, tok.eos_id, tok.chat_template) == (1, 2, TEMPLATE)
    text = "<|im_start|>hello world 123<|im_end|>\nhell o"
    assert tok.encode(text) == want.encode(text) and tok.chat_prompt("hi") == want.chat_prompt("hi")
    config = json.loads((directory / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["architectures"] == ["LlamaForCausalLM"]
    assert config["rms_norm_eps"] == 1e-5 and config["head_dim"] == 8
    np.testing.assert_array_equal(forward(again.weights, [5, 80, 263, 7]), forward(gguf_model.weights, [5, 80, 263, 7]))


def test_hf_bf16_and_f16_round_to_the_dtype(tmp_path, untied):
    for dtype, cast in (("bf16", ml_dtypes.bfloat16), ("f16", np.float16)):
        got = load_model(_checkpoint(tmp_path, untied, dtype, dtype)).weights
        assert np.array_equal(got.layers[1].wo, untied.layers[1].wo.astype(cast).astype(F32))
        assert np.array_equal(got.final_norm, untied.final_norm.astype(cast).astype(F32))
        with read_safetensors(tmp_path / dtype / "model.safetensors") as f:
            assert {e.dtype for e in f.tensors.values()} == {dtype.upper()}
    with pytest.raises(HssError, match="dtype must be one of bf16, f16, f32"):
        save_hf(untied, tiny_tokenizer(), tmp_path / "x", "int8")
    with pytest.raises(TypeError, match="tokenizer must be"):
        save_hf(untied, None, tmp_path / "x")


def _shard(directory: Path, weights, index: dict[str, str] | None = None) -> None:
    """Replace ``directory``'s model.safetensors by two shards and an index."""
    (directory / "model.safetensors").unlink()
    tensors = hf_tensors(weights, "f32")
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in parts.items():
        write_safetensors(directory / shard, {n: tensors[n] for n in part})
    weight_map = {n: shard for shard, part in parts.items() for n in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map if index is None else index}))


def test_sharded_checkpoints_load_and_bad_indexes_are_named(tmp_path, untied):
    directory = _checkpoint(tmp_path, untied)
    _shard(directory, untied)
    assert_same_weights(load_model(directory).weights, untied)
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    cases = {
        "missing_shard": (dict(index, **{"model.norm.weight": "model-00003-of-00003.safetensors"}),
                          "names shard 'model-00003-of-00003.safetensors'.* missing from"),
        "outside": (dict(index, **{"model.norm.weight": "../x.safetensors"}), "not a file name"),
        "wrong_shard": ({n: "model-00001-of-00002.safetensors" for n in index}, "which does not hold it"),
        "not_a_map": ([1, 2], "no 'weight_map'"),
    }
    for name, (weight_map, pattern) in cases.items():
        d = _checkpoint(tmp_path, untied, name=name)
        _shard(d, untied, weight_map)
        fails(d, pattern)
    d = _checkpoint(tmp_path, untied, name="two_files")   # no index: every *.safetensors, no name twice
    (d / "model.safetensors").rename(d / "a.safetensors")
    write_safetensors(d / "b.safetensors", {"model.norm.weight": untied.final_norm})
    fails(d, "tensor 'model.norm.weight' is also in")
    with pytest.raises(HssError, match="already holds"):
        save_hf(untied, tiny_tokenizer(), directory)


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_hf_config_problems_are_named(tmp_path, untied):
    cases = {
        "architecture": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
                         "architecture is \\['MistralForCausalLM'\\]"),
        "no_architecture": ({"architectures": ..., "model_type": ...}, "names no architecture"),
        "rope_scaling": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling .* plain RoPE"),
        "rope_parameters": ({"rope_parameters": {"rope_type": "yarn"}}, "rope_parameters"),
        "attention_bias": ({"attention_bias": True}, "attention_bias is True"),
        "act": ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
        "quantised": ({"quantization_config": {"quant_method": "gptq"}}, "quantised"),
        "missing": ({"hidden_size": ...}, "no 'hidden_size'"),
        "bool": ({"num_hidden_layers": True}, "num_hidden_layers is True; it must be a positive int"),
        "float": ({"intermediate_size": 48.0}, "intermediate_size is 48.0"),
        "heads": ({"num_key_value_heads": 2}, "multiple of n_kv_head"),
        "tie": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        "untied_without_head": ({"tie_word_embeddings": False}, None),
        "wrong_shape": ({"intermediate_size": 40}, "has shape \\(48, 32\\), the config .* needs \\(40, 32\\)"),
        "more_layers": ({"num_hidden_layers": 10**9}, "missing tensor 'model.layers.2.input_layernorm.weight'"),
        "fewer_layers": ({"num_hidden_layers": 1}, "unexpected tensor 'model.layers.1"),
        "vocabulary": ({"vocab_size": 200}, "has shape \\(268, 32\\)"),
        "not_json": (None, "not valid JSON"),
    }
    tied = dataclasses.replace(untied, lm_head=None)
    for name, (changes, pattern) in cases.items():
        d = _checkpoint(tmp_path, tied if name == "untied_without_head" else untied, name=name)
        if changes is None:
            (d / "config.json").write_text("{")
        else:
            _edit_json(d / "config.json", **changes)
        fails(d, pattern or "missing tensor 'lm_head.weight'")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", "no config.json, so not a Hugging Face checkpoint")


def test_hf_weight_and_tokenizer_problems_are_named(tmp_path, untied):
    def with_tensors(name: str, change) -> Path:
        d = _checkpoint(tmp_path, untied, name=name)
        tensors = hf_tensors(untied, "f32")
        change(tensors)
        write_safetensors(d / "model.safetensors", tensors)
        return d

    fails(with_tensors("missing", lambda t: t.pop("model.layers.0.mlp.up_proj.weight")),
          "missing tensor 'model.layers.0.mlp.up_proj.weight'")
    fails(with_tensors("bias", lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(24, F32)})),
          "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'")
    fails(with_tensors("int8", lambda t: t.update({"model.norm.weight": np.ones(32, np.int8)})),
          "'model.norm.weight' is I8; weights must be one of F32")
    d = with_tensors("inv_freq", lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, F32)}))
    assert_same_weights(load_model(d).weights, untied)
    d = _checkpoint(tmp_path, untied, name="no_bin")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    fails(d, "pytorch_model.bin is not read")

    def with_tokenizer(name: str, change, file: str = "tokenizer.json") -> Path:
        d = _checkpoint(tmp_path, untied, name=name)
        data = json.loads((d / file).read_text())
        change(data)
        (d / file).write_text(json.dumps(data))
        return d

    fails(with_tokenizer("pre", lambda t: t.update(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False})),
          "tokenizer.json: the pre-tokenizer .* is not SmolLM2's")
    fails(with_tokenizer("normalizer", lambda t: t.update(normalizer={"type": "NFC"})), "sets normalizer")
    fails(with_tokenizer("fallback", lambda t: t["model"].update(byte_fallback=True)), "sets byte_fallback")
    fails(with_tokenizer("wordpiece", lambda t: t["model"].update(type="WordPiece")), "'WordPiece'")
    fails(with_tokenizer("gap", lambda t: t["model"]["vocab"].pop("Ġw")), "no token has id")
    fails(with_tokenizer("clash", lambda t: t["added_tokens"][0].update(id=5)), "has id 5, which the vocab gives")
    fails(with_tokenizer("lstrip", lambda t: t["added_tokens"][0].update(lstrip=True)), "has lstrip")
    fails(with_tokenizer("bos", lambda t: t.update(bos_token="<nope>"), "tokenizer_config.json"),
          "bos_token '<nope>' is not in the vocabulary")
    fails(with_tokenizer("too_many", lambda t: t["model"]["vocab"].update({"extra": 268})),
          "tokenizer has 269 tokens, more than the model's vocabulary")
    d = with_tokenizer("pairs", lambda t: t["model"].update(merges=[m.split(" ") for m in MERGES]))
    assert load_model(d).tokenizer.merges == MERGES   # the newer [a, b] form of merges
    d = _checkpoint(tmp_path, untied, name="no_tokenizer")
    (d / "tokenizer.json").unlink()
    fails(d, "no tokenizer.json")
    d = _checkpoint(tmp_path, untied, name="jinja")
    (d / "chat_template.jinja").write_text("<|im_start|>system\nFrom the jinja file<|im_end|>")
    assert "From the jinja file" in load_tokenizer(d).chat_prompt("hi")


def test_tokenizers_package_encodes_the_written_tokenizer_json_as_we_do(tmp_path, untied):
    tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers cross-checks tokenizer.json")
    d = _checkpoint(tmp_path, untied)
    theirs = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    ours = load_tokenizer(d)

    pieces = st.sampled_from([*"helo wrd1234'sx\n\t", "<|im_start|>", "<|im_end|>", "é", "  "])

    @FUZZ
    @given(st.lists(pieces, max_size=30).map("".join) | st.text(max_size=30))
    def check(text: str) -> None:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ours.encode(text)) == theirs.decode(ours.encode(text), skip_special_tokens=False)

    check()


def test_hub_names_download_through_huggingface_hub(tmp_path, untied, monkeypatch):
    directory = _checkpoint(tmp_path, untied)
    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, tuple(allow_patterns)))
        if repo_id == "org/missing":
            raise OSError("404 Client Error: Repository Not Found")
        return str(directory)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    model = load_model("hf:org/tiny@v1")
    assert_same_weights(model.weights, untied)
    assert model.path == directory and calls[0][:2] == ("org/tiny", "v1")
    assert "config.json" in calls[0][2] and "*.safetensors" in calls[0][2] and "tokenizer.json" in calls[0][2]
    assert load_tokenizer("hf:org/tiny").tokens == TOKENS and calls[1][1] is None
    with pytest.raises(HssError, match="hf:org/missing: the download failed: OSError: 404"):
        load_model("hf:org/missing")
    with pytest.raises(HssError, match="hf:ORG/NAME"):
        load_model("hf:no-slash")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)   # import huggingface_hub now raises ImportError
    with pytest.raises(HssError, match="needs the huggingface_hub package .* or pass the checkpoint's local"):
        load_model("hf:org/tiny")


# ---- SmolLM2-135M through a Hugging Face directory --------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_both(tmp_path_factory):
    gguf_model = load_model(smollm2_path())
    directory = save_hf(gguf_model, None, tmp_path_factory.mktemp("smollm2_hf"), "f32")
    return gguf_model, load_model(directory), directory


def test_smollm2_hf_directory_equals_the_gguf(smollm2_both):
    gguf_model, hf_model, _ = smollm2_both
    assert_same_weights(hf_model.weights, gguf_model.weights)
    ids = gguf_model.tokenizer.encode("The Zen of Python, by Tim Peters. Beautiful is better than ugly.")
    assert hf_model.tokenizer.encode("The Zen of Python, by Tim Peters. Beautiful is better than ugly.") == ids
    assert np.array_equal(forward(hf_model.weights, ids[:16]), forward(gguf_model.weights, ids[:16]))


def test_smollm2_tokenizer_json_matches_the_tokenizers_package(smollm2_both):
    tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers cross-checks tokenizer.json")
    from hss.checkpoint import english_text
    gguf_model, hf_model, directory = smollm2_both
    theirs = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text in [english_text("heapq"), "Héllo wörld! 日本語 12345 3.14 ½ ²  tabs\t\tand\r\n lines \n\n\n  x's 'S",
                 "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "emoji 😀 👩‍👩‍👧 café ﬁ Ω ≈ \u00a0nbsp \u3000."]:
        ids = gguf_model.tokenizer.encode(text)
        assert hf_model.tokenizer.encode(text) == ids == theirs.encode(text, add_special_tokens=False).ids


# ---- fuzzing: mutated files load or fail with an HssError naming them ---------------------------------------------
def loads_or_names(path: Path) -> None:
    """load_model(path) succeeds or raises an HssError naming ``path``, within LOAD_SECONDS and LOAD_BYTES."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        load_model(path)
    except HssError as e:
        assert str(path) in str(e), e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.perf_counter() - start < LOAD_SECONDS
    assert peak < LOAD_BYTES, f"{peak} bytes allocated"


HUGE = [2**63, 2**64 - 1, 2**32 - 1, 2**31, 10**6, 0]


def mutate(data: st.DataObject, raw: bytes, region: int) -> bytes:
    """Truncate ``raw`` anywhere, overwrite bytes of its first ``region`` bytes, or write a huge u64 there."""
    op = data.draw(st.sampled_from(["truncate", "overwrite", "huge"]))
    if op == "truncate":
        return raw[:data.draw(st.integers(0, len(raw) - 1))]
    out = bytearray(raw)
    if op == "overwrite":
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, region - 1))
            chunk = data.draw(st.binary(min_size=1, max_size=8))
            out[at:at + len(chunk)] = chunk
        return bytes(out[:len(raw)])
    at = data.draw(st.integers(0, region - 8))
    out[at:at + 8] = struct.pack("<Q", data.draw(st.sampled_from(HUGE)))
    return bytes(out)


@FUZZ
@given(data=st.data())
def test_fuzzed_gguf_loads_or_names_the_file(tiny_gguf, tmp_path, data):
    _, good, _ = tiny_gguf
    with read_gguf(tiny_gguf[0]) as f:
        region = f.data_offset
    path = tmp_path / "fuzzed.gguf"
    path.write_bytes(mutate(data, good, region))
    loads_or_names(path)


@FUZZ
@given(data=st.data())
def test_fuzzed_safetensors_checkpoint_loads_or_names_the_file(tmp_path_factory, untied, data):
    directory = tmp_path_factory.mktemp("fuzz_st")
    save_hf(untied, tiny_tokenizer(), directory, "bf16")
    raw = (directory / "model.safetensors").read_bytes()
    region = 8 + struct.unpack("<Q", raw[:8])[0]
    (directory / "model.safetensors").write_bytes(mutate(data, raw, region))
    loads_or_names(directory)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=6)


@FUZZ
@given(data=st.data())
def test_fuzzed_hf_json_loads_or_names_the_file(tmp_path_factory, untied, data):
    directory = tmp_path_factory.mktemp("fuzz_json")
    save_hf(untied, tiny_tokenizer(), directory, "bf16")
    file = data.draw(st.sampled_from(["config.json", "tokenizer.json", "tokenizer_config.json"]))
    doc = json.loads((directory / file).read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        targets = [doc]
        if isinstance(doc.get("model"), dict) and doc["model"]:
            targets.append(doc["model"])
        if isinstance(doc.get("added_tokens"), list) and doc["added_tokens"] and isinstance(doc["added_tokens"][0],
                                                                                             dict):
            targets.append(doc["added_tokens"][0])
        target = data.draw(st.sampled_from(targets))
        key = data.draw(st.sampled_from(sorted(target)) | st.text(max_size=6))
        target[key] = data.draw(JSON_VALUES)
    (directory / file).write_text(json.dumps(doc))
    loads_or_names(directory)


# ---- the Tokenizer keeps what it was built from ----------------------------------------------------------------
def test_tokenizer_keeps_its_inputs():
    tok = Tokenizer(["a", "b", "ab"], ["a b"], [1, 3, 1], bos_id=1)
    assert (tok.tokens, tok.merges, tok.token_types, tok.special) == (["a", "b", "ab"], ["a b"], [1, 3, 1], {"b": 1})
