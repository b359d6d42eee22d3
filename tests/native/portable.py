"""A kernel library built without intrinsics (CARRACK_PORTABLE): the plain C that other targets compile."""

from __future__ import annotations

import ctypes
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
