"""The mutation fuzzer's runner: every mutant is loaded and run in a forked child under an address-space limit
and a timeout, and its outcome classified:

- ok: loaded (and ran, where its inputs could be fed);
- clear: a carrack error (CarrackError) whose message names something (a quoted name, a node, value or field);
- unclear: any other exception, or a carrack error whose message names nothing;
- memory: a MemoryError that is not carrack's MemoryLimitExceeded (a giant allocation reached the OS);
- crash: the child died without reporting (a signal, a native fault);
- hang: the child ran past the timeout.

The child reports one JSON line through a pipe; the parent never imports torch (the torch exports are made in their
own child, see seeds.py), so that forking stays cheap and the children start small.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import resource
import select
import signal
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tests.fuzz.mutate import mutate_bytes, mutate_model
from tests.fuzz.seeds import Seed

ADDRESS_SPACE_LIMIT = 4 << 30
OUTCOMES = ("ok", "clear", "unclear", "memory", "crash", "hang")
BAD_OUTCOMES = ("unclear", "memory", "crash", "hang")
#: a message "names something" when it quotes a name or says which node, value, field... is wrong
_NAMES_SOMETHING = re.compile(r"'[^']+'|\"[^\"]+\"|\bnode\b|\bvalue\b|\bfield\b|\battribute\b|\binput\b|\boutput\b"
                              r"|\binitializer\b|\bopset\b|\bkey\b|\boffset\b|\bfile\b|\bmodel\b"
                              r"|(?:^|\s)/\S+", re.I)


@dataclass
class Report:
    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[dict]] = field(default_factory=dict)
    cases: int = 0
    seconds: float = 0.0

    def add(self, result: dict, keep: int = 20) -> None:
        self.cases += 1
        self.counts[result["outcome"]] += 1
        if result["outcome"] in BAD_OUTCOMES:
            self.examples.setdefault(result["outcome"], [])
            if len(self.examples[result["outcome"]]) < keep:
                self.examples[result["outcome"]].append(result)

    def bad(self) -> int:
        return sum(self.counts[o] for o in BAD_OUTCOMES)

    def summary(self) -> str:
        counts = ", ".join(f"{o} {self.counts[o]}" for o in OUTCOMES)
        return f"{self.cases} cases in {self.seconds:.0f} s: {counts}"


def classify(error: BaseException) -> str:
    from carrack.errors import CarrackError

    if isinstance(error, CarrackError):
        return "clear" if _NAMES_SOMETHING.search(str(error)) else "unclear"
    if isinstance(error, MemoryError):
        return "memory"
    return "unclear"


def feeds_for(session, recorded: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray] | None:
    """Inputs for every session input: the recorded one where it still fits the declared type, otherwise random
    values of the declared type with free or huge dims set small; None when an input is not a tensor."""
    feeds = {}
    for arg in session.get_inputs():
        if not arg.type.startswith("tensor("):
            return None
        dtype = _DTYPES.get(arg.type)
        if dtype is None:
            return None
        given = recorded.get(arg.name)
        if given is not None and given.dtype == dtype:
            feeds[arg.name] = given
            continue
        shape = list(arg.shape or [])
        if not all(isinstance(d, int) and d >= 0 for d in shape) or np.prod(shape, dtype=object) > 1 << 20:
            shape = [d if isinstance(d, int) and 0 <= d <= 64 else 2 for d in shape]
        feeds[arg.name] = _random(dtype, shape, rng)
    return feeds


_DTYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
           "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
           "tensor(bool)": np.bool_, "tensor(int16)": np.int16, "tensor(uint16)": np.uint16}


def _random(dtype, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(0, 3, shape).astype(dtype)


def run_onnx_mutant(data: bytes, recorded: dict[str, np.ndarray]) -> None:
    import carrack

    session = carrack.InferenceSession(data)
    feeds = feeds_for(session, recorded, np.random.default_rng(0))
    if feeds is not None:
        session.run(None, feeds)


def run_gguf_mutant(data: bytes) -> None:
    from carrack.errors import UnsupportedModel
    from carrack.gguf import GGUFFile

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        with GGUFFile(f.name) as gguf:
            for t in gguf.tensors.values():
                int(t.raw()[:16].sum())
                try:
                    t.data()
                except UnsupportedModel:
                    if not t.type.is_quantized:
                        raise


def _address_space_limit() -> int:
    """ADDRESS_SPACE_LIMIT, or 2 GiB above what this process already maps when that is more (a pytest process that
    imported torch maps several GiB before any mutant runs)."""
    try:
        with open("/proc/self/status") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return ADDRESS_SPACE_LIMIT
    return max(ADDRESS_SPACE_LIMIT, mapped + (2 << 30))


def _child(work: Callable[[], None], out_fd: int) -> None:
    limit = _address_space_limit()
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        work()
        result = {"outcome": "ok"}
    except BaseException as e:  # noqa: BLE001 - classifying every exception is the point
        result = {"outcome": classify(e), "error": f"{type(e).__name__}: {str(e)[:500]}",
                  "where": traceback.format_exc(limit=-3)[-1500:]}
    os.write(out_fd, json.dumps(result).encode())
    os._exit(0)


def run_isolated(work: Callable[[], None], timeout: float) -> dict:
    """`work` in a forked child under the address-space limit; its outcome as a dict."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            _child(work, write_fd)
        finally:
            os._exit(1)
    os.close(write_fd)
    chunks, deadline = [], time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([read_fd], [], [], max(left, 0))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_fd)
            return {"outcome": "hang", "error": f"no answer in {timeout:.0f} s"}
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return {"outcome": "crash", "error": f"child ended with status {status} (signal {os.WTERMSIG(status)})"
                if os.WIFSIGNALED(status) else f"child exited {os.WEXITSTATUS(status)} without a report"}
    return json.loads(b"".join(chunks))


def warm_up(seeds: Sequence[Seed]) -> None:
    """Load and run every seed once in this process, so that the children it forks find carrack's modules imported
    and its native kernels built (a child then costs milliseconds, not the imports)."""
    for s in seeds:
        try:
            run_onnx_mutant(s.data, s.feeds)
        except Exception:  # noqa: BLE001, S110 - a seed carrack refuses still warmed the importer
            pass


def fuzz_onnx(seeds: Sequence[Seed], cases: int | Sequence[int], seed: int = 0, timeout: float = 60.0,
              log: Callable[[int, dict], None] | None = None) -> Report:
    """`cases` mutants of the seed models, each loaded and run in its own child."""
    from carrack.runtime.blas import limited_blas_threads

    # one BLAS thread: forking while a BLAS worker holds a lock would leave the child waiting for it forever
    with limited_blas_threads(1):
        return _fuzz_onnx(seeds, cases, seed, timeout, log)


def _fuzz_onnx(seeds: Sequence[Seed], cases: int | Sequence[int], seed: int, timeout: float,
               log: Callable[[int, dict], None] | None) -> Report:
    warm_up(seeds)
    report, start = Report(), time.monotonic()
    for case in (range(cases) if isinstance(cases, int) else cases):
        rng = random.Random(seed * 1_000_003 + case)
        base = seeds[case % len(seeds)]
        data, what = mutate_model(base.data, rng)
        began = time.monotonic()
        result = run_isolated(functools.partial(run_onnx_mutant, data, base.feeds), timeout)
        result.update(case=case, seed_model=base.name, mutation=what, seconds=round(time.monotonic() - began, 3))
        report.add(result)
        if log:
            log(case, result)
    report.seconds = time.monotonic() - start
    return report


def fuzz_gguf(seeds: Sequence[bytes], cases: int | Sequence[int], seed: int = 0, timeout: float = 30.0,
              log: Callable[[int, dict], None] | None = None) -> Report:
    report, start = Report(), time.monotonic()
    for case in (range(cases) if isinstance(cases, int) else cases):
        rng = random.Random(seed * 1_000_003 + case)
        data = seeds[case % len(seeds)]
        for _ in range(rng.randint(1, 3)):
            data = mutate_bytes(data, rng)
        result = run_isolated(functools.partial(run_gguf_mutant, data), timeout)
        result.update(case=case, seed_model=f"gguf seed {case % len(seeds)}")
        report.add(result)
        if log:
            log(case, result)
    report.seconds = time.monotonic() - start
    return report


def reproduce_onnx(seeds: Sequence[Seed], case: int, seed: int = 0) -> tuple[bytes, Seed, str]:
    """The mutant of case number `case` (to debug a finding in process)."""
    rng = random.Random(seed * 1_000_003 + case)
    base = seeds[case % len(seeds)]
    data, what = mutate_model(base.data, rng)
    return data, base, what
