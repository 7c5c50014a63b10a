"""Safetensors files (Hugging Face's weight format), read and written with numpy alone.

Layout: a u64 little-endian header length ``n``, ``n`` bytes of UTF-8 JSON, then the data. The JSON maps each tensor
name to ``{"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}`` (offsets into the data, row-major,
little-endian) and may hold ``"__metadata__"``: a string → string map. Every field is checked against the file's
size before it is used; the file is memory-mapped and :meth:`SafetensorsFile.tensor` reads one tensor when asked.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from hss._util import Closeable
from hss.checkpoint._files import atomic_writer, describe_start, map_file, release
from hss.errors import HssError

__all__ = ["SafetensorsFile", "TensorEntry", "read_safetensors", "write_safetensors", "DTYPES", "HEADER_LIMIT"]

HEADER_LIMIT = 100_000_000   # the safetensors package's own limit on the JSON header
# safetensors dtype → numpy dtype (little-endian)
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}
FLOATS = ("F32", "F16", "BF16", "F64")   # what :meth:`SafetensorsFile.tensor` turns into float32


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: dtype name, shape, absolute byte ``offset`` and ``nbytes``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class SafetensorsFile(Closeable):
    """An open safetensors file: ``tensors`` (name → :class:`TensorEntry`), ``metadata`` (the ``__metadata__``
    map, or {}). :meth:`tensor` reads one as float32, :meth:`array` in its own dtype; :meth:`close` unmaps."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = map_file(self.path, "safetensors file")
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def _fail(self, what: str) -> HssError:
        return HssError(f"{self.path}: {what}")

    def _parse(self) -> None:
        size = len(self._map)
        if size < 8:
            raise self._fail(f"{size} bytes is too short for a safetensors file (8-byte header length, JSON header)")
        (n,) = struct.unpack_from("<Q", self._map, 0)
        if n > min(size - 8, HEADER_LIMIT):
            raise self._fail(f"not a safetensors file: it starts with {describe_start(self._map[:16])}, which as a "
                             f"header length gives {n} bytes, more than the {size - 8} the file has after it "
                             f"(truncated, or another format)")
        try:
            header = json.loads(bytes(self._map[8:8 + n]).decode("utf-8"))
        except UnicodeDecodeError as e:
            raise self._fail(f"the JSON header is not UTF-8 (byte {8 + e.start})") from None
        except json.JSONDecodeError as e:
            raise self._fail(f"the header is not valid JSON: {e.msg} at character {e.pos} (damaged, or not a "
                             f"safetensors file)") from None
        except ValueError as e:   # e.g. an integer literal beyond Python's digit limit
            raise self._fail(f"the header is not valid JSON: {e}") from None
        except RecursionError:
            raise self._fail("the JSON header nests too deeply") from None
        if not isinstance(header, dict):
            raise self._fail(f"the JSON header is a {type(header).__name__}, not an object of tensors")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._fail("__metadata__ must map strings to strings")
        self.metadata: dict[str, str] = metadata
        self.data_offset = 8 + n
        self.tensors: dict[str, TensorEntry] = {name: self._entry(name, spec) for name, spec in header.items()}

    def _entry(self, name: str, spec: Any) -> TensorEntry:
        what = f"tensor {name!r}"
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise self._fail(f"{what}: its entry must hold exactly dtype, shape and data_offsets, got {spec!r:.200}")
        dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise self._fail(f"{what}: dtype {dtype!r:.40} is not a safetensors dtype ({', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise self._fail(f"{what}: shape {shape!r:.200} is not a list of non-negative ints")
        data = len(self._map) - self.data_offset
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise self._fail(f"{what}: data_offsets {offsets!r:.200} is not [begin, end] with 0 <= begin <= end")
        nbytes = int(np.prod(shape, dtype=object)) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise self._fail(f"{what}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but {dtype} "
                             f"{tuple(shape)} takes {nbytes}")
        if offsets[1] > data:
            raise self._fail(f"{what}: its data (bytes {offsets[0]} to {offsets[1]} after the header) lies past the "
                             f"end of the file, which has {data} bytes of data (truncated?)")
        return TensorEntry(name, dtype, tuple(shape), self.data_offset + offsets[0], nbytes)

    def _entry_of(self, name: str) -> TensorEntry:
        entry = self.tensors.get(name)
        if entry is None:
            raise self._fail(f"no tensor {name!r}")
        if self._map is None:
            raise self._fail("the file was closed")
        return entry

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a new array of its own dtype and shape."""
        e = self._entry_of(name)
        dtype = DTYPES[e.dtype]
        return np.frombuffer(self._map, dtype, e.nbytes // dtype.itemsize, e.offset).reshape(e.shape).copy()

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` (F32, F16, BF16 or F64) as a new float32 array of its shape."""
        e = self._entry_of(name)
        if e.dtype not in FLOATS:
            raise self._fail(f"tensor {name!r} is {e.dtype}; model weights must be one of {', '.join(FLOATS)}")
        dtype = DTYPES[e.dtype]
        return np.frombuffer(self._map, dtype, e.nbytes // dtype.itemsize, e.offset).astype(np.float32) \
            .reshape(e.shape)

    def close(self) -> None:
        """Unmap the file (idempotent); arrays already read are copies."""
        mapped, self._map = getattr(self, "_map", None), None
        release(mapped)


def read_safetensors(path: str | Path) -> SafetensorsFile:
    """Open and check the safetensors file at ``path`` (the header read; tensors on demand)."""
    return SafetensorsFile(path)


def _dtype_name(dtype: np.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise HssError(f"write_safetensors: numpy dtype {dtype} has no safetensors name")


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` (name → array; any dtype of :data:`DTYPES`) to ``path`` as safetensors, atomically.

    Tensors are laid out in name order; the header is padded with spaces to a multiple of 8 bytes, as the
    safetensors package does."""
    path = Path(path)
    arrays = {name: np.asarray(tensors[name]) for name in sorted(tensors)}   # (ascontiguousarray makes 0-d 1-d)
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, a in arrays.items():
        if a.dtype.byteorder == ">" or not a.flags.c_contiguous:
            a = arrays[name] = a.astype(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype, order="C")
        header[name] = {"dtype": _dtype_name(a.dtype), "shape": list(a.shape), "data_offsets": [offset,
                                                                                                 offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with atomic_writer(path) as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for a in arrays.values():
            f.write(memoryview(a.reshape(-1).view(np.uint8)))
    return path
