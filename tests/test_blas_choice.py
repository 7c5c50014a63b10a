"""The decode GEMM's algorithm choice (hss.cuda._blas.Blas._choose) under failures: an algorithm the device refuses is
skipped, but a failure of the timing's own driver calls fails the call (it used to be swallowed as "not a
candidate", so an injected fault at the driver seam did not fail the QSA decode step that chose its GEMM), and
every candidate plan is closed either way. cuBLASLt is faked; the timing's events and graphs are the driver's."""
from __future__ import annotations

import pytest
from test_qsa_indexer import driver_calls

from hss.cuda import _blas
from hss.cuda._driver import CudaError


class _FakeLt:
    class cuBLASLtError(Exception):
        pass

    @staticmethod
    def create() -> int:
        return 1


class _Plan:
    def __init__(self, refuses: bool) -> None:
        self.refuses, self.runs, self.closed = refuses, 0, 0

    def run(self, *args) -> None:
        self.runs += 1
        if self.refuses:
            raise CudaError("cublasLtMatmul", "cuBLASLtError", "refused", "m=1 n=8 k=8")

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def make(ctx, monkeypatch):
    """A fresh Blas whose cuBLASLt offers a refused and a working plan (each call: new plans)."""
    made = []
    monkeypatch.setattr(_blas, "_cublaslt", lambda: _FakeLt)

    def new():
        plans = [_Plan(True), _Plan(False)]
        monkeypatch.setattr(_blas._LtPlan, "candidates", classmethod(lambda cls, handle, m, n, k: plans))
        b = _blas.Blas()
        b._gemm_ex = lambda *args: None
        made.append(b)
        return b, plans
    yield new
    for b in made:
        if b._workspace is not None:
            b._workspace.close()


def test_a_refused_algorithm_is_not_a_candidate(make, stream) -> None:
    b, (refused, works) = make()
    best = b._choose(0, 0, 0, 1, 8, 8, stream)
    assert best in (works, None)   # the one that runs, or GemmEx when it was faster
    assert refused.runs == 1 and refused.closed == 1
    assert b._plans[(1, 8, 8)] is best
    assert works.closed == (0 if best is works else 1)


def test_a_failed_driver_call_fails_the_choice(make, stream) -> None:
    with driver_calls() as seen:
        make()[0]._choose(0, 0, 0, 1, 8, 8, stream)
    timing = [i for i, name in enumerate(seen) if name in _blas._TIMING_CALLS]
    assert len(timing) >= 3 * _blas.LT_ROUNDS   # GemmEx's and the working plan's timed replays
    for at in [0, *timing]:   # the workspace's allocation, then every event call of the timing
        b, plans = make()
        with driver_calls(at) as got:
            with pytest.raises(CudaError) as err:
                b._choose(0, 0, 0, 1, 8, 8, stream)
        assert err.value.call == got[at] == seen[at]
        assert (1, 8, 8) not in b._plans   # nothing remembered: the next call times again
        assert all(p.closed == 1 for p in plans) or at == 0   # (a failed allocation: no plan made yet)
