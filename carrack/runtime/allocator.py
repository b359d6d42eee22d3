"""Keep the C allocator from handing freed activation memory back to the OS after every node.

numpy allocates each result with malloc. glibc serves large blocks with fresh mmaps and trims the heap's free top
back to the OS, so a model whose activations are a few MB each re-faults its working set on every run (mobilenet:
~2,400 page faults and ~15% of the run in the kernel). With a fixed mmap threshold (32 MB, glibc's maximum) and a
64 MB trim threshold, blocks below 32 MB come from the heap and up to 64 MB of freed heap stays mapped for the
next run: what onnxruntime's CPU memory arena does. The setting is process-wide; it is applied once, only where
the C library is glibc.
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import math
import os
import platform
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

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


# --- bounded allocations -------------------------------------------------------------------------------------------
# Every large allocation a run makes (its arena, and kernel outputs whose size comes from run-time data or from
# attributes: ConstantOfShape, Expand, Tile, Range, Pad, Resize, OneHot, ...) is first checked here against the
# session's SessionOptions.memory_limit_bytes and against the machine's physical memory, so that a hostile or
# malformed model gets an error naming the node, the value and the size instead of a MemoryError or a swapping
# machine.

#: the memory limit of the session whose run is executing in this thread (0: none); see with_memory_limit
MEMORY_LIMIT: contextvars.ContextVar[int] = contextvars.ContextVar("carrack_memory_limit", default=0)
#: kernel results below this many bytes are not checked (checking costs more than they can do harm)
CHECK_THRESHOLD = 1 << 20


def with_memory_limit(limit_of: Callable[[Any], int]) -> Callable:
    """Decorates a session's run method: while it runs, allocations in this thread (and the pool threads it hands
    nodes to) are checked against `limit_of(session)`; afterwards the previous limit is back."""
    def decorate(run: Callable) -> Callable:
        @functools.wraps(run)
        def limited(self: Any, *args: Any, **kwargs: Any) -> Any:
            token = MEMORY_LIMIT.set(int(limit_of(self) or 0))
            try:
                return run(self, *args, **kwargs)
            finally:
                MEMORY_LIMIT.reset(token)
        return limited
    return decorate


@functools.lru_cache(maxsize=1)
def physical_memory_bytes() -> int:
    """The machine's physical memory (the sanity bound of any one allocation); 2**47 where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 47


def check_allocation(nbytes: int, what: str, limit: int | None = None) -> None:
    """Refuse to allocate `nbytes` for `what` (a description naming the node and the value) when that is more than
    the memory limit (MemoryLimitExceeded; `limit`, or the running session's) or more than the machine's physical
    memory (InvalidArgument): called before the allocation."""
    from carrack.errors import InvalidArgument, MemoryLimitExceeded

    nbytes = int(nbytes)
    limit = MEMORY_LIMIT.get() if limit is None else limit
    if limit and nbytes > limit:
        raise MemoryLimitExceeded(f"{what} needs {nbytes:,} bytes ({_human(nbytes)}), more than "
                                  f"SessionOptions.memory_limit_bytes = {limit:,}")
    physical = physical_memory_bytes()
    if nbytes > physical:
        raise InvalidArgument(f"{what} needs {nbytes:,} bytes ({_human(nbytes)}), more than this machine's "
                              f"physical memory ({_human(physical)})")


def check_shape(shape: Sequence[int], dtype: Any, what: str | Callable[[], str]) -> None:
    """check_allocation for an array of `shape` and `dtype`, in exact integers (no numpy overflow); shapes with a
    negative dim are refused too, and small arrays pass without a look at the limit. `what` names the value in the
    errors; a kernel passes a function that makes the name, so that its many small results never format one."""
    if len(shape) <= 64 and min(shape, default=0) >= 0:
        # in Python ints: a product of numpy integer dims may wrap around to a small size
        if math.prod(map(int, shape)) * np.dtype(dtype).itemsize < CHECK_THRESHOLD:
            return
    from carrack.errors import InvalidArgument

    what = what if isinstance(what, str) else what()
    dims = [int(d) for d in shape]
    if len(dims) > 64:
        raise InvalidArgument(f"{what} would have rank {len(dims)}; arrays have at most 64 dims")
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"{what} would have a negative dim: shape {dims}")
    nbytes = math.prod(dims) * np.dtype(dtype).itemsize
    if nbytes >= CHECK_THRESHOLD:
        check_allocation(nbytes, f"{what} (shape {dims}, {np.dtype(dtype).name})")


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{nbytes} bytes"
