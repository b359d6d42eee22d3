"""The native-kernel builder: compile on first use, cache by source and CPU, fall back cleanly."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from carrack import native

ADD_ONE = """
#include <stdint.h>
void add_one(float *x, int64_t n) { for (int64_t i = 0; i < n; i++) x[i] += 1.0f; }
"""


@pytest.fixture
def sources(tmp_path, monkeypatch):
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    monkeypatch.setattr(native, "SOURCE_DIR", source_dir)
    monkeypatch.setenv("CARRACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_reasons", {})
    monkeypatch.delenv("CARRACK_NATIVE", raising=False)  # these tests build on purpose, whatever the caller chose
    return source_dir


needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


@needs_compiler
def test_builds_once_and_runs(sources):
    (sources / "demo.c").write_text(ADD_ONE)
    lib = native.library("demo")
    assert lib is not None
    lib.add_one.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    x = np.arange(5, dtype=np.float32)
    lib.add_one(native.pointer(x), x.size)
    np.testing.assert_array_equal(x, np.arange(1, 6, dtype=np.float32))
    built = list((sources.parent / "cache").glob("demo-*.so"))
    assert len(built) == 1
    native._loaded.clear()
    assert native.library("demo") is not None
    assert list((sources.parent / "cache").glob("demo-*.so")) == built  # reused, not rebuilt


@needs_compiler
def test_changed_source_rebuilds(sources):
    (sources / "demo.c").write_text(ADD_ONE)
    native.library("demo")
    native._loaded.clear()
    (sources / "demo.c").write_text(ADD_ONE + "\nint other(void) { return 7; }\n")
    lib = native.library("demo")
    assert lib.other() == 7
    assert len(list((sources.parent / "cache").glob("demo-*.so"))) == 2


@needs_compiler
def test_broken_source_falls_back_with_reason(sources):
    (sources / "broken.c").write_text("this is not C")
    assert native.library("broken") is None
    assert "broken.c" in native.unavailable_reason("broken")
    assert not list((sources.parent / "cache").glob("*.tmp"))


def test_missing_compiler_falls_back(sources, monkeypatch):
    (sources / "demo.c").write_text(ADD_ONE)
    monkeypatch.setenv("CARRACK_CC", str(sources / "no-such-cc"))
    assert native.library("demo") is None
    assert "no-such-cc" in native.unavailable_reason("demo")


def test_turned_off(sources, monkeypatch):
    (sources / "demo.c").write_text(ADD_ONE)
    monkeypatch.setenv("CARRACK_NATIVE", "0")
    assert native.library("demo") is None
    assert "CARRACK_NATIVE" in native.unavailable_reason("demo")


@needs_compiler
def test_source_flags(sources):
    (sources / "flagged.c").write_text("// carrack-cflags: -DANSWER=42\nint answer(void) { return ANSWER; }\n")
    assert native.library("flagged").answer() == 42


def test_data_address_matches_numpy():
    """The fast address read agrees with numpy's for arrays, views, offsets, empty and zero-stride arrays and
    subclasses (which take numpy's own path)."""
    base = np.arange(100, dtype=np.float32)
    arrays = [base, base[7:], base[::3], base.reshape(10, 10).T, np.empty((0, 3)), np.broadcast_to(base[5:6], (4, 4)),
              base.view(np.uint8)[1:], base[1:2],
              np.ma.masked_array(base), np.zeros((), np.int64)]
    for a in arrays:
        assert native.data_address(a) == a.ctypes.data
