"""onnxruntime's Python API beyond `run`, side by side: each snippet runs against onnxruntime and against carrack
(`rt` is the module) and the outcomes must agree: the same values, or errors of the same onnxruntime class
(carrack's errors subclass onnxruntime's classes by name, in carrack.capi.onnxruntime_pybind11_state)."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.capi import onnxruntime_pybind11_state as carrack_state

ENGINES = {"onnxruntime": onnxruntime, "carrack": carrack}


# -- comparing outcomes ---------------------------------------------------------------------------------------------

def _normal(value):
    """A comparable form of a result: arrays by dtype, shape and values; OrtValues by their array."""
    if isinstance(value, (onnxruntime.OrtValue, carrack.OrtValue)):
        return ("OrtValue", _normal(value.numpy()))
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tolist())
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value


def _error_names(error: BaseException) -> set[str]:
    """onnxruntime's error: its class name. carrack's: the onnxruntime classes it is an instance of (by name) and
    its builtin classes."""
    if not isinstance(error, carrack.CarrackError):
        return {type(error).__name__}
    names = {cls.__name__ for cls in carrack_state.ERROR_CLASSES if isinstance(error, cls)}
    return names | {cls.__name__ for cls in type(error).__mro__ if cls.__module__ == "builtins"}


def outcome(snippet, rt):
    try:
        return "ok", _normal(snippet(rt))
    except Exception as e:  # noqa: BLE001 - the outcome is what is compared
        return "error", _error_names(e), str(e)


def assert_same(snippet, message_part: str | None = None):
    """Run `snippet(rt)` on both engines: equal results, or both raise the same onnxruntime error class."""
    ort_outcome, carrack_outcome = outcome(snippet, onnxruntime), outcome(snippet, carrack)
    assert ort_outcome[0] == carrack_outcome[0], f"onnxruntime: {ort_outcome}\ncarrack: {carrack_outcome}"
    if ort_outcome[0] == "ok":
        assert carrack_outcome[1] == ort_outcome[1]
        return carrack_outcome[1]
    (ort_class,) = ort_outcome[1]
    assert ort_class in carrack_outcome[1], f"onnxruntime raised {ort_class}, carrack {carrack_outcome}"
    if message_part is not None:
        assert message_part in ort_outcome[2] and message_part in carrack_outcome[2]
    return ort_class


# -- models ---------------------------------------------------------------------------------------------------------

def _model(nodes, inputs, outputs, initializers=(), **model_fields) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers), doc_string="the graph's description")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], **model_fields)
    return model.SerializeToString()


def add_relu(batch="batch") -> bytes:
    """y = relu(x + w), x: (batch, 3) float with the batch dim denoted DATA_BATCH; w an initializer."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3])
    x.type.tensor_type.shape.dim[0].denotation = "DATA_BATCH"
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])
    w = numpy_helper.from_array(np.array([1, -2, 3], np.float32), "w")
    nodes = [helper.make_node("Add", ["x", "w"], ["t"], name="add0"),
             helper.make_node("Relu", ["t"], ["y"], name="relu0")]
    return _model(nodes, [x], [y], [w], domain="ai.example", model_version=7, doc_string="the model's description",
                  producer_name="test")


def long_chain(steps: int = 400, size: int = 192) -> bytes:
    """Many dependent MatMuls: a run that takes a while, for stopping it midway."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, size])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, size])
    w = numpy_helper.from_array(np.eye(size, dtype=np.float32), "w")
    names = ["x"] + [f"h{i}" for i in range(steps - 1)] + ["y"]
    nodes = [helper.make_node("MatMul", [names[i], "w"], [names[i + 1]], name=f"mm{i}") for i in range(steps)]
    return _model(nodes, [x], [y], [w])


X = np.array([[1, 2, 3], [-4, 5, -6]], np.float32)


def session(rt, model=None, **options):
    so = rt.SessionOptions()
    for key, value in options.items():
        setattr(so, key, value)
    return rt.InferenceSession(model or add_relu(), so, providers=["CPUExecutionProvider"])


# -- errors ---------------------------------------------------------------------------------------------------------

def test_error_classes_exist_at_onnxruntimes_module_path():
    for name in ["InvalidArgument", "Fail", "NoSuchFile", "InvalidProtobuf", "NotImplemented", "RuntimeException",
                 "InvalidGraph", "EPFail", "NoModel", "EngineError", "ModelLoaded", "NotFound"]:
        assert issubclass(getattr(carrack.capi.onnxruntime_pybind11_state, name), Exception)
        assert hasattr(onnxruntime.capi.onnxruntime_pybind11_state, name)


def test_carracks_errors_keep_their_builtin_bases():
    assert issubclass(carrack.InvalidArgument, ValueError) and issubclass(carrack.RunFailure, RuntimeError)
    assert issubclass(carrack.UnsupportedModel, NotImplementedError) and issubclass(carrack.ModelFileNotFound,
                                                                                   FileNotFoundError)


def test_missing_model_file_is_no_such_file(tmp_path):
    assert assert_same(lambda rt: rt.InferenceSession(str(tmp_path / "absent.onnx"))) == "NoSuchFile"


def test_corrupt_model_bytes_are_invalid_protobuf():
    assert assert_same(lambda rt: rt.InferenceSession(b"\x0a\xff\xff not a model")) == "InvalidProtobuf"


def test_wrong_feed_type_and_shape_are_invalid_argument():
    assert assert_same(lambda rt: session(rt).run(None, {"x": X.astype(np.float64)})) == "InvalidArgument"
    assert assert_same(lambda rt: session(rt).run(None, {"x": X[:, :2]})) == "InvalidArgument"


def test_unknown_operator_is_invalid_graph():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    model = _model([helper.make_node("NoSuchOp", ["x"], ["y"])], [x], [helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, [3])])
    assert assert_same(lambda rt: rt.InferenceSession(model)) == "InvalidGraph"


def test_a_failing_kernel_is_fail():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    s = helper.make_tensor_value_info("s", TensorProto.INT64, [1])
    model = _model([helper.make_node("Reshape", ["x", "s"], ["y"])], [x, s],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    feed = {"x": np.zeros(3, np.float32), "s": np.array([5])}
    assert assert_same(lambda rt: rt.InferenceSession(model).run(None, feed)) == "Fail"


# -- OrtValue -------------------------------------------------------------------------------------------------------

def test_ortvalue_from_numpy_shares_memory_and_describes_itself():
    def snippet(rt):
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        v = rt.OrtValue.ortvalue_from_numpy(a)
        described = [v.shape(), v.data_type(), v.element_type(), v.device_name(), v.is_tensor(), v.has_value(),
                     v.is_tensor_sequence(), v.tensor_size_in_bytes(), v.data_ptr() == a.ctypes.data,
                     np.shares_memory(v.numpy(), a)]
        v.update_inplace(np.ones((2, 3), np.float32))
        return described + [a]
    assert assert_same(snippet)[:5] == [[2, 3], "tensor(float)", 1, "cpu", True]


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_, np.float16, np.uint8])
def test_ortvalue_types(dtype):
    def snippet(rt):
        v = rt.OrtValue.ortvalue_from_numpy(np.zeros((1, 2), dtype))
        return [v.data_type(), v.element_type()]
    assert_same(snippet)


def test_ortvalue_from_shape_and_type_takes_numpy_or_onnx_types():
    def snippet(rt):
        values = [rt.OrtValue.ortvalue_from_shape_and_type([2, 4], np.float32),
                  rt.OrtValue.ortvalue_from_shape_and_type([3], np.int64),
                  rt.OrtValue.ortvalue_from_shape_and_type([2], TensorProto.DOUBLE)]
        return [(v.shape(), v.data_type(), v.tensor_size_in_bytes()) for v in values]
    assert_same(snippet)


# -- IOBinding ------------------------------------------------------------------------------------------------------

def test_iobinding_cpu_input_and_allocated_output():
    def snippet(rt):
        sess = session(rt)
        binding = sess.io_binding()
        binding.bind_cpu_input("x", X)
        binding.bind_output("y")
        sess.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return [outputs[0].shape(), outputs[0].data_type(), binding.copy_outputs_to_cpu()]
    assert_same(snippet)


def test_iobinding_preallocated_output_buffer_and_raw_input_pointer():
    def snippet(rt):
        sess = session(rt)
        binding = sess.io_binding()
        x = X.copy()
        out = np.full((2, 3), -1, np.float32)
        binding.bind_input("x", "cpu", 0, np.float32, list(x.shape), x.ctypes.data)
        binding.bind_output("y", "cpu", 0, np.float32, [2, 3], out.ctypes.data)
        sess.run_with_iobinding(binding)
        first = out.copy()
        x *= 2  # the bound input is the caller's memory: the next run sees the change
        sess.run_with_iobinding(binding)
        return [first, out, binding.get_outputs()[0].data_ptr() == out.ctypes.data]
    result = assert_same(snippet)
    assert result[-1] is True


def test_iobinding_ortvalues_and_clearing():
    def snippet(rt):
        sess = session(rt)
        binding = sess.io_binding()
        binding.bind_ortvalue_input("x", rt.OrtValue.ortvalue_from_numpy(X))
        target = rt.OrtValue.ortvalue_from_shape_and_type([2, 3], np.float32)
        binding.bind_ortvalue_output("y", target)
        sess.run_with_iobinding(binding)
        filled = target.numpy().copy()
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input("x", X[:1])
        binding.bind_output("y")
        sess.run_with_iobinding(binding)
        return [filled, binding.copy_outputs_to_cpu()]
    assert_same(snippet)


# -- session methods ------------------------------------------------------------------------------------------------

def test_run_with_ort_values():
    def snippet(rt):
        sess = session(rt)
        outputs = sess.run_with_ort_values(["y"], {"x": rt.OrtValue.ortvalue_from_numpy(X)})
        return [type(outputs[0]).__name__, outputs[0].numpy(), outputs[0].shape()]
    assert_same(snippet)


@pytest.mark.parametrize("feed", [X, X[:, :2]], ids=["ok", "bad-shape"])
def test_run_async_calls_back_with_results_user_data_and_error(feed):
    def snippet(rt):
        sess, done, seen = session(rt), threading.Event(), {}

        def callback(results, user_data, error):
            seen.update(results=results, user_data=user_data, failed=bool(error))
            done.set()
        sess.run_async(None, {"x": feed}, callback, {"tag": 7})
        assert done.wait(30)
        return seen
    assert_same(snippet)


def test_providers_fallback_and_profiling_start():
    def snippet(rt):
        sess = session(rt)
        sess.set_providers(["CPUExecutionProvider"])
        sess.disable_fallback()
        sess.enable_fallback()
        return [sess.get_providers(), sess.get_profiling_start_time_ns(), sess.run(None, {"x": X})]
    assert assert_same(snippet)[1] == 0


@pytest.mark.filterwarnings("ignore:Specified provider")
@pytest.mark.parametrize("providers", [["CUDAExecutionProvider"], ["CUDAExecutionProvider", "CPUExecutionProvider"],
                                       [("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})]])
def test_unavailable_providers_fall_back_to_the_cpu(providers):
    def snippet(rt):
        sess = rt.InferenceSession(add_relu(), providers=providers)
        sess.set_providers(providers)
        return [sess.get_providers(), sess.run(None, {"x": X})]
    assert assert_same(snippet)[0] == ["CPUExecutionProvider"]


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_set_providers_refuses_an_unknown_provider():
    assert assert_same(lambda rt: session(rt).set_providers(["NoSuchExecutionProvider"])) == "RuntimeError"


def test_profiling_start_time_is_the_wall_clock(tmp_path):
    for rt in ENGINES.values():
        before = time.time_ns()
        sess = session(rt, enable_profiling=True, profile_file_prefix=str(tmp_path / rt.__name__))
        start = sess.get_profiling_start_time_ns()
        assert before - 10**9 <= start <= time.time_ns()
        os.remove(sess.end_profiling())


def test_module_functions():
    def snippet(rt):
        rt.set_default_logger_severity(3)
        rt.set_default_logger_verbosity(0)
        all_providers = rt.get_all_providers()
        return ["CPUExecutionProvider" in all_providers, "CUDAExecutionProvider" in all_providers,
                "CPUExecutionProvider" in rt.get_available_providers(), isinstance(rt.get_build_info(), str),
                rt.get_device()]
    assert assert_same(snippet) == [True, True, True, True, "CPU"]
    onnxruntime.set_default_logger_severity(2)
    carrack.set_default_logger_severity(2)


def test_register_custom_ops_library_is_refused_clearly():
    # onnxruntime fails to load the (absent) library; carrack cannot load any: both raise, carrack saying why
    with pytest.raises(onnxruntime.capi.onnxruntime_pybind11_state.Fail):
        onnxruntime.SessionOptions().register_custom_ops_library("/absent/libcustom.so")
    with pytest.raises(carrack.capi.onnxruntime_pybind11_state.NotImplemented, match="custom-op libraries"):
        carrack.SessionOptions().register_custom_ops_library("/absent/libcustom.so")


# -- options --------------------------------------------------------------------------------------------------------

def test_add_initializer_replaces_the_initializer_and_ignores_unknown_names():
    def snippet(rt):
        results = []
        for name in ("w", "no_such_initializer"):
            so = rt.SessionOptions()
            value = rt.OrtValue.ortvalue_from_numpy(np.array([10, 20, 30], np.float32))
            so.add_initializer(name, value)
            results.append(rt.InferenceSession(add_relu(), so).run(None, {"x": X}))
        return results
    assert_same(snippet)


def test_session_and_run_config_entries():
    def snippet(rt):
        so, ro = rt.SessionOptions(), rt.RunOptions()
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        return [so.get_session_config_entry("session.intra_op.allow_spinning"),
                ro.get_run_config_entry("memory.enable_memory_arena_shrinkage")]
    assert assert_same(snippet) == ["0", "cpu:0"]
    assert assert_same(lambda rt: rt.SessionOptions().get_session_config_entry("absent")) == "RuntimeError"
    assert assert_same(lambda rt: rt.RunOptions().get_run_config_entry("absent")) == "RuntimeError"
    assert assert_same(lambda rt: rt.SessionOptions().add_session_config_entry("key", 1)) == "TypeError"


@pytest.mark.parametrize("options, attribute", [("SessionOptions", "intra_op_threads"),
                                                ("SessionOptions", "graph_optimisation_level"),
                                                ("RunOptions", "terminated")])
def test_misspelt_option_attributes_raise_attribute_error(options, attribute):
    assert assert_same(lambda rt: setattr(getattr(rt, options)(), attribute, 1)) == "AttributeError"


def test_option_attributes_read_back():
    def snippet(rt):
        so, ro = rt.SessionOptions(), rt.RunOptions()
        so.intra_op_num_threads, so.log_severity_level, so.enable_mem_pattern = 1, 3, False
        ro.terminate, ro.logid, ro.only_execute_path_to_fetches = True, "run-1", True
        return [so.intra_op_num_threads, so.log_severity_level, so.enable_mem_pattern, ro.terminate, ro.logid,
                ro.only_execute_path_to_fetches]
    assert_same(snippet)


@pytest.mark.parametrize("how", ["name", "denotation"])
def test_free_dimension_override_fixes_the_dim(how):
    def snippet(rt):
        so = rt.SessionOptions()
        if how == "name":
            so.add_free_dimension_override_by_name("batch", 2)
        else:
            so.add_free_dimension_override_by_denotation("DATA_BATCH", 2)
        sess = rt.InferenceSession(add_relu(), so)
        return [sess.get_inputs()[0].shape, sess.run(None, {"x": X})]
    assert assert_same(snippet)[0] == [2, 3]

    def refused(rt):
        so = rt.SessionOptions()
        so.add_free_dimension_override_by_name("batch", 2)
        return rt.InferenceSession(add_relu(), so).run(None, {"x": np.ones((5, 3), np.float32)})
    assert assert_same(refused) == "InvalidArgument"


def test_model_metadata():
    def snippet(rt):
        meta = session(rt).get_modelmeta()
        return [meta.producer_name, meta.graph_name, meta.domain, meta.description, meta.graph_description,
                meta.version, meta.custom_metadata_map]
    assert assert_same(snippet)[2:6] == ["ai.example", "the model's description", "the graph's description", 7]


@pytest.mark.parametrize("feed", [[[1, 2, 3]], [[1.5, -2, 3.25], [0, 0, 1]], [[True, False, True]]],
                         ids=["ints", "floats", "bools"])
def test_python_list_feeds_are_cast_to_the_input_type(feed):
    assert_same(lambda rt: session(rt).run(None, {"x": feed}))


# -- RunOptions.terminate -------------------------------------------------------------------------------------------

def test_terminate_set_before_the_run():
    def snippet(rt):
        ro = rt.RunOptions()
        ro.terminate = True
        return session(rt).run(None, {"x": X}, ro)
    assert assert_same(snippet, "Exiting due to terminate flag being set to true.") == "Fail"

    def cleared(rt):
        ro = rt.RunOptions()
        ro.terminate = True
        ro.terminate = False
        return session(rt).run(None, {"x": X}, ro)
    assert_same(cleared)


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
def test_terminate_set_during_the_run_stops_between_nodes(parallel):
    model, x = long_chain(), np.random.default_rng(0).standard_normal((192, 192)).astype(np.float32)
    for name, rt in ENGINES.items():
        mode = rt.ExecutionMode.ORT_PARALLEL if parallel else rt.ExecutionMode.ORT_SEQUENTIAL
        sess = session(rt, model, graph_optimization_level=rt.GraphOptimizationLevel.ORT_DISABLE_ALL,
                       execution_mode=mode, inter_op_num_threads=2)
        sess.run(None, {"x": x})  # warm-up (first-use work is not part of a run's time)
        full = min(_timed(lambda sess=sess: sess.run(None, {"x": x})) for _ in range(2))
        ro = rt.RunOptions()
        timer = threading.Timer(full / 10, lambda ro=ro: setattr(ro, "terminate", True))
        timer.start()
        start = time.perf_counter()
        with pytest.raises(rt.capi.onnxruntime_pybind11_state.Fail, match="terminate flag"):
            sess.run(None, {"x": x}, ro)
        timer.join()
        assert time.perf_counter() - start < full * 5, name  # it stopped (generous: the machine is shared)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- profiling ------------------------------------------------------------------------------------------------------

def test_profiling_node_events_carry_onnxruntimes_args(tmp_path):
    wanted = ["op_name", "input_type_shape", "output_type_shape", "output_size", "activation_size", "parameter_size",
              "provider"]
    traces = {}
    for name, rt in ENGINES.items():
        sess = session(rt, enable_profiling=True, profile_file_prefix=str(tmp_path / name),
                       graph_optimization_level=rt.GraphOptimizationLevel.ORT_DISABLE_ALL)
        sess.run(None, {"x": X})
        with open(sess.end_profiling()) as f:
            events = json.load(f)
        traces[name] = {e["name"]: {k: e["args"].get(k) for k in wanted} for e in events if e["cat"] == "Node"}
    assert set(traces["carrack"]) == set(traces["onnxruntime"]) == {"add0_kernel_time", "relu0_kernel_time"}
    for event, args in traces["onnxruntime"].items():
        assert traces["carrack"][event] == args, event
