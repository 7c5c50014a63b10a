"""Tensor parallelism over KV heads: a layer's kv heads split across ranks (one device each), q heads
following their kv heads, one :class:`~hss.swap.HighSpeedSwap` (or :class:`~hss.attention.TiledAttention`) per
rank over that rank's heads.

Recipe::

    shards = shard_kv_heads(model, 2)
    swaps = [HighSpeedSwap(cm.CudaCtx(s.rank), cfg_for(s.rank), s.model) for s in shards]
    # offload: rank s gets k[:, s.kv_heads] / v[:, s.kv_heads] of every page (s.take_kv(page))
    # decode: rank s gets q[s.q_heads] (s.take_q(q)) and writes out[s.q_heads]; every rank streams its own heads

Attention of one kv head never reads another's, so a rank's output rows are exact attention over its heads. They
equal the one-device run's rows bit for bit when both runs cut the pages into the same tiles (the same resident
set, or every page streamed) and each tile's unit (:func:`hss.decls.attention.unit_tokens`, which depends on the
launch's CTA count) comes out the same: it is the smallest unit (:func:`hss.decls.attention.unit_min`: 256 tokens
at head_dim 65..128, 128 otherwise) in every split while the un-split layer's tile holds at most that unit *
min(64, ceil(T / kv heads)) tokens, T = 256 for head_dim <= 128 and 128 up to 256 (one sequence, up to 16 q heads per
kv head): 8,192 tokens at 8 kv heads x 128, 8,192 at 2 kv heads x 256 (the swap's streamed tiles are
far smaller).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hss import _args
from hss.errors import HssError
from hss.swap.config import ModelDims

__all__ = ["KvHeadShard", "shard_kv_heads"]


@dataclass(frozen=True)
class KvHeadShard:
    """Rank ``rank``'s heads: ``kv_heads`` and ``q_heads`` (ranges of the layer's), and ``model``, the
    :class:`ModelDims` of a swap over just those heads."""

    rank: int
    kv_heads: range
    q_heads: range
    model: ModelDims

    def take_kv(self, page: np.ndarray) -> np.ndarray:
        """This rank's part of a page ``[block_size, num_kv_heads, head_dim]`` (C-contiguous)."""
        if page.ndim != 3:
            raise HssError(f"take_kv needs a [block_size, num_kv_heads, head_dim] page, got shape {page.shape}")
        return np.ascontiguousarray(page[:, self.kv_heads.start:self.kv_heads.stop])

    def take_q(self, q: np.ndarray) -> np.ndarray:
        """This rank's rows of a query ``[num_q_heads, head_dim]`` (C-contiguous)."""
        if q.ndim != 2:
            raise HssError(f"take_q needs a [num_q_heads, head_dim] query, got shape {q.shape}")
        return np.ascontiguousarray(q[self.q_heads.start:self.q_heads.stop])


def shard_kv_heads(model: ModelDims, ranks: int) -> list[KvHeadShard]:
    """Split ``model``'s kv heads into ``ranks`` equal contiguous parts, each with the q heads that attend them
    (q head h reads kv head h // (num_q_heads // num_kv_heads))."""
    model.validate()
    ranks = _args.as_int("ranks", ranks, 1, why="ranks share the kv heads")
    nkv, gqa = model.num_kv_heads, model.num_q_heads // model.num_kv_heads
    if nkv % ranks:
        raise HssError(f"shard_kv_heads: num_kv_heads ({nkv}) must be a multiple of ranks ({ranks}): each rank takes "
                       f"the same number of whole kv heads")
    per = nkv // ranks
    sub = replace(model, num_q_heads=per * gqa, num_kv_heads=per)
    return [KvHeadShard(r, range(r * per, (r + 1) * per), range(r * per * gqa, (r + 1) * per * gqa), sub)
            for r in range(ranks)]
