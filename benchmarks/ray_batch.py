"""Batch inference throughput on Ray (carrack.ray) against one onnxruntime session in a loop, and the overhead each
Ray worker pays before its first result (actor start, plan transfer + executor build, first batch).

Models: mobilenetv2 from $CARRACK_MODELS (benchmarks/make_models.py --only mobilenetv2) and a BERT-like encoder
(transformers BertModel, hidden 256, 4 layers, 4 heads, 64 tokens; random weights, exported here with torch.onnx and
cached next to the others as bert_small.onnx). Every engine scores the same rows in the same batches; the Ray runs
use actors of one CPU each (intra-op threads 1), so "1 worker" is compared with onnxruntime on 1 thread and
"2 workers" with onnxruntime on 2 threads.

Usage: python benchmarks/ray_batch.py [--models mobilenetv2,bert_small] [--workers 1,2] [--batch-size 16]
Ray probes public DNS resolvers for its node address and binds every interface: on a loopback-only machine run it as
unshare --net sh -c 'ip link set lo up && python benchmarks/ray_batch.py'
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_common import models_dir  # noqa: E402

ROWS = {"mobilenetv2": 192, "bert_small": 768}
SEQ = 64


def bert_small(path: Path) -> Path:
    if path.exists():
        return path
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    model = tf.BertModel(config, add_pooling_layer=False).eval()

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]

    ids = torch.randint(0, config.vocab_size, (2, SEQ))
    torch.onnx.export(LastHidden(), (ids, torch.ones_like(ids)), str(path), input_names=["input_ids", "attention_mask"],
                      output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                      dynamic_axes={"input_ids": {0: "batch"}, "attention_mask": {0: "batch"}})
    return path


def model_rows(name: str, rows: int) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    if name == "bert_small":
        path = bert_small(models_dir() / "bert_small.onnx")
        return path, {"input_ids": rng.integers(0, 30522, (rows, SEQ)).astype(np.int64),
                      "attention_mask": np.ones((rows, SEQ), np.int64)}
    path = models_dir() / f"{name}.onnx"
    if not path.exists():
        raise SystemExit(f"{path} is missing: python benchmarks/make_models.py --only {name}")
    return path, {"input": rng.standard_normal((rows, 3, 224, 224)).astype(np.float32)}


def batches(columns: dict[str, np.ndarray], size: int):
    rows = len(next(iter(columns.values())))
    return [{k: v[i:i + size] for k, v in columns.items()} for i in range(0, rows, size)]


def loop_rows_per_s(run, feeds: list[dict]) -> float:
    run(feeds[0])  # warm-up
    started = time.perf_counter()
    for feed in feeds:
        run(feed)
    return sum(len(next(iter(f.values()))) for f in feeds) / (time.perf_counter() - started)


def onnxruntime_rows_per_s(path: Path, feeds: list[dict], threads: int) -> float:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return loop_rows_per_s(lambda feed: session.run(None, feed), feeds)


def carrack_rows_per_s(session, feeds: list[dict], threads: int) -> float:
    session.get_session_options().intra_op_num_threads = threads
    return loop_rows_per_s(lambda feed: session.run(None, feed), feeds)


def make_timed_predictor():
    from carrack.ray import CarrackPredictor

    class TimedPredictor(CarrackPredictor):
        """Records when the actor started, how long fetching the plan (transfer + executor build) took, and when its
        first batch was done (wall-clock: the driver and the actors share the machine's clock)."""

        def __init__(self, model, **kwargs):
            import ray

            self.entered = time.time()
            session = ray.get(model)
            self.plan_s = time.time() - self.entered
            super().__init__(session, **kwargs)
            self.first_done = None

        def __call__(self, batch):
            out = super().__call__(batch)
            if self.first_done is None:
                self.first_done = time.time()
            n = len(out["id"])
            out["entered"] = np.full(n, self.entered)
            out["plan_s"] = np.full(n, self.plan_s)
            out["first_done"] = np.full(n, self.first_done)
            return out

    return TimedPredictor


def ray_run(session_ref, columns: dict[str, np.ndarray], batch_size: int, workers: int) -> dict:
    import pandas as pd
    import ray
    from ray.data.extensions import TensorArray

    rows = len(next(iter(columns.values())))
    frames = [pd.DataFrame({"id": np.arange(i, min(i + batch_size, rows)),
                            **{k: TensorArray(v[i:i + batch_size]) for k, v in columns.items()}})
              for i in range(0, rows, batch_size)]
    dataset = ray.data.from_pandas(frames).materialize()
    started = time.time()
    scored = dataset.map_batches(make_timed_predictor(), fn_constructor_kwargs={"model": session_ref,
                                                                               "report_worker": True},
                                 compute=ray.data.ActorPoolStrategy(size=workers), batch_size=batch_size, num_cpus=1)
    table = pd.concat([b for b in scored.iter_batches(batch_format="pandas", batch_size=None)])
    elapsed = time.time() - started
    per_worker = table.groupby("__carrack_worker").agg(rows=("id", "size"), entered=("entered", "first"),
                                                      plan_s=("plan_s", "first"), first=("first_done", "first"),
                                                      busy=("__carrack_seconds", "sum"))
    assert len(table) == rows and table["id"].is_unique
    return {"rows_per_s": rows / elapsed, "elapsed": elapsed,
            "workers": [(r.rows, r.entered - started, r.plan_s, r.first - started, r.busy)
                        for r in per_worker.itertuples()]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mobilenetv2,bert_small")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rows", type=int, help="rows per model (default: 192 for mobilenetv2, 768 for bert_small)")
    args = p.parse_args(argv)
    worker_counts = [int(w) for w in args.workers.split(",")]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    import carrack

    ray.init(num_cpus=max(worker_counts), object_store_memory=512 * 2**20, include_dashboard=False,
             _node_ip_address="127.0.0.1", logging_level="WARNING", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    print(f"machine: {os.cpu_count()} cores (shared: timings are noisy); batch size {args.batch_size}; Ray "
          f"{ray.__version__}; actors of 1 CPU")
    for name in args.models.split(","):
        path, columns = model_rows(name, args.rows or ROWS[name])
        feeds = batches(columns, args.batch_size)
        started = time.perf_counter()
        session = carrack.InferenceSession(str(path))
        compile_s = time.perf_counter() - started
        plan = pickle.dumps(session)
        started = time.perf_counter()
        pickle.loads(plan)
        unpickle_s = time.perf_counter() - started
        ref = ray.put(session)
        rows = len(next(iter(columns.values())))
        print(f"\n{name}: {rows} rows; compile on the driver {compile_s:.2f} s; plan {len(plan) / 2**20:.1f} MiB, "
              f"unpickled (executor built, no optimizer) in {unpickle_s * 1000:.0f} ms")
        print(f"  {'engine':34s} {'rows/s':>8s}")
        for threads in sorted(set(worker_counts)):
            ort_rate = onnxruntime_rows_per_s(path, feeds, threads)
            print(f"  {f'onnxruntime loop, {threads} thread(s)':34s} {ort_rate:8.1f}")
            carrack_rate = carrack_rows_per_s(session, feeds, threads)
            print(f"  {f'carrack loop, {threads} thread(s)':34s} {carrack_rate:8.1f}")
        for workers in worker_counts:
            result = ray_run(ref, columns, args.batch_size, workers)
            print(f"  {f'carrack.ray, {workers} worker(s)':34s} {result['rows_per_s']:8.1f}   "
                  f"(wall {result['elapsed']:.1f} s, actor start and first batch included)")
            for rows_done, entered, plan_s, first, busy in result["workers"]:
                print(f"      worker: {rows_done} rows, {rows_done / busy:.1f} rows/s while scoring; actor up "
                      f"{entered:.2f} s after submit; plan fetch + executor {plan_s * 1000:.0f} ms; first batch done "
                      f"{first:.2f} s after submit")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
