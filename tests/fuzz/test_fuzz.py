"""Mutation fuzzing (tests/fuzz/harness.py): every mutant of a real ONNX model or GGUF file loads and runs, or is
refused with a carrack error naming what is wrong; none crashes, hangs, exhausts memory or escapes as a bare
Python exception. The default run is a few hundred mutants; the long run (10,000 ONNX models, 2,000 GGUF files,
minutes) runs with CARRACK_LONG_FUZZ=1 (or benchmarks/fuzz.py)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.fuzz.harness import BAD_OUTCOMES, Report, fuzz_gguf, fuzz_onnx, run_isolated
from tests.fuzz.seeds import gguf_seeds, onnx_wheel_seeds, torch_export_seeds

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the harness forks and limits the address space")


def _assert_clean(report: Report) -> None:
    bad = {o: report.examples.get(o, [])[:3] for o in BAD_OUTCOMES if report.counts[o]}
    assert not bad, f"{report.summary()}\n{bad}"


def test_the_harness_tells_outcomes_apart():
    def crash():
        os.kill(os.getpid(), 11)

    def hang():
        while True:
            pass

    def unclear():
        raise IndexError("list index out of range")

    def huge():
        bytearray(8 << 30)

    def clear():
        from carrack.errors import InvalidModel

        raise InvalidModel("node 'n' has 3 inputs; Relu takes 1")

    outcomes = {f.__name__: run_isolated(f, timeout=3)["outcome"] for f in (crash, hang, unclear, huge, clear)}
    assert outcomes == {"crash": "crash", "hang": "hang", "unclear": "unclear", "huge": "memory", "clear": "clear"}


def test_mutated_onnx_models_get_clear_errors():
    _assert_clean(fuzz_onnx(onnx_wheel_seeds(), 150, seed=1, timeout=30))


def test_mutated_gguf_files_get_clear_errors(tmp_path):
    _assert_clean(fuzz_gguf(gguf_seeds(tmp_path), 100, seed=1, timeout=20))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("CARRACK_LONG_FUZZ"), reason="the long fuzz run: set CARRACK_LONG_FUZZ=1")
def test_long_fuzz_run(tmp_path):
    seeds = onnx_wheel_seeds() + torch_export_seeds(tmp_path / "torch")
    onnx_report = fuzz_onnx(seeds, 10_000, seed=0, timeout=60)
    gguf_report = fuzz_gguf(gguf_seeds(tmp_path), 2_000, seed=0, timeout=30)
    print("ONNX:", onnx_report.summary(), "\nGGUF:", gguf_report.summary())
    _assert_clean(onnx_report)
    _assert_clean(gguf_report)
