"""The instruction-set variants every native kernel is built in, and which one a CPU can run.

Shared by the build (``setup.py`` loads this file by path, before carrack or numpy can be imported: stdlib only)
and the loader in ``carrack/native/__init__.py``. Each ``carrack/native/<name>.c`` is compiled once per variant
into ``carrack/native/_kernels/<name>-<variant>.so``; at import the best variant whose CPU features are all
present is loaded. The sources pick their code paths from the compiler's macros (``__AVX512F__``, ``__AVX2__``,
``__AVX512VNNI__``...), so the variants are the same C compiled for three targets.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass

#: compile flags of every native build (a runtime build adds -shared; the package build links separately)
BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-fno-strict-aliasing")
#: a source may ask for more flags on a line of its own: ``// carrack-cflags: -ffast-math``
FLAGS_MARKER = "// carrack-cflags:"
#: where the package build puts the libraries, relative to the carrack/native package
PREBUILT_SUBDIR = "_kernels"
MANIFEST_NAME = "manifest.json"
#: the probe of the CPU's features (built in the portable variant only, from native/probe/)
CPU_PROBE = "cpu_features"


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    #: the CPU features it needs, as Linux's /proc/cpuinfo names them
    cpu_features: frozenset[str]
    summary: str


_AVX2_FEATURES = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"})  # x86-64-v3 (abm: lzcnt)
_AVX512_FEATURES = _AVX2_FEATURES | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}

#: best first; the microarchitecture levels (x86-64-v3/v4) name exactly the features checked, unlike -march=<cpu>,
#: which would also allow instructions (VBMI, GFNI, ...) that some CPUs with these features lack
X86_VARIANTS = (
    Variant("avx512vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=icelake-server"), _AVX512_FEATURES,
            "AVX-512 (F, BW, CD, DQ, VL) with VNNI"),
    Variant("avx2", ("-march=x86-64-v3", "-mtune=haswell"), _AVX2_FEATURES, "AVX2 with FMA (x86-64-v3)"),
    Variant("portable", ("-march=x86-64", "-mtune=generic"), frozenset(), "x86-64 baseline (SSE2)"),
)
GENERIC_VARIANTS = (Variant("portable", (), frozenset(), "the compiler's default target"),)


def variants(x86: bool) -> tuple[Variant, ...]:
    return X86_VARIANTS if x86 else GENERIC_VARIANTS


def by_name(name: str, x86: bool) -> Variant | None:
    return next((v for v in variants(x86) if v.name == name), None)


def best_supported(features: set[str] | frozenset[str], x86: bool, available: set[str] | None = None) -> Variant:
    """The best variant whose features the CPU has (among `available`, the built ones, when given)."""
    for variant in variants(x86):
        if variant.cpu_features <= features and (available is None or variant.name in available):
            return variant
    return variants(x86)[-1]


def source_flags(text: str) -> list[str]:
    """The extra flags a source asks for with ``// carrack-cflags:`` lines."""
    return [flag for line in text.splitlines() if line.startswith(FLAGS_MARKER)
            for flag in line[len(FLAGS_MARKER):].split()]


def headers_text(directory, source_text: str = "") -> str:
    """The headers next to the sources (``*.h``), which every source may include, and the sources that
    `source_text` includes whole (``#include "packconv.c"``): part of what a build of it is of."""
    included = sorted(set(re.findall(r'^#include "(\w+\.c)"', source_text, re.MULTILINE)))
    paths = [*sorted(directory.glob("*.h")), *(directory / name for name in included)]
    return "".join(f"\0{path.name}\0{path.read_text()}" for path in paths)


def source_digest(text: str, headers: str = "") -> str:
    """What the manifest records of a source (and the headers beside it), to tell a library built from it from
    one built from older code."""
    return hashlib.sha256((text + headers).encode()).hexdigest()


def library_suffix() -> str:
    return ".dll" if sys.platform == "win32" else ".dylib" if sys.platform == "darwin" else ".so"


def library_filename(name: str, variant: str) -> str:
    return f"{name}-{variant}{library_suffix()}"
