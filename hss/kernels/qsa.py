"""Declarations of the QSA indexer kernels (filled in by the QSA issues)."""
