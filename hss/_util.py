"""Small helpers every layer shares: integer ceiling division and a context-manager base for resource owners.

Pure Python with no hss imports, so any module may use it (the lowest layer in tests/test_layers.py)."""
from __future__ import annotations

from typing import TypeVar

__all__ = ["Closeable", "ceil_div"]

T = TypeVar("T", bound="Closeable")


def ceil_div(a: int, b: int) -> int:
    """The ceiling of a / b for integers, b > 0."""
    return -(-a // b)


class Closeable:
    """A base for objects that own resources: ``with obj:`` returns ``obj`` and calls :meth:`close` on the way
    out. Subclasses define :meth:`close`; no state of its own (``__slots__ = ()``), so slotted subclasses stay
    slotted."""

    __slots__ = ()

    def close(self) -> None:
        """Release what the object owns; subclasses define it."""
        raise NotImplementedError(f"{type(self).__name__}.close")

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
