"""carrack's command line: ``carrack demo``, ``carrack run``, ``carrack info``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np

import carrack
from carrack.errors import CarrackError

LIGHT_DIR = os.path.join(os.path.dirname(__import__("onnx").__file__), "backend", "test", "data", "light")


def _parse_dims(items: Sequence[str]) -> dict[str, int]:
    dims = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise SystemExit(f"carrack: --dim expects NAME=INT, got '{item}'")
        dims[name.strip()] = int(value)
    return dims


def _input_shape(arg: carrack.NodeArg, dims: dict[str, int]) -> tuple[int, ...]:
    shape = []
    for d in arg.shape or ():
        if isinstance(d, int):
            shape.append(d)
        elif isinstance(d, str) and d in dims:
            shape.append(dims[d])
        else:
            shape.append(1)
    return tuple(shape)


_NUMPY_OF = {"float": np.float32, "double": np.float64, "float16": np.float16, "int64": np.int64,
             "int32": np.int32, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}


def synthetic_feed(sess: carrack.InferenceSession, dims: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs for every model input (unknown dims = 1 unless given with --dim)."""
    rng = np.random.default_rng(seed)
    feed = {}
    for arg in sess.get_inputs():
        kind = arg.type[len("tensor("):-1] if arg.type.startswith("tensor(") else None
        dtype = _NUMPY_OF.get(kind)
        if dtype is None:
            raise SystemExit(f"carrack: cannot make synthetic data for input '{arg.name}' of type {arg.type}; "
                             "give it with --input NAME=FILE.npy")
        shape = _input_shape(arg, dims)
        if np.issubdtype(dtype, np.floating):
            feed[arg.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feed[arg.name] = rng.integers(0, 2, shape).astype(bool)
        else:  # 0 and 1 are valid indices into any table (token ids, token types, positions)
            feed[arg.name] = rng.integers(0, 2, shape).astype(dtype)
    return feed


def _time_runs(sess: carrack.InferenceSession, feed: dict, iters: int) -> tuple[list, list[float]]:
    outputs = sess.run(None, feed)  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    return outputs, times


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the ResNet-50 graph shipped in the onnx wheel and print its top predictions and latency."""
    import onnx
    from onnx import numpy_helper

    path = os.path.join(LIGHT_DIR, f"light_{args.model}.onnx")
    if not os.path.isfile(path):
        raise SystemExit(f"carrack: no model 'light_{args.model}.onnx' in the onnx wheel ({LIGHT_DIR})")
    t0 = time.perf_counter()
    sess = carrack.InferenceSession(path)
    load_s = time.perf_counter() - t0
    inp = sess.get_inputs()[0]
    shape = _input_shape(inp, {})
    n = int(np.prod(shape))
    x = (np.arange(n, dtype=np.float32) / n).reshape(shape)  # onnx's own dummy input for these models
    outputs, times = _time_runs(sess, {inp.name: x}, args.iters)
    scores = outputs[0].reshape(-1)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    print(f"carrack {carrack.__version__}: {args.model} ({os.path.basename(path)}, real architecture, "
          f"{len(onnx.load(path, load_external_data=False).graph.node)} nodes), input {inp.name} {list(shape)}")
    print(f"session created in {load_s * 1000:.0f} ms")
    print("top-5 predictions (ImageNet class index: probability; the wheel ships this architecture with constant "
          "placeholder weights, so the scores are nearly uniform):")
    for idx in np.argsort(-probs, kind="stable")[:5]:
        print(f"  class {idx:4d}: {probs[idx]:.4f}")
    ref_path = os.path.join(LIGHT_DIR, f"light_{args.model}_output_0.pb")
    if os.path.isfile(ref_path):
        ref = numpy_helper.to_array(onnx.load_tensor(ref_path))
        diff = float(np.max(np.abs(ref.astype(np.float64) - outputs[0].astype(np.float64))))
        print(f"matches onnx's expected output: max abs diff {diff:.2e}")
    ms = np.array(times) * 1000
    print(f"latency over {args.iters} runs: median {np.median(ms):.1f} ms, min {ms.min():.1f} ms, "
          f"max {ms.max():.1f} ms")
    print(f"native kernels: {_native_summary()}")
    return 0


def _native_summary() -> str:
    from carrack.doctor import native_summary

    return native_summary()


def _load_inputs(items: Sequence[str]) -> dict[str, np.ndarray]:
    feed = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"carrack: --input expects NAME=FILE.npy, got '{item}'")
        feed[name] = np.load(path, allow_pickle=False)
    return feed


def _stats(value: np.ndarray) -> str:
    """min / max / mean / std of a numeric output (blank for strings and empty arrays)."""
    if value.size == 0 or value.dtype.kind not in "biuf" and value.dtype.name != "bfloat16":
        return ""
    v = value.astype(np.float64)
    return f"  min {v.min():.6g}  max {v.max():.6g}  mean {v.mean():.6g}  std {v.std():.6g}"


def cmd_run(args: argparse.Namespace) -> int:
    sess = carrack.InferenceSession(args.model)
    feed = synthetic_feed(sess, _parse_dims(args.dim))
    feed.update(_load_inputs(args.input))
    if args.profile:
        from carrack.bench import run_profile

        report = run_profile(args.model, feed, iters=max(args.iters, 1))
        outputs, times = report.outputs, list(report.times_s)
        print(report.table)
        print(f"chrome trace: {report.trace_path}")
    else:
        outputs, times = _time_runs(sess, feed, args.iters)
    for arg, value in zip(sess.get_outputs(), outputs):
        if isinstance(value, np.ndarray):
            print(f"{arg.name}: {value.dtype} {list(value.shape)}{_stats(value)}")
            with np.printoptions(precision=4, threshold=20, edgeitems=3):
                print(f"  {value}")
        else:
            print(f"{arg.name}: {type(value).__name__}")
    if args.save:
        np.savez(args.save, **{a.name: v for a, v in zip(sess.get_outputs(), outputs) if isinstance(v, np.ndarray)})
        print(f"saved outputs to {args.save}")
    if times:
        ms = np.array(times) * 1000
        print(f"latency over {len(ms)} runs: median {np.median(ms):.2f} ms, min {ms.min():.2f} ms")
    return 0


def _op_counts(graph) -> Counter:
    return Counter(n.op_type if not n.domain else f"{n.domain}:{n.op_type}" for n in graph.nodes)


def cmd_info(args: argparse.Namespace) -> int:
    from carrack.onnx.importer import load_model

    model = load_model(args.model)
    g = model.graph
    sess = carrack.InferenceSession(args.model)
    print(f"model: {args.model}")
    print(f"producer: {model.producer or '?'}  ir_version: {model.ir_version}  opsets: "
          + ", ".join(f"{d or 'ai.onnx'}={v}" for d, v in sorted(model.opsets.items())))
    print("inputs:")
    for a in sess.get_inputs():
        print(f"  {a.name}: {a.type} {a.shape}")
    print("outputs:")
    for a in sess.get_outputs():
        print(f"  {a.name}: {a.type} {a.shape}")
    arrays = [v for v in g.initializers.values() if isinstance(v, np.ndarray)]
    weight_bytes = sum(v.nbytes for v in arrays)
    params = sum(v.size for v in arrays)
    print(f"parameters: {params:,} in {len(g.initializers)} initializers ({weight_bytes:,} bytes, "
          f"{weight_bytes / 2**20:.2f} MiB)")
    counts = _op_counts(g)
    if args.optimized:
        after = _op_counts(sess._model.graph)
        print(f"nodes: {len(g.nodes)} -> {len(sess._model.graph.nodes)} after optimization")
        print(f"  {'op type':32s} {'before':>7s} {'after':>7s}")
        for op in sorted(set(counts) | set(after), key=lambda o: (-counts.get(o, 0), o)):
            print(f"  {op:32s} {counts.get(op, 0):7d} {after.get(op, 0):7d}")
        fired = ", ".join(f"{k} x{v}" for k, v in sorted(sess.optimizer_stats.items())) or "none"
        print(f"rewrites: {fired}")
    else:
        print(f"nodes: {len(g.nodes)}")
        for op, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {op:32s} {c}")
    if args.implementations:
        _print_implementations(sess)
    if args.memory:
        dims = _parse_dims(args.dim)
        print(f"memory plan ({', '.join(f'{k}={v}' for k, v in dims.items()) or 'declared dims'}):")
        for line in sess.memory_plan(dims).summary().splitlines():
            print(f"  {line}")
    return 0


def _print_implementations(sess: carrack.InferenceSession) -> None:
    """The selection table's choices (carrack.plan.select), counted by op type, of the optimized graph."""
    op_of = {n.name or next((o for o in n.outputs if o), ""): n.op_type for n in sess._model.graph.nodes}
    chosen = Counter((op_of.get(name, "?"), impl) for name, impl in sess.implementations().items())
    print("implementations (nodes with more than one):" if chosen else "implementations: numpy only")
    for (op, impl), count in sorted(chosen.items()):
        print(f"  {op:32s} {impl:8s} {count}")


_LEVELS = {"disable": 0, "basic": 1, "extended": 2, "all": 99}


def cmd_optimize(args: argparse.Namespace) -> int:
    opts = carrack.SessionOptions()
    opts.graph_optimization_level = carrack.GraphOptimizationLevel(_LEVELS[args.level])
    opts.optimized_model_filepath = args.output
    sess = carrack.InferenceSession(args.model, opts)
    before, after = len(sess._source_model.graph.nodes), len(sess._model.graph.nodes)
    print(f"wrote {args.output}: {before} -> {after} nodes")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="carrack", description="carrack: run ONNX models on numpy")
    p.add_argument("--version", action="version", version=f"carrack {carrack.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run a real-architecture model shipped in the onnx wheel (no download)")
    d.add_argument("--model", default="resnet50", help="light model name: resnet50, squeezenet, densenet121, ...")
    d.add_argument("--iters", type=int, default=10)
    d.set_defaults(func=cmd_demo)
    r = sub.add_parser("run", help="run a model on given or synthetic inputs")
    r.add_argument("model")
    r.add_argument("--input", action="append", metavar="NAME=FILE.npy")
    r.add_argument("--dim", action="append", metavar="SYMBOL=SIZE", help="size for a symbolic dim (default 1)")
    r.add_argument("--iters", type=int, default=0, help="timed runs after the first")
    r.add_argument("--save", metavar="OUT.npz")
    r.add_argument("--profile", action="store_true", help="per-op and per-node time table and a Chrome trace")
    r.set_defaults(func=cmd_run)
    i = sub.add_parser("info", help="inputs, outputs, opsets and node counts of a model")
    i.add_argument("model")
    i.add_argument("--memory", action="store_true", help="show the static memory plan")
    i.add_argument("--optimized", action="store_true", help="node counts by op type before and after optimization")
    i.add_argument("--dim", action="append", metavar="SYMBOL=SIZE", help="size for a symbolic dim")
    i.add_argument("--implementations", action="store_true",
                   help="native or numpy per op type, as the plan chose them")
    i.set_defaults(func=cmd_info)
    o = sub.add_parser("optimize", help="write the optimized graph as an ONNX file")
    o.add_argument("model")
    o.add_argument("output")
    o.add_argument("--level", choices=list(_LEVELS), default="all")
    o.set_defaults(func=cmd_optimize)
    from carrack.backends.c.cli import add_compile_parser
    from carrack.batch import add_batch_parser
    from carrack.bench import add_bench_parser
    from carrack.doctor import add_doctor_parser
    from carrack.gguf.cli import add_gguf_parser
    from carrack.llm.cli import add_llm_parser

    add_bench_parser(sub)
    add_batch_parser(sub)
    add_compile_parser(sub)
    add_gguf_parser(sub)
    add_doctor_parser(sub)
    add_llm_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CarrackError as e:
        print(f"carrack: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
