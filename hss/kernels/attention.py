"""Declarations of the storage attention kernels (filled in by the storage issue)."""
