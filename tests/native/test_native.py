"""The native-kernel loader: the prebuilt variant for this CPU, runtime builds only for unbuilt or edited sources,
and a clean numpy fallback, with one carrack.PerformanceWarning, whenever no library can be had."""

from __future__ import annotations

import ctypes
import os
import tempfile
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

import carrack
from carrack import native
from carrack.native import cpu, variants

ADD_ONE = """
#include <stdint.h>
void add_one(float *x, int64_t n) { for (int64_t i = 0; i < n; i++) x[i] += 1.0f; }
"""

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")
needs_prebuilt = pytest.mark.skipif(not native.manifest(), reason="the package was not built (no _kernels/)")


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader with nothing loaded yet, native kernels on (whatever the caller chose)."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_reasons", {})
    monkeypatch.delenv("CARRACK_NATIVE", raising=False)
    monkeypatch.delenv(cpu.VARIANT_ENV, raising=False)


@pytest.fixture
def sources(tmp_path, monkeypatch, fresh_loader):
    """A source directory of its own (no prebuilt library matches it) and a private cache."""
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    monkeypatch.setattr(native, "SOURCE_DIR", source_dir)
    monkeypatch.setenv("CARRACK_CACHE_DIR", str(tmp_path / "cache"))
    return source_dir


def _single_warning(record) -> str:
    messages = [str(w.message) for w in record if issubclass(w.category, carrack.PerformanceWarning)]
    assert len(messages) == 1, messages
    assert "numpy" in messages[0] and "Expected cost" in messages[0]
    return messages[0]


# -- the prebuilt variants -------------------------------------------------------------------------------------------
@needs_prebuilt
def test_prebuilt_kernels_load_without_a_compiler(fresh_loader, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang
    monkeypatch.delenv("CARRACK_CC", raising=False)
    monkeypatch.setenv("CARRACK_CACHE_DIR", str(tmp_path / "cache"))
    assert native.compiler() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", carrack.PerformanceWarning)
        states = native.status()
    assert states and set(states.values()) == {"loaded"}, states
    best = cpu.select_variant(native.cpu_features()[0], None).variant.name
    for name in states:
        assert native.origin(name).startswith(f"prebuilt {best} "), native.origin(name)
    assert not (tmp_path / "cache").exists()  # nothing was compiled


@needs_prebuilt
def test_every_source_is_built_in_every_variant():
    """The build globs carrack/native/*.c: a new source is built with no change to setup.py."""
    built = native.manifest()["libraries"]
    x86 = native.manifest()["target"] == "x86_64"
    for source in native.SOURCE_DIR.glob("*.c"):
        assert built[source.stem]["variants"] == [v.name for v in variants.variants(x86)], source.name
        text = source.read_text()
        headers = variants.headers_text(source.parent, text)
        assert built[source.stem]["source_sha256"] == variants.source_digest(text, headers)
        for variant in built[source.stem]["variants"]:
            assert (native.PREBUILT_DIR / variants.library_filename(source.stem, variant)).is_file()


@needs_prebuilt
@pytest.mark.skipif(not cpu.targets_x86(), reason="the AVX2 variant is an x86 one")
def test_variant_forced_and_refused(fresh_loader, monkeypatch):
    monkeypatch.setenv(cpu.VARIANT_ENV, "portable")
    assert native.library("rowops") is not None
    assert native.origin("rowops").startswith("prebuilt portable (chosen with CARRACK_NATIVE_VARIANT)")
    monkeypatch.setenv(cpu.VARIANT_ENV, "avx2")
    refused = cpu.select_variant(frozenset({"avx2"}), None)  # a CPU with AVX2 but no FMA, BMI2, ...
    assert refused.variant.name == "portable" and "needs" in refused.why and "fma" in refused.why


def test_best_variant_for_each_cpu():
    avx2 = variants.X86_VARIANTS[1].cpu_features
    avx512 = variants.X86_VARIANTS[0].cpu_features
    assert variants.best_supported(frozenset(), x86=True).name == "portable"
    assert variants.best_supported(avx2, x86=True).name == "avx2"
    assert variants.best_supported(avx512 - {"avx512_vnni"}, x86=True).name == "avx2"  # Skylake-X: no VNNI
    assert variants.best_supported(avx512, x86=True).name == "avx512vnni"
    assert variants.best_supported(avx512, x86=True, available={"avx2", "portable"}).name == "avx2"
    assert variants.best_supported(avx512, x86=False).name == "portable"
    assert "avx512_vnni" in cpu.select_variant(avx512 - {"avx512_vnni"}, None).why


@needs_prebuilt
@pytest.mark.skipif(not (cpu.targets_x86() and os.path.exists("/proc/cpuinfo")), reason="x86 Linux only")
def test_cpuid_probe_agrees_with_linux():
    features, source = native.cpu_features()
    assert source.startswith("cpuid")
    with open("/proc/cpuinfo") as f:
        linux = next(set(line.split(":")[1].split()) for line in f if line.startswith("flags"))
    wanted = set().union(*(v.cpu_features for v in variants.X86_VARIANTS))
    assert features & wanted == linux & wanted


@needs_compiler
@needs_prebuilt
def test_edited_source_is_rebuilt_not_run_stale(sources, monkeypatch):
    """A source that changed since the package was built (an editable install being worked on) is compiled at
    run time instead of running the old library."""
    text = (native.PREBUILT_DIR.parent / "rowops.c").read_text() + "\nint carrack_test_edited(void) { return 7; }\n"
    (sources / "rowops.c").write_text(text)
    for header in native.PREBUILT_DIR.parent.glob("*.h"):  # the headers it includes (threadpool.h)
        (sources / header.name).write_text(header.read_text())
    lib = native.library("rowops")
    assert lib is not None and lib.carrack_test_edited() == 7
    assert "source changed since the package was built" in native.origin("rowops")


# -- runtime builds ----------------------------------------------------------------------------------------------------
@needs_compiler
def test_builds_once_and_runs(sources, tmp_path):
    (sources / "demo.c").write_text(ADD_ONE)
    lib = native.library("demo")
    assert lib is not None
    lib.add_one.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    x = np.arange(5, dtype=np.float32)
    lib.add_one(native.pointer(x), x.size)
    np.testing.assert_array_equal(x, np.arange(1, 6, dtype=np.float32))
    built = list((tmp_path / "cache").glob("demo-*.so"))
    assert len(built) == 1
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == oct(0o700)
    native._loaded.clear()
    assert native.library("demo") is not None
    assert list((tmp_path / "cache").glob("demo-*.so")) == built  # reused, not rebuilt


@needs_compiler
def test_changed_source_rebuilds(sources, tmp_path):
    (sources / "demo.c").write_text(ADD_ONE)
    native.library("demo")
    native._loaded.clear()
    (sources / "demo.c").write_text(ADD_ONE + "\nint other(void) { return 7; }\n")
    lib = native.library("demo")
    assert lib.other() == 7
    assert len(list((tmp_path / "cache").glob("demo-*.so"))) == 2


@needs_compiler
def test_header_beside_the_sources(sources, tmp_path):
    """A source may include a header of carrack/native (a shared helper): a runtime build finds it, and a changed
    header rebuilds."""
    (sources / "helper.h").write_text("static inline int answer(void) { return 41; }\n")
    (sources / "uses.c").write_text('#include "helper.h"\nint get(void) { return answer(); }\n')
    assert native.library("uses").get() == 41
    native._loaded.clear()
    (sources / "helper.h").write_text("static inline int answer(void) { return 42; }\n")
    assert native.library("uses").get() == 42
    assert len(list((tmp_path / "cache").glob("uses-*.so"))) == 2


@needs_compiler
def test_included_source_beside_the_sources(sources, tmp_path):
    """A source may include another source whole (invres.c includes packconv.c): a changed included source
    rebuilds the one including it, and a prebuilt library's digest covers it."""
    (sources / "inner.c").write_text("static int answer(void) { return 41; }\n")
    outer = '#include "inner.c"\nint get(void) { return answer(); }\n'
    (sources / "outer.c").write_text(outer)
    assert native.library("outer").get() == 41
    before = variants.source_digest(outer, variants.headers_text(sources, outer))
    native._loaded.clear()
    (sources / "inner.c").write_text("static int answer(void) { return 42; }\n")
    assert native.library("outer").get() == 42
    assert variants.source_digest(outer, variants.headers_text(sources, outer)) != before


@needs_compiler
def test_source_flags(sources):
    (sources / "flagged.c").write_text("// carrack-cflags: -DANSWER=42\nint answer(void) { return ANSWER; }\n")
    assert native.library("flagged").answer() == 42


# -- every failure falls back to numpy with one warning ---------------------------------------------------------------
@needs_compiler
def test_broken_source_falls_back_with_reason(sources, tmp_path):
    (sources / "broken.c").write_text("this is not C")
    with pytest.warns(carrack.PerformanceWarning) as record:
        assert native.library("broken") is None
    assert "broken.c" in _single_warning(record) and "broken.c" in native.unavailable_reason("broken")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.suffix in (".tmp", ".c")]


def test_missing_compiler_falls_back(sources, monkeypatch):
    (sources / "demo.c").write_text(ADD_ONE)
    monkeypatch.setenv("CARRACK_CC", str(sources / "no-such-cc"))
    with pytest.warns(carrack.PerformanceWarning) as record:
        assert native.library("demo") is None
    assert "no-such-cc" in _single_warning(record)
    assert native.library("demo") is None  # asked again: no second warning, no second attempt


def test_no_compiler_on_path_falls_back(sources, monkeypatch, tmp_path):
    (sources / "demo.c").write_text(ADD_ONE)
    monkeypatch.delenv("CARRACK_CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.warns(carrack.PerformanceWarning) as record:
        assert native.library("demo") is None
    assert "no C compiler" in _single_warning(record)


def test_turned_off(sources, monkeypatch):
    (sources / "demo.c").write_text(ADD_ONE)
    monkeypatch.setenv("CARRACK_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", carrack.PerformanceWarning)  # the user's choice: no warning
        assert native.library("demo") is None
    assert "CARRACK_NATIVE" in native.unavailable_reason("demo")


@needs_compiler
def test_no_safe_cache_falls_back(sources, monkeypatch, tmp_path):
    (sources / "demo.c").write_text(ADD_ONE)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CARRACK_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(carrack.PerformanceWarning) as record:
        assert native.library("demo") is None
    assert "no safe cache directory" in _single_warning(record)


@needs_prebuilt
def test_unloadable_prebuilt_falls_back(fresh_loader, monkeypatch, tmp_path):
    prebuilt = tmp_path / "_kernels"
    prebuilt.mkdir()
    (prebuilt / variants.MANIFEST_NAME).write_text((native.PREBUILT_DIR / variants.MANIFEST_NAME).read_text())
    for variant in variants.variants(cpu.targets_x86()):
        (prebuilt / variants.library_filename("rowops", variant.name)).write_text("not a shared library")
    monkeypatch.setattr(native, "PREBUILT_DIR", prebuilt)
    with pytest.warns(carrack.PerformanceWarning) as record:
        assert native.library("rowops") is None
    assert "cannot load" in _single_warning(record)


def test_unexpected_error_falls_back(fresh_loader, monkeypatch):
    def broken():
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(native, "cpu_features", broken)
    with pytest.warns(carrack.PerformanceWarning) as record:
        assert native.library("rowops") is None
    assert "probe exploded" in _single_warning(record)


def _depthwise_model() -> bytes:
    weight = helper.make_tensor("w", TensorProto.FLOAT, [8, 1, 3, 3], np.linspace(-1, 1, 72, dtype=np.float32))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], group=8, pads=[1, 1, 1, 1], name="n0"),
             helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 9, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def test_session_on_a_read_only_machine(fresh_loader, monkeypatch, tmp_path):
    """No prebuilt library, and nowhere to build one (HOME, the temporary directories and the working directory
    all read-only): the session is created and runs on numpy, with a warning (it used to fail)."""
    empty = tmp_path / "no-kernels"
    empty.mkdir()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(native, "PREBUILT_DIR", empty)
    monkeypatch.delenv("CARRACK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))

    def no_temporary_directory():
        raise FileNotFoundError(2, "No usable temporary directory found")

    monkeypatch.setattr(tempfile, "gettempdir", no_temporary_directory)
    model = _depthwise_model()
    x = np.random.default_rng(0).standard_normal((1, 8, 9, 9)).astype(np.float32)
    with pytest.warns(carrack.PerformanceWarning):
        (y,) = carrack.InferenceSession(model).run(None, {"x": x})
    assert native._reasons and all("no safe cache directory" in r for r in native._reasons.values()), native._reasons
    monkeypatch.setenv("CARRACK_NATIVE", "0")
    (reference,) = carrack.InferenceSession(model).run(None, {"x": x})
    np.testing.assert_allclose(y, reference, rtol=1e-6, atol=1e-6)


# -- helpers the kernels use -------------------------------------------------------------------------------------------
def test_data_address_matches_numpy():
    """The fast address read agrees with numpy's for arrays, views, offsets, empty and zero-stride arrays and
    subclasses (which take numpy's own path)."""
    base = np.arange(100, dtype=np.float32)
    arrays = [base, base[7:], base[::3], base.reshape(10, 10).T, np.empty((0, 3)), np.broadcast_to(base[5:6], (4, 4)),
              base.view(np.uint8)[1:], base[1:2],
              np.ma.masked_array(base), np.zeros((), np.int64)]
    for a in arrays:
        assert native.data_address(a) == a.ctypes.data
