"""The one place argument rules live: integers, device pointers, streams and host buffers.

Every hss component converts its arguments here, so a rule is said once and every error names the
parameter and the fix. The module sits low in the layers (it imports only :mod:`hss.errors` and
:mod:`hss._interop`, which reads foreign arrays and streams): the owner classes above it (buffers, streams,
contexts) register how they are read (:func:`register_pointer_type`, :func:`register_stream_type`) and how two
streams are ordered (:func:`set_stream_join`).

**Integers** (:func:`as_int`): Python or numpy integers, converted to a Python ``int`` before any arithmetic;
``bool``, ``float`` (NaN too), ``str`` and anything else are a ``TypeError`` naming the parameter.

**Device pointers** (:func:`pointer`, and :func:`pointer_arg` for hot paths):
- ``int`` / :class:`~hss.cuda.gpu.DevicePtr`: an address. Inside a live hss-owned buffer it is bounds-checked against
  that buffer; elsewhere hss cannot know the size and trusts it.
- hss buffers and their typed views: a closed one is refused ("closed"); size and dtype are checked.
- foreign arrays, read by :mod:`hss._interop`: torch tensors (CUDA, contiguous, size, dtype), CuPy arrays,
  ``__cuda_array_interface__`` (v3) objects (size, C-contiguity, dtype and read-only checked where the callee knows
  them) and ``__dlpack__`` producers (JAX, CuPy, ...; handed the callee's stream as the protocol says). A CAI
  ``stream`` is honoured: the callee's stream is ordered after it (inside :class:`deferred_joins`, the callee's
  check phase, only once every check of the call has passed: a call that fails queues nothing).
Byte arrays (``u8``) are raw memory and match any dtype; other dtypes must match the callee's.

**Streams** (:func:`stream`): ``int`` handles (0 is the legacy default stream), :class:`~hss.cuda_min.CudaStream`,
``CUstream``, ``__cuda_stream__`` objects (cuda.core, recent torch and CuPy), torch / CuPy stream objects, and a
:class:`~hss.cuda_min.CudaCtx` (its stream). ``None`` is refused: streams are explicit everywhere.

**Host buffers** (:func:`host_buffer`): numpy arrays, pinned buffers and buffer-protocol objects, sized by what
they say; an ``int`` is an address (0 refused), bounds-checked inside a live pinned buffer.

**Own memory** (:class:`OwnedRanges`, :func:`disjoint`): a component that owns device memory (scratch, tables, key
buffers, running state) refuses a caller's pointer into it, and a call refuses a written argument that overlaps
another argument of the same call, so no object can be made to overwrite itself.

**Remembered checks** (:func:`memo_key`, :class:`Remembered`; docs/design.md §23): a cheap key per
argument, equal only where every check here answers the same, so that a hot call can keep what the checks of an
argument set produced and skip them when the same set comes again; it holds while ``RANGES.generation`` is
unchanged (no hss buffer allocated or freed, no context made or destroyed), and the stream joins its checks asked
for are asked for again at every repeat.

Why one module of some 790 lines: it is the single place these rules live, and its parts lean on each other
inline for speed (the prepared pointer check reads the live ranges' snapshot, the registered readers, the device
check and the join state directly; a memo key is what those checks read); cut further, the rules would be spread
over modules importing each other's internals. What reads foreign objects, the part that stands alone, is
:mod:`hss._interop`.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import operator
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from hss import _interop
from hss._interop import DeviceArg, Reader, StreamReader
from hss.errors import HssError

__all__ = ["as_int", "as_index", "as_count", "as_float", "int_fields", "dims3", "pointer", "pointer_arg",
           "device_ptr", "DeviceArg", "device_arg", "stream", "host_buffer", "register_pointer_type",
           "register_stream_type", "register_host_type", "set_stream_join", "deferred_joins", "dtype_name",
           "DTYPE_SIZES", "RANGES", "LiveRanges", "OwnedRanges", "disjoint", "extent", "DEVICES", "device_of",
           "check_device", "memo_key", "MEMO_KEYS", "NO_KEY", "no_memo_key", "Remembered"]

# -- integers ---------------------------------------------------------------------------------


def as_int(name: str, value: Any, lo: int | None = None, hi: int | None = None, why: str = "") -> int:
    """``value`` as a Python ``int`` (ints and numpy integers only), optionally within ``[lo, hi]``.

    ``TypeError`` for bool, float, str...; :class:`HssError` out of range, naming ``name`` (and ``why``)."""
    if type(value) is int:
        v = value
    elif isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    else:
        try:
            v = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = (f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in {lo}..{hi}")
        raise HssError(f"{name} = {v} must be {rng}{': ' + why if why else ''}")
    return v


def as_count(name: str, value: Any, hi: int | None = None, why: str = "") -> int:
    """A non-negative int (a byte count, an element count, ...)."""
    return as_int(name, value, 0, hi, why)


def as_index(name: str, value: Any, size: int, what: str) -> int:
    """An index into ``size`` things called ``what``."""
    v = as_int(name, value)
    if not 0 <= v < size:
        raise HssError(f"{name} {v} is out of range: there are {size} {what} (0..{size - 1})")
    return v


def as_float(name: str, value: Any, finite: bool = True) -> float:
    """A real number as a Python float (ints, floats, numpy reals; not bool); finite unless told."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    if finite and not math.isfinite(v):
        raise HssError(f"{name} = {v!r} must be finite")
    return v


def int_fields(obj: Any) -> None:
    """Convert every ``int`` field of dataclass ``obj`` (frozen or not) to a Python int in place (numpy integers
    would otherwise wrap in later arithmetic); ``TypeError`` naming the field for anything else."""
    cls = type(obj)
    for f in dataclasses.fields(obj):
        if f.type in ("int", int):
            object.__setattr__(obj, f.name, as_int(f"{cls.__name__}.{f.name}", getattr(obj, f.name)))


def dims3(name: str, value: Any) -> tuple[int, int, int]:
    """A launch dimension (an int or a 1-3 tuple of ints, each 1..2^31-1) as a 3-tuple of Python ints."""
    if type(value) is tuple and len(value) == 3 and all(type(v) is int and 0 < v < 2**31 for v in value):
        return value
    parts = value if isinstance(value, (tuple, list)) else (value,)
    if not 1 <= len(parts) <= 3:
        raise HssError(f"{name} needs 1 to 3 dimensions, got {value!r}")
    out = tuple(as_int(f"{name}[{i}]", v, 1, 2**31 - 1) for i, v in enumerate(parts))
    return (out + (1, 1))[:3]


# -- dtypes -----------------------------------------------------------------------------------
DTYPE_SIZES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4,
               "u32": 4, "i64": 8, "u64": 8}
_TYPESTR = _interop.TYPESTR   # numpy / CAI typestr -> short name (hss.cuda._memory reads it here)


def dtype_name(dtype: Any) -> str:
    """hss's short name ('bf16', 'f32', 'i32', ...) of a short name, numpy / ml_dtypes dtype or torch dtype."""
    if isinstance(dtype, str) and dtype in DTYPE_SIZES:
        return dtype
    torch_names = _interop.torch_dtypes()
    if torch_names and dtype in torch_names:
        return torch_names[dtype]
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{dtype!r} is not a dtype hss knows; use one of {', '.join(DTYPE_SIZES)}") from None
    if dt.name == "bfloat16":
        return "bf16"
    name = _TYPESTR.get(dt.str)
    if name is None:
        raise TypeError(f"dtype {dt} is not one hss uses; use one of {', '.join(DTYPE_SIZES)}")
    return name


def _matches(have: str | None, want: str | None) -> bool:
    return want is None or have is None or have == want or have == "u8"


# -- live hss buffers -------------------------------------------------------------------------
class LiveRanges:
    """Address ranges of live hss buffers (device and pinned), so that pointers into them are bounds-checked.

    Readers take an immutable snapshot (no lock on the hot path); writers replace it under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[int, int, int, int]] = []        # (start, end, key, device), sorted by start
        self._keys = itertools.count()
        self.snapshot: tuple[list[int], list[int]] = ([], [])      # starts, ends
        self.devices: tuple[list[int], list[int], list[int]] = ([], [], [])   # starts, ends, device ordinals
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        # changes with every add / remove and every bump(): a check made at one generation holds until it changes
        self.generation = 0

    def add(self, start: int, size: int, device: int = -1) -> int:
        """Register ``[start, start + size)`` (device memory of ordinal ``device``; -1: pinned host memory, any
        device's); the returned key removes exactly this entry."""
        with self._lock:
            key = next(self._keys)
            bisect.insort(self._entries, (start, start + size, key, device))
            self._publish()
        return key

    def remove(self, key: int) -> None:
        with self._lock:
            self._entries = [e for e in self._entries if e[2] != key]
            self._publish()

    def bump(self) -> None:
        """Change the generation without changing the ranges: something else a remembered check depends on changed
        (hss's context layer calls it whenever a context is made or destroyed)."""
        with self._lock:
            self.generation += 1

    def _publish(self) -> None:
        starts, ends = [e[0] for e in self._entries], [e[1] for e in self._entries]
        self.snapshot = (starts, ends)
        self.devices = (starts, ends, [e[3] for e in self._entries])
        self._arrays = None
        self.generation += 1

    def device_of(self, ptr: int) -> int | None:
        """The device ordinal of the live hss device buffer holding ``ptr`` (None: pinned memory or not hss's)."""
        starts, ends, devices = self.devices
        i = bisect.bisect_right(starts, ptr) - 1
        return devices[i] if i >= 0 and ptr < ends[i] and devices[i] >= 0 else None

    def find(self, ptr: int) -> tuple[int, int] | None:
        """(start, end) of the live buffer holding ``ptr``, or None."""
        starts, ends = self.snapshot
        i = bisect.bisect_right(starts, ptr) - 1
        return (starts[i], ends[i]) if i >= 0 and ptr < ends[i] else None

    def check(self, ptr: int, nbytes: int, name: str) -> None:
        """Raise if ``nbytes`` at ``ptr`` start inside a live buffer and run past its end."""
        starts, ends = self.snapshot
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and ptr < ends[i] < ptr + nbytes:
            raise HssError(f"{name}: {nbytes} bytes at offset {ptr - starts[i]} run past the end of its "
                           f"{ends[i] - starts[i]}-byte buffer; use fewer bytes or a larger buffer")

    def check_many(self, ptrs: np.ndarray, nbytes: np.ndarray, name: str) -> None:
        """:meth:`check` of every ``(ptrs[i], nbytes[i])`` (int64 arrays) at once; raises for the first bad one."""
        arrays = self._arrays
        if arrays is None:
            starts, ends = self.snapshot
            arrays = self._arrays = np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)
        starts, ends = arrays
        if not starts.size or not ptrs.size:
            return
        i = np.searchsorted(starts, ptrs, side="right") - 1
        end = ends[np.maximum(i, 0)]
        bad = np.flatnonzero((i >= 0) & (ptrs < end) & (ptrs + nbytes > end))
        if bad.size:
            b = int(bad[0])
            self.check(int(ptrs[b]), int(nbytes[b]), name)


RANGES = LiveRanges()


class _Devices:
    """Whether this process uses more than one device (hss then checks which device each pointer is on)."""

    many = False


DEVICES = _Devices()


def device_of(obj: Any, ptr: int) -> int | None:
    """The device ordinal of argument ``obj`` at address ``ptr`` where it can be known without a driver call: an
    hss buffer or view, a torch tensor, any address inside a live hss device buffer; else None."""
    d = getattr(obj, "device", None)
    if type(d) is int:
        return d   # DeviceBuffer.device
    buf = getattr(obj, "buffer", None)
    if buf is not None and type(getattr(buf, "device", None)) is int:
        return buf.device   # DeviceView
    if _READERS.get(type(obj)) is _interop.read_torch and obj.is_cuda:
        return obj.get_device()
    return RANGES.device_of(ptr)


def check_device(obj: Any, ptr: int, name: str, device: int) -> None:
    """Raise :class:`HssError` if argument ``name`` is memory of another device than ``device`` (see
    :func:`device_of`; memory whose device cannot be known passes)."""
    where = device_of(obj, ptr)
    if where is not None and where != device:
        raise HssError(f"{name} is memory of device {where}, but this call runs on device {device}; pass memory "
                       f"of device {device} (copy it there first)")


class OwnedRanges:
    """The device memory one component owns, each range with a label (``add(start, nbytes, label)``,
    ``remove(start)``), so that a caller's pointer into it is refused (:meth:`check`): the component would
    overwrite its own scratch, tables or state. Ranges do not overlap (they are distinct allocations)."""

    __slots__ = ("_starts", "_ends", "_labels")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._labels: list[str] = []

    def add(self, start: int, nbytes: int, label: str) -> None:
        i = bisect.bisect_right(self._starts, start)
        self._starts.insert(i, start)
        self._ends.insert(i, start + nbytes)
        self._labels.insert(i, label)

    def remove(self, start: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start:
            del self._starts[i], self._ends[i], self._labels[i]

    def clear(self) -> None:
        self._starts.clear()
        self._ends.clear()
        self._labels.clear()

    def __len__(self) -> int:
        return len(self._starts)

    def overlap(self, ptr: int, nbytes: int) -> str | None:
        """The label of an owned range that ``[ptr, ptr + nbytes)`` overlaps, or None."""
        if nbytes <= 0:
            return None
        i = bisect.bisect_left(self._starts, ptr + nbytes) - 1   # the last range starting before the end
        return self._labels[i] if i >= 0 and self._ends[i] > ptr else None

    def check(self, ptr: int, nbytes: int, name: str, owner: str) -> None:
        """Raise :class:`HssError` if argument ``name`` (``nbytes`` at ``ptr``) overlaps memory ``owner`` owns."""
        if not self._starts:
            return
        label = self.overlap(ptr, nbytes)
        if label is not None:
            raise HssError(f"{name} ({ptr:#x}, {nbytes} bytes) overlaps {label}, memory that {owner} owns and writes; "
                           f"pass a buffer of your own")


def disjoint(what: str, *args: tuple[str, int, int, bool]) -> None:
    """Raise :class:`HssError` if a written argument of call ``what`` overlaps another of its arguments: each
    ``(name, address, bytes, written)``; arguments that are only read may overlap each other."""
    for i, (name, p, n, w) in enumerate(args):
        if n <= 0:
            continue
        for name2, p2, n2, w2 in args[i + 1:]:
            if (w or w2) and n2 > 0 and p < p2 + n2 and p2 < p + n:
                a, b = ((name, p, n), (name2, p2, n2)) if w else ((name2, p2, n2), (name, p, n))
                raise HssError(f"{what}: {a[0]} overlaps {b[0]} ({a[2]} bytes at {a[1]:#x}, {b[2]} bytes at "
                               f"{b[1]:#x}): {a[0]} is written while {b[0]} is in use; pass separate buffers")


def extent(obj: Any, ptr: int, min_bytes: int) -> int:
    """The bytes an argument spans from its checked address ``ptr``, for an overlap check where the call's reach is
    not known in advance (a paged pool read through page ids): the bytes the argument states (an array's size), else,
    for an address inside a live hss buffer, up to that buffer's end, else ``min_bytes`` (the least the call reads);
    never less than ``min_bytes``."""
    cls = type(obj)
    n: int | None = None
    if cls in _QUICK:
        got = _QUICK[cls](obj)
        n = got[1] if got is not None else None
    elif _READERS.get(cls) is _interop.read_torch:
        n = obj.nbytes
    elif not isinstance(obj, (int, np.integer)):
        n = device_arg(obj, "extent").nbytes
    if n is None:
        span = RANGES.find(ptr)
        n = span[1] - ptr if span is not None else 0
    return n if n > min_bytes else min_bytes


# -- device pointers --------------------------------------------------------------------------
# A reader turns an object of one type into a DeviceArg (raising HssError/TypeError naming `name`); the foreign
# types' readers are hss._interop's, found once per type
_READERS: dict[type, Reader] = {}
# hss's own array types: obj -> (address, bytes, dtype name or None), or None when closed (then the reader
# raises); what pointer_arg decides without building a DeviceArg
Quick = Callable[[Any], "tuple[int, int, str | None] | None"]
_QUICK: dict[type, Quick] = {}
_stream_join: Callable[[int, int], None] | None = None


def register_pointer_type(cls: type, reader: Reader, quick: Quick | None = None, remembered: bool = False) -> None:
    """Teach the argument layer a device-array type: ``reader(obj, name, stream) -> DeviceArg`` (raising for a
    closed or unusable object), and optionally ``quick(obj) -> (address, bytes, dtype) | None`` for hot paths.

    ``remembered``: its objects have a ``_memo_key`` (an attribute or property): a hashable key that is equal for two
    objects only when ``reader`` and ``quick`` say the same of both (a key object of the object's own, compared by
    identity, for an owner whose address and size are fixed), and :data:`NO_KEY` once the object is closed; see
    :func:`memo_key`."""
    _READERS[cls] = reader
    if quick is not None:
        _QUICK[cls] = quick
    MEMO_KEYS[cls] = _own_key if remembered else _no_key


def set_stream_join(join: Callable[[int, int], None]) -> None:
    """The function that orders later work on stream ``consumer`` after what ``producer`` has queued
    (``join(consumer, producer)``); hss's context layer installs it."""
    global _stream_join
    _stream_join = join


class _JoinState(threading.local):
    """Per thread: the marks of the open deferred_joins blocks (their pending list's length at entry), the pending
    (consumer, producer) joins, and the lists that record the joins of the checks a Remembered table is running
    (innermost last)."""

    def __init__(self) -> None:
        self.marks: list[int] = []
        self.pending: list[tuple[int, int]] = []
        self.records: list[list[tuple[int, int]]] = []


_joins = _JoinState()


class deferred_joins:
    """``with _args.deferred_joins(): <every argument check of one call>``: the stream joins those checks ask for
    (a ``__cuda_array_interface__`` producer's stream) are queued when the block exits normally, after every check
    passed, and dropped when it raises, so a call that fails on a later argument has ordered nothing. Nested blocks
    join at the outermost exit (an inner block that raises drops only its own). Outside any block a join is queued
    at once, when its argument is read."""

    __slots__ = ()

    def __enter__(self) -> deferred_joins:
        js = _joins
        js.marks.append(len(js.pending))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        js = _joins
        mark = js.marks.pop()
        pending = js.pending
        if exc_type is not None:
            del pending[mark:]
        elif pending and not js.marks:
            todo = pending[:]
            pending.clear()
            for consumer, producer in todo:
                _stream_join(consumer, producer)   # type: ignore[misc]


def _join(consumer: int, producer: int) -> None:
    """Order ``consumer`` after ``producer`` now, or when the enclosing :class:`deferred_joins` block exits."""
    js = _joins
    if js.records:   # (an enclosing record gets it when the inner block exits)
        js.records[-1].append((consumer, producer))
    if not js.marks:
        _stream_join(consumer, producer)   # type: ignore[misc]
    elif (consumer, producer) not in js.pending:
        js.pending.append((consumer, producer))


def _finish(arg: DeviceArg, name: str, nbytes: int | None, align: int, dtype: str | None, write: bool,
            what: str) -> int:
    ptr = arg.ptr
    fix = f" ({what})" if what else ""
    if nbytes is not None and arg.nbytes is not None and arg.nbytes < nbytes:
        raise HssError(f"{name} holds {arg.nbytes} bytes but {nbytes} are needed{fix}")
    if ptr == 0 and (nbytes is None or nbytes > 0):
        raise HssError(f"{name} is a null pointer: pass the device address of {what or 'the data'}")
    if ptr % align:
        raise HssError(f"{name} ({ptr:#x}) must be {align}-byte aligned{fix}")
    if not _matches(arg.dtype, dtype):
        raise HssError(f"{name} holds {arg.dtype} but {dtype} is needed{fix}: pass a {dtype} tensor (or a view of "
                       f"the same bytes as {dtype})")
    if write and arg.readonly:
        raise HssError(f"{name} is read-only but is written{fix}: pass a writable array")
    if arg.nbytes is None and nbytes:
        RANGES.check(ptr, nbytes, name)
    return ptr


def device_arg(obj: Any, name: str = "pointer", stream: int | None = None) -> DeviceArg:
    """What ``obj`` says about itself as a device array (see the module docstring for the accepted forms).

    ``stream``: the stream the callee will use; a CUDA-array-interface producer's stream is ordered before it,
    a DLPack producer is handed it. None: the callee orders nothing."""
    if type(obj) is int:
        return DeviceArg(obj, None)
    reader = _READERS.get(type(obj))
    if reader is None:
        reader = _reader_for(type(obj), obj, name)
    arg = reader(obj, name, stream)
    if stream is not None and arg.stream is not None and arg.stream != stream and _stream_join is not None:
        if not (arg.stream in (0, 1) and stream in (0, 1)):   # 0 and 1 both name the legacy default stream
            _join(stream, arg.stream)
    return arg


def pointer(obj: Any, name: str, nbytes: int | None = None, align: int = 1, dtype: str | None = None,
            write: bool = False, stream: int | None = None, what: str = "") -> int:
    """The checked device address of argument ``name``: non-null, ``align``-aligned, at least ``nbytes`` (where
    the object or a live hss buffer knows its size), of ``dtype`` (where the object has one), writable when
    ``write``; ``what`` describes the expected array in errors. See :func:`device_arg` for ``stream``."""
    if type(obj) is int:
        if obj < 0:
            raise HssError(f"{name} = {obj} is not a device address (addresses are >= 0)")
        return _finish(DeviceArg(obj, None), name, nbytes, align, None, False, what)
    return _finish(device_arg(obj, name, stream), name, nbytes, align, dtype, write, what)


def pointer_arg(name: str, nbytes: int | None, align: int = 1, dtype: str | None = None, write: bool = False,
                what: str = "", device: int | None = None) -> Callable[..., int]:
    """A prepared :func:`pointer` for one parameter of a hot call: ``check(obj, stream=None, nbytes=None) -> int``
    (``nbytes`` overrides the prepared size for calls whose size varies).

    Same rules and errors as :func:`pointer`, with the common cases (an int address, a torch tensor, an hss
    buffer) decided in a few attribute reads, and an int address that passed at least this size while the live
    buffers did not change passing at once; anything unusual takes the general path. ``device``: the ordinal the
    call runs on; once the process uses a second device, memory known to be another device's is refused
    (:func:`check_device`)."""
    registry = RANGES
    fixed = nbytes or 0
    torch_dtypes: set[Any] = set()   # the torch dtypes that match `dtype`, resolved at the first torch tensor
    prepared = nbytes
    last_ptr, last_need, last_gen = -1, -1, -1   # the last int address that passed, for how many bytes, when
    many = DEVICES if device is not None else _Devices()   # the latter never turns on

    def check(obj: Any, stream: int | None = None, nbytes: int | None = None) -> int:
        nonlocal last_ptr, last_need, last_gen
        if nbytes is None:
            need, nbytes = fixed, prepared
        else:
            need = nbytes
        cls = type(obj)
        if cls is int:
            if obj == last_ptr and need <= last_need and registry.generation == last_gen:
                return obj
            if obj > 0 and not obj % align:
                gen = registry.generation
                if need:
                    starts, ends = registry.snapshot
                    i = bisect.bisect_right(starts, obj) - 1
                    if i >= 0 and obj < ends[i] < obj + need:
                        registry.check(obj, need, name)
                if many.many:
                    check_device(obj, obj, name, device)   # type: ignore[arg-type]
                last_ptr, last_need, last_gen = obj, need, gen
                return obj
        elif cls in _QUICK:
            got = _QUICK[cls](obj)
            if got is not None:
                p, size, dt = got
                if size >= need and not p % align and (dt is None or dt == dtype or dtype is None or dt == "u8"):
                    if many.many:
                        check_device(obj, p, name, device)   # type: ignore[arg-type]
                    return p
        elif _READERS.get(cls) is _interop.read_torch:
            if not torch_dtypes:
                torch_dtypes.update(_torch_matching(dtype))
            if obj.is_cuda and obj.dtype in torch_dtypes and obj.is_contiguous() and obj.nbytes >= need:
                p = obj.data_ptr()
                if p and not p % align:
                    if many.many:
                        check_device(obj, p, name, device)   # type: ignore[arg-type]
                    return p
        p = pointer(obj, name, nbytes, align, dtype, write, stream, what)
        if many.many:
            check_device(obj, p, name, device)   # type: ignore[arg-type]
        return p

    return check


def _torch_matching(dtype: str | None) -> list[Any]:
    names = _interop.torch_dtypes() or {}
    return [t for t, n in names.items() if _matches(n, dtype)]


def device_ptr(obj: Any, name: str = "pointer") -> int:
    """The device address of any accepted device-array form, unchecked beyond being one (closed buffers refused)."""
    if type(obj) is int:
        return obj
    return device_arg(obj, name).ptr


def _reader_for(cls: type, obj: Any, name: str) -> Reader:
    """Find (and cache) the reader of a type not seen before."""
    reader: Reader | None
    if (issubclass(cls, int) and not issubclass(cls, bool)) or issubclass(cls, np.integer):
        reader = _read_int
    else:
        reader = _interop.reader_for(cls, obj)
    if reader is None:
        return _interop.refuse
    _READERS[cls] = reader
    MEMO_KEYS[cls] = _torch_key if reader is _interop.read_torch else _cai_key if reader is _interop.read_cai else \
        _no_key
    return reader


def _read_int(obj: Any, name: str, stream: int | None) -> DeviceArg:
    return DeviceArg(operator.index(obj), None)


# -- remembered checks ------------------------------------------------------------------------
# What one argument's checks read, as a cheap hashable key (memo_key), so that a hot call can keep a table from the
# keys of a whole argument set to what its checks produced (Remembered): docs/design.md §23.
MEMO_KEYS: dict[type, Callable[[Any], Any]] = {int: operator.index}   # exact type -> its objects' key


class _NoKey:
    """The memo key of an argument that has none: it cannot be hashed, so no key holding it is ever kept or found."""

    __slots__ = ()
    __hash__ = None   # type: ignore[assignment]

    def __repr__(self) -> str:
        return "NO_KEY"


NO_KEY: Any = _NoKey()


def no_memo_key(obj: Any) -> Any:
    """The memo key of an object of a type :data:`MEMO_KEYS` does not list: one not seen before, read first (its key,
    if it has one, serves from this call on), or one that is no device array (NO_KEY)."""
    cls = type(obj)
    if cls in _READERS:
        return NO_KEY
    try:
        _reader_for(cls, obj, "argument")
    except Exception:   # what cannot be read is refused by the check itself, with its error
        return NO_KEY
    return MEMO_KEYS.get(cls, _no_key)(obj)


def _no_key(obj: Any) -> Any:   # the key of a type that has none
    return NO_KEY


_TORCH_KEY, _CAI_KEY = object(), object()   # tags: a torch key never equals an interface's
_own_key = operator.attrgetter("_memo_key")


def memo_key(obj: Any) -> Any:
    """A cheap hashable key of device-array argument ``obj`` for a table of checks that passed (:class:`Remembered`),
    or :data:`NO_KEY` where there is none (check it every call). Equal keys mean that every check here (:func:`pointer`,
    a :func:`pointer_arg` check, :func:`check_device`) answers the same for both objects and asks for the same stream
    joins, for as long as ``RANGES.generation`` is unchanged:

    - an ``int`` address: the int (its bounds check reads the live buffers, which the generation covers);
    - hss's own types (``register_pointer_type(..., remembered=True)``): their ``_memo_key`` (a DeviceBuffer's is a
      key object of its own, NO_KEY once it is closed);
    - torch tensors: what their check reads (address, bytes, dtype, contiguity, device): about as many reads as the
      check, but a table then spares the call's other checks;
    - ``__cuda_array_interface__`` objects: what the interface says now (it is read every call; the producer's
      stream is part of it, and a table joins it again at every recall), and once the process uses several devices
      the device the device check finds;
    - anything else: NO_KEY (DLPack producers, handed the stream at every export; CuPy arrays, whose producer is
      CuPy's current stream; numpy integers; pinned buffers).

    Hot paths spell it ``MEMO_KEYS.get(type(obj), no_memo_key)(obj)`` (no Python frame for hss's own types), or
    ``obj`` itself where ``type(obj) is int``."""
    return MEMO_KEYS.get(type(obj), no_memo_key)(obj)


def _torch_key(t: Any) -> Any:
    try:
        return (_TORCH_KEY, t.data_ptr(), t.nbytes, t.dtype, t.is_contiguous(), t.device)
    except Exception:   # a tensor without storage (meta, fake): its check says why
        return NO_KEY


def _cai_key(obj: Any) -> Any:
    try:
        cai = obj.__cuda_array_interface__
        key = (_CAI_KEY, cai["data"], cai["shape"], cai["typestr"], cai.get("strides"), cai.get("version"),
               cai.get("mask"), cai.get("stream"))
        if DEVICES.many:   # the device check reads more than the interface: what it finds is part of the key
            key += (device_of(obj, int(cai["data"][0] or 0)),)
        return key
    except Exception:   # no interface, or a malformed one: its check says why
        return NO_KEY


class Remembered(dict):
    """What one hot call remembers of the argument sets whose checks passed, so that a repeat skips them: ``key`` ->
    what the checks produced. A key is a tuple that starts with ``RANGES.generation`` read before the checks (so that an
    entry is not found once an hss buffer was allocated or freed, or a context made or destroyed, since), followed by
    the arguments' :func:`memo_key` and the call's other arguments, each an exact ``int`` (a key holding NO_KEY cannot
    be hashed: ``get`` raises TypeError, :meth:`check` keeps nothing). ``table.get(key)`` (a dict's: no Python frame
    on a hot path) finds the entries whose checks asked for no stream join; :meth:`check` finds the others too, asking
    for their joins again, and checks (and keeps) what it finds nothing for. At most ``size`` entries: a full table
    starts over."""

    __slots__ = ("size", "_joined")

    def __init__(self, size: int = 256) -> None:
        super().__init__()
        self.size = size
        self._joined: dict[tuple, tuple[Any, tuple[tuple[int, int], ...]]] = {}   # key -> (value, joins)

    def __len__(self) -> int:
        return dict.__len__(self) + len(self._joined)

    def clear(self) -> None:
        dict.clear(self)
        self._joined.clear()

    def check(self, key: tuple | None, checks: Callable[..., Any], *args: Any) -> Any:
        """What ``checks(*args)`` (the call's full checks, raising for a bad argument) produces for the arguments
        ``key`` names: remembered (their joins asked for again), else checked now and kept when they pass (not when
        ``key`` is None or cannot be hashed: an argument without a memo key, an interface's list)."""
        if key is None:
            return checks(*args)
        joined = self._joined
        try:
            value = dict.get(self, key)
            hit = joined.get(key) if joined else None
        except TypeError:   # NO_KEY, or an unhashable value an interface holds: never kept
            return checks(*args)
        if value is not None:
            return value
        if hit is not None:
            for consumer, producer in hit[1]:
                _join(consumer, producer)
            return hit[0]
        records, joins = _joins.records, []   # the joins these checks ask for (queued or deferred as usual)
        records.append(joins)
        try:
            value = checks(*args)
        finally:
            records.pop()
            if records:   # an enclosing table's checks asked for them too
                records[-1].extend(joins)
        if dict.__len__(self) + len(joined) >= self.size:
            self.clear()
        if joins:
            joined[key] = (value, tuple(joins))
        else:
            self[key] = value
        return value


# -- streams ----------------------------------------------------------------------------------
_STREAMS: dict[type, StreamReader] = {}


def register_stream_type(cls: type, reader: StreamReader) -> None:
    """Teach the argument layer a stream type: ``reader(obj) -> raw handle``."""
    _STREAMS[cls] = reader


def stream(obj: Any, name: str = "stream") -> int:
    """The raw ``CUstream`` handle of a stream argument (see the module docstring for the accepted forms)."""
    if type(obj) is int:
        if obj < 0:
            raise HssError(f"{name} = {obj} is not a stream handle")
        return obj
    reader = _STREAMS.get(type(obj))
    if reader is None:
        reader = _stream_reader_for(type(obj), obj, name)
    return reader(obj)


def _stream_reader_for(cls: type, obj: Any, name: str) -> StreamReader:
    reader: StreamReader | None = None
    if obj is None or issubclass(cls, (bool, float, str, np.bool_, np.floating)):
        pass
    elif issubclass(cls, (int, np.integer)):
        reader = operator.index
    else:
        reader = _interop.stream_reader_for(cls)
    if reader is None:
        raise TypeError(f"{name}: a stream is required: pass an int handle (0 = the legacy default stream), a "
                        f"CudaStream, a CudaCtx, a CUstream, a torch / CuPy stream or an object with __cuda_stream__; "
                        f"got {type(obj).__name__}")
    _STREAMS[cls] = reader
    return reader


# -- host buffers -----------------------------------------------------------------------------
_HOST_READERS: dict[type, Reader] = {}


def register_host_type(cls: type, reader: Reader) -> None:
    """Teach the argument layer a host-buffer type (an hss pinned buffer): ``reader(obj, name, None)``."""
    _HOST_READERS[cls] = reader


def host_buffer(obj: Any, nbytes: int, write: bool, name: str) -> int:
    """The host address of a buffer holding at least ``nbytes`` (written when ``write``).

    numpy arrays must be C-contiguous; pinned buffers and buffer-protocol objects are sized by what they say;
    an ``int`` is an address (0 refused) and is bounds-checked when it lies in a live pinned buffer."""
    if type(obj) is int:
        if obj <= 0:
            raise HssError(f"{name} = {obj} is not a host address: pass a numpy array or a pinned buffer")
        RANGES.check(obj, nbytes, name)
        return obj
    reader = _HOST_READERS.get(type(obj))
    if reader is not None:   # an hss pinned buffer
        return _finish(reader(obj, name, None), name, nbytes, 1, None, write, "")
    if isinstance(obj, np.ndarray):
        arr = obj
        if not arr.flags.c_contiguous:
            raise HssError(f"{name} must be C-contiguous; pass np.ascontiguousarray(...)")
    elif _interop.is_torch_tensor(type(obj)) and not obj.is_cuda:   # a CPU torch tensor is host memory
        return _interop.read_host_torch(obj, nbytes, name)
    elif _READERS.get(type(obj), _interop.refuse) is not _interop.refuse or _interop.is_torch_tensor(type(obj)) or \
            hasattr(obj, "__cuda_array_interface__"):
        raise HssError(f"{name} is device memory; a host buffer (numpy array, bytes-like or PinnedBuffer) is needed")
    else:
        try:
            arr = np.frombuffer(obj, dtype=np.uint8)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a host buffer (numpy array, bytes-like or PinnedBuffer), got "
                            f"{type(obj).__name__}") from None
    if write and not arr.flags.writeable:
        raise HssError(f"{name} is read-only")
    if arr.nbytes < nbytes:
        raise HssError(f"{name} holds {arr.nbytes} bytes but {nbytes} are to be copied")
    return arr.__array_interface__["data"][0] if arr.nbytes else 0
