"""Mutation fuzzing of carrack's ONNX importer/runtime and GGUF reader (see tests/fuzz/harness.py).

    PYTHONPATH=$PWD python benchmarks/fuzz.py --onnx 10000 --gguf 2000 --log /tmp/fuzz.jsonl

Prints the outcome counts (ok, clear, unclear, memory, crash, hang) and writes every case's result as a JSON line
to --log; a bad case is reproduced with tests.fuzz.harness.reproduce_onnx(seeds, case, seed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.fuzz.harness import fuzz_gguf, fuzz_onnx  # noqa: E402
from tests.fuzz.seeds import gguf_seeds, onnx_wheel_seeds, torch_export_seeds  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnx", type=int, default=1000, help="mutated ONNX models to run")
    parser.add_argument("--gguf", type=int, default=500, help="mutated GGUF files to read")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0, help="number of the first case (to split a run)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per case before it counts as a hang")
    parser.add_argument("--log", default=None, help="write each case's result as a JSON line here")
    parser.add_argument("--torch-dir", default=os.path.join(tempfile.gettempdir(), "carrack-fuzz-torch"))
    args = parser.parse_args()
    log_file = open(args.log, "w") if args.log else None  # noqa: SIM115

    def log(case: int, result: dict) -> None:
        if log_file:
            log_file.write(json.dumps(result) + "\n")
            log_file.flush()
        if result["outcome"] not in ("ok", "clear"):
            print(f"case {case}: {result['outcome']}: {result.get('seed_model')} [{result.get('mutation', '')}] "
                  f"{result.get('error', '')[:200]}", flush=True)

    bad = 0
    if args.onnx:
        seeds = onnx_wheel_seeds() + torch_export_seeds(args.torch_dir)
        print(f"{len(seeds)} ONNX seed models", flush=True)
        report = fuzz_onnx(seeds, range(args.first, args.first + args.onnx), args.seed, args.timeout, log)
        print("ONNX:", report.summary(), flush=True)
        bad += report.bad()
    if args.gguf:
        with tempfile.TemporaryDirectory() as folder:
            cases = range(args.first, args.first + args.gguf)
            report = fuzz_gguf(gguf_seeds(folder), cases, args.seed, args.timeout, log)
        print("GGUF:", report.summary(), flush=True)
        bad += report.bad()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
