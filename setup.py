"""Builds carrack's native kernels when the package is built (``pip install .``, ``pip install -e .``, wheels).

Every ``carrack/native/*.c`` is compiled in each instruction-set variant of ``carrack/native/variants.py`` into a
plain shared library, ``carrack/native/_kernels/<name>-<variant>.so``, loaded at import with ctypes (no Python
C-API, so one build serves every Python version); ``manifest.json`` next to them records what was built and from
which source. The rest of the metadata is in pyproject.toml.

A kernel that fails to compile is left out with a warning (carrack then runs its numpy path and says so at run
time), unless ``CARRACK_BUILD_STRICT=1`` (set for wheel builds), which makes any failure fail the build.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1 has it in the wheel package
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

ROOT = Path(__file__).resolve().parent
NATIVE_DIR = Path("carrack") / "native"


def _load_variants():
    """carrack/native/variants.py, loaded by path: importing carrack needs numpy, which a build may not have."""
    spec = importlib.util.spec_from_file_location("_carrack_native_variants", ROOT / NATIVE_DIR / "variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


variants = _load_variants()
PACKAGE = "carrack.native." + variants.PREBUILT_SUBDIR


class NativeLibrary(Extension):
    """One kernel source compiled for one variant into a shared library for ctypes."""

    def __init__(self, kernel: str, variant: str, source: Path):
        super().__init__(f"{PACKAGE}.{kernel}-{variant}", [source.as_posix()], optional=True)
        self.kernel = kernel
        self.variant = variant


def native_libraries() -> list[NativeLibrary]:
    """Every kernel source in every variant (glob: a new .c file is built with no change here), and the probe."""
    sources = sorted(path.relative_to(ROOT) for path in (ROOT / NATIVE_DIR).glob("*.c"))  # setup paths are relative
    libraries = [NativeLibrary(source.stem, variant.name, source) for source in sources
                 for variant in variants.X86_VARIANTS]
    probe = NATIVE_DIR / "probe" / f"{variants.CPU_PROBE}.c"
    return libraries + [NativeLibrary(variants.CPU_PROBE, "portable", probe)]


def _digest(source: Path) -> str:
    text = source.read_text()
    return variants.source_digest(text, variants.headers_text(source.parent, text))


def _strict() -> bool:
    return os.environ.get("CARRACK_BUILD_STRICT", "").strip().lower() in ("1", "true", "yes")


class BuildNativeLibraries(build_ext):
    """build_ext for NativeLibrary: compile with the variant's flags, link a plain shared library, then write the
    manifest. Variants for x86 are built only when the compiler targets x86-64; elsewhere only the portable one."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1
        self._targets_x86: bool | None = None

    def get_ext_filename(self, fullname: str) -> str:
        parts = fullname.split(".")
        if ".".join(parts[:-1]) in ("", PACKAGE) and parts[-1].count("-") == 1:
            return os.path.join(*parts[:-1], parts[-1] + variants.library_suffix())
        return super().get_ext_filename(fullname)

    def targets_x86(self) -> bool:
        if self._targets_x86 is None:
            probe = Path(self.build_temp) / "carrack_target_probe.c"
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text("#if !defined(__x86_64__) && !defined(_M_X64)\n#error not x86-64\n#endif\n"
                             "int carrack_target_probe;\n")
            try:
                self.compiler.compile([str(probe)], output_dir=self.build_temp)
                self._targets_x86 = True
            except Exception:  # noqa: BLE001 - any failure means: do not build x86 variants
                self._targets_x86 = False
        return self._targets_x86

    def build_extensions(self) -> None:
        self.targets_x86()  # asked once, before the parallel builds
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, NativeLibrary):
            return super().build_extension(ext)
        if self.compiler.compiler_type == "msvc":
            self.warn(f"{ext.name}: carrack's native kernels build with gcc or clang only; left out")
            return None
        variant = variants.by_name(ext.variant, self.targets_x86())
        if variant is None:  # an x86 variant, and the compiler targets another architecture
            return None
        source = ROOT / ext.sources[0]
        requested = variants.source_flags(source.read_text())  # e.g. -pthread: it matters when linking too
        flags = [*variants.BASE_FLAGS, "-g0", *variant.flags, *requested]
        output = self.get_ext_fullpath(ext.name)
        try:
            objects = self.compiler.compile(ext.sources, output_dir=os.path.join(self.build_temp, ext.variant),
                                            extra_postargs=flags)
            self.compiler.link_shared_object(objects, output, libraries=["m"], extra_postargs=requested)
        except Exception as exc:
            if _strict():
                raise RuntimeError(f"carrack: building {source.name} ({ext.variant}) failed: {exc}") from exc
            raise  # build_ext leaves an optional extension out with a warning
        return None

    def copy_extensions_to_source(self) -> None:
        self.mkpath(str(NATIVE_DIR / variants.PREBUILT_SUBDIR))  # not a package: nothing else creates it in place
        super().copy_extensions_to_source()

    def run(self) -> None:
        super().run()
        self._write_manifest(Path(self.build_lib))
        if self.inplace:
            self._write_manifest(ROOT)

    def _write_manifest(self, root: Path) -> None:
        directory = root / NATIVE_DIR / variants.PREBUILT_SUBDIR
        libraries: dict[str, dict] = {}
        built = [ext for ext in self.extensions if isinstance(ext, NativeLibrary)
                 and (directory / variants.library_filename(ext.kernel, ext.variant)).exists()]
        for ext in built:
            entry = libraries.setdefault(ext.kernel, {
                "source_sha256": _digest(ROOT / ext.sources[0]), "variants": []})
            entry["variants"].append(ext.variant)
        if not directory.is_dir():
            return
        manifest = {
            "format": 1,
            "target": "x86_64" if self.targets_x86() else "generic",
            "compiler": " ".join(self.compiler.compiler_so[:1]) if hasattr(self.compiler, "compiler_so") else "",
            "variants": {v.name: {"flags": list(v.flags), "summary": v.summary}
                         for v in variants.variants(self.targets_x86())},
            "libraries": libraries,
        }
        (directory / variants.MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")

    def get_outputs(self) -> list[str]:
        manifest = Path(self.build_lib) / NATIVE_DIR / variants.PREBUILT_SUBDIR / variants.MANIFEST_NAME
        return [*super().get_outputs(), str(manifest)]


commands = {"build_ext": BuildNativeLibraries}
if bdist_wheel is not None:
    class PlatformWheel(bdist_wheel):
        """The libraries use no Python API: one wheel per platform serves every Python 3 (py3-none-<platform>)."""

        def get_tag(self) -> tuple[str, str, str]:
            _, _, platform = super().get_tag()
            return "py3", "none", platform

    commands["bdist_wheel"] = PlatformWheel

setup(ext_modules=native_libraries(), cmdclass=commands)
