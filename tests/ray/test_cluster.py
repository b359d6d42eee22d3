"""carrack.ray on a real two-node Ray cluster (tests/ray/conftest.py): 10,240 rows through two actors, one per
node, equal bit for bit to one in-process session; no worker optimizes the graph; a killed worker loses nothing."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import carrack

ray = pytest.importorskip("ray", reason="Ray Data is not installed: pip install 'carrack[ray]'")
from ray.data.extensions import TensorArray  # noqa: E402

from carrack.ray import predict  # noqa: E402
from tests.ray.models import features, mlp_model  # noqa: E402
from tests.ray.udfs import KillOncePredictor, OptimizerRunsPredictor  # noqa: E402

ROWS, BATCH = 10_240, 256  # blocks of whole batches: Ray's batches are the reference's batches


def blocks_of(x: np.ndarray, ids: np.ndarray) -> ray.data.Dataset:
    frames = [pd.DataFrame({"id": ids[i:i + BATCH], "features": TensorArray(x[i:i + BATCH])})
              for i in range(0, len(x), BATCH)]
    return ray.data.from_pandas(frames)


def reference(session: carrack.InferenceSession, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One in-process session, batch by batch as the actors run them."""
    outs = [session.run(["probs", "logits"], {"features": x[i:i + BATCH]}) for i in range(0, len(x), BATCH)]
    return np.concatenate([o[0] for o in outs]), np.concatenate([o[1] for o in outs])


def test_ten_thousand_rows_on_two_nodes_equal_one_session_bit_for_bit(ray_cluster):
    session = carrack.InferenceSession(mlp_model())
    x = features(ROWS)
    ids = np.random.default_rng(3).permutation(ROWS).astype(np.int64) * 7  # ids out of order, not positions
    ref = ray.put(session)
    scored = blocks_of(x, ids).map_batches(
        OptimizerRunsPredictor, fn_constructor_kwargs={"model": ref}, compute=ray.data.ActorPoolStrategy(size=2),
        batch_size=BATCH, num_cpus=1)
    out = scored.to_pandas().sort_values("id", kind="stable")
    assert len(out) == ROWS and out["id"].is_unique
    order = np.argsort(ids, kind="stable")
    probs, logits = reference(session, x)
    np.testing.assert_array_equal(out["id"].to_numpy(), ids[order])
    assert np.array_equal(np.stack(out["probs"].to_numpy()), probs[order])
    assert np.array_equal(np.stack(out["logits"].to_numpy()), logits[order])
    assert set(out["optimizer_runs"]) == {0}, "a worker optimized the graph instead of loading the compiled plan"
    assert set(out["threads"]) == {1}, "intra-op threads follow the actor's CPU allocation (num_cpus=1)"
    assert out["pid"].nunique() == 2, "two actors share the work"


def test_a_worker_killed_mid_job_is_retried_and_no_row_is_lost_or_doubled(ray_cluster, tmp_path):
    session = carrack.InferenceSession(mlp_model())
    rows = 4096
    x, ids = features(rows, seed=5), np.arange(rows, dtype=np.int64)
    marker = tmp_path / "killed"
    scored = blocks_of(x, ids).map_batches(
        KillOncePredictor, fn_constructor_kwargs={"model": ray.put(session), "kill_id": 2000, "marker": str(marker)},
        compute=ray.data.ActorPoolStrategy(size=2), batch_size=BATCH, num_cpus=1,
        max_restarts=-1, max_task_retries=-1)
    out = scored.to_pandas()
    assert marker.exists(), "the fault was not injected"
    np.testing.assert_array_equal(np.sort(out["id"].to_numpy()), ids)  # every row exactly once
    out = out.sort_values("id")
    assert np.array_equal(np.stack(out["probs"].to_numpy()), reference(session, x)[0])


def test_predict_helper_puts_the_plan_once_and_sorts_by_id(ray_cluster):
    session = carrack.InferenceSession(mlp_model())
    x = features(1024, seed=9)
    ids = np.arange(1024, dtype=np.int64)[::-1].copy()
    out = predict(blocks_of(x, ids), session, concurrency=2, batch_size=BATCH, output_columns={"probs": "p"},
                  sort=True).to_pandas()
    assert list(out.columns) == ["id", "p"]
    np.testing.assert_array_equal(out["id"].to_numpy(), np.arange(1024))
    assert np.array_equal(np.stack(out["p"].to_numpy()), reference(session, x)[0][::-1])
