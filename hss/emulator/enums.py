"""The ``cuda.bindings.driver`` enums and structs hss uses, with the driver's own names and values."""
from __future__ import annotations

import enum


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_DEINITIALIZED = 4
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209
    CUDA_ERROR_INVALID_PTX = 218
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905
    CUDA_ERROR_UNKNOWN = 999


ERROR_STRINGS = {
    CUresult.CUDA_SUCCESS: "no error",
    CUresult.CUDA_ERROR_INVALID_VALUE: "invalid argument",
    CUresult.CUDA_ERROR_OUT_OF_MEMORY: "out of memory",
    CUresult.CUDA_ERROR_NOT_INITIALIZED: "initialization error",
    CUresult.CUDA_ERROR_DEINITIALIZED: "driver shutting down",
    CUresult.CUDA_ERROR_NO_DEVICE: "no CUDA-capable device is detected",
    CUresult.CUDA_ERROR_INVALID_DEVICE: "invalid device ordinal",
    CUresult.CUDA_ERROR_INVALID_IMAGE: "device kernel image is invalid",
    CUresult.CUDA_ERROR_INVALID_CONTEXT: "invalid device context",
    CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU: "no kernel image is available for execution on the device",
    CUresult.CUDA_ERROR_INVALID_PTX: "a PTX JIT compilation failed",
    CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION: "the provided PTX was compiled with an unsupported toolchain.",
    CUresult.CUDA_ERROR_INVALID_HANDLE: "invalid resource handle",
    CUresult.CUDA_ERROR_ILLEGAL_STATE: "the operation cannot be performed in the present state",
    CUresult.CUDA_ERROR_NOT_FOUND: "named symbol not found",
    CUresult.CUDA_ERROR_NOT_READY: "device not ready",
    CUresult.CUDA_ERROR_ILLEGAL_ADDRESS: "an illegal memory access was encountered",
    CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: "too many resources requested for launch",
    CUresult.CUDA_ERROR_LAUNCH_FAILED: "unspecified launch failure",
    CUresult.CUDA_ERROR_NOT_SUPPORTED: "operation not supported",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: "operation not permitted when stream is capturing",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: "operation failed due to a previous error during capture",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: "capture was not initiated in this stream",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED: "capturing stream has unjoined work",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_ISOLATION: "dependency created on uncaptured work in another stream",
    CUresult.CUDA_ERROR_UNKNOWN: "unknown error",
}


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


class CUfunction_attribute(enum.IntEnum):
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CUstream_flags(enum.IntEnum):
    CU_STREAM_DEFAULT = 0
    CU_STREAM_NON_BLOCKING = 1


class CUevent_flags(enum.IntEnum):
    CU_EVENT_DEFAULT = 0
    CU_EVENT_BLOCKING_SYNC = 1
    CU_EVENT_DISABLE_TIMING = 2


class CUstreamCaptureMode(enum.IntEnum):
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
    CU_STREAM_CAPTURE_MODE_RELAXED = 2


class CUmemorytype(enum.IntEnum):
    CU_MEMORYTYPE_HOST = 1
    CU_MEMORYTYPE_DEVICE = 2
    CU_MEMORYTYPE_ARRAY = 3
    CU_MEMORYTYPE_UNIFIED = 4


class CUDA_MEMCPY2D:
    """The 2-D copy descriptor (only the host/device fields hss uses)."""

    def __init__(self) -> None:
        self.srcXInBytes = self.srcY = self.dstXInBytes = self.dstY = 0
        self.srcMemoryType = self.dstMemoryType = CUmemorytype.CU_MEMORYTYPE_DEVICE
        self.srcDevice = self.dstDevice = 0
        self.srcHost = self.dstHost = 0
        self.srcPitch = self.dstPitch = 0
        self.WidthInBytes = self.Height = 0


class CUmemcpySrcAccessOrder(enum.IntEnum):
    CU_MEMCPY_SRC_ACCESS_ORDER_INVALID = 0
    CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
    CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL = 2
    CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1
    CU_MEM_LOCATION_TYPE_HOST = 2


class CUdeviceptr(int):
    """A device address (the binding's wrapper type; an int here)."""


class _Location:
    def __init__(self) -> None:
        self.type, self.id = CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID, 0


class CUmemcpyAttributes:
    def __init__(self) -> None:
        self.srcAccessOrder = CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_INVALID
        self.srcLocHint, self.dstLocHint, self.flags = _Location(), _Location(), 0


class CUlaunchAttributeID(enum.IntEnum):
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttributeValue:
    def __init__(self) -> None:
        self.programmaticStreamSerializationAllowed = 0


class CUlaunchAttribute:
    """One launch attribute: ``id`` and the ``value`` union (only programmatic serialization is emulated)."""

    def __init__(self) -> None:
        self.id: int = 0
        self.value = _LaunchAttributeValue()


class CUlaunchConfig:
    """cuLaunchKernelEx's configuration: geometry, shared bytes, stream and ``numAttrs`` of ``attrs``."""

    def __init__(self) -> None:
        self.gridDimX = self.gridDimY = self.gridDimZ = 0
        self.blockDimX = self.blockDimY = self.blockDimZ = 0
        self.sharedMemBytes = 0
        self.hStream: int = 0
        self.attrs: list[CUlaunchAttribute] = []
        self.numAttrs = 0
