"""Latency of `carrack compile --target native` against carrack's session and onnxruntime at 1 thread, on the
real architectures shipped in the onnx wheel (placeholder weights: the latency is the architecture's), runs
interleaved so a shared machine's load hits every engine alike.

    python benchmarks/compiled.py squeezenet shufflenet mobilenetv2 resnet50 [--iters 7] [--portable]

--portable adds a library built with the portable kernels only (native_kernels=False: no session kernels, the
build every target without AVX-512 gets) to the interleaved runs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort

import carrack
from carrack.backends.c.build import compile_model

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
#: models the browser benchmark prepares (benchmarks/wasm_browser.py: mobilenetv2, ...), symbolic dims set to 1
CACHE = os.path.expanduser("~/.cache/carrack-bench")


def model_path(name: str) -> str:
    for path in (os.path.join(LIGHT, f"light_{name}.onnx"), os.path.join(CACHE, f"{name}.onnx")):
        if os.path.exists(path):
            return path
    raise SystemExit(f"no light_{name}.onnx in the onnx wheel and no {name}.onnx in {CACHE} "
                     "(python benchmarks/wasm_browser.py {name} prepares it)")


def interleaved_medians(runs: dict, iters: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(iters):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) * 1000 for name, t in times.items()}


def measure(name: str, iters: int, portable: bool = False) -> dict[str, float]:
    path = model_path(name)
    graph = onnx.load(path, load_external_data=False).graph
    stored = {t.name for t in graph.initializer}
    symbols = {d.dim_param: 1 for i in graph.input if i.name not in stored
               for d in i.type.tensor_type.shape.dim if d.dim_param}
    with tempfile.TemporaryDirectory() as directory:
        compile_model(path, directory, "native", dims=symbols)
        compiled = carrack.CompiledModel(directory)
        if portable:
            compile_model(path, os.path.join(directory, "portable"), "native", dims=symbols, native_kernels=False)
            compiled_portable = carrack.CompiledModel(os.path.join(directory, "portable"))
        session = carrack.InferenceSession(path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        reference = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        info = session.get_inputs()[0]
        shape = [d if isinstance(d, int) else 1 for d in info.shape]
        feed = {info.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
        runs = {"compiled": lambda: compiled.run(None, feed), "session": lambda: session.run(None, feed),
                "onnxruntime_1t": lambda: reference.run(None, feed)}
        if portable:
            runs["compiled_portable"] = lambda: compiled_portable.run(None, feed)
        for run in runs.values():
            run()
        return interleaved_medians(runs, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="light model names: squeezenet, shufflenet, resnet50, ...")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--portable", action="store_true", help="also the portable-kernel library")
    args = parser.parse_args()
    for name in args.models:
        ms = measure(name, args.iters, args.portable)
        cells = "  ".join(f"{k} {v:.1f} ms" for k, v in ms.items())
        print(f"{name:12s} {cells}  compiled/onnxruntime {ms['compiled'] / ms['onnxruntime_1t']:.2f}  "
              f"compiled/session {ms['compiled'] / ms['session']:.2f}"
              + (f"  portable/onnxruntime {ms['compiled_portable'] / ms['onnxruntime_1t']:.2f}" if args.portable
                 else ""))


if __name__ == "__main__":
    main()
