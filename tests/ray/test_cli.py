"""`carrack batch` end to end: a Parquet file through a local Ray instance the command starts itself (a subprocess,
as a user runs it), and through the test cluster (--address): a malformed row stops the job naming the row, a folder
of .npy files is one row per file."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import carrack

pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'carrack[ray]'")
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from carrack.cli import main  # noqa: E402
from tests.ray.conftest import cluster_env  # noqa: E402
from tests.ray.models import features, mlp_model  # noqa: E402

ROWS, BAD_ROW = 600, 17
BAD_ID = 3 * (ROWS - 1 - BAD_ROW)  # ids descend in steps of 3: the id of row BAD_ROW


def write_input(tmp_path, rows: int = ROWS, bad_row: int | None = BAD_ROW):
    model = tmp_path / "mlp.onnx"
    model.write_bytes(mlp_model())
    x = features(rows, seed=11)
    values = [list(map(float, row)) for row in x]
    if bad_row is not None:
        values[bad_row] = values[bad_row][:5]
    ids = np.arange(rows)[::-1] * 3  # written in descending id order
    pq.write_table(pa.table({"id": ids, "features": values}), tmp_path / "in.parquet")
    return model, x, ids


@pytest.mark.slow  # ~25 s on a loaded 2-core machine: most of it starting and stopping a Ray instance
def test_batch_command_starts_local_ray_and_writes_sorted_outputs_with_an_error_column(tmp_path):
    model, x, ids = write_input(tmp_path)
    out_path = tmp_path / "out.parquet"
    done = subprocess.run(
        [sys.executable, "-m", "carrack", "batch", str(model), "--input", str(tmp_path / "in.parquet"),
         "--output", str(out_path), "--workers", "2", "--batch-size", "64", "--on-error", "column",
         "--output-column", "probs=p"],
        env=cluster_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{ROWS:,} rows in" in done.stdout and "rows/s" in done.stdout and "worker 127.0.0.1:" not in done.stderr
    assert "1 malformed row(s)" in done.stdout
    assert "rows/s" in done.stderr  # progress lines
    table = pq.read_table(out_path)
    assert table.column_names == ["id", "p", "error"]
    assert table.schema.field("p").metadata == {b"carrack.shape": b"[4]"}
    out_ids = table["id"].to_numpy()
    np.testing.assert_array_equal(out_ids, np.sort(ids))  # every row once, sorted by id
    errors = table["error"].to_pylist()
    assert [i for i, e in zip(out_ids, errors) if e] == [BAD_ID] and "shape (5,)" in errors[BAD_ID // 3]
    position = {int(i): k for k, i in enumerate(ids)}
    good = np.array([position[int(i)] for i in out_ids if i != BAD_ID])
    scored = np.stack(table["p"].to_numpy(zero_copy_only=False))[out_ids != BAD_ID]
    expected = carrack.InferenceSession(str(model)).run(["probs"], {"features": x[good]})[0]
    np.testing.assert_allclose(scored, expected, rtol=1e-5, atol=1e-7)  # batches differ from the reference's


def test_a_malformed_row_stops_the_job_with_its_id(ray_cluster, tmp_path, capsys):
    model, _, _ = write_input(tmp_path)
    code = main(["batch", str(model), "--input", str(tmp_path / "in.parquet"), "--output",
                 str(tmp_path / "out.parquet"), "--address", ray_cluster, "--batch-size", "64", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1
    assert f"row id {BAD_ID}: column 'features' value has shape (5,), input 'features' expects (16,)" in err
    assert not (tmp_path / "out.parquet").exists()


def test_a_folder_of_npy_files_is_one_row_per_file(ray_cluster, tmp_path, capsys):
    model = tmp_path / "mlp.onnx"
    model.write_bytes(mlp_model())
    folder = tmp_path / "arrays"
    folder.mkdir()
    x = features(5, seed=2)
    for k, row in enumerate(x):
        np.save(folder / f"sample{k}.npy", row.astype(np.float64))
    assert main(["batch", str(model), "--input", str(folder), "--output", str(tmp_path / "out.parquet"),
                 "--address", ray_cluster, "--output-column", "logits", "--quiet"]) == 0
    table = pq.read_table(tmp_path / "out.parquet")
    assert table["id"].to_pylist() == [f"sample{k}.npy" for k in range(5)]
    expected = carrack.InferenceSession(str(model)).run(["logits"], {"features": x})[0]
    np.testing.assert_allclose(np.stack(table["logits"].to_numpy(zero_copy_only=False)), expected, rtol=1e-6)
    assert os.path.basename(str(tmp_path / "out.parquet")) in capsys.readouterr().out


def test_a_folder_of_images_is_decoded_by_ray_and_fed_channels_first(ray_cluster, tmp_path):
    from PIL import Image

    from tests.ray.test_predictor import tiny_cnn

    model = tmp_path / "cnn.onnx"
    model.write_bytes(tiny_cnn())
    folder = tmp_path / "images"
    folder.mkdir()
    pixels = np.random.default_rng(4).integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)
    for k, image in enumerate(pixels):
        Image.fromarray(image).save(folder / f"img{k}.png")
    assert main(["batch", str(model), "--input", str(folder), "--output", str(tmp_path / "out.parquet"),
                 "--address", ray_cluster, "--quiet"]) == 0
    table = pq.read_table(tmp_path / "out.parquet")
    assert table["id"].to_pylist() == ["img0.png", "img1.png", "img2.png"]
    chw = pixels.transpose(0, 3, 1, 2).astype(np.float32)
    expected = carrack.InferenceSession(str(model)).run(None, {"image": chw})
    np.testing.assert_allclose(np.stack(table["score"].to_numpy(zero_copy_only=False)), expected[0], rtol=1e-6)


def test_missing_id_column_is_named(ray_cluster, tmp_path, capsys):
    pq.write_table(pa.table({"key": [1, 2], "features": [[0.0] * 16] * 2}), tmp_path / "in.parquet")
    (tmp_path / "mlp.onnx").write_bytes(mlp_model())
    assert main(["batch", str(tmp_path / "mlp.onnx"), "--input", str(tmp_path / "in.parquet"), "--output",
                 str(tmp_path / "out.parquet"), "--address", ray_cluster]) == 1
    assert "has no id column 'id' (columns: ['key', 'features']); name one with --id-column" in capsys.readouterr().err
