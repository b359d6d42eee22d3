"""Recurrent layers: RNN, GRU and LSTM (every opset, every direction, both layouts).

All directions run together: inputs are gathered into per-direction time order once (reverse direction and
``sequence_lens`` handled by an index map), the input projection X @ W^T is one matmul over all steps, and each
time step is one batched matmul over directions, H_{t-1} @ R^T.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from carrack.ops.registry import Kernel, register

Activation = Callable[[np.ndarray], np.ndarray]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # written with exp of a non-positive number only, so it never overflows
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def _activation(name: str, alpha: float, beta: float) -> Activation:
    a, b = alpha, beta
    table: dict[str, Activation] = {
        "relu": lambda x: np.maximum(x, 0),
        "tanh": np.tanh,
        "sigmoid": _sigmoid,
        "affine": lambda x: x * a + b,
        "leakyrelu": lambda x: np.where(x >= 0, x, x * a),
        "thresholdedrelu": lambda x: np.where(x >= a, x, 0),
        "scaledtanh": lambda x: np.tanh(x * b) * a,
        "hardsigmoid": lambda x: np.clip(x * a + b, 0, 1),
        "elu": lambda x: np.where(x >= 0, x, np.expm1(np.minimum(x, 0)) * a),
        "softsign": lambda x: x / (1 + np.abs(x)),
        "softplus": _softplus,
    }
    return table[name]


#: Default (alpha, beta) of the activations that take them; the others take none and consume no list entry.
_ALPHA_DEFAULTS = {"affine": 1.0, "leakyrelu": 0.01, "thresholdedrelu": 1.0, "scaledtanh": 1.0,
                   "hardsigmoid": 0.2, "elu": 1.0}
_BETA_DEFAULTS = {"affine": 0.0, "scaledtanh": 1.0, "hardsigmoid": 0.5}
_KNOWN = {"relu", "tanh", "sigmoid", "softsign", "softplus"} | set(_ALPHA_DEFAULTS)


class _Recurrent(Kernel):
    """What RNN, GRU and LSTM share: attributes, layout, direction handling and the time loop's plumbing."""

    gates = 1
    default_activations: tuple[str, ...] = ("Tanh",)

    def setup(self) -> None:
        self.hidden_size = self.attr("hidden_size")
        direction = self.attr("direction", "forward")
        direction = "forward" if direction == "foward" else direction  # GRU-1's schema default has this typo
        if direction not in ("forward", "reverse", "bidirectional"):
            self.fail(f"direction must be forward, reverse or bidirectional, got {direction!r}")
        self.reversed_dirs = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}[direction]
        self.layout = self.attr("layout", 0) if self.version >= 14 else 0
        if self.layout not in (0, 1):
            self.fail(f"layout must be 0 or 1, got {self.layout}")
        clip = self.attr("clip")
        self.clip = None if clip is None else float(clip)
        self.activations = self._parse_activations()

    def _parse_activations(self) -> list[list[Activation]]:
        """One list of activation functions per direction."""
        per_dir = len(self.default_activations)
        n_dirs = len(self.reversed_dirs)
        names = list(self.attr("activations") or [])
        if not names:
            names = list(self.default_activations) * n_dirs
        elif len(names) == per_dir and n_dirs == 2:
            names = names * 2
        if len(names) < per_dir * n_dirs:
            self.fail(f"activations needs {per_dir * n_dirs} functions, got {len(names)}")
        alphas = list(self.attr("activation_alpha") or [])
        betas = list(self.attr("activation_beta") or [])
        specs = []
        for name in names[: per_dir * n_dirs]:
            key = name.lower()
            if key not in _KNOWN:
                self.fail(f"unknown activation {name!r}")
            alpha = alphas.pop(0) if key in _ALPHA_DEFAULTS and alphas else _ALPHA_DEFAULTS.get(key, 0.0)
            beta = betas.pop(0) if key in _BETA_DEFAULTS and betas else _BETA_DEFAULTS.get(key, 0.0)
            specs.append((key, float(alpha), float(beta)))
        per_direction = [specs[d * per_dir:(d + 1) * per_dir] for d in range(n_dirs)]
        self.same_activations = per_direction[0] == per_direction[-1]
        return [[_activation(*spec) for spec in d] for d in per_direction]

    # --- helpers used by the subclasses' step functions ---

    def _apply(self, k: int, x: np.ndarray, clip: bool = True) -> np.ndarray:
        """Activation number k (f, g, h, ...) of each direction, on x of shape [directions, batch, hidden]."""
        if clip and self.clip is not None:
            x = np.clip(x, -self.clip, self.clip)
        fns = [acts[k] for acts in self.activations]
        if self.same_activations:
            return fns[0](x)
        return np.stack([fn(x[d]) for d, fn in enumerate(fns)])

    # --- shared plumbing ---

    def _prepare(self, x, w, r, b, sequence_lens, initial_states):
        """Per-direction inputs in processing order: X @ W^T + Wb [D, T, N, G*H], R^T [D, H, G*H], Rb, states, masks."""
        dtype = x.dtype
        compute = np.float32 if dtype.itemsize < 4 else dtype
        if self.layout == 1:
            x = x.transpose(1, 0, 2)
            initial_states = [None if s is None else s.transpose(1, 0, 2) for s in initial_states]
        seq_len, batch = x.shape[:2]
        n_dirs = len(self.reversed_dirs)
        hidden = r.shape[-1]
        lens = None if sequence_lens is None else np.asarray(sequence_lens, dtype=np.int64).reshape(batch)
        if lens is not None:
            lens = np.clip(lens, 0, seq_len)
            if np.all(lens == seq_len):
                lens = None
        order = [self._time_index(seq_len, batch, lens, rev) for rev in self.reversed_dirs]
        xd = np.stack([x if idx is None else x[idx, np.arange(batch)] for idx in order]).astype(compute, copy=False)
        gh = self.gates * hidden
        if b is None:
            b = np.zeros((n_dirs, 2 * gh), dtype=compute)
        b = b.astype(compute, copy=False)
        # contiguous operands keep numpy's stacked matmul on BLAS
        w_t = np.ascontiguousarray(w.astype(compute, copy=False).transpose(0, 2, 1))
        projected = np.matmul(xd.reshape(n_dirs, seq_len * batch, -1), w_t).reshape(n_dirs, seq_len, batch, gh)
        projected += b[:, None, None, :gh]
        r_t = np.ascontiguousarray(r.astype(compute, copy=False).transpose(0, 2, 1))
        states = [np.zeros((n_dirs, batch, hidden), dtype=compute) if s is None else s.astype(compute)
                  for s in initial_states]
        active = None if lens is None else (np.arange(seq_len)[:, None] < lens[None, :])[:, None, :, None]
        return projected, r_t, b[:, None, gh:], states, active, order, compute

    @staticmethod
    def _time_index(seq_len: int, batch: int, lens, reverse: bool):
        """Per (step, batch) source time index, or None for the identity; the map is its own inverse."""
        if not reverse:
            return None
        steps = np.arange(seq_len)[:, None]
        if lens is None:
            return np.broadcast_to(seq_len - 1 - steps, (seq_len, batch))
        return np.where(steps < lens[None, :], lens[None, :] - 1 - steps, steps)

    def _finish(self, ys: list[np.ndarray], finals: Sequence[np.ndarray], order, active, dtype):
        """Y back in source time order and layout, plus the final states, as the node's outputs."""
        y = np.stack(ys) if ys else np.zeros((0, *finals[0].shape), dtype=finals[0].dtype)  # [T, D, N, H]
        if active is not None:
            y = np.where(active, y, 0)
        batch = y.shape[2]
        if any(idx is not None for idx in order):
            y = np.stack([y[:, d] if idx is None else y[idx, d, np.arange(batch)] for d, idx in enumerate(order)],
                         axis=1)
        if active is not None:
            # a sequence of length 0 has no final state: onnxruntime reports zeros, not the initial state
            finals = [np.where(active.any(axis=0), f, 0) for f in finals]
        finals = [f.astype(dtype, copy=False) for f in finals]
        y = y.astype(dtype, copy=False)
        if self.layout == 1:
            y = y.transpose(2, 0, 1, 3)
            finals = [f.transpose(1, 0, 2) for f in finals]
        return (y, *finals)

    @staticmethod
    def _keep(active, t: int, new: np.ndarray, old: np.ndarray) -> np.ndarray:
        """Past a sequence's end its state stays as it was."""
        return new if active is None else np.where(active[t], new, old)


@register("RNN", since=1)
class RNN(_Recurrent):
    gates = 1
    default_activations = ("Tanh",)

    def run(self, x, w, r, b=None, sequence_lens=None, initial_h=None):
        projected, r_t, rb, (h,), active, order, _ = self._prepare(x, w, r, b, sequence_lens, [initial_h])
        projected += rb[:, None]
        ys = []
        for t in range(projected.shape[1]):
            h_new = self._apply(0, projected[:, t] + h @ r_t)
            h = self._keep(active, t, h_new, h)
            ys.append(h_new)
        return self._finish(ys, [h], order, active, x.dtype)


@register("GRU", since=1)
class GRU(_Recurrent):
    gates = 3
    default_activations = ("Sigmoid", "Tanh")

    def setup(self) -> None:
        super().setup()
        self.linear_before_reset = bool(self.attr("linear_before_reset", 0))

    def run(self, x, w, r, b=None, sequence_lens=None, initial_h=None):
        projected, r_t, rb, (h,), active, order, _ = self._prepare(x, w, r, b, sequence_lens, [initial_h])
        hidden = r_t.shape[1]
        projected[..., : 2 * hidden] += rb[:, None, :, : 2 * hidden]
        rb_h = rb[..., 2 * hidden:]
        r_zr, r_h = r_t[..., : 2 * hidden], r_t[..., 2 * hidden:]
        ys = []
        for t in range(projected.shape[1]):
            xp = projected[:, t]
            zr = self._apply(0, xp[..., : 2 * hidden] + h @ r_zr)
            z, reset = zr[..., :hidden], zr[..., hidden:]
            if self.linear_before_reset:
                candidate = self._apply(1, xp[..., 2 * hidden:] + reset * (h @ r_h + rb_h))
            else:
                candidate = self._apply(1, xp[..., 2 * hidden:] + (reset * h) @ r_h + rb_h)
            h_new = (1 - z) * candidate + z * h
            h = self._keep(active, t, h_new, h)
            ys.append(h_new)
        return self._finish(ys, [h], order, active, x.dtype)


@register("LSTM", since=1)
class LSTM(_Recurrent):
    gates = 4
    default_activations = ("Sigmoid", "Tanh", "Tanh")

    def setup(self) -> None:
        super().setup()
        self.input_forget = bool(self.attr("input_forget", 0))

    def run(self, x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None):
        projected, r_t, rb, (h, c), active, order, compute = self._prepare(
            x, w, r, b, sequence_lens, [initial_h, initial_c])
        projected += rb[:, None]
        hidden = r_t.shape[1]
        if p is not None:
            p = p.astype(compute, copy=False)[:, None, :]
            p_i, p_o, p_f = p[..., :hidden], p[..., hidden:2 * hidden], p[..., 2 * hidden:]
        ys = []
        for t in range(projected.shape[1]):
            g = projected[:, t] + h @ r_t
            pre_i, pre_o, pre_f, pre_c = (g[..., k * hidden:(k + 1) * hidden] for k in range(4))
            if p is not None:
                pre_i = pre_i + p_i * c
                pre_f = pre_f + p_f * c
            gate_i = self._apply(0, pre_i)
            gate_f = 1 - gate_i if self.input_forget else self._apply(0, pre_f)
            c_new = gate_f * c + gate_i * self._apply(1, pre_c)
            if p is not None:
                pre_o = pre_o + p_o * c_new
            # clip bounds the gates' inputs, not the cell state (as onnxruntime does)
            h_new = self._apply(0, pre_o) * self._apply(2, c_new, clip=False)
            h = self._keep(active, t, h_new, h)
            c = self._keep(active, t, c_new, c)
            ys.append(h_new)
        return self._finish(ys, [h, c], order, active, x.dtype)
