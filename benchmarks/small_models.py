"""Per-run time of small models, where Python overhead per node and per run decides: carrack beside onnxruntime.

  bert_ts / bert_dynamo   BertModel, 2 layers, hidden 64, 4 heads (random weights), batch 1 x 16 tokens,
                          exported by torch.onnx's TorchScript and dynamo exporters
  gpt2_decode             GPT2LMHeadModel, 2 layers, hidden 64, with past key values: one decode step (1 token,
                          past of 16)
  mlp                     a 3-layer MLP (256 -> 256 -> 256 -> 10, ReLU), batch 1
  light_squeezenet        the onnx wheel's light models (~/.cache/carrack-bench/light_*.onnx, or
  light_shufflenet        `python benchmarks/make_models.py --only light_squeezenet,light_shufflenet`)
  decode_tiny             greedy decoding with the KV cache fed back, a new past length every token (no shape
  decode_gpt2             repeats): the tiny GPT-2 above, or GPT-2 small (benchmarks/serving.py's gpt2_past.onnx);
                          the engines alternate token by token, each with its own cache; ms per token

Both engines run in one process (or, with --fresh, each thread count in a fresh process), alternating: for each
round, a batch of --inner runs of carrack then of onnxruntime, so both see the same machine load. Reported per
model and thread count: the median over --rounds of the per-run microseconds, and carrack / onnxruntime.

  python benchmarks/small_models.py [--models bert_ts,mlp] [--threads 1,0] [--rounds 15] [--inner 50]
                                    [--profile MODEL] [--json PATH]

`--profile MODEL` prints carrack's per-op time table (its session profiler) and a cProfile summary of the run loop
for that model at one thread instead of timing. Models are built on first use into $CARRACK_MODELS/small (random
weights; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("CARRACK_MODELS", "~/.cache/carrack-bench")).expanduser()
SMALL = MODELS / "small"
ALL_MODELS = ["bert_ts", "bert_dynamo", "gpt2_decode", "mlp", "light_squeezenet", "light_shufflenet", "decode_tiny",
              "decode_gpt2"]
BERT = {"layers": 2, "hidden": 64, "heads": 4, "intermediate": 128, "vocab": 1000, "tokens": 16}
GPT2 = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 1000, "past": 16}


# --------------------------------------------------------------------------------------------- models and feeds
def _quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def _export_bert(path: Path, dynamo: bool) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=BERT["vocab"], hidden_size=BERT["hidden"],
                                     num_hidden_layers=BERT["layers"], num_attention_heads=BERT["heads"],
                                     intermediate_size=BERT["intermediate"])
    bert = transformers.BertModel(config, add_pooling_layer=False).eval()

    class LastHidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]

    # example batch 2: torch.export specialises a dim whose example size is 1
    args = (torch.randint(0, BERT["vocab"], (2, BERT["tokens"])), torch.ones(2, BERT["tokens"], dtype=torch.int64))
    names = ["input_ids", "attention_mask"]
    with torch.no_grad(), _quiet():
        if dynamo:
            batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("sequence", max=512)
            shapes = ({0: batch, 1: seq}, {0: batch, 1: seq})
            torch.onnx.export(LastHidden(), args, str(path), input_names=names, output_names=["last_hidden_state"],
                              dynamic_shapes=shapes, dynamo=True, opset_version=18, external_data=False)
        else:
            axes = {n: {0: "batch", 1: "sequence"} for n in names}
            torch.onnx.export(LastHidden(), args, str(path), input_names=names, output_names=["last_hidden_state"],
                              dynamic_axes=axes, dynamo=False, opset_version=17)


def _export_gpt2(path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.plan.decoder import export_gpt2_with_past

    export_gpt2_with_past(path, False, GPT2["layers"], GPT2["heads"], GPT2["hidden"], GPT2["vocab"])


def _export_mlp(path: Path) -> None:
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10)).eval()
    with torch.no_grad(), _quiet():
        torch.onnx.export(net, (torch.randn(1, 256),), str(path), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False, opset_version=17)


BUILDERS: dict[str, Callable[[Path], None]] = {
    "bert_ts": lambda p: _export_bert(p, dynamo=False),
    "bert_dynamo": lambda p: _export_bert(p, dynamo=True),
    "gpt2_decode": _export_gpt2,
    "mlp": _export_mlp,
}


def model_path(name: str) -> Path:
    if name.startswith("light_"):
        path = MODELS / f"{name}.onnx"
        if not path.exists():
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_models.py"), "--only", name], check=True)
        return path
    path = SMALL / f"{name}.onnx"
    if not path.exists():
        SMALL.mkdir(parents=True, exist_ok=True)
        BUILDERS[name](path)
    return path


def make_feed(name: str, path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if name.startswith("bert"):
        return {"input_ids": rng.integers(0, BERT["vocab"], (1, BERT["tokens"]), dtype=np.int64),
                "attention_mask": np.ones((1, BERT["tokens"]), np.int64)}
    if name == "gpt2_decode":
        head = GPT2["hidden"] // GPT2["heads"]
        past = {f"past_key_values.{i}.{k}": rng.standard_normal((1, GPT2["heads"], GPT2["past"], head),
                                                                dtype=np.float32)
                for i in range(GPT2["layers"]) for k in ("key", "value")}
        return {"input_ids": np.array([[7]], np.int64),
                "attention_mask": np.ones((1, GPT2["past"] + 1), np.int64), **past}
    if name == "mlp":
        return {"x": rng.standard_normal((1, 256), dtype=np.float32)}
    import onnx

    graph = onnx.load(str(path)).graph
    inits = {i.name for i in graph.initializer}
    feed = {}
    for v in graph.input:
        if v.name not in inits:
            shape = [d.dim_value or 1 for d in v.type.tensor_type.shape.dim]
            feed[v.name] = rng.standard_normal(shape, dtype=np.float32)
    return feed


# --------------------------------------------------------------------------------------------- timing
def sessions(path: Path, threads: int):
    import onnxruntime as ort

    import carrack

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    ort_session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    co = carrack.SessionOptions()
    co.intra_op_num_threads = threads
    return carrack.InferenceSession(str(path), co), ort_session


def _per_run_us(session, feed: dict, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        session.run(None, feed)
    return (time.perf_counter() - t0) / inner * 1e6


def time_model(name: str, threads: int, rounds: int, inner: int) -> dict:
    path = model_path(name)
    feed = make_feed(name, path)
    carrack_session, ort_session = sessions(path, threads)
    ours, theirs = carrack_session.run(None, feed), ort_session.run(None, feed)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs))
    for session in (carrack_session, ort_session):
        _per_run_us(session, feed, inner)  # warm-up
    times: dict[str, list[float]] = {"carrack": [], "ort": []}
    for _ in range(rounds):
        times["carrack"].append(_per_run_us(carrack_session, feed, inner))
        times["ort"].append(_per_run_us(ort_session, feed, inner))
    c, o = statistics.median(times["carrack"]), statistics.median(times["ort"])
    nodes = len(carrack_session._plan.graph.nodes)
    return {"model": name, "threads": threads, "carrack_us": round(c, 1), "ort_us": round(o, 1),
            "ratio": round(c / o, 2), "carrack_min_us": round(min(times["carrack"]), 1),
            "ort_min_us": round(min(times["ort"]), 1), "nodes": nodes, "max_abs_diff": worst}


def time_decode(name: str, threads: int, tokens: int) -> dict:
    """Per-token time of greedy decoding with a growing KV cache, the two engines alternating token by token."""
    if name == "decode_gpt2":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from serving import DECODER, _decoder_path

        spec, path = DECODER, _decoder_path(DECODER)
    else:
        spec, path = dict(GPT2, name="tiny"), model_path("gpt2_decode")
    head = spec["hidden"] // spec["heads"]
    names = [f"past_key_values.{i}.{k}" for i in range(spec["layers"]) for k in ("key", "value")]
    engines = dict(zip(("carrack", "ort"), sessions(path, threads)))
    state = {e: (np.array([[1] * 8], np.int64), {n: np.zeros((1, spec["heads"], 0, head), np.float32)
                                                 for n in names}) for e in engines}
    times: dict[str, list[float]] = {e: [] for e in engines}
    picked: dict[str, list[int]] = {e: [] for e in engines}
    for _ in range(tokens + 1):
        for engine, session in engines.items():
            ids, past = state[engine]
            total = ids.shape[1] + next(iter(past.values())).shape[2]
            feed = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64), **past}
            t0 = time.perf_counter()
            outs = session.run(None, feed)
            times[engine].append(time.perf_counter() - t0)
            token = int(outs[0][0, -1].argmax())
            picked[engine].append(token)
            state[engine] = (np.array([[token]], np.int64), dict(zip(names, outs[1:])))
    c, o = (statistics.median(times[e][1:]) * 1e6 for e in ("carrack", "ort"))  # [0]: the prompt
    return {"model": name, "threads": threads, "carrack_us": round(c, 1), "ort_us": round(o, 1),
            "ratio": round(c / o, 3), "nodes": len(engines["carrack"]._plan.graph.nodes),
            "same_tokens": picked["carrack"] == picked["ort"]}


def profile(name: str, runs: int) -> None:
    import cProfile
    import pstats

    import carrack

    path = model_path(name)
    feed = make_feed(name, path)
    so = carrack.SessionOptions()
    so.intra_op_num_threads = 1
    so.enable_profiling = True
    profiled = carrack.InferenceSession(str(path), so)
    for _ in range(runs):
        profiled.run(None, feed)
    print(profiled.profiler.table() if hasattr(profiled.profiler, "table") else "")
    session, _ = sessions(path, 1)
    for _ in range(20):
        session.run(None, feed)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(runs):
        session.run(None, feed)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ALL_MODELS))
    parser.add_argument("--threads", default="1,0", help="comma-separated; 0 = each engine's default")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=50)
    parser.add_argument("--fresh", action="store_true", help="each model and thread count in a fresh process")
    parser.add_argument("--profile", metavar="MODEL")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.profile:
        profile(args.profile, args.inner * 4)
        return 0
    rows = []
    for name in args.models.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            if args.fresh:
                out = subprocess.run([sys.executable, __file__, "--models", name, "--threads", str(threads),
                                      "--rounds", str(args.rounds), "--inner", str(args.inner), "--json", "-"],
                                     check=True, capture_output=True, text=True).stdout
                rows.append(json.loads(out.splitlines()[-1])[0])
            elif name.startswith("decode_"):
                rows.append(time_decode(name, threads, args.rounds * 4))
            else:
                rows.append(time_model(name, threads, args.rounds, args.inner))
    if args.json == "-":
        print(json.dumps(rows))
        return 0
    print("| model | nodes (carrack plan) | threads | carrack us/run | onnxruntime us/run | carrack / ort |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        threads = r["threads"] or "default"
        note = "" if r.get("same_tokens", True) else " (the engines picked different tokens)"
        print(f"| {r['model']} | {r['nodes']} | {threads} | {r['carrack_us']} | {r['ort_us']} | {r['ratio']}x{note} |")
    if any(r["model"].startswith("decode_") for r in rows):
        print("\ndecode_* rows: microseconds per generated token.")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
