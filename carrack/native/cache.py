"""The directory of libraries compiled at run time: used only when only this user can write to it.

A library loaded from a directory that another user can write to runs that user's code in this process (its
constructor runs at load). So before every build and every load the directory and each of its parents is checked:
the directory itself must be this user's and writable by no one else; a parent must belong to this user or root
and be writable by no one else, unless it has the sticky bit (/tmp), where others cannot rename what is ours.
Directories created here are created private (0700). Builds of one library are serialized with a file lock.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


def default_cache_dir() -> Path:
    """$CARRACK_CACHE_DIR, else $XDG_CACHE_HOME/carrack/native (~/.cache/carrack/native)."""
    explicit = os.environ.get("CARRACK_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "carrack" / "native"


def candidate_dirs() -> list[Path]:
    """Where a runtime build may go, in order: an explicit $CARRACK_CACHE_DIR only, else the user cache, then a
    per-user directory in the temporary directory (accepted only if it passes the same checks)."""
    if os.environ.get("CARRACK_CACHE_DIR"):
        return [default_cache_dir()]
    candidates = [default_cache_dir()]
    with contextlib.suppress(OSError, FileNotFoundError):  # gettempdir raises when no temporary directory is usable
        candidates.append(Path(tempfile.gettempdir()) / f"carrack-native-{_uid()}")
    return candidates


def private_cache_dir() -> tuple[Path | None, str]:
    """The first candidate directory that is safe (created if missing), or None and why none is."""
    problems = []
    for directory in candidate_dirs():
        problem = ensure_private_dir(directory)
        if problem is None:
            return directory, f"{directory} (owned by this user, writable only by it)"
        problems.append(problem)
    return None, "no safe cache directory: " + "; ".join(problems)


def ensure_private_dir(directory: Path) -> str | None:
    """Create `directory` (and missing parents) private to this user; None when it is safe, else why it is not."""
    directory = Path(os.path.abspath(directory))
    missing = []
    existing = directory
    while not os.path.lexists(existing):
        missing.append(existing)
        existing = existing.parent
    problem = unsafe_reason(existing, leaf=not missing)
    if problem:
        return problem
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            return f"cannot create {path}: {exc.strerror or exc}"
        problem = _unsafe_self(path, leaf=True)  # each parent created for it is held to the directory's own rule
        if problem:
            return problem
    return unsafe_reason(directory, leaf=True)


def inspect(directory: Path) -> str:
    """How `directory` would fare as the cache, without creating anything (for `carrack doctor`)."""
    directory = Path(os.path.abspath(directory))
    if os.path.lexists(directory):
        return unsafe_reason(directory) or "safe (this user's, writable only by it)"
    existing = directory.parent
    while not os.path.lexists(existing):
        existing = existing.parent
    problem = unsafe_reason(existing, leaf=False)
    if problem:
        return f"not usable: {problem}"
    if not os.access(existing, os.W_OK):
        return f"not usable: cannot create it ({existing} is not writable)"
    return "does not exist yet (would be created private, mode 700, on the first runtime build)"


def unsafe_reason(directory: Path, leaf: bool = True) -> str | None:
    """Why loading from `directory` is unsafe (None when it is safe): checked before every build and load."""
    directory = Path(os.path.abspath(directory))
    problem = _unsafe_self(directory, leaf=leaf)
    if problem:
        return problem
    real = Path(os.path.realpath(directory))
    for parent in [real, *real.parents][1:]:
        problem = _unsafe_self(parent, leaf=False)
        if problem:
            return problem
    return None


def unsafe_file_reason(path: Path) -> str | None:
    """Why loading the library file at `path` is unsafe (None when it is this user's and writable only by it)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"cannot inspect {path}: {exc.strerror or exc}"
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file"
    if info.st_uid != _uid():
        return f"{path} is owned by uid {info.st_uid}, not this user (uid {_uid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _unsafe_self(path: Path, leaf: bool) -> str | None:
    try:
        info = os.lstat(path) if leaf else os.stat(path)
    except OSError as exc:
        return f"cannot inspect {path}: {exc.strerror or exc}"
    if leaf and stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    owners = (_uid(),) if leaf else (_uid(), 0)
    if info.st_uid not in owners:
        return f"{path} is owned by uid {info.st_uid}, not this user (uid {_uid()})"
    writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and (leaf or not info.st_mode & stat.S_ISVTX):
        return f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


@contextlib.contextmanager
def build_lock(directory: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock on `name` in `directory` (one builder at a time; the others wait, then reuse)."""
    if sys.platform == "win32":  # pragma: no cover - no fcntl; builds still land atomically by rename
        yield
        return
    import fcntl

    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(directory / f".{name}.lock", flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0
