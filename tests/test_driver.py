"""The driver seam: choice of driver, error sentences, fault injection."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hss import CudaError, inject_fault
from hss import cuda_min as cm
from hss.cuda import ptx
from hss.cuda._driver import PTX_VERSION_MESSAGE, check, driver_status

from conftest import ON_GPU


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_old_driver_gets_the_ptx_version_sentence(ctx):
    text = ptx.ptx_path("selftest").read_text()
    with inject_fault("cuModuleLoadData", "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"):
        with pytest.raises(CudaError) as info:
            cm.CudaModule.from_ptx(text, name="selftest")
    assert PTX_VERSION_MESSAGE in str(info.value) and "driver >= 580" in str(info.value)
    assert info.value.call == "cuModuleLoadData" and "module selftest" in str(info.value)


def test_check_unwraps_values():
    ok = type(driver_status())  # any object; check only reads result[0]
    assert check((0,), "x") is None
    assert check((0, 5), "x") == 5
    assert check((0, 1, 2), "x") == (1, 2)
    del ok


def test_fault_injection_counts_and_restores(ctx):
    with inject_fault("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY", times=2):
        for _ in range(2):
            with pytest.raises(CudaError):
                cm.DeviceBuffer(64)
        cm.DeviceBuffer(64).close()


def test_bad_hss_driver_value_is_refused():
    out = run_python("import hss; hss.driver_status()", HSS_DRIVER="opencl")
    assert out.returncode != 0 and "HSS_DRIVER='opencl'" in out.stderr


def test_emulator_can_be_forced():
    out = run_python("import hss; print(hss.driver_status().kind)", HSS_DRIVER="emulator")
    assert out.stdout.strip() == "emulator"


@pytest.mark.skipif(ON_GPU, reason="needs a machine without a CUDA driver")
def test_no_driver_gives_a_cuda_error_that_says_so():
    code = ("from hss import cuda_min as cm\n"
            "try:\n    cm.CudaCtx()\nexcept cm.CudaError as e:\n    print('ERR', e)\n")
    out = run_python(code, HSS_DRIVER="cuda")
    if "ERR" not in out.stdout and out.returncode == 0:
        pytest.skip("a CUDA driver is installed here")
    assert "no CUDA driver was found" in out.stdout, out.stdout + out.stderr


@pytest.mark.gpu
def test_real_driver_is_used_on_a_gpu():
    status = driver_status()
    assert status.kind == "cuda" and status.found and status.version >= 12000


def test_without_cuda_python_the_seam_chooses_the_emulator_and_says_why():
    """A process where cuda-python cannot be imported runs on the emulator (HSS_DRIVER unset) and says so; with
    HSS_DRIVER=cuda it raises an ImportError naming the fix."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = ("import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None\n"
            "import hss.cuda._driver as d\n"
            "try:\n    print(d.driver_status().kind, '|', d.driver_status().message)\n"
            "except ImportError as e:\n    print('ImportError |', e)\n")
    root = str(Path(__file__).resolve().parent.parent)
    for want, expect in (("", "emulator | cuda-python is not installed"),
                         ("cuda", "ImportError | HSS_DRIVER=cuda but cuda-python is not importable")):
        env = dict(os.environ, HSS_DRIVER=want, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert out.stdout.startswith(expect), (out.stdout, out.stderr)
