"""Float vs quantized latency in carrack and onnxruntime, side by side (one thread, median of a few runs).

Models come from benchmarks/make_models.py (random weights, built locally if missing):
  bert_base  transformers BertModel(BertConfig()), 1 x 128 tokens, quantized with quantize_dynamic
  resnet50   ResNet-50-like CNN, 1x3x224x224, prepared with quant_pre_process (BatchNorm folded) and quantized with
             quantize_static in QDQ format (random calibration data)

Reported per model and engine: median latency float and quantized, model file bytes, and resident weight bytes
(the session's initializers after carrack's optimizer; onnxruntime's are not observable, so its column shows the
file's initializer bytes).

Usage: python benchmarks/quantized.py [--runs 5] [--only bert_base,resnet50]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_models  # noqa: E402

import carrack  # noqa: E402


def feeds_for(name: str) -> dict[str, np.ndarray]:
    import json

    spec = json.loads((make_models.models_dir() / f"{name}.json").read_text())["inputs"]
    rng = np.random.default_rng(0)
    feeds = {}
    for s in spec:
        shape, dtype = tuple(s["shape"]), np.dtype(s["dtype"])
        if s["fill"] == "randint":
            feeds[s["name"]] = rng.integers(0, s["high"], shape).astype(dtype)
        elif s["fill"] == "ones":
            feeds[s["name"]] = np.ones(shape, dtype)
        elif s["fill"] == "zeros":
            feeds[s["name"]] = np.zeros(shape, dtype)
        else:
            feeds[s["name"]] = rng.standard_normal(shape).astype(dtype)
    return feeds


def quantize(name: str, source: Path, feeds: dict[str, np.ndarray]) -> Path:
    from onnxruntime import quantization as q

    target = source.with_name(f"{name}_quantized.onnx")
    if target.exists():
        return target
    if name == "resnet50":
        class Calibration(q.CalibrationDataReader):
            def __init__(self):
                rng = np.random.default_rng(1)
                self.batches = iter([{k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in feeds.items()}
                                     for _ in range(2)])

            def get_next(self):
                return next(self.batches, None)

        from onnxruntime.quantization.shape_inference import quant_pre_process

        prepared = source.with_name(f"{name}_prepared.onnx")  # the recommended flow: BatchNorm folded first
        quant_pre_process(str(source), str(prepared))
        q.quantize_static(str(prepared), str(target), Calibration(), quant_format=q.QuantFormat.QDQ)
    else:
        q.quantize_dynamic(str(source), str(target))
    return target


def median_ms(run, runs: int) -> float:
    run()  # warm-up (carrack specializes dynamic shapes on first use)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def carrack_session(path: Path):
    from carrack import native

    gc.collect()  # earlier sessions' packed weights go with them, not during this one's creation
    packed_before = native.prepared_nbytes()
    session = carrack.InferenceSession(str(path))
    # the optimized graph's weights plus what kernels packed from them at session creation (int8 GEMM panels)
    resident = sum(v.nbytes for v in session._model.graph.initializers.values())
    resident += native.prepared_nbytes() - packed_before
    return session, resident


def ort_session(path: Path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def file_initializer_bytes(path: Path) -> int:
    model = onnx.load(str(path))
    return sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def bench(name: str, runs: int) -> list[tuple]:
    source = make_models.make(name, make_models.models_dir())
    feeds = feeds_for(name)
    quantized = quantize(name, source, feeds)
    rows = []
    for label, path in (("float", source), ("quantized", quantized)):
        session, resident = carrack_session(path)
        c_ms = median_ms(lambda s=session: s.run(None, feeds), runs)
        del session
        reference = ort_session(path)
        o_ms = median_ms(lambda s=reference: s.run(None, feeds), runs)
        del reference
        rows.append((name, label, c_ms, o_ms, path.stat().st_size, resident, file_initializer_bytes(path)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", default="bert_base,resnet50")
    args = parser.parse_args(argv)
    print(f"{'model':10} {'variant':10} {'carrack ms':>11} {'ort ms':>9} {'file MiB':>9} {'carrack resident MiB':>21} "
          f"{'file weights MiB':>17}")
    for name in args.only.split(","):
        for row in bench(name, args.runs):
            model, label, c_ms, o_ms, file_bytes, resident, weights = row
            print(f"{model:10} {label:10} {c_ms:11.1f} {o_ms:9.1f} {file_bytes / 2**20:9.1f} {resident / 2**20:21.1f} "
                  f"{weights / 2**20:17.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
