"""Inter-op parallelism (SessionOptions.execution_mode = ORT_PARALLEL): independent nodes run at the same time.

numpy's BLAS, its large ufunc loops and carrack's native kernels release the GIL, so two branches of a graph (an
Inception block's towers, a fire module's two expands) can compute on two cores at once. Nodes run as soon as their
producers are done, on a shared pool of worker threads; a worker that finishes a node goes straight on with one of
the nodes it made ready (chains stay on one thread) and hands the others to the pool.

A concurrent run does not use the sequential memory plan's arena (two nodes running at once could be planned into
the same bytes): every kernel allocates its result, and a value is freed after its last reader, whichever thread
that ran on. Its peak is therefore bounded by the sum of the intermediates, not by the sequential plan.
"""

from __future__ import annotations

import contextvars
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from carrack.native.intra_op import intra_op_threads, threads

if TYPE_CHECKING:
    from carrack.runtime.program import Program

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _workers() -> ThreadPoolExecutor:
    # separate from carrack.native's pool: a node running here may itself split its work over that one
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="carrack-op")
    return _pool


class Dependencies:
    """Per program, computed once: which steps wait on which, and how many steps read each slot."""

    def __init__(self, program: Program):
        producer = {}
        for i, st in enumerate(program.steps):
            for s in st.outs:
                if s >= 0:
                    producer[s] = i
        self.reads: list[tuple[int, ...]] = []
        self.waits_on = [0] * len(program.steps)
        self.unblocks: list[list[int]] = [[] for _ in program.steps]
        self.readers = [0] * (program.n_slots + 1)
        for i, st in enumerate(program.steps):
            reads = tuple(sorted({s for s in st.ins + tuple(s for _, s in st.captures) if s >= 0}))
            self.reads.append(reads)
            before = {producer[s] for s in reads if s in producer}
            self.waits_on[i] = len(before)
            for j in before:
                self.unblocks[j].append(i)
            for s in reads:
                self.readers[s] += 1
        self.keep = frozenset(program.output_slots) | frozenset(program.constants) | frozenset(program.input_slots)


def run_concurrently(program: Program, env: list[Any], limit: int, execute_step) -> None:
    """Run every step of `program` on `env`, at most `limit` at a time, each through `execute_step(step, env)`.
    Returns when all are done; raises the first failure (the rest of the run is abandoned)."""
    steps = program.steps
    if not steps:
        return
    deps: Dependencies = program.dependencies()
    waiting = list(deps.waits_on)
    readers = list(deps.readers)
    lock = threading.Lock()
    handoff: queue.SimpleQueue = queue.SimpleQueue()  # ready steps no worker was free for, then DONE
    state = {"left": len(steps), "error": None}
    free_workers = threading.Semaphore(max(1, limit) - 1)  # helpers beyond the calling thread
    pool = _workers()
    kernel_threads = threads()  # the run's intra-op thread count, which the helpers' kernels keep too

    def chain(i: int | None) -> None:
        while i is not None and state["error"] is None:
            try:
                execute_step(steps[i], env)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                with lock:
                    if state["error"] is None:
                        state["error"] = exc
                        handoff.put(DONE)
                return
            ready = _finish(i)
            i = ready.pop(0) if ready else None
            for j in ready:
                spawn(j)

    def _finish(i: int) -> list[int]:
        ready = []
        with lock:
            for s in deps.reads[i]:
                readers[s] -= 1
                if readers[s] == 0 and s not in deps.keep:
                    env[s] = None
            for s in steps[i].outs:
                if s >= 0 and readers[s] == 0 and s not in deps.keep:
                    env[s] = None  # an output nothing reads
            for j in deps.unblocks[i]:
                waiting[j] -= 1
                if waiting[j] == 0:
                    ready.append(j)
            state["left"] -= 1
            if state["left"] == 0:
                handoff.put(DONE)
        return ready

    def spawn(j: int) -> None:
        if not free_workers.acquire(blocking=False):
            handoff.put(j)  # every helper is busy: the calling thread takes it
            return

        def task() -> None:
            try:
                with intra_op_threads(kernel_threads):
                    chain(j)
            finally:
                free_workers.release()

        pool.submit(contextvars.copy_context().run, task)  # the run's memory limit (allocator) goes along

    roots = [i for i, n in enumerate(waiting) if n == 0]
    if not roots:
        raise RuntimeError("no step is ready to run (the program's dependencies form a cycle)")
    for j in roots[1:]:
        spawn(j)
    chain(roots[0])
    while (j := handoff.get()) is not DONE:
        chain(j)
    if state["error"] is not None:
        raise state["error"]


DONE = object()
