"""One engine in one fresh process, driven by benchmarks/run.py over stdin/stdout (JSON lines).

  worker.py serve ENGINE MODEL      load, answer 'ready'; then 'run' (one timed inference), 'stats', 'quit'
  worker.py memory ENGINE MODEL     load, one inference, report peak RSS (and carrack's memory plan)
  worker.py peak                    numpy float32 2048^3 matmul GFLOP/s

ENGINE is carrack or ort. The thread count comes from the environment (OMP_NUM_THREADS etc., set by run.py before
numpy loads) and BENCH_THREADS (given to the engine's session options).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, os.environ.get("CARRACK_REPO") or str(HERE.parent))

# the protocol owns the real stdout; anything an engine prints goes to stderr
_PROTO = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)

from bench_common import input_spec, make_feed, peak_rss_bytes, rss_bytes  # noqa: E402


def say(**msg) -> None:
    _PROTO.write(json.dumps(msg) + "\n")


def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 600 else text[:600] + " ..."


def import_engine(engine: str) -> None:
    """Import the engine before measuring the baseline RSS, so that the baseline holds its code too."""
    if engine in ("ort", "carrack"):
        __import__("onnxruntime" if engine == "ort" else "carrack")


def load_session(engine: str, model: str, threads: int):
    """A session with the default (full) graph optimization and `threads` intra-op threads."""
    if engine == "ort":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    elif engine == "carrack":
        import carrack

        opts = carrack.SessionOptions()
        opts.intra_op_num_threads = threads
        sess = carrack.InferenceSession(model, opts)
    else:
        raise SystemExit(f"unknown engine {engine!r}")
    return sess


def serve(engine: str, model: str, threads: int) -> None:
    feed = make_feed(input_spec(model))
    import_engine(engine)
    baseline = rss_bytes()
    try:
        t0 = time.perf_counter()
        sess = load_session(engine, model, threads)
        load_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - reported to the driver
        say(event="error", phase="load", error=_error(e), trace=traceback.format_exc()[-2000:])
        return
    say(event="ready", load_s=load_s, baseline_rss=baseline, load_rss=rss_bytes())
    for line in sys.stdin:
        command = line.strip()
        if command == "run":
            try:
                t0, c0 = time.perf_counter(), time.process_time()
                sess.run(None, feed)
                say(event="ran", ms=(time.perf_counter() - t0) * 1000, cpu_ms=(time.process_time() - c0) * 1000)
            except Exception as e:  # noqa: BLE001
                say(event="error", phase="run", error=_error(e), trace=traceback.format_exc()[-2000:])
                return
        elif command == "stats":
            say(event="stats", peak_rss=peak_rss_bytes(), rss=rss_bytes())
        else:
            return


def memory(engine: str, model: str, threads: int) -> None:
    spec = input_spec(model)
    feed = make_feed(spec)
    import_engine(engine)
    baseline = rss_bytes()
    result: dict = {"event": "memory", "baseline_rss": baseline}
    try:
        sess = load_session(engine, model, threads)
        result["load_rss"] = rss_bytes()
        sess.run(None, feed)
        result["peak_rss"] = peak_rss_bytes()
    except Exception as e:  # noqa: BLE001
        say(event="error", phase="load" if "load_rss" not in result else "run", error=_error(e), **result)
        return
    if engine == "carrack":
        from bench_common import dim_bindings

        bindings = dim_bindings(model, spec)
        try:
            result["plan"] = _plan_dict(sess.memory_plan(bindings))
            if result["plan"]["unknown"]:
                # the optimized graph has values whose sizes inference cannot tell: plan the graph as loaded too
                from carrack.onnx.importer import load_model
                from carrack.passes.memory_plan import plan_memory

                loaded = load_model(model)
                result["plan_unoptimized"] = _plan_dict(plan_memory(loaded.graph, loaded.opsets, bindings))
        except Exception as e:  # noqa: BLE001
            result["plan_error"] = _error(e)
    say(**result)


def _plan_dict(plan) -> dict:
    return {"arena_bytes": plan.arena_bytes, "weight_bytes": plan.weight_bytes, "input_bytes": plan.input_bytes,
            "intermediate_bytes": plan.intermediate_bytes, "peak_bytes": plan.peak_bytes,
            "efficiency": plan.efficiency, "unknown": len(plan.unknown), "unknown_names": plan.unknown[:5]}


def sgemm_peak(size: int = 2048, reps: int = 5) -> None:
    """Best-of-`reps` float32 size^3 matmul rate of numpy (carrack's ceiling) and of onnxruntime's MatMul."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    result = {"event": "peak", "size": size, "gflops": _best_rate(lambda: a @ b, size, reps)}
    try:
        run = _ort_matmul(size)
        result["ort_gflops"] = _best_rate(lambda: run(a, b), size, reps)
    except Exception as e:  # noqa: BLE001 - the numpy figure is the one the tables need
        result["ort_error"] = _error(e)
    say(**result)


def _best_rate(fn, size: int, reps: int) -> float:
    fn()  # warm-up: thread pool start, page faults
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def _ort_matmul(size: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    spec = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [size, size]) for n in "abc"]
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "sgemm", spec[:2], spec[2:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = int(os.environ.get("BENCH_THREADS", "1"))
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return lambda a, b: sess.run(None, {"a": a, "b": b})


def main() -> None:
    mode = sys.argv[1]
    threads = int(os.environ.get("BENCH_THREADS", "1"))
    if mode == "peak":
        sgemm_peak()
    elif mode == "serve":
        serve(sys.argv[2], sys.argv[3], threads)
    elif mode == "memory":
        memory(sys.argv[2], sys.argv[3], threads)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
