"""hss: the high-speed-swap predictor and the QSA sparse-attention indexer over the CUDA driver API.

Raw device pointers in, raw device pointers out, explicit streams, no hidden syncs. Set
``HSS_DRIVER=emulator`` to run everything on the CPU emulator (chosen automatically where no
CUDA driver is installed).
"""
from hss._driver import driver_status, inject_fault
from hss.errors import CudaError, HssError

__all__ = ["CudaError", "HssError", "driver_status", "inject_fault"]
__version__ = "0.1.0"
