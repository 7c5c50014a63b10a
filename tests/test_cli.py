"""``python -m hss``: the commands a user expects, argparse's messages for wrong flags and values (with the
command's own usage), ``hss: error: ...`` and exit status 2 for every :class:`HssError`, ``--version``, and the
package face ``help(hss)`` shows. No GPU needed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import hss
from hss import __main__ as cli
from hss.errors import HssError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def python(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env={**ENV, **env})


def usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--help"]])
def test_help_lists_every_command_with_one_line(capsys, argv):
    if argv:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
    else:
        assert cli.main(argv) == 0           # no command: the help, exit status 0
    out = capsys.readouterr().out
    for name, cmd in cli.COMMANDS.items():
        assert f"    {name} " in out and cmd.help.split()[0] in out
    assert "--version" in out and "{" not in out.split("commands:")[1]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hss {hss.__version__}"


def test_help_and_version_import_nothing_heavy():
    out = python("-c", "import sys\nfrom hss.__main__ import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
                 "    pass\nprint(sorted(m for m in sys.modules if m.startswith(('hss.', 'ml_dtypes', 'cuda'))))")
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert "hss.model" not in out.stdout and "ml_dtypes" not in out.stdout
    assert not [m for m in loaded if m.strip("[]',").startswith("cuda")], "cuda-python was imported"


@pytest.mark.parametrize("argv, usage", [
    (["demo", "--tokenz", "3"], "python -m hss demo"),
    (["demo-qsa", "--stepz", "3"], "python -m hss demo-qsa"),
    (["info", "--verbose"], "python -m hss info"),
    (["fetch", "--wheels", "x"], "python -m hss fetch"),
])
def test_unknown_flags_are_named_with_the_commands_usage(capsys, argv, usage):
    err = usage_error(capsys, argv)
    assert f"usage: {usage} " in err and f"unrecognized arguments: {' '.join(argv[1:])}" in err


def test_an_unknown_command_and_the_old_demo_qsa(capsys):
    assert "invalid choice: 'dmeo'" in usage_error(capsys, ["dmeo"])
    assert "python -m hss demo-qsa" in usage_error(capsys, ["demo", "qsa"])


@pytest.mark.parametrize("argv, flag, low", [
    (["demo", "--tokens", "-1"], "--tokens", 1),
    (["demo", "--tokens", "0"], "--tokens", 1),
    (["demo", "--prompt-tokens", "0"], "--prompt-tokens", 1),
    (["demo", "--resident", "-1"], "--resident", 0),
    (["demo", "--tile", "0"], "--tile", 1),
    (["demo", "--ring", "0"], "--ring", 1),
    (["demo", "--rank", "0"], "--rank", 1),
    (["demo", "--budget", "0"], "--budget", 1),
    (["demo", "--keep-first", "-2"], "--keep-first", 0),
    (["demo", "--keep-recent", "-1"], "--keep-recent", 0),
    (["demo", "--eval-tokens", "0"], "--eval-tokens", 1),
    (["demo", "--profile-steps", "0"], "--profile-steps", 1),
    (["demo", "--model-seed", "-1"], "--model-seed", 0),
    (["demo", "--device", "-1"], "--device", 0),
    (["demo", "--batch", "0"], "--batch", 1),
    (["demo-qsa", "--prefill", "0"], "--prefill", 1),
    (["demo-qsa", "--steps", "0"], "--steps", 1),
    (["demo-qsa", "--hidden", "-5"], "--hidden", 1),
])
def test_counts_out_of_range_name_the_flag_and_the_range(capsys, argv, flag, low):
    err = usage_error(capsys, argv)
    assert f"argument {flag}: {argv[-1]} is out of range (allowed: {low} or more)" in err


def test_a_count_that_is_no_integer(capsys):
    assert "argument --tokens: 'three' is not an integer (allowed: 1 or more)" in \
        usage_error(capsys, ["demo", "--tokens", "three"])


@pytest.mark.parametrize("flag, value, rule", [
    ("--temperature", "-1", "temperature = -1.0 must be >= 0"),
    ("--temperature", "1e-50", "must be representable as finite f32"),
    ("--top-k", "-1", "top_k = -1 must be in 0..1024"),
    ("--top-k", "1025", "top_k = 1025 must be in 0..1024"),
    ("--top-p", "0", "top_p = 0.0 must be in (0, 1]"),
    ("--top-p", "1.5", "top_p = 1.5 must be in (0, 1]"),
    ("--min-p", "1.01", "min_p = 1.01 must be in [0, 1]"),
    ("--repeat-penalty", "0", "repetition_penalty = 0.0 must be > 0"),
    ("--presence-penalty", "nan", "presence_penalty = nan must be finite"),
    ("--seed", "-1", "seed = -1 must be in 0..18446744073709551615"),
    ("--seed", str(1 << 64), f"seed = {1 << 64} must be in 0..18446744073709551615"),
])
def test_sampling_values_out_of_range_name_the_flag_and_the_rule(capsys, flag, value, rule):
    err = usage_error(capsys, ["demo", flag, value])
    assert "usage: python -m hss demo " in err and f"argument {flag}: {value} is out of range (" in err and rule in err


def test_a_sampling_value_of_the_wrong_kind(capsys):
    assert "argument --top-k: '1.5' is not an integer" in usage_error(capsys, ["demo", "--top-k", "1.5"])
    assert "argument --temperature: 'hot' is not a number" in usage_error(capsys, ["demo", "--temperature", "hot"])


@pytest.mark.parametrize("argv, shown", [
    (["--temperature", "0.8"], "temperature 0.8, seed 0"),
    (["--repeat-penalty", "1.3"], "temperature 0, repeat penalty 1.3, seed 0"),
    (["--chat"], "temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.1, seed 0 (--chat samples by "
                 "default)"),
])
def test_check_with_sampling_is_refused(capsys, argv, shown):
    """--check compares with the argmax: any sampling that is not the argmax (penalties too) is an error, before the
    model is loaded."""
    assert cli.main(["demo", "--model", "random", "--check", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hss: error: --check compares every token with the numpy forward's argmax, so it needs "
                          f"greedy decoding, not {shown}: drop --check, or pass --temperature 0 and no penalties")


def test_an_hss_error_is_one_line_on_stderr_with_status_2(tmp_path):
    bad = tmp_path / "nope.gguf"
    out = python("-m", "hss", "demo", "--model", str(bad))
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("hss: error: ") and str(bad) in out.stderr and "Traceback" not in out.stderr
    out = python("-m", "hss", "demo", "--model", "random", "--prompt-file", str(bad))
    assert out.returncode == 2 and f"hss: error: --prompt-file {bad}: cannot read it" in out.stderr


def test_batch_with_the_exact_swap_runs(capsys):
    assert cli.main(["demo", "--model", "random", "--batch", "2", "--kv", "swap", "--tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "kv swap (0 resident pages a row, all layers; ring 3); batch 2 (BatchSession)" in out
    assert "streamed from the host" in out


def test_hss_errors_are_caught_other_exceptions_are_not(monkeypatch, capsys):
    def raising(exc):
        def arguments(parser):
            def run(args):
                raise exc
            return run
        return arguments

    monkeypatch.setitem(cli.COMMANDS, "info", cli.Command("x", raising(HssError("the reason"))))
    assert cli.main(["info"]) == 2
    assert capsys.readouterr().err == "hss: error: the reason\n"
    monkeypatch.setitem(cli.COMMANDS, "info", cli.Command("x", raising(RuntimeError("a bug"))))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["info"])


def test_bench_passes_its_arguments_through(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0 and "--smoke" in capsys.readouterr().out


def test_the_package_face_names_the_main_objects():
    for name in ("CudaCtx", "Predictor", "PredictorDims", "TiledAttention", "HighSpeedSwap", "QsaIndexer",
                 "load_model", "Session", "DeviceModel", "HssError"):
        assert name in hss.__all__ and f"``{name}``" in hss.__doc__
    for name in hss.__all__:
        assert getattr(hss, name) is not None
    assert set(hss.__all__) <= set(dir(hss))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hss.nope    # noqa: B018


def test_import_hss_stays_cheap():
    out = python("-c", "import sys, hss\nprint(sorted(m for m in sys.modules if m.startswith('hss.')))")
    assert out.returncode == 0, out.stderr
    for heavy in ("hss.cuda_min", "hss.model", "hss.checkpoint", "hss.swap", "hss.qsa"):
        assert f"'{heavy}" not in out.stdout
