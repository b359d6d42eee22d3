"""Binary classifiers of ai.onnx.ml against onnxruntime: scikit-learn models converted by skl2onnx, and every
binary convention of TreeEnsembleClassifier (which classes carry leaf weights, their signs, base_values,
post_transform) on a hand-built two-tree ensemble."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import carrack

ort = pytest.importorskip("onnxruntime")
RNG = np.random.default_rng(0)


def _run_both(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list, list]:
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = carrack.InferenceSession(model.SerializeToString()).run(None, feeds)
    return expected, got


def _assert_same(expected: list, got: list, atol: float = 1e-5) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        if e.dtype == object:
            assert g.tolist() == e.tolist()
        elif np.issubdtype(e.dtype, np.integer):
            np.testing.assert_array_equal(g, e)
        else:
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=atol)


# -- scikit-learn models through skl2onnx --------------------------------------------------------------------------

def _binary_data(rows: int = 80) -> tuple[np.ndarray, np.ndarray]:
    x = RNG.standard_normal((rows, 4)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] - 0.3 * x[:, 2] > 0.2).astype(np.int64)
    return x, y


def _estimators() -> dict:
    pytest.importorskip("sklearn")
    from sklearn.compose import ColumnTransformer
    from sklearn.ensemble import ExtraTreesClassifier, GradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression, SGDClassifier
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC, LinearSVC
    from sklearn.tree import DecisionTreeClassifier

    scaled_forest = Pipeline([
        ("columns", ColumnTransformer([("scale", StandardScaler(), [0, 1]), ("keep", "passthrough", [2, 3])])),
        ("forest", RandomForestClassifier(n_estimators=4, max_depth=3, random_state=0))])
    return {
        "random_forest_in_column_transformer": scaled_forest,
        "random_forest": RandomForestClassifier(n_estimators=3, max_depth=4, random_state=1),
        "extra_trees": ExtraTreesClassifier(n_estimators=3, max_depth=3, random_state=0),
        "decision_tree": DecisionTreeClassifier(max_depth=3, random_state=0),
        "gradient_boosting": GradientBoostingClassifier(n_estimators=5, max_depth=2, random_state=0),
        "logistic_regression": LogisticRegression(),
        "linear_svc": LinearSVC(),
        "sgd_hinge": SGDClassifier(random_state=0),
        "svc_rbf": SVC(),
        "svc_rbf_probability": SVC(probability=True, random_state=0),
        "svc_linear": SVC(kernel="linear"),
    }


ESTIMATORS = ["random_forest_in_column_transformer", "random_forest", "extra_trees", "decision_tree",
              "gradient_boosting", "logistic_regression", "linear_svc", "sgd_hinge", "svc_rbf", "svc_rbf_probability",
              "svc_linear"]


@pytest.mark.parametrize("name", ESTIMATORS)
def test_skl2onnx_binary_classifier_matches_onnxruntime(name):
    skl2onnx = pytest.importorskip("skl2onnx")
    estimator = _estimators()[name]
    x, y = _binary_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimator.fit(x, y)
        options = None if name == "linear_svc" else {"zipmap": False}  # LinearSVC gives no probabilities map
        model = skl2onnx.to_onnx(estimator, x[:1], options=options, target_opset={"": 17, "ai.onnx.ml": 3})
    expected, got = _run_both(model, {"X": x})
    _assert_same(expected, got)
    # and the labels are scikit-learn's own
    np.testing.assert_array_equal(got[0], estimator.predict(x))


# -- TreeEnsembleClassifier's binary conventions -------------------------------------------------------------------

def _two_stumps(class_ids: tuple[int, ...], weights: tuple[float, ...], base: list[float] | None,
                post: str) -> onnx.ModelProto:
    """Two trees `x0 <= split ? leaf 1 : leaf 2`; every leaf votes for each of `class_ids`, cycling `weights`."""
    cycle = itertools.cycle(weights)
    votes = [(tree, leaf, c, next(cycle)) for tree in (0, 1) for leaf in (1, 2) for c in class_ids]
    attrs = dict(
        nodes_treeids=[0, 0, 0, 1, 1, 1], nodes_nodeids=[0, 1, 2] * 2, nodes_featureids=[0] * 6,
        nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"] * 2, nodes_values=[0.0, 0, 0, 0.1, 0, 0],
        nodes_truenodeids=[1, 0, 0] * 2, nodes_falsenodeids=[2, 0, 0] * 2,
        class_treeids=[v[0] for v in votes], class_nodeids=[v[1] for v in votes], class_ids=[v[2] for v in votes],
        class_weights=[v[3] for v in votes], classlabels_int64s=[0, 1], post_transform=post)
    if base is not None:
        attrs["base_values"] = base
    node = helper.make_node("TreeEnsembleClassifier", ["X"], ["Y", "Z"], domain="ai.onnx.ml", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 1])],
                              [helper.make_tensor_value_info("Y", TensorProto.INT64, [None]),
                               helper.make_tensor_value_info("Z", TensorProto.FLOAT, [None, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)],
                             ir_version=9)


WEIGHTS = {"probabilities": (0.2, 0.7, 0.4, 0.9), "small_probabilities": (0.05, 0.1, 0.02, 0.01),
           "margins": (0.3, -0.6, 0.2, -0.1)}


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT"])
@pytest.mark.parametrize("base", [None, [0.1], [0.1, 0.3]], ids=["no_base", "one_base", "two_bases"])
@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("class_ids", [(0,), (0, 1)], ids=["class0_only", "both_classes"])
def test_tree_ensemble_binary_convention(class_ids, weights, base, post):
    model = _two_stumps(class_ids, WEIGHTS[weights], base, post)
    x = np.array([[-1.0], [0.05], [1.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # PROBIT of scores outside [0, 1] is NaN in both engines
        expected, got = _run_both(model, {"X": x})
    np.testing.assert_array_equal(got[0], expected[0])
    if post == "PROBIT" and len(class_ids) == 1 and base != [0.1, 0.3]:
        # onnxruntime writes one column for a single PROBIT score and leaves the other unset
        expected[1], got[1] = expected[1][:, :1], got[1][:, :1]
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-6)


# -- SVMClassifier's conventions ------------------------------------------------------------------------------

@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT"])
@pytest.mark.parametrize("probabilities", [False, True], ids=["decision", "probabilities"])
@pytest.mark.parametrize("labels", [[0, 1], [3, 7], [0, 1, 2]], ids=["labels01", "labels37", "three_classes"])
def test_svm_classifier_convention(post, probabilities, labels):
    rng = np.random.default_rng(5)
    three = len(labels) == 3
    attrs = dict(kernel_type="RBF", kernel_params=[0.3, 0.0, 0.0], vectors_per_class=[2, 2, 1] if three else [2, 2],
                 support_vectors=rng.standard_normal(15 if three else 12).tolist(),
                 coefficients=rng.standard_normal(10 if three else 4).tolist(),
                 rho=[0.1, -0.2, 0.3] if three else [0.05], classlabels_ints=labels, post_transform=post)
    if probabilities:
        attrs.update(prob_a=[-1.5, -2.0, -1.0] if three else [-1.3], prob_b=[0.1, -0.1, 0.05] if three else [0.2])
    node = helper.make_node("SVMClassifier", ["X"], ["Y", "Z"], domain="ai.onnx.ml", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 3])],
                              [helper.make_tensor_value_info("Y", TensorProto.INT64, [None]),
                               helper.make_tensor_value_info("Z", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)],
                              ir_version=9)
    x = (rng.standard_normal((6, 3)) * 0.5).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected, got = _run_both(model, {"X": x})
    np.testing.assert_array_equal(got[0], expected[0])
    if post == "PROBIT" and not probabilities and not three:  # onnxruntime writes the first column only
        expected[1], got[1] = expected[1][:, :1], got[1][:, :1]
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-4, atol=1e-5)
