"""The selection table (carrack.plan.select): the plan picks native or numpy per node, a session can force numpy,
both agree on a torch-exported CNN and a small BERT, the choices travel with a pickled session, and convolution
kernels are prepared per input shape by the plan's per-size evaluation, never changed by a run (threads too)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
from onnx import TensorProto

import carrack
from carrack.errors import InvalidArgument
from carrack.ir.types import TensorType
from carrack.native import convolution as native_conv
from carrack.native import rowops
from carrack.ops.conv import Conv
from carrack.passes.facts import Fact
from carrack.plan import select
from tests.helpers import first_output_module
from tests.plan.cnn import export_small_cnn

torch = pytest.importorskip("torch")
needs_native = pytest.mark.skipif(native_conv.load() is None or rowops.library() is None,
                                  reason="native kernels not built here")


def _numpy_options() -> carrack.SessionOptions:
    options = carrack.SessionOptions()
    options.add_session_config_entry(select.KERNELS_CONFIG_KEY, "numpy")
    return options


@pytest.fixture(scope="module")
def cnn(tmp_path_factory) -> str:
    """Conv + BN + ReLU, depthwise, 1x1, residual, strided conv, max pool, global pool, Gemm, softmax; dynamic
    batch, height and width."""
    return export_small_cnn(tmp_path_factory.mktemp("cnn") / "cnn.onnx", pooled=True)


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> tuple[str, dict]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37, max_position_embeddings=64, attn_implementation="eager")
    ids = torch.randint(0, 99, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.int64)
    module = first_output_module(transformers.BertModel(config).eval())
    path = str(tmp_path_factory.mktemp("bert") / "bert.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (ids, mask), path, input_names=["ids", "mask"], output_names=["y"],
                          dynamic_axes={"ids": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}},
                          opset_version=17, dynamo=False)
    return path, {"ids": ids.numpy(), "mask": mask.numpy()}


def _kernels(session: carrack.InferenceSession, *op_types: str) -> list:
    return [step.kernel for step in session._program.steps if step.node.op_type in op_types]


def _conv(kernel) -> Conv:
    return kernel if isinstance(kernel, Conv) else kernel.inner


@needs_native
def test_the_table_picks_native_where_it_loads_and_numpy_when_forced(cnn, monkeypatch):
    native_session = carrack.InferenceSession(cnn)
    native = native_session.implementations()
    forced = carrack.InferenceSession(cnn, _numpy_options()).implementations()
    monkeypatch.setenv("CARRACK_NATIVE", "0")
    switched_off = carrack.InferenceSession(cnn).implementations()
    kinds = {name: name.rsplit("/", 1)[-1] for name in forced}
    assert sum("Conv" in k for k in kinds.values()) == 4 and any("Pool" in k for k in kinds.values())
    assert set(native.values()) == {"native"}
    assert forced == switched_off == dict.fromkeys(forced, "numpy")
    # natively, the depthwise-separable pair (its projection's name gone) is one carrack.InvertedResidual node
    assert set(forced) - set(native) == {"/dw/dw.2/Conv"} and set(native) < set(forced)
    assert [k.node.name for k in _kernels(native_session, "InvertedResidual")] == ["/dw/dw.0/Conv"]


@needs_native
def test_kernels_are_built_with_their_choice(cnn):
    native, forced = carrack.InferenceSession(cnn), carrack.InferenceSession(cnn, _numpy_options())
    for kernel in _kernels(native, "Conv", "FusedConv"):
        assert kernel.implementation == "native" and _conv(kernel).native is not None
    for kernel in _kernels(forced, "Conv", "FusedConv"):
        assert kernel.implementation == "numpy" and _conv(kernel).native is None and not _conv(kernel).prepared
    softmax, max_pool = _kernels(forced, "Softmax")[0], _kernels(forced, "MaxPool")[0]
    assert softmax.implementation == max_pool.implementation == "numpy"
    assert softmax.rows is None and max_pool.native is None
    softmax, max_pool = _kernels(native, "Softmax")[0], _kernels(native, "MaxPool")[0]
    assert softmax.rows is not None and max_pool.native is not None


def test_a_wrong_kernels_config_value_is_refused(cnn):
    options = carrack.SessionOptions()
    options.add_session_config_entry(select.KERNELS_CONFIG_KEY, "fast")
    with pytest.raises(InvalidArgument, match=r"carrack\.kernels.*auto, numpy.*'fast'"):
        carrack.InferenceSession(cnn, options)


def test_static_predicates_read_dtypes_and_constants():
    from carrack.ir.graph import Node

    float_input = {"x": Fact(TensorType(TensorProto.FLOAT, (1, 2, 9)))}
    pool_1d = Node("MaxPool", ["x"], ["y"], {"kernel_shape": [3]})
    assert select.choose(pool_1d, float_input) == "numpy"  # the native float pools are 2-D only
    pool_2d = Node("MaxPool", ["x"], ["y"], {"kernel_shape": [3, 3]})
    expected = "native" if select.library_loads("convolution") else "numpy"
    assert select.choose(pool_2d, {"x": Fact(TensorType(TensorProto.FLOAT, (1, 2, 9, 9)))}) == expected
    assert select.choose(pool_2d, {"x": Fact(TensorType(TensorProto.DOUBLE, (1, 2, 9, 9)))}) == "numpy"
    integer = Node("MatMulInteger", ["a", "b"], ["y"])
    assert select.choose(integer) == "numpy"  # the weight is not a constant
    weight = np.ones((4, 4), np.int8)
    expected = "native" if select.library_loads("qgemm") else "numpy"
    assert select.choose(integer, constants={"b": weight}) == expected
    assert select.choose(integer, constants={"b": weight}, numpy_only=True) == "numpy"
    assert select.choose(Node("Relu", ["x"], ["y"])) == "numpy"  # one implementation


@needs_native
def test_native_and_numpy_agree_on_a_torch_cnn(cnn):
    native, forced = carrack.InferenceSession(cnn), carrack.InferenceSession(cnn, _numpy_options())
    for batch, height, width in [(1, 16, 16), (2, 9, 31), (1, 1, 1), (3, 32, 8)]:
        x = np.random.default_rng(height).standard_normal((batch, 3, height, width)).astype(np.float32)
        np.testing.assert_allclose(native.run(None, {"x": x})[0], forced.run(None, {"x": x})[0], rtol=1e-5,
                                   atol=1e-6)


@needs_native
@pytest.mark.parametrize("level", [carrack.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                   carrack.GraphOptimizationLevel.ORT_ENABLE_ALL], ids=lambda level: level.name)
def test_native_and_numpy_agree_on_a_small_bert(bert, level):
    path, feed = bert
    options, numpy_options = carrack.SessionOptions(), _numpy_options()
    options.graph_optimization_level = numpy_options.graph_optimization_level = level
    native, forced = carrack.InferenceSession(path, options), carrack.InferenceSession(path, numpy_options)
    chosen = native.implementations()
    assert "native" in chosen.values() and set(forced.implementations().values()) == {"numpy"}
    assert chosen.keys() == forced.implementations().keys()
    for batch, seq in [(2, 9), (1, 17), (3, 4)]:
        rng = np.random.default_rng(seq)
        run_feed = {"ids": rng.integers(0, 99, (batch, seq)).astype(np.int64),
                    "mask": np.ones((batch, seq), np.int64)}
        run_feed["mask"][0, seq // 2:] = 0
        np.testing.assert_allclose(native.run(None, run_feed)[0], forced.run(None, run_feed)[0], rtol=1e-4,
                                   atol=1e-4)
    assert feed["ids"].shape == (2, 9)


_PICKLE_CHILD = textwrap.dedent("""
    import pickle, sys
    session, feeds = pickle.loads(sys.stdin.buffer.read())
    convs = [s.kernel for s in session._program.steps if s.node.op_type in ("Conv", "FusedConv")]
    outs = [session.run(None, feed) for feed in feeds]
    sys.stdout.buffer.write(pickle.dumps((outs, session.implementations(), [k.implementation for k in convs])))
""")


@pytest.mark.parametrize("forced", [False, True], ids=["table", "numpy"])
def test_choices_survive_pickling_into_another_process(cnn, forced):
    session = carrack.InferenceSession(cnn, _numpy_options() if forced else None)
    feeds = [{"x": np.random.default_rng(n).standard_normal((n, 3, 8 + n, 12)).astype(np.float32)}
             for n in (1, 2)]
    child = subprocess.run([sys.executable, "-c", _PICKLE_CHILD], input=pickle.dumps((session, feeds)),
                           capture_output=True, check=False)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    outs, chosen, conv_choices = pickle.loads(child.stdout)
    assert chosen == session.implementations()
    assert conv_choices == [k.implementation for k in _kernels(session, "Conv", "FusedConv")]
    assert set(conv_choices) == {"numpy" if forced or native_conv.load() is None else "native"}
    for got, feed in zip(outs, feeds):
        np.testing.assert_array_equal(got[0], session.run(None, feed)[0])


def _snapshot(kernel) -> dict:
    """Every attribute of a kernel by identity, and what its prepared table holds."""
    conv = _conv(kernel)
    state = {name: id(value) for name, value in vars(kernel).items()}
    state.update({f"conv.{name}": id(value) for name, value in vars(conv).items()})
    state["prepared"] = {shape: id(value) for shape, value in conv.prepared._by_shape.items()}
    state["prepared table"] = id(conv.prepared._by_shape)
    return state


@needs_native
def test_runs_never_change_a_convolution_kernel(cnn, monkeypatch):
    """The plan's per-size evaluation binds each convolution to the input shapes it evaluates; the runs that follow
    at those shapes use the bindings and leave every kernel attribute as it was."""
    calls = []
    original = native_conv.BoundConvolution.__call__
    monkeypatch.setattr(native_conv.BoundConvolution, "__call__",
                        lambda self, *a: calls.append(self) or original(self, *a))
    session = carrack.InferenceSession(cnn)
    plan = session._plan
    convs = _kernels(session, "Conv", "FusedConv")
    shapes = [(1, 16, 16), (2, 9, 31), (3, 32, 8)]
    for batch, height, width in shapes:
        plan.bind(plan.sizes_of({"batch": batch, "height": height, "width": width}))
    before = [_snapshot(k) for k in convs]
    assert all(len(_conv(k).prepared) == len(shapes) for k in convs)
    for batch, height, width in shapes * 2:
        x = np.random.default_rng(height).standard_normal((batch, 3, height, width)).astype(np.float32)
        session.run(None, {"x": x})
    assert [_snapshot(k) for k in convs] == before
    assert calls  # the prepared bindings did the work


@needs_native
def test_threads_running_new_shapes_at_once_agree_with_one_thread(cnn):
    session, reference = carrack.InferenceSession(cnn), carrack.InferenceSession(cnn)
    sizes = [(1 + i % 3, 8 + i, 20 - i) for i in range(12)]
    feeds = [{"x": np.random.default_rng(i).standard_normal((b, 3, h, w)).astype(np.float32)}
             for i, (b, h, w) in enumerate(sizes)]
    expected = [reference.run(None, feed)[0] for feed in feeds]
    results: dict[tuple[int, int, int], np.ndarray] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(t: int) -> None:
        try:
            start.wait()
            for round_ in range(3):
                for i in range(t, len(feeds), 2) if t % 2 else range(len(feeds)):
                    results[(t, i, round_)] = session.run(None, feeds[i])[0]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for (_, i, _), got in results.items():
        np.testing.assert_array_equal(got, expected[i])


def test_prepared_shapes_drop_the_oldest_as_the_plan_does():
    from carrack.ops import conv
    from carrack.plan import plan

    assert conv.MAX_PREPARED_SHAPES == plan.BOUND_CACHE_SIZE
    table = conv.PreparedShapes()
    for n in range(conv.MAX_PREPARED_SHAPES + 3):
        table.add((n,), n)
    assert len(table) == conv.MAX_PREPARED_SHAPES
    assert (2,) not in table and table.get((3,)) == 3 and table.get((conv.MAX_PREPARED_SHAPES + 2,)) is not None
    assert table.get((0,), "missing") == "missing"


@needs_native
def test_carrack_info_lists_the_choices(cnn, capsys, monkeypatch):
    from carrack.cli import main

    assert main(["info", cnn, "--implementations"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {tuple(line.split()) for line in lines[lines.index("implementations (nodes with more than one):") + 1:]}
    assert ("Softmax", "native", "1") in listed and ("MaxPool", "native", "1") in listed
    monkeypatch.setenv("CARRACK_NATIVE", "0")
    assert main(["info", cnn, "--implementations"]) == 0
    assert "native" not in capsys.readouterr().out.split("implementations")[1]


def test_the_memory_report_takes_scratch_from_the_kernel_class(cnn, monkeypatch):
    options = carrack.SessionOptions()
    options.graph_optimization_level = carrack.GraphOptimizationLevel.ORT_DISABLE_ALL  # Conv nodes stay Conv
    dims = {"batch": 1, "height": 16, "width": 16}

    def scratch(session: carrack.InferenceSession) -> dict[str, int]:
        return {n: b.nbytes for n, b in session.memory_plan(dims).blocks.items() if n.endswith(":scratch")}

    session = carrack.InferenceSession(cnn, options)
    convs = [n.name for n in session._model.graph.nodes if n.op_type == "Conv"]
    assert scratch(session) and set(scratch(session)) <= {f"{n}:scratch" for n in convs}
    monkeypatch.setattr(Conv, "scratch_bytes", classmethod(lambda cls, node, facts: 4096))
    assert scratch(carrack.InferenceSession(cnn, options)) == {f"{n}:scratch": 4096 for n in convs}


@needs_native
def test_a_numpy_session_never_touches_native_code(cnn, bert, monkeypatch):
    """Forced to numpy, no kernel asks for a native library while running (the native session does)."""
    from carrack import native

    bert_path, feed = bert
    x = np.random.default_rng(0).standard_normal((2, 3, 12, 10)).astype(np.float32)
    for forced in (True, False):
        options = _numpy_options() if forced else None
        sessions = [(carrack.InferenceSession(cnn, options), {"x": x}),
                    (carrack.InferenceSession(bert_path, options), feed)]
        asked: list[str] = []
        with monkeypatch.context() as patch:
            patch.setattr(native, "library", lambda name, load=native.library, seen=asked: seen.append(name) or
                          load(name))
            for session, session_feed in sessions:
                session.run(None, session_feed)
        assert (asked == []) == forced, sorted(set(asked))


def _conv_in_a_branch() -> bytes:
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    branch = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y_then"], pads=[1, 1, 1, 1])], "then", [],
                               [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["y_else"])], "else", [],
                              [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, None)])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 5, 5]),
                               helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@needs_native
def test_subgraph_nodes_are_chosen_by_the_same_table(monkeypatch):
    """Nodes the plan does not list (an If branch's) are chosen by the table when they are built, honouring the
    session's numpy setting."""
    model = _conv_in_a_branch()
    feed = {"x": np.random.default_rng(1).standard_normal((1, 3, 5, 5)).astype(np.float32), "c": np.array(True)}

    def branch_conv(session: carrack.InferenceSession) -> Conv:
        if_kernel = _kernels(session, "If")[0]
        programs = [v for v in vars(if_kernel).values() if hasattr(v, "steps")]
        return next(s.kernel for p in programs for s in p.steps if s.node.op_type == "Conv")

    native, forced = carrack.InferenceSession(model), carrack.InferenceSession(model, _numpy_options())
    assert branch_conv(native).implementation == "native" and branch_conv(native).native is not None
    assert branch_conv(forced).implementation == "numpy" and branch_conv(forced).native is None
    np.testing.assert_allclose(native.run(None, feed)[0], forced.run(None, feed)[0], rtol=1e-5, atol=1e-5)
