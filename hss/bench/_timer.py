"""The one benchmark timer of every suite (in the spirit of Triton's ``do_bench``).

* :func:`host_us`: host wall time, median µs per call. The variants are timed in interleaved batches (variant A's
  batch, B's batch, ..., then A again), so clock and thermal drift hits all of them alike; each is warmed up first.
  Inside a batch the calls run back to back: nothing synchronises between them. A variant's ``sync`` runs after each
  of its batches, outside the batch's time by default (host cost only), inside it with ``timed_sync=True``
  (throughput: the batch ends when its queued work has drained).
* :func:`gpu_us`: device time, median µs per call: a pair of timing events (``CudaEvent(timing=True)``) around each
  batch of calls on ``stream``.
* Hooks: a variant's ``prepare`` runs before each batch, outside its time (for :func:`gpu_us` it is queued before the
  start event): a :class:`Flush` (a large memset: it evicts L2 and lets the batch's launches queue up behind it, so
  host issue gaps do not count), or a rotation to the next buffers; :func:`rotating` turns ``fn(i)`` into a
  no-argument call that walks ``i = 0, 1, 2, ...`` (rotating windows or buffers, one per call).

The garbage collector is off while a batch runs (as in :mod:`timeit`), so a collection never lands in one sample.
"""
from __future__ import annotations

import gc
import itertools
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from hss import cuda_min as cm

__all__ = ["Case", "Timing", "host_us", "gpu_us", "Flush", "rotating"]


class Timing(NamedTuple):
    """``us``: the median µs per call over the batches; ``samples``: µs per call of each batch, in order."""

    us: float
    samples: tuple[float, ...]


class Case(NamedTuple):
    """One variant of :func:`host_us`: ``fn()`` is the call timed; ``sync()`` runs after each batch (drains queued
    work; see ``timed_sync``); ``prepare()`` runs before each batch, never timed."""

    fn: Callable[[], Any]
    sync: Callable[[], Any] | None = None
    prepare: Callable[[], Any] | None = None


def _run(fn: Callable[[], Any], n: int) -> None:
    for _ in range(n):
        fn()


def host_us(cases: Mapping[str, Case | Callable[[], Any]], *, batch: int, batches: int, warmup: int | None = None,
            timed_sync: bool = False) -> dict[str, Timing]:
    """Median host µs per call of every case (a :class:`Case` or a bare callable), in interleaved batches.

    ``batch`` calls per batch, ``batches`` batches per case; ``warmup`` untimed calls of each case first (default
    ``min(batch, 200)``), followed by its ``sync``. ``timed_sync``: the batch's time includes its ``sync``."""
    norm = {name: c if isinstance(c, Case) else Case(c) for name, c in cases.items()}
    samples: dict[str, list[float]] = {name: [] for name in norm}
    n_warm = min(batch, 200) if warmup is None else warmup
    for case in norm.values():
        _run(case.fn, n_warm)
        if case.sync is not None:
            case.sync()
    clock = time.perf_counter
    enabled = gc.isenabled()
    try:
        for _ in range(batches):
            for name, (fn, sync, prepare) in norm.items():
                if prepare is not None:
                    prepare()
                gc.disable()
                t0 = clock()
                for _ in range(batch):
                    fn()
                if sync is not None and timed_sync:
                    sync()
                t1 = clock()
                if enabled:
                    gc.enable()
                if sync is not None and not timed_sync:
                    sync()
                samples[name].append((t1 - t0) / batch * 1e6)
    finally:
        if enabled:
            gc.enable()
    return {name: Timing(statistics.median(v), tuple(v)) for name, v in samples.items()}


def gpu_us(stream: Any, fn: Callable[[], Any], *, batch: int = 1, batches: int = 1, warmup: int = 0,
           prepare: Callable[[], Any] | None = None, sync_each: bool = False) -> Timing:
    """Median device µs per call of ``fn()``: timing events on ``stream`` around each batch of ``batch`` calls.

    ``warmup`` untimed calls first, then the stream is synchronised. ``prepare()`` runs before each batch (queued
    ahead of its start event, so not timed). The host waits once, after the last batch, unless ``sync_each`` (a wait
    after every batch: each batch starts on a drained queue)."""
    s = cm.stream_handle(stream)
    _run(fn, warmup)
    cm.stream_sync(s)
    events = [(cm.CudaEvent(timing=True), cm.CudaEvent(timing=True)) for _ in range(batches)]
    try:
        for start, end in events:
            if prepare is not None:
                prepare()
            start.record(s)
            _run(fn, batch)
            end.record(s)
            if sync_each:
                end.synchronize()
        if events:
            events[-1][1].synchronize()
        times = tuple(start.elapsed_ms(end) * 1e3 / batch for start, end in events)
    finally:
        for pair in events:
            for e in pair:
                e.close()
    return Timing(statistics.median(times), times)


class Flush:
    """A ``prepare`` hook: a memset of ``nbytes`` of device memory on ``stream`` (a few hundred MB evicts L2; a long
    one fills the queue so the launches after it run back to back). ``close()`` frees the buffer."""

    def __init__(self, stream: Any, nbytes: int) -> None:
        self.stream = cm.stream_handle(stream)
        self.buffer = cm.DeviceBuffer(nbytes)

    def __call__(self) -> None:
        cm.memset_d32_async(self.buffer, 0, self.buffer.bytes // 4, self.stream)

    def close(self) -> None:
        self.buffer.close()


def rotating(fn: Callable[[int], Any], start: int = 0) -> Callable[[], Any]:
    """A no-argument call of ``fn(i)`` with ``i = start, start + 1, ...`` (the index picks the window or buffer)."""
    count = itertools.count(start)
    return lambda: fn(next(count))
