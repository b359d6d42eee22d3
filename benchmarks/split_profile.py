"""How the two halves of each float product share the cores: a per-thread profile of a model's native MatMuls.

One process runs the model with a 1-thread and a 2-thread session, alternately (--runs pairs). Every product on
the native tile (`carrack.native.matmul.matmul_into` and `matmul_checked_into`) is timed, and at two
threads matched to its split region in the pool's trace (`intra_op.trace_regions`), which gives each participant's
start, end, CPU time and pieces. Per product shape it reports:

- 1t CPU: the product's CPU time on one thread (min over the runs);
- both ran: the share of its 2-thread regions in which both threads ran a piece (the others' numbers are left out:
  on a loaded machine the worker is often not running when a region starts);
- worker start: from the region's start to the later participant's start (median);
- end gap: |difference of the two participants' end times| (median): the halves not finishing together;
- 2t CPU: both participants' CPU time (min) and its excess over 1t CPU: the work the split adds;
- region wall (min) and the efficiency it gives (1t CPU / (2 x region wall)).
A deep product (convgemm.c's DEEP_MIN) runs as two regions, its depth halves and then their sum: its CPU and wall
cover both, its start and end gap are the first's.

Whole-run lines: 1t and 2t wall (min) and efficiency; the share of the 2-thread run inside split regions; the sums
of end gaps and later starts over all regions. CPU times do not depend on the machine's load (apart from other
processes' use of the caches); wall times do: the load average and the other processes' CPU use are printed with
each model, and a 2-thread wall time is a scaling number only where they are near zero.

Usage: python benchmarks/split_profile.py [--models gpt2,bert_base,vit_small] [--runs 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import input_spec, make_feed, models_dir  # noqa: E402


@dataclass
class ShapeProfile:
    """One product shape's numbers (microseconds; see the module's docstring)."""

    shape: tuple[int, int, int]
    calls_per_run: float
    one_thread_cpu_us: float
    regions: int
    both_ran: int
    worker_start_us: float = float("nan")
    end_gap_us: float = float("nan")
    two_thread_cpu_us: float = float("nan")
    region_wall_us: float = float("nan")

    @property
    def extra_work(self) -> float:
        """What the split adds to the product's CPU time (0.1: 10 % more than on one thread)."""
        return self.two_thread_cpu_us / self.one_thread_cpu_us - 1.0

    @property
    def efficiency(self) -> float:
        return self.one_thread_cpu_us / (2.0 * self.region_wall_us)


@dataclass
class RunProfile:
    """A model's per-shape table and whole-run numbers (seconds for the walls)."""

    shapes: list[ShapeProfile]
    one_thread_wall: float
    two_thread_wall: float
    split_wall: float
    end_gaps: float
    late_starts: float
    load_average: tuple[float, float, float]
    others_cpu: float  # cores the other processes used during the runs (median)
    notes: list[str] = field(default_factory=list)


class _ProductClock:
    """Wraps `matmul_into` and `matmul_checked_into` to record each call's shape, wall interval and the calling
    thread's CPU time."""

    NAMES = ("matmul_into", "matmul_checked_into")

    def __init__(self) -> None:
        from carrack.native import matmul as native_matmul

        self.module = native_matmul
        self.inner = {name: getattr(native_matmul, name) for name in self.NAMES}
        self.calls: list[tuple[tuple[int, int, int], int, int, int]] = []

    def _timed(self, inner):
        def timed(a, b, out):
            wall, cpu = time.monotonic_ns(), time.thread_time_ns()
            done = inner(a, b, out)
            if done:
                self.calls.append(((a.shape[0], a.shape[1], b.shape[1]), wall, time.monotonic_ns(),
                                   time.thread_time_ns() - cpu))
            return done

        return timed

    def __enter__(self) -> _ProductClock:
        for name, inner in self.inner.items():
            setattr(self.module, name, self._timed(inner))
        return self

    def __exit__(self, *exc) -> None:
        for name, inner in self.inner.items():
            setattr(self.module, name, inner)


def _busy_ticks() -> tuple[int, int]:
    """(all processes' busy CPU ticks, this process's) from /proc; (0, 0) where there is none."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        return sum(ticks) - ticks[3] - ticks[4], int(own[11]) + int(own[12])
    except OSError:
        return 0, 0


def _regions_of(trace) -> tuple[dict, dict]:
    """The trace as {region: its slot -1 record} and {region: {slot: participant record}}."""
    whole, parts = {}, defaultdict(dict)
    for part in trace:
        if part.slot < 0:
            whole[part.region] = part
        else:
            parts[part.region][part.slot] = part
    return whole, parts


def profile(session_one, session_two, feed: dict, runs: int) -> RunProfile:
    """Alternate `runs` runs of the two sessions (1 and 2 intra-op threads) and profile their native products."""
    from carrack.native import intra_op

    one_cpu, two_records, calls_counted = defaultdict(list), defaultdict(list), defaultdict(int)
    walls_one, walls_two, split_walls, gaps, starts, others = [], [], [], [], [], []
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for session in (session_one, session_two, session_one, session_two):
        session.run(None, feed)
    with _ProductClock() as clock:
        for _ in range(runs):
            for threads, session in ((1, session_one), (2, session_two)):
                clock.calls.clear()
                intra_op.trace_regions(threads == 2)
                busy, own = _busy_ticks()
                start = time.perf_counter()
                session.run(None, feed)
                wall = time.perf_counter() - start
                intra_op.trace_regions(False)
                busy_after, own_after = _busy_ticks()
                others.append(((busy_after - busy) - (own_after - own)) / tick / wall)
                if threads == 1:
                    walls_one.append(wall)
                    for shape, _, _, cpu in clock.calls:
                        one_cpu[shape].append(cpu / 1e3)
                        calls_counted[shape] += 1
                    continue
                walls_two.append(wall)
                whole, parts = _regions_of(intra_op.region_trace())
                split_walls.append(sum(w.end - w.start for w in whole.values()))
                gaps.append(sum(abs(p[0].end - p[1].end) for p in parts.values() if len(p) == 2))
                starts.append(sum(max(x.start for x in p.values()) - whole[r].start
                                  for r, p in parts.items() if len(p) == 2 and r in whole))
                by_start = sorted((w.start, r) for r, w in whole.items())
                for shape, begin, end, _ in clock.calls:
                    inside = [r for s, r in by_start if begin / 1e9 <= s <= end / 1e9]
                    if inside:  # (a deep product is two regions: its depth halves, then their sum)
                        two_records[shape].append(([whole[r] for r in inside], [parts.get(r, {}) for r in inside]))
    shapes = [_shape_profile(shape, one_cpu[shape], two_records.get(shape, []), calls_counted[shape] / runs)
              for shape in sorted(one_cpu, key=lambda s: -s[0] * s[1] * s[2])]
    best = min(range(len(walls_two)), key=walls_two.__getitem__)
    return RunProfile(shapes, min(walls_one), walls_two[best], split_walls[best], gaps[best], starts[best],
                      tuple(os.getloadavg()) if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0), median(others))


def _shape_profile(shape, one_cpu: list[float], calls: list, calls_per_run: float) -> ShapeProfile:
    """`calls`: per 2-thread call, its regions' slot -1 records and participants ({slot: record}), in order; the
    start and end gap are the first (main) region's, the CPU and wall all of the call's regions'."""
    both = [(w, p) for w, p in calls if len(p[0]) == 2 and all(x.pieces for x in p[0].values())]
    result = ShapeProfile(shape, calls_per_run, min(one_cpu), len(calls), len(both))
    if calls:
        result.region_wall_us = min(w[-1].end - w[0].start for w, _ in calls) * 1e6
    if both:
        result.worker_start_us = median(max(x.start for x in p[0].values()) - w[0].start for w, p in both) * 1e6
        result.end_gap_us = median(abs(p[0][0].end - p[0][1].end) for _, p in both) * 1e6
        result.two_thread_cpu_us = min(sum(x.cpu for region in p for x in region.values()) for _, p in both) * 1e6
    return result


def report(name: str, result: RunProfile) -> str:
    lines = [f"### {name}", "",
             f"load average {' '.join(f'{x:.2f}' for x in result.load_average)}, other processes' CPU "
             f"{result.others_cpu:.2f} cores (median over the runs)", "",
             f"whole run: 1 thread {result.one_thread_wall * 1e3:.1f} ms, "
             f"2 threads {result.two_thread_wall * 1e3:.1f} ms "
             f"(efficiency {result.one_thread_wall / (2 * result.two_thread_wall):.0%}); "
             f"{result.split_wall / result.two_thread_wall:.0%} of the 2-thread run in split regions; "
             f"sum of end gaps {result.end_gaps * 1e3:.2f} ms, of later starts {result.late_starts * 1e3:.2f} ms", "",
             "| product T x K x N | calls/run | 1t CPU us | both ran | worker start us | end gap us | 2t CPU us "
             "(extra) | region wall us | efficiency |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result.shapes:
        lines.append(f"| {'x'.join(map(str, s.shape))} | {s.calls_per_run:.0f} | {s.one_thread_cpu_us:.0f} | "
                     f"{s.both_ran}/{s.regions} | {s.worker_start_us:.1f} | {s.end_gap_us:.0f} | "
                     f"{s.two_thread_cpu_us:.0f} ({s.extra_work:+.1%}) | {s.region_wall_us:.0f} | {s.efficiency:.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt2,bert_base,vit_small")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    import carrack

    results = {}
    for name in args.models.split(","):
        path = models_dir() / f"{name}.onnx"
        if not path.is_file():
            sys.exit(f"{path}: not found (benchmarks/make_models.py builds the suite's models)")
        sessions = []
        for threads in (1, 2):
            options = carrack.SessionOptions()
            options.intra_op_num_threads = threads
            sessions.append(carrack.InferenceSession(str(path), options))
        results[name] = profile(*sessions, make_feed(input_spec(path)), args.runs)
        print(report(name, results[name]), end="\n\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({k: asdict(v) for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
