"""The per-run shortcuts of the executor and the session: values that depend only on the input sizes computed once
per set of sizes, the arena reused by the next run of the same sizes, feeds of the common form checked in one loop,
a MatMul's constant weight checked once. Each must give exactly what the full path gives."""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.errors import InvalidArgument
from carrack.ops import registry
from tests.helpers import run_in_threads

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")


class _PositionEmbedder(torch.nn.Module):
    """Token embeddings plus position embeddings of arange(seq), a linear layer: BERT's embedding block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = torch.nn.Embedding(50, 32)
        self.positions = torch.nn.Embedding(64, 32)
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        return torch.relu(self.linear(self.tokens(ids) + self.positions(positions)))


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("overhead") / "embedder.onnx"
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_PositionEmbedder().eval(), (torch.zeros(2, 5, dtype=torch.int64),), str(path),
                          input_names=["ids"], output_names=["y"], dynamo=False, opset_version=17,
                          dynamic_axes={"ids": {0: "batch", 1: "seq"}, "y": {0: "batch", 1: "seq"}})
    return path.read_bytes()


def _ids(batch: int, seq: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50, (batch, seq), dtype=np.int64)


def _counting(monkeypatch, op_type: str) -> list[int]:
    """Count the calls of every kernel class registered for `op_type` (at any opset)."""
    calls = [0]
    for (_, op), entries in registry._REGISTRY.items():
        if op != op_type:
            continue
        for _, cls in entries:
            original = cls.run

            def counted(self, *args, _original=original):
                calls[0] += 1
                return _original(self, *args)
            monkeypatch.setattr(cls, "run", counted)
    return calls


def test_size_only_steps_run_once_per_set_of_sizes(embedder, monkeypatch):
    calls = _counting(monkeypatch, "Range")
    session = carrack.InferenceSession(embedder)
    reference = ort.InferenceSession(embedder, providers=["CPUExecutionProvider"])
    assert session._program._memo_steps, "the position ids should be computed once per set of sizes"
    for shape in [(1, 7), (1, 7), (2, 7), (1, 7), (2, 7), (1, 7), (2, 7), (1, 12)]:
        ids = _ids(*shape, seed=shape[1])
        np.testing.assert_allclose(session.run(None, {"ids": ids})[0], reference.run(None, {"ids": ids})[0],
                                   rtol=1e-5, atol=1e-5)
    # a set of sizes seen once is computed by its run; its second run keeps the values for every later one:
    # (1, 7) and (2, 7) twice each, (1, 12) once (eight runs without the memo)
    assert calls[0] == 5


def test_size_only_values_are_not_handed_out_writable(embedder):
    """A memoized value that is also a graph output reaches the caller as a copy of its own."""
    model = onnx.load_from_string(embedder)
    positions = next(n.output[0] for n in model.graph.node if n.op_type == "Range")
    model.graph.output.append(helper.make_tensor_value_info(positions, TensorProto.INT64, None))
    session = carrack.InferenceSession(model.SerializeToString())
    first = session.run(None, {"ids": _ids(1, 6)})[1]
    np.testing.assert_array_equal(first, np.arange(6))
    first[:] = -1
    second = session.run(None, {"ids": _ids(1, 6)})[1]
    np.testing.assert_array_equal(second, np.arange(6))


def test_a_reused_arena_leaves_earlier_outputs_alone(embedder):
    session = carrack.InferenceSession(embedder)
    a, b = _ids(1, 9, seed=1), _ids(1, 9, seed=2)
    first = session.run(None, {"ids": a})[0]
    kept = first.copy()
    second = session.run(None, {"ids": b})[0]
    np.testing.assert_array_equal(first, kept)
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(session.run(None, {"ids": a})[0], kept)


def test_threads_sharing_a_session_get_their_own_results(embedder):
    session = carrack.InferenceSession(embedder)
    feeds = [_ids(1 + i % 2, 5 + i % 3, seed=i) for i in range(8)]
    expected = [session.run(None, {"ids": f})[0] for f in feeds]
    failures: list[str] = []

    def worker(k: int) -> None:
        for _ in range(30):
            for i, f in enumerate(feeds[k:] + feeds[:k]):
                got = session.run(None, {"ids": f})[0]
                if not np.array_equal(got, expected[(i + k) % len(feeds)]):
                    failures.append(f"thread {k} feed {(i + k) % len(feeds)}")

    run_in_threads(worker)
    assert not failures


def _matmul_model(k: int = 64, n: int = 48, dtype=TensorProto.FLOAT, transposed_input: bool = False) -> bytes:
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    w = np.random.default_rng(3).standard_normal((k, n)).astype(np_dtype)
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1])] if transposed_input else []
    nodes += [helper.make_node("MatMul", ["xt" if transposed_input else "x", "w"], ["m"]),
              helper.make_node("Relu", ["m"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
    shape = ["batch", k, "rows"] if transposed_input else ["batch", "rows", k]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, shape)],
                              [helper.make_tensor_value_info("y", dtype, None)],
                              initializer=[onnx.numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("dtype,transposed", [(TensorProto.FLOAT, False), (TensorProto.FLOAT, True),
                                              (TensorProto.DOUBLE, False), (TensorProto.FLOAT16, False)])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_matmul_by_a_prepared_weight_matches_onnxruntime(native, dtype, transposed, rows, monkeypatch):
    monkeypatch.setenv("CARRACK_NATIVE", native)
    model = _matmul_model(dtype=dtype, transposed_input=transposed)
    session = carrack.InferenceSession(model)
    kernel = next(st.kernel for st in session._program.steps if "MatMul" in st.node.op_type)
    kernel = getattr(kernel, "inner", kernel)  # FusedMatMul (with the Relu) wraps the MatMul kernel
    assert (kernel.weight is not None) == (dtype == TensorProto.FLOAT)
    assert any("MatMul" in entry[0].node.op_type and entry[6] >= 0 for entry in session._program._plan)  # run_into
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    shape = (2, 64, rows) if transposed else (2, rows, 64)
    x = np.random.default_rng(rows).standard_normal(shape).astype(np_dtype)
    tolerance = 1e-2 if dtype == TensorProto.FLOAT16 else 1e-4
    for feed in (x, np.asfortranarray(x), x[:, ::-1][:, ::-1]):
        np.testing.assert_allclose(session.run(None, {"x": feed})[0], reference.run(None, {"x": x})[0],
                                   rtol=tolerance, atol=tolerance)


def _typed_model() -> bytes:
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 4]),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("feed,message", [
    ({"a": np.zeros((2, 4), np.float64), "b": np.zeros((2, 4), np.float32)}, "input 'a' has the wrong type"),
    ({"a": np.zeros((2, 5), np.float32), "b": np.zeros((2, 5), np.float32)}, "input 'a' has the wrong size on axis 1"),
    ({"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 4), np.float32)}, "is dim 'n' = 3"),
    ({"a": np.zeros((4,), np.float32), "b": np.zeros((2, 4), np.float32)}, "input 'a' has the wrong rank"),
    ({"a": np.zeros((2, 4), np.float32)}, "missing input(s) ['b']"),
    ({"a": np.zeros((2, 4), np.float32), "b": np.zeros((2, 4), np.float32), "c": 1}, "unknown input name(s)"),
])
def test_feeds_off_the_common_form_get_the_full_checks(feed, message):
    session = carrack.InferenceSession(_typed_model())
    with pytest.raises(InvalidArgument) as error:
        session.run(None, feed)
    assert message in str(error.value)


def test_feeds_in_other_layouts_and_byte_orders_match_plain_ones():
    session = carrack.InferenceSession(_typed_model())
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones((3, 4), np.float32)
    expected = session.run(None, {"a": a, "b": b})[0]
    for other in (a.astype(">f4"), np.asfortranarray(a), [[float(v) for v in row] for row in a]):
        np.testing.assert_array_equal(session.run(None, {"a": other, "b": b})[0], expected)
    output = session.run(None, {"a": a, "b": b})[0]
    output[:] = 0  # the caller owns its outputs; the feeds are untouched
    np.testing.assert_array_equal(a, np.arange(12, dtype=np.float32).reshape(3, 4))


MS = "com.microsoft"


def _row_ops_model(hidden: int = 64) -> bytes:
    """Constant row parameters feeding LayerNormalization, SkipLayerNormalization and BiasGelu, each writing into
    the arena (a later node reads it), then a Gemm linear layer with constant weight and bias."""
    rng = np.random.default_rng(5)
    consts = {"gamma": rng.standard_normal(hidden), "beta": rng.standard_normal(hidden),
              "bias": rng.standard_normal(hidden), "w": rng.standard_normal((8, hidden)) / 8,
              "c": rng.standard_normal(8)}
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], epsilon=1e-5),
             helper.make_node("SkipLayerNormalization", ["n", "x", "gamma", "beta", "bias"], ["s"], domain=MS),
             helper.make_node("BiasGelu", ["s", "bias"], ["g"], domain=MS),
             helper.make_node("Reshape", ["g", "flat"], ["rows"]),
             helper.make_node("Gemm", ["rows", "w", "c"], ["lin"], transB=1),
             helper.make_node("Neg", ["lin"], ["y"])]
    inits = [onnx.numpy_helper.from_array(v.astype(np.float32), k) for k, v in consts.items()]
    inits.append(onnx.numpy_helper.from_array(np.array([-1, hidden], np.int64), "flat"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    return model.SerializeToString()


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("shape", [(1, 3), (2, 16), (1, 40)])
def test_prepared_row_parameters_and_linear_layer_match_onnxruntime(native, shape, monkeypatch):
    monkeypatch.setenv("CARRACK_NATIVE", native)
    model = _row_ops_model()
    session = carrack.InferenceSession(model)
    kernels = {st.node.op_type: st.kernel for st in session._program.steps}
    if native == "1":
        assert kernels["SkipLayerNormalization"].row_constants is not None
        assert kernels["LayerNormalization"].row_constants is not None
        assert kernels["BiasGelu"].bias is not None
    assert kernels["Gemm"].weight is not None
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(shape[1]).standard_normal((*shape, 64)).astype(np.float32)
    for _ in range(2):  # the second run reuses the arena
        np.testing.assert_allclose(session.run(None, {"x": x})[0], reference.run(None, {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)


def _gather_model() -> bytes:
    table = np.arange(20, dtype=np.float32).reshape(10, 2)
    graph = helper.make_graph([helper.make_node("Gather", ["table", "i"], ["y"], axis=0)], "g",
                              [helper.make_tensor_value_info("i", TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[onnx.numpy_helper.from_array(table, "table")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_gather_counts_negative_indices_from_the_back_and_names_a_bad_one():
    session = carrack.InferenceSession(_gather_model())
    np.testing.assert_array_equal(session.run(None, {"i": np.array([-1, 0, -10, 9])})[0],
                                  np.arange(20, dtype=np.float32).reshape(10, 2)[[9, 0, 0, 9]])
    for bad in (10, -11):
        with pytest.raises(Exception, match=f"index {bad} at position \\[1\\] is out of range for a dimension of 10"):
            session.run(None, {"i": np.array([0, bad])})


def test_size_only_values_kept_stay_within_their_budget(embedder, monkeypatch):
    from carrack.runtime import program

    monkeypatch.setattr(program, "MEMO_TOTAL_BYTES", 4096)
    session = carrack.InferenceSession(embedder)
    reference = ort.InferenceSession(embedder, providers=["CPUExecutionProvider"])
    for seq in range(3, 40):
        ids = _ids(1, seq, seed=seq)
        np.testing.assert_allclose(session.run(None, {"ids": ids})[0], reference.run(None, {"ids": ids})[0],
                                   rtol=1e-5, atol=1e-5)
        assert 0 <= session._program._memo_total <= 4096


@pytest.mark.parametrize("op", ["LayerNormalization", "SkipLayerNormalization"])
def test_a_prepared_normalization_that_writes_a_graph_output_matches_onnxruntime(op):
    """Graph outputs are not planned in the arena: the prepared path allocates them itself."""
    rng = np.random.default_rng(7)
    inputs = ["x", "skip", "gamma", "beta"] if op == "SkipLayerNormalization" else ["x", "gamma", "beta"]
    node = helper.make_node(op, inputs, ["y"], epsilon=1e-5, **({"domain": MS} if op.startswith("Skip") else {}))
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), n) for n in ("gamma", "beta")]
    feeds = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", 32]) for n in inputs[:len(inputs) - 2]]
    graph = helper.make_graph([node], "g", feeds, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model = model.SerializeToString()
    session = carrack.InferenceSession(model)
    assert session._program.steps[0].kernel.row_constants is not None
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    feed = {n: rng.standard_normal((5, 32)).astype(np.float32) for n in inputs[:len(inputs) - 2]}
    first = session.run(None, feed)[0]
    np.testing.assert_allclose(first, reference.run(None, feed)[0], rtol=1e-5, atol=1e-5)
    assert first.flags.writeable and not any(np.may_share_memory(first, f) for f in feed.values())


def test_gather_nd_counts_negative_indices_from_the_back_and_names_a_bad_one():
    data = np.arange(24, dtype=np.float32).reshape(4, 3, 2)
    graph = helper.make_graph([helper.make_node("GatherND", ["data", "i"], ["y"])], "g",
                              [helper.make_tensor_value_info("i", TensorProto.INT64, ["n", 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[onnx.numpy_helper.from_array(data, "data")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    session = carrack.InferenceSession(model)
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    good = np.array([[0, 1], [-1, -3], [3, 2]], np.int64)
    np.testing.assert_array_equal(session.run(None, {"i": good})[0], reference.run(None, {"i": good})[0])
    with pytest.raises(Exception, match="out of range for a dimension of 3"):
        session.run(None, {"i": np.array([[0, 3]], np.int64)})


def test_split_parts_stay_views_of_their_planned_input_while_read():
    """Split's parts are views of its input in the arena (not copied out): the plan keeps the input's bytes
    reserved until the last part is read, while other values are written around them."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((16, 48)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Split", ["m"], ["a", "b", "c"], axis=-1, num_outputs=3),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Sigmoid", ["r"], ["s"]),
             helper.make_node("Add", ["s", "b"], ["t"]), helper.make_node("Mul", ["t", "c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    session = carrack.InferenceSession(model)
    split = next(entry for entry in session._program._plan if entry[0].node.op_type == "Split")
    assert split[7] is False  # no copy off the arena
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for n in (1, 5, 33, 5):
        x = rng.standard_normal((n, 16)).astype(np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], reference.run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", ["0", "1"])
def test_a_prepared_skip_layer_norm_with_its_sum_output_matches_onnxruntime(native, monkeypatch):
    """SkipLayerNormalization whose 4th output (input + skip + bias) is read, with constant row parameters: the
    prepared native call writes the sum too (GPT-2's residual stream)."""
    monkeypatch.setenv("CARRACK_NATIVE", native)
    rng = np.random.default_rng(8)
    consts = {name: rng.standard_normal(32).astype(np.float32) for name in ("gamma", "beta", "bias")}
    nodes = [helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta", "bias"], ["n", "", "", "s"],
                              domain=MS, epsilon=1e-5),
             helper.make_node("Neg", ["n"], ["y"]), helper.make_node("Neg", ["s"], ["t"])]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", 5, 32]) for name in ("x", "skip")]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
                                                   for name in ("y", "t")],
                              initializer=[onnx.numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                              ir_version=9).SerializeToString()
    session = carrack.InferenceSession(model)
    kernel = next(st.kernel for st in session._program.steps if st.node.op_type == "SkipLayerNormalization")
    assert (kernel.row_constants is not None) is (native == "1")
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for batch in (1, 3, 3):
        feed = {name: rng.standard_normal((batch, 5, 32)).astype(np.float32) for name in ("x", "skip")}
        for got, expected in zip(session.run(None, feed), reference.run(None, feed)):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
