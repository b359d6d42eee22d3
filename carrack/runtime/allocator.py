"""Keep the C allocator from handing freed activation memory back to the OS after every node.

numpy allocates each result with malloc. glibc serves large blocks with fresh mmaps and trims the heap's free top
back to the OS, so a model whose activations are a few MB each re-faults its working set on every run (mobilenet:
~2,400 page faults and ~15% of the run in the kernel). With a fixed mmap threshold (32 MB, glibc's maximum) and a
64 MB trim threshold, blocks below 32 MB come from the heap and up to 64 MB of freed heap stays mapped for the
next run: what onnxruntime's CPU memory arena does. The setting is process-wide; it is applied once, only where
the C library is glibc.
"""

from __future__ import annotations

import ctypes
import platform
import threading

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20

_lock = threading.Lock()
_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Tune glibc's malloc as described above (once per process); returns whether it is in effect."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        return _applied


def _mallopt(param: int, value: int) -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(param, value) == 1
