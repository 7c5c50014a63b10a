"""``python -m hss.bench sample``: the smoke runs every code path (numbers meaningless on the emulator), the table
states the target, and the target line reads the step time from ``--step-us`` or says it is assumed."""
from __future__ import annotations

from hss.bench import sample as bench


def test_sample_smoke_runs_every_setting_and_states_the_target() -> None:
    args = bench.parse_args(["--smoke"])
    assert args.no_torch and args.step_us is None
    rows = bench.run(args)
    assert not [r for r in rows if "CHECK FAILED" in r["note"] or "skipped:" in r["note"]]
    want = [*bench.SETTINGS, *(f"{name}, unstaged" for name in bench.OTHER_STAGE)]   # staged by default: 3,000 fit
    assert {(r["rows"], r["setting"]) for r in rows} == {(n, s) for n in (1, 3) for s in want}
    assert all(r["sample_us"] > 0 and r["argmax_us"] > 0 and "torch_us" not in r for r in rows)
    assert all("torch skipped" in r["note"] or r["note"] == "stage=False" for r in rows)
    text = bench.table(rows)
    assert text.count("- target:") == 1 and "assumed" in text and "measured at V = 3,000 instead" in text


def test_target_line_uses_the_step_time_and_the_target_row() -> None:
    rows = [dict(vocab=v, rows=r, setting=s, sample_us=us, step_us=800.0)
            for v, r, s, us in ((262144, 1, bench.TARGET_SETTING, 90.0), (49152, 16, bench.TARGET_SETTING, 70.0),
                                (49152, 1, "greedy", 10.0), (49152, 1, bench.TARGET_SETTING, 32.0))]
    line = bench.target_line(rows)
    assert "800 µs, given by --step-us" in line and "32.0 µs = 4.0 % of the step: met" in line
    assert "instead" not in line
    rows[-1]["sample_us"] = 48.0
    assert bench.target_line(rows).endswith("6.0 % of the step: NOT met")
    for r in rows:
        r["step_us"] = None
    assert "1,000 µs, assumed" in bench.target_line(rows) and "4.8 %" in bench.target_line(rows)
    assert "not measured" in bench.target_line(rows[1:3])
