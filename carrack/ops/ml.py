"""Classical-ML kernels of the ai.onnx.ml domain: encoders, scalers, linear models, SVMs and tree ensembles.

Tree ensembles are evaluated for all rows and trees at once: each (row, tree) pair holds a current node, and every
step advances all pairs that have not reached a leaf, so the Python loop runs once per tree level, not per row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from carrack.errors import RunFailure
from carrack.ops.registry import Kernel, register

ML = "ai.onnx.ml"


# ---------------------------------------------------------------------------------------------------- helpers


def _rows(x: np.ndarray) -> np.ndarray:
    """Model inputs are [N, F]; a 1-D input is one row."""
    return x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1) if x.ndim > 2 else x


def _floats(values: Any) -> np.ndarray:
    return np.asarray([] if values is None else values, dtype=np.float32)


def _ints(values: Any) -> np.ndarray:
    return np.asarray([] if values is None else values, dtype=np.int64)


def _strings(values: Any) -> np.ndarray:
    return np.asarray([] if values is None else list(values), dtype=object)


def _erfinv(y: np.ndarray) -> np.ndarray:
    """Winitzki's closed-form approximation of erfinv (a = 0.147), as ONNX ML runtimes use for PROBIT."""
    a = np.float32(0.147)
    ln = np.log((1 - y) * (1 + y))
    first = 2 / (np.float32(np.pi) * a) + ln / 2
    return np.sign(y) * np.sqrt(np.sqrt(first * first - ln / a) - first)


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _softmax_zero(s: np.ndarray) -> np.ndarray:
    """Softmax over the non-zero scores of each row; zero scores stay zero."""
    nonzero = s != 0
    shifted = np.where(nonzero, s, -np.inf)
    top = shifted.max(axis=1, keepdims=True)
    e = np.where(nonzero, np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
    total = e.sum(axis=1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1), 0)


_POST_TRANSFORMS = {
    "NONE": lambda s: s,
    "SOFTMAX": _softmax,
    "LOGISTIC": lambda s: 1 / (1 + np.exp(-s)),
    "SOFTMAX_ZERO": _softmax_zero,
    "PROBIT": lambda s: np.float32(np.sqrt(2)) * _erfinv(2 * s - 1),
}
_POST_TRANSFORM_CODES = ["NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT"]


class _PostTransform(Kernel):
    """Base for kernels with a `post_transform` attribute (a string, or an int code in TreeEnsemble)."""

    def read_post_transform(self) -> None:
        name = self.attr("post_transform", "NONE")
        if isinstance(name, int):
            name = _POST_TRANSFORM_CODES[name] if 0 <= name < len(_POST_TRANSFORM_CODES) else str(name)
        if name not in _POST_TRANSFORMS:
            self.fail(f"post_transform must be one of {', '.join(_POST_TRANSFORMS)}, got {name!r}")
        self.post_transform_name = name
        self.post_transform = _POST_TRANSFORMS[name]


def _class_labels(kernel: Kernel) -> np.ndarray:
    ints, strs = kernel.attr("classlabels_ints", kernel.attr("classlabels_int64s")), kernel.attr("classlabels_strings")
    if strs is not None:
        return _strings(strs)
    return _ints(ints)


# ---------------------------------------------------------------------------------------------------- simple ops


@register("ArrayFeatureExtractor", since=1, domain=ML)
class ArrayFeatureExtractor(Kernel):
    def run(self, x, indices):
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        width = x.shape[-1]
        if idx.size and (idx.min() < -width or idx.max() >= width):
            raise RunFailure(f"indices {idx.tolist()} are out of range for a last axis of size {width}")
        out = np.take(x, idx, axis=-1)
        return out.reshape(1, -1) if x.ndim == 1 else out


@register("Binarizer", since=1, domain=ML)
class Binarizer(Kernel):
    def setup(self) -> None:
        self.threshold = self.attr("threshold", 0.0)

    def run(self, x):
        return (x > x.dtype.type(self.threshold)).astype(x.dtype)


@register("Scaler", since=1, domain=ML)
class Scaler(Kernel):
    def setup(self) -> None:
        self.offset = _floats(self.attr("offset", [0.0]))
        self.scale = _floats(self.attr("scale", [1.0]))

    def run(self, x):
        return ((x.astype(np.float32) - self.offset) * self.scale).astype(np.float32)


@register("Normalizer", since=1, domain=ML)
class Normalizer(Kernel):
    def setup(self) -> None:
        self.norm = self.attr("norm", "MAX")
        if self.norm not in ("MAX", "L1", "L2"):
            self.fail(f"norm must be MAX, L1 or L2, got {self.norm!r}")

    def run(self, x):
        rows = _rows(x).astype(np.float32)
        if self.norm == "MAX":
            divisor = rows.max(axis=1, keepdims=True)
        elif self.norm == "L1":
            divisor = np.abs(rows).sum(axis=1, keepdims=True)
        else:
            divisor = np.sqrt((rows * rows).sum(axis=1, keepdims=True))
        out = np.where(divisor == 0, rows, rows / np.where(divisor == 0, 1, divisor))
        return out.astype(np.float32).reshape(x.shape)


@register("Imputer", since=1, domain=ML)
class Imputer(Kernel):
    def setup(self) -> None:
        floats, ints = self.attr("imputed_value_floats"), self.attr("imputed_value_int64s")
        if (floats is None) == (ints is None):
            self.fail("exactly one of imputed_value_floats and imputed_value_int64s must be set")
        self.imputed = _floats(floats) if floats is not None else _ints(ints)
        self.replaced = self.attr("replaced_value_float", 0.0) if floats is not None else \
            self.attr("replaced_value_int64", 0)

    def run(self, x):
        if x.shape[-1:] != self.imputed.shape and self.imputed.size != 1:
            raise RunFailure(f"{self.imputed.size} imputed values do not match {x.shape[-1]} features")
        if x.dtype.kind == "f" and np.isnan(self.replaced):
            missing = np.isnan(x)
        else:
            missing = x == x.dtype.type(self.replaced)
        return np.where(missing, self.imputed.astype(x.dtype), x)


@register("FeatureVectorizer", since=1, domain=ML)
class FeatureVectorizer(Kernel):
    def setup(self) -> None:
        self.dims = self.attr("inputdimensions")

    def run(self, *inputs):
        parts = []
        for i, x in enumerate(inputs):
            rows = _rows(np.asarray(x)).astype(np.float32)
            want = self.dims[i] if self.dims is not None and i < len(self.dims) else rows.shape[1]
            if rows.shape[1] >= want:
                parts.append(rows[:, :want])
            else:
                parts.append(np.pad(rows, ((0, 0), (0, want - rows.shape[1]))))
        return np.concatenate(parts, axis=1)


@register("OneHotEncoder", since=1, domain=ML)
class OneHotEncoder(Kernel):
    def setup(self) -> None:
        ints, strs = self.attr("cats_int64s"), self.attr("cats_strings")
        if (ints is None) == (strs is None):
            self.fail("exactly one of cats_int64s and cats_strings must be set")
        self.cats = _ints(ints) if ints is not None else _strings(strs)
        self.zeros = bool(self.attr("zeros", 1))

    def run(self, x):
        values = x if self.cats.dtype == object else x.astype(np.int64)
        if (self.cats.dtype == object) != (values.dtype == object):
            raise RunFailure("OneHotEncoder input type does not match its categories (strings vs numbers)")
        hits = values[..., None] == self.cats
        if not self.zeros and not hits.any(axis=-1).all():
            raise RunFailure("OneHotEncoder met a value outside its categories (and zeros=0)")
        return hits.astype(np.float32)


def _lookup(x: np.ndarray, keys: np.ndarray, values: np.ndarray, default: Any, last_wins: bool = True,
            nan_matches: bool = True) -> np.ndarray:
    """Map each element of x through keys -> values (by default the last of repeated keys wins and NaN keys
    match NaN, as LabelEncoder-4 specifies; earlier versions keep the first key and never match NaN)."""
    flat = x.reshape(-1)
    out = np.full(flat.shape, default, dtype=values.dtype)
    if keys.size == 0:
        return out.reshape(x.shape)
    order = slice(None, None, -1 if last_wins else 1)
    uniq, first = np.unique(keys[order], return_index=True)
    mapped = values[order][first]
    pos = np.minimum(np.searchsorted(uniq, flat), uniq.size - 1)
    found = uniq[pos] == flat
    if nan_matches and flat.dtype.kind == "f" and uniq.dtype.kind == "f":
        found |= np.isnan(flat) & np.isnan(uniq[pos])
    out[found] = mapped[pos[found]]
    return out.reshape(x.shape)


@register("LabelEncoder", since=1, domain=ML)
class LabelEncoderV1(Kernel):
    """Opset 1: strings <-> their index in classes_strings."""

    def setup(self) -> None:
        self.classes = _strings(self.attr("classes_strings", []))
        self.default_int = self.attr("default_int64", -1)
        self.default_string = self.attr("default_string", "_Unused")

    def run(self, x):
        if x.dtype == object:
            return _lookup(x, self.classes, np.arange(self.classes.size, dtype=np.int64), self.default_int)
        return _lookup(x.astype(np.int64), np.arange(self.classes.size, dtype=np.int64), self.classes,
                       self.default_string)


@register("LabelEncoder", since=2, domain=ML)
class LabelEncoder(Kernel):
    """Opset 2+: keys_* -> values_*; opset 4 adds keys_tensor/values_tensor/default_tensor."""

    def setup(self) -> None:
        self.keys = self._one_of("keys")
        self.values = self._one_of("values")
        if self.keys.size != self.values.size:
            self.fail(f"keys ({self.keys.size}) and values ({self.values.size}) must have the same length")
        self.default = self._default()

    def _one_of(self, prefix: str) -> np.ndarray:
        given = {kind: self.attr(f"{prefix}_{kind}") for kind in ("floats", "int64s", "strings", "tensor")}
        given = {k: v for k, v in given.items() if v is not None}
        if len(given) != 1:
            self.fail(f"exactly one of {prefix}_* must be set, got {sorted(given) or 'none'}")
        kind, value = given.popitem()
        convert = {"floats": _floats, "int64s": _ints, "strings": _strings, "tensor": lambda v: np.asarray(v)}
        return convert[kind](value).reshape(-1)

    def _default(self) -> Any:
        tensor = self.attr("default_tensor")
        if tensor is not None:
            return np.asarray(tensor).reshape(-1)[0]
        kind = self.values.dtype.kind
        if kind == "O":
            return self.attr("default_string", "_Unused")
        if kind == "f":
            return self.attr("default_float", -0.0)
        return self.attr("default_int64", -1)

    def run(self, x):
        keys = self.keys
        if x.dtype != object and keys.dtype != object and keys.dtype != x.dtype:
            keys = keys.astype(x.dtype)
        # onnxruntime keeps the first of repeated keys at every version (the opset-4 text says the last).
        return _lookup(x, keys, self.values, self.default, last_wins=False, nan_matches=self.version >= 4)


@register("CategoryMapper", since=1, domain=ML)
class CategoryMapper(Kernel):
    def setup(self) -> None:
        self.strings = _strings(self.attr("cats_strings", []))
        self.ints = _ints(self.attr("cats_int64s", []))
        if self.strings.size != self.ints.size:
            self.fail("cats_strings and cats_int64s must have the same length")
        self.default_int = self.attr("default_int64", -1)
        self.default_string = self.attr("default_string", "_Unused")

    def run(self, x):
        if x.dtype == object:
            return _lookup(x, self.strings, self.ints, self.default_int)
        return _lookup(x.astype(np.int64), self.ints, self.strings, self.default_string)


@register("DictVectorizer", since=1, domain=ML)
class DictVectorizer(Kernel):
    def setup(self) -> None:
        strs, ints = self.attr("string_vocabulary"), self.attr("int64_vocabulary")
        if (strs is None) == (ints is None):
            self.fail("exactly one of string_vocabulary and int64_vocabulary must be set")
        self.vocabulary = {k: i for i, k in enumerate(strs if strs is not None else ints)}

    def run(self, mapping):
        values = list(mapping.values())
        dtype = _map_value_dtype(values)
        out = np.zeros((1, len(self.vocabulary)), dtype=dtype)
        for key, value in mapping.items():
            col = self.vocabulary.get(key.decode() if isinstance(key, bytes) else key)
            if col is not None:
                out[0, col] = value
        return out


def _map_value_dtype(values: list) -> np.dtype:
    """The element type of a map's values (Python floats are taken as ONNX float, as maps of float are usual)."""
    if values and isinstance(values[0], np.generic):
        return values[0].dtype
    if values and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        return np.dtype(np.int64)
    if values and isinstance(values[0], str):
        return np.dtype(object)
    return np.dtype(np.float32)


@register("CastMap", since=1, domain=ML)
class CastMap(Kernel):
    def setup(self) -> None:
        self.dense = self.attr("map_form", "DENSE") == "DENSE"
        self.max_map = self.attr("max_map", 1)
        cast_to = self.attr("cast_to", "TO_FLOAT")
        dtypes = {"TO_FLOAT": np.float32, "TO_STRING": object, "TO_INT64": np.int64}
        if cast_to not in dtypes:
            self.fail(f"cast_to must be TO_FLOAT, TO_STRING or TO_INT64, got {cast_to!r}")
        self.dtype = np.dtype(dtypes[cast_to])

    def run(self, mapping):
        keys = sorted(mapping)
        values = [mapping[k] for k in keys]
        if self.dtype == object:
            converted = _strings([v if isinstance(v, str) else str(v) for v in values])
        else:
            converted = np.asarray([float(v) for v in values]).astype(self.dtype) if values else \
                np.zeros(0, self.dtype)
        if self.dense:
            return converted.reshape(1, -1)
        out = np.full((1, self.max_map), "" if self.dtype == object else 0, dtype=self.dtype)
        idx = np.asarray(keys, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.max_map):
            raise RunFailure(f"CastMap keys must lie in [0, {self.max_map}) for SPARSE packing")
        out[0, idx] = converted
        return out


@register("ZipMap", since=1, domain=ML)
class ZipMap(Kernel):
    def setup(self) -> None:
        self.labels = _class_labels(self).tolist()
        if not self.labels:
            self.fail("one of classlabels_int64s and classlabels_strings must be set")

    def run(self, x):
        rows = _rows(x)
        if rows.shape[1] != len(self.labels):
            raise RunFailure(f"ZipMap has {len(self.labels)} labels but the input has {rows.shape[1]} columns")
        return ([dict(zip(self.labels, row)) for row in rows.tolist()],)


# ---------------------------------------------------------------------------------------------------- linear models


@register("LinearRegressor", since=1, domain=ML)
class LinearRegressor(_PostTransform):
    def setup(self) -> None:
        self.read_post_transform()
        targets = self.attr("targets", 1)
        self.coef = _floats(self.attr("coefficients", [])).reshape(targets, -1)
        intercepts = self.attr("intercepts")
        self.intercepts = _floats(intercepts) if intercepts is not None else np.zeros(targets, np.float32)

    def run(self, x):
        scores = _rows(x).astype(np.float32) @ self.coef.T + self.intercepts
        return self.post_transform(scores).astype(np.float32)


def _binary_scores(scores: np.ndarray, transform: str, complement: bool) -> np.ndarray:
    """One-column binary scores -> two columns (negative class, positive class), as onnxruntime writes them:
    LOGISTIC gives (1 - p, p); other transforms leave the score as is, with `complement` choosing whether the
    negative column is 1 - s (LinearClassifier) or -s (tree ensembles)."""
    if transform == "LOGISTIC":
        positive = _POST_TRANSFORMS[transform](scores)
        return np.concatenate([1 - positive, positive], axis=1)
    return np.concatenate([1 - scores if complement else -scores, scores], axis=1)


@register("LinearClassifier", since=1, domain=ML)
class LinearClassifier(_PostTransform):
    def setup(self) -> None:
        self.read_post_transform()
        self.labels = _class_labels(self)
        coef = _floats(self.required_attr("coefficients"))
        intercepts = self.attr("intercepts")
        n_rows = len(intercepts) if intercepts else max(self.labels.size, 1)
        if coef.size % n_rows:
            self.fail(f"{coef.size} coefficients do not split into {n_rows} classes")
        self.coef = coef.reshape(n_rows, -1)
        self.intercepts = _floats(intercepts) if intercepts else np.zeros(n_rows, np.float32)
        self.multi_class = self.attr("multi_class", 0)

    def run(self, x):
        scores = _rows(x).astype(np.float32) @ self.coef.T + self.intercepts
        if scores.shape[1] == 1 and self.labels.size == 2:
            positive = scores[:, 0] > 0
            labels = np.where(positive, self.labels[1], self.labels[0])
            z = _binary_scores(scores, self.post_transform_name, complement=True)
            return labels.astype(self.labels.dtype), z.astype(np.float32)
        if scores.shape[1] == 1 and self.labels.size == 1:
            labels = np.where(scores[:, 0] > 0, self.labels[0], self.labels[0])
            return labels.astype(self.labels.dtype), self.post_transform(scores).astype(np.float32)
        labels = self.labels[np.argmax(scores, axis=1)]
        return labels.astype(self.labels.dtype), self.post_transform(scores).astype(np.float32)


# ---------------------------------------------------------------------------------------------------- SVMs


class _SVMBase(_PostTransform):
    def read_kernel(self) -> None:
        self.read_post_transform()
        self.kernel_type = self.attr("kernel_type", "LINEAR")
        if self.kernel_type not in ("LINEAR", "POLY", "RBF", "SIGMOID"):
            self.fail(f"kernel_type must be LINEAR, POLY, RBF or SIGMOID, got {self.kernel_type!r}")
        params = list(self.attr("kernel_params", [])) + [0.0, 0.0, 0.0]
        self.gamma, self.coef0, self.degree = np.float32(params[0]), np.float32(params[1]), np.float32(params[2])

    def kernel(self, x: np.ndarray, sv: np.ndarray) -> np.ndarray:
        """K(x_i, sv_j) for all rows and support vectors: [N, S]."""
        if self.kernel_type == "RBF":
            sq = (x * x).sum(axis=1, keepdims=True) - 2 * (x @ sv.T) + (sv * sv).sum(axis=1)
            return np.exp(-self.gamma * np.maximum(sq, 0))
        dot = x @ sv.T
        if self.kernel_type == "POLY":
            return np.power(self.gamma * dot + self.coef0, self.degree)
        if self.kernel_type == "SIGMOID":
            return np.tanh(self.gamma * dot + self.coef0)
        return dot


@register("SVMRegressor", since=1, domain=ML)
class SVMRegressor(_SVMBase):
    def setup(self) -> None:
        self.read_kernel()
        self.n_supports = self.attr("n_supports", 0)
        self.one_class = bool(self.attr("one_class", 0))
        self.coef = _floats(self.attr("coefficients", []))
        self.rho = _floats(self.attr("rho", [0.0]))
        sv = _floats(self.attr("support_vectors", []))
        self.sv = sv.reshape(self.n_supports, -1) if self.n_supports else sv

    def run(self, x):
        rows = _rows(x).astype(np.float32)
        if self.n_supports:
            scores = self.kernel(rows, self.sv) @ self.coef + self.rho[0]
        else:
            scores = rows @ self.coef + self.rho[0]
        scores = scores.reshape(-1, 1).astype(np.float32)
        if self.one_class:
            return np.where(scores > 0, np.float32(1), np.float32(-1))
        return self.post_transform(scores).astype(np.float32)


def _sigmoid_prob(decision: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Platt scaling, as libsvm: 1 / (1 + exp(a * f + b)), computed without overflow."""
    z = decision * a + b
    return np.where(z >= 0, np.exp(-np.abs(z)) / (1 + np.exp(-np.abs(z))), 1 / (1 + np.exp(-np.abs(z))))


def _couple_probabilities(pairwise: np.ndarray, k: int) -> np.ndarray:
    """Multi-class probabilities from pairwise ones (Wu, Lin & Weng 2004, method 2, as libsvm), batched over rows."""
    n = pairwise.shape[0]
    r = np.zeros((n, k, k))
    iu, ju = np.triu_indices(k, 1)
    clipped = np.clip(pairwise, 1e-7, 1 - 1e-7)
    r[:, iu, ju] = clipped
    r[:, ju, iu] = 1 - clipped
    q = -r.transpose(0, 2, 1) * r  # Q[t, j] = -r[j, t] * r[t, j]
    diag = (r.transpose(0, 2, 1) ** 2).sum(axis=2) - np.einsum("nii->ni", r.transpose(0, 2, 1) ** 2)
    idx = np.arange(k)
    q[:, idx, idx] = diag
    p = np.full((n, k), 1.0 / k)
    rows = np.arange(n)
    for _ in range(max(100, k)):
        qp = np.einsum("ntj,nj->nt", q[rows], p[rows])
        pqp = (p[rows] * qp).sum(axis=1, keepdims=True)
        unconverged = np.abs(qp - pqp).max(axis=1) >= 0.005 / k  # each row stops on its own, as libsvm's loop
        rows, qp, pqp = rows[unconverged], qp[unconverged], pqp[unconverged]
        if not rows.size:
            break
        p = _couple_sweep(p, q, rows, qp, pqp, k)
    return p


def _couple_sweep(p: np.ndarray, q: np.ndarray, rows: np.ndarray, qp: np.ndarray, pqp: np.ndarray,
                  k: int) -> np.ndarray:
    """One libsvm coordinate sweep over the classes for the given rows."""
    p = p.copy()
    sub, qs = p[rows], q[rows]
    for t in range(k):
        diff = (-qp[:, t] + pqp[:, 0]) / qs[:, t, t]
        sub[:, t] += diff
        scale = 1 + diff
        pqp = ((pqp[:, 0] + diff * (diff * qs[:, t, t] + 2 * qp[:, t])) / scale / scale)[:, None]
        qp = (qp + diff[:, None] * qs[:, t, :]) / scale[:, None]
        sub /= scale[:, None]
    p[rows] = sub
    return p


@register("SVMClassifier", since=1, domain=ML)
class SVMClassifier(_SVMBase):
    def setup(self) -> None:
        self.read_kernel()
        self.labels = _class_labels(self)
        self.per_class = _ints(self.attr("vectors_per_class", []))
        self.coef = _floats(self.attr("coefficients", []))
        self.rho = _floats(self.attr("rho", []))
        self.prob_a = _floats(self.attr("prob_a", []))
        self.prob_b = _floats(self.attr("prob_b", []))
        sv = _floats(self.attr("support_vectors", []))
        n_sv = int(self.per_class.sum())
        self.sv = sv.reshape(n_sv, -1) if n_sv else sv
        self.n_classes = self.labels.size
        if n_sv:
            self.coef = self.coef.reshape(self.n_classes - 1, n_sv)
        else:
            self.coef = self.coef.reshape(self.n_classes if self.n_classes > 2 else 1, -1)

    def run(self, x):
        rows = _rows(x).astype(np.float32)
        if not self.per_class.size or not self.per_class.sum():
            return self._linear(rows)
        k = self.n_classes
        kern = self.kernel(rows, self.sv)
        starts = np.concatenate([[0], np.cumsum(self.per_class)])
        decisions, votes = [], np.zeros((rows.shape[0], k), dtype=np.int64)
        for p, (i, j) in enumerate(zip(*np.triu_indices(k, 1))):
            si, sj = slice(starts[i], starts[i + 1]), slice(starts[j], starts[j + 1])
            d = kern[:, si] @ self.coef[j - 1, si] + kern[:, sj] @ self.coef[i, sj] + self.rho[p]
            decisions.append(d)
            votes[:, i] += d > 0
            votes[:, j] += d <= 0
        decision = np.stack(decisions, axis=1).astype(np.float32)
        if self.prob_a.size:
            pairwise = _sigmoid_prob(decision.astype(np.float64), self.prob_a, self.prob_b)
            probs = _couple_probabilities(pairwise, k).astype(np.float32)
            scores = self.post_transform(probs).astype(np.float32)  # onnxruntime transforms the probabilities too
            if k == 2:  # libsvm: the decision picks the label, even where the probabilities favour the other class
                return self._binary_labels(decision), scores
            return self.labels[np.argmax(votes, axis=1)], scores  # the votes too, as onnxruntime decides
        if k == 2:
            return self._binary_labels(decision), self._binary_decision_scores(decision[:, 0])
        labels = self.labels[np.argmax(votes, axis=1)]
        return labels, self.post_transform(decision).astype(np.float32)

    def _binary_decision_scores(self, d: np.ndarray) -> np.ndarray:
        """Two columns from a two-class SVC's one decision d, as onnxruntime writes them: (-d, d) without a
        post_transform, (1 - sigmoid(d), sigmoid(d)) under LOGISTIC, (probit(d), 0) under PROBIT (it writes the
        first column only), and (1 - d, d) under the softmaxes, which a single score leaves untransformed."""
        if self.post_transform_name == "NONE":
            pair = (-d, d)
        elif self.post_transform_name == "LOGISTIC":
            positive = _POST_TRANSFORMS["LOGISTIC"](d)
            pair = (1 - positive, positive)
        elif self.post_transform_name == "PROBIT":
            pair = (_POST_TRANSFORMS["PROBIT"](d), np.zeros_like(d))
        else:
            pair = (1 - d, d)
        return np.stack(pair, axis=1).astype(np.float32)

    def _binary_labels(self, decision: np.ndarray) -> np.ndarray:
        """libsvm's sign convention: a positive decision votes for the first class."""
        return np.where(decision[:, 0] > 0, self.labels[0], self.labels[1]).astype(self.labels.dtype)

    def _linear(self, rows: np.ndarray) -> tuple:
        scores = rows @ self.coef.T + self.rho[: self.coef.shape[0]]
        if self.n_classes == 2 and scores.shape[1] == 1:
            labels = np.where(scores[:, 0] > 0, self.labels[1], self.labels[0]).astype(self.labels.dtype)
            return labels, _binary_scores(scores, self.post_transform_name, complement=False).astype(np.float32)
        return self.labels[np.argmax(scores, axis=1)], self.post_transform(scores).astype(np.float32)


# ---------------------------------------------------------------------------------------------------- trees

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER, _LEAF = range(8)
_MODE_CODES = {"BRANCH_LEQ": _LEQ, "BRANCH_LT": _LT, "BRANCH_GTE": _GTE, "BRANCH_GT": _GT, "BRANCH_EQ": _EQ,
               "BRANCH_NEQ": _NEQ, "BRANCH_MEMBER": _MEMBER, "LEAF": _LEAF}


class _Forest:
    """Flat arrays of interior nodes; children are node indices, or ~leaf (negative) for leaves.

    Leaf i votes `vote_weights[vote_start[i]:vote_start[i+1]]` for targets `vote_targets[...]`.
    """

    def __init__(self, roots, features, modes, splits, true_child, false_child, nan_true, members, vote_start,
                 vote_targets, vote_weights):
        self.roots = np.asarray(roots, np.int64)
        self.features = np.asarray(features, np.int64)
        self.modes = np.asarray(modes, np.int64)
        self.splits = splits
        self.true_child = np.asarray(true_child, np.int64)
        self.false_child = np.asarray(false_child, np.int64)
        self.nan_true = np.asarray(nan_true, bool)
        self.vote_start = np.asarray(vote_start, np.int64)
        self.vote_targets = np.asarray(vote_targets, np.int64)
        self.vote_weights = vote_weights
        # membership sets, padded with NaN: row m holds the set of the m-th BRANCH_MEMBER node
        self.member_row = np.full(len(self.modes), -1, np.int64)
        member_nodes = np.flatnonzero(self.modes == _MEMBER)
        self.member_row[member_nodes] = np.arange(member_nodes.size)
        width = max((len(m) for m in members), default=0)
        self.member_sets = np.full((len(members), max(width, 1)), np.nan)
        for m, values in enumerate(members):
            self.member_sets[m, :len(values)] = values

    def leaves(self, x: np.ndarray) -> np.ndarray:
        """The leaf each (row, tree) pair ends in: [N, n_trees]."""
        n, t = x.shape[0], self.roots.size
        rows = np.repeat(np.arange(n), t)
        node = np.tile(self.roots, n)
        for _ in range(len(self.modes) + 1):
            active = np.flatnonzero(node >= 0)
            if not active.size:
                break
            nid = node[active]
            node[active] = np.where(self._goes_true(x[rows[active], self.features[nid]], nid),
                                    self.true_child[nid], self.false_child[nid])
        if (node >= 0).any():
            raise RunFailure("tree ensemble has a cycle: a path never reaches a leaf")
        return (~node).reshape(n, t)

    def _goes_true(self, v: np.ndarray, nid: np.ndarray) -> np.ndarray:
        s = self.splits[nid]
        mode = self.modes[nid]
        cond = np.select([mode == _LEQ, mode == _LT, mode == _GTE, mode == _GT, mode == _EQ, mode == _NEQ],
                         [v <= s, v < s, v >= s, v > s, v == s, v != s], False)
        member = mode == _MEMBER
        if member.any():
            sets = self.member_sets[self.member_row[nid[member]]]
            cond[member] = (sets == v[member, None].astype(np.float64)).any(axis=1)
        # NaN takes the true branch where the node says so; otherwise the comparison decides (NaN != s holds)
        return cond | (np.isnan(v) & self.nan_true[nid])

    def aggregate(self, x: np.ndarray, n_targets: int, how: str, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """Per row and target: the aggregated leaf votes, and whether any vote reached it."""
        leaf = self.leaves(x)
        n = x.shape[0]
        counts = self.vote_start[leaf + 1] - self.vote_start[leaf]
        row_of = np.repeat(np.repeat(np.arange(n), self.roots.size), counts.reshape(-1))
        starts = np.repeat(self.vote_start[leaf].reshape(-1), counts.reshape(-1))
        vote = starts + np.arange(starts.size) - np.repeat(np.cumsum(counts.reshape(-1)) - counts.reshape(-1),
                                                           counts.reshape(-1))
        where = (row_of, self.vote_targets[vote])
        weights = self.vote_weights[vote].astype(dtype)
        voted = np.zeros((n, n_targets), bool)
        voted[where] = True
        if how in ("SUM", "AVERAGE"):
            out = np.zeros((n, n_targets), dtype)
            np.add.at(out, where, weights)
            if how == "AVERAGE":
                out = out / dtype.type(self.roots.size)
        elif how == "MIN":
            out = np.full((n, n_targets), np.inf, dtype)
            np.minimum.at(out, where, weights)
        else:
            out = np.full((n, n_targets), -np.inf, dtype)
            np.maximum.at(out, where, weights)
        return np.where(voted, out, dtype.type(0)).astype(dtype), voted


def _tensor_or_list(kernel: Kernel, name: str, dtype=np.float32) -> np.ndarray | None:
    as_tensor = kernel.attr(f"{name}_as_tensor")
    if as_tensor is not None:
        return np.asarray(as_tensor).reshape(-1)
    value = kernel.attr(name)
    return None if value is None else np.asarray(value, dtype=dtype)


def _legacy_forest(kernel: Kernel, prefix: str) -> tuple[_Forest, int]:
    """Build a _Forest from TreeEnsembleRegressor/Classifier attributes (nodes keyed by tree id and node id)."""
    tree_ids = _ints(kernel.required_attr("nodes_treeids"))
    node_ids = _ints(kernel.required_attr("nodes_nodeids"))
    features = _ints(kernel.attr("nodes_featureids", [0] * len(tree_ids)))
    modes = np.asarray([_MODE_CODES.get(m, -1) for m in kernel.required_attr("nodes_modes")], np.int64)
    if (modes < 0).any():
        kernel.fail(f"unknown nodes_modes value; expected one of {', '.join(_MODE_CODES)}")
    values = _tensor_or_list(kernel, "nodes_values")
    values = np.zeros(len(tree_ids), np.float32) if values is None else values
    true_ids = _ints(kernel.attr("nodes_truenodeids", [0] * len(tree_ids)))
    false_ids = _ints(kernel.attr("nodes_falsenodeids", [0] * len(tree_ids)))
    nan_true = _ints(kernel.attr("nodes_missing_value_tracks_true", [0] * len(tree_ids)))
    position = {(t, n): i for i, (t, n) in enumerate(zip(tree_ids.tolist(), node_ids.tolist()))}
    is_leaf = modes == _LEAF
    leaf_number = np.cumsum(is_leaf) - 1  # leaf index of each LEAF node

    def child(tree: int, nid: int) -> int:
        i = position.get((tree, nid))
        if i is None:
            kernel.fail(f"tree {tree} refers to node {nid}, which it does not define")
        return ~int(leaf_number[i]) if is_leaf[i] else i

    vote_trees = _ints(kernel.attr(f"{prefix}_treeids", []))
    vote_nodes = _ints(kernel.attr(f"{prefix}_nodeids", []))
    vote_targets = _ints(kernel.attr(f"{prefix}_ids", []))
    vote_weights = _tensor_or_list(kernel, f"{prefix}_weights")
    vote_weights = np.zeros(0, np.float32) if vote_weights is None else vote_weights
    vote_pos = np.asarray([position.get((t, n), -1) for t, n in zip(vote_trees.tolist(), vote_nodes.tolist())],
                          np.int64)
    if (vote_pos < 0).any() or not is_leaf[vote_pos].all():
        kernel.fail(f"{prefix}_treeids/{prefix}_nodeids name nodes that are not leaves")
    vote_leaf = leaf_number[vote_pos]
    order = np.argsort(vote_leaf, kind="stable")
    n_leaves = int(is_leaf.sum())
    vote_start = np.searchsorted(vote_leaf[order], np.arange(n_leaves + 1))
    # Interior nodes keep their positions; leaves are referenced via ~leaf; the root of each tree is node id 0
    # (or the tree's first node). A tree that is a single leaf gets a dummy interior node pointing at it.
    trees = list(dict.fromkeys(tree_ids.tolist()))
    roots, extra = [], []
    for tree in trees:
        i = position.get((tree, 0), int(np.flatnonzero(tree_ids == tree)[0]))
        if is_leaf[i]:
            extra.append(~int(leaf_number[i]))
            roots.append(len(tree_ids) + len(extra) - 1)
        else:
            roots.append(i)
    true_child = [child(t, n) if not leaf else 0 for t, n, leaf in zip(tree_ids.tolist(), true_ids.tolist(), is_leaf)]
    false_child = [child(t, n) if not leaf else 0 for t, n, leaf in
                   zip(tree_ids.tolist(), false_ids.tolist(), is_leaf)]
    dummy = len(extra)
    forest = _Forest(
        roots, np.concatenate([features, np.zeros(dummy, np.int64)]),
        np.concatenate([np.where(is_leaf, _EQ, modes), np.full(dummy, _EQ)]),
        np.concatenate([values, np.zeros(dummy, values.dtype)]),
        true_child + extra, false_child + extra,
        np.concatenate([nan_true, np.zeros(dummy, np.int64)]), [], vote_start,
        vote_targets[order], vote_weights[order])
    return forest, len(trees)


@register("TreeEnsembleRegressor", since=1, domain=ML)
class TreeEnsembleRegressor(_PostTransform):
    def setup(self) -> None:
        self.read_post_transform()
        self.forest, _ = _legacy_forest(self, "target")
        self.n_targets = self.attr("n_targets", 1)
        self.aggregate = self.attr("aggregate_function", "SUM")
        if self.aggregate not in ("SUM", "AVERAGE", "MIN", "MAX"):
            self.fail(f"aggregate_function must be SUM, AVERAGE, MIN or MAX, got {self.aggregate!r}")
        base = _tensor_or_list(self, "base_values")
        self.base = np.zeros(self.n_targets, np.float32) if base is None or not base.size else base

    def run(self, x):
        rows = _rows(x)
        scores, voted = self.forest.aggregate(rows, self.n_targets, self.aggregate, np.dtype(np.float64))
        scores = np.where(voted, scores + self.base, 0)  # onnxruntime: targets no leaf voted for stay 0
        return self.post_transform(scores.astype(np.float32)).astype(np.float32)


@register("TreeEnsembleClassifier", since=1, domain=ML)
class TreeEnsembleClassifier(_PostTransform):
    def setup(self) -> None:
        self.read_post_transform()
        self.forest, _ = _legacy_forest(self, "class")
        self.labels = _class_labels(self)
        if not self.labels.size:
            self.fail("one of classlabels_int64s and classlabels_strings must be set")
        base = _tensor_or_list(self, "base_values")
        self.base = np.zeros(0, np.float32) if base is None else base
        class_ids = _ints(self.attr("class_ids", []))
        weights = self.forest.vote_weights
        # onnxruntime's binary conventions: one class carrying every leaf weight makes the ensemble a single score
        # (a probability when no weight is negative, a margin otherwise), whatever class id the weights name
        self.single_score = self.labels.size == 2 and np.unique(class_ids).size == 1
        self.all_positive = bool((weights >= 0).all())

    def run(self, x):
        rows = _rows(x)
        k = self.labels.size
        scores, voted = self.forest.aggregate(rows, k, "SUM", np.dtype(np.float64))
        if k == 2:
            return self._binary(scores, voted)
        if self.base.size == k:
            scores = scores + self.base
        labels = self.labels[np.argmax(scores, axis=1)]
        z = self.post_transform(scores.astype(np.float32)).astype(np.float32)
        return labels.astype(self.labels.dtype), z

    def _binary(self, scores: np.ndarray, voted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Two classes as onnxruntime scores them. The positive score is class 1's sum where a leaf voted for
        class 1, else class 0's. Two base_values make it base[1] + class 0's sum (the negative score its
        opposite) where class 1 was voted for, else add base[0] to class 0's sum alone. A row with no class-1
        vote (and fewer than two base values) is a one-column score s written as two columns: (1 - s, s) for a
        probability, (-s, s) for a margin, (sigmoid(-s), sigmoid(s)) under LOGISTIC."""
        s0, s1 = scores[:, 0], scores[:, 1]
        has0, has1 = voted[:, 0], voted[:, 1]
        one_column = ~has1
        if self.base.size == 2:
            s1 = np.where(has1, self.base[1] + s0, s1)
            s0 = np.where(has1, -s1, s0 + self.base[0])
            one_column = np.zeros_like(has1)
        elif self.base.size == 1:
            s0 = s0 + self.base[0]
        elif self.base.size:
            one_column = np.zeros_like(has1)
        positive = np.where(has1, s1, np.where(has0, s0, 0))
        threshold = 0.5 if self.single_score and self.all_positive else 0.0
        labels = np.where(positive > threshold, self.labels[1], self.labels[0]).astype(self.labels.dtype)
        z = self.post_transform(np.stack([s0, s1], axis=1).astype(np.float32)).astype(np.float32)
        if one_column.any():
            z[one_column] = self._one_column(s0[one_column].astype(np.float32))
        return labels, z

    def _one_column(self, s: np.ndarray) -> np.ndarray:
        zeros = np.zeros_like(s)
        if self.post_transform_name == "PROBIT":
            # onnxruntime writes only the first column here; the second is left 0
            return np.stack([self.post_transform(s), zeros], axis=1)
        if not self.single_score and self.base.size == 1:
            return np.stack([s, zeros], axis=1)
        if self.post_transform_name == "LOGISTIC":
            positive = _POST_TRANSFORMS["LOGISTIC"](s)
            return np.stack([1 - positive, positive], axis=1)
        if self.single_score and self.all_positive:
            return np.stack([1 - s, s], axis=1)
        return np.stack([-s, s], axis=1)


@register("TreeEnsemble", since=5, domain=ML)
class TreeEnsemble(_PostTransform):
    def setup(self) -> None:
        self.read_post_transform()
        modes = np.asarray(self.required_attr("nodes_modes")).reshape(-1).astype(np.int64)
        splits = np.asarray(self.required_attr("nodes_splits")).reshape(-1)
        true_leaf = _ints(self.required_attr("nodes_trueleafs")).astype(bool)
        false_leaf = _ints(self.required_attr("nodes_falseleafs")).astype(bool)
        true_ids = _ints(self.required_attr("nodes_truenodeids"))
        false_ids = _ints(self.required_attr("nodes_falsenodeids"))
        nan_true = _ints(self.attr("nodes_missing_value_tracks_true", [0] * modes.size))
        members = self._membership_sets(modes)
        weights = np.asarray(self.required_attr("leaf_weights")).reshape(-1)
        targets = _ints(self.required_attr("leaf_targetids"))
        self.dtype = weights.dtype
        self.forest = _Forest(
            self.required_attr("tree_roots"), _ints(self.required_attr("nodes_featureids")), modes, splits,
            np.where(true_leaf, ~true_ids, true_ids), np.where(false_leaf, ~false_ids, false_ids), nan_true,
            members, np.arange(targets.size + 1), targets, weights)
        self.n_targets = self.attr("n_targets", int(targets.max()) + 1 if targets.size else 1)
        codes = ["AVERAGE", "SUM", "MIN", "MAX"]
        agg = self.attr("aggregate_function", 1)
        if not 0 <= agg < 4:
            self.fail(f"aggregate_function must be 0..3 (AVERAGE, SUM, MIN, MAX), got {agg}")
        self.aggregate = codes[agg]

    def _membership_sets(self, modes: np.ndarray) -> list[np.ndarray]:
        n_member = int((modes == _MEMBER).sum())
        if not n_member:
            return []
        values = np.asarray(self.required_attr("membership_values")).reshape(-1).astype(np.float64)
        ends = np.flatnonzero(np.isnan(values))
        bounds = np.concatenate([[-1], ends])
        sets = [values[bounds[i] + 1:bounds[i + 1]] for i in range(len(ends))]
        if len(ends) < n_member or values.size and not np.isnan(values[-1]):
            sets.append(values[bounds[-1] + 1:])
        if len(sets) < n_member:
            self.fail(f"membership_values holds {len(sets)} sets for {n_member} BRANCH_MEMBER nodes")
        return sets[:n_member]

    def run(self, x):
        rows = _rows(x)
        scores, _ = self.forest.aggregate(rows, self.n_targets, self.aggregate, np.dtype(x.dtype))
        return self.post_transform(scores).astype(x.dtype)
