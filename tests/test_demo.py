"""``python -m hss demo`` runs end to end (emulator in CI, GPU on the device) and reports what it promises."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_runs_past_the_inert_bound():
    out = subprocess.run([sys.executable, "-m", "hss", "demo", "--prefill", "2050", "--steps", "3", "--hidden", "256"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             filter(None, [ROOT, os.environ.get("PYTHONPATH")]))})
    assert out.returncode == 0, out.stderr
    steps = re.findall(r"visible (\d+), selected (\d+) tokens.*cosine\(sparse, dense\) ([0-9.]+)", out.stdout)
    assert [int(v) for v, _, _ in steps] == [2051, 2052, 2053]
    assert int(steps[0][1]) == 2051 and "inert" in out.stdout           # visible <= 2051: dense is exact
    assert int(steps[1][1]) == 2048 and int(steps[2][1]) == 2049         # 512 blocks + the tail
    assert all(float(c) > 0.99 for _, _, c in steps)
    assert "median per stage" in out.stdout


def test_demo_help_lists_the_knobs():
    out = subprocess.run([sys.executable, "-m", "hss", "demo", "--help"], capture_output=True, text=True, cwd=ROOT)
    for flag in ("--prefill", "--steps", "--hidden", "--seed", "--device"):
        assert flag in out.stdout
