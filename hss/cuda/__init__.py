"""The driver layer: the CUDA driver API through ``cuda.bindings.driver`` (or :mod:`hss.emulator`), contexts and
streams, memory, PTX modules and launches, graphs, cuBLAS through nvmath-python, and the kernel-backend face the
QSA indexer drives (:mod:`hss.cuda.gpu`). Users reach it through :mod:`hss.cuda_min`."""
