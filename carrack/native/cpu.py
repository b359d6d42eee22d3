"""The CPU features the kernel variants need, and the variant this process loads.

Read with cpuid by the small probe library built with the kernels (it also checks that the operating system
enables the AVX and AVX-512 registers), else from /proc/cpuinfo (Linux reports only what the kernel enables).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from carrack.native import variants

VARIANT_ENV = "CARRACK_NATIVE_VARIANT"


def targets_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.lru_cache(maxsize=4)
def cpu_features(prebuilt_dir: Path) -> tuple[frozenset[str], str]:
    """The features seen, and where they were read (the probe library in `prebuilt_dir`, or /proc/cpuinfo)."""
    probe = prebuilt_dir / variants.library_filename(variants.CPU_PROBE, "portable")
    if probe.is_file() and targets_x86():
        try:
            lib = ctypes.CDLL(str(probe))
            buffer = ctypes.create_string_buffer(1024)
            lib.carrack_cpu_features.argtypes = [ctypes.c_char_p, ctypes.c_int]
            lib.carrack_cpu_features.restype = ctypes.c_int
            if lib.carrack_cpu_features(buffer, len(buffer)) >= 0:
                return frozenset(buffer.value.decode().split()), "cpuid, by carrack's probe library"
        except (OSError, AttributeError):
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split()), "/proc/cpuinfo"
    except OSError:
        pass
    return frozenset(), "nothing (no probe library, no /proc/cpuinfo): assuming the baseline"


@dataclass(frozen=True)
class Selection:
    variant: variants.Variant
    why: str


def select_variant(features: frozenset[str], available: set[str] | None) -> Selection:
    """The variant to load: $CARRACK_NATIVE_VARIANT when the CPU supports it, else the best one it supports
    among `available` (the variants built; None: any)."""
    x86 = targets_x86()
    forced = os.environ.get(VARIANT_ENV, "").strip()
    best = variants.best_supported(features, x86, available)
    if forced:
        variant = variants.by_name(forced, x86)
        names = ", ".join(v.name for v in variants.variants(x86))
        if variant is None:
            return Selection(best, f"{VARIANT_ENV}={forced} is not a variant here ({names}); using {best.name}")
        lacking = sorted(variant.cpu_features - features)
        if lacking:
            return Selection(best, f"{VARIANT_ENV}={forced} needs {', '.join(lacking)}, which this CPU lacks; "
                                   f"using {best.name}")
        if available is not None and forced not in available:
            return Selection(best, f"{VARIANT_ENV}={forced} was not built; using {best.name}")
        return Selection(variant, f"chosen with {VARIANT_ENV}")
    better = [v.name for v in variants.variants(x86)[:variants.variants(x86).index(best)]]
    if not better:
        return Selection(best, "the best variant, and this CPU supports it")
    unsupported = [v for v in better if not variants.by_name(v, x86).cpu_features <= features]
    if unsupported:
        lacking = sorted(set().union(*(variants.by_name(v, x86).cpu_features for v in unsupported)) - features)
        return Selection(best, f"this CPU lacks {', '.join(lacking)} (needed by {', '.join(unsupported)})")
    return Selection(best, f"{', '.join(better)} not built")
