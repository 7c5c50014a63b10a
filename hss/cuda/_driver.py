"""The driver seam: ``cuda.bindings.driver`` or ``hss.emulator``, chosen once per process.

Everything in hss reaches the CUDA driver through :data:`api` and unwraps results with
:func:`check`. ``HSS_DRIVER=emulator`` forces the CPU emulator, ``HSS_DRIVER=cuda`` forces the real
driver; unset, the real driver is used when ``cuInit`` finds one and the emulator otherwise.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hss.errors import CudaError, HssError

__all__ = [
    "HssError", "CudaError", "api", "check", "driver_status", "DriverStatus", "inject_fault",
    "NO_DRIVER_MESSAGE", "PTX_VERSION_MESSAGE",
]

NO_DRIVER_MESSAGE = (
    "no CUDA driver was found (libcuda could not be loaded): install the NVIDIA driver, "
    "or set HSS_DRIVER=emulator to run on the CPU emulator"
)
PTX_VERSION_MESSAGE = (
    "the driver is too old for hss's PTX (ISA 9.0, built by nvcc 13.0): it needs driver >= 580; "
    "upgrade the driver, or rebuild the PTX with an older nvcc (python build_ptx.py)"
)


@dataclass(frozen=True)
class DriverStatus:
    """What the seam found: ``kind`` is 'cuda' or 'emulator'; ``message`` says why."""

    kind: str
    found: bool          # a real driver was loaded and initialised
    version: int | None  # cuDriverGetVersion of the real driver (e.g. 13000), if found
    message: str


class _Api:
    """Attribute view of the chosen driver module; ``inject_fault`` overrides single calls."""

    def __init__(self) -> None:
        self._module: Any = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        module = _load()
        value = getattr(module, name)
        setattr(self, name, value)  # cache: later lookups are a plain instance-dict hit
        return value


api = _Api()
_lock = threading.Lock()
_status: DriverStatus | None = None


def _load() -> Any:
    if api._module is None:
        with _lock:
            if api._module is None:
                _choose()
    return api._module


def _choose() -> None:
    global _status
    want = os.environ.get("HSS_DRIVER", "").strip().lower()
    if want not in ("", "auto", "cuda", "emulator"):
        raise HssError(f"HSS_DRIVER={want!r}: use 'cuda', 'emulator' or leave it unset")
    if want == "emulator":
        from hss import emulator
        api._module = emulator
        _status = DriverStatus("emulator", False, None, "HSS_DRIVER=emulator: running on the CPU emulator")
        return
    try:
        from cuda.bindings import driver as real
    except ImportError as exc:
        if want == "cuda":
            raise ImportError(f"HSS_DRIVER=cuda but cuda-python is not importable ({exc}): pip install cuda-python") \
                from exc
        from hss import emulator
        api._module = emulator
        _status = DriverStatus("emulator", False, None, f"cuda-python is not installed ({exc}); running on the CPU "
                               "emulator (pip install cuda-python for a GPU)")
        return
    try:
        err, = real.cuInit(0)
    except Exception as exc:  # cuda.pathfinder's DynamicLibNotFoundError (or an OSError) when no libcuda
        if want == "cuda":
            api._module = real
            _status = DriverStatus("cuda", False, None, f"{NO_DRIVER_MESSAGE} [{type(exc).__name__}]")
            return
        from hss import emulator
        api._module = emulator
        _status = DriverStatus("emulator", False, None, f"no CUDA driver found ({type(exc).__name__}); "
                               "running on the CPU emulator")
        return
    version = None
    if not err:
        verr, version = real.cuDriverGetVersion()
        version = int(version) if not verr else None
    if err and want != "cuda":
        from hss import emulator
        api._module = emulator
        _status = DriverStatus("emulator", False, version,
                               f"cuInit failed ({err.name}); running on the CPU emulator")
        return
    api._module = real
    msg = f"CUDA driver {_version_text(version)}" if not err else f"cuInit failed: {err.name}"
    _status = DriverStatus("cuda", not err, version, msg)


def _version_text(v: int | None) -> str:
    return "unknown" if v is None else f"{v // 1000}.{(v % 1000) // 10}"


def driver_status() -> DriverStatus:
    """Which driver this process uses, whether a real one was found, and why."""
    _load()
    assert _status is not None
    return _status


def is_emulator() -> bool:
    """True when this process runs on the CPU emulator."""
    return driver_status().kind == "emulator"


def check(result: tuple, call: str, detail: str = "") -> Any:
    """Unwrap a ``(CUresult, *values)`` tuple: raise :class:`CudaError` on failure, else return the values."""
    err = result[0]
    if err:
        raise cuda_error(err, call, detail)
    n = len(result)
    return None if n == 1 else result[1] if n == 2 else result[1:]


def cuda_error(err: Any, call: str, detail: str = "") -> CudaError:
    """Build the :class:`CudaError` for a failed call, with the driver's name and explanation."""
    code = int(err)
    name = getattr(err, "name", None) or f"CUresult({code})"
    message = ""
    if _status is not None and not _status.found and _status.kind == "cuda":
        message = NO_DRIVER_MESSAGE
    else:
        try:
            serr, text = api.cuGetErrorString(err)
            message = text.decode() if isinstance(text, bytes) and not serr else ""
        except Exception:  # the lookup itself must never mask the original failure
            message = ""
    if name == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION":
        message = PTX_VERSION_MESSAGE
    return CudaError(call, name, message or "no description", detail, code)


@contextlib.contextmanager
def inject_fault(call: str, error: str, times: int = 1) -> Iterator[None]:
    """Make the next ``times`` calls of driver function ``call`` return CUresult ``error``.

    Works on both drivers, so error paths are tested on the emulator and the GPU alike.
    """
    _load()
    real = getattr(api, call)
    code = getattr(api.CUresult, error)
    left = [times]

    def faulty(*args: Any, **kwargs: Any) -> tuple:
        if left[0] > 0:
            left[0] -= 1
            return (code, None)
        return real(*args, **kwargs)

    setattr(api, call, faulty)
    try:
        yield
    finally:
        setattr(api, call, real)
