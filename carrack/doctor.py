"""``carrack doctor``: what this machine gives carrack, for users and bug reports.

The native kernel variant in use and why, the CPU features seen, numpy's BLAS and its threads, whether a C
compiler is there (needed only for runtime builds), and the runtime-build cache with its safety.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings

import numpy as np

import carrack
from carrack import native
from carrack.native import cache, cpu, variants


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("doctor", help="native kernel variant and why, CPU features, BLAS, compiler, cache safety")
    d.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    print("\n".join(report_lines()))
    return 0


def report_lines() -> list[str]:
    lines = [f"carrack {carrack.__version__}, Python {platform.python_version()}, numpy {np.__version__}, "
             f"{platform.system()} {platform.machine()}"]
    for section in (_kernel_lines, _cpu_lines, _blas_lines, _compiler_lines, _cache_lines):
        try:
            lines += section()
        except Exception as exc:  # noqa: BLE001 - a report that stops half-way helps no one
            lines.append(f"  ({section.__name__[1:-6]}: cannot tell: {type(exc).__name__}: {exc})")
    return lines


def native_summary() -> str:
    """One line on the native kernels (the end of `carrack demo`)."""
    states = native.status()
    loaded = [name for name, state in states.items() if state == "loaded"]
    kinds = sorted({(native.origin(name) or "").split(" (")[0] for name in loaded})
    if len(loaded) == len(states):
        return f"all {len(states)} loaded, {' / '.join(kinds)} ({', '.join(loaded)})"
    missing = {name: state for name, state in states.items() if state != "loaded"}
    return f"{len(loaded)} of {len(states)} loaded; " + "; ".join(f"{k}: {v}" for k, v in missing.items())


def _kernel_lines() -> list[str]:
    lines = ["native kernels:"]
    for name in ("CARRACK_NATIVE", cpu.VARIANT_ENV, "CARRACK_CC", "CARRACK_CACHE_DIR"):
        if os.environ.get(name):
            lines.append(f"  {name}={os.environ[name]}")
    built = native.manifest()
    if built:
        shipped = sorted({v for entry in built.get("libraries", {}).values() for v in entry.get("variants", ())})
        lines.append(f"  built with the package by {built.get('compiler') or '?'}: variants {', '.join(shipped)} "
                     f"({native.PREBUILT_DIR})")
    else:
        lines.append(f"  not built with the package (no {native.PREBUILT_DIR / variants.MANIFEST_NAME}): a source "
                     "checkout? `pip install -e .` builds them; until then they compile at first use")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        states = native.status()
    for name, state in states.items():
        lines.append(f"  {name}: {native.origin(name) if state == 'loaded' else state}")
    lines += [f"  warning: {w.message}" for w in caught]
    return lines


def _cpu_lines() -> list[str]:
    features, source = native.cpu_features()
    wanted = set().union(*(v.cpu_features for v in variants.variants(cpu.targets_x86())))
    lines = [f"CPU: {_cpu_model()}",
             f"  features seen ({source}): {' '.join(sorted(features & wanted)) or 'none of the ones carrack uses'}"]
    absent = sorted(wanted - features)
    if absent:
        lines.append(f"  absent: {' '.join(absent)}")
    best = cpu.select_variant(features, None)
    lines.append(f"  best variant for this CPU: {best.variant.name}, {best.variant.summary} ({best.why})")
    return lines


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.partition(':')[2].strip()}, {os.cpu_count()} logical CPUs"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs"


def _blas_lines() -> list[str]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        threadpool_info = None
    if threadpool_info is not None:
        pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        if pools:
            return ["BLAS (threadpoolctl):"] + [
                f"  {p.get('internal_api')} {p.get('version') or ''} ({p.get('architecture') or '?'} kernels), "
                f"{p.get('num_threads')} threads: {p.get('filepath')}" for p in pools]
    from carrack.runtime.blas import blas_threads

    config = np.show_config(mode="dicts") if _numpy_config_dicts() else {}
    blas = config.get("Build Dependencies", {}).get("blas", {})
    name = f"{blas.get('name', '?')} {blas.get('version', '')}".strip() if blas else "unknown (numpy.show_config)"
    threads = blas_threads()
    return [f"BLAS (numpy.show_config): {name}, {threads if threads else 'unknown'} threads"]


def _numpy_config_dicts() -> bool:
    try:
        np.show_config(mode="dicts")
        return True
    except TypeError:  # numpy < 1.25 only prints
        return False


def _compiler_lines() -> list[str]:
    cc = native.compiler()
    if cc is None:
        return ["C compiler: none found (fine: the kernels are prebuilt; one is needed only for sources not built "
                "with the package)"]
    version = native._compiler_version(cc).splitlines()
    return [f"C compiler: {cc} ({version[0] if version else 'does not run'}), used only for runtime builds"]


def _cache_lines() -> list[str]:
    lines = ["runtime-build cache (for sources not built with the package, or edited since):"]
    lines += [f"  {directory}: {cache.inspect(directory)}" for directory in cache.candidate_dirs()]
    return lines


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cmd_doctor(argparse.Namespace()))
