"""Emulated module loading and ``cuLaunchKernel``.

``cuModuleLoadData`` reads the PTX text (version, target, ``.entry`` names) and resolves each
entry to its hss declaration. ``cuLaunchKernel`` decodes the ``void**`` parameter array with
that declaration, checks the geometry (device limits plus the declaration's own contract),
checks every pointer's declared read/write extent against the allocations, then queues the
kernel's numpy implementation for the whole launch on the stream.
"""
from __future__ import annotations

import ctypes
import re
import struct
from types import SimpleNamespace
from typing import Any

from hss._util import ceil_div
from hss.errors import EmulatorError, MemoryFault

from .driver import S, _needs_ctx, enqueue, stream_of, view_on
from .enums import CUfunction_attribute
from .enums import CUresult as R

MAX_PTX_ISA = (9, 0)           # what the emulated driver (13.0) understands
DEVICE_CC = (9, 0)
SHARED_DEFAULT, SHARED_OPTIN = 48 * 1024, 227 * 1024   # dynamic shared memory per block: default, opt-in limit
_UNPACK = {"ptr": "<Q", "i32": "<i", "u32": "<I", "i64": "<q", "f32": "<f"}
_SIZE = {"ptr": 8, "i32": 4, "u32": 4, "i64": 8, "f32": 4}


class Module:
    def __init__(self, handle: int, entries: list[str], target: str, ctx: int = 0) -> None:
        self.handle, self.entries, self.target, self.ctx = handle, entries, target, ctx


class Function:
    def __init__(self, handle: int, module: Module, name: str) -> None:
        self.handle, self.module, self.name = handle, module, name
        self.max_dynamic_shared = SHARED_DEFAULT


def _parse_ptx(image: Any) -> tuple[R, list[str], str]:
    if isinstance(image, (bytes, bytearray)):
        text = bytes(image).split(b"\0", 1)[0].decode("ascii", "replace")
    elif isinstance(image, str):
        text = image
    else:
        return R.CUDA_ERROR_INVALID_VALUE, [], ""
    ver = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", text, re.M)
    tgt = re.search(r"^\s*\.target\s+(\w+)", text, re.M)
    body = re.sub(r"//[^\n]*", "", text)
    if not ver or not tgt or body.count("{") != body.count("}"):
        return R.CUDA_ERROR_INVALID_PTX, [], ""   # what ptxas would reject first: a malformed module
    if (int(ver.group(1)), int(ver.group(2))) > MAX_PTX_ISA:
        return R.CUDA_ERROR_UNSUPPORTED_PTX_VERSION, [], ""
    target = tgt.group(1)
    m = re.fullmatch(r"(?:sm|compute)_(\d+)(\d)([af]?)", target)
    if not m:
        return R.CUDA_ERROR_INVALID_PTX, [], ""
    cc = (int(m.group(1)), int(m.group(2)))
    if cc > DEVICE_CC or (m.group(3) == "a" and cc != DEVICE_CC):
        return R.CUDA_ERROR_NO_BINARY_FOR_GPU, [], ""
    entries = re.findall(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(", text)
    return R.CUDA_SUCCESS, entries, target


def cuModuleLoadData(image: Any) -> tuple:
    err = _needs_ctx()
    if err:
        return (err, None)
    err, entries, target = _parse_ptx(image)
    if err:
        return (err, None)
    with S.lock:
        h = next(S.ids)
        S.modules[h] = Module(h, entries, target, S.current())
    return (R.CUDA_SUCCESS, h)


def cuModuleUnload(hmod: Any) -> tuple:
    with S.lock:
        mod = S.modules.pop(int(hmod), None)
        if mod is None:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        for h in [h for h, f in S.functions.items() if f.module is mod]:
            del S.functions[h]
    return (R.CUDA_SUCCESS,)


def cuModuleGetFunction(hmod: Any, name: Any) -> tuple:
    mod = S.modules.get(int(hmod))
    if mod is None:
        return (R.CUDA_ERROR_INVALID_HANDLE, None)
    fname = name.decode() if isinstance(name, bytes) else str(name)
    if fname not in mod.entries:
        return (R.CUDA_ERROR_NOT_FOUND, None)
    with S.lock:
        h = next(S.ids)
        S.functions[h] = Function(h, mod, fname)
    return (R.CUDA_SUCCESS, h)


def cuFuncGetParamInfo(f: Any, index: int) -> tuple:
    """(offset, size) of parameter ``index`` in the kernel's parameter buffer, from its hss declaration."""
    fn = S.functions.get(int(f))
    if fn is None:
        return (R.CUDA_ERROR_INVALID_HANDLE, None, None)
    from hss.decls import DECLARATIONS
    decl = DECLARATIONS.get(fn.name)
    index = int(index)
    if decl is None or not 0 <= index < len(decl.kinds):
        return (R.CUDA_ERROR_INVALID_VALUE, None, None)
    offset = 0
    for kind in decl.kinds[:index + 1]:
        size = _SIZE[kind]
        offset = ceil_div(offset, size) * size
        here = offset
        offset += size
    return (R.CUDA_SUCCESS, here, _SIZE[decl.kinds[index]])


def _decode(decl: Any, address: int) -> SimpleNamespace:
    n = len(decl.kinds)
    slots = (ctypes.c_void_p * n).from_address(address) if n else []
    args = SimpleNamespace()
    for i, (pname, kind) in enumerate(zip(decl.names, decl.kinds)):
        raw = ctypes.string_at(slots[i], _SIZE[kind])
        setattr(args, pname, struct.unpack(_UNPACK[kind], raw)[0])
    return args


def cuFuncSetAttribute(f: Any, attrib: Any, value: int) -> tuple:
    fn = S.functions.get(int(f))
    if fn is None:
        return (R.CUDA_ERROR_INVALID_HANDLE,)
    if int(attrib) != CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        return (R.CUDA_ERROR_NOT_SUPPORTED,)
    if not 0 <= int(value) <= SHARED_OPTIN:
        return (R.CUDA_ERROR_INVALID_VALUE,)
    fn.max_dynamic_shared = int(value)
    return (R.CUDA_SUCCESS,)


def _geometry_error(grid: tuple, block: tuple, shared: int, limit: int) -> str | None:
    if min(grid) < 1 or min(block) < 1:
        return "grid and block dimensions must be >= 1"
    if grid[0] > 2**31 - 1 or grid[1] > 65535 or grid[2] > 65535:
        return "grid exceeds (2^31-1, 65535, 65535)"
    if block[0] > 1024 or block[1] > 1024 or block[2] > 64 or block[0] * block[1] * block[2] > 1024:
        return "block exceeds 1024 threads"
    if shared > limit:
        return "dynamic shared memory over the function's limit (48 KiB unless raised by cuFuncSetAttribute)"
    return None


def _device_view(device: int) -> Any:
    """Launch.view of a launch on ``device``: emulated memory at run time (MemoryFault outside every allocation
    and in another device's memory)."""
    def view(addr: int, nbytes: int, what: str) -> Any:
        with S.lock:
            return view_on(device, int(addr), int(nbytes), what)
    return view


def cuLaunchKernel(f: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                   hstream: Any, params: Any, extra: Any) -> tuple:
    err = _needs_ctx()
    if err:
        return (err,)
    fn = S.functions.get(int(f))
    st = stream_of(hstream)
    if fn is None or st is None or st.ctx != S.current() or fn.module.ctx != S.current():
        return (R.CUDA_ERROR_INVALID_HANDLE,)   # the function and the stream must be the current context's
    device = S.device()
    grid, block, shared = (int(gx), int(gy), int(gz)), (int(bx), int(by), int(bz)), int(shared)
    if _geometry_error(grid, block, shared, fn.max_dynamic_shared):
        return (R.CUDA_ERROR_INVALID_VALUE,)
    from hss.decls import DECLARATIONS, Launch
    decl = DECLARATIONS.get(fn.name)
    if decl is None or decl.emulate is None and decl.reads | decl.writes:
        raise EmulatorError(f"kernel {fn.name} has no emulated implementation")
    if extra not in (None, 0):
        return (R.CUDA_ERROR_NOT_SUPPORTED,)
    address = int(params) if params not in (None, 0) else 0
    if decl.kinds and not address:
        return (R.CUDA_ERROR_INVALID_VALUE,)
    args = _decode(decl, address)
    args.grid, args.block = grid, block
    launch = Launch(grid, block, shared, view=_device_view(device))
    if decl.check is not None:
        problem = decl.check(args, launch)
        if problem:
            raise EmulatorError(f"{fn.name} launched with grid {grid}, block {block}, shared {shared}: {problem}")
    with S.lock:
        bound = SimpleNamespace(**vars(args))
        for pname, kind in zip(decl.names, decl.kinds):
            if kind != "ptr":
                continue
            r, w = decl.extent(pname, args)
            if r is None and w is None and pname not in decl.reads and pname not in decl.writes:
                continue
            addr = getattr(args, pname)
            what = f"{fn.name} parameter {pname}"
            if addr == 0 and (r, w) != (None, None) and not (r or w):   # optional pointer left null: untouched
                setattr(bound, pname, None)
                continue
            if r is None and w is None:     # data-dependent extent: the whole rest of the allocation
                alloc = S.arena.find(addr)
                if alloc is None:
                    raise MemoryFault(f"{what}: address {addr:#x} is in no allocation")
                view = view_on(device, addr, alloc.base + alloc.size - addr, what)
            else:
                view = view_on(device, addr, max(r or 0, w or 0), what)
            setattr(bound, pname, view)
        if decl.emulate is not None:
            emulate = decl.emulate
            enqueue(st, lambda: emulate(bound, launch))
        else:
            enqueue(st, lambda: None)
    return (R.CUDA_SUCCESS,)


def cuLaunchKernelEx(config: Any, f: Any, params: Any, extra: Any) -> tuple:
    """cuLaunchKernel with a CUlaunchConfig. The only attribute emulated is programmatic stream serialization: the
    emulator runs a stream's launches in order, one of the schedules it allows (a kernel that reads what the launch
    before it writes without waiting for it is a race only a GPU shows)."""
    from .enums import CUlaunchAttributeID
    n = int(config.numAttrs)
    if n < 0 or n > len(config.attrs):
        return (R.CUDA_ERROR_INVALID_VALUE,)
    for attr in config.attrs[:n]:
        if attr.id != CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION:
            return (R.CUDA_ERROR_NOT_SUPPORTED,)
    return cuLaunchKernel(f, config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.blockDimY,
                          config.blockDimZ, config.sharedMemBytes, config.hStream, params, extra)
