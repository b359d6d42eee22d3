"""The intra-op thread pool (carrack/native/threadpool.c) and the per-run thread count (carrack.native.intra_op).

Every parallel kernel splits its output into tiles, so each output element is computed by one thread in the same
order whatever the thread count: results with 1, 2 and 4 threads must be bit-identical (float and integer kernels
alike), including sizes that do not split evenly. The split thresholds are lowered here so that small, fast
operands are split too.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack import native
from carrack.errors import InvalidArgument
from carrack.native import convolution as native_conv
from carrack.native import intra_op, qconv, qgemm, rowops
from carrack.native import matmul as native_matmul

needs_native = pytest.mark.skipif(native.library("threadpool") is None or native_conv.load() is None,
                                  reason="native kernels (and their thread pool) are not built here")
THREAD_COUNTS = (1, 2, 4)


@pytest.fixture
def split_small(monkeypatch):
    """Split even the small operands of these tests over the threads."""
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)
    monkeypatch.setattr(rowops, "PARALLEL_MIN", 1)
    monkeypatch.setattr(qgemm, "_PARALLEL_MIN_MACS", 1)
    monkeypatch.setattr(qgemm, "_QUANTIZE_MIN_ELEMENTS", 1)
    monkeypatch.setattr(qconv, "_ADD_SPLIT", 1)
    monkeypatch.setattr(qconv, "_ROW_ALIGN", 16)
    # and keep the small products on the native tile (in a run numpy takes them: matmul.numpy_is_faster)
    monkeypatch.setattr(native_matmul, "SINGLE_THREAD_BLAS_WORK", 0)
    monkeypatch.setattr(native_matmul, "SINGLE_THREAD_GEMV_WORK", 0)


def _at_each_thread_count(compute) -> list:
    results = []
    for count in THREAD_COUNTS:
        with intra_op.intra_op_threads(count):
            result = compute()
        results.append([np.array(r, copy=True) for r in (result if isinstance(result, tuple) else (result,))])
    return results


def _assert_same_at_every_count(compute) -> None:
    first, *others = _at_each_thread_count(compute)
    for other in others:
        assert len(other) == len(first)
        for a, b in zip(first, other):
            np.testing.assert_array_equal(a, b)


# -- the pool itself ---------------------------------------------------------------------------------------------------
def _selftest(count: int, chunks: int, threads: int, item_ns: int) -> np.ndarray:
    pool = native.library("threadpool")
    fn = pool.carrack_pool_selftest
    fn.argtypes, fn.restype = [ctypes.c_void_p, *[ctypes.c_int64] * 4], None
    owner = np.full(count, -1, np.int64)
    fn(owner.ctypes.data, count, chunks, threads, item_ns)
    return owner


@needs_native
@pytest.mark.parametrize(("count", "chunks", "threads"), [(1, 1, 4), (7, 3, 2), (64, 16, 4), (101, 101, 3),
                                                          (5, 50, 8), (1000, 7, 2)])
def test_every_item_runs_once_on_a_valid_slot(count, chunks, threads):
    owner = _selftest(count, chunks, threads, 0)
    assert owner.min() >= 0, "an item ran twice or never"
    assert owner.max() < threads


@needs_native
def test_workers_take_part_and_are_reused():
    used_several = False
    for _ in range(200):  # other processes share the cores: a worker may not get a piece every time
        owner = _selftest(64, 16, 2, 20_000)
        assert owner.min() >= 0
        if len(set(owner.tolist())) > 1:
            used_several = True
            break
    assert used_several, "no pool worker ever took a piece"
    created = intra_op.pool_workers()
    for _ in range(20):
        _selftest(16, 16, 2, 0)
    assert intra_op.pool_workers() == created  # no thread per call


@needs_native
def test_concurrent_regions_share_the_pool():
    """Regions from several Python threads at once: each still covers its items once; workers are borrowed only
    while idle, so their number stays the largest count asked for, not the sum."""
    _selftest(8, 8, 3, 0)
    before = intra_op.pool_workers()
    failures = []

    def region():
        for _ in range(30):
            owner = _selftest(96, 24, 3, 2_000)
            if owner.min() < 0:
                failures.append(owner)

    threads = [threading.Thread(target=region) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert intra_op.pool_workers() == max(before, 2)


@needs_native
def test_parallel_seconds_counts_split_regions_only():
    """The wall time spent in regions split over threads: a run's remaining time is what ran on one core."""
    _selftest(4, 4, 2, 0)
    before = intra_op.parallel_seconds()
    _selftest(8, 1, 2, 200_000)  # one chunk: runs on the caller, not a split region
    assert intra_op.parallel_seconds() == before
    _selftest(8, 8, 2, 200_000)  # 1.6 ms of items over two threads: at least 0.8 ms inside the region
    assert intra_op.parallel_seconds() - before >= 0.0008


@needs_native
def test_a_sleeping_worker_is_counted_when_woken():
    _selftest(4, 4, 2, 0)
    wakes = intra_op.pool_workers() and intra_op.pool_wakes()
    for _ in range(50):  # the worker spins CARRACK_SPIN_US (200 us) after a region, then sleeps
        threading.Event().wait(0.002)
        _selftest(4, 4, 2, 0)
        if intra_op.pool_wakes() > wakes:
            break
    assert intra_op.pool_wakes() > wakes


@needs_native
def test_work_seconds_counts_the_pieces_of_split_regions_while_on():
    """CPU time running pieces: none for a region that was not split or while counting is off."""
    _selftest(4, 4, 2, 0)
    before = intra_op.work_seconds()
    _selftest(8, 8, 2, 100_000)
    assert intra_op.work_seconds() == before  # off by default
    intra_op.count_work(True)
    try:
        _selftest(8, 1, 2, 100_000)  # one chunk: runs on the caller, not a split region
        assert intra_op.work_seconds() == before
        _selftest(8, 8, 2, 200_000)  # eight items of 0.2 ms of spinning each
        assert intra_op.work_seconds() > before
    finally:
        intra_op.count_work(False)


@needs_native
def test_the_region_trace_records_each_participants_share():
    """Off by default; on, one record per participant of each split region (its slot, pieces, start, end and CPU)
    and one of slot -1 for the region as its caller saw it, which spans the participants'."""
    _selftest(4, 4, 2, 0)
    intra_op.trace_regions(True)
    intra_op.trace_regions(False)
    _selftest(8, 8, 2, 10_000)
    assert intra_op.region_trace() == []  # nothing recorded while off
    intra_op.trace_regions(True)
    try:
        _selftest(8, 1, 2, 10_000)  # one chunk: not a split region, nothing recorded
        assert intra_op.region_trace() == []
        for _ in range(3):
            _selftest(16, 4, 2, 100_000)  # four pieces of 0.4 ms of spinning each
        trace = intra_op.region_trace()
    finally:
        intra_op.trace_regions(False)
    regions = sorted({part.region for part in trace})
    assert len(regions) == 3 and regions == list(range(regions[0], regions[0] + 3))
    for region in regions:
        parts = [part for part in trace if part.region == region]
        assert parts[-1].slot == -1 and parts[-1].pieces == 4
        participants = parts[:-1]
        assert {part.slot for part in participants} <= {0, 1} and 0 in {part.slot for part in participants}
        assert sum(part.pieces for part in participants) == 4
        whole = parts[-1]
        for part in participants:
            assert whole.start <= part.start <= part.end <= whole.end
            assert part.cpu <= (part.end - part.start) + 1e-4
        busiest = max(participants, key=lambda part: part.pieces)
        assert busiest.end - busiest.start >= 0.0004 * busiest.pieces  # its pieces' spinning, at least
    assert intra_op.region_trace() == trace  # kept after the stop
    intra_op.trace_regions(True)
    intra_op.trace_regions(False)
    assert intra_op.region_trace() == []  # starting again forgets them


def test_a_run_with_threads_holds_the_pool():
    native.library("threadpool")
    assert intra_op.holding_pool() == 0
    with intra_op.intra_op_threads(1):
        assert intra_op.holding_pool() == 0  # one thread: no worker to keep awake
    if intra_op._pool_hold() is None:
        pytest.skip("the pool library is not built here")
    with intra_op.intra_op_threads(2):
        assert intra_op.holding_pool() == 1
        with intra_op.intra_op_threads(3):
            assert intra_op.holding_pool() == 2
        with intra_op.intra_op_threads(1):
            assert intra_op.holding_pool() == 1
        assert intra_op.holding_pool() == 1
    assert intra_op.holding_pool() == 0
    with pytest.raises(RuntimeError), intra_op.intra_op_threads(2):
        raise RuntimeError("a failing run")
    assert intra_op.holding_pool() == 0  # released by a run that raised


def test_runs_in_several_python_threads_hold_the_pool_together():
    """Each Python thread updates a hold word of its own; the pool sees the sum."""
    native.library("threadpool")
    if intra_op._pool_hold() is None:
        pytest.skip("the pool library is not built here")
    inside, leave, seen = threading.Barrier(3), threading.Barrier(3), []

    def run() -> None:
        with intra_op.intra_op_threads(2):
            inside.wait()
            leave.wait()

    workers = [threading.Thread(target=run) for _ in range(2)]
    for w in workers:
        w.start()
    inside.wait()
    seen.append(intra_op.holding_pool())
    leave.wait()
    for w in workers:
        w.join()
    assert seen == [2]
    assert intra_op.holding_pool() == 0


def test_a_python_thread_without_a_word_of_its_own_holds_through_the_shared_one():
    """Past the pool's 63 per-thread words a Python thread takes the hold by a call on the shared word."""
    native.library("threadpool")
    if intra_op._pool_hold() is None:
        pytest.skip("the pool library is not built here")
    seen = []

    def run() -> None:
        hold = intra_op._Hold(native.library("threadpool"))
        hold.slot = -1  # as when every word is taken
        intra_op._local.hold = hold
        with intra_op.intra_op_threads(2):
            seen.append(intra_op.holding_pool())
        seen.append(intra_op.holding_pool())

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert seen == [1, 0]


_HELD_GAPS_SCRIPT = """
import json, threading, time
from carrack import native
from carrack.native import intra_op
pool = native.library("threadpool")
selftest = pool.carrack_pool_selftest
selftest.argtypes, selftest.restype = [ctypes.c_void_p] + [ctypes.c_int64] * 4, None
owner = np.full(4, -1, np.int64)
def region():
    owner[:] = -1
    selftest(owner.ctypes.data, 4, 4, 2, 200_000)  # items long enough for a woken worker to take some
def gaps_and_wakes(gaps):
    out = []
    for _ in range(gaps):
        ended = time.perf_counter()
        threading.Event().wait(0.001)
        before = intra_op.pool_wakes()
        gap = time.perf_counter() - ended
        region()
        out.append((gap, intra_op.pool_wakes() - before))
    return out
region()
plain, held = [], []
for _ in range(20):
    plain += [w for gap, w in gaps_and_wakes(10) if 0.0005 <= gap <= 0.003]
    with intra_op.intra_op_threads(2):
        held += [w for gap, w in gaps_and_wakes(10) if 0.0005 <= gap <= 0.003]
    if len(plain) >= 10 and len(held) >= 10:
        break
print(json.dumps([plain, held]))
"""


@needs_native
def test_a_held_pool_keeps_its_workers_awake_between_regions():
    """Between the split kernels of a run holding the pool, an idle worker spins on (up to 5 ms, the default
    CARRACK_HELD_SPIN_US) instead of sleeping after CARRACK_SPIN_US (200 us), so the next region finds it awake;
    outside runs it sleeps as before. Regions 1 ms apart in a fresh process (whose pool no earlier test has
    used); the machine is shared and a gap can overrun, so only gaps that really lasted 0.5-3 ms count, and held
    ones must wake the worker clearly less often than plain ones (quiet: never; loaded: about half as often).
    Each region's items take 0.2 ms, so that a woken worker gets to run a piece: with instant items the caller
    withdrew every job before the worker woke, and the worker slept through every gap, held or not."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(native.SOURCE_DIR.parents[1]),
                                                                    os.environ.get("PYTHONPATH")])))
    env.pop("CARRACK_SPIN_US", None)
    env.pop("CARRACK_HELD_SPIN_US", None)
    script = "import ctypes\nimport numpy as np\n" + _HELD_GAPS_SCRIPT
    for _ in range(3):  # a loaded machine preempts the spinning worker too (it then sleeps): a few tries
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        plain, held = json.loads(done.stdout.strip().splitlines()[-1])
        if len(plain) < 10 or len(held) < 10:
            continue
        plain_rate, held_rate = sum(plain) / len(plain), sum(held) / len(held)
        if plain_rate >= 0.5 and held_rate < 0.75 * plain_rate:
            return
    if len(plain) < 10 or len(held) < 10:
        pytest.skip("the machine is too loaded: too few gaps of 0.5-3 ms")
    assert plain_rate >= 0.5, f"the worker slept in only {sum(plain)} of {len(plain)} plain gaps"
    assert held_rate < 0.75 * plain_rate, f"held gaps woke the worker {sum(held)} of {len(held)} times, " \
                                          f"plain gaps {sum(plain)} of {len(plain)}"


def test_thread_count_is_per_python_thread():
    seen = {}

    def run(count):
        with intra_op.intra_op_threads(count):
            barrier.wait()
            seen[count] = intra_op.threads()

    barrier = threading.Barrier(2)
    workers = [threading.Thread(target=run, args=(c,)) for c in (1, 3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert seen == {1: 1, 3: 3}


def test_intra_op_threads_nests_and_restores():
    default = intra_op.default_threads()
    assert intra_op.threads() == default  # outside any run
    with intra_op.intra_op_threads(3):
        assert native.threads() == 3
        with intra_op.intra_op_threads(0):
            assert native.threads() == default  # 0: one per core
        assert native.threads() == 3
    assert native.threads() == default
    with pytest.raises(InvalidArgument, match="intra_op_num_threads"):
        with intra_op.intra_op_threads(-1):
            pass


# -- every parallel kernel: the same bits at 1, 2 and 4 threads ------------------------------------------------------
def _rand(*shape, seed=0):
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


@needs_native
@pytest.mark.parametrize(("t", "k", "n"), [(37, 129, 203), (8, 64, 64), (255, 77, 65), (37, 2100, 200), (9, 2048, 64)])
def test_matmul(split_small, t, k, n):
    a, b = _rand(t, k), _rand(k, n, seed=1)

    def compute():
        y = np.empty((t, n), np.float32)
        assert native_matmul.matmul_into(a, b, y)
        return y

    _assert_same_at_every_count(compute)
    np.testing.assert_allclose(compute(), a @ b, rtol=1e-4, atol=1e-3)


@needs_native
@pytest.mark.parametrize(("t", "k", "n"), [(37, 2100, 200), (64, 3072, 768)])
def test_a_deep_narrow_product_sums_its_two_depth_halves(split_small, t, k, n):
    """K >= 2048 and >= 4 N: the sums of the two halves of the depth (whole blocks of matmul.DEPTH_BLOCK), added
    once, at every thread count (each thread of two runs one half)."""
    a, b = _rand(t, k), _rand(k, n, seed=1)
    split = -(-k // native_matmul.DEPTH_BLOCK) // 2 * native_matmul.DEPTH_BLOCK
    halves = []
    for part in (slice(0, split), slice(split, k)):  # each half alone is one sum (not deep)
        y = np.empty((t, n), np.float32)
        assert native_matmul.matmul_into(np.ascontiguousarray(a[:, part]), np.ascontiguousarray(b[part]), y)
        halves.append(y)
    for count in THREAD_COUNTS:
        y = np.empty((t, n), np.float32)
        with intra_op.intra_op_threads(count):
            assert native_matmul.matmul_into(a, b, y)
        np.testing.assert_array_equal(y, halves[0] + halves[1])
    np.testing.assert_allclose(y, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


@needs_native
@pytest.mark.parametrize(("t", "k", "n"), [(1, 768, 300), (5, 64, 64)])
def test_matmul_of_a_few_rows_stays_on_the_runs_threads(split_small, t, k, n):
    """Token-by-token products (fewer rows than the tile pays for) run on the native tile when the run has
    threads, so that carrack's pool is the only one busy: the same bits at 2 and 4 threads."""
    a, b = _rand(t, k), _rand(k, n, seed=1)
    results = []
    for count in (2, 4):
        with intra_op.intra_op_threads(count):
            assert native_matmul.chosen(t, k, n)
            y = np.empty((t, n), np.float32)
            assert native_matmul.matmul_into(a, b, y)
            results.append(y)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_allclose(results[0], a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
    with intra_op.intra_op_threads(2):
        assert not native_matmul.chosen(t, 32, n)  # too shallow to be worth a native call


CONVS = [  # (x shape, w shape, strides, pads, group)
    ((1, 13, 17, 19), (11, 13, 3, 3), (1, 1), (1, 1, 1, 1), 1),
    ((2, 6, 23, 21), (10, 3, 3, 3), (2, 2), (1, 0, 1, 2), 2),
    ((1, 3, 33, 31), (7, 3, 5, 5), (2, 1), (2, 2, 2, 2), 1),
]


@needs_native
@pytest.mark.parametrize(("x_shape", "w_shape", "strides", "pads", "group"), CONVS)
def test_direct_convolution(split_small, x_shape, w_shape, strides, pads, group):
    kernels = native_conv.load()
    x, w, bias = _rand(*x_shape), _rand(*w_shape, seed=1), _rand(w_shape[0], seed=2)
    _assert_same_at_every_count(lambda: kernels.direct(x, w, bias, None, strides, pads, (1, 1), group, (1, 0, 0)))


@needs_native
@pytest.mark.parametrize(("x_shape", "m", "group"), [((2, 13, 9, 11), 17, 1), ((1, 8, 5, 7), 12, 4),
                                                     ((1, 64, 3, 3), 70, 1)])
def test_pointwise_convolution(split_small, x_shape, m, group):
    kernels = native_conv.load()
    x, w, bias = _rand(*x_shape), _rand(m, x_shape[1] // group, 1, 1, seed=1), _rand(m, seed=2)
    z = _rand(x_shape[0], m, *x_shape[2:], seed=3)
    _assert_same_at_every_count(lambda: kernels.pointwise(x, w, bias, None, group, (2, 0.0, 6.0), z))


@needs_native
def test_im2col_and_bound_convolutions(split_small):
    kernels = native_conv.load()
    image = _rand(5, 17, 19)

    def columns():
        cols = np.empty((5 * 9, 7 * 9), np.float32)
        kernels.im2col(image, cols, (3, 3), 9, (2, 2), (1, 1), (1, 1, 1, 1), 1, 8)
        return cols

    _assert_same_at_every_count(columns)
    x, w, bias = _rand(1, 9, 15, 13), _rand(14, 9, 3, 3, seed=1), _rand(14, seed=2)
    direct = kernels.bind("direct", x.shape, w, bias, (1, 1), (1, 1, 1, 1), (1, 1), 1, (1, 0, 0))
    _assert_same_at_every_count(lambda: direct(x, None, None))
    depthwise_w = _rand(18, 1, 3, 3, seed=3)
    depthwise = kernels.bind("depthwise", x.shape, depthwise_w, None, (2, 2), (1, 1, 1, 1), (1, 1), 9, (0, 0, 0))
    _assert_same_at_every_count(lambda: depthwise(x, None, None))


@needs_native
@pytest.mark.parametrize(("x_shape", "mult", "strides"), [((2, 7, 15, 13), 2, (1, 1)), ((1, 33, 9, 30), 1, (2, 2))])
def test_depthwise_convolution(split_small, x_shape, mult, strides):
    kernels = native_conv.load()
    c = x_shape[1]
    x, w, bias = _rand(*x_shape), _rand(c * mult, 1, 3, 3, seed=1), _rand(c * mult, seed=2)
    _assert_same_at_every_count(lambda: kernels.depthwise(x, w, bias, None, strides, (1, 1, 1, 1), (1, 1),
                                                          (5, 0.0, 0.0)))


@needs_native
def test_pools_and_plane_passes(split_small):
    kernels = native_conv.load()
    x = _rand(3, 5, 17, 15)
    scale, shift, bias = _rand(5, seed=1), _rand(5, seed=2), _rand(5, seed=3)
    for mode in (native_conv.POOL_MAX, native_conv.POOL_AVERAGE, native_conv.POOL_AVERAGE_PADS):
        _assert_same_at_every_count(lambda mode=mode: kernels.pool(x, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), (9, 8),
                                                                    mode))
    _assert_same_at_every_count(lambda: kernels.plane_mean(x))
    _assert_same_at_every_count(lambda: kernels.scale_shift(x, scale, shift, (1, 0.0, 0.0)))

    def bias_relu():
        y = x.copy()
        assert kernels.bias_activation(y, bias, (1, 0.0, 0.0))
        return y

    _assert_same_at_every_count(bias_relu)


@needs_native
@pytest.mark.parametrize("rows", [1, 7, 37, 129])
def test_row_kernels(split_small, rows):
    if rowops.library() is None:
        pytest.skip("rowops not built here")
    x, skip, gamma, beta = _rand(rows, 300), _rand(rows, 300, seed=1), _rand(300, seed=2), _rand(300, seed=3)
    scores, mask = _rand(2, 3, rows, 41), _rand(2, 1, rows, 41, seed=4)
    _assert_same_at_every_count(lambda: rowops.softmax(scores, 0.5, mask, True))
    _assert_same_at_every_count(lambda: rowops.layer_norm(x, gamma, beta, 1e-5, 300, skip=skip, stats=True,
                                                          total=True))
    _assert_same_at_every_count(lambda: rowops.gelu(x))
    _assert_same_at_every_count(lambda: rowops.gelu(x, beta, True))
    _assert_same_at_every_count(lambda: rowops.gelu(_rand(5, 3, 7)))  # short rows merged into one


@needs_native
@pytest.mark.parametrize(("m", "k", "n"), [(50, 99, 300), (3, 17, 40), (131, 64, 7), (1, 256, 1000)])
def test_int8_gemm(split_small, m, k, n):
    rng = np.random.default_rng(m)
    a = rng.integers(0, 256, (m, k), dtype=np.uint8)
    w = rng.integers(-128, 128, (k, n), dtype=np.int8)
    packed = qgemm.PackedInt8Weight.pack(w)
    exact = (a.astype(np.int64) - 7) @ w.astype(np.int64)
    results = _at_each_thread_count(lambda: qgemm.qgemm(a, packed, a_zero_point=7))
    for (result,) in results:
        np.testing.assert_array_equal(result, exact)
    _assert_same_at_every_count(lambda: qgemm.qgemm(a, packed, a_zero_point=7, multiplier=np.float32(1 / 512),
                                                    y_zero_point=100, out_dtype=np.uint8))


def _qdq_conv_model(x_shape, w, group, strides, pads) -> bytes:
    inits = {"xs": np.float32(0.05), "xz": np.uint8(3), "w": w, "ws": np.float32(0.02), "wz": np.int8(0),
             "ys": np.float32(0.1), "yz": np.uint8(5)}
    nodes = [helper.make_node("DequantizeLinear", ["x", "xs", "xz"], ["xf"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"]),
             helper.make_node("Conv", ["xf", "wf"], ["yf"], group=group, strides=strides, pads=pads),
             helper.make_node("QuantizeLinear", ["yf", "ys", "yz"], ["y"])]
    graph = helper.make_graph(nodes, "qconv", [helper.make_tensor_value_info("x", TensorProto.UINT8, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()


QCONVS = [  # (x shape, w shape, group, strides, pads): im2col, 1x1 (transposes only), depthwise
    ((1, 5, 21, 19), (9, 5, 3, 3), 1, [1, 1], [1, 1, 1, 1]),
    ((2, 16, 13, 11), (24, 16, 1, 1), 1, [1, 1], [0, 0, 0, 0]),
    ((1, 12, 17, 15), (12, 1, 3, 3), 12, [2, 2], [1, 1, 1, 1]),
]


@needs_native
@pytest.mark.parametrize("shape", [(1, 300), (7, 33), (129, 768)])
def test_dynamic_quantization_of_activations(split_small, shape):
    """DynamicQuantizeLinear of x (the int8 GEMM's activations): the range by row ranges over the threads, then the
    bytes: the same scale, zero point and bytes at every count; a NaN or an all-zero x the same at every count."""
    if qgemm.library() is None:
        pytest.skip("qgemm not built here")
    x = _rand(*shape) * 3 + 0.5
    x[-1, -1] = -7.25  # the minimum in the last row: the range must combine every piece's
    _assert_same_at_every_count(lambda: qgemm.dynamic_quantize_u8(x))
    q, scale, zero_point = qgemm.dynamic_quantize_u8(x)
    expected_scale = np.float32((np.float32(max(0, x.max())) - np.float32(min(0, x.min()))) / np.float32(255))
    assert scale == expected_scale
    with intra_op.intra_op_threads(4):
        assert qgemm.dynamic_quantize_u8(np.zeros(shape, np.float32))[1:] == (np.float32(1.0), 0)
        poisoned = x.copy()
        poisoned[-1, 0] = np.nan
        assert qgemm.dynamic_quantize_u8(poisoned) is None


@needs_native
@pytest.mark.parametrize(("x_shape", "w_shape", "group", "strides", "pads"), QCONVS)
def test_quantized_convolution(split_small, monkeypatch, x_shape, w_shape, group, strides, pads):
    if qconv.library() is None:
        pytest.skip("qconv not built here")
    monkeypatch.setattr(qconv, "BLOCK_BYTES", 1024)  # several pixel blocks per image
    rng = np.random.default_rng(1)
    model = _qdq_conv_model(x_shape, rng.integers(-128, 128, w_shape, dtype=np.int8), group, strides, pads)
    x = rng.integers(0, 256, x_shape, dtype=np.uint8)
    results = []
    for count in THREAD_COUNTS:
        options = carrack.SessionOptions()
        options.intra_op_num_threads = count
        results.append(carrack.InferenceSession(model, options).run(None, {"x": x})[0])
    for result in results[1:]:
        np.testing.assert_array_equal(result, results[0])


@needs_native
def test_quantized_add_and_max_pool(split_small):
    if qconv.library() is None:
        pytest.skip("qconv not built here")
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 256, (3, 7, 11), dtype=np.uint8), rng.integers(0, 256, (3, 7, 11), dtype=np.uint8)
    _assert_same_at_every_count(lambda: qconv.qlinear_add(a, b, np.float32(0.7), np.float32(0.4), np.float32(-3.0),
                                                          np.uint8))
    x = rng.integers(-128, 128, (2, 5, 13, 11), dtype=np.int8)
    _assert_same_at_every_count(lambda: qconv.maxpool_8bit(x, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), (7, 6)))


@needs_native
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("other_shape", [(37, 301), (301,), (1, 301), (1,), ()])
@pytest.mark.parametrize("swap", [False, True])
def test_elementwise_arithmetic(split_small, op, other_shape, swap):
    """Add/Sub/Mul/Div of float32 arrays by the native pass: the same shape, a bias over the last dims or a scalar,
    on either side, with zeros, infinities and NaN among the values: the same bits as numpy at every count."""
    if rowops.library() is None:
        pytest.skip("rowops not built here")
    full = _rand(2, 37, 301) if other_shape == (37, 301) else _rand(37, 301)
    other = _rand(*other_shape, seed=1) if other_shape else np.array(np.float32(-0.75))
    full.flat[::97], full.flat[5] = 0.0, np.inf
    other.flat[0] = 0.0 if other.size > 1 else other.flat[0]
    a, b = (other, full) if swap else (full, other)
    expected = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}[op]
    with np.errstate(divide="ignore", invalid="ignore"):
        want = expected(a, b)

    def compute():
        y = rowops.binary(op, a, b)
        assert (y is None) == (intra_op.threads() == 1)  # numpy's on one thread
        return want if y is None else y

    _assert_same_at_every_count(compute)
    with intra_op.intra_op_threads(2):
        into = full.copy()  # in place over the full-size operand
        args = (other, into) if swap else (into, other)
        assert rowops.binary(op, *args, out=into) is into
        np.testing.assert_array_equal(into, want)


@needs_native
def test_elementwise_arithmetic_leaves_other_layouts_to_numpy(split_small):
    x = _rand(4, 8, 16)
    with intra_op.intra_op_threads(2):
        assert rowops.binary("Add", x, _rand(4, 1, 16)) is None  # broadcast in a middle dim
        assert rowops.binary("Add", x[:, ::2], _rand(16)) is None  # strided
        assert rowops.binary("Add", x, _rand(16).astype(np.float64)) is None
        assert rowops.binary("Add", x, x, out=np.empty(3, np.float32)) is None  # an out it cannot fill: numpy's
        assert rowops.binary("Add", x, x) is not None
        bias = _rand(16)
        assert rowops.binary("Add", x, bias, out=bias[None, None]) is None  # out overlaps the bias: numpy


@needs_native
@pytest.mark.parametrize(("batch", "t", "k", "n"), [((1, 6), 37, 64, 197), ((2, 3), 64, 65, 64), ((5,), 9, 130, 71)])
def test_batched_matmul_of_head_views(split_small, batch, t, k, n):
    """Attention's products: per (batch, head) views with strided rows, keys transposed (copied), the result
    written through a transposed view, as the fused Attention kernel calls it."""
    heads = batch[-1]
    packed_q = _rand(*batch[:-1], t, heads * k)  # (B, S, N * H): heads are strided views
    q = packed_q.reshape(*batch[:-1], t, heads, k).swapaxes(-2, -3)
    keys = _rand(*batch, n, k, seed=1).swapaxes(-1, -2)  # rows not contiguous: copied

    def compute():
        out = np.full((*batch[:-1], t, heads * n), np.nan, np.float32)
        view = out.reshape(*batch[:-1], t, heads, n).swapaxes(-2, -3)
        assert native_matmul.batched_into(q, keys, view)
        return out

    _assert_same_at_every_count(compute)
    expected = np.matmul(q.astype(np.float64), keys).swapaxes(-2, -3).reshape(*batch[:-1], t, heads * n)
    np.testing.assert_allclose(compute(), expected, rtol=1e-4, atol=1e-3)
    assert not native_matmul.batched_into(q, keys[..., :1, :], np.empty((*batch, t, n), np.float32))  # K differs


@needs_native
@pytest.mark.parametrize(("shape", "heads"), [((1, 37, 12 * 17), 12), ((3, 5, 2 * 33), 2), ((2, 130, 64), 1)])
def test_transposing_copy_of_head_views(split_small, monkeypatch, shape, heads):
    """Attention's keys (B, S, N * H) seen as (B, N, H, S): copied C-contiguous by the native blocked copy, the
    same elements as numpy's copy at every thread count (3-D and 4-D, sizes that fill no band evenly)."""
    native_matmul._load()
    lib, calls = native.library("convgemm"), []
    copy = lib.transpose_f32_threads
    monkeypatch.setattr(lib, "transpose_f32_threads", lambda *args: calls.append(args[-1]) or copy(*args))
    batch, seq, hidden = shape
    packed = _rand(*shape)
    keys = packed.reshape(batch, seq, heads, hidden // heads).transpose(0, 2, 3, 1)  # (B, N, H, S)
    for view in (keys, keys[0]):
        expected = np.ascontiguousarray(view)

        def compute(view=view):
            copy = native_matmul._contiguous_transposed(view)
            assert copy.flags.c_contiguous and not np.may_share_memory(copy, view)
            return copy

        _assert_same_at_every_count(compute)
        np.testing.assert_array_equal(compute(), expected)
    assert sorted(set(calls)) == [1, 2, 4]  # the native copy, at each thread count


@needs_native
@pytest.mark.parametrize(("a_shape", "b_shape"), [((2, 3, 37, 64), (2, 3, 64, 70)), ((5, 64, 65), (5, 65, 64))])
def test_batched_matmul_node(split_small, monkeypatch, a_shape, b_shape):
    """A MatMul node of batched operands (attention left unfused) on the native kernel: the same bits at 1, 2 and
    4 threads, and onnxruntime's result within float32 rounding."""
    from tests.helpers import ort_run

    calls = []
    original = native_matmul.batched_into
    monkeypatch.setattr(native_matmul, "batched_into", lambda *args: calls.append(1) or original(*args))
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape),
                                            helper.make_tensor_value_info("b", TensorProto.FLOAT, b_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feed = {"a": _rand(*a_shape), "b": _rand(*b_shape, seed=1)}
    outputs = []
    for count in THREAD_COUNTS:
        options = carrack.SessionOptions()
        options.intra_op_num_threads = count
        outputs.append(carrack.InferenceSession(model.SerializeToString(), options).run(None, feed)[0])
    for other in outputs[1:]:
        np.testing.assert_array_equal(other, outputs[0])
    assert len(calls) == len(THREAD_COUNTS)
    np.testing.assert_allclose(outputs[0], ort_run(model, feed)[0], rtol=1e-4, atol=1e-4)


@needs_native
@pytest.mark.parametrize(("t", "k", "n"), [(1, 1280, 1000), (3, 17, 33), (16, 64, 5)])
def test_dot_products_by_a_transposed_weight(split_small, t, k, n):
    a, b = _rand(t, k), _rand(n, k, seed=1)

    def compute():
        y = np.empty((t, n), np.float32)
        assert native_matmul.transposed_into(a, b, y)
        return y

    _assert_same_at_every_count(compute)
    np.testing.assert_allclose(compute(), a.astype(np.float64) @ b.T, rtol=1e-4, atol=1e-4)
    assert not native_matmul.transposed_into(_rand(17, k), b, np.empty((17, n), np.float32))  # too many rows


@needs_native
def test_gemm_head_on_native_threads(monkeypatch):
    """A classifier head (Gemm, transB, alpha, beta, bias) through the native path matches onnxruntime."""
    from tests.helpers import ort_run

    calls = []
    original = native_matmul.transposed_into
    monkeypatch.setattr(native_matmul, "transposed_into", lambda *args: calls.append(1) or original(*args))

    rng = np.random.default_rng(0)
    w, c = rng.standard_normal((40, 300)).astype(np.float32), rng.standard_normal(40).astype(np.float32)
    node = helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1, alpha=0.5, beta=2.0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 300])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(c, "c")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.standard_normal((2, 300)).astype(np.float32)
    got = carrack.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ort_run(model, {"x": x})[0], rtol=1e-5, atol=1e-5)
    assert calls == [1]
