"""The minimal CUDA driver layer (docs/design.md §1 as amended by §0): the original's surface, re-exported from the
modules that own each concept.

- :mod:`hss.cuda._context`: :class:`CudaCtx`, :class:`CudaStream`, :class:`CudaEvent`, ``stream_sync``,
  ``stream_wait_event``, ``compute_capability``, ``multiprocessor_count``;
- :mod:`hss.cuda._memory`: :class:`DeviceBuffer` (and its typed :class:`DeviceView`), :class:`PinnedBuffer`, the copies,
  memsets, :class:`HostToDeviceBatch` (and the :class:`PointerTable` of its planned copies), ``mem_info``;
- :mod:`hss.cuda._launch`: :class:`CudaModule`, :class:`CudaFunction`, ``launch_kernel``, graphs (``begin_capture``,
  ``end_capture``, ``on_replay``: host callbacks a graph's replay runs, ``is_capturing``);
- :mod:`hss._args`: how arguments are read (``device_ptr``, ``stream_handle``).

Device addresses are plain ints (offsets are ``ptr + nbytes``). Streams are explicit everywhere and nothing
synchronises unless its name or docstring says so. Owners free exactly once: an idempotent ``close()``, ``with``
support and a ``weakref.finalize`` safety net that holds only raw handles; every owner keeps the primary
context it was made in retained, and every call makes that context current first.
"""
from __future__ import annotations

from hss._args import device_ptr
from hss._params import ParamPack
from hss.cuda._context import (
                          CudaCtx,
                          CudaEvent,
                          CudaStream,
                          compute_capability,
                          device_count,
                          multiprocessor_count,
                          ordinal_of,
                          stream_handle,
                          stream_sync,
                          stream_wait_event,
)
from hss.cuda._driver import driver_status
from hss.cuda._launch import (
                          CudaFunction,
                          CudaGraph,
                          CudaModule,
                          begin_capture,
                          end_capture,
                          is_capturing,
                          launch_kernel,
                          on_replay,
)
from hss.cuda._memory import (  # noqa: F401 (the _planned copies: hss's own hot loops, of values they checked)
                          DeviceBuffer,
                          DeviceView,
                          HostToDeviceBatch,
                          PinnedBuffer,
                          PointerTable,
                          _d_to_h_planned,
                          _h_to_d_planned,
                          copy_2d_d_to_d_async,
                          copy_d_to_d_async,
                          copy_d_to_h_async,
                          copy_h_to_d_async,
                          copy_h_to_d_batch_async,
                          mem_info,
                          memset_d8_async,
                          memset_d32_async,
)
from hss.errors import CudaError, HssError

__all__ = [
    "CudaCtx", "CudaStream", "CudaModule", "CudaFunction", "DeviceBuffer", "DeviceView", "PinnedBuffer",
    "CudaEvent", "CudaGraph", "ParamPack", "HostToDeviceBatch", "PointerTable", "copy_h_to_d_async",
    "copy_h_to_d_batch_async", "copy_d_to_h_async", "copy_d_to_d_async", "copy_2d_d_to_d_async", "memset_d8_async",
    "memset_d32_async",
    "launch_kernel", "stream_sync", "mem_info", "multiprocessor_count", "compute_capability", "begin_capture",
    "end_capture", "on_replay", "is_capturing", "driver_status", "device_ptr", "stream_handle", "stream_wait_event",
    "device_count", "ordinal_of", "CudaError", "HssError",
]
