"""Shape and layout kernels against onnxruntime (or hand-computed values where onnxruntime lacks the case):
old opset versions, negative axes, clamping, empty tensors, error messages, and no writes into inputs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.ir.graph import Node
from carrack.ops import registry

I64 = np.int64
INT64_MAX, INT64_MIN = np.iinfo(np.int64).max, np.iinfo(np.int64).min
X = np.arange(24, dtype=np.float32).reshape(2, 3, 4)


# -- helpers (test_indexing.py uses them too) ------------------------------------------------------------------------

def make_model(op: str, inputs: list[tuple[str, np.ndarray | None]], n_outputs: int = 1, opset: int = 18,
               **attrs) -> onnx.ModelProto:
    """One `op` node; inputs given as None are omitted optional inputs."""
    names = [name if value is not None else "" for name, value in inputs]
    while names and names[-1] == "":
        names.pop()
    outputs = [f"y{i}" for i in range(n_outputs)]
    node = helper.make_node(op, names, outputs, **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                    for n, v in inputs if v is not None]
    graph_outputs = [helper.make_value_info(o, onnx.TypeProto()) for o in outputs]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def run_carrack(op: str, inputs: list[tuple[str, np.ndarray | None]], n_outputs: int = 1, opset: int = 18,
                **attrs) -> list:
    model = make_model(op, inputs, n_outputs, opset, **attrs)
    feed = {n: v for n, v in inputs if v is not None}
    return carrack.InferenceSession(model.SerializeToString()).run(None, feed)


def assert_arrays_equal(got: list, expected: list, rtol: float = 0.0) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        e = np.asarray(e)
        assert g.dtype == e.dtype, (g.dtype, e.dtype)
        assert g.shape == e.shape, (g.shape, e.shape)
        if rtol:
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol)
        else:
            np.testing.assert_array_equal(g, e)


def assert_like_ort(op: str, inputs: list[tuple[str, np.ndarray | None]], n_outputs: int = 1, opset: int = 18,
                    rtol: float = 0.0, **attrs) -> None:
    """carrack's outputs equal onnxruntime's (dtype, shape, values), and the inputs are left untouched."""
    model = make_model(op, inputs, n_outputs, opset, **attrs).SerializeToString()
    feed = {n: v for n, v in inputs if v is not None}
    before = {n: v.copy() for n, v in feed.items()}
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feed)
    got = carrack.InferenceSession(model).run(None, feed)
    assert_arrays_equal(got, expected, rtol)
    for n, v in feed.items():
        np.testing.assert_array_equal(v, before[n])


def kernel(op: str, version: int, n_inputs: int = 1, n_outputs: int = 1, **attrs) -> registry.Kernel:
    """A kernel built directly, to look at what `run` returns (views, exact objects)."""
    node = Node(op_type=op, inputs=[f"x{i}" for i in range(n_inputs)], outputs=[f"y{i}" for i in range(n_outputs)],
                attrs=attrs)
    cls, resolved = registry.resolve("", op, version)
    return cls(node, resolved)


def i64(*values) -> np.ndarray:
    return np.array(values, dtype=I64)


# -- Reshape -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4, 0, -1), (-1,), (0, 0, 2, 2), (6, -1), (2, 1, 3, 4)])
def test_reshape_like_ort(shape):
    assert_like_ort("Reshape", [("x", X), ("s", i64(*shape))], opset=14)


def test_reshape_opset1_shape_attribute():
    assert_arrays_equal(run_carrack("Reshape", [("x", X)], opset=1, shape=[4, 0, -1]), [X.reshape(4, 3, 2)])


def test_reshape_allowzero_keeps_zero_dims():
    x = np.zeros((0, 3), np.float32)
    assert_like_ort("Reshape", [("x", x), ("s", i64(3, 0))], opset=14, allowzero=1)
    # without allowzero the 0 copies the input's dim
    assert_arrays_equal(run_carrack("Reshape", [("x", X), ("s", i64(0, 12))], opset=14), [X.reshape(2, 12)])


def test_reshape_errors():
    with pytest.raises(carrack.RunFailure, match="cannot reshape"):
        run_carrack("Reshape", [("x", X), ("s", i64(5, -1))])
    with pytest.raises(carrack.RunFailure, match="more than one -1"):
        run_carrack("Reshape", [("x", X), ("s", i64(-1, -1))])


def test_reshape_returns_a_view():
    out = kernel("Reshape", 14, 2).run(X, i64(6, 4))
    assert np.shares_memory(out, X)


# -- Transpose / Concat / Split ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("perm", [None, [1, 2, 0], [0, 2, 1]])
def test_transpose(perm):
    attrs = {} if perm is None else {"perm": perm}
    assert_like_ort("Transpose", [("x", X)], **attrs)


def test_transpose_rejects_bad_perm():
    with pytest.raises(carrack.RunFailure, match="perm"):
        run_carrack("Transpose", [("x", X)], perm=[0, 0, 1])


def test_concat_negative_axis_and_empty_input():
    assert_like_ort("Concat", [("a", X), ("b", np.zeros((2, 0, 4), np.float32)), ("c", X)], axis=-2)


def test_concat_opset1_default_axis_is_1():
    assert_arrays_equal(run_carrack("Concat", [("a", X), ("b", X)], opset=1), [np.concatenate([X, X], axis=1)])


def test_concat_strings():
    a, b = np.array(["a", "b"], dtype=object), np.array(["c"], dtype=object)
    assert_like_ort("Concat", [("a", a), ("b", b)], axis=0)


@pytest.mark.parametrize("opset,attrs,split", [
    (2, {"axis": 2, "split": [1, 3]}, None),
    (2, {"axis": 2}, None),
    (11, {"axis": -1, "split": [3, 1]}, None),
    (13, {"axis": 1}, i64(2, 1)),
    (13, {"axis": 0}, None),
    (18, {"axis": 2, "num_outputs": 2}, None),
])
def test_split_versions(opset, attrs, split):
    assert_like_ort("Split", [("x", X), ("split", split)], n_outputs=2, opset=opset, **attrs)


def test_split_num_outputs_uneven_last_chunk():
    x = np.arange(7, dtype=np.float32)
    assert_like_ort("Split", [("x", x)], n_outputs=4, opset=18, num_outputs=4)
    got = run_carrack("Split", [("x", x)], n_outputs=3, opset=18, num_outputs=3)
    assert [g.tolist() for g in got] == [[0, 1, 2], [3, 4, 5], [6]]


def test_split_opset1_split_input():
    got = run_carrack("Split", [("x", X), ("s", np.array([1, 3], np.float32))], n_outputs=2, opset=1, axis=2)
    assert_arrays_equal(got, [X[..., :1], X[..., 1:]])


def test_split_empty_split_input_means_even():
    assert_like_ort("Split", [("x", np.arange(6, dtype=np.float32)), ("s", i64())], n_outputs=2, opset=13)


def test_split_errors():
    with pytest.raises(carrack.RunFailure, match="split"):
        run_carrack("Split", [("x", X), ("s", i64(1, 1))], n_outputs=2, opset=13, axis=2)
    with pytest.raises(carrack.RunFailure, match="evenly"):
        run_carrack("Split", [("x", X)], n_outputs=3, opset=13, axis=2)


# -- Slice -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("starts,ends,axes,steps", [
    ((INT64_MAX, -1), (INT64_MIN, INT64_MIN), (2, 1), (-1, -2)),
    ((-100, 1), (100, -1), (-1, -2), (3, 1)),
    ((5,), (-7,), (2,), (-2,)),
    ((4,), (0,), (2,), (1,)),
    ((1, 0, 0), (INT64_MAX, INT64_MAX, INT64_MAX), None, None),
    ((0,), (1,), None, None),
    ((-1,), (-INT64_MAX,), (0,), (-1,)),
])
def test_slice_clamping_and_negative_steps(starts, ends, axes, steps):
    inputs = [("x", X), ("s", i64(*starts)), ("e", i64(*ends)),
              ("a", None if axes is None else i64(*axes)), ("st", None if steps is None else i64(*steps))]
    assert_like_ort("Slice", inputs, opset=13)


def test_slice_int32_inputs():
    assert_like_ort("Slice", [("x", X), ("s", np.array([0, 1], np.int32)), ("e", np.array([1, 3], np.int32))])


@pytest.mark.parametrize("opset", [1, 7])
def test_slice_attributes_before_opset10(opset):
    got = run_carrack("Slice", [("x", X)], opset=opset, starts=[1, -3], ends=[100, -1], axes=[2, 1])
    assert_arrays_equal(got, [X[:, -3:-1, 1:]])
    got = run_carrack("Slice", [("x", X)], opset=opset, starts=[1], ends=[2])
    assert_arrays_equal(got, [X[1:2]])


def test_slice_zero_step_is_an_error():
    with pytest.raises(carrack.RunFailure, match="step"):
        run_carrack("Slice", [("x", X), ("s", i64(0)), ("e", i64(1)), ("a", i64(0)), ("st", i64(0))])


# -- Squeeze / Unsqueeze / Flatten ---------------------------------------------------------------------------------

def test_squeeze_versions():
    x = np.zeros((1, 3, 1), np.float32)
    assert_like_ort("Squeeze", [("x", x)], opset=11)
    assert_like_ort("Squeeze", [("x", x)], opset=11, axes=[-1])
    assert_like_ort("Squeeze", [("x", x), ("a", i64(-1, 0))], opset=13)
    assert_like_ort("Squeeze", [("x", x), ("a", i64())], opset=13)
    assert_arrays_equal(run_carrack("Squeeze", [("x", x)], opset=1, axes=[0]), [x.reshape(3, 1)])


def test_squeeze_non_unit_axis_is_an_error():
    with pytest.raises(carrack.RunFailure, match="size is not 1"):
        run_carrack("Squeeze", [("x", X), ("a", i64(1))])


def test_unsqueeze_versions():
    x = np.zeros((3, 4), np.float32)
    assert_like_ort("Unsqueeze", [("x", x), ("a", i64(-1, 0, 3))], opset=13)
    assert_like_ort("Unsqueeze", [("x", x)], opset=11, axes=[4, 0, -3])
    assert_arrays_equal(run_carrack("Unsqueeze", [("x", x)], opset=1, axes=[0, 3]), [x.reshape(1, 3, 4, 1)])


def test_unsqueeze_scalar_and_repeated_axis():
    assert_like_ort("Unsqueeze", [("x", np.array(5, np.int32)), ("a", i64(0, 1))], opset=13)
    with pytest.raises(carrack.RunFailure, match="repeats"):
        run_carrack("Unsqueeze", [("x", X), ("a", i64(0, 0))], opset=13)


@pytest.mark.parametrize("axis", [0, 1, 3, -1, -3])
def test_flatten(axis):
    assert_like_ort("Flatten", [("x", X)], opset=13, axis=axis)


def test_flatten_zero_sized():
    assert_like_ort("Flatten", [("x", np.zeros((0, 3, 2), np.float32))], opset=13, axis=2)


# -- Expand / Tile -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 1, 4), (3, 1), (1,), (2, 3, 5)])
def test_expand_bidirectional(shape):
    assert_like_ort("Expand", [("x", np.arange(3, dtype=np.float32).reshape(3, 1)), ("s", i64(*shape))], opset=13)


def test_expand_output_is_writeable_copy():
    x = np.arange(3, dtype=np.float32)
    out = kernel("Expand", 13, 2).run(x, i64(2, 3))
    assert out.flags.writeable and not np.shares_memory(out, x)


def test_tile():
    assert_like_ort("Tile", [("x", X), ("r", i64(1, 2, 0))], opset=13)
    assert_like_ort("Tile", [("x", X), ("r", i64(2, 1, 3))], opset=6)


def test_tile_opset1_tiles_and_axis_inputs():
    got = run_carrack("Tile", [("x", X), ("t", np.array(3, np.float32)), ("a", np.array(1, np.float32))], opset=1)
    assert_arrays_equal(got, [np.tile(X, (1, 3, 1))])


# -- Pad -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads", [(0, 1, 2, 1, 0, 2), (0, -1, 1, 0, 1, -2), (1, 0, 0, 0, 0, 0)])
def test_pad_modes(mode, pads):
    assert_like_ort("Pad", [("x", X), ("p", i64(*pads))], opset=19, mode=mode)


def test_pad_negative_pads_crop_before_padding():
    x = np.array([1, 2, 3], np.float32)
    assert_like_ort("Pad", [("x", x), ("p", i64(2, -1))], opset=19, mode="wrap")
    assert_like_ort("Pad", [("x", x), ("p", i64(-2, 4))], opset=19, mode="wrap")


def test_pad_constant_value_and_axes():
    assert_like_ort("Pad", [("x", X), ("p", i64(1, -1, 2, 0)), ("v", np.array(3, np.float32)), ("a", i64(-1, 0))])
    assert_like_ort("Pad", [("x", X.astype(np.int32)), ("p", i64(0, 1, 1, 0, 1, 1)), ("v", np.array(7, np.int32))],
                    opset=13)
    assert_like_ort("Pad", [("x", np.array([True, False])), ("p", i64(1, 1)), ("v", np.array(True))])


def test_pad_attribute_versions():
    got = run_carrack("Pad", [("x", X)], opset=1, paddings=[0, 1, 1, 0, 1, 1], mode="edge")
    assert_arrays_equal(got, [np.pad(X, [(0, 0), (1, 1), (1, 1)], mode="edge")])
    assert_like_ort("Pad", [("x", X)], opset=2, pads=[0, 1, 1, 0, 1, -1], value=2.5)


def test_pad_errors_like_onnxruntime():
    with pytest.raises(carrack.RunFailure, match="reflect"):
        run_carrack("Pad", [("x", np.array([1, 2, 3], np.float32)), ("p", i64(3, 0))], mode="reflect")
    with pytest.raises(carrack.RunFailure, match="empty axis"):
        run_carrack("Pad", [("x", np.zeros((0, 3), np.float32)), ("p", i64(1, 0, 1, 0))], mode="edge")
    with pytest.raises(carrack.RunFailure, match="pads"):
        run_carrack("Pad", [("x", X), ("p", i64(1, 1))])


def test_pad_strings_default_to_empty():
    got = run_carrack("Pad", [("x", np.array(["a", "b"], dtype=object)), ("p", i64(1, 1))])
    assert got[0].dtype == object and got[0].tolist() == ["", "a", "b", ""]


# -- Shape / Size / ConstantOfShape / Constant ------------------------------------------------------------------------

@pytest.mark.parametrize("attrs", [{}, {"start": -2}, {"start": -10, "end": 10}, {"start": 2, "end": 1},
                                   {"end": -1}])
def test_shape(attrs):
    assert_like_ort("Shape", [("x", X)], opset=15, **attrs)


def test_shape_of_scalar_and_size():
    assert_like_ort("Shape", [("x", np.array(1.0, np.float32))], opset=13)
    assert_like_ort("Size", [("x", X)], opset=13)
    assert_like_ort("Size", [("x", np.zeros((0, 2), np.float32))], opset=13)


def test_constant_of_shape():
    assert_like_ort("ConstantOfShape", [("s", i64(2, 0))])
    assert_like_ort("ConstantOfShape", [("s", i64())], value=helper.make_tensor("v", TensorProto.INT32, [1], [7]))
    assert_like_ort("ConstantOfShape", [("s", i64(2, 3))], value=helper.make_tensor("v", TensorProto.BOOL, [1], [1]))


@pytest.mark.parametrize("attr,value,expected", [
    ("value_float", 1.5, np.array(1.5, np.float32)),
    ("value_floats", [1.5, 2.0], np.array([1.5, 2.0], np.float32)),
    ("value_int", 3, np.array(3, I64)),
    ("value_ints", [3, 4], np.array([3, 4], I64)),
    ("value_string", "hi", np.array("hi", dtype=object)),
    ("value_strings", ["a", "b"], np.array(["a", "b"], dtype=object)),
    ("value", helper.make_tensor("t", TensorProto.FLOAT16, [2], [1.0, 2.0]), np.array([1, 2], np.float16)),
])
def test_constant_attribute_forms(attr, value, expected):
    node = helper.make_node("Constant", [], ["y0"], **{attr: value})
    graph = helper.make_graph([node], "g", [], [helper.make_value_info("y0", onnx.TypeProto())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    assert_arrays_equal(carrack.InferenceSession(model.SerializeToString()).run(None, {}), [expected])


def test_constant_sparse_value():
    values = helper.make_tensor("v", TensorProto.FLOAT, [2], [5.0, 6.0])
    indices = helper.make_tensor("i", TensorProto.INT64, [2], [1, 4])
    sparse = helper.make_sparse_tensor(values, indices, [2, 3])
    node = helper.make_node("Constant", [], ["y0"], sparse_value=sparse)
    graph = helper.make_graph([node], "g", [], [helper.make_value_info("y0", onnx.TypeProto())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    expected = np.array([[0, 5, 0], [0, 6, 0]], np.float32)
    assert_arrays_equal(carrack.InferenceSession(model.SerializeToString()).run(None, {}), [expected])


def test_constant_needs_exactly_one_value():
    node = helper.make_node("Constant", [], ["y0"], value_int=1, value_float=2.0)
    graph = helper.make_graph([node], "g", [], [helper.make_value_info("y0", onnx.TypeProto())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    with pytest.raises(carrack.InvalidModel, match="exactly one"):
        carrack.InferenceSession(model.SerializeToString())


# -- Range / EyeLike / Trilu -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,start,limit,delta", [
    (np.int32, 10, 4, -3), (I64, 1, 9, 3), (np.int16, 0, 0, 1), (np.int64, 5, 1, 1),
    (np.float32, 1.0, 9.3, 0.1), (np.float64, -2.5, 3.0, 0.75), (np.float32, 3.0, 1.0, -0.5),
])
def test_range(dtype, start, limit, delta):
    inputs = [("a", np.array(start, dtype)), ("b", np.array(limit, dtype)), ("c", np.array(delta, dtype))]
    assert_like_ort("Range", inputs, opset=11, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_range_half_types_stash_in_float32(dtype):
    inputs = [("a", np.array(1, dtype)), ("b", np.array(300, dtype)), ("c", np.array(1, dtype))]
    got = run_carrack("Range", inputs, opset=27)[0]
    assert got.dtype == dtype and got.shape == (299,)
    np.testing.assert_array_equal(got.astype(np.float32), np.arange(1, 300, dtype=np.float32).astype(dtype))


def test_range_zero_delta_is_an_error():
    with pytest.raises(carrack.RunFailure, match="delta"):
        run_carrack("Range", [("a", np.array(0, I64)), ("b", np.array(3, I64)), ("c", np.array(0, I64))], opset=11)


@pytest.mark.parametrize("attrs", [{}, {"k": -1}, {"k": 2, "dtype": TensorProto.DOUBLE}, {"k": 7}])
def test_eye_like(attrs):
    assert_like_ort("EyeLike", [("x", np.zeros((3, 5), np.int32))], opset=9, **attrs)


def test_eye_like_bfloat16():
    got = run_carrack("EyeLike", [("x", np.zeros((2, 3), ml_dtypes.bfloat16))], opset=22)[0]
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), np.eye(2, 3))


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 2, -1, -5, INT64_MAX, INT64_MIN])
def test_trilu(upper, k):
    inputs = [("x", X), ("k", None if k is None else np.array(k, I64))]
    assert_like_ort("Trilu", inputs, opset=14, upper=upper)


def test_trilu_bool_and_int():
    assert_like_ort("Trilu", [("x", (X % 3).astype(bool))], opset=14, upper=0)
    assert_like_ort("Trilu", [("x", X.astype(I64)), ("k", np.array(1, I64))], opset=14)


# -- DepthToSpace / SpaceToDepth / CenterCropPad ----------------------------------------------------------------------

@pytest.mark.parametrize("opset,attrs", [(1, {}), (11, {}), (13, {"mode": "DCR"}), (13, {"mode": "CRD"})])
def test_depth_to_space(opset, attrs):
    x = np.arange(2 * 8 * 2 * 3, dtype=np.float32).reshape(2, 8, 2, 3)
    assert_like_ort("DepthToSpace", [("x", x)], opset=opset, blocksize=2, **attrs)


@pytest.mark.parametrize("opset", [1, 13])
def test_space_to_depth(opset):
    x = np.arange(2 * 2 * 4 * 6, dtype=np.float32).reshape(2, 2, 4, 6)
    assert_like_ort("SpaceToDepth", [("x", x)], opset=opset, blocksize=2)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_space_to_depth_inverts_depth_to_space(mode):
    x = np.arange(2 * 2 * 4 * 6, dtype=np.float32).reshape(2, 2, 4, 6)
    depth = run_carrack("SpaceToDepth", [("x", x)], opset=28, blocksize=2, mode=mode)[0]
    back = run_carrack("DepthToSpace", [("x", depth)], opset=28, blocksize=2, mode=mode)[0]
    np.testing.assert_array_equal(back, x)


def test_depth_to_space_rejects_bad_channels():
    with pytest.raises(carrack.RunFailure, match="divisible"):
        run_carrack("DepthToSpace", [("x", np.zeros((1, 6, 2, 2), np.float32))], opset=13, blocksize=2)


@pytest.mark.parametrize("shape,axes", [((5, 1), [-1, 1]), ((3, 6, 3), None), ((1, 2, 7), None), ((4,), [2])])
def test_center_crop_pad(shape, axes):
    attrs = {} if axes is None else {"axes": axes}
    assert_like_ort("CenterCropPad", [("x", X), ("s", i64(*shape))], opset=18, **attrs)


# -- Identity --------------------------------------------------------------------------------------------------------

def test_identity_passes_tensors_sequences_and_none():
    k = kernel("Identity", 16)
    assert k.run(X) is X
    seq = [X, X]
    assert k.run(seq) == (seq,)
    assert k.run(None) == (None,)
