"""Reference for ``ptx/page_gather.cu``: a gather of whole pages (a byte copy, so exact: no tolerance)."""
from __future__ import annotations

import numpy as np


def _pages_of(buf: np.ndarray, index: np.ndarray, page_bytes: int, what: str) -> np.ndarray:
    """``buf``'s whole pages as ``[count, page_bytes]``; IndexError naming the first ``what`` not wholly inside."""
    count = buf.size // page_bytes
    bad = (index < 0) | (index >= count)
    if bad.any():
        raise IndexError(f"{what} {int(index[bad][0])} of {page_bytes} bytes is outside the {buf.size} bytes "
                         f"({count} whole pages)")
    return buf[:count * page_bytes].reshape(count, page_bytes)


def gather_pages(src: np.ndarray, pages: np.ndarray, page_bytes: int) -> np.ndarray:
    """uint8 ``[len(pages), page_bytes]``: row r is page ``pages[r]`` of ``src`` (bytes ``pages[r] * page_bytes`` up
    to the next page), a copy. Raises ``IndexError`` for a page not wholly inside ``src``."""
    index = np.asarray(pages, dtype=np.int64)
    return _pages_of(src, index, page_bytes, "page")[index]


def scatter_pages(dst: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
    """Write row r of ``rows`` (uint8 ``[n, page_bytes]``) into page ``slots[r]`` of ``dst`` (distinct slots; raises
    ``IndexError`` for a slot not wholly inside ``dst``, ``ValueError`` for a repeated one, writing nothing)."""
    index = np.asarray(slots, dtype=np.int64)
    pages = _pages_of(dst, index, rows.shape[1], "slot")
    if np.unique(index).size != index.size:
        raise ValueError("destination slots repeat: the copies of one launch must not overlap")
    pages[index] = rows
