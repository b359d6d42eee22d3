"""CarrackPredictor on batches as Ray Data hands them (dicts of numpy arrays, pandas with tensor columns, pyarrow),
in process: column mapping, dtype casts, images channels-last, and malformed rows named by id or written to the
error column while the rest of the batch is scored."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import carrack

pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'carrack[ray]'")
import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402
from ray.data.extensions import TensorArray  # noqa: E402

from carrack.errors import InvalidArgument  # noqa: E402
from carrack.passes import optimizer  # noqa: E402
from carrack.ray import CarrackPredictor, MalformedRows  # noqa: E402
from tests.ray.models import features, mlp_model  # noqa: E402


@pytest.fixture(scope="module")
def session():
    return carrack.InferenceSession(mlp_model())


def test_an_unpickled_plan_scores_without_optimizing_again(session):
    shipped = pickle.dumps(session)
    runs = optimizer.RUNS[0]
    predictor = CarrackPredictor(pickle.loads(shipped), threads=2)
    assert optimizer.RUNS[0] == runs
    assert predictor.session.get_session_options().intra_op_num_threads == 2
    x = features(64)
    out = predictor({"id": np.arange(64), "features": x})
    assert np.array_equal(out["probs"], session.run(["probs"], {"features": x})[0])


def test_pandas_tensor_columns_pyarrow_and_a_column_mapping_with_a_cast(session):
    x = features(32)
    expected = session.run(["logits"], {"features": x})[0]
    frame = pd.DataFrame({"key": np.arange(32), "feats": TensorArray(x.astype(np.float64))})
    predictor = CarrackPredictor(session, input_columns={"features": "feats"}, output_columns={"logits": "score"},
                                 id_column="key")
    out = predictor(frame)
    assert sorted(out) == ["key", "score"] and out["score"].dtype == np.float32
    np.testing.assert_array_equal(out["score"], expected)
    table = pa.table({"key": np.arange(32), "feats": [list(map(float, row)) for row in x]})
    np.testing.assert_array_equal(predictor(table)["score"], expected)


def test_malformed_rows_are_named_by_id(session):
    x = features(4)
    rows = np.empty(4, dtype=object)
    rows[:] = [x[0], x[1][:3], None, np.array(["a"] * 16)]
    with pytest.raises(MalformedRows) as caught:
        CarrackPredictor(session)({"id": np.array([10, 11, 12, 13]), "features": rows})
    message = str(caught.value)
    assert "row id 11" in message and "shape (3,)" in message and "expects (16,)" in message
    assert "row id 12" in message and "no value" in message
    assert "row id 13" in message and "not convertible to float32" in message
    assert "row id 10" not in message
    assert set(caught.value.problems) == {11, 12, 13}


def test_nan_is_refused_only_when_asked(session):
    x = features(8)
    x[5, 2] = np.nan
    assert np.isnan(CarrackPredictor(session)({"id": np.arange(8), "features": x})["probs"][5]).all()
    with pytest.raises(MalformedRows, match="row id 5: input 'features' has NaN"):
        CarrackPredictor(session, check_finite=True)({"id": np.arange(8), "features": x})


def test_error_column_records_bad_rows_and_scores_the_rest(session):
    x = features(6)
    rows = np.empty(6, dtype=object)
    rows[:] = list(x)
    rows[2] = x[2][:5]
    out = CarrackPredictor(session, on_error="column")({"id": np.arange(6) * 10, "features": rows})
    assert [e is None for e in out["error"]] == [True, True, False, True, True, True]
    assert "shape (5,)" in out["error"][2]
    assert np.isnan(out["probs"][2]).all()
    good = [0, 1, 3, 4, 5]
    np.testing.assert_array_equal(out["probs"][good], session.run(["probs"], {"features": x[good]})[0])


def test_a_missing_column_or_unknown_names_are_clear_errors(session):
    with pytest.raises(InvalidArgument, match="model input 'features' reads column 'features'.*input_columns"):
        CarrackPredictor(session)({"id": np.arange(2), "x": features(2), "y": features(2)})
    with pytest.raises(InvalidArgument, match="no id column 'id'"):
        CarrackPredictor(session)({"features": features(2)})
    with pytest.raises(InvalidArgument, match=r"not inputs of the model \(inputs: \['features'\]\)"):
        CarrackPredictor(session, input_columns={"pixels": "x"})
    with pytest.raises(InvalidArgument, match="not outputs of the model"):
        CarrackPredictor(session, output_columns=["nope"])


def tiny_cnn() -> bytes:
    weight = helper.make_tensor("w", TensorProto.FLOAT, [2, 3, 3, 3], np.linspace(-1, 1, 54).tolist())
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("GlobalAveragePool", ["c"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["score"])],
        "cnn", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["n", 2])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_images_as_ray_decodes_them_go_channels_first_and_to_float():
    session = carrack.InferenceSession(tiny_cnn())
    images = np.random.default_rng(0).integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)  # read_images: HWC uint8
    out = CarrackPredictor(session)({"id": np.arange(5), "image": images})
    expected = session.run(None, {"image": images.transpose(0, 3, 1, 2).astype(np.float32)})[0]
    np.testing.assert_array_equal(out["score"], expected)
