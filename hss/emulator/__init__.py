"""A CPU stand-in for the subset of ``cuda.bindings.driver`` that hss calls (docs/design.md §0, "no GPU").

Import it as a driver module: ``HSS_DRIVER=emulator`` makes :mod:`hss.cuda._driver` choose it, and it is
chosen automatically where no CUDA driver exists. Memory is a page-aligned arena with real,
bounds-checked addresses; streams run their queued work only when something waits for it; events
order streams; capture records a replayable graph; ``cuLaunchKernel`` decodes packed parameters
with each kernel's declaration in :mod:`hss.decls` and runs its numpy implementation. It is a test
double: a kernel is proven only on a GPU.
"""
from .driver import *  # noqa: F401,F403  (the driver-call surface)
from .driver import CUstreamCaptureStatus  # noqa: F401
from .driver import S as state  # noqa: F401
from .enums import (  # noqa: F401
                    CUDA_MEMCPY2D,
                    CUdevice_attribute,
                    CUevent_flags,
                    CUfunction_attribute,
                    CUlaunchAttribute,
                    CUlaunchAttributeID,
                    CUlaunchConfig,
                    CUmemorytype,
                    CUresult,
                    CUstream_flags,
                    CUstreamCaptureMode,
)
from .launch import (  # noqa: F401
                    EmulatorError,
                    cuFuncGetParamInfo,
                    cuFuncSetAttribute,
                    cuLaunchKernel,
                    cuLaunchKernelEx,
                    cuModuleGetFunction,
                    cuModuleLoadData,
                    cuModuleUnload,
)
from .memory import MemoryFault  # noqa: F401
