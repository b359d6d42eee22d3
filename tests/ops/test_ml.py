"""ai.onnx.ml kernels against onnxruntime on hand-built single-node models."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack

RNG = np.random.default_rng(0)
F = TensorProto.FLOAT


def _model(op: str, inputs: dict[str, np.ndarray], outputs: list[tuple[str, int]], ml_opset: int = 1,
           **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, list(inputs), [n for n, _ in outputs], domain="ai.onnx.ml", **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                    for n, v in inputs.items()]
    graph_outputs = [helper.make_tensor_value_info(n, t, None) for n, t in outputs]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs)
    opsets = [helper.make_opsetid("", 19), helper.make_opsetid("ai.onnx.ml", ml_opset)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def _compare(model: onnx.ModelProto, inputs: dict[str, np.ndarray], rtol: float = 1e-5, atol: float = 1e-6):
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)
    got = carrack.InferenceSession(model.SerializeToString()).run(None, inputs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype, (g.dtype, e.dtype)
        assert g.shape == e.shape, (g.shape, e.shape)
        if g.dtype == object:
            assert g.tolist() == e.tolist()
        else:
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)


X = RNG.standard_normal((6, 4)).astype(np.float32)


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_binarizer(threshold):
    _compare(_model("Binarizer", {"x": X}, [("y", F)], threshold=threshold), {"x": X})


def test_array_feature_extractor():
    idx = np.array([3, 0, 0], np.int64)
    _compare(_model("ArrayFeatureExtractor", {"x": X, "i": idx}, [("y", F)]), {"x": X, "i": idx})


def test_scaler():
    _compare(_model("Scaler", {"x": X}, [("y", F)], offset=[0.1, 0.2, 0.3, 0.4], scale=[2.0, 1.0, 0.5, 3.0]),
             {"x": X})


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
def test_normalizer(norm):
    x = np.concatenate([X, np.zeros((1, 4), np.float32)])
    _compare(_model("Normalizer", {"x": x}, [("y", F)], norm=norm), {"x": x})


def test_imputer_nan():
    x = X.copy()
    x[1, 2] = np.nan
    x[3, 0] = np.nan
    _compare(_model("Imputer", {"x": x}, [("y", F)], imputed_value_floats=[1.0, 2.0, 3.0, 4.0],
                    replaced_value_float=float("nan")), {"x": x})


def test_feature_vectorizer():
    a = X[:, :2].copy()
    b = X[:, 1:].copy()
    model = _model("FeatureVectorizer", {"a": a, "b": b}, [("y", F)], inputdimensions=[2, 3])
    _compare(model, {"a": a, "b": b})


@pytest.mark.parametrize("zeros", [1])
def test_one_hot_encoder(zeros):
    x = np.array([[1, 3], [2, 7]], np.int64)
    _compare(_model("OneHotEncoder", {"x": x}, [("y", F)], cats_int64s=[1, 2, 3, 4], zeros=zeros), {"x": x})


def test_one_hot_encoder_strings():
    x = np.array([["a", "b"], ["z", "c"]], dtype=object)
    _compare(_model("OneHotEncoder", {"x": x}, [("y", F)], cats_strings=["a", "b", "c"]), {"x": x})


def test_category_mapper_both_ways():
    strings = np.array(["a", "c", "q"], dtype=object)
    ints = np.array([[1, 5], [2, 3]], np.int64)
    attrs = dict(cats_strings=["a", "b", "c"], cats_int64s=[1, 2, 3], default_int64=-7, default_string="?")
    _compare(_model("CategoryMapper", {"x": strings}, [("y", TensorProto.INT64)], **attrs), {"x": strings})
    _compare(_model("CategoryMapper", {"x": ints}, [("y", TensorProto.STRING)], **attrs), {"x": ints})


def test_label_encoder_v1():
    strings = np.array(["b", "a", "zz"], dtype=object)
    attrs = dict(classes_strings=["a", "b", "c"], default_int64=-5)
    _compare(_model("LabelEncoder", {"x": strings}, [("y", TensorProto.INT64)], **attrs), {"x": strings})


@pytest.mark.parametrize("ml_opset", [2, 4])
def test_label_encoder_float_keys_with_nan(ml_opset):
    x = np.array([1.5, np.nan, 2.0, 7.0], np.float32)
    model = _model("LabelEncoder", {"x": x}, [("y", TensorProto.INT64)], ml_opset=ml_opset,
                   keys_floats=[1.5, float("nan"), 2.0, 2.0], values_int64s=[1, 2, 3, 4], default_int64=9)
    _compare(model, {"x": x})


def test_label_encoder_tensor_attrs():
    x = np.array([3, 1, 8], np.int64)
    model = _model("LabelEncoder", {"x": x}, [("y", TensorProto.DOUBLE)], ml_opset=4,
                   keys_tensor=helper.make_tensor("k", TensorProto.INT64, [2], [1, 3]),
                   values_tensor=helper.make_tensor("v", TensorProto.DOUBLE, [2], [0.5, 1.5]),
                   default_tensor=helper.make_tensor("d", TensorProto.DOUBLE, [1], [-2.0]))
    _compare(model, {"x": x})


@pytest.mark.parametrize("post", ["NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO"])
def test_linear_classifier_multiclass(post):
    coef = RNG.standard_normal(12).tolist()
    model = _model("LinearClassifier", {"x": X}, [("y", TensorProto.INT64), ("z", F)], coefficients=coef,
                   intercepts=[0.1, -0.2, 0.3], classlabels_ints=[4, 5, 6], post_transform=post)
    _compare(model, {"x": X})


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC"])
def test_linear_classifier_binary(post):
    model = _model("LinearClassifier", {"x": X}, [("y", TensorProto.STRING), ("z", F)],
                   coefficients=[0.5, -1.0, 2.0, 0.25], intercepts=[0.1], classlabels_strings=["no", "yes"],
                   post_transform=post)
    _compare(model, {"x": X})


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "PROBIT"])
def test_linear_regressor(post):
    x = X / 10
    model = _model("LinearRegressor", {"x": x}, [("y", F)], coefficients=[0.1, -0.2, 0.2, 0.05] * 2,
                   intercepts=[0.3, 0.4], targets=2, post_transform=post)
    _compare(model, {"x": x}, rtol=1e-4, atol=1e-5)


SV = RNG.standard_normal((5, 4)).astype(np.float32)


@pytest.mark.parametrize("kernel", ["LINEAR", "POLY", "RBF", "SIGMOID"])
def test_svm_regressor(kernel):
    model = _model("SVMRegressor", {"x": X}, [("y", F)], kernel_type=kernel, kernel_params=[0.3, 0.1, 2.0],
                   n_supports=5, support_vectors=SV.reshape(-1).tolist(), coefficients=[0.5, -0.2, 0.1, 0.3, -0.4],
                   rho=[0.25])
    _compare(model, {"x": X}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", ["LINEAR", "RBF"])
@pytest.mark.parametrize("probabilities", [False, True])
def test_svm_classifier_three_classes(kernel, probabilities):
    attrs = dict(kernel_type=kernel, kernel_params=[0.3, 0.1, 2.0], classlabels_ints=[0, 1, 2],
                 vectors_per_class=[2, 2, 1], support_vectors=SV.reshape(-1).tolist(),
                 coefficients=RNG.standard_normal(10).tolist(), rho=[0.1, -0.2, 0.3])
    if probabilities:
        attrs.update(prob_a=[-1.5, -2.0, -1.0], prob_b=[0.1, -0.1, 0.05])
    model = _model("SVMClassifier", {"x": X}, [("y", TensorProto.INT64), ("z", F)], **attrs)
    _compare(model, {"x": X}, rtol=1e-3, atol=1e-4)


def test_svm_classifier_binary():
    model = _model("SVMClassifier", {"x": X}, [("y", TensorProto.INT64), ("z", F)], kernel_type="RBF",
                   kernel_params=[0.3, 0.0, 0.0], classlabels_ints=[3, 8], vectors_per_class=[3, 2],
                   support_vectors=SV.reshape(-1).tolist(), coefficients=[0.5, -0.2, 0.1, 0.3, -0.4], rho=[0.05])
    _compare(model, {"x": X}, rtol=1e-4, atol=1e-5)


def _regressor_trees() -> dict:
    # tree 0: x0 <= 0.1 ? (x2 < -0.3 ? leaf 3 : leaf 4) : leaf 2; tree 1: x1 > 0 ? leaf 1 : leaf 2
    return dict(
        nodes_treeids=[0, 0, 0, 0, 0, 1, 1, 1], nodes_nodeids=[0, 1, 2, 3, 4, 0, 1, 2],
        nodes_featureids=[0, 2, 0, 0, 0, 1, 0, 0], nodes_values=[0.1, -0.3, 0, 0, 0, 0.0, 0, 0],
        nodes_modes=["BRANCH_LEQ", "BRANCH_LT", "LEAF", "LEAF", "LEAF", "BRANCH_GT", "LEAF", "LEAF"],
        nodes_truenodeids=[1, 3, 0, 0, 0, 1, 0, 0], nodes_falsenodeids=[2, 4, 0, 0, 0, 2, 0, 0],
        nodes_missing_value_tracks_true=[1, 0, 0, 0, 0, 0, 0, 0])


@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE", "MIN", "MAX"])
def test_tree_ensemble_regressor(aggregate):
    x = X.copy()
    x[0, 0] = np.nan
    attrs = _regressor_trees() | dict(
        target_treeids=[0, 0, 0, 0, 1, 1], target_nodeids=[2, 3, 4, 4, 1, 2], target_ids=[0, 0, 0, 1, 1, 0],
        target_weights=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], n_targets=2, aggregate_function=aggregate,
        base_values=[0.5, -0.5])
    _compare(_model("TreeEnsembleRegressor", {"x": x}, [("y", F)], ml_opset=3, **attrs), {"x": x})


@pytest.mark.parametrize("post", ["NONE", "SOFTMAX", "LOGISTIC"])
def test_tree_ensemble_classifier_multiclass(post):
    attrs = _regressor_trees() | dict(
        class_treeids=[0, 0, 0, 1, 1, 1], class_nodeids=[2, 3, 4, 1, 2, 2], class_ids=[0, 1, 2, 2, 0, 1],
        class_weights=[0.3, 0.6, 0.9, 0.2, 0.4, 0.1], classlabels_int64s=[10, 20, 30], post_transform=post)
    model = _model("TreeEnsembleClassifier", {"x": X}, [("y", TensorProto.INT64), ("z", F)], ml_opset=3, **attrs)
    _compare(model, {"x": X})


def test_tree_ensemble_classifier_binary_both_classes():
    attrs = _regressor_trees() | dict(
        class_treeids=[0, 0, 0, 0, 1, 1], class_nodeids=[2, 3, 4, 4, 1, 2], class_ids=[0, 1, 0, 1, 1, 0],
        class_weights=[0.3, 0.6, 0.1, 0.9, 0.2, 0.4], classlabels_strings=["a", "b"])
    model = _model("TreeEnsembleClassifier", {"x": X}, [("y", TensorProto.STRING), ("z", F)], ml_opset=3,
                   **attrs)
    _compare(model, {"x": X})


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tree_ensemble_v5(aggregate, dtype):
    x = X.astype(dtype)
    x[2, 1] = np.nan
    code = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    attrs = dict(
        n_targets=2, aggregate_function=aggregate, post_transform=0, tree_roots=[0, 2],
        nodes_featureids=[0, 1, 1], nodes_modes=helper.make_tensor("m", TensorProto.UINT8, [3], [0, 3, 5]),
        nodes_splits=helper.make_tensor("s", code, [3], [0.1, -0.2, 0.4]),
        nodes_truenodeids=[1, 0, 2], nodes_trueleafs=[0, 1, 1], nodes_falsenodeids=[1, 1, 3],
        nodes_falseleafs=[1, 1, 1], nodes_missing_value_tracks_true=[0, 1, 0],
        leaf_targetids=[0, 1, 0, 1], leaf_weights=helper.make_tensor("w", code, [4], [1.0, 2.0, 3.0, 4.0]))
    _compare(_model("TreeEnsemble", {"x": x}, [("y", code)], ml_opset=5, **attrs), {"x": x})


def test_zipmap():
    x = np.array([[0.1, 0.9], [0.7, 0.3]], np.float32)
    model = _model("ZipMap", {"x": x}, [("z", F)], classlabels_strings=["a", "b"])
    map_type = helper.make_map_type_proto(TensorProto.STRING, helper.make_tensor_type_proto(F, None))
    model.graph.output[0].CopyFrom(helper.make_value_info("z", helper.make_sequence_type_proto(map_type)))
    got = carrack.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert [sorted(d) for d in got] == [["a", "b"], ["a", "b"]]
    np.testing.assert_allclose([d["b"] for d in got], [0.9, 0.3], rtol=1e-6)


def test_dict_vectorizer():
    model = _model("DictVectorizer", {}, [("y", F)], string_vocabulary=["a", "c", "b", "z"])
    model.graph.input.append(helper.make_value_info("x", helper.make_map_type_proto(
        TensorProto.STRING, helper.make_tensor_type_proto(F, None))))
    model.graph.node[0].input.append("x")
    got = carrack.InferenceSession(model.SerializeToString()).run(None, {"x": {"a": 4.0, "c": 8.0}})[0]
    np.testing.assert_array_equal(got.reshape(-1), [4, 8, 0, 0])
