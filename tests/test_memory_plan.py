"""The static memory plan: liveness-based reuse, in-place ops, symbolic dims bound per signature."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from carrack.onnx.importer import load_model
from carrack.passes.memory_plan import ALIGNMENT, plan_memory


def _chain_model(layers: int, width: int):
    nodes, inits, prev = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array(np.eye(width, dtype=np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"]))
        prev = f"r{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])
    graph = helper.make_graph(nodes, "chain", [x], [y], initializer=inits)
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_chain_reuses_two_buffers():
    model = _chain_model(50, 256)
    plan = plan_memory(model.graph, model.opsets, {"batch": 8})
    act = 8 * 256 * 4
    assert plan.intermediate_bytes >= 50 * act  # MatMul outputs, Relu in place
    assert plan.arena_bytes <= 3 * act  # a live activation, the next one, the output
    assert plan.weight_bytes == 50 * 256 * 256 * 4
    assert not plan.unknown
    assert all(b.offset % ALIGNMENT == 0 for b in plan.blocks.values())


def test_plan_scales_with_bound_dims():
    model = _chain_model(4, 64)
    small = plan_memory(model.graph, model.opsets, {"batch": 1})
    big = plan_memory(model.graph, model.opsets, {"batch": 100})
    assert big.arena_bytes >= 90 * small.arena_bytes // 2


def test_unbound_dims_are_reported_not_guessed():
    model = _chain_model(2, 16)
    plan = plan_memory(model.graph, model.opsets)
    assert plan.unknown and plan.arena_bytes == 0


def test_overlapping_lifetimes_never_share_bytes():
    model = _chain_model(10, 32)
    plan = plan_memory(model.graph, model.opsets, {"batch": 3})
    blocks = list(plan.blocks.values())
    for i, a in enumerate(blocks):
        for b in blocks[i + 1:]:
            if a.start <= b.end and b.start <= a.end:
                assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset


def test_session_memory_plan_and_limit():
    import pytest

    import carrack
    from carrack.errors import MemoryLimitExceeded

    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1024])
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    sess = carrack.InferenceSession(model)
    plan = sess.memory_plan({"n": 16})
    assert plan.input_bytes == 16 * 1024 * 4 and plan.arena_bytes >= 2 * 16 * 1024 * 4
    opts = carrack.SessionOptions()
    opts.memory_limit_bytes = plan.peak_bytes
    limited = carrack.InferenceSession(model, opts)
    limited.run(None, {"x": np.ones((16, 1024), np.float32)})
    with pytest.raises(MemoryLimitExceeded, match="memory_limit_bytes"):
        limited.run(None, {"x": np.ones((64, 1024), np.float32)})


def test_runs_write_into_the_planned_arena():
    """MatMul/Relu/Add outputs go into one per-run arena; results equal those of runs that allocate every value,
    also from several threads at once."""
    import concurrent.futures

    import carrack

    model = _chain_model(12, 64)
    from carrack.onnx.exporter import export_model

    proto = export_model(model)
    plain = carrack.SessionOptions()
    plain.enable_mem_pattern = False
    sess, reference = carrack.InferenceSession(proto), carrack.InferenceSession(proto, plain)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    into = [entry for entry in sess._program._plan if entry[6] >= 0]
    assert into and sess._plan.bind(sess._sizes({"x": x})).arena_bytes > 0
    expected = reference.run(None, {"x": x})[0]
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], expected)
    xs = [np.random.default_rng(i).standard_normal((5, 64)).astype(np.float32) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda v: sess.run(None, {"x": v})[0], xs))
    for v, g in zip(xs, got):
        np.testing.assert_array_equal(g, reference.run(None, {"x": v})[0])


def test_a_view_returned_by_a_kernel_is_never_overwritten():
    """Slice returns a view of its input; the arena bytes under it are reused by later steps, so the executor copies
    such views out of the arena (the plan only knows the views of Reshape-like ops)."""
    import carrack

    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Slice", ["m", "s", "e"], ["v"]),
             helper.make_node("MatMul", ["x", "w"], ["m2"]), helper.make_node("Neg", ["m2"], ["n"]),
             helper.make_node("Mul", ["n", "n"], ["k"]), helper.make_node("Add", ["v", "k"], ["y"])]
    w = numpy_helper.from_array(np.eye(8, dtype=np.float32), "w")
    inits = [w, numpy_helper.from_array(np.array([0]), "s"), numpy_helper.from_array(np.array([8]), "e")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 8])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    opts = carrack.SessionOptions()
    opts.graph_optimization_level = carrack.GraphOptimizationLevel.ORT_DISABLE_ALL
    x = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    np.testing.assert_allclose(carrack.InferenceSession(model, opts).run(None, {"x": x})[0], x + x * x, rtol=1e-6)


def test_convolutions_write_into_the_arena():
    import carrack

    rng = np.random.default_rng(2)
    nodes, inits, prev = [], [], "x"
    for i in range(4):
        inits.append(numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32) / 8, f"w{i}"))
        nodes += [helper.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        prev = f"r{i}"
    nodes.append(helper.make_node("Sigmoid", [prev], ["y"]))
    shape = [1, 8, 16, 16]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal(shape).astype(np.float32)
    plain = carrack.SessionOptions()
    plain.enable_mem_pattern = False
    for level in (carrack.GraphOptimizationLevel.ORT_DISABLE_ALL, carrack.GraphOptimizationLevel.ORT_ENABLE_ALL):
        opts = carrack.SessionOptions()
        opts.graph_optimization_level = level
        plain.graph_optimization_level = level
        sess = carrack.InferenceSession(model, opts)
        written = {entry[0].node.op_type for entry in sess._program._plan if entry[6] >= 0}
        assert written & {"Conv", "FusedConv"}, written
        np.testing.assert_allclose(sess.run(None, {"x": x})[0],
                                   carrack.InferenceSession(model, plain).run(None, {"x": x})[0], rtol=1e-6)


def _conv_net():
    """A 3x3 convolution, a depthwise one and a 1x1 one, with constant weights."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("w3", (20, 8, 3, 3)), ("wd", (20, 1, 3, 3)), ("w1", (13, 20, 1, 1)))]
    nodes = [helper.make_node("Conv", ["x", "w3"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "wd"], ["d"], pads=[1, 1, 1, 1], group=20),
             helper.make_node("Conv", ["d", "w1"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 13, 12, 12])
    graph = helper.make_graph(nodes, "convs", [x], [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_weights_packed_for_the_kernels_are_in_the_plan():
    """The packed copies of convolution weights (packconv.c) are counted before the first run, exactly, and not
    when the plan runs the convolutions on numpy."""
    import carrack
    from carrack.native import convolution as native_conv
    from carrack.passes.fusions import without_block_fusion

    model = _conv_net()
    kernels = native_conv.load()
    with without_block_fusion():  # the depthwise + 1x1 pair stays two convolutions (not a carrack.InvertedResidual)
        sess = carrack.InferenceSession(model.SerializeToString())
    expected = 0
    if kernels is not None and kernels.packs:  # 6-row panels: 20 rows -> 24, 13 -> 18; the depthwise one is not
        expected = 4 * (24 * 8 * 9 + 18 * 20)
    plan = sess.memory_plan()
    assert plan.prepared_bytes == expected
    assert plan.peak_bytes == plan.weight_bytes + expected + plan.input_bytes + plan.arena_bytes + plan.output_bytes
    assert "prepared" in plan.summary()
    x = np.random.default_rng(0).standard_normal((1, 8, 12, 12)).astype(np.float32)
    sess.run(None, {"x": x})
    if expected:
        held = sum(wp.nbytes for ref, wp in kernels._packed.values()
                   if ref() is not None and wp.size in (24 * 72, 18 * 20))
        assert held >= expected

    opts = carrack.SessionOptions()
    opts.add_session_config_entry("carrack.kernels", "numpy")
    assert carrack.InferenceSession(model.SerializeToString(), opts).memory_plan().prepared_bytes == 0
