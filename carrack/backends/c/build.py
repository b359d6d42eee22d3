"""`carrack compile`: a model file to a directory holding its C source, weights, manifest and a built library.

    carrack compile model.onnx -o out --target native --max-dim batch=8   # out/libmodel.so (system C compiler)
    carrack compile model.onnx -o out --target wasm32 --max-dim batch=8   # out/model.wasm + out/model.mjs

Toolchains: native builds use the system C compiler (``$CC``, else cc, gcc or clang). WebAssembly builds use the
``ziglang`` package from PyPI (``pip install carrack[wasm]``): a pip-installable clang with wasi-libc's libm for
wasm32, so the wasm target needs nothing from the system package manager, on any OS, and the same compiler
version everywhere. The module is built as a reactor with no imports; its memory is fixed at link time (initial
= maximum) from the plan at the declared maxima, so it cannot grow during a run.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from carrack.backends.c import emit_native
from carrack.backends.c.emit import C_TYPES, QUANT_HEADER, RUNTIME_HEADER, VALUES_HEADER, Emitted, emit, manifest_json
from carrack.errors import CarrackError

RUNTIME_DIR = Path(__file__).parent / "runtime"
#: the activations the native kernels and the compiled models' runtime share (carrack_rt.h includes it)
ACTIVATIONS_HEADER = Path(__file__).parent.parent.parent / "native" / "activations.h"
#: the session's kernel sources, built into native libraries that call them (emit_native)
NATIVE_KERNELS_DIR = ACTIVATIONS_HEADER.parent
TARGETS = ("native", "wasm32")
#: the WebAssembly builds of one model: SIMD128, which every engine runs, and relaxed SIMD, whose fused
#: multiply-add (f32x4.relaxed_madd, from a * b + c under -ffp-contract=fast) the loader picks where the engine
#: validates it (Chrome 114+ and Node 22+ ship it; elsewhere the probe decides); onnxruntime-web's wasm build
#: uses plain SIMD128 only
WASM_BUILDS = {"model.wasm": [], "model.relaxed.wasm": ["-mrelaxed-simd", "-ffp-contract=fast"]}
WASM_PAGE = 65536
WASM_STACK = 1 << 20
#: room for the C library's data and the compiler's globals above the static areas and the stack
WASM_SLACK = 1 << 20
#: the packed matrix product's tile width in floats (carrack_rt.h's CR_GN = CR_GNV vectors of CR_VW lanes): the
#: panel width constant weights are written in. 2 x 4 lanes on SIMD128 (and SSE, NEON), 2 x 8 on AVX2, 4 x 16 on
#: AVX-512
WASM_PANEL_WIDTH = 8
LIBRARY_NAME = {"linux": "libmodel.so", "darwin": "libmodel.dylib", "win32": "model.dll"}


class ToolchainMissing(CarrackError, RuntimeError):
    """The compiler a target needs is not installed; the message says what to install."""


class BuildFailed(CarrackError, RuntimeError):
    """The C compiler rejected the generated code (a carrack bug): the message holds its output."""


@dataclass
class Compiled:
    directory: Path
    target: str
    files: list[str]


def library_name() -> str:
    return LIBRARY_NAME.get(sys.platform, "libmodel.so")


def compile_model(model, directory: str | os.PathLike, target: str = "native", dims: Mapping[str, int] | None = None,
                  max_dims: Mapping[str, int] | None = None, level: int = 99, native_arch: str = "native",
                  panel_width: int | None = None, embed_weights: bool = False,
                  native_kernels: bool | None = None) -> Compiled:
    """Plan `model` (a path or a carrack Model), emit C and build it for `target` into `directory`; a native build
    is for `native_arch` (the compiler's -march: "native", or e.g. "x86-64-v3" for AVX2 on another machine).
    Constant matrix-product weights are written as panels of `panel_width` columns (default: the target's tile
    width; 0 keeps them as stored). `embed_weights` assembles weights.bin into the library or module, so that it
    alone is shipped. `native_kernels` (default: wherever they apply, native builds for x86-64 with AVX-512)
    builds the session's own convolution and pool kernels into the library and calls them."""
    if target not in TARGETS:
        raise CarrackError(f"carrack compile: unknown target '{target}'; targets are {list(TARGETS)}")
    from carrack.onnx.importer import load_model

    if isinstance(model, (str, os.PathLike)):
        model = load_model(str(model))
    compiler = native_compiler() if target == "native" else wasm_compiler()  # fail before the work
    if panel_width is None:
        panel_width = native_panel_width(compiler, native_arch) if target == "native" else WASM_PANEL_WIDTH
    native_kernels = _native_kernels(target, compiler, native_arch, native_kernels)
    emitted = emit(plan_for_build(model, level, native_kernels), dims, max_dims, panel_width, embed_weights,
                   native_kernels)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    files = write_sources(emitted, out)
    if target == "native":
        files.append(_build_native(compiler, out, native_arch, emitted.kernel_sources))
    else:
        files += _build_wasm(compiler, out, emitted)
    return Compiled(out, target, files)


def plan_for_build(model, level: int, native_kernels: bool):
    """The plan a build emits. MobileNetV2's inverted-residual blocks become carrack.InvertedResidual nodes (run by
    invres.c) in libraries with the session kernels; elsewhere (wasm32, the portable kernels) they stay, or a
    session's plan holding such nodes (the compiled executor's) is lowered back to, their convolutions."""
    from carrack.passes.fusions import block_fusion, lower_inverted_residuals
    from carrack.plan import build_plan

    with block_fusion(native_kernels):
        return build_plan(model if native_kernels else lower_inverted_residuals(model), level)


def write_sources(emitted: Emitted, out: Path) -> list[str]:
    (out / "model.c").write_text(emitted.source)
    shutil.copyfile(RUNTIME_DIR / RUNTIME_HEADER, out / RUNTIME_HEADER)
    shutil.copyfile(RUNTIME_DIR / VALUES_HEADER, out / VALUES_HEADER)
    shutil.copyfile(RUNTIME_DIR / QUANT_HEADER, out / QUANT_HEADER)
    shutil.copyfile(ACTIVATIONS_HEADER, out / ACTIVATIONS_HEADER.name)
    (out / "weights.bin").write_bytes(emitted.weights)
    (out / "model.json").write_text(manifest_json(emitted.manifest))
    headers = [RUNTIME_HEADER, VALUES_HEADER, QUANT_HEADER, ACTIVATIONS_HEADER.name]
    if emitted.kernel_sources:
        shutil.copyfile(RUNTIME_DIR / emit_native.NATIVE_HEADER, out / emit_native.NATIVE_HEADER)
        copied = emit_native.copied_sources(emitted.kernel_sources)
        for name in copied:
            shutil.copyfile(NATIVE_KERNELS_DIR / name, out / name)
        headers += [emit_native.NATIVE_HEADER, *copied]
    return ["model.c", *headers, "weights.bin", "model.json"]


def native_compiler() -> list[str]:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate.split()[0]):
            return candidate.split()
    raise ToolchainMissing("carrack compile --target native needs a C compiler: install gcc or clang "
                           "(Debian: apt-get install gcc) or set $CC")


def native_panel_width(compiler: list[str], arch: str = "native") -> int:
    """The packed product's tile width for a native build: from the vector extensions the compiler enables at
    `arch` (0, weights as stored, where the compiler cannot say)."""
    macros = _compiler_macros(tuple(compiler), arch)
    if macros is None:
        return 0
    return 64 if "__AVX512F__" in macros else 16 if "__AVX__" in macros else WASM_PANEL_WIDTH


def native_kernels_apply(compiler: list[str], arch: str = "native") -> bool:
    """Whether a native build for `arch` can call the session's own kernels (packconv.c, dwconv.c): their vector
    code is AVX-512's, and their build flags are GCC's and Clang's on Linux and macOS."""
    macros = _compiler_macros(tuple(compiler), arch)
    return sys.platform != "win32" and macros is not None and "__AVX512F__" in macros


@functools.lru_cache(maxsize=16)
def _compiler_macros(compiler: tuple[str, ...], arch: str) -> frozenset[str] | None:
    """The macros `compiler` predefines at -march=`arch` (None where it cannot say)."""
    flags = [] if sys.platform == "win32" else [f"-march={arch}"]
    done = subprocess.run([*compiler, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return frozenset(re.findall(r"#define (\w+)", done.stdout))


def _native_kernels(target: str, compiler: list[str], arch: str, wanted: bool | None) -> bool:
    if target != "native" or wanted is False:
        return False
    applies = native_kernels_apply(compiler, arch)
    if wanted and not applies:
        raise CarrackError(f"carrack compile: native_kernels=True needs a native build for x86-64 with AVX-512 "
                           f"(the session kernels' vector code); -march={arch} of {' '.join(compiler)} has none")
    return applies


def wasm_compiler() -> list[str]:
    if importlib.util.find_spec("ziglang") is None:
        raise ToolchainMissing("carrack compile --target wasm32 needs the ziglang package (a clang for wasm32): "
                               "pip install 'carrack[wasm]' (or pip install ziglang)")
    return [sys.executable, "-m", "ziglang", "cc"]


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildFailed(f"carrack compile: the C compiler failed ({' '.join(command)}):\n"
                          f"{(done.stdout + done.stderr)[-4000:]}")


def _build_native(compiler: list[str], out: Path, arch: str = "native", kernel_sources=()) -> str:
    name = library_name()
    flags = ["-std=c11", "-O3", "-ffp-contract=fast", "-fPIC", "-shared", "-Wall", "-Wno-unused-function"]
    if sys.platform != "win32":
        flags.append(f"-march={arch}")
    objects = _build_kernel_objects(compiler, out, arch, kernel_sources)
    try:
        _run([*compiler, *flags, "-o", name, "model.c", *objects, "-lm"], out)
    finally:
        for obj in objects:
            (out / obj).unlink(missing_ok=True)
    return name


def _build_kernel_objects(compiler: list[str], out: Path, arch: str, sources) -> list[str]:
    """The session kernels' objects, compiled side by side with the session's own flags (so they round as its
    kernels do), their symbols hidden in the library (another copy loaded in the process cannot interpose)."""
    from carrack.native.variants import BASE_FLAGS, source_flags

    jobs = []
    for source in sources:
        obj = Path(source).with_suffix(".o").name
        extra = source_flags((out / source).read_text())
        command = [*compiler, *BASE_FLAGS, *extra, f"-march={arch}", "-fvisibility=hidden", "-c", source, "-o", obj]
        jobs.append((command, obj, subprocess.Popen(command, cwd=out, stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT, text=True)))
    for command, _, job in jobs:
        output, _ = job.communicate()
        if job.returncode != 0:
            raise BuildFailed(f"carrack compile: the C compiler failed ({' '.join(command)}):\n{output[-4000:]}")
    return [obj for _, obj, _ in jobs]


def wasm_memory_bytes(emitted: Emitted) -> int:
    """The module's whole memory: weights, arena, input and output areas at the maxima, stack and slack."""
    manifest = emitted.manifest
    areas = sum(C_TYPES[e["dtype"]][2] * max(1, e["max_elements"]) + 64
                for e in manifest["inputs"] + manifest["outputs"])
    total = manifest["weights"]["bytes"] + 64 + manifest["arena_capacity"] + 64 + areas + WASM_STACK + WASM_SLACK
    return (total + WASM_PAGE - 1) // WASM_PAGE * WASM_PAGE


def _build_wasm(compiler: list[str], out: Path, emitted: Emitted) -> list[str]:
    memory = wasm_memory_bytes(emitted)
    flags = ["-target", "wasm32-wasi", "-std=c11", "-O3", "-msimd128", "-mexec-model=reactor", "-Wall",
             "-Wno-unused-function", "-Wl,--no-entry", "-Wl,--strip-all", f"-Wl,--initial-memory={memory}",
             f"-Wl,--max-memory={memory}", f"-Wl,-z,stack-size={WASM_STACK}"]
    for name, extra in WASM_BUILDS.items():
        _run([*compiler, *flags, *extra, "-o", name, "model.c"], out)
    from carrack.backends.c.js import module_source

    (out / "model.mjs").write_text(module_source(emitted.manifest, memory))
    files = [*WASM_BUILDS, "model.mjs"]
    from carrack.backends.c.page import is_image_classifier, page_source

    if is_image_classifier(emitted.manifest):
        (out / "index.html").write_text(page_source())
        files.append("index.html")
    return files
