"""Declarations of the storage predictor kernels (filled in by the storage issue)."""
