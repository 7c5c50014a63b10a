"""Where the tests run is decided by the process's driver: a real GPU, or the CPU emulator (CI).

``gpu``-marked tests need real hardware and skip on the emulator with the reason; ``emulator``-marked
tests check emulator-only behaviour and skip on a GPU. Hypothesis uses one profile per driver.
"""
from __future__ import annotations

import os
import secrets

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

os.environ.setdefault("HSS_EMULATOR_DEVICES", "2")   # the emulator offers two devices to the multi-device tests

try:
    from hss.cuda._driver import driver_status
    STATUS = driver_status()
except ImportError as exc:   # a bare interpreter without hss's dependencies: only the source-level tests can run
    from types import SimpleNamespace
    STATUS = SimpleNamespace(kind="none", found=False, message=f"hss cannot be imported here: {exc}")
ON_GPU = STATUS.kind == "cuda" and STATUS.found

settings.register_profile(
    "emulator", deadline=None, max_examples=12, derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "gpu", deadline=None, max_examples=30, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile(   # compute-sanitizer reruns: few, small examples
    "sanitize", deadline=None, max_examples=3, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HSS_HYPOTHESIS_PROFILE") or ("gpu" if ON_GPU else "emulator"))


def pytest_report_header(config: pytest.Config) -> str:
    return f"hss driver: {STATUS.kind} ({STATUS.message}); hypothesis profile: {settings._current_profile}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason=f"needs a real NVIDIA GPU; this run uses the {STATUS.kind} ({STATUS.message})")
    skip_emu = pytest.mark.skip(reason="checks emulator-only behaviour (deferred execution); a GPU runs it for real")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)
        if "emulator" in item.keywords and ON_GPU:
            item.add_marker(skip_emu)


@pytest.fixture(scope="session")
def ctx():
    from hss.cuda_min import CudaCtx
    c = CudaCtx(0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def gpu(ctx):
    """A CudaBackend (the QSA indexer's GPU) on the session context."""
    from hss.cuda.gpu import CudaBackend
    g = CudaBackend(ctx)
    yield g
    g.close()


@pytest.fixture
def stream(ctx):
    return ctx.stream


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Fresh random data each run (seed shown on failure; HSS_TEST_SEED pins it)."""
    seed = int(os.environ.get("HSS_TEST_SEED") or secrets.randbits(32))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> None:
    if call.when == "call" and call.excinfo is not None:
        for key, value in item.user_properties:
            if key == "seed":
                item.add_report_section("call", "seed", f"HSS_TEST_SEED={value}")
