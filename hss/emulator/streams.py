"""Emulated streams, events and graphs: work is queued per stream and runs only when waited for.

A stream is a queue of operations with two counters, ``submitted`` and ``done``. Waiting for a
stream position runs its queue up to there. An event remembers the (stream, position) of its
last record; ``cuStreamWaitEvent`` queues an operation that runs the other stream up to that
position first. Nothing else orders two streams, so a missing cross-stream wait or a missing
sync leaves results unwritten on the CPU just as it would race on a GPU. A stream in capture
mode appends its operations to a graph instead; a graph launch queues copies of them.

An operation that raises (an emulated memory fault) does not stop the queue: its exception goes to the
``faults`` list the stream was made with, and the driver reports it at the next synchronising call, as a
GPU reports a fault in queued work at the next sync.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable

Op = Callable[[], None]


class Stream:
    def __init__(self, handle: int, ctx: int, blocking: bool, faults: list[BaseException]) -> None:
        self.handle, self.ctx, self.blocking, self.faults = handle, ctx, blocking, faults
        self.queue: collections.deque[Op] = collections.deque()
        self.submitted = 0
        self.done = 0
        self.capture: list[Op] | None = None
        self.capture_broken = False

    def push(self, op: Op) -> None:
        self.queue.append(op)
        self.submitted += 1

    def run_to(self, position: int) -> None:
        while self.done < position:
            op = self.queue.popleft()
            self.done += 1
            try:
                op()
            except Exception as exc:   # the driver reports it at the next synchronising call
                self.faults.append(exc)

    def drain(self) -> None:
        self.run_to(self.submitted)


class Event:
    def __init__(self, handle: int, timing: bool, ctx: int = 0) -> None:
        self.handle, self.timing, self.ctx = handle, timing, ctx
        self.stream: Stream | None = None
        self.position = 0
        self.time: float | None = None

    def pending(self) -> bool:
        return self.stream is not None and self.stream.done < self.position

    def record_op(self) -> Op:
        def op() -> None:
            self.time = time.perf_counter()
        return op


class Graph:
    def __init__(self, handle: int, ops: list[Op]) -> None:
        self.handle, self.ops = handle, ops


class GraphExec:
    def __init__(self, handle: int, graph: Graph) -> None:
        self.handle, self.ops = handle, list(graph.ops)
