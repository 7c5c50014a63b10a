"""Every hss kernel declared once: module, name, parameters in the ``.cu`` order, pointer extents.

A declaration serves three users: typed packing (``decl.pack(...)`` gives a
:class:`~hss.cuda_min.ParamPack` whose values were range-checked at their exact widths), the
emulator (which decodes a launch's packed parameters with the same declaration, checks the
bytes each pointer may read and write against the allocations, then runs ``emulate``), and
a test that compares each declaration with the ``.entry`` signature in the committed PTX.
"""
from __future__ import annotations

from hss.decls._decl import DECLARATIONS, Extent, KernelDecl, Launch, declare, f32

__all__ = ["DECLARATIONS", "Extent", "KernelDecl", "Launch", "declare", "f32"]

# Domain declarations register themselves on import; the emulator sees them all through this package.
from hss.decls import (
    attention,  # noqa: E402,F401
    gather,  # noqa: E402,F401
    model,  # noqa: E402,F401
    predictor,  # noqa: E402,F401
    qsa,  # noqa: E402,F401
    qsa_device,  # noqa: E402,F401
    qsa_prefill,  # noqa: E402,F401
    sample,  # noqa: E402,F401
    selftest,  # noqa: E402,F401
    sparse_step,  # noqa: E402,F401
)
