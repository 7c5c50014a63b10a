"""The QSA sparse-attention indexer (SPEC §10-§12)."""
