"""Coverage-guided fuzzing of carrack's model loading and running with atheris (libFuzzer), where it is installed
(`pip install atheris`, the `fuzz` extra). Seeds are the onnx wheel's backend models; every input is loaded and run
in process, and any exception other than a carrack error that names something is reported as a finding
(libFuzzer's own -timeout and -rss_limit_mb catch hangs and memory blow-ups):

    PYTHONPATH=$PWD python benchmarks/fuzz_atheris.py -atheris_runs=20000 -timeout=30 -rss_limit_mb=4096 /tmp/corpus

The mutation fuzzer in tests/fuzz (benchmarks/fuzz.py) needs no atheris and isolates every case in a child.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import atheris  # noqa: E402

with atheris.instrument_imports(include=["carrack"]):
    import carrack  # noqa: F401

from tests.fuzz.harness import classify, run_onnx_mutant  # noqa: E402
from tests.fuzz.seeds import onnx_wheel_seeds  # noqa: E402


def test_one_input(data: bytes) -> None:
    try:
        run_onnx_mutant(data, {})
    except Exception as e:  # noqa: BLE001 - only unclear errors are findings
        if classify(e) != "clear":
            raise


def main() -> None:
    corpus = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if corpus and os.path.isdir(corpus) and not os.listdir(corpus):  # an empty corpus starts from the seeds
        for i, seed in enumerate(onnx_wheel_seeds()):
            with open(os.path.join(corpus, f"seed{i}.onnx"), "wb") as f:
                f.write(seed.data)
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
