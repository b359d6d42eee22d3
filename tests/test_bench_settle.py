"""benchmarks/run.py starts each engine's run once the other engine's process is idle (onnxruntime's intra-op
threads spin on after its runs): wait_until_idle reads the process's CPU time from /proc."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
run = pytest.importorskip("run")

needs_proc = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no /proc task stats here")


@pytest.fixture
def child():
    started = []

    def start(code: str) -> subprocess.Popen:
        """A Python child running `code` after it has printed a line (read here: its start-up is over)."""
        proc = subprocess.Popen([sys.executable, "-c", "print(flush=True)\n" + code], stdout=subprocess.PIPE)
        started.append(proc)
        proc.stdout.readline()
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


@needs_proc
def test_an_idle_process_is_waited_for_one_quiet_window(child):
    sleeper = child("import time; time.sleep(30)")
    assert run.wait_until_idle([sleeper.pid], quiet_s=0.002, limit_s=5.0) < 1.0


@needs_proc
def test_a_busy_process_is_waited_for_until_the_limit(child):
    spinner = child("while True: pass")
    # windows of 20 ms: a spinning process gets well over a tenth of a core in each, even on a shared machine
    assert run.wait_until_idle([spinner.pid], quiet_s=0.02, limit_s=0.2) >= 0.2
    assert run.process_cpu_ns(spinner.pid) > 0


def test_no_process_means_no_wait():
    assert run.wait_until_idle([]) == 0.0


def test_alone_mode_never_has_two_engines_alive(monkeypatch):
    """--alone: each engine's process runs with no other engine's process alive, in two rounds of opposite order."""
    alive: list[str] = []
    log: list[tuple[str, str]] = []

    class FakeWorker:
        def __init__(self, mode, args, threads):
            assert not alive, f"{args[0]} started while {alive} was alive"
            self.engine = args[0]
            alive.append(self.engine)
            self.replies = [{"event": "ready", "load_s": 0.1, "baseline_rss": 1}]

        def send(self, command):
            log.append((self.engine, command))
            self.replies.append({"event": "ran", "ms": 2.0 if self.engine == "carrack" else 3.0, "cpu_ms": 2.0}
                                if command == "run" else {"event": "stats", "peak_rss": 5})

        def receive(self, timeout):
            return self.replies.pop(0)

        def close(self):
            alive.remove(self.engine)

    monkeypatch.setattr(run, "Worker", FakeWorker)
    results = run.time_model_alone(Path("model.onnx"), threads=2, iters=6, warmup=1, timeout=10)
    assert [e for e, c in log if c == "stats"] == ["carrack", "ort", "ort", "carrack"]
    assert len(results["carrack"]["times_ms"]) == len(results["ort"]["times_ms"]) == 6
    assert results["carrack"]["median_ms"] == 2.0 and results["ort"]["median_ms"] == 3.0
    assert results["ort"]["peak_rss"] == 5 and not alive
