"""`carrack compile --target native`: the generated C, built with the system compiler and run through
`carrack.CompiledModel`, equals carrack's Python session within float32 rounding on CNNs and MLPs exported by
torch, at several sizes of their run-time dims; errors are listed at once and named; output is reproducible."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import carrack
from carrack.backends.c.build import compile_model
from carrack.backends.c.emit import CompileError, UnsupportedOperators, emit
from carrack.cli import main
from carrack.errors import InvalidArgument
from carrack.onnx.importer import load_model
from carrack.plan import build_plan
from tests.compile.models import MODELS, feeds, session_outputs

pytestmark = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                reason="no C compiler (apt-get install gcc)")


@pytest.fixture(scope="module")
def compiled(exported, tmp_path_factory):
    """name -> (onnx path, CompiledModel), built once per model."""
    out = {}
    for name, (path, maxima) in exported.items():
        directory = tmp_path_factory.mktemp(f"native_{name}")
        compile_model(path, directory, "native", max_dims=maxima)
        out[name] = (path, carrack.CompiledModel(directory))
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_equal_the_session_at_every_size(compiled, name):
    path, model = compiled[name]
    for feed in feeds(name):
        got = model.run(None, feed)
        want = session_outputs(path, feed)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", [0, 1])
def test_unoptimized_plans_compile_too(exported, tmp_path, level):
    """Level 0 keeps BatchNormalization, Relu and Constant nodes the optimizer would fold or fuse."""
    path, maxima = exported["small_cnn"]
    compile_model(path, tmp_path, "native", max_dims=maxima, level=level)
    model = carrack.CompiledModel(tmp_path)
    for feed in feeds("small_cnn"):
        np.testing.assert_allclose(model.run(None, feed)[0], session_outputs(path, feed)[0], rtol=1e-5, atol=1e-6)


def test_inputs_in_any_layout_give_the_same_outputs(compiled):
    """Strided, byte-swapped and unaligned inputs are copied into aligned buffers: outputs equal bit for bit."""
    path, model = compiled["residual_cnn"]
    x = np.random.default_rng(3).standard_normal((2, 3, 9, 13)).astype(np.float32)
    want = model.run(None, {"x": x})[0]
    wide = np.zeros((2, 3, 9, 26), np.float32)
    wide[..., ::2] = x
    swapped = x.astype(">f4")
    raw = np.zeros(x.nbytes + 1, np.uint8)
    unaligned = np.frombuffer(raw.data, dtype=np.float32, count=x.size, offset=1).reshape(x.shape)
    assert unaligned.ctypes.data % 4 != 0
    raw[1:] = x.view(np.uint8).reshape(-1)
    fortran = np.asfortranarray(x)
    for variant in (wide[..., ::2], swapped, unaligned, fortran):
        np.testing.assert_array_equal(model.run(None, {"x": variant})[0], want)


def test_run_checks_names_dtypes_and_maxima(compiled):
    _, model = compiled["small_cnn"]
    x = np.zeros((2, 3, 16, 16), np.float32)
    with pytest.raises(InvalidArgument, match="unknown input name.*'image'"):
        model.run(None, {"image": x})
    with pytest.raises(InvalidArgument, match="'x' must be float32, got float64"):
        model.run(None, {"x": x.astype(np.float64)})
    with pytest.raises(InvalidArgument, match=r"'x' dim 0 \('batch'\) must be in 1..4 .*got 5"):
        model.run(None, {"x": np.zeros((5, 3, 16, 16), np.float32)})
    with pytest.raises(InvalidArgument, match="'x' dim 2 must be 16, got 15"):
        model.run(None, {"x": np.zeros((2, 3, 15, 16), np.float32)})


def test_arena_is_sized_for_the_maxima(compiled, exported):
    """The static arena is the plan's layout at the declared maxima; a run at smaller dims uses a prefix of it,
    and the plan's own blocks sit at the offsets the Python plan computes."""
    path, model = compiled["residual_cnn"]
    maxima = exported["residual_cnn"][1]
    capacity = model.manifest["arena_capacity"]
    assert model.arena_bytes(maxima) == capacity
    plan = build_plan(load_model(str(path)), 99)
    for dims in ({"batch": 1, "height": 5, "width": 7}, {"batch": 2, "height": 20, "width": 9}, maxima):
        used = model.arena_bytes(dims)
        assert plan.bind(plan.sizes_of(dims)).arena_bytes <= used <= capacity


def test_fixed_dims_are_compiled_in(exported, tmp_path):
    path, _ = exported["small_cnn"]
    compile_model(path, tmp_path, "native", dims={"batch": 2})
    model = carrack.CompiledModel(tmp_path)
    assert model.get_inputs()[0].shape == [2, 3, 16, 16]
    feed = {"x": np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)}
    np.testing.assert_allclose(model.run(None, feed)[0], session_outputs(path, feed)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidArgument, match="dim 0 must be 2, got 3"):
        model.run(None, {"x": np.zeros((3, 3, 16, 16), np.float32)})


def test_generated_files_are_reproducible(exported, tmp_path):
    """Two processes with different hash seeds write the same bytes."""
    path, maxima = exported["residual_cnn"]
    for run, seed in (("a", "1"), ("b", "2")):
        command = [sys.executable, "-m", "carrack", "compile", str(path), "-o", str(tmp_path / run),
                   *[f"--max-dim={k}={v}" for k, v in maxima.items()]]
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run(command, check=True, env=env, capture_output=True)
    for name in ("model.c", "weights.bin", "model.json", "carrack_rt.h"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    source = (tmp_path / "a" / "model.c").read_text()
    assert "/conv1/Conv" in source and "S_height" in source  # names from the graph


@pytest.mark.parametrize("name", ["mlp", "residual_cnn"])
def test_weights_are_64_byte_aligned_and_stored_once(exported, name):
    """Every constant starts on a 64-byte boundary; reordered or transposed weights replace the originals."""
    path, maxima = exported[name]
    emitted = emit(build_plan(load_model(str(path)), 99), None, maxima)
    offsets = {int(part.split(")")[0]) for part in emitted.source.split("r->weights + ")[1:]}
    assert offsets and all(o % 64 == 0 for o in offsets)
    stored = sum(p.nbytes for p in load_model(str(path)).graph.initializers.values())
    assert len(emitted.weights) <= stored + 64 * len(offsets)


def test_symbols_need_a_size_or_a_maximum(exported):
    path, _ = exported["residual_cnn"]
    plan = build_plan(load_model(str(path)), 99)
    with pytest.raises(CompileError, match=r"\['height', 'width'\] need a size"):
        emit(plan, {"batch": 1}, None)
    with pytest.raises(CompileError, match="no symbolic dim.*'depth'"):
        emit(plan, {"depth": 3}, {"batch": 1, "height": 4, "width": 4})


class _Unsupported(torch.nn.Module):
    def forward(self, x):
        return torch.floor(torch.cumsum(x, 1)).relu() + torch.sort(x, 1).values


def test_unsupported_operators_are_listed_at_once(tmp_path):
    path = tmp_path / "unsupported.onnx"
    torch.onnx.export(_Unsupported(), (torch.randn(2, 5),), str(path), input_names=["x"], dynamo=False)
    with pytest.raises(UnsupportedOperators) as info:
        compile_model(path, tmp_path / "out", "native")
    message = str(info.value)
    for op in ("CumSum", "Floor", "TopK"):
        assert op in message
    assert "Relu" not in message and "Add" not in message  # readers of unsupported values are not listed
    assert not (tmp_path / "out").exists()


def test_inputs_of_other_element_types_are_named(tmp_path):
    graph = helper.make_graph([helper.make_node("Cast", ["values"], ["y"], to=TensorProto.FLOAT)], "g",
                              [helper.make_tensor_value_info("values", TensorProto.DOUBLE, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    path = tmp_path / "values.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(UnsupportedOperators, match="'values' \\(element type 11\\).*only float32, int64"):
        compile_model(path, tmp_path / "out", "native")


def test_cli_compiles_and_reports_errors(exported, tmp_path, capsys):
    path, _ = exported["mlp"]
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--max-dim", "batch=3"]) == 0
    assert "libmodel" in capsys.readouterr().out
    feed = {"x": np.ones((3, 20), np.float32)}
    np.testing.assert_allclose(carrack.CompiledModel(tmp_path / "out").run(None, feed)[0],
                               session_outputs(path, feed)[0], rtol=1e-5, atol=1e-6)
    assert main(["compile", str(path), "-o", str(tmp_path / "out2")]) == 1
    assert "need a size" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--max-dim expects SYMBOL=SIZE"):
        main(["compile", str(path), "-o", str(tmp_path / "out3"), "--max-dim", "batch"])


LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


@pytest.mark.parametrize("name", ["squeezenet", "shufflenet", "inception_v1"])
def test_real_architectures_from_the_onnx_wheel(name, tmp_path):
    """Real architectures (fire modules, grouped convs with channel shuffles, LRN, inception concats) compile and
    reproduce onnx's expected outputs for its dummy input. The wheel's weights are constant placeholders, so this
    checks the graphs end to end; the numbers are checked on the random-weight torch models."""
    from onnx import numpy_helper

    path = f"{LIGHT_DIR}/light_{name}.onnx"
    compile_model(path, tmp_path, "native")
    model = carrack.CompiledModel(tmp_path)
    info = model.get_inputs()[0]
    n = int(np.prod(info.shape))
    x = (np.arange(n, dtype=np.float32) / n).reshape(info.shape)
    expected = numpy_helper.to_array(onnx.load_tensor(f"{LIGHT_DIR}/light_{name}_output_0.pb"))
    got = model.run(None, {info.name: x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got, carrack.InferenceSession(path).run(None, {info.name: x})[0], rtol=1e-5,
                               atol=1e-7)


def test_sum_of_three_and_lrn(tmp_path):
    rng = np.random.default_rng(0)
    bias = helper.make_tensor("bias", TensorProto.FLOAT, [4, 1, 1], rng.standard_normal(4).astype(np.float32))
    row = helper.make_tensor("row", TensorProto.FLOAT, [5], rng.standard_normal(5).astype(np.float32))
    graph = helper.make_graph(
        [helper.make_node("LRN", ["x"], ["n"], size=3, alpha=0.5, beta=0.75, bias=2.0),
         helper.make_node("Sum", ["n", "bias", "row"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 3, 5])], [bias, row])
    path = tmp_path / "sum.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    compile_model(path, tmp_path / "out", "native", max_dims={"batch": 2})
    feed = {"x": rng.standard_normal((2, 4, 3, 5)).astype(np.float32) * 3}
    np.testing.assert_allclose(carrack.CompiledModel(tmp_path / "out").run(None, feed)[0],
                               session_outputs(path, feed)[0], rtol=1e-5, atol=1e-6)


def test_threads_and_second_loads_share_one_library_safely(compiled, exported):
    """A directory loaded twice shares the library's static arena and weights; concurrent runs take turns."""
    from concurrent.futures import ThreadPoolExecutor

    path, model = compiled["small_cnn"]
    again = carrack.CompiledModel(model.directory)
    assert again._lib is model._lib and again._weights is model._weights
    feeds_ = feeds("small_cnn", seed=7) * 4
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda f: again.run(None, f)[0], feeds_))
    for feed, got in zip(feeds_, results):
        np.testing.assert_allclose(got, session_outputs(path, feed)[0], rtol=1e-5, atol=1e-6)


def test_outputs_passed_through_from_inputs_and_constants(tmp_path):
    rng = np.random.default_rng(1)
    table = rng.standard_normal((2, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, ["n", 3]),
         helper.make_tensor_value_info("table", TensorProto.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(table, "table")])
    path = tmp_path / "through.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    compile_model(path, tmp_path / "out", "native", max_dims={"n": 4})
    x = rng.standard_normal((3, 3)).astype(np.float32)
    got = carrack.CompiledModel(tmp_path / "out").run(None, {"x": x})
    for g, w in zip(got, session_outputs(path, {"x": x})):
        np.testing.assert_array_equal(g, w)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


#: -march -> the CPU flags it needs: 4 float lanes (SSE2), 8 (AVX2 + FMA), 16 (AVX-512)
ARCHES = {"x86-64": set(), "x86-64-v3": {"avx2", "fma"}, "x86-64-v4": {"avx512f", "avx512bw", "avx512vl"}}


@pytest.mark.parametrize("arch", list(ARCHES))
@pytest.mark.parametrize("name", ["wide_blocks", "residual_cnn", "sequence_mlp", "strided_edges"])
def test_every_vector_width_equals_the_session(exported, tmp_path, arch, name):
    """The packed product's register tiles per target (4, 8 and 16 lanes) all give the session's results."""
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        pytest.skip("x86-64 Linux only")
    if not ARCHES[arch] <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(ARCHES[arch] - _cpu_flags())} for -march={arch}")
    path, maxima = exported[name]
    compile_model(path, tmp_path, "native", max_dims=maxima, native_arch=arch)
    model = carrack.CompiledModel(tmp_path)
    for feed in feeds(name):
        for got, want in zip(model.run(None, feed), session_outputs(path, feed)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class _ClassToken(torch.nn.Module):
    """ViT's head: a learned token expanded to the batch and put before the sequence, then attention."""

    def __init__(self) -> None:
        super().__init__()
        self.token = torch.nn.Parameter(torch.randn(1, 1, 40))
        self.attention = MODELS["self_attention"][0]()

    def forward(self, x):
        return self.attention(torch.cat([self.token.expand(x.shape[0], -1, -1), x], 1))


def test_nodes_known_at_the_fixed_dims_are_folded(tmp_path):
    """The token's Expand to the batch (shape arithmetic from a symbolic dim) is evaluated at compile time when the
    batch is fixed, and runs as a step when the batch is a run-time dim."""
    torch.manual_seed(0)
    path = tmp_path / "class_token.onnx"
    torch.onnx.export(_ClassToken().eval(), (torch.randn(2, 5, 40),), str(path), input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "batch", 1: "sequence"}, "y": {0: "batch", 1: "seq"}},
                      dynamo=False)
    compile_model(path, tmp_path / "fixed", "native", dims={"batch": 2}, max_dims={"sequence": 7})
    model = carrack.CompiledModel(tmp_path / "fixed")
    for length in (1, 7):
        feed = {"x": np.random.default_rng(length).standard_normal((2, length, 40)).astype(np.float32)}
        np.testing.assert_allclose(model.run(None, feed)[0], session_outputs(path, feed)[0], rtol=1e-5, atol=1e-5)
    # with the batch a run-time dim, the Expand is a step (cr_expand over the run-time shape) instead
    compile_model(path, tmp_path / "dynamic", "native", max_dims={"batch": 2, "sequence": 7})
    assert "cr_expand(" in (tmp_path / "dynamic" / "model.c").read_text()
    assert "cr_expand(" not in (tmp_path / "fixed" / "model.c").read_text()
    model = carrack.CompiledModel(tmp_path / "dynamic")
    for batch, length in ((1, 1), (2, 7), (1, 4)):
        feed = {"x": np.random.default_rng(length).standard_normal((batch, length, 40)).astype(np.float32)}
        np.testing.assert_allclose(model.run(None, feed)[0], session_outputs(path, feed)[0], rtol=1e-5, atol=1e-5)


def test_nan_and_signed_zeros_pass_through_clamps_and_pools_like_the_session(tmp_path):
    """Relu6/Relu applied in the tile's registers (max and min instructions) and the separable max pool keep NaN
    where the session does, and a depthwise 3x3 (a NaN in its window) too."""
    channels = 8
    eye = numpy_helper_tensor("eye", np.eye(channels, dtype=np.float32).reshape(channels, channels, 1, 1))
    taps = numpy_helper_tensor("taps", np.full((channels, 1, 3, 3), 0.5, np.float32))
    nodes = [helper.make_node("Conv", ["x", "eye"], ["c"]),
             helper.make_node("Clip", ["c", "lo", "hi"], ["c6"]),
             helper.make_node("Conv", ["x", "eye"], ["d"]),
             helper.make_node("Relu", ["d"], ["r"]),
             helper.make_node("Conv", ["x", "taps"], ["w"], group=channels, pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["c6", "r", "w"], ["cat"], axis=1),
             helper.make_node("MaxPool", ["cat"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])]
    shape = [1, channels, 9, 70]
    graph = helper.make_graph(
        nodes, "nan_paths", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [eye, taps, numpy_helper_tensor("lo", np.float32(0.0)), numpy_helper_tensor("hi", np.float32(6.0))])
    path = tmp_path / "nan_paths.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    compile_model(path, tmp_path / "out", "native")
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32) * 8
    x[0, :, 4, 7] = np.nan
    x[0, 2, :, 40] = -0.0
    x[0, 5, 1, 66:] = np.nan
    got = carrack.CompiledModel(tmp_path / "out").run(None, {"x": x})[0]
    want = session_outputs(path, {"x": x})[0]
    assert np.isnan(want).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def numpy_helper_tensor(name: str, array: np.ndarray):
    from onnx import numpy_helper

    return numpy_helper.from_array(np.asarray(array), name)


@pytest.mark.parametrize("width", [0, 8, 12, 16, 64])
@pytest.mark.parametrize("name", ["wide_blocks", "sequence_mlp"])
def test_prepacked_weights_at_any_panel_width_equal_the_session(exported, tmp_path, name, width):
    """Constant matrix-product weights written as column panels at compile time: read in place where the width is
    this build's tile width, repacked where it is another target's (or no target's: 12), kept as stored at 0.
    wide_blocks' 300 -> 130 Gemm spans two depth blocks and two column blocks with a partial last panel."""
    path, maxima = exported[name]
    compile_model(path, tmp_path, "native", max_dims=maxima, panel_width=width)
    source = (tmp_path / "model.c").read_text()
    assert ("cr_matmul_prepacked" in source) == (width > 0)
    model = carrack.CompiledModel(tmp_path)
    for feed in feeds(name):
        for got, want in zip(model.run(None, feed), session_outputs(path, feed)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_prepacked_weights_are_column_panels_stored_once(exported):
    """The MLP's Linear weights ([out, in], Gemm transB) are written only as B = W^T cut into 8-column panels
    ([ceil(out / 8), in, 8], the last panel zero-padded), 64-byte aligned."""
    path, maxima = exported["mlp"]
    model = load_model(str(path))
    emitted = emit(build_plan(model, 99), None, maxima, panel_width=8)
    calls = emitted.source.split("cr_matmul_prepacked(")[1:]
    assert len(calls) == 3 and "::transposed" not in emitted.source
    weights = np.frombuffer(bytes(emitted.weights), "<f4")
    gemm_weights = [w for w in model.graph.initializers.values() if np.asarray(w).ndim == 2]
    for call in calls:
        offset = int(call.split("r->weights + ")[1].split(")")[0])
        assert offset % 64 == 0
        k, n = (int(v) for v in call.split(",")[7:9])
        w = next(np.asarray(w) for w in gemm_weights if np.asarray(w).shape == (n, k))
        panels = -(-n // 8)
        stored = weights[offset // 4: offset // 4 + panels * k * 8].reshape(panels, k, 8)
        for t in range(panels):
            columns = min(8, n - 8 * t)
            np.testing.assert_array_equal(stored[t, :, :columns], w[8 * t: 8 * t + columns].T)
            assert not stored[t, :, columns:].any()
    matrices = sum(-(-w.shape[0] // 8) * 8 * w.shape[1] * 4 for w in gemm_weights)
    assert len(emitted.weights) <= matrices + sum(np.asarray(w).nbytes for w in model.graph.initializers.values()
                                                  if np.asarray(w).ndim == 1) + 64 * 6
