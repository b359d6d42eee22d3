"""Indexing kernels: Gather*, Scatter*, OneHot, NonZero, TopK, Unique, Compress, CumSum, CumProd, ReverseSequence."""

from __future__ import annotations

import numpy as np

from carrack.ops.registry import Kernel, register
from carrack.ops.shape_ops import int_list, normalize_axis


def checked_indices(indices: np.ndarray, dim, what: str = "index") -> np.ndarray:
    """Indices (negative ones counted from the back) as int64 in [0, dim); IndexError names any outside that."""
    idx = np.asarray(indices).astype(np.int64, copy=False)
    dim = np.asarray(dim, dtype=np.int64)
    bad = (idx < -dim) | (idx >= dim)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        limit = int(np.broadcast_to(dim, idx.shape)[first])
        raise IndexError(f"{what} {int(idx[first])} at position {list(first)} is out of range for a dimension of "
                         f"{limit}")
    return np.where(idx < 0, idx + dim, idx)


def _axis_attr(kernel: Kernel, default: int = 0) -> int:
    return int(kernel.attr("axis", default))


@register("Gather", since=1)
class Gather(Kernel):
    def setup(self):
        self.axis = _axis_attr(self)

    def run(self, data, indices):
        axis = normalize_axis(self.axis, data.ndim)
        out = None
        if type(indices) is np.ndarray and indices.dtype.kind == "i":
            try:  # numpy's take accepts exactly ONNX's range [-dim, dim); outside it, the error below names the index
                out = np.take(data, indices, axis=axis)
            except IndexError:
                pass
        if out is None:
            out = np.take(data, checked_indices(indices, data.shape[axis]), axis=axis)
        # one element taken from an object (string) array comes back as the bare Python object
        return out if isinstance(out, np.ndarray) else np.array(out, dtype=data.dtype)

    def bind_into(self, out, data, indices):
        """numpy's take into `out` for these very arrays (new index values every call: one outside ONNX's range
        raises the error `run` raises)."""
        if not (type(data) is np.ndarray and type(indices) is np.ndarray and type(out) is np.ndarray
                and indices.dtype.kind == "i" and data.dtype.kind != "O" and out.dtype == data.dtype and data.ndim):
            return None
        axis = normalize_axis(self.axis, data.ndim)
        if not (out.shape == data.shape[:axis] + indices.shape + data.shape[axis + 1:] and out.flags.writeable
                and not np.may_share_memory(out, data) and not np.may_share_memory(out, indices)):
            return None

        def gather() -> None:
            try:
                np.take(data, indices, axis=axis, out=out)
            except IndexError:
                np.take(data, checked_indices(indices, data.shape[axis]), axis=axis, out=out)
        return gather


@register("GatherElements", since=11)
class GatherElements(Kernel):
    def setup(self):
        self.axis = _axis_attr(self)

    def run(self, data, indices):
        if indices.ndim != data.ndim:
            raise ValueError(f"GatherElements indices rank {indices.ndim} differs from data rank {data.ndim}")
        axis = normalize_axis(self.axis, data.ndim)
        idx = checked_indices(indices, data.shape[axis])
        if any(i > d for a, (i, d) in enumerate(zip(idx.shape, data.shape)) if a != axis):
            raise ValueError(f"GatherElements indices shape {list(idx.shape)} exceeds data shape {list(data.shape)}")
        window = tuple(slice(None) if a == axis else slice(0, n) for a, n in enumerate(idx.shape))
        return np.take_along_axis(data[window], idx, axis=axis)


def nd_index(data_shape: tuple[int, ...], indices: np.ndarray, batch_dims: int) -> tuple[np.ndarray, ...]:
    """GatherND/ScatterND index arrays into data reshaped to (batch, *rest): one array per indexed axis."""
    k = indices.shape[-1]
    if k > len(data_shape) - batch_dims:
        raise ValueError(f"indices address {k} axes but data of shape {list(data_shape)} has only "
                         f"{len(data_shape) - batch_dims} after {batch_dims} batch dims")
    if indices.shape[:batch_dims] != data_shape[:batch_dims]:
        raise ValueError(f"indices batch dims {list(indices.shape[:batch_dims])} differ from data's "
                         f"{list(data_shape[:batch_dims])}")
    n_batch = int(np.prod(data_shape[:batch_dims], dtype=np.int64))
    idx = checked_indices(indices, np.array(data_shape[batch_dims:batch_dims + k], dtype=np.int64))
    per_batch = int(np.prod(indices.shape[batch_dims:-1], dtype=np.int64))
    idx = idx.reshape(n_batch, per_batch, k)
    batch = np.broadcast_to(np.arange(n_batch).reshape(n_batch, 1), (n_batch, per_batch))
    return (batch, *(idx[..., j] for j in range(k)))


@register("GatherND", since=11)
class GatherND(Kernel):
    def setup(self):
        self.batch_dims = self.attr("batch_dims", 0)

    def run(self, data, indices):
        b = self.batch_dims
        if indices.ndim < 1 or indices.ndim <= b:
            raise ValueError(f"GatherND indices of shape {list(indices.shape)} need rank > batch_dims={b}")
        k = indices.shape[-1]
        if b == 0 and 0 < k <= data.ndim and type(indices) is np.ndarray and indices.dtype.kind == "i":
            try:  # numpy's fancy indexing takes exactly ONNX's range [-dim, dim); outside it, nd_index names it
                return np.asarray(data[tuple(indices[..., j] for j in range(k))])  # (a 0-d result too)
            except IndexError:
                pass
        index = nd_index(data.shape, indices, b)
        flat = data.reshape(len(index[0]), *data.shape[b:])
        k = indices.shape[-1]
        return flat[index].reshape(indices.shape[:-1] + data.shape[b + k:])


_REDUCE_AT = {"add": np.add.at, "mul": np.multiply.at, "max": np.maximum.at, "min": np.minimum.at}


def _reduction(kernel: Kernel) -> str:
    reduction = kernel.attr("reduction", "none")
    if reduction not in ("none", *_REDUCE_AT):
        kernel.fail(f"reduction '{reduction}' is not one of none, add, mul, max, min")
    return reduction


def scatter_into(data: np.ndarray, index: tuple, updates: np.ndarray, reduction: str) -> np.ndarray:
    out = data.copy()
    if reduction == "none":
        out[index] = updates
    else:
        _REDUCE_AT[reduction](out, index, updates)
    return out


@register("ScatterElements", since=11)
class ScatterElements(Kernel):
    def setup(self):
        self.axis = _axis_attr(self)
        self.reduction = _reduction(self)

    def run(self, data, indices, updates):
        if not data.ndim == indices.ndim == updates.ndim or indices.shape != updates.shape:
            raise ValueError(f"ScatterElements needs indices {list(indices.shape)} and updates "
                             f"{list(updates.shape)} of one shape and of data's rank {data.ndim}")
        axis = normalize_axis(self.axis, data.ndim)
        if any(i > d for a, (i, d) in enumerate(zip(indices.shape, data.shape)) if a != axis):
            raise ValueError(f"ScatterElements indices shape {list(indices.shape)} exceeds data shape "
                             f"{list(data.shape)}")
        idx = checked_indices(indices, data.shape[axis])
        index = list(np.indices(idx.shape, sparse=True))
        index[axis] = idx
        return scatter_into(data, tuple(index), updates, self.reduction)


@register("Scatter", since=9)
class Scatter(ScatterElements):
    """Deprecated alias of ScatterElements without reduction."""


@register("ScatterND", since=11)
class ScatterND(Kernel):
    def setup(self):
        self.reduction = _reduction(self)

    def run(self, data, indices, updates):
        k = indices.shape[-1] if indices.ndim else 0
        expected = (*indices.shape[:-1], *data.shape[k:])
        if indices.ndim < 1 or updates.shape != expected:
            raise ValueError(f"ScatterND updates shape {list(updates.shape)} should be {list(expected)}")
        index = nd_index(data.shape, indices, 0)[1:]
        flat_updates = updates.reshape(-1, *data.shape[k:])
        return scatter_into(data, tuple(i[0] for i in index), flat_updates, self.reduction)


@register("TensorScatter", since=24)
class TensorScatter(Kernel):
    def setup(self):
        self.axis = self.attr("axis", -2)
        self.mode = self.attr("mode", "linear")
        if self.mode not in ("linear", "circular"):
            self.fail(f"mode '{self.mode}' must be linear or circular")

    def run(self, past_cache, update, write_indices=None):
        axis = normalize_axis(self.axis, past_cache.ndim)
        if axis == 0:
            raise ValueError("TensorScatter axis cannot be the batch axis 0")
        expected = past_cache.shape[:axis] + past_cache.shape[axis + 1:]
        if update.ndim != past_cache.ndim or update.shape[:axis] + update.shape[axis + 1:] != expected:
            raise ValueError(f"TensorScatter update shape {list(update.shape)} does not match cache shape "
                             f"{list(past_cache.shape)} outside axis {axis}")
        batch, max_len, length = past_cache.shape[0], past_cache.shape[axis], update.shape[axis]
        starts = np.zeros(batch, np.int64) if write_indices is None else write_indices.astype(np.int64).reshape(-1)
        positions = starts[:, None] + np.arange(length)[None, :]
        if self.mode == "circular":
            positions %= max_len
        elif (positions < 0).any() or (positions >= max_len).any():
            raise IndexError(f"TensorScatter writes at {starts.tolist()} + {length} exceed max length {max_len}")
        shape = [1] * past_cache.ndim
        shape[0], shape[axis] = batch, length
        index = np.broadcast_to(positions.reshape(shape), update.shape)
        out = past_cache.copy()
        np.put_along_axis(out, index, update, axis=axis)
        return out


@register("OneHot", since=9)
class OneHot(Kernel):
    def setup(self):
        self.axis = _axis_attr(self, -1)

    def run(self, indices, depth, values):
        depth = int(np.asarray(depth).reshape(-1)[0])
        if depth < 1:
            raise ValueError(f"OneHot depth must be positive, got {depth}")
        off, on = np.asarray(values).reshape(-1)[:2]
        axis = normalize_axis(self.axis, indices.ndim + 1)
        self.check_output([*indices.shape[:axis], depth, *indices.shape[axis:]], values.dtype)
        idx = np.asarray(indices).astype(np.int64)
        idx = np.where(idx < 0, idx + depth, idx)
        classes = np.arange(depth).reshape([depth] + [1] * (indices.ndim - axis))
        hot = np.expand_dims(idx, axis) == classes
        return np.where(hot, on, off).astype(values.dtype, copy=False)


@register("NonZero", since=9)
class NonZero(Kernel):
    def run(self, x):
        if x.ndim == 0:  # onnxruntime treats a scalar as a 1-element vector
            return np.zeros((1, int(bool(x))), dtype=np.int64)
        self.check_output([x.ndim, np.count_nonzero(x)], np.int64)
        return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


def top_k_order(x: np.ndarray, k: int, axis: int, largest: bool) -> np.ndarray:
    """Indices of the k largest/smallest along axis, ties broken by the smaller index. NaN ranks above every number
    (numpy's sort order; onnxruntime does the same from 1.32 on)."""
    if x.dtype.kind == "V":  # ml_dtypes (bfloat16, float8, int4): numpy sorts them by float32 value only when upcast
        x = x.astype(np.float32)
    if not largest:
        return np.argsort(x, axis=axis, kind="stable").take(np.arange(k), axis=axis)
    n = x.shape[axis]
    # a stable ascending sort of the reversed axis, read backwards, is descending with ties in index order
    ascending = np.argsort(np.flip(x, axis=axis), axis=axis, kind="stable")
    descending = np.flip(ascending, axis=axis).take(np.arange(k), axis=axis)
    return (n - 1) - descending


@register("TopK", since=1)
class TopK(Kernel):
    def setup(self):
        self.axis = _axis_attr(self, -1)
        self.largest = bool(self.attr("largest", 1))
        if self.version < 10:
            self.k = self.required_attr("k")

    def run(self, x, k=None):
        k = self.k if self.version < 10 else int_list(k)[0]
        axis = normalize_axis(self.axis, x.ndim)
        if not 0 <= k <= x.shape[axis]:
            raise ValueError(f"TopK k={k} is outside [0, {x.shape[axis]}] for axis {axis} of {list(x.shape)}")
        self.check_output([k if a == axis else d for a, d in enumerate(x.shape)], x.dtype)
        order = top_k_order(x, k, axis, self.largest)
        return np.take_along_axis(x, order, axis=axis), order.astype(np.int64, copy=False)


@register("Unique", since=11)
class Unique(Kernel):
    def setup(self):
        self.axis = self.attr("axis")
        self.sorted = bool(self.attr("sorted", 1))

    def run(self, x):
        axis = None if self.axis is None else normalize_axis(self.axis, x.ndim)
        values, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True,
                                                   axis=axis)
        inverse = inverse.reshape(-1)
        if not self.sorted:
            order = np.argsort(first, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(order.size)
            values = values[order] if axis is None else np.take(values, order, axis=axis)
            first, counts, inverse = first[order], counts[order], rank[inverse]
        return values, *(a.astype(np.int64, copy=False) for a in (first, inverse, counts))


@register("Compress", since=9)
class Compress(Kernel):
    def setup(self):
        self.axis = self.attr("axis")

    def run(self, x, condition):
        data = x.reshape(-1) if self.axis is None else x
        axis = 0 if self.axis is None else normalize_axis(self.axis, x.ndim)
        keep = np.asarray(condition).astype(bool).reshape(-1)
        if keep.size > data.shape[axis]:
            if keep[data.shape[axis]:].any():
                raise IndexError(f"Compress condition selects index beyond the axis length {data.shape[axis]}")
            keep = keep[:data.shape[axis]]
        return np.compress(keep, data, axis=axis)


class _Cumulative(Kernel):
    """CumSum / CumProd: inclusive or exclusive, forward or reverse scans."""

    scan = staticmethod(np.cumsum)
    identity = 0

    def setup(self):
        self.exclusive = bool(self.attr("exclusive", 0))
        self.reverse = bool(self.attr("reverse", 0))

    def run(self, x, axis):
        axis = normalize_axis(int_list(axis)[0], x.ndim)
        data = np.flip(x, axis) if self.reverse else x
        if self.exclusive:
            head = np.full_like(data.take([0], axis=axis) if data.shape[axis] else data, self.identity)
            data = np.concatenate([head, data.take(np.arange(data.shape[axis] - 1), axis=axis)], axis=axis)
        out = self.scan(data, axis=axis, dtype=x.dtype)
        return np.flip(out, axis) if self.reverse else out


@register("CumSum", since=11)
class CumSum(_Cumulative):
    scan = staticmethod(np.cumsum)
    identity = 0


@register("CumProd", since=26)
class CumProd(_Cumulative):
    scan = staticmethod(np.cumprod)
    identity = 1


@register("ReverseSequence", since=10)
class ReverseSequence(Kernel):
    def setup(self):
        self.batch_axis = self.attr("batch_axis", 1)
        self.time_axis = self.attr("time_axis", 0)
        if {self.batch_axis, self.time_axis} != {0, 1}:
            self.fail("batch_axis and time_axis must be 0 and 1 (one each)")

    def run(self, x, sequence_lens):
        batch, steps = x.shape[self.batch_axis], x.shape[self.time_axis]
        lens = np.asarray(sequence_lens).astype(np.int64).reshape(-1)
        if lens.size != batch or (lens < 0).any() or (lens > steps).any():
            raise ValueError(f"sequence_lens {lens.tolist()} must give {batch} lengths in [0, {steps}]")
        t = np.arange(steps)[None, :]
        source = np.where(t < lens[:, None], lens[:, None] - 1 - t, t)  # (batch, time)
        if self.time_axis == 0:
            source = source.T
        source = np.broadcast_to(source.reshape(source.shape + (1,) * (x.ndim - 2)), x.shape)
        return np.take_along_axis(x, source, axis=self.time_axis)
