"""Native kernels: small C files compiled when the package is built, loaded with ctypes.

numpy has no integer GEMM and pays a memory pass per call, so the kernels where that decides speed (the int8 GEMM of
quantized models, depthwise convolution, row-wise softmax and normalization) have a C version next to their numpy
one. ``pip install`` compiles each ``carrack/native/<name>.c`` in several instruction-set variants (``setup.py``,
``variants.py``: portable, AVX2+FMA, AVX-512 with VNNI) into ``_kernels/<name>-<variant>.so``; ``library(name)``
loads the best variant this CPU supports (``cpu.py``). No compiler is needed at run time.

Compiling at run time is left for a source with no matching prebuilt library (a source checkout that was not built,
a source edited since: the alternative would be numpy, or stale code), into a private cache directory (``cache.py``,
one build at a time under a file lock). An opt-in ``-march=native`` rebuild was measured and not kept: on the
AVX-512 VNNI machine the kernels are tuned on it was no faster than the prebuilt variant (ResNet-50 slower).

Nothing here is required: with ``CARRACK_NATIVE=0``, or when no library can be had, ``library(name)`` returns None
and the kernels keep their numpy path, which computes the same results (the tests run both); the second case warns
once with ``carrack.PerformanceWarning``. ctypes releases the GIL during a call, so native kernels run concurrently
with other threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import subprocess
import threading
import warnings
import weakref
from pathlib import Path

import numpy as np

from carrack.errors import PerformanceWarning
from carrack.native import cache, cpu, variants
from carrack.native.variants import BASE_FLAGS, FLAGS_MARKER  # noqa: F401 - part of this module's interface

log = logging.getLogger("carrack.native")

SOURCE_DIR = Path(__file__).resolve().parent
#: the libraries built with the package, and their manifest.json
PREBUILT_DIR = SOURCE_DIR / variants.PREBUILT_SUBDIR
#: what running the numpy path instead costs (`carrack demo`, 2-core AVX-512 VNNI machine)
FALLBACK_COST = ("models that use it run several times slower on numpy (measured: the ResNet-50 demo 4.6-8x, "
                 "ShuffleNet 9x)")

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_reasons: dict[str, str] = {}


_OFF = ("0", "false", "no", "off")
#: os.environ's own mapping (bytes on POSIX): every kernel call asks `enabled()`, and os.environ.get encodes and
#: decodes on each call (about 1 us), which small models pay hundreds of times per run
_ENVIRON = getattr(os.environ, "_data", None)
_KEY = os.environ.encodekey("CARRACK_NATIVE") if _ENVIRON is not None else None


def enabled() -> bool:
    """False when the user turned native kernels off with CARRACK_NATIVE=0."""
    if _ENVIRON is None:
        return os.environ.get("CARRACK_NATIVE", "1").strip().lower() not in _OFF
    raw = _ENVIRON.get(_KEY)
    return raw is None or os.environ.decodevalue(raw).strip().lower() not in _OFF


_declared: dict[str, ctypes.CDLL] = {}


def declared_library(name: str, declare) -> ctypes.CDLL | None:
    """`library(name)` with `declare(lib)` (its functions' argtypes and restypes) run once per loaded library."""
    lib = library(name)
    if lib is not None and _declared.get(name) is not lib:
        declare(lib)
        _declared[name] = lib
    return lib


def signature_declarer(signatures: dict):
    """A `declared_library` declare function for {function name: (argtypes, restype)}."""
    def declare(lib: ctypes.CDLL) -> None:
        for name, (args, result) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
    return declare


def library(name: str) -> ctypes.CDLL | None:
    """The library of ``<name>.c`` (the prebuilt variant for this CPU), or None when native kernels are off or
    none can be had (then it warns once, with carrack.PerformanceWarning, and the numpy path runs)."""
    if not enabled():
        return None
    lib = _loaded.get(name)
    if lib is not None or name in _loaded:
        return lib
    with _lock:
        fresh = name not in _loaded
        if fresh:
            _loaded[name] = _load(name)
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


def origin(name: str) -> str | None:
    """Where `library(name)` came from: the variant, why that one, and the file (None when it did not load)."""
    return getattr(_loaded.get(name), "carrack_origin", None)


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


# -- loading and building -------------------------------------------------------------------------------------------
def compiler() -> str | None:
    """The C compiler for runtime builds: $CARRACK_CC, else cc/gcc/clang on PATH."""
    chosen = os.environ.get("CARRACK_CC")
    if chosen:
        return chosen
    for candidate in ("cc", "gcc", "clang"):
        found = shutil.which(candidate)
        if found:
            return found
    return None


def cache_dir() -> Path:
    """Where runtime builds go first: $CARRACK_CACHE_DIR, else $XDG_CACHE_HOME/carrack/native (~/.cache/...)."""
    return cache.default_cache_dir()


def manifest() -> dict:
    """What the package build compiled (``_kernels/manifest.json``; empty when the package was not built)."""
    try:
        return json.loads((PREBUILT_DIR / variants.MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}


def cpu_features() -> tuple[frozenset[str], str]:
    """The CPU features seen, and how they were read."""
    return cpu.cpu_features(PREBUILT_DIR)


def _load(name: str) -> ctypes.CDLL | None:
    try:
        lib, detail = _find_library(name)
    except Exception as exc:  # noqa: BLE001 - a kernel lookup must never fail a session: numpy computes the same
        lib, detail = None, f"unexpected {type(exc).__name__}: {exc}"
    if lib is None:
        _reasons[name] = detail
        warnings.warn(f"carrack: native kernel '{name}' unavailable, using its numpy path: {detail}. "
                      f"Expected cost: {FALLBACK_COST}.", PerformanceWarning, stacklevel=3)
    else:
        lib.carrack_origin = detail  # kept with the library: whoever swaps _loaded swaps both
    return lib


def _find_library(name: str) -> tuple[ctypes.CDLL | None, str]:
    """The library and where it came from, or None and why there is none."""
    source = SOURCE_DIR / f"{name}.c"
    text = source.read_text() if source.is_file() else None
    features, _ = cpu_features()
    entry = manifest().get("libraries", {}).get(name)
    headers = variants.headers_text(SOURCE_DIR, text or "")
    if entry is not None and (text is None or variants.source_digest(text, headers) == entry.get("source_sha256")):
        selection = cpu.select_variant(features, set(entry.get("variants", ())))
        path = PREBUILT_DIR / variants.library_filename(name, selection.variant.name)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            return None, f"cannot load {path}: {exc}"
        return lib, f"prebuilt {selection.variant.name} ({selection.why}): {path}"
    if text is None:
        return None, f"no native source {source.name} and no prebuilt library"
    why = "not built with the package" if entry is None else "its source changed since the package was built"
    selection = cpu.select_variant(features, None)
    return _runtime_build(name, text, selection.variant, f"{why}; {selection.variant.name}: {selection.why}")


def _runtime_build(name: str, text: str, variant: variants.Variant, why: str) -> tuple[ctypes.CDLL | None, str]:
    """Build `text` for `variant` into the private cache (once: other processes wait on the lock) and load it."""
    cc = compiler()
    if cc is None:
        return None, f"{why}, and no C compiler was found to build it (set CARRACK_CC or install cc)"
    flags = [*BASE_FLAGS, "-shared", f"-I{SOURCE_DIR}", *variant.flags, *variants.source_flags(text)]
    parts = [text, variants.headers_text(SOURCE_DIR, text), cc, _compiler_version(cc), *flags]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    directory, detail = cache.private_cache_dir()
    if directory is None:
        return None, f"{why}, and {detail}"
    target = directory / f"{name}-{variant.name}-{key}{variants.library_suffix()}"
    with cache.build_lock(directory, target.name):
        if not target.exists():
            log.info("carrack: building native kernel %s (%s) into %s", name, variant.name, directory)
            error = _compile(cc, SOURCE_DIR / f"{name}.c", text, flags, target)
            if error:
                return None, f"{why}, and the build failed: {error}"
    problem = cache.unsafe_reason(directory) or cache.unsafe_file_reason(target)  # checked again before loading
    if problem:
        return None, f"{why}; refusing to load {target.name}: {problem}"
    try:
        return ctypes.CDLL(str(target)), f"built at run time, {variant.name} ({why}): {target}"
    except OSError as exc:
        return None, f"cannot load {target}: {exc}"


def _compile(cc: str, source: Path, text: str, flags: list[str], target: Path) -> str | None:
    """Compile `text` (the source the key was computed from; its headers come from SOURCE_DIR with -I) into a
    private temporary file, then rename it into place (readers never see a partial file)."""
    stem = f"{target.stem}.{os.getpid()}"
    copy, temporary = target.parent / f"{stem}.c", target.parent / f"{stem}.tmp"
    try:
        copy.write_text(text)
        result = subprocess.run([cc, *flags, str(copy), "-o", str(temporary), "-lm"], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            return f"{Path(cc).name} failed on {source.name}: {result.stderr.strip()[-2000:]}"
        os.chmod(temporary, 0o700)
        os.replace(temporary, target)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run {cc}: {exc}"
    finally:
        for leftover in (copy, temporary):
            if leftover.exists():
                leftover.unlink()


_versions: dict[str, str] = {}


def _compiler_version(cc: str) -> str:
    if cc not in _versions:
        try:
            _versions[cc] = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            _versions[cc] = ""
    return _versions[cc]


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
