"""Emulated streams, events and graphs: work is queued per stream and runs only when waited for.

A stream is a queue of operations with two counters, ``submitted`` and ``done``. Waiting for a
stream position runs its queue up to there. An event remembers the (stream, position) of its
last record; ``cuStreamWaitEvent`` queues an operation that runs the other stream up to that
position first. Nothing else orders two streams, so a missing cross-stream wait or a missing
sync leaves results unwritten on the CPU just as it would race on a GPU. A stream in capture
mode appends its operations to a graph instead; a graph launch queues copies of them. A capture may fork:
a stream that waits for an event recorded in a capture joins it as another *lane* (:class:`CaptureGroup`), its
waits on other lanes kept as :class:`Dep` markers; a launch of such a graph runs the origin lane on the launching
stream and every other lane on a private stream, the markers becoming the same lazy cross-stream waits as eager
``cuStreamWaitEvent`` (so a missing wait inside a graph leaves work unrun, as it does eagerly).

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
        self.capture_group: CaptureGroup | None = None   # the capture this stream takes part in
        self.capture_lane = 0                            # its lane in that capture (0: the origin)

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
        self.captured: tuple[CaptureGroup, int, int] | None = None   # (capture, lane, position) of a captured record
        self.time: float | None = None

    def pending(self) -> bool:
        return self.stream is not None and self.stream.done < self.position

    def record_op(self) -> Op:
        def op() -> None:
            self.time = time.perf_counter()
        return op


class Dep:
    """A captured cross-lane wait: lane ``lane`` of the capture has run its first ``pos`` operations."""

    __slots__ = ("lane", "pos")

    def __init__(self, lane: int, pos: int) -> None:
        self.lane, self.pos = lane, pos


class CaptureGroup:
    """One capture sequence: its origin stream (lane 0) and the streams that joined it (lanes 1, ...), per lane the
    operations that count as work (every one but event records) and the furthest position another lane waits for
    (a lane whose work outlasts that was never joined back)."""

    def __init__(self, cid: int, origin: Stream) -> None:
        self.id, self.lanes = cid, [origin]
        self.work, self.waited = [0], [0]
        self.active = True

    def join(self, st: Stream) -> None:
        st.capture, st.capture_broken = [], False
        st.capture_group, st.capture_lane, st.capture_id = self, len(self.lanes), self.id
        self.lanes.append(st)
        self.work.append(0)
        self.waited.append(0)

    def unjoined(self) -> bool:
        return any(w > self.waited[i] for i, w in enumerate(self.work) if i)


class Graph:
    """Captured operations: ``ops`` the origin lane's; ``lanes`` every lane's (``[ops]`` for a capture that did not
    fork), with :class:`Dep` markers between them."""

    def __init__(self, handle: int, ops: list[Op], lanes: list[list] | None = None) -> None:
        self.handle, self.ops = handle, ops
        self.lanes = lanes if lanes is not None else [ops]


class GraphExec:
    def __init__(self, handle: int, graph: Graph) -> None:
        self.handle, self.ops = handle, list(graph.ops)
        self.lanes = [list(lane) for lane in graph.lanes]
