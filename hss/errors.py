"""Every exception hss raises, in one place (the bottom layer: it imports nothing of hss).

- :class:`HssError` (a ``ValueError``): bad input, raised before any device work; names the parameter and the fix.
- :class:`CudaError` (a ``RuntimeError``): a driver call failed; carries the call, the CUresult name and text.
- :class:`BuildError`: nvcc or ptxas is missing or failed.
- :class:`MemoryFault`, :class:`EmulatorError`: what the CPU emulator reports where a GPU would fault or hang.
- :class:`PoolExhausted`, :class:`StoreError`, :class:`StoreIOError`: the high-speed swap's pool and stores.

A wrong *type* of argument is a plain ``TypeError`` (naming the parameter), as Python itself does.
"""
from __future__ import annotations

import errno
from typing import Any

__all__ = ["HssError", "CudaError", "BuildError", "MemoryFault", "EmulatorError", "PoolExhausted", "StoreError",
           "StoreIOError"]


class HssError(ValueError):
    """Bad input to hss (wrong shape, out-of-range id, size that does not fit, null pointer, closed object...)."""


class CudaError(RuntimeError):
    """A driver call failed: carries the call, the CUresult name and the driver's explanation."""

    def __init__(self, call: str, name: str, message: str, detail: str = "", code: int = -1):
        self.call, self.name, self.message, self.detail, self.code = call, name, message, detail, code
        text = f"{call} failed: {name}: {message}"
        super().__init__(f"{text} ({detail})" if detail else text)


class BuildError(RuntimeError):
    """nvcc or ptxas is missing or failed: carries the command and the tool's stderr."""

    def __init__(self, command: list[str], stderr: str) -> None:
        self.command, self.stderr = command, stderr
        super().__init__(f"{' '.join(command)} failed:\n{stderr.strip()}")


class MemoryFault(RuntimeError):
    """An emulated access outside every allocation, or past the end of the one it starts in."""


class EmulatorError(RuntimeError):
    """A launch broke a kernel's declared contract (geometry), or has no emulated implementation."""


class PoolExhausted(HssError):
    """No free slot and no resident eviction candidate."""


class StoreError(HssError):
    """A page was read before it was (successfully) written, or a write's size or range is wrong.
    ``pages``: the pages found not valid, when that is the error (else None)."""

    def __init__(self, message: str, pages: Any = None) -> None:
        super().__init__(message)
        self.pages = pages


class StoreIOError(OSError):
    """A read or write of a store failed or came up short; names the layer, page, kind and kv head."""

    KIND_NAMES = ("K", "V")

    def __init__(self, layer: int, page: int, kind: int, kv_head: int, message: str, err: int | None = None) -> None:
        self.layer, self.page, self.kind, self.kv_head = layer, page, self.KIND_NAMES[kind], kv_head
        text = f"layer {layer} page {page} ({self.kind} stripe of kv_head {kv_head}): {message}"
        super().__init__(err if err is not None else errno.EIO, text)

    def __str__(self) -> str:
        return self.strerror
