"""carrack installed into a fresh virtual environment, as a user (``pip install .``) and a developer or CI
(``pip install -e .``) install it: the install builds the native kernels, and they load at run time with no C
compiler on PATH, without compiling anything.

About 20-40 s per install, so these run when CARRACK_TEST_INSTALL=1 (.ci/run sets it). Nothing is downloaded:
the venv sees this interpreter's packages (numpy, onnx, setuptools) and pip runs without an index or isolation.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
IGNORED = shutil.ignore_patterns(".git", "build", "dist", "_kernels", "*.egg-info", "__pycache__", ".venv", "*.so")

pytestmark = [
    pytest.mark.install,
    pytest.mark.skipif(os.environ.get("CARRACK_TEST_INSTALL") != "1",
                       reason="set CARRACK_TEST_INSTALL=1 (as .ci/run does) to install carrack into a fresh venv"),
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CC"),
                       reason="building the kernels needs a C compiler at install time"),
]

CHECK = """
import json, shutil, warnings
import numpy as np
import carrack
from carrack import native
from onnx import TensorProto, helper

warnings.simplefilter("error", carrack.PerformanceWarning)  # a numpy fallback would fail here
weight = helper.make_tensor("w", TensorProto.FLOAT, [8, 1, 3, 3], np.linspace(-1, 1, 72, dtype=np.float32))
graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], group=8, pads=[1, 1, 1, 1])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 9, 9])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[weight])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
(y,) = carrack.InferenceSession(model).run(None, {"x": np.ones((1, 8, 9, 9), np.float32)})
status = native.status()
print(json.dumps({"file": carrack.__file__, "compiler": shutil.which("cc") or shutil.which("gcc"),
                  "status": status, "origins": {name: native.origin(name) for name in status},
                  "finite": bool(np.isfinite(y).all())}))
"""


def _copy_source(destination: Path) -> Path:
    """The repository as a clean checkout would have it (no built kernels, no build directory)."""
    shutil.copytree(REPO_ROOT, destination, ignore=IGNORED)
    return destination


def _fresh_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True)
    return path / ("Scripts" if os.name == "nt" else "bin")


def _install(bin_dir: Path, *args: str, cwd: Path) -> None:
    result = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                             "--no-index", "--no-input", *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _run_without_compiler(bin_dir: Path, home: Path, *command: str) -> subprocess.CompletedProcess:
    """Run in the venv with PATH holding only the venv (no cc, gcc or clang) and an empty HOME."""
    home.mkdir(exist_ok=True)
    env = {"PATH": str(bin_dir), "HOME": str(home), "LANG": "C.UTF-8"}
    return subprocess.run(list(command), cwd=home, env=env, capture_output=True, text=True, timeout=300)


def _check_kernels(bin_dir: Path, home: Path, package_root: Path) -> None:
    result = _run_without_compiler(bin_dir, home, str(bin_dir / "python"), "-c", CHECK)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["compiler"] is None
    assert Path(seen["file"]).resolve().is_relative_to(package_root.resolve()), seen["file"]
    assert set(seen["status"]) >= {"convgemm", "dwconv", "qconv", "qgemm", "rowops"}, seen["status"]
    assert set(seen["status"].values()) == {"loaded"}, seen["status"]
    assert all(origin.startswith("prebuilt ") for origin in seen["origins"].values()), seen["origins"]
    assert seen["finite"]
    assert not (home / ".cache").exists()  # nothing compiled at run time
    doctor = _run_without_compiler(bin_dir, home, str(bin_dir / "carrack"), "doctor")
    assert doctor.returncode == 0, doctor.stderr[-3000:]
    assert "prebuilt" in doctor.stdout and "C compiler: none found" in doctor.stdout, doctor.stdout


@pytest.mark.install
def test_pip_install_builds_the_kernels(tmp_path):
    source = _copy_source(tmp_path / "src")
    bin_dir = _fresh_venv(tmp_path / "venv")
    _install(bin_dir, str(source), cwd=tmp_path)
    site = Path(subprocess.run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['platlib'])"], capture_output=True, text=True, check=True).stdout.strip())
    assert (site / "carrack" / "native" / "_kernels" / "manifest.json").is_file()
    _check_kernels(bin_dir, tmp_path / "home", site / "carrack")


@pytest.mark.install
def test_editable_install_builds_the_kernels_in_place(tmp_path):
    """What .ci/run does (pip install -e): setuptools builds the kernels into the source tree."""
    source = _copy_source(tmp_path / "src")
    bin_dir = _fresh_venv(tmp_path / "venv")
    _install(bin_dir, "-e", str(source), cwd=tmp_path)
    assert (source / "carrack" / "native" / "_kernels" / "manifest.json").is_file()
    _check_kernels(bin_dir, tmp_path / "home", source / "carrack")
