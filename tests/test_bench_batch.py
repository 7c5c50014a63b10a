"""The batched-decoding suite (hss.bench.batch): its smoke run on the tiny random model (the emulator in CI), the
targets' verdicts, the skip without SmolLM2's GGUF, and its option checks."""
from __future__ import annotations

import pytest

from hss.bench import batch


def test_smoke_times_every_batch_and_states_the_targets():
    rows = batch.run(batch.parse_args(["--smoke"]))
    measured = [r for r in rows if "variant" not in r]
    assert [(r["kv"], r["batch"], r["sampling"]) for r in measured] == [
        (kv, b, mode) for kv in ("hbm", "sparse", "swap") for mode in ("greedy", "sampled") for b in (1, 2)]
    for r in measured:
        assert r["tokens_s"] > 0 and r["ms"] > 0
        assert r["tokens_s"] == pytest.approx(r["batch"] / (r["ms"] * 1e-3))
        assert "graph replay" in r["note"] and "prefilled" in r["note"]
    assert [r["ratio"] for r in measured[::2]] == [1.0] * 6   # each mode against its own batch 1
    assert all("sparse: budget 1 + first 1 / last 4" in r["note"] for r in measured[4:8])
    for r in measured[8:]:   # the prompt's complete page of each row streamed every step: its H2D floor
        assert r["streamed"] == r["batch"] * 2 * 2 * 2 * 4096   # rows x layers x (K, V) x kv heads x stripe
        assert r["floor_ms"] > 0 and r["floor_ratio"] == pytest.approx(r["ms"] / r["floor_ms"])
        assert f"{r['streamed'] / 1e6:.3f} MB streamed a step" in r["note"] and "H2D floor" in r["note"]
    targets = [r for r in rows if "variant" in r]
    assert [r["variant"] for r in targets] == ["target: batch 16 >= 8x batch 1", "target: batch 64 >= 20x batch 1",
                                               "target: sampled batch-1 step <= 1.05x greedy",
                                               "target: swap batch 16 within 1.3x its H2D floor"]
    assert all(r["note"].startswith("not run") for r in targets[:2])   # the smoke runs batches 1 and 2 only
    assert targets[2]["ratio"] == pytest.approx(measured[2]["ms"] / measured[0]["ms"])
    assert targets[2]["note"].endswith(("met", "not met"))
    assert targets[3]["note"] == "not run (needs --kv swap with batch 16, greedy)"
    text = batch.table(rows)
    assert text.count("| random (tiny) |") == 16 and "decode tokens/s" in text and "| swap | sampled |" in text


def test_targets_say_met_or_not_met():
    rows = [dict(batch=1, ratio=1.0), dict(batch=16, ratio=8.5), dict(batch=64, ratio=19.0)]
    notes = [r["note"] for r in batch._targets(rows, "m")]
    assert notes == ["8.50x: met", "19.00x: not met", "not run (needs batch 1 with --sampling greedy,sampled)",
                     "not run (needs --kv swap with batch 16, greedy)"]
    timed = [dict(batch=1, sampling="greedy", ms=1.0, ratio=1.0), dict(batch=1, sampling="sampled", ms=1.04)]
    assert batch._targets(timed, "m")[-2]["note"] == "1.040x: met"
    timed[1]["ms"] = 1.06
    assert batch._targets(timed, "m")[-2]["note"] == "1.060x: not met"
    swap = dict(batch=16, kv="swap", sampling="greedy", ms=2.6, floor_ms=2.0, floor_ratio=1.3)
    assert batch._targets([swap], "m")[-1]["note"] == "1.30x (2.600 ms a step, floor 2.000 ms): met"
    assert batch._targets([{**swap, "floor_ratio": 1.31}], "m")[-1]["note"].endswith(": not met")
    assert batch._targets([{**swap, "floor_ratio": None}], "m")[-1]["note"].startswith("not run (the steps streamed")


def test_without_the_gguf_it_says_so_and_skips(monkeypatch):
    from hss.checkpoint import fetch
    monkeypatch.setattr(fetch, "locate_default_gguf", lambda: (None, ["hss's cache has none"]))
    rows = batch.run(batch.parse_args(["--batches", "1,16"]))
    assert len(rows) == 1 and rows[0]["note"].startswith("skipped: SmolLM2-135M-Instruct's GGUF is not on this "
                                                         "machine (hss's cache has none)")
    assert "python -m hss fetch" in rows[0]["note"] and "skipped" in batch.table(rows)


@pytest.mark.parametrize("argv, message", [
    (["--batches", "1,x"], "comma-separated positive integers"),
    (["--batches", "0,4"], "batch sizes must be >= 1"),
    (["--tokens", "4"], "--tokens 4: at least 5"),
    (["--tokens", "3", "--no-graph"], "--tokens 3: at least 4"),
    (["--prompt-tokens", "0"], "--prompt-tokens 0: at least 1"),
    (["--sampling", "greedy,topp"], "each one of greedy, sampled"),
    (["--kv", "hbm,ram"], "each one of hbm, sparse, swap"),
    (["--resident", "-1"], "--resident -1: at least 0"),
    (["--budget", "-1"], "--budget -1: at least 0"),
])
def test_bad_options_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        batch.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_suite_is_discovered():
    from hss.bench.__main__ import SUITES
    assert "batch" in SUITES


def test_staged_rows_use_a_staged_sampler_and_get_their_own_target(monkeypatch):
    from hss.model import sample
    monkeypatch.setattr(sample, "SESSION_STAGE", False)   # so that the sampled rows are the unstaged ones
    args = batch.parse_args(["--smoke"])
    args.sampling_list, args.kv_list, args.batch_list = ["greedy", "sampled", "staged"], ["hbm"], [1]
    rows = batch.run(args)
    assert sample.SESSION_STAGE is False   # restored after the staged rows
    measured = {r["sampling"]: r for r in rows if "variant" not in r}
    assert "sampler stage=False" in measured["sampled"]["note"]
    assert "sampler stage=True" in measured["staged"]["note"]   # the tiny vocabulary's keys fit
    assert "sampler stage" not in measured["greedy"]["note"]
    targets = {r["variant"]: r for r in rows if "variant" in r}
    staged = targets["target: staged batch-1 step <= 1.05x greedy"]
    assert staged["ratio"] == pytest.approx(measured["staged"]["ms"] / measured["greedy"]["ms"])
