"""What users run beyond one fixed shape, carrack beside onnxruntime in one run (each engine in its own process):

  varlen   BERT-base, a stream of batch-1 requests of random length 8-128 (a text server): total, p50, p99, and
           each request against the steady-state latency of its length
  decode   GPT-2 small exported with past key values (torch.onnx, as optimum exports it): a 32-token prompt, then
           greedy tokens with the KV cache fed back: ms per token
  create   session-creation time for the suite models and a 7,000-node graph (a 32-layer decoder export)

  python benchmarks/serving.py [--tasks varlen,decode,create] [--threads 1] [--requests 100] [--tokens 128]

Models are built locally on first use into $CARRACK_MODELS (random weights, nothing downloaded). Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("CARRACK_MODELS", "~/.cache/carrack-bench")).expanduser()
DECODER = {"name": "gpt2_past", "layers": 12, "heads": 12, "hidden": 768, "vocab": 50257}
BIG_GRAPH = {"name": "gpt2_32layers_past", "layers": 32, "heads": 4, "hidden": 64, "vocab": 1000}
CREATE_MODELS = ["mobilenetv2", "resnet50", "bert_base", "gpt2", "vit_small"]


def _session(engine: str, path: Path, threads: int):
    if engine == "ort":
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    import carrack

    so = carrack.SessionOptions()
    so.intra_op_num_threads = threads
    return carrack.InferenceSession(str(path), so)


def _decoder_path(spec: dict) -> Path:
    path = MODELS / f"{spec['name']}.onnx"
    if not path.exists():
        sys.path.insert(0, str(ROOT))
        from tests.plan.decoder import export_gpt2_with_past

        MODELS.mkdir(parents=True, exist_ok=True)
        export_gpt2_with_past(path, False, spec["layers"], spec["heads"], spec["hidden"], spec["vocab"])
    return path


def _suite_path(name: str) -> Path:
    path = MODELS / f"{name}.onnx"
    if not path.exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_models.py"), "--only", name], check=True)
    return path


# -- workers (one engine, one task, in a fresh process) ---------------------------------------------------------------

def work_varlen(engine: str, threads: int, requests: int) -> dict:
    path = _suite_path("bert_base")
    t0 = time.perf_counter()
    sess = _session(engine, path, threads)
    create_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(8, 129, requests)]

    def feed(n: int) -> dict:
        ids = rng.integers(0, 30000, (1, n)).astype(np.int64)
        return {"input_ids": ids, "attention_mask": np.ones((1, n), np.int64),
                "token_type_ids": np.zeros((1, n), np.int64)}

    t0 = time.perf_counter()
    sess.run(None, feed(64))  # a server warms up on one length
    first_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for n in lengths:
        f = feed(n)
        t0 = time.perf_counter()
        sess.run(None, f)
        times.append((time.perf_counter() - t0) * 1e3)
    steady = {}
    for n in sorted(set(lengths)):  # each length again, now seen: its steady-state latency
        f = feed(n)
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            sess.run(None, f)
            best = min(best, (time.perf_counter() - t0) * 1e3)
        steady[n] = best
    worst = max(t / steady[n] for t, n in zip(times, lengths))
    return {"create_s": create_s, "first_ms": first_ms, "total_ms": sum(times), "p50_ms": float(np.median(times)),
            "p99_ms": float(np.percentile(times, 99)), "worst_vs_steady": worst, "requests": len(lengths),
            "distinct": len(set(lengths))}


def work_decode(engine: str, threads: int, tokens: int) -> dict:
    path = _decoder_path(DECODER)
    past_names = [f"past_key_values.{i}.{k}" for i in range(DECODER["layers"]) for k in ("key", "value")]
    t0 = time.perf_counter()
    sess = _session(engine, path, threads)
    create_s = time.perf_counter() - t0
    heads, head = DECODER["heads"], DECODER["hidden"] // DECODER["heads"]
    ids = np.random.default_rng(0).integers(0, DECODER["vocab"], (1, 32)).astype(np.int64)
    past = {p: np.zeros((1, heads, 0, head), np.float32) for p in past_names}
    t0 = time.perf_counter()
    outs = sess.run(None, {"input_ids": ids, "attention_mask": np.ones((1, 32), np.int64), **past})
    prompt_ms = (time.perf_counter() - t0) * 1e3
    total, steps, generated = 32, [], []
    for _ in range(tokens):
        nxt = int(outs[0][0, -1].argmax())
        generated.append(nxt)
        past = dict(zip(past_names, outs[1:]))
        total += 1
        feed = {"input_ids": np.array([[nxt]], np.int64), "attention_mask": np.ones((1, total), np.int64), **past}
        t0 = time.perf_counter()
        outs = sess.run(None, feed)
        steps.append((time.perf_counter() - t0) * 1e3)
    return {"create_s": create_s, "prompt_ms": prompt_ms, "ms_per_token": float(np.median(steps)),
            "first_token_ms": steps[0], "total_ms": prompt_ms + sum(steps), "tokens": generated[:16]}


def work_create(engine: str, threads: int, name: str) -> dict:
    path = _decoder_path(BIG_GRAPH) if name == BIG_GRAPH["name"] else _suite_path(name)
    import onnx

    nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
    __import__("onnxruntime" if engine == "ort" else "carrack")  # the module import is not the session's cost
    t0 = time.perf_counter()
    sess = _session(engine, path, threads)
    create_s = time.perf_counter() - t0
    return {"create_s": create_s, "nodes": nodes, "session": type(sess).__module__}


# -- driver ------------------------------------------------------------------------------------------------------------

def _worker(task: str, engine: str, args: argparse.Namespace, extra: str = "") -> dict:
    cmd = [sys.executable, __file__, "--worker", task, "--engine", engine, "--threads", str(args.threads),
           "--requests", str(args.requests), "--tokens", str(args.tokens), "--model", extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{engine} {task} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="varlen,decode,create")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--worker", default="")
    ap.add_argument("--engine", default="carrack")
    ap.add_argument("--model", default="")
    args = ap.parse_args()
    if args.worker:
        fn = {"varlen": lambda: work_varlen(args.engine, args.threads, args.requests),
              "decode": lambda: work_decode(args.engine, args.threads, args.tokens),
              "create": lambda: work_create(args.engine, args.threads, args.model)}[args.worker]
        print(json.dumps(fn()))
        return
    tasks = args.tasks.split(",")
    print(f"# serving benchmarks, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
          f"intra-op threads {args.threads}, load average {os.getloadavg()[0]:.2f}\n")
    if "varlen" in tasks:
        ort, car = _worker("varlen", "ort", args), _worker("varlen", "carrack", args)
        print(f"## BERT-base, {car['requests']} batch-1 requests of random length 8-128 "
              f"({car['distinct']} distinct)\n")
        print("| engine | total ms | p50 ms | p99 ms | worst request / steady state of its length | first run ms |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in (("onnxruntime", ort), ("carrack", car)):
            print(f"| {name} | {r['total_ms']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                  f"{r['worst_vs_steady']:.2f} | {r['first_ms']:.0f} |")
        print(f"\ncarrack / onnxruntime total: {car['total_ms'] / ort['total_ms']:.2f}x\n")
    if "decode" in tasks:
        ort, car = _worker("decode", "ort", args), _worker("decode", "carrack", args)
        same = "identical" if ort["tokens"] == car["tokens"] else "DIFFERENT"
        print(f"## GPT-2 small with past key values: 32-token prompt, {args.tokens} greedy tokens "
              f"(first 16 tokens {same})\n")
        print("| engine | prompt ms | ms / token | first token ms | total ms |")
        print("|---|---:|---:|---:|---:|")
        for name, r in (("onnxruntime", ort), ("carrack", car)):
            print(f"| {name} | {r['prompt_ms']:.1f} | {r['ms_per_token']:.2f} | {r['first_token_ms']:.2f} | "
                  f"{r['total_ms']:.0f} |")
        print(f"\ncarrack / onnxruntime ms per token: {car['ms_per_token'] / ort['ms_per_token']:.2f}x\n")
    if "create" in tasks:
        print("## Session creation\n")
        print("| model | nodes | onnxruntime s | carrack s | ratio |")
        print("|---|---:|---:|---:|---:|")
        for name in CREATE_MODELS + [BIG_GRAPH["name"]]:
            ort, car = _worker("create", "ort", args, name), _worker("create", "carrack", args, name)
            print(f"| {name} | {car['nodes']} | {ort['create_s']:.2f} | {car['create_s']:.2f} | "
                  f"{car['create_s'] / ort['create_s']:.2f}x |")


if __name__ == "__main__":
    main()
