"""Native libraries built for x86-64 with AVX-512 call the session's own kernels (packconv.c, dwconv.c) for their
convolutions and pools, with the weights packed at compile time: same results as the session, kernel symbols
hidden inside the library, the portable kernels where asked or where AVX-512 is missing."""

from __future__ import annotations

import ctypes
import os
import shutil
import sys

import numpy as np
import onnx
import pytest

import carrack
from carrack.backends.c.build import compile_model, library_name, native_compiler, native_kernels_apply
from carrack.backends.c.emit_native import KERNEL_SOURCES, NATIVE_HEADER, packed_conv_weights
from carrack.errors import CarrackError
from tests.compile.models import MODELS, feeds, session_outputs

pytestmark = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                reason="no C compiler (apt-get install gcc)")

KERNEL_CALLS = ("packconv_f32_threads(", "dwconv2d_f32(", "pool2d_f32(")


def _avx512_build() -> bool:
    return sys.platform.startswith("linux") and os.uname().machine == "x86_64" and native_kernels_apply(
        native_compiler())


needs_avx512 = pytest.mark.skipif(not _avx512_build(), reason="the session kernels' vector code needs x86-64 "
                                  "Linux with a compiler targeting AVX-512 at -march=native")


def _calls(directory) -> dict[str, int]:
    source = (directory / "model.c").read_text()
    return {call[:-1]: source.count(call) for call in KERNEL_CALLS}


@needs_avx512
@pytest.mark.parametrize("name, dims", [
    ("residual_cnn", {"batch": 2, "height": 15, "width": 17}),  # grouped, dilated, ceil-mode and padded pools
    ("small_cnn", {"batch": 3}),  # depthwise at stride 2 over three images, max and average pools
    ("wide_blocks", {"batch": 2, "height": 13, "width": 11}),  # depthwise 3x3 and 3x5 at stride (2, 1)
    ("sequence_mlp", {"batch": 2, "length": 5}),  # a 1-D convolution as a 2-D one of height 1
])
def test_fixed_dims_call_the_session_kernels_and_equal_the_session(exported, tmp_path, name, dims):
    path, _ = exported[name]
    compile_model(path, tmp_path, "native", dims=dims)
    calls = _calls(tmp_path)
    assert calls["packconv_f32_threads"] > 0
    if name in ("small_cnn", "wide_blocks"):
        assert calls["dwconv2d_f32"] > 0
    if name in ("small_cnn", "residual_cnn"):
        assert calls["pool2d_f32"] > 0
    for source in (*KERNEL_SOURCES, NATIVE_HEADER):
        assert (tmp_path / source).is_file()
    _, example, axes, _ = MODELS[name]
    shape = [dims[axes[axis]] if axis in axes else size for axis, size in enumerate(example)]
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    for got, want in zip(carrack.CompiledModel(tmp_path).run(None, {"x": x}), session_outputs(path, {"x": x})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@needs_avx512
def test_run_time_dims_call_them_too(exported, tmp_path):
    """Sizes from the run-time dims (C expressions) reach the kernels: every size within the maxima agrees."""
    path, maxima = exported["residual_cnn"]
    compile_model(path, tmp_path, "native", max_dims=maxima)
    calls = _calls(tmp_path)
    assert calls["packconv_f32_threads"] > 0 and calls["pool2d_f32"] > 0
    model = carrack.CompiledModel(tmp_path)
    for feed in feeds("residual_cnn", seed=2):
        for got, want in zip(model.run(None, feed), session_outputs(path, feed)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@needs_avx512
def test_kernel_symbols_stay_inside_the_library(exported, tmp_path):
    """Only the model's API is exported: another packconv.c loaded in the process (the session's) cannot take the
    library's calls, nor the library the session's."""
    path, _ = exported["small_cnn"]
    compile_model(path, tmp_path, "native", dims={"batch": 1})
    library = ctypes.CDLL(str(tmp_path / library_name()))
    assert hasattr(library, "model_run")
    for symbol in ("packconv_f32_threads", "dwconv2d_f32", "pool2d_f32", "packconv_use_pool"):
        assert not hasattr(library, symbol), symbol


@needs_avx512
def test_concatenated_parts_are_written_in_place_at_batch_one(exported, tmp_path):
    """A fire module's two convolutions write their halves of the Concat's output directly: no copy step."""
    name, dims = "residual_cnn", {"batch": 1, "height": 15, "width": 17}
    path, _ = exported[name]
    compile_model(path, tmp_path / "one", "native", dims=dims)
    compile_model(path, tmp_path / "two", "native", dims={**dims, "batch": 2})
    assert "cr_concat_part" not in (tmp_path / "one" / "model.c").read_text()
    assert "cr_concat_part" in (tmp_path / "two" / "model.c").read_text()  # parts interleave per image: copied
    for batch in (1, 2):
        _, example, axes, _ = MODELS[name]
        shape = [{**dims, "batch": batch}[axes[axis]] if axis in axes else size for axis, size in enumerate(example)]
        x = np.random.default_rng(batch).standard_normal(shape).astype(np.float32)
        model = carrack.CompiledModel(tmp_path / ("one" if batch == 1 else "two"))
        for got, want in zip(model.run(None, {"x": x}), session_outputs(path, {"x": x})):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@needs_avx512
def test_a_concatenated_model_output_is_written_in_place(tmp_path):
    """Parts from a convolution and a pool (shufflenet's downsampling unit) written into the caller's output."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    w = numpy_helper.from_array(rng.standard_normal((5, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("AveragePool", ["x"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["c", "p"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "unit", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 11, 14])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    path = tmp_path / "unit.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    compile_model(path, tmp_path / "out", "native")
    source = (tmp_path / "out" / "model.c").read_text()
    assert "cr_concat_part" not in source and "(float *)r->out[0]" in source
    x = rng.standard_normal((1, 3, 11, 14)).astype(np.float32)
    got = carrack.CompiledModel(tmp_path / "out").run(None, {"x": x})[0]
    np.testing.assert_allclose(got, session_outputs(path, {"x": x})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape, groups", [((13, 5, 3, 3), 1), ((12, 2, 1, 1), 3), ((7, 4, 1, 5), 1),
                                           ((18, 1, 3, 3), 3)])
def test_packed_weights_are_packconv_layout(shape, groups):
    """The compile-time packing writes exactly what the session's packconv_pack_weights writes (panels of 6
    output channels, depth tap by tap, zero rows past a group's last)."""
    from carrack.native.convolution import load

    conv = load()
    if conv is None or not conv.packs:
        pytest.skip("the session's packconv.c is not vectorized here (AVX-512 only)")
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    want = conv.packed_weights(w, groups, keep=False)
    got = packed_conv_weights(w, groups)
    assert got.dtype == np.float32 and got.size == want.size
    np.testing.assert_array_equal(got.reshape(-1), want)


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64", reason="x86-64 Linux")
def test_portable_kernels_where_asked_or_without_avx512(exported, tmp_path):
    path, _ = exported["small_cnn"]
    compile_model(path, tmp_path / "portable", "native", dims={"batch": 2}, native_kernels=False)
    assert not any(_calls(tmp_path / "portable").values())
    assert not (tmp_path / "portable" / "packconv.c").exists()
    compile_model(path, tmp_path / "v3", "native", dims={"batch": 2}, native_arch="x86-64-v3")
    assert not any(_calls(tmp_path / "v3").values())
    with pytest.raises(CarrackError, match="AVX-512"):
        compile_model(path, tmp_path / "forced", "native", dims={"batch": 2}, native_arch="x86-64-v3",
                      native_kernels=True)
