"""Native kernels: small C files compiled on this machine at first use, loaded with ctypes.

numpy has no integer GEMM and pays a memory pass per call, so the kernels where that decides speed (the int8 GEMM of
quantized models, depthwise convolution, row-wise softmax and normalization) have a C version next to their numpy
one. Each ``carrack/native/<name>.c`` is built on its own with the system C compiler (``cc``, or ``$CARRACK_CC``)
for this CPU (``-march=native``: the library never leaves the machine that built it) into a cache directory, keyed
by the source, the compiler, the flags and the CPU, so a rebuild happens only when one of them changes.

Nothing here is required: without a compiler, when a build fails, or with ``CARRACK_NATIVE=0``, ``library(name)``
returns None and the kernels keep their numpy path, which computes the same results (the tests run both).
ctypes releases the GIL during a call, so native kernels run concurrently with other threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np

log = logging.getLogger("carrack.native")

SOURCE_DIR = Path(__file__).resolve().parent
BASE_FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-fno-strict-aliasing")
#: a source may ask for more flags on a line of its own: ``// carrack-cflags: -ffast-math``
FLAGS_MARKER = "// carrack-cflags:"

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_reasons: dict[str, str] = {}


def enabled() -> bool:
    """False when the user turned native kernels off with CARRACK_NATIVE=0."""
    return os.environ.get("CARRACK_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def library(name: str) -> ctypes.CDLL | None:
    """The compiled ``<name>.c`` (built on first use), or None when native kernels are off or it cannot be built."""
    if not enabled():
        return None
    lib = _loaded.get(name)
    if lib is not None or name in _loaded:
        return lib
    with _lock:
        fresh = name not in _loaded
        if fresh:
            _loaded[name] = _build_and_load(name)
    lib = _loaded[name]
    if fresh and lib is not None and name != "threadpool":
        from carrack.native.intra_op import attach_pool

        attach_pool(name, lib, library("threadpool"))
    return lib


def unavailable_reason(name: str) -> str | None:
    """Why `library(name)` is None (None when it loaded, or was never asked for)."""
    if not enabled():
        return "native kernels are turned off (CARRACK_NATIVE=0)"
    return _reasons.get(name)


def status() -> dict[str, str]:
    """Every native source and whether it is loaded here (for `carrack info` and bug reports)."""
    out = {}
    for source in sorted(SOURCE_DIR.glob("*.c")):
        lib = library(source.stem)
        out[source.stem] = "loaded" if lib is not None else f"numpy fallback ({unavailable_reason(source.stem)})"
    return out


def _data_field_reader():
    """A reader of an ndarray's data pointer straight from its C struct (numpy's PyArrayObject puts `data` right
    after the object header): ~0.1 us against ~0.8 us for `a.ctypes.data`, which builds a helper object per call;
    native calls on small layers pay that several times each. Checked here against `ctypes.data` on arrays, views
    and offsets; None (use `ctypes.data`) where the layout differs, e.g. an interpreter with a larger header."""
    offset = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)
    read = ctypes.c_size_t.from_address
    base = np.arange(64, dtype=np.float32)
    probes = [base, base[3:], base[1::2], base.reshape(8, 8)[:, 2:].T, np.empty(0), np.float64(1.0) * base[:5]]
    try:
        if all(read(id(a) + offset).value == a.ctypes.data for a in probes):
            return lambda a: read(id(a) + offset).value
    except (ValueError, OSError):  # pragma: no cover - an interpreter that does not allow it
        pass
    return None  # pragma: no cover


_read_data_field = _data_field_reader()


def data_address(array: np.ndarray) -> int:
    """The address of an ndarray's first element."""
    if type(array) is np.ndarray and _read_data_field is not None:
        return _read_data_field(array)
    return array.ctypes.data


def pointer(array: np.ndarray | None) -> ctypes.c_void_p:
    """The address of an array's first element (NULL for None) to pass to a native function."""
    return ctypes.c_void_p(None if array is None else data_address(array))


# -- building ----------------------------------------------------------------------------------------------------------
def compiler() -> str | None:
    """The C compiler to use: $CARRACK_CC, else cc/gcc/clang on PATH."""
    chosen = os.environ.get("CARRACK_CC")
    if chosen:
        return chosen
    for candidate in ("cc", "gcc", "clang"):
        found = shutil.which(candidate)
        if found:
            return found
    return None


def cache_dir() -> Path:
    """Where compiled libraries live: $CARRACK_CACHE_DIR, else $XDG_CACHE_HOME/carrack/native (~/.cache/...)."""
    explicit = os.environ.get("CARRACK_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "carrack" / "native"


def _build_and_load(name: str) -> ctypes.CDLL | None:
    source = SOURCE_DIR / f"{name}.c"
    if not source.is_file():
        _reasons[name] = f"no native source {source.name}"
        return None
    cc = compiler()
    if cc is None:
        _reasons[name] = "no C compiler found (set CARRACK_CC or install cc)"
        return None
    text = source.read_text()
    flags = list(BASE_FLAGS) + _arch_flags() + _extra_flags(text)
    headers = [h.read_text() for h in sorted(SOURCE_DIR.glob("*.h"))]  # included by the sources (threadpool.h)
    key = hashlib.sha256("\0".join([text, *headers, cc, _compiler_version(cc), *flags, _cpu_fingerprint()]).encode())
    target = _writable_cache() / f"{name}-{key.hexdigest()[:20]}{_suffix()}"
    if not target.exists():
        error = _compile(cc, source, flags, target)
        if error:
            _reasons[name] = error
            log.warning("carrack: native kernel %s unavailable, using numpy: %s", name, error)
            return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        _reasons[name] = f"cannot load {target}: {exc}"
        return None


def _compile(cc: str, source: Path, flags: list[str], target: Path) -> str | None:
    """Compile into a private temporary file, then rename it into place (atomic for concurrent builders)."""
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        result = subprocess.run([cc, *flags, str(source), "-o", temporary, "-lm"], capture_output=True, text=True,
                                timeout=300)
        if result.returncode != 0:
            return f"{Path(cc).name} failed on {source.name}: {result.stderr.strip()[-2000:]}"
        os.replace(temporary, target)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run {cc}: {exc}"
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _writable_cache() -> Path:
    for directory in (cache_dir(), Path(tempfile.gettempdir()) / f"carrack-native-{os.getuid()}"):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if os.access(directory, os.W_OK):
                return directory
        except OSError:
            continue
    return Path(tempfile.mkdtemp(prefix="carrack-native-"))


def _extra_flags(text: str) -> list[str]:
    return [flag for line in text.splitlines() if line.startswith(FLAGS_MARKER)
            for flag in line[len(FLAGS_MARKER):].split()]


def _arch_flags() -> list[str]:
    # the library is built for, and only ever loaded on, this machine (the cache key holds the CPU)
    return ["-march=native"] if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64") else []


def _suffix() -> str:
    return ".dll" if sys.platform == "win32" else ".dylib" if sys.platform == "darwin" else ".so"


_versions: dict[str, str] = {}


def _compiler_version(cc: str) -> str:
    if cc not in _versions:
        try:
            _versions[cc] = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            _versions[cc] = ""
    return _versions[cc]


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


# -- weights prepared once per session -------------------------------------------------------------------------------
_prepared_lock = threading.Lock()
_prepared: dict[tuple, tuple[tuple, object]] = {}


def prepared(tag: str, arrays: tuple, build):
    """`build()` once for these exact constant arrays: the kernels of a session's programs (one per input-shape
    signature) share one packed weight instead of packing it per program. The entry is dropped with its arrays."""
    key = (tag,) + tuple(id(a) for a in arrays)
    hit = _prepared.get(key)
    if hit is not None and all(ref() is a for ref, a in zip(hit[0], arrays)):
        return hit[1]
    value = build()
    try:
        refs = tuple(weakref.ref(a, lambda _, key=key: _prepared.pop(key, None)) for a in arrays)
    except TypeError:  # something that cannot be weakly referenced: not cached
        return value
    with _prepared_lock:
        _prepared[key] = (refs, value)
    return value


def prepared_nbytes() -> int:
    """Bytes held by prepared (packed) weights now, over every live session."""
    with _prepared_lock:
        values = [value for _, value in _prepared.values()]
    return sum(_nbytes(v) for v in values)


def _nbytes(obj, depth: int = 3) -> int:
    if isinstance(obj, np.ndarray):
        return obj.nbytes if obj.base is None or not isinstance(obj.base, np.ndarray) else 0
    if depth == 0 or obj is None:
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o, depth - 1) for o in obj)
    return sum(_nbytes(o, depth - 1) for o in vars(obj).values()) if hasattr(obj, "__dict__") else 0


# -- threads -----------------------------------------------------------------------------------------------------------
#: threads(): how many threads a native kernel may split its work over now: the running session's
#: intra_op_num_threads (per run and per Python thread), else one per core
from carrack.native.intra_op import threads as threads  # noqa: E402
