"""Argument rules shared by the swap's components: a stream of the component's own context (:class:`StreamCheck`),
memory of the component's own device (:func:`same_device`)."""
from __future__ import annotations

from typing import Any

from hss import _args
from hss.cuda._context import PrimaryContext, owner_context, stream_context
from hss.errors import CudaError, HssError

__all__ = ["StreamCheck", "same_device"]


class StreamCheck:
    """``check(stream, name) -> int``: the raw handle of a stream argument, refused (:class:`HssError`, before any
    work) where it is a stream of another context than ``ctx``'s (None: the current one), once the process uses
    several devices: the component's memory, events and kernels live in that context. A stream that passed once
    passes at once later; the legacy handles (0, 1, 2) name the current context's stream and pass."""

    __slots__ = ("pctx", "_owner", "_ok")

    def __init__(self, ctx: Any, owner: str) -> None:
        self.pctx: PrimaryContext = ctx if isinstance(ctx, PrimaryContext) else owner_context(ctx)
        self._owner = owner
        self._ok: set[int] = set()

    @property
    def device(self) -> int:
        return self.pctx.ordinal

    def __call__(self, stream: Any, name: str = "stream") -> int:
        s = stream if type(stream) is int and stream >= 0 else _args.stream(stream, name)
        if _args.DEVICES.many and s not in self._ok:
            self._check(s, name)
        return s

    def _check(self, s: int, name: str) -> None:
        if s in (0, 1, 2):
            return
        device = self.pctx.ordinal
        try:
            handle, owner = stream_context(s)
        except CudaError as exc:
            raise HssError(f"{name} ({s:#x}) is not a live stream ({exc.name}); pass a stream of device {device}, "
                           f"where {self._owner} works") from None
        if handle != self.pctx.handle:
            where = f"device {owner.ordinal}" if owner is not None else "another context"
            raise HssError(f"{name} ({s:#x}) is a stream of {where}, but {self._owner} works on device {device}; "
                           f"pass a stream of device {device}")
        self._ok.add(s)


def same_device(what: str, device: int, **parts: int) -> None:
    """Raise :class:`HssError` if a part of component ``what`` (``name=ordinal``) is on another device than
    ``device``: a component's parts read each other's memory, which another device's kernels cannot."""
    bad = {name: d for name, d in parts.items() if d != device}
    if bad:
        listed = ", ".join(f"{name} on device {d}" for name, d in bad.items())
        raise HssError(f"{what} works on device {device} but is given {listed}: build every part in one device's "
                       "context (pass the same ctx)")
