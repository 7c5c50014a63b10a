"""Reference for ``ptx/page_gather.cu``: a gather of whole pages (a byte copy, so exact: no tolerance)."""
from __future__ import annotations

import numpy as np


def gather_pages(src: np.ndarray, pages: np.ndarray, page_bytes: int) -> np.ndarray:
    """uint8 ``[len(pages), page_bytes]``: row r is page ``pages[r]`` of ``src`` (bytes ``pages[r] * page_bytes`` up
    to the next page), a copy. Raises ``IndexError`` for a page not wholly inside ``src``."""
    count = src.size // page_bytes
    index = np.asarray(pages, dtype=np.int64)
    bad = (index < 0) | (index >= count)
    if bad.any():
        raise IndexError(f"page {int(index[bad][0])} of {page_bytes} bytes is outside the {src.size} bytes "
                         f"({count} whole pages)")
    return src[:count * page_bytes].reshape(count, page_bytes)[index]


def scatter_pages(dst: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
    """Write row r of ``rows`` (uint8 ``[n, page_bytes]``) into page ``slots[r]`` of ``dst`` (distinct slots; raises
    ``IndexError`` for a slot not wholly inside ``dst``, ``ValueError`` for a repeated one, writing nothing)."""
    page_bytes = rows.shape[1]
    count = dst.size // page_bytes
    index = np.asarray(slots, dtype=np.int64)
    bad = (index < 0) | (index >= count)
    if bad.any():
        raise IndexError(f"slot {int(index[bad][0])} of {page_bytes} bytes is outside the {dst.size} bytes "
                         f"({count} whole pages)")
    if np.unique(index).size != index.size:
        raise ValueError("destination slots repeat: the copies of one launch must not overlap")
    dst[:count * page_bytes].reshape(count, page_bytes)[index] = rows
