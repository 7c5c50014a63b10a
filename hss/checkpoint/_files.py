"""What every model-file reader and writer shares: the file named in each error, memory maps, JSON, atomic writes."""
from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from hss.errors import HssError

__all__ = ["about", "map_file", "release", "read_json", "atomic_writer", "write_atomic", "describe_start"]

JSON_LIMIT = 1 << 30   # a config or tokenizer JSON larger than this is not one


@contextlib.contextmanager
def about(path: str | Path) -> Iterator[None]:
    """Re-raise an :class:`HssError` from the block with ``path`` in front, unless it names it already."""
    try:
        yield
    except HssError as e:
        if str(e).startswith(str(path)):
            raise
        raise HssError(f"{path}: {e}") from None


def map_file(path: Path, what: str) -> mmap.mmap:
    """A read-only memory map of the regular file ``path`` (``what``: the format, for the errors)."""
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise HssError(f"{path}: not a regular file, so not a {what}")
        if size == 0:
            raise HssError(f"{path}: the file is empty (0 bytes), so not a {what}")
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise HssError(f"{path}: cannot read the {what}: {e.strerror or e}") from None


def release(mapped: mmap.mmap | None) -> None:
    """Close a map from :func:`map_file` unless arrays still view it (then the last of them frees it)."""
    if mapped is not None:
        with contextlib.suppress(BufferError):
            mapped.close()


def describe_start(data: bytes) -> str:
    """The first bytes of a file for an error message: as text when they read as text."""
    head = bytes(data[:16])
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"the bytes {head.hex(' ')}"
    readable = all(c.isprintable() or c in "\t\n\r" for c in text)
    return f"the text {text!r}" if readable else f"the bytes {head.hex(' ')}"


def read_json(path: Path, what: str) -> Any:
    """The JSON document in ``path`` (``what`` names it in the errors)."""
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise HssError(f"{path}: not a regular file, so not the {what}")
        if size > JSON_LIMIT:
            raise HssError(f"{path}: {size} bytes is too large for the {what}")
        data = path.read_bytes()
    except OSError as e:
        raise HssError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise HssError(f"{path}: the {what} is not UTF-8 text (byte {e.start} is not valid)") from None
    except json.JSONDecodeError as e:
        raise HssError(f"{path}: the {what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:   # e.g. an integer literal beyond Python's digit limit
        raise HssError(f"{path}: the {what} is not valid JSON: {e}") from None
    except RecursionError:
        raise HssError(f"{path}: the {what} nests too deeply to be a {what}") from None


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` (by ``os.replace``) only when the block completes."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` (str: as UTF-8) to ``path`` atomically (:func:`atomic_writer`)."""
    with atomic_writer(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
