"""Time carrack against onnxruntime on the benchmark suite; or (--memory) compare their peak memory.

Latency mode: for each model and thread count, one fresh worker process per engine loads the model; the driver then
alternates single inferences between them (carrack, ort, carrack, ort, ...): first --warmup runs each, then --iters
timed runs each, so that both engines see the same machine load. Reported: median and min-max latency, the
carrack/onnxruntime ratio of medians, each process's peak RSS, and achieved GFLOP/s (2 x MatMul/Gemm/Conv MACs per
inference / median latency) against numpy's float32 2048^3 matmul rate measured at the start of the run with the
same thread count.

Before each run the driver waits until the other engine's process is idle (at most 0.25 s; --no-settle: not):
onnxruntime's intra-op threads spin on for a while after its run and would otherwise take a core from carrack's
next run (and carrack's pool workers, more briefly, from onnxruntime's).

--alone instead times each engine with no other engine's process alive (two rounds of fresh processes, carrack
then onnxruntime, then the reverse): what a user running one engine sees at several threads, where idle threads of
the other engine's process can still take a core from the alternating runs.

Memory mode: per model, a fresh process per engine loads the model and runs one inference; reported: the process's
peak RSS (VmHWM), its RSS before loading (imports only), and carrack's static memory plan (weights, arena, planned
peak, arena / sum of intermediates).

Output: a markdown table on stdout, and JSON (--json, default $CARRACK_MODELS/results/<mode>-<time>.json).
Usage: python benchmarks/run.py [--models a,b] [--threads 1,2] [--iters 5] [--warmup 2] [--memory]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
REPO = Path(os.environ.get("CARRACK_REPO") or HERE.parent)
sys.path.insert(0, str(HERE))

from bench_common import blas_core, dim_bindings, input_spec, models_dir, thread_env  # noqa: E402

#: OpenBLAS core type of every worker (set from --blas-core in main)
BLAS_CORE: str | None = None

ENGINES = ("carrack", "ort")
DEFAULT_MODELS = ["resnet50", "mobilenetv2", "bert_base", "gpt2", "vit_small", "encoder_1024", "light_resnet50",
                  "light_squeezenet", "light_densenet121", "light_inception_v1", "light_shufflenet"]
MIB = 2**20


# --------------------------------------------------------------------------------------------- worker processes
class Worker:
    """A benchmark worker process (worker.py) speaking JSON lines; stderr goes to a temp file for error reports."""

    def __init__(self, mode: str, args: list[str], threads: int):
        env = thread_env(threads, BLAS_CORE)
        env["BENCH_THREADS"] = str(threads)
        env["CARRACK_REPO"] = str(REPO)
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "worker.py"), mode, *args], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     bufsize=1)

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict:
        """The next message; a synthetic error message when the worker dies or times out."""
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0.01))
        if not ready:
            self.close()
            return {"event": "error", "phase": "timeout", "error": f"no answer within {timeout:.0f} s (killed)"}
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            return {"event": "error", "phase": "crash", "error": f"worker exited with code {self.proc.returncode}: "
                    + self.stderr_tail()}
        return json.loads(line)

    def stderr_tail(self, n: int = 400) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-n:].strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of a process so far, in nanoseconds (the scheduler's own count, /proc/PID/task/*/
    schedstat); 0 where it cannot be read."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def wait_until_idle(pids: list[int], quiet_s: float = 0.002, limit_s: float = 0.25) -> float:
    """Waits until the processes have used under a tenth of a core for `quiet_s` (an engine's intra-op threads
    may keep spinning after its run, onnxruntime's for tens of milliseconds, and would take a core from the other
    engine's next run); at most `limit_s`. Returns the seconds waited."""
    start = time.perf_counter()
    if not pids or not os.path.isdir(f"/proc/{pids[0]}/task"):
        return 0.0
    while time.perf_counter() - start < limit_s:
        before = sum(process_cpu_ns(p) for p in pids)
        time.sleep(quiet_s)
        if sum(process_cpu_ns(p) for p in pids) - before < quiet_s * 1e8:
            break
    return time.perf_counter() - start


def measure_peak(threads: int) -> dict:
    """numpy's (and onnxruntime's) float32 2048^3 matmul GFLOP/s with `threads` threads."""
    w = Worker("peak", [], threads)
    msg = w.receive(120)
    w.close()
    return msg


def time_model_alone(path: Path, threads: int, iters: int, warmup: int, timeout: float) -> dict[str, dict]:
    """Latency of each engine with no other engine's process alive: two rounds (carrack, ort, then ort, carrack),
    each a fresh process making `warmup` runs and half the timed runs, so that slow drift of the machine falls on
    both. What a user running one engine sees; idle threads of the other cannot take a core."""
    results: dict[str, dict] = {e: {"times_ms": [], "cpu_ms": [], "settle_ms": []} for e in ENGINES}
    for order in (ENGINES, ENGINES[::-1]):
        for engine in order:
            r = results[engine]
            if "error" in r:
                continue
            w = Worker("serve", [engine, str(path)], threads)
            msg = w.receive(timeout)
            if msg["event"] != "ready":
                r.update(error=msg["error"], phase=msg["phase"])
                w.close()
                continue
            r.setdefault("load_s", msg["load_s"])
            r.setdefault("baseline_rss", msg["baseline_rss"])
            deadline = time.monotonic() + timeout
            for i in range(warmup + (iters + 1) // 2):
                w.send("run")
                msg = w.receive(deadline - time.monotonic())
                if msg["event"] != "ran":
                    r.update(error=msg["error"], phase=msg["phase"])
                    break
                r.setdefault("first_ms", msg["ms"])
                if i >= warmup:
                    r["times_ms"].append(msg["ms"])
                    r["cpu_ms"].append(msg["cpu_ms"])
            if "error" not in r:
                w.send("stats")
                r["peak_rss"] = max(r.get("peak_rss") or 0, w.receive(30).get("peak_rss") or 0)
            w.close()
    _summarize(results)
    return results


def _summarize(results: dict[str, dict]) -> None:
    for r in results.values():
        if r.get("times_ms") and "error" not in r:
            r.update(median_ms=median(r["times_ms"]), min_ms=min(r["times_ms"]), max_ms=max(r["times_ms"]),
                     cpu_per_wall=sum(r["cpu_ms"]) / sum(r["times_ms"]),
                     settle_median_ms=median(r["settle_ms"]) if r["settle_ms"] else 0.0)


def time_model(path: Path, threads: int, iters: int, warmup: int, timeout: float,
               settle: bool = True) -> dict[str, dict]:
    """Interleaved latency of every engine on one model; per engine a dict of results or an error. With
    `settle`, each run starts once the other engines' processes are idle (wait_until_idle)."""
    results: dict[str, dict] = {}
    workers: dict[str, Worker] = {}
    for engine in ENGINES:  # load one after the other: loading is not what is measured
        w = Worker("serve", [engine, str(path)], threads)
        msg = w.receive(timeout)
        if msg["event"] == "ready":
            workers[engine] = w
            results[engine] = {"load_s": msg["load_s"], "baseline_rss": msg["baseline_rss"], "times_ms": [],
                               "cpu_ms": [], "settle_ms": []}
        else:
            results[engine] = {"error": msg["error"], "phase": msg["phase"]}
            w.close()
    deadline = time.monotonic() + timeout
    for i in range(warmup + iters):
        for engine, w in list(workers.items()):
            if settle:
                others = [o.proc.pid for e, o in workers.items() if e != engine]
                results[engine]["settle_ms"].append(wait_until_idle(others) * 1e3)
            w.send("run")
            msg = w.receive(deadline - time.monotonic())
            if msg["event"] != "ran":
                results[engine].update(error=msg["error"], phase=msg["phase"])
                w.close()
                del workers[engine]
                continue
            if i == 0:
                results[engine]["first_ms"] = msg["ms"]
            if i >= warmup:
                results[engine]["times_ms"].append(msg["ms"])
                results[engine]["cpu_ms"].append(msg["cpu_ms"])
    for engine, w in workers.items():
        w.send("stats")
        msg = w.receive(30)
        results[engine]["peak_rss"] = msg.get("peak_rss")
        w.close()
    _summarize(results)
    return results


def memory_model(path: Path, threads: int, timeout: float) -> dict[str, dict]:
    results = {}
    for engine in ENGINES:
        w = Worker("memory", [engine, str(path)], threads)
        results[engine] = w.receive(timeout)
        w.close()
    return results


# --------------------------------------------------------------------------------------------- reporting
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def load_average() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _versions() -> str:
    import numpy

    out = [f"numpy {numpy.__version__}"]
    try:
        from importlib.metadata import version

        out.append(f"onnxruntime {version('onnxruntime')}")
    except Exception:  # noqa: BLE001
        pass
    return ", ".join(out)


def _short(error: str, n: int = 90) -> str:
    error = " ".join(error.split()).replace("|", "/")
    return error if len(error) <= n else error[:n] + "..."


def _latency(r: dict) -> str:
    if "median_ms" not in r:
        return f"FAIL ({r['phase']})" if r.get("error") else "-"
    return f"{r['median_ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f})"


def _gflops(r: dict, flops: float | None, peak: float) -> str:
    if "median_ms" not in r or not flops:
        return "-"
    rate = flops / (r["median_ms"] / 1000) / 1e9
    return f"{rate:.1f} ({100 * rate / peak:.0f}%)"


def _rss(r: dict) -> str:
    return f"{r['peak_rss'] / MIB:.0f}" if r.get("peak_rss") else "-"


def _cpu(r: dict) -> str:
    return f"{r['cpu_per_wall']:.2f}" if "cpu_per_wall" in r else "-"


def latency_table(rows: list[dict], threads: int, peaks: dict, args) -> str:
    peak = peaks.get("gflops", float("nan"))
    ort_peak = f", onnxruntime MatMul {peaks['ort_gflops']:.1f}" if "ort_gflops" in peaks else ""
    lines = [f"### Latency, {_threads_label(threads)} "
             f"(float32 2048^3 matmul: numpy {peak:.1f} GFLOP/s{ort_peak})", "",
             "| model | GFLOP | carrack ms, median (min-max) | onnxruntime ms | carrack / ort | carrack GFLOP/s "
             "(% peak) | ort GFLOP/s (% peak) | carrack peak RSS MiB | ort peak RSS MiB | CPU/wall carrack, ort "
             "| notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        c, o = row["engines"].get("carrack", {}), row["engines"].get("ort", {})
        ratio = f"{c['median_ms'] / o['median_ms']:.2f}x" if "median_ms" in c and "median_ms" in o else "-"
        flops = row.get("flops")
        gf = f"{'>=' if row.get('flops_partial') else ''}{flops / 1e9:.2f}" if flops else "?"
        notes = "; ".join(f"{e}: {_short(r['error'])}" for e, r in row["engines"].items() if r.get("error"))
        lines.append(f"| {row['model']} | {gf} | {_latency(c)} | {_latency(o)} | {ratio} | {_gflops(c, flops, peak)} | "
                     f"{_gflops(o, flops, peak)} | {_rss(c)} | {_rss(o)} | {_cpu(c)}, {_cpu(o)} | {notes} |")
    return "\n".join(lines)


def _threads_label(threads: int) -> str:
    if threads <= 0:
        return f"default threads (each engine's own: one per core, {os.cpu_count()} here)"
    return f"{threads} thread{'s' if threads > 1 else ''}"


def scaling_table(rows: list[dict]) -> str:
    """Per model and engine: median latency at each explicit thread count, speedup over 1 thread and parallel
    efficiency (speedup / threads)."""
    counts = sorted({r["threads"] for r in rows if r["threads"] > 0})
    lines = ["### Scaling (median ms; speedup over 1 thread; efficiency = speedup / threads)", "",
             "| model | engine | " + " | ".join(f"{n} thr" for n in counts) + " |",
             "|---|---|" + "---:|" * len(counts)]
    for model in dict.fromkeys(r["model"] for r in rows):
        for engine in ENGINES:
            times = {r["threads"]: r["engines"].get(engine, {}).get("median_ms") for r in rows
                     if r["model"] == model}
            one = times.get(1)
            cells = []
            for n in counts:
                t = times.get(n)
                if not t:
                    cells.append("-")
                elif one and n > 1:
                    cells.append(f"{t:.1f} ({one / t:.2f}x, {one / t / n:.0%})")
                else:
                    cells.append(f"{t:.1f}")
            lines.append(f"| {model} | {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    lines = ["| model | carrack peak RSS MiB (after imports) | ort peak RSS MiB (after imports) | carrack / ort | "
             "weights MiB | planned arena MiB | planned peak MiB | arena / intermediates | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        c, o = row["engines"]["carrack"], row["engines"]["ort"]

        def peak(r):
            if not r.get("peak_rss"):
                return f"FAIL ({r.get('phase', '?')})"
            return f"{r['peak_rss'] / MIB:.0f} ({r['baseline_rss'] / MIB:.0f})"

        ratio = f"{c['peak_rss'] / o['peak_rss']:.2f}x" if c.get("peak_rss") and o.get("peak_rss") else "-"
        plan = c.get("plan") or {}
        note = ""
        if plan.get("unknown") and c.get("plan_unoptimized"):
            note = (f"plan of the optimized graph has {plan['unknown']} unknown sizes; "
                    "plan shown is the unoptimized graph's")
            plan = c["plan_unoptimized"]
        plan_cols = "- | - | - | -"
        if plan:
            plan_cols = (f"{plan['weight_bytes'] / MIB:.0f} | {plan['arena_bytes'] / MIB:.0f} | "
                         f"{plan['peak_bytes'] / MIB:.0f} | {plan['efficiency']:.3f}"
                         + (f" ({plan['unknown']} sizes unknown)" if plan.get("unknown") else ""))
        notes = "; ".join(f"{e}: {_short(r['error'])}" for e, r in row["engines"].items() if r.get("error"))
        if c.get("plan_error"):
            notes += f" plan: {_short(c['plan_error'])}"
        notes = "; ".join(x for x in (notes, note) if x)
        lines.append(f"| {row['model']} | {peak(c)} | {peak(o)} | {ratio} | {plan_cols} | {notes} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- driver
def resolve_models(names: list[str]) -> list[tuple[str, Path]]:
    """(name, path) for each model, building missing suite models with make_models.py."""
    out_dir = models_dir()
    found, missing = [], []
    for name in names:
        path = Path(name) if name.endswith(".onnx") else out_dir / f"{name}.onnx"
        (found if path.is_file() else missing).append((Path(name).stem, path))
    if missing:
        import make_models

        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"building missing models: {', '.join(n for n, _ in missing)}", file=sys.stderr)
        for name, path in missing:
            try:
                if name in make_models.all_model_names() and make_models.make(name, out_dir):
                    found.append((name, path))
                else:
                    print(f"skipping {name}: not built", file=sys.stderr)
            except Exception as e:  # noqa: BLE001
                print(f"skipping {name}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        order = {n: i for i, n in enumerate(names)}
        found.sort(key=lambda np_: order.get(np_[0], order.get(str(np_[1]), 0)))
    return found


def count_model_flops(path: Path) -> tuple[float | None, bool, str | None]:
    try:
        from flops import count_flops

        c = count_flops(path, dim_bindings(path, input_spec(path)))
        return float(c.flops), len(c.uncounted) > len(c.from_onnx), None
    except Exception as e:  # noqa: BLE001
        return None, False, f"{type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="carrack vs onnxruntime: latency, GFLOP/s and peak memory")
    p.add_argument("--models", help=f"comma-separated names or .onnx paths (default: {','.join(DEFAULT_MODELS)})")
    p.add_argument("--threads", default="1", help="comma-separated thread counts, e.g. 0,1,2 (0: each engine's "
                   "default, one thread per core; default 1); with two or more counts a scaling table follows")
    p.add_argument("--iters", type=int, default=10, help="timed inferences per engine (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed inferences per engine first (default 2)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per engine and model (default 600)")
    p.add_argument("--memory", action="store_true", help="peak-memory comparison instead of latency")
    p.add_argument("--json", help="where to write the JSON results")
    p.add_argument("--alone", action="store_true", help="time each engine with no other engine's process alive "
                   "(two rounds of fresh processes, alternating order) instead of alternating runs")
    p.add_argument("--no-settle", action="store_true", help="start each run right after the other engine's "
                   "(by default a run waits until the other engine's process is idle: onnxruntime's threads spin "
                   "on after its runs)")
    p.add_argument("--blas-core", default="native",
                   help="OpenBLAS core type for every worker: 'native' (default: the CPU's widest kernels, SkylakeX "
                        "where AVX-512 is there, as onnxruntime's MLAS uses them; overrides a pin such as "
                        "OPENBLAS_CORETYPE=Haswell), 'keep' (the environment's), or a core name")
    args = p.parse_args(argv)
    global BLAS_CORE
    BLAS_CORE = blas_core(args.blas_core)
    names = args.models.split(",") if args.models else DEFAULT_MODELS
    thread_counts = [int(t) for t in args.threads.split(",")]
    models = resolve_models(names)
    started = datetime.datetime.now()
    header = {"date": started.isoformat(timespec="seconds"), "machine": machine(), "versions": _versions(),
              "load_average_start": load_average(), "threads": thread_counts, "iters": args.iters,
              "warmup": args.warmup, "mode": "memory" if args.memory else "latency",
              "openblas_core": BLAS_CORE or "detected"}
    print(f"# carrack benchmark ({header['mode']}) - {started:%Y-%m-%d %H:%M}\n")
    print(f"Machine: {header['machine']}; {header['versions']}; OpenBLAS core {header['openblas_core']} (both engines' "
          f"processes); load average at start {header['load_average_start']}")
    rows: list[dict] = []
    if args.memory:
        threads = thread_counts[0]
        print(f"Threads: {threads}; one inference per fresh process; RSS = VmHWM of the process, which includes "
              "the Python interpreter and the engine's imports (RSS after imports, before loading, in brackets); "
              "plan columns: carrack's static memory plan (arena / intermediates: 1.0 = no reuse)\n", flush=True)
        for name, path in models:
            print(f"  {name} ...", file=sys.stderr, flush=True)
            rows.append({"model": name, "engines": memory_model(path, threads, args.timeout)})
        print(memory_table(rows))
    else:
        print(f"Threads: {', '.join(map(str, thread_counts))}; {args.iters} timed runs per engine after "
              f"{args.warmup} warm-up, "
              + ("each engine alone (two rounds of fresh processes, no other engine alive)" if args.alone else
                 "engines alternating run by run in fresh processes"
                 f"{'' if args.no_settle else ', each run once the other engine is idle'}")
              + "; GFLOP = 2 x "
              "MatMul/Gemm/Conv MACs (>= where some shapes were unknown); % peak is relative to numpy's sgemm rate "
              "(onnxruntime's own kernels can beat it); CPU/wall = process CPU time / latency (threads kept busy)\n",
              flush=True)
        flops = {name: count_model_flops(path) for name, path in models}
        for threads in thread_counts:
            peaks = measure_peak(threads)
            header[f"sgemm_peak_{threads}t"] = peaks
            block = []
            for name, path in models:
                print(f"  {name}, {threads} thread(s) ...", file=sys.stderr, flush=True)
                count, partial, flop_error = flops[name]
                row = {"model": name, "threads": threads, "flops": count, "flops_partial": partial,
                       "engines": (time_model_alone(path, threads, args.iters, args.warmup, args.timeout)
                                   if args.alone else
                                   time_model(path, threads, args.iters, args.warmup, args.timeout,
                                              not args.no_settle))}
                if flop_error:
                    row["flops_error"] = flop_error
                block.append(row)
            rows.extend(block)
            print(latency_table(block, threads, peaks, args) + "\n", flush=True)
    if len({r["threads"] for r in rows if r.get("threads", 0) > 0}) > 1:
        print(scaling_table(rows) + "\n", flush=True)
    header["load_average_end"] = load_average()
    header["wall_s"] = round((datetime.datetime.now() - started).total_seconds(), 1)
    print(f"\nLoad average at end {header['load_average_end']}; wall time {header['wall_s']:.0f} s")
    out = Path(args.json) if args.json else (models_dir() / "results" /
                                             f"{header['mode']}-{started:%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    print(f"JSON results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
