"""The QSA sparse-attention indexer (SPEC §10-§12): decode-side selection over the paged KV cache."""
from hss.qsa.indexer import (DEFAULT_MAX_TOKENS, INGEST_SLAB, MIN_BLOCK_SIZE, QsaIndexer, QsaSelection,
                             QsaSeqState)
from hss.qsa.select import select_tokens, selection_size, top_blocks

__all__ = ["QsaIndexer", "QsaSeqState", "QsaSelection", "select_tokens", "selection_size", "top_blocks",
           "INGEST_SLAB", "MIN_BLOCK_SIZE", "DEFAULT_MAX_TOKENS"]
