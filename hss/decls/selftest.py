"""Declarations of ``ptx/selftest.cu`` and their emulation through :mod:`hss.reference.selftest`."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hss._util import ceil_div
from hss.decls._decl import Launch, declare, f32
from hss.reference import selftest as ref_selftest


def _emulate_fill(a: SimpleNamespace, launch: Launch) -> None:
    a.out.view(np.uint32)[:] = ref_selftest.fill_u32(a.n, a.value)


def _emulate_axpy(a: SimpleNamespace, launch: Launch) -> None:
    out, index = ref_selftest.axpy(f32(a.x), f32(a.y), a.a, a.n, a.mul, a.add)
    f32(a.out)[:] = out.astype(np.float32)
    a.index_out.view(np.int64)[:] = index


def _emulate_block_sum(a: SimpleNamespace, launch: Launch) -> None:
    f32(a.out)[:] = ref_selftest.block_sums(f32(a.x), a.n, launch.block[0]).astype(np.float32)


def _check_block_sum(a: SimpleNamespace, launch: Launch) -> str | None:
    bx = launch.block[0]
    if bx & (bx - 1) or launch.block[1:] != (1, 1):
        return f"block must be (power of two, 1, 1), got {launch.block}"
    if launch.shared < 4 * bx:
        return f"needs {4 * bx} bytes of dynamic shared memory, got {launch.shared}"
    if launch.grid != (ceil_div(a.n, bx), 1, 1):
        return f"grid must be (ceil(n / block.x), 1, 1) = ({ceil_div(a.n, bx)}, 1, 1), got {launch.grid}"
    return None


SELFTEST_EMPTY = declare("selftest", "selftest_empty", "ptr a, ptr b, i32 n")
SELFTEST_FILL = declare(
    "selftest", "selftest_fill_u32", "ptr out, u32 value, i32 n",
    writes={"out": lambda a: 4 * max(a.n, 0)}, emulate=_emulate_fill)
SELFTEST_AXPY = declare(
    "selftest", "selftest_axpy", "ptr out, ptr index_out, ptr x, ptr y, f32 a, i32 n, u32 mul, i64 add",
    reads={"x": lambda a: 4 * max(a.n, 0), "y": lambda a: 4 * max(a.n, 0)},
    writes={"out": lambda a: 4 * max(a.n, 0), "index_out": lambda a: 8 * max(a.n, 0)},
    emulate=_emulate_axpy)
SELFTEST_BLOCK_SUM = declare(
    "selftest", "selftest_block_sum", "ptr x, ptr out, i32 n",
    reads={"x": lambda a: 4 * max(a.n, 0)}, writes={"out": lambda a: 4 * a.grid[0]},
    emulate=_emulate_block_sum, check=_check_block_sum)
