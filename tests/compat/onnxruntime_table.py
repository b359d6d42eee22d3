"""The onnxruntime compatibility table (docs/onnxruntime_compat.md), built from the installed onnxruntime.

    PYTHONPATH=. python -m tests.compat.onnxruntime_table > docs/onnxruntime_compat.md

Every public name of the onnxruntime module, of onnxruntime.capi.onnxruntime_pybind11_state and of the members of
its session classes is listed; whether carrack has it is looked up (carrack's side is the module
`carrack.install_as_onnxruntime()` installs), how it differs or why it is absent comes from NOTES.
tests/compat/test_onnxruntime_table.py checks that the committed table is what this prints.
"""

from __future__ import annotations

import dataclasses
import types
from collections import Counter

import onnxruntime
import onnxruntime.capi.onnxruntime_pybind11_state as ort_state

from carrack.capi import onnxruntime_pybind11_state as carrack_state
from carrack.onnxruntime_compat import ONNXRUNTIME_API_VERSION, _root_module

CLASSES = ["InferenceSession", "SessionOptions", "RunOptions", "OrtValue", "IOBinding", "NodeArg", "ModelMetadata",
           "OrtDevice", "SparseTensor"]

_EP = "execution providers: carrack runs its own CPU engine only"
_CPU_ONLY = "device memory and allocators: carrack computes in host memory with numpy"
_SPARSE = "sparse tensors: carrack has no sparse tensor type"
_COMPILE = "EP-context model compilation and model packages: no execution providers to compile for"
_INTERNAL = "a module onnxruntime's package imports, not API"
_LORA = "LoRA adapters: not implemented"

#: name -> (status, note); status 'different' (present, behaves differently) or 'absent' (with the reason)
NOTES: dict[str, tuple[str, str]] = {
    # module
    "AdapterFormat": ("absent", _LORA), "LoraAdapter": ("absent", _LORA),
    "RunOptions.add_active_adapter": ("absent", _LORA),
    "ModelCompiler": ("absent", _COMPILE), "OrtCompileApiFlags": ("absent", _COMPILE),
    "ModelPackage": ("absent", _COMPILE), "ModelPackageComponentContext": ("absent", _COMPILE),
    "ModelPackageContext": ("absent", _COMPILE), "ModelPackageOptions": ("absent", _COMPILE),
    "ModelPackageWriteMode": ("absent", _COMPILE), "OrtCompiledModelCompatibility": ("absent", _COMPILE),
    "OrtEpContextData": ("absent", _COMPILE), "OrtEpContextDataBuffer": ("absent", _COMPILE),
    "get_compatibility_info_from_model": ("absent", _COMPILE),
    "get_compatibility_info_from_model_bytes": ("absent", _COMPILE),
    "get_model_compatibility_for_ep_devices": ("absent", _COMPILE),
    "SessionOptions.set_ep_context_data_read_func": ("absent", _COMPILE),
    "SessionOptions.clear_ep_context_data_read_func": ("absent", _COMPILE),
    "OrtEpAssignedNode": ("absent", _EP), "OrtEpAssignedSubgraph": ("absent", _EP), "OrtEpDevice": ("absent", _EP),
    "OrtExecutionProviderDevicePolicy": ("absent", _EP), "OrtHardwareDevice": ("absent", _EP),
    "OrtHardwareDeviceType": ("absent", _EP), "OrtDeviceEpIncompatibilityReason": ("absent", _EP),
    "get_ep_devices": ("absent", _EP), "get_hardware_devices": ("absent", _EP),
    "get_hardware_device_ep_incompatibility_details": ("absent", _EP),
    "register_execution_provider_library": ("absent", _EP), "unregister_execution_provider_library": ("absent", _EP),
    "get_registered_ep_kernel_defs": ("absent", _EP), "preload_dlls": ("absent", _EP + " (no CUDA DLLs to load)"),
    "OrtAllocatorType": ("absent", _CPU_ONLY), "OrtArenaCfg": ("absent", _CPU_ONLY),
    "OrtDeviceMemoryType": ("absent", _CPU_ONLY), "OrtDeviceVendorId": ("absent", _CPU_ONLY),
    "OrtMemType": ("absent", _CPU_ONLY), "OrtMemoryInfo": ("absent", _CPU_ONLY),
    "OrtMemoryInfoDeviceType": ("absent", _CPU_ONLY), "OrtSyncStream": ("absent", _CPU_ONLY),
    "ArenaExtendStrategy": ("absent", _CPU_ONLY), "kNextPowerOfTwo": ("absent", _CPU_ONLY),
    "kSameAsRequested": ("absent", _CPU_ONLY), "copy_tensors": ("absent", _CPU_ONLY),
    "create_and_register_allocator": ("absent", _CPU_ONLY), "create_and_register_allocator_v2": ("absent", _CPU_ONLY),
    "OrtExternalInitializerInfo": ("absent", "external-initializer callbacks: carrack maps external data itself"),
    "SparseTensor": ("absent", _SPARSE), "OrtSparseFormat": ("absent", _SPARSE),
    "SparseBlockSparseView": ("absent", _SPARSE), "SparseCooView": ("absent", _SPARSE),
    "SparseCsrView": ("absent", _SPARSE), "OrtValue.ort_value_from_sparse_tensor": ("absent", _SPARSE),
    "OrtValue.as_sparse_tensor": ("different", "raises UnsupportedFeature (NotImplemented): " + _SPARSE),
    "OrtValue.is_sparse_tensor": ("different", "always False: " + _SPARSE),
    "OrtValueVector": ("absent", "onnxruntime's internal vector type; carrack's IOBinding returns lists"),
    "InferenceSession.run_with_ortvaluevector": ("absent", "internal form of run_with_ort_values; use that"),
    "contextlib": ("absent", _INTERNAL), "onnxruntime_validation": ("absent", _INTERNAL),
    "import_capi_exception": ("absent", _INTERNAL), "opkernel": ("absent", _INTERNAL),
    "schemadef": ("absent", _INTERNAL), "SessionObjectInitializer": ("absent", _INTERNAL),
    "print_debug_info": ("absent", "prints onnxruntime's build and CUDA details; see get_build_info"),
    "set_default_logger_callback": ("absent", "not implemented: carrack logs through Python's logging ('carrack')"),
    "set_global_thread_pool_sizes": ("absent", "carrack has no global thread pools (SessionOptions threads only)"),
    "set_seed": ("absent", "random operators draw from their seed attribute or fresh OS entropy per run, so a "
                           "global seed would not make them repeatable"),
    "get_all_operator_schema": ("absent", "use onnx.defs.get_all_schemas()"),
    "get_all_opkernel_def": ("absent", "not implemented (carrack's kernels: carrack.ops.registry)"),
    "get_default_session_options": ("absent", "use SessionOptions()"),
    "get_session_initializer": ("absent", _INTERNAL),
    "quantize_matmul_2bits": ("absent", "onnxruntime's weight-quantization helpers: not implemented"),
    "quantize_matmul_4bits": ("absent", "onnxruntime's weight-quantization helpers: not implemented"),
    "quantize_matmul_8bits": ("absent", "onnxruntime's weight-quantization helpers: not implemented"),
    "quantize_matmul_bnb4": ("absent", "onnxruntime's weight-quantization helpers: not implemented"),
    "quantize_qdq_matmul_2bits": ("absent", "onnxruntime's weight-quantization helpers: not implemented"),
    "quantize_qdq_matmul_4bits": ("absent", "onnxruntime's weight-quantization helpers: not implemented"),
    "pack_fp4_weights_for_cuda_moe_gemm": ("absent", "CUDA-only weight packing"),
    "__version__": ("different", f"the onnxruntime API version carrack follows ({ONNXRUNTIME_API_VERSION}); "
                                 "carrack.__version__ is carrack's own"),
    "version": ("different", "as __version__"),
    "get_version_string": ("different", "as __version__ on the stand-in module; carrack.get_version_string() is "
                                        "carrack's version"),
    "package_name": ("different", "'carrack'"),
    "cuda_version": ("different", "'' (no CUDA)"),
    "get_build_info": ("different", "carrack's version, numpy, Python and machine"),
    "get_all_providers": ("same", ""),
    "get_available_providers": ("different", "['CPUExecutionProvider'] only"),
    "set_default_logger_severity": ("different", "sets the level of Python's 'carrack' logger"),
    "set_default_logger_verbosity": ("different", "accepted; carrack has no verbosity levels"),
    "enable_telemetry_events": ("different", "no-op: carrack sends no telemetry"),
    "disable_telemetry_events": ("different", "no-op: carrack sends no telemetry"),
    "capi": ("different", "carrack.capi: onnxruntime_pybind11_state (error classes, session classes) and "
                          "onnxruntime_inference_collection"),
    "ExecutionOrder": ("different", "accepted; carrack always runs nodes in topological order"),
    "EPFail": ("different", "defined so except clauses work; carrack never raises it (no execution providers)"),
    "DeviceReset": ("different", "defined so except clauses work; never raised (no devices)"),
    "ModelLoadCanceled": ("different", "defined; never raised (no load cancellation)"),
    "ModelRequiresCompilation": ("different", "defined; never raised (" + _COMPILE + ")"),
    "NoModel": ("different", "defined; never raised"), "EngineError": ("different", "defined; never raised"),
    "ModelLoaded": ("different", "defined; never raised"), "NotFound": ("different", "defined; never raised"),
    "NotImplemented": ("different", "carrack's UnsupportedModel/NotImplementedOps subclass it (missing operators "
                                    "subclass InvalidGraph too, as onnxruntime raises that for unknown operators)"),
    "Fail": ("different", "carrack's RunFailure (a kernel failed), RunTerminated and MemoryLimitExceeded subclass it"),
    "RuntimeException": ("different", "carrack's RunFailure subclasses it (and Fail, which onnxruntime raises for "
                                      "most kernel failures)"),
    "InvalidGraph": ("different", "carrack's InvalidModel subclasses it"),
    "InvalidArgument": ("different", "carrack's InvalidArgument subclasses it; messages are carrack's own"),
    "NoSuchFile": ("different", "carrack's ModelFileNotFound subclasses it"),
    "InvalidProtobuf": ("different", "carrack's CorruptModel subclasses it"),
    "SessionIOBinding": ("different", "the same class as IOBinding"),
    "OrtDevice": ("different", "CPU only: other device types raise UnsupportedFeature"),
    # InferenceSession
    "InferenceSession.set_providers": ("same", "CPU only: unavailable providers warn and run on the CPU, unknown "
                                               "names raise RuntimeError"),
    "InferenceSession.get_providers": ("different", "always ['CPUExecutionProvider']"),
    "InferenceSession.get_provider_options": ("different", "always {'CPUExecutionProvider': {}}"),
    "InferenceSession.disable_fallback": ("different", "stored; there is nothing to fall back from"),
    "InferenceSession.enable_fallback": ("different", "stored; there is nothing to fall back from"),
    "InferenceSession.run": ("different", "RunOptions.only_execute_path_to_fetches and log settings are accepted and "
                                          "ignored; Python scalars are accepted as feeds (onnxruntime refuses them)"),
    "InferenceSession.run_with_iobinding": ("different", "an output bound to a buffer receives a copy of the result"),
    "InferenceSession.end_profiling": ("different", "node events carry onnxruntime's args except the memory and "
                                                    "thread-scheduling ones; no fence events"),
    "InferenceSession.get_input_epdevices": ("absent", _EP), "InferenceSession.get_input_memory_infos": ("absent",
                                                                                                         _CPU_ONLY),
    "InferenceSession.get_output_memory_infos": ("absent", _CPU_ONLY),
    "InferenceSession.get_provider_graph_assignment_info": ("absent", _EP),
    "InferenceSession.get_tuning_results": ("absent", "no kernel tuning"),
    "InferenceSession.set_tuning_results": ("absent", "no kernel tuning"),
    "InferenceSession.release_captured_graph": ("absent", "CUDA graph capture"),
    "InferenceSession.set_ep_dynamic_options": ("absent", _EP),
    "InferenceSession.create_ortvalue_from_shape_and_type": ("different", "CPU memory whatever the device"),
    # SessionOptions
    "SessionOptions.add_provider": ("absent", _EP), "SessionOptions.add_provider_for_devices": ("absent", _EP),
    "SessionOptions.has_providers": ("absent", _EP), "SessionOptions.set_provider_selection_policy": ("absent", _EP),
    "SessionOptions.set_provider_selection_policy_delegate": ("absent", _EP),
    "SessionOptions.add_external_initializers_from_files_in_memory": ("absent", "not implemented"),
    "SessionOptions.set_load_cancellation_flag": ("absent", "loading cannot be cancelled"),
    "SessionOptions.register_custom_ops_library": ("different", "raises UnsupportedFeature (NotImplemented): carrack "
                                                                "cannot load onnxruntime custom-op libraries"),
    "SessionOptions.add_session_config_entry": ("different", "stored and readable; carrack's engine reads none of "
                                                             "onnxruntime's keys"),
    "SessionOptions.add_initializer": ("same", "replaces initializers of that name; other names are ignored "
                                               "(with a warning in carrack's log)"),
    "SessionOptions.execution_order": ("different", "accepted; topological order always"),
    "SessionOptions.optimized_model_filepath": ("different", "writes carrack's optimized graph (its own fusions)"),
    "SessionOptions.intra_op_num_threads": ("different", "limits numpy's BLAS thread pool (process-wide) during "
                                                         "runs"),
    "SessionOptions.graph_optimization_level": ("different", "onnxruntime's level names; carrack's own rewrites"),
    "SessionOptions.use_per_session_threads": ("different", "accepted; carrack has no global thread pools"),
    "SessionOptions.log_severity_level": ("different", "accepted; carrack logs through Python's logging"),
    "SessionOptions.log_verbosity_level": ("different", "accepted; carrack logs through Python's logging"),
    "SessionOptions.logid": ("different", "accepted; not used"),
    "SessionOptions.use_deterministic_compute": ("different", "accepted; carrack's kernels are deterministic"),
    "SessionOptions.enable_mem_reuse": ("different", "accepted; the memory plan always reuses buffers"),
    "SessionOptions.enable_mem_pattern": ("different", "True plans intermediates into one arena per run"),
    "SessionOptions.enable_cpu_mem_arena": ("different", "True keeps freed memory for reuse (glibc malloc settings)"),
    "RunOptions.log_severity_level": ("different", "accepted; not used"),
    "RunOptions.log_verbosity_level": ("different", "accepted; not used"),
    "RunOptions.logid": ("different", "accepted; not used"),
    "RunOptions.only_execute_path_to_fetches": ("different", "accepted; carrack runs the whole graph"),
    "RunOptions.add_run_config_entry": ("different", "stored and readable; carrack reads none of the keys"),
    # OrtValue / IOBinding
    "OrtValue.device_name": ("different", "always 'cpu'"),
    "OrtValue.from_dlpack": ("different", "through numpy.from_dlpack: CPU tensors only"),
    "OrtValue.data_ptr": ("same", ""),
    "IOBinding.bind_input": ("different", "device_type must be 'cpu'"),
    "IOBinding.bind_output": ("different", "device_type must be 'cpu'; a bound buffer gets a copy of the result"),
    "IOBinding.synchronize_inputs": ("different", "no-op (nothing asynchronous on the CPU)"),
    "IOBinding.synchronize_outputs": ("different", "no-op (nothing asynchronous on the CPU)"),
    "IOBinding.get_outputs_as_ortvaluevector": ("different", "a list of OrtValues"),
    "OrtDevice.make": ("different", "CPU only"),
}


_ALWAYS_LOADED = {"capi", "contextlib", "onnxruntime_validation"}


def _public(obj) -> list[str]:
    return sorted(n for n in dir(obj) if not n.startswith("_"))


def _has(obj, name: str) -> bool:
    if obj is None:
        return False
    if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
        return True
    return hasattr(obj, name)


def rows() -> list[tuple[str, str, str, str]]:
    """(section, name, status, note) for every public onnxruntime name."""
    stand_in = _root_module()
    found = []

    def add(section: str, key: str, present: bool) -> None:
        status, note = NOTES.get(key, ("same" if present else "absent", ""))
        if present and status == "absent" or not present and status != "absent":
            raise AssertionError(f"{key}: NOTES says {status!r} but carrack {'has' if present else 'lacks'} it")
        found.append((section, key, status, note))

    # submodules show up in dir() once something imports them (onnxruntime.quantization ...): only capi is API here
    module_names = [n for n in _public(onnxruntime) if n in _ALWAYS_LOADED
                    or not isinstance(getattr(onnxruntime, n), types.ModuleType)] + ["__version__"]
    for name in module_names:
        add("onnxruntime", name, _has(stand_in, name))
    for name in _public(ort_state):
        if name not in module_names:
            add("onnxruntime.capi.onnxruntime_pybind11_state", name, _has(carrack_state, name))
    for cls in CLASSES:
        ours = getattr(stand_in, cls, None)
        for name in _public(getattr(onnxruntime, cls)):
            if ours is None:  # the whole class is absent: its reason covers its members
                NOTES.setdefault(f"{cls}.{name}", ("absent", f"{cls} is absent: {NOTES[cls][1]}"))
            add(cls, f"{cls}.{name}", _has(ours, name))
    return found


def markdown() -> str:
    table = rows()
    counts = Counter(status for _, _, status, _ in table)
    lines = [
        "# onnxruntime compatibility",
        "",
        f"Every public name of onnxruntime {onnxruntime.__version__}'s Python API (the `onnxruntime` module, "
        "`onnxruntime.capi.onnxruntime_pybind11_state`, and the members of its session classes), and carrack's "
        "status: **same** (present, behaves as onnxruntime), **different** (present; how it differs), **absent** "
        "(why). carrack's side is what `carrack.install_as_onnxruntime()` makes `import onnxruntime` give.",
        "Generated by `PYTHONPATH=. python -m tests.compat.onnxruntime_table > docs/onnxruntime_compat.md`; "
        "tests/compat/test_onnxruntime_table.py fails when it is out of date.",
        "",
        f"**{len(table)} names: {counts['same']} same, {counts['different']} different, {counts['absent']} absent.**",
        "",
    ]
    section = None
    for sec, name, status, note in table:
        if sec != section:
            section = sec
            sub = Counter(s for t, _, s, _ in table if t == sec)
            lines += ["", f"## {sec} ({sub['same']} same, {sub['different']} different, {sub['absent']} absent)", "",
                      "| name | status | notes |", "|---|---|---|"]
        lines.append(f"| `{name}` | {status} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
