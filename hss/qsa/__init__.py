"""The QSA sparse-attention indexer (docs/design.md §10-§12): decode and prefill selection over the paged KV cache, and
per-sequence snapshots, and the batched, graph-capturable decode on the device (``decode_select_batch``,
``sparse_decode_attention``)."""
from hss.qsa.device import DEFAULT_MAX_SEQS, QsaDeviceSelection
from hss.qsa.indexer import INGEST_SLAB, QsaIndexer
from hss.qsa.prefill import SELECT_SLAB, prefill_scratch_bytes, row_lists
from hss.qsa.select import select_tokens, selection_size, top_blocks
from hss.qsa.settings import DEFAULT_MAX_TOKENS, MIN_BLOCK_SIZE
from hss.qsa.state import QsaSelection, QsaSeqState

__all__ = ["QsaIndexer", "QsaSeqState", "QsaSelection", "QsaDeviceSelection", "select_tokens", "selection_size",
           "top_blocks", "row_lists", "prefill_scratch_bytes", "INGEST_SLAB", "SELECT_SLAB", "MIN_BLOCK_SIZE",
           "DEFAULT_MAX_TOKENS", "DEFAULT_MAX_SEQS"]
