"""``python -m hss demo`` (SmolLM2, or the tiny random model) and ``python -m hss demo-qsa`` run end to end (emulator in
CI, GPU on the device) and report what they promise; on the emulator every time and rate says it is no hardware
measurement."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from hss.checkpoint.fetch import locate_default_gguf
from hss.demo import batch
from hss.demo.model import NOT_MEASURED, PARAGRAPH, add_arguments, random_model
from hss.demo.sampling import CHAT_SAMPLING, sampling_params, sampling_text
from hss.model import sparse_support
from hss.model.check import check_greedy
from hss.model.sample import GREEDY, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
SMOLLM2_GGUF = os.environ.get("HSS_SMOLLM2_GGUF") or None   # a GGUF file elsewhere than hss's cache
HAVE_SMOLLM2 = os.path.isfile(SMOLLM2_GGUF) if SMOLLM2_GGUF else locate_default_gguf()[0] is not None


def demo(*args: str, command: str = "demo") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hss", command, *args], capture_output=True, text=True, cwd=ROOT,
                          env=ENV)


def emulated(out: subprocess.CompletedProcess) -> bool:
    return "CPU emulator" in out.stdout


def test_demo_qsa_runs_past_the_inert_bound():
    out = demo("--prefill", "2050", "--steps", "3", "--hidden", "256", command="demo-qsa")
    assert out.returncode == 0, out.stderr
    steps = re.findall(r"visible (\d+), selected (\d+) tokens.*cosine\(sparse, dense\) ([0-9.]+)", out.stdout)
    assert [int(v) for v, _, _ in steps] == [2051, 2052, 2053]
    assert int(steps[0][1]) == 2051 and "inert" in out.stdout           # visible <= 2051: dense is exact
    assert int(steps[1][1]) == 2048 and int(steps[2][1]) == 2049         # 512 blocks + the tail
    assert all(float(c) > 0.99 for _, _, c in steps)
    assert "median per stage" in out.stdout
    timed = [line for line in out.stdout.splitlines() if " us" in line or " ms" in line]
    assert timed and all((NOT_MEASURED in line) == emulated(out) for line in timed)


def test_demo_help_lists_the_knobs():
    out = demo("--help")
    for flag in ("--model", "--no-fetch", "--prompt", "--prompt-file", "--prompt-tokens", "--chat", "--tokens", "--kv",
                 "--resident", "--budget", "--graph", "--check", "--batch", "--batch-session", "--temperature",
                 "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--presence-penalty", "--seed", "--model-seed"):
        assert flag in out.stdout
    assert "{qsa}" not in out.stdout
    out = demo("--help", command="demo-qsa")
    for flag in ("--prefill", "--steps", "--hidden", "--seed", "--device"):
        assert flag in out.stdout


@pytest.mark.parametrize("kv", ["hbm", "swap"])
def test_demo_random_model_tokens_match_the_numpy_forward(kv):
    """The CI smoke run: a few tokens of a short prompt on the tiny random model, checked by the demo itself and
    here against the numpy forward."""
    out = demo("--model", "random", "--kv", kv, "--tokens", "5", "--prompt-tokens", "40", "--check", "--resident", "2",
               "--tile", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    tokens = [int(t) for t in re.search(r"token ids: ([\d ]+)", out.stdout).group(1).split()]
    assert len(tokens) == 5
    prompt = [b % 512 for b in PARAGRAPH.encode()][:40]   # the random model reads the built-in paragraph's bytes
    assert check_greedy(random_model(0), prompt, tokens).ok
    for promise in ("sampling: greedy\n", "prefill: 40 tokens", "tokens/s", "time per stage", "KV"):
        assert promise in out.stdout
    if kv == "swap":
        assert "H2D" in out.stdout and "resident hit rate" in out.stdout
    measured = [line for line in out.stdout.splitlines()
                if any(word in line for word in ("tokens/s", "GB/s", "ms per token", "the floor", " s on the device"))]
    assert measured and all((NOT_MEASURED in line) == emulated(out) for line in measured), measured
    assert ("(pinned, measured)" in out.stdout) == (kv == "swap" and not emulated(out))


def test_demo_sparse_is_wired_or_says_why():
    out = demo("--model", "random", "--kv", "sparse", "--tokens", "3", "--prompt-tokens", "128", "--eval-tokens", "8")
    if sparse_support() is None:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "next-token agreement" in out.stdout and "cross-entropy" in out.stdout
    else:
        assert out.returncode == 2 and out.stderr.startswith("hss: error: --kv sparse is not available yet")


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs SmolLM2-135M-Instruct's GGUF (python -m hss fetch) or "
                    "HSS_SMOLLM2_GGUF=<the GGUF file>")
def test_demo_smollm2_decodes_text():
    model = ("--model", SMOLLM2_GGUF) if SMOLLM2_GGUF else ("--no-fetch",)
    out = demo(*model, "--tokens", "3", "--prompt-tokens", "16", "--check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "30 layers, dim 576" in out.stdout and "--- generated ---" in out.stdout
    assert "check against the numpy forward" in out.stdout


# -- --batch: several prompts through BatchSession ---------------------------------------------------------
def row_tokens(stdout: str) -> dict[int, list[int]]:
    """The random model's ``[row i] token ids: ...`` lines."""
    found = re.findall(r"\[row (\d+)\] token ids: ([\d ]+)", stdout)
    return {int(i): [int(t) for t in ids.split()] for i, ids in found}


def test_demo_batch_rows_decode_what_each_decodes_alone():
    """Three built-in prompts decoded together (graph replay on the emulator too), each row checked by the demo and
    equal to the single-sequence demo of its prompt; the report gives the batch's and every row's tokens/s."""
    from hss.demo.batch import PROMPTS
    out = demo("--model", "random", "--batch", "3", "--tokens", "5", "--prompt-tokens", "24", "--graph", "--check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kv hbm; batch 3 (BatchSession); graph on; prompts 24 tokens; up to 5 tokens per row\nsampling: greedy\n" \
        in out.stdout
    rows = row_tokens(out.stdout)
    assert sorted(rows) == [0, 1, 2] and all(len(t) == 5 for t in rows.values())
    assert out.stdout.count("5/5 tokens are the numpy forward's argmax") == 3
    alone = demo("--model", "random", "--kv", "hbm", "--tokens", "5", "--prompt-tokens", "24", "--prompt", PROMPTS[1])
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert [int(t) for t in re.search(r"token ids: ([\d ]+)", alone.stdout).group(1).split()] == rows[1]
    assert "prefill: 3 rows, 72 tokens" in out.stdout and "tokens/s for the batch" in out.stdout
    assert all(f"  row {i}: 24 prompt + 5 tokens (max_new); decode " in out.stdout for i in range(3))
    measured = [line for line in out.stdout.splitlines() if any(w in line for w in ("tokens/s", " s wall", "weights:"))]
    assert len(measured) == 7 and all((NOT_MEASURED in line) == emulated(out) for line in measured), measured


def test_demo_batch_prompt_file_has_one_prompt_a_line_cycled(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("The first prompt, about rivers\n\nThe second one, about the moon and its phases\n", encoding="utf-8")
    out = demo("--model", "random", "--batch", "3", "--tokens", "3", "--prompt-file", str(f))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = row_tokens(out.stdout)
    assert rows[0] == rows[2] != rows[1]                            # 2 non-empty lines, cycled to 3 rows
    assert "prompts 30 to 45 tokens" in out.stdout                  # bytes of each line, the blank one skipped
    f.write_text("\n  \n", encoding="utf-8")
    out = demo("--model", "random", "--batch", "2", "--prompt-file", str(f))
    assert out.returncode == 2 and out.stderr.startswith(f"hss: error: --prompt-file {f} has no non-empty line")


def test_demo_batch_one_stays_the_single_sequence_demo_unless_asked():
    one = demo("--model", "random", "--batch", "1", "--tokens", "3", "--prompt-tokens", "16")
    assert one.returncode == 0 and "BatchSession" not in one.stdout and "kv swap" in one.stdout
    forced = demo("--model", "random", "--batch", "1", "--batch-session", "--tokens", "3", "--prompt-tokens", "16")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "batch 1 (BatchSession)" in forced.stdout and list(row_tokens(forced.stdout)) == [0]


SPARSE_FLAGS = ("--kv", "sparse", "--tokens", "6", "--prompt-tokens", "224", "--budget", "1", "--keep-first", "1",
                "--keep-recent", "1")   # 7 pages of 32 tokens, 3 attended a step: the selection matters


@pytest.mark.skipif(sparse_support() is not None, reason=f"hss.swap's sparse mode is missing: {sparse_support()}")
def test_demo_batch_sparse_rows_decode_what_the_sparse_demo_decodes_alone():
    """--batch 2 --kv sparse: the header names the mode and its pages, every row's tokens are the single-sequence
    --kv sparse demo's of its prompt (the same calibrated projection and head temperature), and the report sums the
    rows' counters: 5 steps x 3 of 7 pages x 2 layers x 2 rows attended."""
    from hss.demo.batch import PROMPTS
    out = demo("--model", "random", "--batch", "2", *SPARSE_FLAGS)
    assert out.returncode == 0, out.stdout + out.stderr
    graph = "off" if emulated(out) else "on"   # the demo's default: graphs on a GPU
    assert (f"kv sparse (budget 1, first 1, recent 1 pages); batch 2 (BatchSession); graph {graph}; prompts 224 "
            "tokens; up to 6 tokens per row\n") in out.stdout
    rows = row_tokens(out.stdout)
    assert sorted(rows) == [0, 1] and all(len(t) == 6 for t in rows.values())
    for i in (0, 1):
        alone = demo("--model", "random", *SPARSE_FLAGS, "--eval-tokens", "4", "--prompt", PROMPTS[i])
        assert alone.returncode == 0, alone.stdout + alone.stderr
        assert [int(t) for t in re.search(r"token ids: ([\d ]+)", alone.stdout).group(1).split()] == rows[i], i
    hits, misses = (int(n) for n in re.search(r"pages attended \(all rows and layers\) 60: (\d+) hits in HBM, "
                                              r"(\d+) misses read from the host", out.stdout).groups())
    assert hits + misses == 60 and misses > 0 and " MB read" in out.stdout
    assert all(f"  row {i}: 224 prompt + 6 tokens (max_new); decode " in out.stdout for i in range(2))


# a page and 28 tokens: the first page of each layer resident, the second streamed once it completes
SWAP_FLAGS = ("--kv", "swap", "--tokens", "6", "--prompt-tokens", "60", "--resident", "2")


def test_demo_batch_swap_rows_decode_what_the_swap_demo_decodes_alone():
    """--batch 2 --kv swap (graphs on, captured again as the rows' pages change): the header names the mode, every
    row's tokens are the single-sequence --kv swap demo's of its prompt, and the report sums the rows' counters:
    (5 steps x 1 + 1) pages x 2 layers x 2 rows attended, 5 x 2 x 2 resident, the one completed during the steps
    streamed (a capture for its epoch and one for the slots prefetched after it); --batch-session with --batch 1 is
    the same path."""
    from hss.demo.batch import PROMPTS
    out = demo("--model", "random", "--batch", "2", "--graph", *SWAP_FLAGS)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("kv swap (2 resident pages a row, all layers; ring 3); batch 2 (BatchSession); graph on; prompts 60 "
            "tokens; up to 6 tokens per row\n") in out.stdout
    rows = row_tokens(out.stdout)
    assert sorted(rows) == [0, 1] and all(len(t) == 6 for t in rows.values())
    for i in (0, 1):
        alone = demo("--model", "random", *SWAP_FLAGS, "--prompt", PROMPTS[i])
        assert alone.returncode == 0, alone.stdout + alone.stderr
        assert [int(t) for t in re.search(r"token ids: ([\d ]+)", alone.stdout).group(1).split()] == rows[i], i
    assert ("pages attended (all rows and layers) 24: 20 resident in HBM, 4 streamed from the host, 0.066 MB "
            "streamed; the step captured 3 time(s)") in out.stdout, out.stdout
    assert all(f"  row {i}: 60 prompt + 6 tokens (max_new); decode " in out.stdout for i in range(2))
    one = demo("--model", "random", "--batch", "1", "--batch-session", *SWAP_FLAGS)
    assert one.returncode == 0 and "kv swap (2 resident" in one.stdout and list(row_tokens(one.stdout)) == [0]


# -- sampling flags ---------------------------------------------------------------------------------------------
def parsed(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_sampling_flags_make_one_sampling_params():
    """Greedy unless asked; --chat takes llama.cpp's defaults unless --temperature 0 is given; a flag given wins."""
    assert sampling_params(parsed()) == GREEDY and sampling_text(GREEDY) == "greedy"
    assert sampling_params(parsed("--top-k", "5", "--seed", "9")).greedy   # temperature 0: the filters change nothing
    assert CHAT_SAMPLING == SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1)
    chat = sampling_params(parsed("--chat"))
    assert chat == CHAT_SAMPLING and not chat.greedy
    assert sampling_text(chat) == "temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.1, seed 0"
    assert sampling_params(parsed("--chat", "--temperature", "0")) == GREEDY
    assert sampling_params(parsed("--chat", "--temperature", "0", "--repeat-penalty", "1.2")) == \
        SamplingParams(repetition_penalty=1.2)
    got = sampling_params(parsed("--chat", "--top-k", "0", "--top-p", "1", "--presence-penalty", "0.5", "--seed",
                                 str((1 << 64) - 1)))
    assert got == SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
                                 seed=(1 << 64) - 1)
    assert sampling_text(got) == ("temperature 0.8, min-p 0.05, repeat penalty 1.1, presence penalty 0.5, seed "
                                  f"{(1 << 64) - 1}")
    plain = parsed("--temperature", "1.5", "--top-p", "0.9", "--min-p", "0.1", "--seed", "1")
    assert sampling_params(plain) == SamplingParams(temperature=1.5, top_p=0.9, min_p=0.1, seed=1)


def test_batch_rows_draw_with_the_seed_plus_the_row():
    args = parsed("--temperature", "0.8", "--seed", "1", "--batch", "2")
    assert [batch.sampling(args, row) for row in (0, 1)] == [SamplingParams(temperature=0.8, seed=s) for s in (1, 2)]
    assert sampling_text(sampling_params(args), 2) == "temperature 0.8, seeds 1 to 2 (--seed + the row)"
    last = parsed("--temperature", "0.8", "--seed", str((1 << 64) - 1))
    assert [batch.sampling(last, row).seed for row in (0, 1)] == [(1 << 64) - 1, 0]   # modulo 2**64
    assert batch.sampling(parsed("--seed", "4"), 1) == SamplingParams(seed=5) and batch.sampling(parsed(), 3).greedy


def ids_of(out: subprocess.CompletedProcess) -> list[int]:
    assert out.returncode == 0, out.stdout + out.stderr
    return [int(t) for t in re.search(r"token ids: ([\d ]+)", out.stdout).group(1).split()]


def test_demo_sampling_repeats_with_its_seed():
    """A seed repeats its draws (the default swap mode, eager); another seed draws other tokens. On the tiny random
    model the logits are peaked: at temperature 0.8 the seeds part at the seventh token here (the emulator, or any
    device: the draws are keyed by seed and step)."""
    run = ("--model", "random", "--tokens", "12", "--prompt-tokens", "16", "--temperature", "0.8")
    first = demo(*run, "--seed", "3")
    assert "sampling: temperature 0.8, seed 3\n" in first.stdout
    again, other, greedy = demo(*run, "--seed", "3"), demo(*run, "--seed", "4"), demo(*run[:-2])
    assert ids_of(first) == ids_of(again) and len(ids_of(first)) == 12
    assert ids_of(other) != ids_of(first) and ids_of(greedy) not in (ids_of(first), ids_of(other))


def test_demo_batch_rows_sample_with_the_seed_plus_the_row():
    """--batch 2 --seed 1: row 0 draws what its prompt draws alone with --seed 1, row 1 what its prompt draws with
    --seed 2 (a request's tokens depend on its seed and step, not its row)."""
    from hss.demo.batch import PROMPTS
    run = ("--model", "random", "--tokens", "8", "--prompt-tokens", "24", "--temperature", "0.8")
    out = demo(*run, "--batch", "2", "--seed", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sampling: temperature 0.8, seeds 1 to 2 (--seed + the row)\n" in out.stdout
    rows = row_tokens(out.stdout)
    assert sorted(rows) == [0, 1] and all(len(t) == 8 for t in rows.values())
    for row, seed in ((0, 1), (1, 2)):
        alone = demo(*run, "--kv", "hbm", "--prompt", PROMPTS[row], "--seed", str(seed))
        assert ids_of(alone) == rows[row], (row, seed)
