"""The runtime-build cache: a library is loaded only from a directory no other user can write to (a planted
library's constructor never runs), and processes building the same library at once compile it once."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import carrack
from carrack import native
from carrack.native import cache

ADD_ONE = """
#include <stdint.h>
void add_one(float *x, int64_t n) { for (int64_t i = 0; i < n; i++) x[i] += 1.0f; }
"""
#: what an attacker plants: its constructor runs the moment the library is loaded
PLANTED = """
#include <stdio.h>
#include <stdint.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("constructor ran", f); fclose(f); }
}
void add_one(float *x, int64_t n) { (void)x; (void)n; }
"""
OTHER_UID = 4242
REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(native.compiler() is None or not hasattr(os, "getuid"),
                                reason="needs a C compiler (to build the libraries) and POSIX users")
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="handing a directory to another user (os.chown) needs root")


@pytest.fixture
def demo(tmp_path, monkeypatch):
    """A source of its own, built once into a private cache: returns the file name a build of it gets."""
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    (source_dir / "demo.c").write_text(ADD_ONE)
    monkeypatch.setattr(native, "SOURCE_DIR", source_dir)
    monkeypatch.delenv("CARRACK_NATIVE", raising=False)
    monkeypatch.setenv("CARRACK_CACHE_DIR", str(tmp_path / "private"))
    _forget(monkeypatch)
    assert native.library("demo") is not None, native.unavailable_reason("demo")
    name = Path(native.origin("demo").rsplit(": ", 1)[1]).name
    _forget(monkeypatch)
    return name


def _forget(monkeypatch):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_reasons", {})


def _plant(directory: Path, name: str, marker: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    source = directory.parent / "planted.c"
    source.write_text(PLANTED.replace("MARKER", f'"{marker}"'))
    target = directory / name
    subprocess.run([native.compiler(), "-shared", "-fPIC", str(source), "-o", str(target)], check=True)
    return target


def _load_from(directory: Path, monkeypatch) -> object:
    monkeypatch.setenv("CARRACK_CACHE_DIR", str(directory))
    return native.library("demo")


def test_control_a_planted_library_in_a_private_directory_runs(demo, tmp_path, monkeypatch):
    """The attack is real: loaded from a directory that passes the checks, the planted constructor runs (which
    is what the refusals below must prevent)."""
    marker = tmp_path / "marker"
    directory = tmp_path / "mine"
    directory.mkdir(mode=0o700)
    _plant(directory, demo, marker).chmod(0o700)
    assert _load_from(directory, monkeypatch) is not None
    assert marker.read_text() == "constructor ran"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757])
def test_directory_writable_by_others_is_refused(demo, tmp_path, monkeypatch, mode):
    marker = tmp_path / "marker"
    directory = tmp_path / "shared"
    _plant(directory, demo, marker)
    directory.chmod(mode)
    with pytest.warns(carrack.PerformanceWarning, match="writable by other users"):
        assert _load_from(directory, monkeypatch) is None
    assert not marker.exists()


def test_planted_file_writable_by_others_is_refused(demo, tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    directory = tmp_path / "mine"
    directory.mkdir(mode=0o700)
    _plant(directory, demo, marker).chmod(0o766)
    with pytest.warns(carrack.PerformanceWarning, match="refusing to load"):
        assert _load_from(directory, monkeypatch) is None
    assert not marker.exists()


@as_root
def test_directory_of_another_user_is_refused(demo, tmp_path, monkeypatch):
    """The issue's attack: another user made the cache directory, world-writable, and planted the library."""
    marker = tmp_path / "marker"
    directory = tmp_path / "shared"
    planted = _plant(directory, demo, marker)
    os.chown(planted, OTHER_UID, OTHER_UID)
    os.chown(directory, OTHER_UID, OTHER_UID)
    directory.chmod(0o777)
    with pytest.warns(carrack.PerformanceWarning, match=f"owned by uid {OTHER_UID}"):
        assert _load_from(directory, monkeypatch) is None
    assert not marker.exists()


@as_root
def test_temporary_fallback_of_another_user_is_refused(demo, tmp_path, monkeypatch):
    """HOME unusable, so the cache falls back to <tmp>/carrack-native-<uid>, which another user created first."""
    marker = tmp_path / "marker"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.delenv("CARRACK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))  # cannot be created
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    shared_tmp.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    directory = shared_tmp / f"carrack-native-{os.getuid()}"
    planted = _plant(directory, demo, marker)
    os.chown(planted, OTHER_UID, OTHER_UID)
    os.chown(directory, OTHER_UID, OTHER_UID)
    directory.chmod(0o777)
    with pytest.warns(carrack.PerformanceWarning) as record:
        assert native.library("demo") is None
    message = str(record[0].message)
    assert str(directory) in message and f"owned by uid {OTHER_UID}" in message
    assert not marker.exists()


@as_root
def test_parent_another_user_can_write_is_refused(demo, tmp_path, monkeypatch):
    """Our own private directory inside one another user controls: they could swap it for theirs."""
    marker = tmp_path / "marker"
    parent = tmp_path / "theirs"
    directory = parent / "mine"
    _plant(directory, demo, marker).chmod(0o700)
    directory.chmod(0o700)
    os.chown(parent, OTHER_UID, OTHER_UID)
    parent.chmod(0o777)
    with pytest.warns(carrack.PerformanceWarning, match=f"{parent} is owned by uid {OTHER_UID}"):
        assert _load_from(directory, monkeypatch) is None
    assert not marker.exists()


def test_created_directories_are_private(tmp_path):
    old = os.umask(0o002)  # a umask that leaves new directories group-writable
    try:
        assert cache.ensure_private_dir(tmp_path / "a" / "b" / "c") is None
    finally:
        os.umask(old)
    for path in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


def test_symlinked_cache_directory_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    assert "symbolic link" in cache.ensure_private_dir(tmp_path / "link")


# -- concurrent builders ----------------------------------------------------------------------------------------------
WORKER = """
import os, sys, time
from pathlib import Path
from carrack import native
native.SOURCE_DIR = Path(sys.argv[1])
go = Path(sys.argv[2])
(go.parent / f"ready-{os.getpid()}").touch()
while not go.exists():
    time.sleep(0.01)
lib = native.library("demo")
print("loaded" if lib is not None else native.unavailable_reason("demo"))
"""


def test_cold_cache_built_by_four_processes_compiles_once(tmp_path):
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    (source_dir / "demo.c").write_text(ADD_ONE)
    log = tmp_path / "compilations"
    wrapper = tmp_path / "cc"  # records each compilation and makes it slow enough for the others to arrive
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *--version*) ;; *) echo "$$" >> "{log}"; sleep 1 ;; esac\n'
                       f'exec "{native.compiler()}" "$@"\n')
    wrapper.chmod(0o755)
    sync = tmp_path / "sync"
    sync.mkdir()
    env = {**os.environ, "CARRACK_CC": str(wrapper), "CARRACK_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(REPO_ROOT)}
    env.pop("CARRACK_NATIVE", None)
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(source_dir), str(sync / "go")], env=env,
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(4)]
    deadline = time.monotonic() + 120
    while len(list(sync.glob("ready-*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    (sync / "go").touch()  # all four ask for the library at the same moment
    results = [worker.communicate(timeout=300) for worker in workers]
    assert [out.strip() for out, _ in results] == ["loaded"] * 4, results
    assert len(log.read_text().split()) == 1
    assert len(list((tmp_path / "cache").glob("demo-*.so"))) == 1
