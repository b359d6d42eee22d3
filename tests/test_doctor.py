"""`carrack doctor`: the kernel variant and why, CPU features, BLAS, compiler and cache, on this machine."""

from __future__ import annotations

import os
import sys

import pytest

from carrack import cli, doctor, native
from carrack.native import cpu


def _doctor(capsys) -> str:
    assert cli.main(["doctor"]) == 0
    return capsys.readouterr().out


def test_doctor_reports_every_section(capsys):
    out = _doctor(capsys)
    for heading in ("native kernels:", "CPU: ", "features seen (", "best variant for this CPU: ", "BLAS",
                    "C compiler: ", "runtime-build cache"):
        assert heading in out, heading
    for name in native.status():
        assert f"  {name}: " in out
    best = cpu.select_variant(native.cpu_features()[0], None).variant.name
    if native.manifest():
        assert f"prebuilt {best} (" in out


def test_doctor_without_threadpoolctl_reads_numpy(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import fails
    assert "BLAS (numpy.show_config): " in _doctor(capsys)


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_doctor_names_an_unsafe_cache(capsys, monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("CARRACK_CACHE_DIR", str(shared))
    out = _doctor(capsys)
    assert f"{shared}: {shared} is writable by other users (mode 777)" in out
    assert f"CARRACK_CACHE_DIR={shared}" in out


def test_doctor_reports_a_fallback(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_reasons", {})
    monkeypatch.setattr(native, "PREBUILT_DIR", tmp_path / "none")
    monkeypatch.setenv("CARRACK_CC", str(tmp_path / "no-such-cc"))
    out = _doctor(capsys)
    assert "not built with the package" in out
    assert "numpy fallback (not built with the package" in out and "warning: carrack: native kernel" in out


def test_demo_summary_names_the_variant():
    summary = doctor.native_summary()
    if native.manifest():
        assert summary.startswith(f"all {len(native.status())} loaded, prebuilt ")
