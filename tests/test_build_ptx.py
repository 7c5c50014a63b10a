"""PTX build, stamps, staleness, --check, declarations vs the committed PTX; no GPU needed."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import build_ptx
from hss.cuda import ptx
from hss.decls import DECLARATIONS
from hss.errors import HssError

ROOT = Path(__file__).resolve().parent.parent
HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
PTX_TYPES = {"ptr": ".u64", "i64": ".u64", "i32": ".u32", "u32": ".u32", "f32": ".f32"}


def copy_tree(tmp_path: Path) -> Path:
    d = tmp_path / "ptx"
    shutil.copytree(ptx.ptx_dir(), d)
    return d


def test_committed_ptx_is_fresh():
    assert build_ptx.check() == []


def test_stamp_records_hash_flags_and_nvcc():
    stamp = ptx.read_stamp(ptx.ptx_path("selftest"))
    assert stamp is not None
    assert stamp["arch"] == ptx.DEFAULT_ARCH
    assert stamp["hash"] == ptx.source_hash("selftest", ptx.DEFAULT_ARCH)
    assert "-O3" in stamp["flags"] and "nvcc" in stamp


def test_editing_a_source_or_an_include_makes_it_stale(tmp_path):
    d = copy_tree(tmp_path)
    assert build_ptx.check(d) == []
    (d / "selftest.cu").write_text((d / "selftest.cu").read_text() + "\n// edit\n")
    problems = build_ptx.check(d)
    assert any("selftest.ptx: stale" in p for p in problems)
    d = copy_tree(tmp_path / "again")
    (d / "hss_common.cuh").write_text((d / "hss_common.cuh").read_text() + "\n// edit\n")
    assert any("stale" in p for p in build_ptx.check(d))


def test_missing_ptx_is_named(tmp_path):
    d = copy_tree(tmp_path)
    (d / "selftest.sm_90a.ptx").unlink()
    assert build_ptx.check(d) == [f"{d / 'selftest.sm_90a.ptx'}: missing (run `python build_ptx.py selftest`)"]


def test_flags_are_part_of_the_hash():
    assert ptx.source_hash("selftest", "compute_80") != ptx.source_hash("selftest", "compute_90")


def test_check_cli_exit_codes(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "build_ptx.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sources_follow_includes():
    names = [p.name for p in ptx.sources("selftest")]
    assert names == ["hss_common.cuh", "selftest.cu"]


@pytest.mark.skipif(not HAS_NVCC, reason="nvcc is not installed")
def test_rebuild_only_what_changed_and_atomically(tmp_path):
    d = copy_tree(tmp_path)
    assert all("up to date" in line for line in build_ptx.build(["selftest"], directory=d))
    (d / "selftest.cu").write_text((d / "selftest.cu").read_text() + "\n// touch\n")
    lines = build_ptx.build(["selftest"], directory=d)
    assert any("built" in line for line in lines)
    assert build_ptx.check(d) == []
    assert not list(d.glob(".selftest*"))   # no temp files left behind


def test_build_error_carries_command_and_stderr(tmp_path, monkeypatch):
    monkeypatch.setattr(build_ptx, "NVCC_CANDIDATES", ())
    monkeypatch.setattr(build_ptx.shutil, "which", lambda name: None)
    with pytest.raises(build_ptx.BuildError, match="nvcc not found"):
        build_ptx.build(["selftest"], directory=copy_tree(tmp_path))


@pytest.mark.skipif(not HAS_NVCC, reason="nvcc is not installed")
def test_nvcc_failure_is_a_build_error(tmp_path):
    d = copy_tree(tmp_path)
    (d / "selftest.cu").write_text("this is not C++\n")
    with pytest.raises(build_ptx.BuildError) as info:
        build_ptx.build(["selftest"], directory=d)
    assert "nvcc" in " ".join(info.value.command) and "error" in info.value.stderr


def test_variant_support_rules():
    assert ptx.variant_supported("sm_90a", (9, 0))
    assert not ptx.variant_supported("sm_90a", (10, 0))
    assert ptx.variant_supported("sm_90", (10, 0))
    assert not ptx.variant_supported("sm_100", (9, 0))
    assert ptx.choose("selftest", (9, 0))[0] == "sm_90a"
    assert ptx.choose("selftest", (8, 9))[0] is None


def test_min_driver_of_shipped_ptx():
    isa, driver = ptx.min_driver(ptx.ptx_path("selftest").read_text())
    assert isa == (9, 0) and driver == 580


def _entries(text: str) -> dict[str, list[str]]:
    out = {}
    for name, body in re.findall(r"\.entry\s+(\w+)\s*\(([^)]*)\)", text):
        out[name] = re.findall(r"\.param\s+(\.\w+)", body)
    return out


def test_every_declaration_matches_its_ptx_entry():
    for name, decl in DECLARATIONS.items():
        if decl.module not in ptx.MODULES:
            continue
        for variant, _ in ptx.targets(decl.module):
            entries = _entries(ptx.ptx_path(decl.module, variant).read_text())
            assert name in entries, f"{name} missing from {decl.module} ({variant})"
            assert entries[name] == [PTX_TYPES[k] for k in decl.kinds], f"{name}: declaration differs from PTX"


def test_every_ptx_entry_is_declared():
    for module in ptx.MODULES:
        for name in _entries(ptx.ptx_path(module).read_text()):
            assert name in DECLARATIONS, f"{module}.{name} has no declaration in hss.decls"


def test_a_module_with_a_newer_base_arch():
    """paged_decode_attn_pdl's base PTX is sm_90 (griddepcontrol): built, stamped and served for such devices only."""
    assert ptx.targets("paged_decode_attn_pdl") == [(None, "sm_90")]
    assert ptx.read_stamp(ptx.ptx_path("paged_decode_attn_pdl"))["arch"] == "sm_90"
    assert ptx.freshness("paged_decode_attn_pdl") == "fresh"
    assert ptx.choose("paged_decode_attn_pdl", (9, 0))[1].name == "paged_decode_attn_pdl.ptx"
    with pytest.raises(HssError, match="built for sm_90 only; this device is compute capability 8.9"):
        ptx.choose("paged_decode_attn_pdl", (8, 9))
    assert "griddepcontrol.wait" in ptx.ptx_path("paged_decode_attn_pdl").read_text()
    assert "griddepcontrol" not in ptx.ptx_path("paged_decode_attn_tiled").read_text()


def test_a_module_built_from_another_modules_source():
    """paged_decode_attn_pdl has no .cu of its own: it is paged_decode_attn_tiled.cu built with -DATT_PDL (the same
    entry points), and an edit of that source makes both stale."""
    assert ptx.spec("paged_decode_attn_pdl").source_name == "paged_decode_attn_tiled"
    assert not (ptx.ptx_dir() / "paged_decode_attn_pdl.cu").exists()
    assert ptx.sources("paged_decode_attn_pdl") == ptx.sources("paged_decode_attn_tiled")
    assert "-DATT_PDL" in ptx.read_stamp(ptx.ptx_path("paged_decode_attn_pdl"))["flags"]
    assert (_entries(ptx.ptx_path("paged_decode_attn_pdl").read_text())
            == _entries(ptx.ptx_path("paged_decode_attn_tiled").read_text()))


def test_editing_a_shared_source_makes_every_module_built_from_it_stale(tmp_path):
    d = copy_tree(tmp_path)
    (d / "paged_decode_attn_tiled.cu").write_text((d / "paged_decode_attn_tiled.cu").read_text() + "\n// edit\n")
    stale = {Path(p.split(":")[0]).name for p in build_ptx.check(d)}
    assert {"paged_decode_attn_tiled.ptx", "paged_decode_attn_pdl.ptx"} <= stale
    assert "attention_finalize.ptx" not in stale


def test_info_passes_over_modules_a_device_cannot_load(monkeypatch, capsys):
    """`python -m hss info` on a device older than a module's base arch says so and still reports ok."""
    from hss import __main__ as cli
    from hss.cuda import _context
    monkeypatch.setattr(_context.CudaCtx, "compute_capability", property(lambda self: (8, 0)))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "paged_decode_attn_pdl" in out and "not for this device (built for sm_90 only)" in out
    assert "status      : ok" in out
