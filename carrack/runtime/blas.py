"""numpy's BLAS thread pool: read and limit it.

Uses threadpoolctl when installed, else the BLAS library's own setter found among the process's loaded libraries.
The pool is process-wide, so sessions do not change it: a run's intra_op_num_threads goes to carrack's own kernels
(carrack.native.intra_op), and the products of a run allowed fewer threads than this pool has are done there too.
`carrack bench` and the benchmarks limit it for a whole process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
from collections.abc import Callable, Iterator

import numpy as np  # noqa: F401 - loads the BLAS library whose functions are looked up here

# OpenBLAS builds name their thread setter differently (numpy wheels ship scipy-openblas with 64-bit ints)
_BLAS_THREAD_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                        "scipy_openblas_set_num_threads", "openblas_set_num_threads64_", "MKL_Set_Num_Threads")
_BLAS_THREAD_GETTERS = ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_",
                        "scipy_openblas_get_num_threads", "openblas_get_num_threads64_", "MKL_Get_Max_Threads")
_OPENBLAS_CONFIG_GETTERS = ("openblas_get_config", "scipy_openblas_get_config64_", "scipy_openblas_get_config",
                            "openblas_get_config64_")


def set_blas_threads(threads: int) -> bool:
    """Limit numpy's BLAS to `threads` threads from now on (carrack's matmuls and convolutions run there).

    Uses the BLAS library's own setter, found once among the loaded libraries, else threadpoolctl when installed.
    Returns whether a setter was found.
    """
    setter, _ = _blas_functions()
    if setter is not None:
        setter(threads)
        return True
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return False
    threadpool_limits(threads)
    return True


def blas_threads() -> int | None:
    """numpy's BLAS thread count now (None when it cannot be read)."""
    _, getter = _blas_functions()
    if getter is not None:
        return int(getter())
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    counts = [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]
    return counts[0] if counts else None


@functools.lru_cache(maxsize=1)
def _blas_functions() -> tuple[Callable[[int], None] | None, Callable[[], int] | None]:
    """The thread-count setter and getter of the BLAS library numpy loaded (looked up once: cheap to call)."""
    setter = getter = None
    for lib in _blas_libraries():
        for name in _BLAS_THREAD_SETTERS:
            if setter is None and getattr(lib, name, None) is not None:
                setter = getattr(lib, name)
                setter.argtypes = [ctypes.c_int]
                setter.restype = None
        for name in _BLAS_THREAD_GETTERS:
            if getter is None and getattr(lib, name, None) is not None:
                getter = getattr(lib, name)
                getter.argtypes = []
                getter.restype = ctypes.c_int
    return setter, getter


@functools.lru_cache(maxsize=1)
def openblas_version() -> tuple[int, ...] | None:
    """The version of the OpenBLAS numpy loaded, e.g. (0, 3, 31) (from its config string, "OpenBLAS 0.3.31..."),
    or None when numpy's BLAS is not OpenBLAS or does not say."""
    for lib in _blas_libraries():
        for name in _OPENBLAS_CONFIG_GETTERS:
            getter = getattr(lib, name, None)
            if getter is None:
                continue
            getter.argtypes, getter.restype = [], ctypes.c_char_p
            match = re.match(rb"OpenBLAS (\d+)\.(\d+)\.(\d+)", getter() or b"")
            return tuple(int(part) for part in match.groups()) if match else None
    return None


@contextlib.contextmanager
def limited_blas_threads(threads: int | None) -> Iterator[None]:
    """Run the block with numpy's BLAS limited to `threads` threads (no change when None), then restore it."""
    before = blas_threads() if threads else None
    changed = bool(threads) and before != threads and set_blas_threads(threads)
    try:
        yield
    finally:
        if changed and before:
            set_blas_threads(before)


def _blas_libraries() -> list[ctypes.CDLL]:
    libs = []
    for path in _loaded_libraries(("blas", "mkl")):
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libs


def _loaded_libraries(keywords: tuple[str, ...]) -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if any(k in os.path.basename(p).lower() for k in keywords))
