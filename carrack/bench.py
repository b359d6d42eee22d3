"""``carrack bench``: latency percentiles, throughput and peak memory of one model; and profiled runs.

    carrack bench model.onnx --dim batch=8 --threads 1 --iters 50 --warmup 5 [--profile]

Library use:

    result = benchmark("model.onnx", dims={"batch": 8}, iters=50)
    print(result.format())
    prof = run_profile("model.onnx", feed, iters=10)   # per-op table of the timed runs + Chrome trace
    print(prof.table); print(prof.trace_path)
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from carrack.native import intra_op
from carrack.runtime.blas import blas_threads, limited_blas_threads, set_blas_threads
from carrack.runtime.options import SessionOptions
from carrack.runtime.profiler import Profiler
from carrack.runtime.session import InferenceSession

MIB = 2**20


# --------------------------------------------------------------------------------------------- process facts
def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux VmHWM, else getrusage)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """This process's current resident set size (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------------------------- benchmark
@dataclass
class BenchResult:
    model: str
    times_s: list[float]
    load_s: float
    warmup: int
    threads: int | None
    batch: int
    rss_after_load: int
    peak_rss: int
    feed_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    profile: ProfileResult | None = None
    #: share of the timed runs' wall time spent in native regions split over threads (the rest ran on one core)
    split_share: float = 0.0
    #: pool workers woken from sleep per timed run (a spinning worker starts sooner)
    wakes_per_run: float = 0.0

    def percentile(self, q: float) -> float:
        """Latency percentile in seconds."""
        return float(np.percentile(np.array(self.times_s), q)) if self.times_s else float("nan")

    @property
    def mean_s(self) -> float:
        return float(np.mean(self.times_s)) if self.times_s else float("nan")

    @property
    def throughput(self) -> float:
        """Inferences per second (each inference processes `batch` samples)."""
        return 1.0 / self.mean_s if self.times_s else float("nan")

    def format(self) -> str:
        ms = 1000
        shapes = ", ".join(f"{k} {list(v)}" for k, v in self.feed_shapes.items())
        lines = [f"model: {self.model}",
                 f"inputs: {shapes}",
                 f"threads: {self.threads or 'default'}; session created in {self.load_s * ms:.0f} ms; "
                 f"{len(self.times_s)} timed runs after {self.warmup} warm-up"
                 + ("; profiling on" if self.profile else ""),
                 f"latency ms: p50 {self.percentile(50) * ms:.2f}  p90 {self.percentile(90) * ms:.2f}  "
                 f"p99 {self.percentile(99) * ms:.2f}  min {min(self.times_s, default=0) * ms:.2f}  "
                 f"max {max(self.times_s, default=0) * ms:.2f}  mean {self.mean_s * ms:.2f}",
                 f"throughput: {self.throughput:.2f} inferences/s"
                 + (f", {self.throughput * self.batch:.2f} samples/s (batch {self.batch})" if self.batch > 1 else ""),
                 f"memory: peak RSS {self.peak_rss / MIB:.1f} MiB (RSS after load {self.rss_after_load / MIB:.1f} MiB)",
                 f"cores: {self.split_share:.0%} of the runs' time in kernels split over threads (the rest on one "
                 f"core); {self.wakes_per_run:.0f} pool wake-ups a run"]
        if self.profile:
            lines += ["", self.profile.table, "", f"profile trace: {self.profile.trace_path}"]
        return "\n".join(lines)


def benchmark(model: Any, feed: Mapping[str, np.ndarray] | None = None, dims: Mapping[str, int] | None = None,
              iters: int = 20, warmup: int = 3, threads: int | None = None, profile: bool = False,
              trace_path: str | None = None) -> BenchResult:
    """Time `iters` runs of `model` (a path, bytes or ModelProto) after `warmup` untimed ones.

    Inputs not in `feed` get synthetic data (symbolic dims from `dims`, else 1; floats standard normal, integers
    0 or 1 so that ids and indices stay in range). `threads` limits numpy's BLAS pool while it runs. With
    `profile`, the session profiles every node and the result carries the table of the timed runs.
    """
    with limited_blas_threads(threads):
        return _benchmark(model, feed, dims, iters, warmup, threads, profile, trace_path)


def _benchmark(model: Any, feed: Mapping[str, np.ndarray] | None, dims: Mapping[str, int] | None, iters: int,
               warmup: int, threads: int | None, profile: bool, trace_path: str | None) -> BenchResult:
    options = SessionOptions(enable_profiling=profile, intra_op_num_threads=threads or 0)
    t0 = time.perf_counter()
    sess = InferenceSession(model, options)
    load_s = time.perf_counter() - t0
    rss_after_load = rss_bytes()
    full_feed = _complete_feed(sess, feed, dims)
    for _ in range(warmup):
        sess.run(None, full_feed)
    timed_from = time.perf_counter_ns()
    times = []
    split_before, wakes_before = intra_op.parallel_seconds(), intra_op.pool_wakes()
    for _ in range(iters):
        t0 = time.perf_counter()
        sess.run(None, full_feed)
        times.append(time.perf_counter() - t0)
    split_share = (intra_op.parallel_seconds() - split_before) / sum(times) if times else 0.0
    wakes_per_run = (intra_op.pool_wakes() - wakes_before) / len(times) if times else 0.0
    result = BenchResult(model=model if isinstance(model, str) else type(model).__name__, times_s=times,
                         load_s=load_s, warmup=warmup, threads=threads, batch=_batch(full_feed),
                         rss_after_load=rss_after_load, peak_rss=peak_rss_bytes(),
                         feed_shapes={k: tuple(np.shape(v)) for k, v in full_feed.items()},
                         split_share=split_share, wakes_per_run=wakes_per_run)
    if profile:
        result.profile = _profile_since(sess.profiler, timed_from, trace_path)
    return result


def _complete_feed(sess: InferenceSession, feed: Mapping[str, np.ndarray] | None,
                   dims: Mapping[str, int] | None) -> dict[str, np.ndarray]:
    from carrack.cli import synthetic_feed

    given = dict(feed or {})
    missing = [a.name for a in sess.get_inputs() if a.name not in given]
    if missing:
        synthetic = synthetic_feed(sess, dict(dims or {}))
        given.update({k: _small_ints(v) for k, v in synthetic.items() if k in missing})
    return given


def _small_ints(value: np.ndarray) -> np.ndarray:
    """Integer inputs as 0/1: valid token ids, segment ids, masks and indices for any table of 2 or more rows."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        return (value % 2).astype(value.dtype)
    return value


def _batch(feed: Mapping[str, Any]) -> int:
    """The leading dim of the first input with one (1 for scalars)."""
    for v in feed.values():
        shape = np.shape(v)
        if shape:
            return int(shape[0])
    return 1


# --------------------------------------------------------------------------------------------- profiling
@dataclass
class ProfileResult:
    table: str
    trace_path: str
    times_s: list[float]
    outputs: list[Any]
    events: int


def profiling_options(options: SessionOptions | None = None) -> SessionOptions:
    """Session options with profiling switched on (a copy of `options` when given)."""
    from dataclasses import replace

    opts = replace(options) if options is not None else SessionOptions()
    opts.enable_profiling = True
    return opts


def run_profile(model: Any, feed: Mapping[str, np.ndarray], iters: int = 10, warmup: int = 1,
                trace_path: str | None = None) -> ProfileResult:
    """Run `model` `iters` times with per-node profiling; returns the op/node table of those runs and a trace file.

    `model` is a path, bytes or ModelProto (a profiling session is created), or an InferenceSession created with
    ``enable_profiling=True``. `warmup` runs go first and are left out of the table and the trace.
    """
    if isinstance(model, InferenceSession):
        sess = model
        if sess.profiler is None:
            raise ValueError("run_profile needs a session created with SessionOptions(enable_profiling=True)")
    else:
        sess = InferenceSession(model, profiling_options())
    for _ in range(warmup):
        sess.run(None, feed)
    start = time.perf_counter_ns()
    times: list[float] = []
    outputs: list[Any] = []
    for _ in range(max(iters, 1)):
        t0 = time.perf_counter()
        outputs = sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    result = _profile_since(sess.profiler, start, trace_path)
    result.times_s, result.outputs = times, outputs
    return result


def _profile_since(profiler: Profiler, start_ns: int, trace_path: str | None) -> ProfileResult:
    """Table and Chrome trace of the events recorded after `start_ns` (perf_counter_ns), leaving warm-up out."""
    kept = Profiler(profiler.prefix)
    kept.origin_ns = profiler.origin_ns
    events = [e for e in profiler.events if e.start_ns + profiler.origin_ns >= start_ns]
    for e in events:
        begin = e.start_ns + profiler.origin_ns
        kept.record(e.name, e.op_type, begin, begin + e.duration_ns, e.category)
    return ProfileResult(table=kept.table(), trace_path=kept.write(trace_path), times_s=[], outputs=[],
                         events=len(events))


# --------------------------------------------------------------------------------------------- command line
def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` sub-command to carrack's argument parser."""
    b = subparsers.add_parser("bench", help="latency percentiles, throughput and peak memory of a model")
    b.add_argument("model")
    b.add_argument("--dim", action="append", metavar="SYMBOL=SIZE", help="size for a symbolic dim (default 1)")
    b.add_argument("--input", action="append", metavar="NAME=FILE.npy", help="an input's data (else synthetic)")
    b.add_argument("--threads", type=int, default=None, help="numpy BLAS threads (default: numpy's own)")
    b.add_argument("--iters", type=int, default=20, help="timed runs (default 20)")
    b.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    b.add_argument("--profile", action="store_true", help="profile every node: op table and a Chrome trace")
    b.add_argument("--trace", metavar="PATH.json", help="where to write the profile trace (with --profile)")
    b.set_defaults(func=cmd_bench)
    return b


def cmd_bench(args: argparse.Namespace) -> int:
    from carrack.cli import _load_inputs, _parse_dims

    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("carrack: --iters must be >= 1 and --warmup >= 0")
    result = benchmark(args.model, feed=_load_inputs(args.input), dims=_parse_dims(args.dim), iters=args.iters,
                       warmup=args.warmup, threads=args.threads, profile=args.profile, trace_path=args.trace)
    print(result.format())
    return 0


__all__ = ["BenchResult", "ProfileResult", "add_bench_parser", "benchmark", "blas_threads", "cmd_bench",
           "limited_blas_threads", "peak_rss_bytes", "profiling_options", "run_profile", "set_blas_threads"]
