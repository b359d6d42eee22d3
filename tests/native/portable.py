"""A kernel library built without intrinsics (CARRACK_PORTABLE): the plain C that other targets compile."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import pytest

from carrack import native


def portable_build(name: str, directory: Path) -> ctypes.CDLL:
    """`<name>.c` (and the headers it includes) compiled with -DCARRACK_PORTABLE into `directory`."""
    if native.compiler() is None:
        pytest.skip("no C compiler")
    source = (native.SOURCE_DIR / f"{name}.c").read_text()
    (directory / f"{name}.c").write_text("// carrack-cflags: -DCARRACK_PORTABLE\n" + source)
    for header in native.SOURCE_DIR.glob("*.h"):  # threadpool.h
        (directory / header.name).write_text(header.read_text())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "SOURCE_DIR", directory)
        patch.setenv("CARRACK_CACHE_DIR", str(directory / "cache"))
        patch.setattr(native, "_loaded", {})
        patch.setattr(native, "_reasons", {})
        lib = native.library(name)
    assert lib is not None, native._reasons
    return lib


def native_and_portable(name: str, loaded: Callable[[], ctypes.CDLL | None], machine: str, unavailable: str):
    """The `portable_library` and `build` fixtures of a kernel module's tests: `build` runs each test on the
    library as built for this machine (`machine` says what it has), then on `name`'s portable build, which it
    puts in native's loaded libraries; a test skips with `unavailable` where `loaded()` finds no library."""

    @pytest.fixture(scope="module", name="portable_library")
    def portable_library(tmp_path_factory):
        return portable_build(name, tmp_path_factory.mktemp("portable"))

    @pytest.fixture(params=["native", "portable"], name="build")
    def build(request, monkeypatch):
        if loaded() is None:
            pytest.skip(unavailable)
        if request.param == "portable":
            monkeypatch.setattr(native, "_loaded", {name: request.getfixturevalue("portable_library")})
        return request.param

    build.__doc__ = f"The library as built for this machine ({machine}), then its portable build."
    return portable_library, build
