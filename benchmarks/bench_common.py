"""Helpers shared by benchmarks/run.py and its worker processes: model lookup, input feeds, peak RSS.

Kept free of carrack and onnxruntime imports so that a worker's memory baseline only holds its own engine.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import numpy as np

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "int64": np.int64,
                "int32": np.int32, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}


def models_dir() -> Path:
    return Path(os.environ.get("CARRACK_MODELS") or Path.home() / ".cache" / "carrack-bench")


def sidecar(model_path: str | Path) -> dict:
    """The NAME.json written next to NAME.onnx by make_models.py ({} when there is none)."""
    p = Path(model_path).with_suffix(".json")
    return json.loads(p.read_text()) if p.is_file() else {}


def input_spec(model_path: str | Path) -> list[dict]:
    """How to feed the model: the sidecar's spec, else the graph's own inputs (unknown dims = 1, random data)."""
    spec = sidecar(model_path).get("inputs")
    if spec:
        return spec
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    out = []
    for v in graph.input:
        if v.name in inits:
            continue
        t = v.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        out.append({"name": v.name, "shape": [d.dim_value or 1 for d in t.shape.dim], "dtype": dtype,
                    "fill": "randn" if dtype.startswith("float") else "randint", "high": 2})
    return out


def make_feed(spec: list[dict], seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs from a feed spec (fill: randn, randint with high, ones, zeros)."""
    rng = np.random.default_rng(seed)
    feed = {}
    for s in spec:
        dtype, shape, fill = NUMPY_DTYPES[s["dtype"]], tuple(s["shape"]), s.get("fill", "randn")
        if fill == "ones":
            feed[s["name"]] = np.ones(shape, dtype)
        elif fill == "zeros":
            feed[s["name"]] = np.zeros(shape, dtype)
        elif fill == "randint":
            feed[s["name"]] = rng.integers(0, s.get("high", 2), shape).astype(dtype)
        else:
            feed[s["name"]] = rng.standard_normal(shape).astype(dtype)
    return feed


def dim_bindings(model_path: str | Path, spec: list[dict]) -> dict[str, int]:
    """Symbolic dim name -> size implied by the feed spec (anonymous dims are named 'input:axis', as carrack does)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    shapes = {s["name"]: s["shape"] for s in spec}
    bindings = {}
    for v in graph.input:
        if v.name not in shapes:
            continue
        for axis, (d, size) in enumerate(zip(v.type.tensor_type.shape.dim, shapes[v.name])):
            if d.HasField("dim_value"):
                continue
            bindings[d.dim_param or f"{v.name}:{axis}"] = int(size)
    return bindings


def rss_bytes() -> int:
    """Current resident set size of this process."""
    status = _proc_status()
    return status.get("VmRSS", 0)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (VmHWM, else getrusage's ru_maxrss)."""
    status = _proc_status()
    if "VmHWM" in status:
        return status["VmHWM"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _proc_status() -> dict[str, int]:
    try:
        with open("/proc/self/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out


#: the AVX-512 features OpenBLAS's SkylakeX kernels need
_AVX512 = ("avx512f", "avx512dq", "avx512bw", "avx512vl")


def avx512_available() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return all(flag in flags for flag in _AVX512)


def blas_core(choice: str) -> str | None:
    """The OpenBLAS core type workers run with: 'keep' leaves the environment's OPENBLAS_CORETYPE alone; 'native'
    lets OpenBLAS use the CPU's widest kernels (SkylakeX where AVX-512 is there, which onnxruntime's MLAS also
    uses), overriding a pin such as OPENBLAS_CORETYPE=Haswell; any other value is used as the core type."""
    if choice == "keep":
        return os.environ.get("OPENBLAS_CORETYPE")
    if choice == "native":
        return "SkylakeX" if avx512_available() else None
    return choice


def thread_env(threads: int, core: str | None = None) -> dict[str, str]:
    """Environment for a worker limited to `threads` BLAS/OpenMP threads (0: their defaults; must be set before
    numpy loads), with
    OpenBLAS's core type `core` (None: OpenBLAS detects it)."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
                "NUMEXPR_NUM_THREADS", "CARRACK_NUM_THREADS"):
        if threads > 0:
            env[var] = str(threads)
        else:  # 0: every library's own default (one thread per core)
            env.pop(var, None)
    env.pop("OPENBLAS_CORETYPE", None)
    if core:
        env["OPENBLAS_CORETYPE"] = core
    return env
