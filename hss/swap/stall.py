"""Read stalls of the swap step (``read_stall_ms``): :class:`StallTimer`, pairs of timing events around the attention
stream's waits for reads, summed on the host once they are complete, with as few event queries as it can."""
from __future__ import annotations

from typing import Any

from hss import cuda_min as cm

__all__ = ["StallTimer"]


class StallTimer:
    """Pairs of timing events around the attention stream's waits for reads; summed once complete."""

    def __init__(self, ctx: Any) -> None:
        self._ctx, self._spare, self._pending, self._open = ctx, [], [], None
        self._mark = self._known = 0      # pairs before the last marked event; pairs known complete
        self.ms = 0.0

    def _event(self) -> cm.CudaEvent:
        return self._spare.pop() if self._spare else cm.CudaEvent(timing=True, ctx=self._ctx)

    def begin(self, stream: int) -> None:
        """Record a pair's first event on ``stream`` (before its wait)."""
        self._open = self._event()
        self._open.record(stream)

    def end(self, stream: int) -> None:
        """Record the pair's second event on ``stream`` (after its wait)."""
        b = self._event()
        b.record(stream)
        self._pending.append((self._open, b))

    def mark(self) -> None:
        """An event the host will wait for is recorded after the pairs recorded so far (on their stream or one
        ordered after it): :meth:`reached` once it has completed."""
        self._mark = len(self._pending)

    def reached(self) -> None:
        """The last :meth:`mark`'s event has completed: its pairs are summed with no query."""
        self._known = max(self._known, self._mark)

    def collect(self, wait: bool) -> None:
        """Sum the complete pairs (``wait``: all of them, after waiting; else those known complete, see
        :meth:`reached`, or found complete by queries). Pairs complete in record order: one step's are on one
        stream, and each step's stream waits for the previous step's end."""
        pending = self._pending
        if not pending:
            return
        if wait:
            pending[-1][1].synchronize()
            k = len(pending)
        elif self._known:
            k = min(self._known, len(pending))
        elif pending[-1][1].query():
            k = len(pending)
        else:
            k = 0
            while k < len(pending) and pending[k][1].query():
                k += 1
        for a, b in pending[:k]:
            self.ms += a.elapsed_ms(b)
            self._spare += [a, b]
        del pending[:k]
        self._known, self._mark = max(self._known - k, 0), max(self._mark - k, 0)

    def close(self) -> None:
        """Free every event (the pairs not yet summed are dropped)."""
        for ev in self._spare + [e for pair in self._pending for e in pair]:
            ev.close()
        self._spare, self._pending = [], []
