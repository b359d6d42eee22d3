"""64-byte alignment of everything carrack allocates for constants, and misaligned caller inputs.

Constants (initializers from raw_data, typed fields or external files, Constant node values, 0-d scalars, sparse
initializers, and what the optimizer folds) must start on a 64-byte boundary. Caller inputs may start anywhere
(np.frombuffer at an odd byte offset, uint16 storage sliced at an odd element and viewed as float32, two operands
with different misalignments): results must be bit-identical to those for an aligned copy, and the caller's bytes
must not change.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.onnx.importer import load_model
from carrack.onnx.tensors import IN_PLACE_RAW_BYTES, aligned_copy, ensure_aligned
from carrack.runtime.feeds import as_native_array
from tests.test_layouts import (
    F32,
    FAMILIES,
    SETTINGS,
    Case,
    Layout,
    carrack_session,
    check_layouts,
    draw_rng,
)

ALIGN = 64


def aligned(a: np.ndarray) -> bool:
    return a.ctypes.data % ALIGN == 0


def program_constants(sess: carrack.InferenceSession) -> dict[str, np.ndarray]:
    """Every constant the compiled program holds: initializers and Constant kernels' values."""
    program = sess._program
    names = {slot: name for name, slot in program.slot_of.items()}
    found = {names[slot]: value for slot, value in program.constants.items()}
    for step in program.steps:
        if step.node.op_type == "Constant":
            found[step.node.outputs[0]] = step.kernel.value
    return found


def model_of(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


# -- constants ---------------------------------------------------------------------------------------------------------

_CONST_DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.int8, np.uint8, np.bool_]


@pytest.mark.parametrize("dtype", _CONST_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (1,), (3,), (7, 5), (IN_PLACE_RAW_BYTES // 4 + 3,)], ids=str)
@pytest.mark.parametrize("raw", [True, False], ids=["raw_data", "typed_field"])
def test_initializers_are_aligned(dtype, shape, raw):
    values = (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
    tensor = numpy_helper.from_array(values, "w")
    if not raw:
        tensor = helper.make_tensor("w", tensor.data_type, shape, values.reshape(-1).tolist())
    node = helper.make_node("Identity", ["w"], ["y"])
    model = load_model(model_of([node], [], [helper.make_tensor_value_info("y", tensor.data_type, shape)], [tensor]))
    w = model.graph.initializers["w"]
    assert aligned(w) and w.shape == shape and w.dtype == values.dtype and np.array_equal(w, values)


def test_constant_node_values_are_aligned():
    attrs = {"c_tensor": dict(value=numpy_helper.from_array(np.arange(5, dtype=np.float32))),
             "c_scalar": dict(value=numpy_helper.from_array(np.array(2.5, np.float64))),
             "c_float": dict(value_float=1.5), "c_floats": dict(value_floats=[1.0, 2.0]),
             "c_int": dict(value_int=3), "c_ints": dict(value_ints=[4, 5, 6]),
             "c_sparse": dict(sparse_value=helper.make_sparse_tensor(
                 numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "v"),
                 numpy_helper.from_array(np.array([1, 3], np.int64), "i"), [5]))}
    nodes = [helper.make_node("Constant", [], [name], **a) for name, a in attrs.items()]
    outputs = [helper.make_empty_tensor_value_info(name) for name in attrs]
    sess = carrack.InferenceSession(model_of(nodes, [], outputs).SerializeToString())
    results = dict(zip(attrs, sess.run(None, {})))
    assert results["c_float"].dtype == np.float32 and results["c_float"].shape == () and results["c_float"] == 1.5
    assert results["c_ints"].dtype == np.int64 and results["c_ints"].tolist() == [4, 5, 6]
    assert results["c_int"].shape == () and results["c_int"] == 3
    assert results["c_sparse"].tolist() == [0, 1, 0, 2, 0]
    constants = program_constants(sess)
    assert set(attrs) <= set(constants)
    for name, value in constants.items():
        assert aligned(value), name


def test_folded_constants_are_aligned():
    """Constant folding and BatchNormalization folding make new arrays; the session aligns them."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in
             [("a", (3, 5)), ("b", (3, 5)), ("w", (4, 3, 3, 3)), ("scale", (4,)), ("bias", (4,)), ("mean", (4,))]]
    inits.append(numpy_helper.from_array(rng.random(4).astype(np.float32) + 0.5, "var"))
    nodes = [helper.make_node("Add", ["a", "b"], ["ab"]), helper.make_node("Mul", ["ab", "ab"], ["c"]),
             helper.make_node("Conv", ["x", "w"], ["conv"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["conv", "scale", "bias", "mean", "var"], ["bn"]),
             helper.make_node("ReduceSum", ["bn"], ["s"], keepdims=0),
             helper.make_node("Add", ["s", "c"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])
    sess = carrack.InferenceSession(model_of(nodes, [x], [y], inits).SerializeToString())
    assert "BatchNormalization" not in [n.op_type for n in sess._model.graph.nodes]
    for name, value in program_constants(sess).items():
        assert aligned(value), name
    for name, value in sess._model.graph.initializers.items():
        assert aligned(value), name


def test_constant_of_shape_fold_stays_a_view():
    node = helper.make_node("ConstantOfShape", ["shape"], ["c"],
                            value=numpy_helper.from_array(np.array([2.5], np.float32)))
    add = helper.make_node("Add", ["x", "c"], ["y"])
    shape = numpy_helper.from_array(np.array([512, 512], np.int64), "shape")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [512, 512])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [512, 512])
    sess = carrack.InferenceSession(model_of([node, add], [x], [y], [shape]).SerializeToString())
    assert "c" in program_constants(sess)
    for name, value in program_constants(sess).items():
        assert aligned(value), name
        if name == "c":
            assert value.strides == (0, 0)  # not materialised by the alignment pass
    assert sess.run(None, {"x": np.ones((512, 512), np.float32)})[0][3, 7] == 3.5


def test_sparse_initializer_is_aligned():
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.array([7, 8], np.int64), "w"),
                                       numpy_helper.from_array(np.array([[0, 1], [2, 2]], np.int64), "idx"), [3, 3])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [3, 3])
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [], [y], sparse_initializer=[sparse])
    model = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    w = model.graph.initializers["w"]
    assert aligned(w) and w.tolist() == [[0, 7, 0], [0, 0, 0], [0, 0, 8]]


def test_ensure_aligned_copies_only_when_needed():
    good = aligned_copy(np.arange(10, dtype=np.float32))
    assert ensure_aligned(good) is good
    raw = np.zeros(41 + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN + 1
    odd = raw[start:start + 40].view(np.float32)
    fixed = ensure_aligned(odd)
    assert fixed is not odd and aligned(fixed) and np.array_equal(fixed, odd)
    swapped = ensure_aligned(aligned_copy(np.arange(3, dtype=np.float32)).astype(">f4"))
    assert swapped.dtype.isnative and aligned(swapped)
    # a broadcast (zero-stride) constant, as ConstantOfShape folds to, stays a view: only its one value is copied
    wide = np.broadcast_to(odd[1:2].reshape(()), (1000, 1000))
    fixed = ensure_aligned(wide)
    assert aligned(fixed) and fixed.strides == (0, 0) and fixed.shape == wide.shape and fixed[0, 0] == odd[1]


# -- misaligned inputs -------------------------------------------------------------------------------------------------

def odd_float32_view(values: np.ndarray) -> np.ndarray:
    """values in uint16 storage sliced at an odd element and viewed as float32 (the view starts 2 bytes in)."""
    storage = np.arange(2 * values.size + 2, dtype=np.uint16)
    view = storage[1:1 + 2 * values.size].view(np.float32).reshape(values.shape)
    view[...] = values
    return view


def test_float32_view_of_sliced_uint16_storage():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((6, 10)).astype(np.float32), rng.standard_normal((10, 4)).astype(np.float32)
    va, vb = odd_float32_view(a), odd_float32_view(b)
    assert va.ctypes.data % 4 == 2 and not va.flags.aligned
    before = (va.base.tobytes(), vb.base.tobytes())
    for case, args in [(Case("MatMul", (F32, F32)), (va, vb)), (Case("Add", (F32, F32)), (va, va)),
                       (Case("Sigmoid", (F32,)), (va,)),
                       (Case("ReduceSum", (F32,), attrs=(("keepdims", 0),), consts=(("axes", (1,)),)), (va,))]:
        sess = carrack_session(case)
        feeds = {f"x{i}": v for i, v in enumerate(args)}
        got = sess.run(None, feeds)[0]
        expected = sess.run(None, {k: np.array(v) for k, v in feeds.items()})[0]
        assert got.tobytes() == expected.tobytes() and got.dtype == expected.dtype, case.op
    assert (va.base.tobytes(), vb.base.tobytes()) == before


def test_misaligned_feeds_reach_kernels_aligned():
    raw = np.zeros(64 + 3 + 48, np.uint8)
    start = (-raw.ctypes.data) % ALIGN + 3
    x = np.frombuffer(raw.data, np.uint8, 48, start).view(np.float64).reshape(2, 3)  # 3 bytes past a boundary
    x.flags.writeable = False
    fixed = as_native_array("x", x)
    assert aligned(fixed) and fixed.flags.c_contiguous and np.array_equal(fixed, x)
    assert not x.flags.writeable and fixed.flags.writeable  # the copy is ours


@pytest.mark.parametrize("family", sorted(FAMILIES))
@SETTINGS
@given(data=st.data())
def test_misaligned_inputs_match_aligned(family, data):
    """Every input at its own byte offset 0-15 (so operands never share an alignment), otherwise contiguous."""
    make, dtypes = FAMILIES[family]
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    case, values = make(data, draw_rng(data), dtype)
    offsets = [data.draw(st.integers(0, 15), label=f"offset{i}") for i in range(len(values))]
    readonly = data.draw(st.booleans(), label="readonly")
    check_layouts(case, values, [Layout(offset=o, readonly=readonly) for o in offsets])
