"""Shape and layout kernels: Identity, Reshape, Transpose, Concat, Split, Slice, Squeeze, ..."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from carrack.ir.dtypes import to_numpy
from carrack.ops.registry import Kernel, register


def int_list(values) -> list[int]:
    """A shape/axes/pads tensor (or attribute list) as Python ints."""
    return [int(v) for v in np.asarray(values).reshape(-1)]


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    """An axis in [-rank, rank-1] as a non-negative index; ValueError outside that range."""
    if not -rank <= axis < rank:
        raise ValueError(f"{what} {axis} is out of range for a tensor of rank {rank}")
    return axis + rank if axis < 0 else axis


def normalize_axes(axes: Sequence[int], rank: int, what: str = "axes") -> list[int]:
    out = [normalize_axis(int(a), rank, what) for a in axes]
    if len(set(out)) != len(out):
        raise ValueError(f"{what} {list(axes)} repeats an axis")
    return out


def constant_input(kernel: Kernel, index: int) -> np.ndarray | None:
    """Input `index` when it is a constant of the graph (not an initializer a run may override), else None."""
    graph = kernel.ctx.graph if kernel.ctx is not None else None
    name = kernel.node.inputs[index] if index < len(kernel.node.inputs) else ""
    if graph is None or not name or any(v.name == name for v in graph.inputs):
        return None
    return graph.initializers.get(name)


@register("Identity", since=1)
class Identity(Kernel):
    in_place = view = True

    def run(self, x):
        return x if type(x) is not list and x is not None else (x,)


def reshape_target(in_shape: tuple[int, ...], shape: list[int], allowzero: bool) -> tuple[int, ...]:
    """Resolve Reshape's 0 (copy the input dim, unless allowzero) and -1 (infer) entries."""
    if shape.count(-1) > 1:
        raise ValueError(f"Reshape shape {shape} has more than one -1")
    if allowzero and 0 in shape and -1 in shape:
        raise ValueError(f"Reshape shape {shape} has both 0 and -1 while allowzero=1")
    out = []
    for i, d in enumerate(shape):
        if d == 0 and not allowzero:
            if i >= len(in_shape):
                raise ValueError(f"Reshape shape {shape} copies dim {i} (0) but the input has rank {len(in_shape)}")
            d = in_shape[i]
        elif d < -1:
            raise ValueError(f"Reshape shape {shape} has a negative dimension")
        out.append(d)
    size = math.prod(in_shape)
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        if known == 0 or size % known:
            raise ValueError(f"cannot reshape a tensor of shape {list(in_shape)} to {shape}")
        out[out.index(-1)] = size // known
    if math.prod(out) != size:
        raise ValueError(f"cannot reshape a tensor of shape {list(in_shape)} ({size} elements) to {shape}")
    return tuple(out)


@register("Reshape", since=1)
class Reshape(Kernel):
    view = True

    def setup(self):
        self.allowzero = bool(self.attr("allowzero", 0))
        self.shape_attr = self.attr("shape") if self.version < 5 else None
        if self.version < 5 and self.shape_attr is None:
            self.fail("attribute 'shape' is required before opset 5")

        if self.version >= 5 and len(self.node.inputs) > 1:
            const = constant_input(self, 1)
            if const is not None:
                self.shape_attr = int_list(const)  # a constant target: parsed once, not per run

    def run(self, data, shape=None):
        if self.shape_attr is not None:
            target = self.shape_attr
        elif type(shape) is np.ndarray and shape.ndim == 1 and shape.dtype.kind == "i":
            target = shape.tolist()
        else:
            target = int_list(shape)
        if data.size and (0 not in target or self.allowzero and -1 not in target):
            # no dim copied from the input: numpy's reshape agrees with ONNX's where it succeeds (one -1 at most,
            # no other negative); anything else goes through reshape_target for its error
            try:
                if min(target, default=0) >= -1:
                    return data.reshape(target)
            except ValueError:
                pass
        return data.reshape(reshape_target(data.shape, list(target), self.allowzero))


@register("Transpose", since=1)
class Transpose(Kernel):
    view = True

    def setup(self):
        self.perm = self.attr("perm")
        if self.perm is not None:
            self.perm = tuple(int(p) for p in self.perm)
        # checked once here; a bad perm still fails at run time, naming the input's rank
        self.valid = self.perm is None or sorted(self.perm) == list(range(len(self.perm)))

    def run(self, x):
        if self.perm is None:
            return x.transpose()
        if not self.valid or len(self.perm) != x.ndim:
            raise ValueError(f"perm {list(self.perm)} is not a permutation of the {x.ndim} axes")
        return x.transpose(self.perm)


@register("Concat", since=1)
class Concat(Kernel):
    def setup(self):
        self.axis = self.attr("axis", 1) if self.version < 4 else self.required_attr("axis")

    def run(self, *inputs):
        arrays = [x for x in inputs if x is not None]
        if not arrays:
            raise ValueError("Concat needs at least one input")
        axis = normalize_axis(self.axis, arrays[0].ndim)
        return np.concatenate(arrays, axis=axis)

    def run_into(self, out, *inputs):
        """Into the planned buffer when the planned shape and dtype match (else a fresh array)."""
        if len(inputs) == 1 and type(inputs[0]) is np.ndarray and type(out) is np.ndarray and (
                inputs[0].shape == out.shape and inputs[0].dtype == out.dtype):
            np.copyto(out, inputs[0])  # one input: a copy (an exporter's Concat of a decoder's past alone)
            return out
        arrays = [x for x in inputs if x is not None]
        if not arrays or out is None or any(x.dtype != out.dtype or x.ndim != out.ndim for x in arrays):
            return self.run(*inputs)
        axis = normalize_axis(self.axis, out.ndim)
        expected = list(arrays[0].shape)
        expected[axis] = sum(x.shape[axis] for x in arrays)
        if tuple(expected) != out.shape:
            return self.run(*inputs)
        return np.concatenate(arrays, axis=axis, out=out)

    def bind_into(self, out, *inputs):
        """numpy's concatenate into `out` for these very arrays (when `run_into` writes there)."""
        arrays = tuple(x for x in inputs if x is not None)
        if not arrays or type(out) is not np.ndarray or not out.flags.writeable \
                or any(type(x) is not np.ndarray or x.dtype != out.dtype or x.ndim != out.ndim
                       or np.may_share_memory(x, out) for x in arrays):
            return None
        axis = normalize_axis(self.axis, out.ndim)
        expected = list(arrays[0].shape)
        expected[axis] = sum(x.shape[axis] for x in arrays)
        if tuple(expected) != out.shape:
            return None
        return functools.partial(np.concatenate, arrays, axis=axis, out=out)


def split_sizes(dim: int, n_outputs: int, split: list[int] | None, num_outputs: int | None) -> list[int]:
    """Lengths of Split's outputs along the axis."""
    if split is not None:
        if len(split) != n_outputs or sum(split) != dim or min(split, default=0) < 0:
            raise ValueError(f"split {split} does not divide a dimension of {dim} into {n_outputs} outputs")
        return split
    if num_outputs is not None:
        chunk = -(-dim // num_outputs)
        sizes = [min(chunk, max(dim - i * chunk, 0)) for i in range(num_outputs)]
        return sizes
    if dim % n_outputs:
        raise ValueError(f"a dimension of {dim} does not split evenly into {n_outputs} outputs")
    return [dim // n_outputs] * n_outputs


@register("Split", since=1)
class Split(Kernel):
    view = True  # every part is a view of the input (the plan keeps the input's bytes while any part is read)

    def setup(self):
        self.axis = self.attr("axis", 0)
        self.split_attr = self.attr("split") if self.version < 13 else None
        self.num_outputs = self.attr("num_outputs") if self.version >= 18 else None
        if self.num_outputs is not None and self.num_outputs != len(self.node.outputs):
            self.fail(f"num_outputs={self.num_outputs} but the node has {len(self.node.outputs)} outputs")

    def run(self, x, split=None):
        axis = normalize_axis(self.axis, x.ndim)
        # an empty `split` input means "not given", as in onnxruntime
        lengths = self.split_attr if split is None or split.size == 0 else int_list(split)
        sizes = split_sizes(x.shape[axis], len(self.node.outputs), lengths, self.num_outputs)
        index = [slice(None)] * x.ndim
        parts, start = [], 0
        for size in sizes:  # views, as np.split makes them, without its per-call overhead (~10 us)
            index[axis] = slice(start, start + size)
            parts.append(x[tuple(index)])
            start += size
        return tuple(parts)


def slice_bounds(start: int, end: int, step: int, dim: int) -> slice:
    """ONNX Slice clamping (negative indices count from the back; INT64 sentinels clamp) as a Python slice."""
    if step == 0:
        raise ValueError("Slice step cannot be 0")
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        return slice(start, end, step)
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return slice(start, end if end >= 0 else None, step)


@register("Slice", since=1)
class Slice(Kernel):
    def setup(self):
        if self.version < 10:
            self.starts = self.required_attr("starts")
            self.ends = self.required_attr("ends")
            self.axes = self.attr("axes")
            if len(self.starts) != len(self.ends):
                self.fail("attributes 'starts' and 'ends' must have the same length")

    def run(self, data, starts=None, ends=None, axes=None, steps=None):
        if self.version < 10:
            starts, ends, axes, steps = self.starts, self.ends, self.axes, None
        starts, ends = int_list(starts), int_list(ends)
        if len(starts) != len(ends):
            raise ValueError(f"Slice starts {starts} and ends {ends} differ in length")
        axes = list(range(len(starts))) if axes is None else int_list(axes)
        steps = [1] * len(starts) if steps is None else int_list(steps)
        if not len(axes) == len(steps) == len(starts):
            raise ValueError(f"Slice starts, ends, axes {axes} and steps {steps} differ in length")
        index = [slice(None)] * data.ndim
        for axis, start, end, step in zip(normalize_axes(axes, data.ndim), starts, ends, steps):
            index[axis] = slice_bounds(start, end, step, data.shape[axis])
        return data[tuple(index)]


@register("Squeeze", since=1)
class Squeeze(Kernel):
    view = True

    def setup(self):
        self.axes_attr = self.attr("axes") if self.version < 13 else None

    def run(self, data, axes=None):
        axes = self.axes_attr if self.version < 13 else (None if axes is None else int_list(axes))
        if axes is None or len(axes) == 0:  # onnxruntime reads empty axes as "all size-1 axes"
            return data.reshape([d for d in data.shape if d != 1])
        axes = normalize_axes(axes, data.ndim)
        bad = [a for a in axes if data.shape[a] != 1]
        if bad:
            raise ValueError(f"cannot squeeze axes {bad} of shape {list(data.shape)}: their size is not 1")
        return data.reshape([d for i, d in enumerate(data.shape) if i not in axes])


@register("Unsqueeze", since=1)
class Unsqueeze(Kernel):
    view = True

    def setup(self):
        if self.version < 13:
            self.axes_attr = self.required_attr("axes")
        const = constant_input(self, 1) if self.version >= 13 and len(self.node.inputs) > 1 else None
        axes = int_list(const) if const is not None else []
        #: constant non-negative axes, parsed once: positions at which a run inserts its dims in ascending order
        self.positions = sorted(axes) if axes and min(axes) >= 0 and len(set(axes)) == len(axes) else None

    def run(self, data, axes=None):
        if self.positions is not None and self.positions[-1] < data.ndim + len(self.positions):
            shape = list(data.shape)
            for position in self.positions:
                shape.insert(position, 1)
            return data.reshape(shape)
        axes = self.axes_attr if self.version < 13 else int_list(axes)
        rank = data.ndim + len(axes)
        inserted = set(normalize_axes(axes, rank))
        dims = iter(data.shape)
        return data.reshape([1 if i in inserted else next(dims) for i in range(rank)])


@register("Flatten", since=1)
class Flatten(Kernel):
    view = True

    def setup(self):
        self.axis = self.attr("axis", 1)

    def run(self, x):
        axis = self.axis + x.ndim if self.axis < 0 else self.axis
        if not 0 <= axis <= x.ndim:
            raise ValueError(f"Flatten axis {self.axis} is out of range for rank {x.ndim}")
        return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))  # np.prod: ~2 us a tuple


@register("Expand", since=8)
class Expand(Kernel):
    #: inputs whose values a bound call bakes in (runtime.program binds only where they do not change)
    value_inputs = (1,)

    def run(self, x, shape):
        if type(shape) is np.ndarray and shape.ndim == 1 and shape.dtype.kind == "i":
            dims = tuple(shape.tolist())
        else:
            dims = tuple(int_list(shape))
        target = _broadcast_shape(x.shape, dims)
        self.check_output(target, x.dtype)
        # a real copy: a stride-0 view handed out as an output would surprise anyone who writes into it
        out = np.empty(target, x.dtype)
        np.copyto(out, x)
        return out

    def bind_into(self, out, x, shape):
        """numpy's copyto of x broadcast into `out` (what `run` does into its new array), for these very arrays."""
        dims = tuple(int_list(shape))
        if not (type(x) is np.ndarray and type(out) is np.ndarray and out.dtype == x.dtype and out.flags.writeable
                and out.shape == _broadcast_shape(x.shape, dims) and not np.may_share_memory(out, x)):
            return None
        return functools.partial(np.copyto, out, x)


def _broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """np.broadcast_shapes(a, b) for two shapes, without its overhead in the common case (its error otherwise)."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for da, db in zip(a, b):
        if da == db or db == 1:
            out.append(da)
        elif da == 1 and db >= 0:
            out.append(db)
        else:
            return np.broadcast_shapes(a, b)  # raises, naming the shapes
    if min(out, default=0) < 0:
        return np.broadcast_shapes(a, b)
    return tuple(out)


@register("Tile", since=1)
class Tile(Kernel):
    def run(self, x, repeats, axis=None):
        if self.version < 6:  # Tile-1: repeat `tiles` times along one `axis`
            reps = [1] * x.ndim
            reps[normalize_axis(int_list(axis)[0], x.ndim)] = int_list(repeats)[0]
        else:
            reps = int_list(repeats)
        if len(reps) != x.ndim or min(reps, default=0) < 0:
            raise ValueError(f"Tile repeats {reps} must be {x.ndim} non-negative counts")
        self.check_output([d * r for d, r in zip(x.shape, reps)], x.dtype)
        return np.tile(x, reps)


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "edge", "wrap": "wrap"}


@register("Pad", since=1)
class Pad(Kernel):
    def setup(self):
        self.mode = self.attr("mode", "constant")
        if self.mode not in _PAD_MODES:
            self.fail(f"mode '{self.mode}' is not one of {sorted(_PAD_MODES)}")
        if self.version < 11:
            self.pads_attr = self.required_attr("paddings" if self.version < 2 else "pads")
            self.value_attr = self.attr("value", 0.0)

    def run(self, data, pads=None, constant_value=None, axes=None):
        if self.version < 11:
            pads, value = list(self.pads_attr), self.value_attr
        else:
            pads = int_list(pads)
            value = None if constant_value is None or constant_value.size == 0 else constant_value.reshape(-1)[0]
        if axes is None:
            axes = list(range(data.ndim))
        else:
            axes = normalize_axes(int_list(axes), data.ndim)
        if len(pads) != 2 * len(axes):
            raise ValueError(f"Pad needs {2 * len(axes)} pads for axes {axes}, got {pads}")
        begin, end = [0] * data.ndim, [0] * data.ndim
        for i, a in enumerate(axes):
            begin[a], end[a] = pads[i], pads[i + len(axes)]
        self.check_output([max(d + b + e, 0) for d, b, e in zip(data.shape, begin, end)], data.dtype)
        return pad_array(data, begin, end, self.mode, value)


def pad_array(data: np.ndarray, begin: list[int], end: list[int], mode: str, value) -> np.ndarray:
    """np.pad with ONNX's conventions: negative pads crop first (as onnxruntime does), the constant takes the data
    type."""
    crop = tuple(slice(-min(b, 0), d + min(e, 0)) for d, b, e in zip(data.shape, begin, end))
    if any(s.start > s.stop for s in crop):
        raise ValueError(f"negative pads {begin}/{end} remove more than shape {list(data.shape)}")
    data = data[crop]
    widths = [(max(b, 0), max(e, 0)) for b, e in zip(begin, end)]
    if all(w == (0, 0) for w in widths):
        return data
    if mode == "constant":
        if value is None:
            value = "" if data.dtype == object else 0
        return np.pad(data, widths, mode="constant", constant_values=np.asarray(value).astype(data.dtype))
    if any(d == 0 and w != (0, 0) for d, w in zip(data.shape, widths)):
        raise ValueError(f"Pad mode '{mode}' cannot pad an empty axis (shape {list(data.shape)})")
    if mode == "reflect" and any(max(w) >= d for d, w in zip(data.shape, widths) if w != (0, 0)):
        raise ValueError(f"Pad mode 'reflect' needs pads smaller than each padded axis, got {widths} for shape "
                         f"{list(data.shape)}")
    return np.pad(data, widths, mode=_PAD_MODES[mode])


@register("Shape", since=1)
class Shape(Kernel):
    def setup(self):
        self.start = self.attr("start", 0)
        self.end = self.attr("end")

    def run(self, data):
        rank = data.ndim
        start = self.start + rank if self.start < 0 else self.start
        end = rank if self.end is None else (self.end + rank if self.end < 0 else self.end)
        start, end = min(max(start, 0), rank), min(max(end, 0), rank)
        return np.array(data.shape[start:end], dtype=np.int64)


@register("Size", since=1)
class Size(Kernel):
    def run(self, data):
        return np.array(data.size, dtype=np.int64)


@register("ConstantOfShape", since=9)
class ConstantOfShape(Kernel):
    def setup(self):
        value = self.attr("value")
        if value is None:
            value = np.zeros(1, dtype=np.float32)
        if np.asarray(value).size != 1:
            self.fail("attribute 'value' must hold exactly one element")
        self.value = np.asarray(value).reshape(-1)[:1]

    def run(self, shape):
        dims = int_list(shape)
        if min(dims, default=0) < 0:
            raise ValueError(f"ConstantOfShape got a negative dimension in {dims}")
        self.check_output(dims, self.value.dtype)
        return np.full(dims, self.value[0], dtype=self.value.dtype)


_CONSTANT_FIELDS = {
    "value": lambda v: np.asarray(v),
    "sparse_value": lambda v: np.asarray(v),
    "value_float": lambda v: np.array(v, dtype=np.float32),
    "value_floats": lambda v: np.array(v, dtype=np.float32).reshape(-1),
    "value_int": lambda v: np.array(v, dtype=np.int64),
    "value_ints": lambda v: np.array(v, dtype=np.int64).reshape(-1),
    "value_string": lambda v: np.array(v, dtype=object),
    "value_strings": lambda v: np.array(list(v), dtype=object).reshape(-1),
}


@register("Constant", since=1)
class Constant(Kernel):
    def setup(self):
        given = [k for k in _CONSTANT_FIELDS if k in self.node.attrs]
        if len(given) != 1:
            self.fail(f"exactly one of {sorted(_CONSTANT_FIELDS)} must be set, got {given}")
        self.value = _CONSTANT_FIELDS[given[0]](self.node.attrs[given[0]])

    def run(self):
        return self.value


@register("Range", since=11)
class Range(Kernel):
    def setup(self):
        self.stash = self.version >= 27 and self.attr("stash_type", 1) == 1

    def run(self, start, limit, delta):
        if (type(start) is type(limit) is type(delta) is np.ndarray and start.dtype.kind in "iu"
                and start.size == limit.size == delta.size == 1):
            return self._integers(start.dtype, int(start.item()), int(limit.item()), int(delta.item()))
        dtype = np.asarray(start).dtype
        start, limit, delta = (np.asarray(v).reshape(-1)[0] for v in (start, limit, delta))
        if dtype.kind in "iu":
            return self._integers(dtype, int(start), int(limit), int(delta))
        if delta == 0:
            raise ValueError("Range delta cannot be 0")
        span = (float(limit) - float(start)) / float(delta)
        if not np.isfinite(span):
            raise ValueError(f"Range from {start} to {limit} by {delta} has no finite length")
        count = max(int(np.ceil(span)), 0)
        self.check_output([count], dtype)
        compute = np.dtype(np.float32) if self.stash and dtype.itemsize == 2 else dtype
        steps = np.arange(count, dtype=compute) * compute.type(delta)
        return (compute.type(start) + steps).astype(dtype)

    def _integers(self, dtype: np.dtype, start: int, limit: int, delta: int) -> np.ndarray:
        """start + k * delta in int64 (wrapping as numpy does), as `dtype` (a position range per decoded token)."""
        if delta == 0:
            raise ValueError("Range delta cannot be 0")
        count = max(-(-(limit - start) // delta), 0)
        self.check_output([count], dtype)
        values = np.arange(count, dtype=np.int64)
        if delta != 1:
            values *= delta
        if start:
            values += start
        return values if dtype == np.int64 else values.astype(dtype)


@register("EyeLike", since=9)
class EyeLike(Kernel):
    def setup(self):
        self.dtype = self.attr("dtype")
        self.k = self.attr("k", 0)

    def run(self, x):
        if x.ndim != 2:
            raise ValueError(f"EyeLike needs a 2-D input, got shape {list(x.shape)}")
        dtype = x.dtype if self.dtype is None else to_numpy(self.dtype)
        return np.eye(x.shape[0], x.shape[1], k=self.k, dtype=dtype)


def _block_size(kernel: Kernel) -> int:
    size = kernel.required_attr("blocksize")
    if size < 1:
        kernel.fail(f"blocksize must be positive, got {size}")
    return size


def _block_mode(kernel: Kernel) -> str:
    mode = kernel.attr("mode", "DCR")
    if mode not in ("DCR", "CRD"):
        kernel.fail(f"mode '{mode}' must be DCR or CRD")
    return mode


@register("DepthToSpace", since=1)
class DepthToSpace(Kernel):
    def setup(self):
        self.bs = _block_size(self)
        self.mode = _block_mode(self)

    def run(self, x):
        if x.ndim != 4 or x.shape[1] % (self.bs * self.bs):
            raise ValueError(f"DepthToSpace needs NCHW input with C divisible by {self.bs ** 2}, got {x.shape}")
        b, c, h, w = x.shape
        bs, depth = self.bs, c // (self.bs * self.bs)
        if self.mode == "DCR":
            tmp = x.reshape(b, bs, bs, depth, h, w).transpose(0, 3, 4, 1, 5, 2)
        else:
            tmp = x.reshape(b, depth, bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
        return tmp.reshape(b, depth, h * bs, w * bs)


@register("SpaceToDepth", since=1)
class SpaceToDepth(Kernel):
    def setup(self):
        self.bs = _block_size(self)
        self.mode = _block_mode(self)

    def run(self, x):
        bs = self.bs
        if x.ndim != 4 or x.shape[2] % bs or x.shape[3] % bs:
            raise ValueError(f"SpaceToDepth needs NCHW input with H and W divisible by {bs}, got {x.shape}")
        b, c, h, w = x.shape
        tmp = x.reshape(b, c, h // bs, bs, w // bs, bs)
        perm = (0, 3, 5, 1, 2, 4) if self.mode == "DCR" else (0, 1, 3, 5, 2, 4)
        return tmp.transpose(perm).reshape(b, c * bs * bs, h // bs, w // bs)


@register("Trilu", since=14)
class Trilu(Kernel):
    def setup(self):
        self.upper = bool(self.attr("upper", 1))

    def run(self, x, k=None):
        if x.ndim < 2:
            raise ValueError(f"Trilu needs a tensor of rank >= 2, got shape {list(x.shape)}")
        diag = 0 if k is None else int_list(k)[0]
        # clamp so huge k values don't make np.tri build enormous index ranges
        diag = min(max(diag, -x.shape[-2] - 1), x.shape[-1] + 1)
        rows, cols = x.shape[-2:]
        keep = np.tri(rows, cols, k=diag - 1, dtype=bool)
        keep = ~keep if self.upper else np.tri(rows, cols, k=diag, dtype=bool)
        return np.where(keep, x, np.zeros((), dtype=x.dtype))


@register("CenterCropPad", since=18)
class CenterCropPad(Kernel):
    def setup(self):
        self.axes = self.attr("axes")

    def run(self, data, shape):
        target = int_list(shape)
        axes = list(range(data.ndim)) if self.axes is None else normalize_axes(self.axes, data.ndim)
        if len(target) != len(axes):
            raise ValueError(f"CenterCropPad shape {target} does not match axes {axes}")
        begin, end = [0] * data.ndim, [0] * data.ndim
        for a, size in zip(axes, target):
            diff = size - data.shape[a]
            # padding puts the odd pixel on the right; cropping shifts the window left (both round the begin down)
            begin[a] = diff // 2 if diff >= 0 else -((-diff) // 2)
            end[a] = diff - begin[a]
        return pad_array(data, begin, end, "constant", None)
