"""The benchmark timer (hss.bench._timer) and the overhead suite's bookkeeping; runs on the emulator."""
from __future__ import annotations

import time

import pytest

from hss.bench._timer import Case, Flush, Timing, gpu_us, host_us, rotating


def test_host_us_interleaves_batches_after_warmup() -> None:
    log: list[str] = []
    cases = {name: Case(lambda name=name: log.append(name), lambda name=name: log.append(name + " sync"),
                        lambda name=name: log.append(name + " prepare")) for name in ("a", "b")}
    t = host_us(cases, batch=2, batches=2, warmup=1)
    batch_round = ["a prepare", "a", "a", "a sync", "b prepare", "b", "b", "b sync"]
    assert log == ["a", "a sync", "b", "b sync"] + batch_round * 2
    assert set(t) == {"a", "b"}
    assert all(isinstance(v, Timing) and len(v.samples) == 2 and v.us > 0 for v in t.values())


def test_host_us_times_the_sync_only_when_told() -> None:
    def nap() -> None:
        time.sleep(0.004)

    untimed = host_us({"x": Case(lambda: None, nap)}, batch=2, batches=3, warmup=0)["x"]
    timed = host_us({"x": Case(lambda: None, nap)}, batch=2, batches=3, warmup=0, timed_sync=True)["x"]
    assert untimed.us < 1000 <= timed.us   # 4 ms of sync over 2 calls: >= 2000 µs per call when timed


def test_host_us_takes_bare_callables_and_reports_the_median() -> None:
    calls = []
    t = host_us({"f": lambda: calls.append(1)}, batch=3, batches=5, warmup=0)["f"]
    assert len(calls) == 15
    assert t.us == sorted(t.samples)[2]


def test_gpu_us_events_around_batches(ctx, stream) -> None:
    calls, prepared = [], []
    buf_flush = Flush(stream, 4096)
    try:
        def prepare() -> None:
            prepared.append(1)
            buf_flush()

        t = gpu_us(stream, lambda: calls.append(1), batch=3, batches=4, warmup=2, prepare=prepare)
        assert len(calls) == 2 + 3 * 4 and len(prepared) == 4
        assert len(t.samples) == 4 and t.us >= 0
        t = gpu_us(stream, lambda: None, batch=1, batches=3, sync_each=True)
        assert len(t.samples) == 3
    finally:
        buf_flush.close()


def test_rotating_walks_the_index() -> None:
    seen: list[int] = []
    f = rotating(seen.append, 5)
    for _ in range(3):
        f()
    assert seen == [5, 6, 7]


def test_outside_waits_subtracts_each_batch_own_waits() -> None:
    from hss.bench.overhead import _outside_waits
    # 2 warm-up calls, then 3 batches of 2 calls; each batch's waits (seconds) removed from its µs per call
    waits = [9.0, 9.0, 1e-6, 1e-6, 2e-6, 2e-6, 4e-6, 0.0]
    t = Timing(10.0, (10.0, 10.0, 10.0))
    assert _outside_waits(t, waits, warmup=2, batch=2) == pytest.approx(8.0)   # median of 9, 8, 8


def test_overhead_smoke_runs_every_form_and_states_the_targets() -> None:
    from hss.bench import overhead
    rows = overhead.run(overhead.parse_args(["--smoke"]))
    assert not [r for r in rows if "CHECK FAILED" in r["note"]]
    assert rows[0]["call"].startswith("raw cuLaunchKernel") and rows[0]["x_floor"] == 1.0
    timed = {(r["call"], r["form"]) for r in rows if r["us"] is not None}
    for call in overhead.SINGLE:
        assert (call, "int") in timed and (call, "DeviceBuffer") in timed
    text = overhead.table(rows)
    assert text.count("- target:") == 7
