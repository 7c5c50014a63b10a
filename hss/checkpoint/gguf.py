"""A reader of GGUF files (llama.cpp's model format, versions 2 and 3, little-endian) that trusts no byte of them.

Layout: ``"GGUF"``, u32 version, u64 tensor count, u64 metadata count; the metadata as (string key, u32 value type,
value); the tensor infos as (string name, u32 n_dims, u64 ne[n_dims], u32 GGML type, u64 offset); padding to
``general.alignment`` (default 32); the tensor data, each tensor at its offset from there. A string is a u64 byte
length and UTF-8 bytes; an array is a u32 element type, a u64 count and the elements.

Every count, length and offset is checked against the bytes the file has before it is used, so a damaged file is an
:class:`~hss.errors.HssError` naming the file, the field and its byte offset, and nothing is allocated for a length
the file cannot hold. The file is memory-mapped: :meth:`GgufFile.tensor` reads and dequantises one tensor when asked.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hss._util import Closeable, ceil_div
from hss.checkpoint._files import describe_start, map_file, release
from hss.checkpoint.quants import GGML_TYPES, dequantize, type_name
from hss.errors import HssError

__all__ = ["GgufFile", "TensorInfo", "read_gguf", "VALUE_TYPES", "MAGIC"]

MAGIC = b"GGUF"
MAX_DIMS = 4            # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# GGUF value types: name, struct format (None: string / array)
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
    5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<B"), 8: ("STRING", None), 9: ("ARRAY", None),
    10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d")}
STRING, ARRAY, BOOL = 8, 9, 7
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF: ``shape`` in numpy order (GGUF's ``ne`` reversed: ``ne[0]`` is the fastest axis),
    its GGML type id, the absolute byte ``offset`` of its data and its ``nbytes``."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


class _Cursor:
    """Bounds-checked little-endian reads from ``buf`` (``size`` bytes) at ``pos``; errors name ``path``."""

    def __init__(self, buf: Any, size: int, path: Path) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, what: str, at: int | None = None) -> HssError:
        return HssError(f"{self.path}: {what} (at byte {self.pos if at is None else at} of {self.size})")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"the file ends inside {what}: it needs {n} more bytes, {self.size - self.pos} are left "
                            f"(truncated?)")

    def scalar(self, fmt: struct.Struct, what: str) -> Any:
        self.need(fmt.size, what)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def u32(self, what: str) -> int:
        return self.scalar(_U32, what)

    def u64(self, what: str) -> int:
        return self.scalar(_U64, what)

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8", start) from None

    def count(self, what: str, min_size: int) -> int:
        """A u64 element count, each element at least ``min_size`` bytes: checked against the bytes left."""
        at = self.pos
        n = self.u64(f"the count of {what}")
        if n * min_size > self.size - self.pos:
            raise self.fail(f"{what}: a count of {n} needs at least {n * min_size} bytes, {self.size - self.pos} "
                            f"are left (damaged or truncated)", at)
        return n

    def value_type(self, what: str) -> int:
        at = self.pos
        vtype = self.u32(f"the value type of {what}")
        if vtype not in VALUE_TYPES:
            raise self.fail(f"{what} has value type {vtype}, which GGUF does not define (0..12)", at)
        return vtype

    def value(self, vtype: int, what: str) -> Any:
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            return self.array(what)
        value = self.scalar(struct.Struct(VALUE_TYPES[vtype][1]), what)
        return bool(value) if vtype == BOOL else value

    def array(self, what: str) -> list[Any]:
        etype = self.value_type(f"the elements of {what}")
        if etype == ARRAY:
            raise self.fail(f"{what} is an array of arrays, which no model file needs (not supported)")
        if etype == STRING:
            return self.strings(self.count(what, 8), what)
        fmt = VALUE_TYPES[etype][1]
        assert fmt is not None
        item = struct.calcsize(fmt)
        n = self.count(what, item)
        values = np.frombuffer(self.buf, np.dtype(fmt), n, self.pos).tolist()
        self.pos += n * item
        return [bool(v) for v in values] if etype == BOOL else values

    def strings(self, n: int, what: str) -> list[str]:
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for i in range(n):
                if size - pos < 8:
                    raise self.fail(f"the file ends inside {what}[{i}] (truncated?)", pos)
                (length,) = unpack(buf, pos)
                pos += 8
                if length > size - pos:
                    raise self.fail(f"{what}[{i}] claims {length} bytes, {size - pos} are left (damaged or "
                                    f"truncated)", pos - 8)
                append(buf[pos:pos + length].decode("utf-8"))
                pos += length
        except UnicodeDecodeError:
            raise self.fail(f"{what}[{len(out)}] is not valid UTF-8", pos) from None
        self.pos = pos
        return out


class GgufFile(Closeable):
    """An open GGUF: ``metadata`` (key → value: int, float, bool, str or list), ``value_types`` (key → GGUF type
    name, e.g. ``ARRAY[STRING]``), ``tensors`` (name → :class:`TensorInfo`, in file order), ``version``,
    ``alignment``, ``data_offset``. :meth:`tensor` gives one tensor as float32; :meth:`close` (or ``with``) unmaps."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = map_file(self.path, "GGUF file")
        try:
            self._parse(_Cursor(self._map, len(self._map), self.path))
        except BaseException:
            self.close()
            raise

    def _parse(self, cur: _Cursor) -> None:
        if cur.size < 4 or bytes(self._map[:4]) != MAGIC:
            raise HssError(f"{self.path}: not a GGUF file: it starts with {describe_start(self._map[:16])}, where a "
                           f"GGUF starts with 'GGUF'")
        cur.pos = 4
        version = cur.u32("the header (version)")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            hint = ("a big-endian GGUF: only little-endian files are read" if swapped in (2, 3) else
                    "version 1 predates the current layout: convert the model again with a current llama.cpp"
                    if version == 1 else "only versions 2 and 3 are read")
            raise cur.fail(f"GGUF version {version}: {hint}", 4)
        self.version = version
        n_tensors = cur.u64("the header (tensor count)")
        n_kv = cur.u64("the header (metadata count)")
        if n_kv * 13 > cur.size - cur.pos or n_tensors * 24 > cur.size - cur.pos:   # the smallest possible entries
            raise cur.fail(f"the header claims {n_kv} metadata entries and {n_tensors} tensors, more than the "
                           f"{cur.size - cur.pos} bytes left can hold (damaged or truncated)", 8)
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, str] = {}
        for i in range(n_kv):
            at = cur.pos
            key = cur.string(f"metadata key {i}")
            if key in self.metadata:
                raise cur.fail(f"metadata key {key!r} appears twice", at)
            vtype = cur.value_type(f"metadata {key!r}")
            element = cur.buf[cur.pos:cur.pos + 4] if vtype == ARRAY else b""
            self.metadata[key] = cur.value(vtype, f"metadata {key!r}")
            name = VALUE_TYPES[vtype][0]
            if vtype == ARRAY:
                name += f"[{VALUE_TYPES[int.from_bytes(element, 'little')][0]}]"
            self.value_types[key] = name
        self.alignment = self._alignment(cur)
        infos = [self._tensor_info(cur, i) for i in range(n_tensors)]
        self.data_offset = ceil_div(cur.pos, self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, rel in infos:
            self.tensors[name] = self._placed(name, shape, ggml_type, rel)

    def _alignment(self, cur: _Cursor) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        value = self.metadata["general.alignment"]
        if self.value_types["general.alignment"] != "UINT32" or value == 0 or value & (value - 1):
            raise HssError(f"{self.path}: metadata 'general.alignment' is {value!r} "
                           f"({self.value_types['general.alignment']}); it must be a UINT32 power of two")
        return value

    def _tensor_info(self, cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
        at = cur.pos
        name = cur.string(f"the name of tensor {i}")
        n_dims = cur.u32(f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}", cur.pos - 4)
        ne = [cur.u64(f"the dimensions of tensor {name!r}") for _ in range(n_dims)]
        ggml_type = cur.u32(f"the type of tensor {name!r}")
        if ggml_type not in GGML_TYPES:
            raise cur.fail(f"tensor {name!r} has GGML type {ggml_type}, which ggml does not define", cur.pos - 4)
        rel = cur.u64(f"the data offset of tensor {name!r}")
        block = GGML_TYPES[ggml_type].block
        if ne[0] % block:
            raise cur.fail(f"tensor {name!r}: its rows of {ne[0]} elements are not whole {type_name(ggml_type)} "
                           f"blocks of {block}", at)
        if rel % self.alignment:
            raise cur.fail(f"tensor {name!r}: data offset {rel} is not a multiple of the alignment {self.alignment}",
                           cur.pos - 8)
        return name, tuple(reversed(ne)), ggml_type, rel

    def _placed(self, name: str, shape: tuple[int, ...], ggml_type: int, rel: int) -> TensorInfo:
        if name in self.tensors:
            raise HssError(f"{self.path}: tensor {name!r} appears twice")
        t = GGML_TYPES[ggml_type]
        n = int(np.prod(shape, dtype=object))
        nbytes = n // t.block * t.nbytes
        start = self.data_offset + rel
        if start + nbytes > len(self._map):
            raise HssError(f"{self.path}: tensor {name!r} ({t.name}, shape {shape}) needs bytes {start} to "
                           f"{start + nbytes}, the file has {len(self._map)} (truncated?)")
        return TensorInfo(name, shape, ggml_type, start, nbytes)

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantised to a new float32 array of its numpy shape."""
        info = self.tensors.get(name)
        if info is None:
            raise HssError(f"{self.path}: no tensor {name!r}")
        if self._map is None:
            raise HssError(f"{self.path}: the GGUF was closed")
        raw = np.frombuffer(self._map, np.uint8, info.nbytes, info.offset)
        try:
            values = dequantize(raw, info.ggml_type, int(np.prod(info.shape, dtype=object)))
        except HssError as e:
            raise HssError(f"{self.path}: tensor {name!r}: {e}") from None
        finally:
            del raw
        return values.reshape(info.shape)

    def close(self) -> None:
        """Unmap the file (idempotent); arrays from :meth:`tensor` are copies and stay valid."""
        mapped, self._map = getattr(self, "_map", None), None
        release(mapped)

    def __repr__(self) -> str:
        return f"GgufFile({str(self.path)!r}, version {self.version}, {len(self.metadata)} keys, " \
               f"{len(self.tensors)} tensors)"


def read_gguf(path: str | Path) -> GgufFile:
    """Open and check the GGUF at ``path`` (metadata and tensor infos read; tensor data read on demand)."""
    return GgufFile(path)
