"""Bounded resources: allocations whose size comes from run-time data or attributes are checked before they are made,
against SessionOptions.memory_limit_bytes and the machine's memory, with an error naming the node, the value and the
size (carrack.runtime.allocator.check_allocation)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.errors import InvalidArgument, MemoryLimitExceeded, RunFailure
from carrack.runtime.allocator import MEMORY_LIMIT, check_allocation, check_shape, physical_memory_bytes

MiB = 1 << 20


def _session(nodes, inputs, outputs, initializers=(), limit: int = 0, opset: int = 17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    options = carrack.SessionOptions()
    options.memory_limit_bytes = limit
    return carrack.InferenceSession(model.SerializeToString(), options)


def _shape_input(name="shape", n=1):
    return helper.make_tensor_value_info(name, TensorProto.INT64, [n])


def _out(name="y", elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, None)


def test_check_allocation_refuses_beyond_the_limit_and_the_machine():
    check_allocation(10 * MiB, "value 'v'", limit=20 * MiB)
    with pytest.raises(MemoryLimitExceeded, match="value 'v' needs 31,457,280 bytes"):
        check_allocation(30 * MiB, "value 'v'", limit=20 * MiB)
    with pytest.raises(InvalidArgument, match="more than this machine's physical memory"):
        check_allocation(physical_memory_bytes() + 1, "value 'v'", limit=0)


def test_check_shape_names_the_value_only_when_it_refuses():
    named = []

    def name() -> str:
        named.append(1)
        return "Expand node 'e' output 'y'"

    check_shape([1, 64, 768], np.float32, name)
    check_shape((), np.float64, name)
    assert named == []
    with pytest.raises(InvalidArgument, match=r"Expand node 'e' output 'y' would have a negative dim: shape \[2, -1\]"):
        check_shape([2, -1], np.float32, name)
    with pytest.raises(InvalidArgument, match="'y' would have rank 65; arrays have at most 64 dims"):
        check_shape([1] * 65, np.float32, name)
    with pytest.raises(MemoryLimitExceeded, match=r"value 'v' \(shape \[1024, 1024\], float32\) needs 4,194,304"):
        token = MEMORY_LIMIT.set(2 * MiB)
        try:
            check_shape([1024, 1024], np.float32, "value 'v'")
        finally:
            MEMORY_LIMIT.reset(token)


def test_check_shape_counts_numpy_integer_dims_exactly():
    # 2**32 * 2**32 wraps to 0 in int64: the size must still be seen as 2**64 elements
    wrapping = [np.int64(2**32), np.int64(2**32)]
    with pytest.raises(InvalidArgument, match=r"'y' \(shape \[4294967296, 4294967296\], float32\).*physical"):
        check_shape(wrapping, np.float32, "value 'y'")
    check_shape([np.int64(3), np.int32(4)], np.float32, "value 'y'")


def test_constant_of_shape_fed_a_huge_shape_names_the_node_and_value():
    s = _session([helper.make_node("ConstantOfShape", ["shape"], ["y"], name="fill")], [_shape_input()], [_out()])
    with pytest.raises(InvalidArgument, match=r"ConstantOfShape node 'fill' output 'y' \(shape \[1099511627776\]"):
        s.run(None, {"shape": np.array([2**40], np.int64)})
    assert s.run(None, {"shape": np.array([3], np.int64)})[0].shape == (3,)


def test_a_run_that_would_exceed_the_memory_limit_is_refused_before_allocating():
    s = _session([helper.make_node("ConstantOfShape", ["shape"], ["y"], name="fill")], [_shape_input()], [_out()],
                 limit=256 * MiB)
    with pytest.raises(MemoryLimitExceeded, match="'y'.*more than SessionOptions.memory_limit_bytes = 268,435,456"):
        s.run(None, {"shape": np.array([2**28], np.int64)})  # 1 GiB of float32
    assert s.run(None, {"shape": np.array([1000], np.int64)})[0].shape == (1000,)


@pytest.mark.parametrize("node, inputs, feed, value", [
    (helper.make_node("Range", ["a", "b", "c"], ["y"]),
     [helper.make_tensor_value_info(n, TensorProto.INT64, []) for n in "abc"],
     {"a": np.array(0), "b": np.array(2**45), "c": np.array(1)}, "y"),
    (helper.make_node("Expand", ["x", "shape"], ["y"]),
     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]), _shape_input(n=2)],
     {"x": np.ones(1, np.float32), "shape": np.array([2**22, 2**22], np.int64)}, "y"),
    (helper.make_node("Tile", ["x", "shape"], ["y"]),
     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]), _shape_input()],
     {"x": np.ones(4, np.float32), "shape": np.array([2**42], np.int64)}, "y"),
    (helper.make_node("Pad", ["x", "shape"], ["y"]),
     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]), _shape_input(n=2)],
     {"x": np.ones(4, np.float32), "shape": np.array([0, 2**42], np.int64)}, "y"),
    (helper.make_node("OneHot", ["x", "shape", "v"], ["y"]),
     [helper.make_tensor_value_info("x", TensorProto.INT64, [4]), _shape_input(),
      helper.make_tensor_value_info("v", TensorProto.FLOAT, [2])],
     {"x": np.zeros(4, np.int64), "shape": np.array([2**42], np.int64), "v": np.array([0, 1], np.float32)}, "y"),
    (helper.make_node("Resize", ["x", "", "scales"], ["y"]),
     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4]),
      helper.make_tensor_value_info("scales", TensorProto.FLOAT, [4])],
     {"x": np.ones((1, 1, 4, 4), np.float32), "scales": np.array([1, 1, 1e6, 1e6], np.float32)}, "y"),
])
def test_kernels_sized_by_run_time_data_are_checked(node, inputs, feed, value):
    s = _session([node], inputs, [_out()])
    with pytest.raises(InvalidArgument, match=f"{node.op_type} node .* output '{value}'.*physical memory"):
        s.run(None, feed)


def test_loop_scan_outputs_count_against_the_limit():
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("ConstantOfShape", ["len"], ["chunk"],
                          value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("chunk", TensorProto.FLOAT, None)])
    length = helper.make_tensor("len", TensorProto.INT64, [1], [1 << 18])  # 1 MiB per iteration
    loop = helper.make_node("Loop", ["trips", ""], ["scanned"], body=body, name="loop")
    s = _session([loop], [helper.make_tensor_value_info("trips", TensorProto.INT64, [])], [_out("scanned")],
                 initializers=[length], limit=64 * MiB)
    assert s.run(None, {"trips": np.array(4)})[0].shape == (4, 1 << 18)
    with pytest.raises(MemoryLimitExceeded, match="Loop node 'loop' scan outputs after"):
        s.run(None, {"trips": np.array(1000)})


def test_a_conv_whose_padding_makes_its_output_too_large_is_refused_at_run_start():
    w = helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 1, 1], [1.0])
    conv = helper.make_node("Conv", ["x", "w"], ["c"], pads=[2**20, 2**20, 2**20, 2**20], name="padded")
    s = _session([conv, helper.make_node("Relu", ["c"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 2, 2])], [_out()],
                 initializers=[w])
    with pytest.raises(InvalidArgument, match=r"Conv node 'padded' output 'y' \(shape \[1, 1, 2097154, 2097154\]"):
        s.run(None, {"x": np.ones((1, 1, 2, 2), np.float32)})


def test_a_static_arena_too_large_for_the_machine_is_refused_at_load():
    w = helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 1, 1], [1.0])
    conv = helper.make_node("Conv", ["x", "w"], ["c"], pads=[2**20, 2**20, 2**20, 2**20], name="padded")
    with pytest.raises(InvalidArgument, match="value 'c' .*physical memory"):
        _session([conv, helper.make_node("Softmax", ["c"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])], [_out()], initializers=[w])


def test_a_kernel_error_names_its_node():
    seq = helper.make_node("SequenceConstruct", ["x", "x"], ["s"])
    at = helper.make_node("SequenceAt", ["s", "pos"], ["y"], name="pick")
    s = _session([seq, at], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                             helper.make_tensor_value_info("pos", TensorProto.INT64, [])], [_out()])
    with pytest.raises(RunFailure, match="SequenceAt node 'pick': position 50 is out of range"):
        s.run(None, {"x": np.ones(2, np.float32), "pos": np.array(50)})


def test_the_limit_holds_for_nodes_run_on_inter_op_threads():
    nodes = [helper.make_node("ConstantOfShape", ["small"], ["a"]),
             helper.make_node("ConstantOfShape", ["big"], ["b"], name="big_fill")]  # the second root: a pool thread
    graph = helper.make_graph(nodes, "g", [_shape_input("small"), _shape_input("big")], [_out("a"), _out("b")])
    options = carrack.SessionOptions()
    options.memory_limit_bytes = 32 * MiB
    options.execution_mode = carrack.ExecutionMode.ORT_PARALLEL
    options.inter_op_num_threads = 2
    s = carrack.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
                                 .SerializeToString(), options)
    with pytest.raises(MemoryLimitExceeded, match="ConstantOfShape node 'big_fill' output 'b'"):
        s.run(None, {"small": np.array([4], np.int64), "big": np.array([32 << 20], np.int64)})  # 128 MiB


def test_a_run_limit_ends_with_the_run():
    small = _session([helper.make_node("ConstantOfShape", ["shape"], ["y"])], [_shape_input()], [_out()], limit=MiB)
    small.run(None, {"shape": np.array([4], np.int64)})
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024, 1024])  # 4 MiB intermediates, planned
    big = _session([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])], [x], [_out()])
    assert big.run(None, {"x": np.ones((1, 1024, 1024), np.float32)})[0].shape == (1, 1024, 1024)
    assert MEMORY_LIMIT.get() == 0


def test_a_float8_intermediate_is_not_placed_under_a_name_numpy_cannot_read():
    # found by the fuzzer: a float8 value planned into the arena as dtype '<f1' failed with a TypeError
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT8E5M2, [10, 20])
    s = _session([helper.make_node("Neg", ["x"], ["i"]), helper.make_node("Neg", ["i"], ["y"])], [x],
                 [_out("y", TensorProto.FLOAT8E5M2)], opset=6)
    try:
        (y,) = s.run(None, {"x": np.ones((10, 20), ml_dtypes.float8_e5m2)})
    except carrack.errors.CarrackError:  # a clear refusal is fine; a TypeError from the plan is not
        return
    assert y.dtype == ml_dtypes.float8_e5m2 and float(y[0, 0]) == 1.0
