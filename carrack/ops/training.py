"""Optimizer steps of the ai.onnx.preview.training domain: Adagrad, Adam, Momentum.

Each is a pure function of its inputs: R (learning rate), T (update count), then the optimized tensors
grouped by role (all X, then all G, then the per-tensor state), and outputs grouped the same way.
"""

from __future__ import annotations

import numpy as np

from carrack.ops.registry import Kernel, register

TRAINING = "ai.onnx.preview.training"


def _groups(tensors: tuple[np.ndarray, ...], count: int, kernel: Kernel) -> list[tuple[np.ndarray, ...]]:
    """Splits [X1..Xn, G1..Gn, ...] into n tuples (Xi, Gi, ...)."""
    if len(tensors) % count:
        kernel.fail(f"expected a multiple of {count} tensors after R and T, got {len(tensors)}")
    n = len(tensors) // count
    return [tuple(tensors[k * n + i] for k in range(count)) for i in range(n)]


@register("Adagrad", since=1, domain=TRAINING)
class Adagrad(Kernel):
    def setup(self):
        self.decay_factor = float(self.attr("decay_factor", 0.0))
        self.epsilon = float(self.attr("epsilon", 1e-6))
        self.norm_coefficient = float(self.attr("norm_coefficient", 0.0))

    def run(self, rate, step, *tensors):
        r = float(rate) / (1 + float(step) * self.decay_factor)
        new_x, new_h = [], []
        for x, g, h in _groups(tensors, 3, self):
            g_reg = self.norm_coefficient * x + g
            h_new = h + g_reg * g_reg
            new_x.append((x - r * g_reg / (np.sqrt(h_new) + self.epsilon)).astype(x.dtype, copy=False))
            new_h.append(h_new.astype(h.dtype, copy=False))
        return tuple(new_x + new_h)


@register("Adam", since=1, domain=TRAINING)
class Adam(Kernel):
    def setup(self):
        self.alpha = float(self.attr("alpha", 0.9))
        self.beta = float(self.attr("beta", 0.999))
        self.epsilon = float(self.attr("epsilon", 1e-6))
        self.norm_coefficient = float(self.attr("norm_coefficient", 0.0))
        self.norm_coefficient_post = float(self.attr("norm_coefficient_post", 0.0))

    def run(self, rate, step, *tensors):
        t, r = float(step), float(rate)
        if t > 0:
            r = r * np.sqrt(1 - self.beta**t) / (1 - self.alpha**t)
        new_x, new_v, new_h = [], [], []
        for x, g, v, h in _groups(tensors, 4, self):
            g_reg = self.norm_coefficient * x + g
            v_new = self.alpha * v + (1 - self.alpha) * g_reg
            h_new = self.beta * h + (1 - self.beta) * g_reg * g_reg
            x_new = x - float(r) * v_new / (np.sqrt(h_new) + self.epsilon)
            new_x.append(((1 - self.norm_coefficient_post) * x_new).astype(x.dtype, copy=False))
            new_v.append(v_new.astype(v.dtype, copy=False))
            new_h.append(h_new.astype(h.dtype, copy=False))
        return tuple(new_x + new_v + new_h)


@register("Momentum", since=1, domain=TRAINING)
class Momentum(Kernel):
    def setup(self):
        self.alpha = float(self.required_attr("alpha"))
        self.beta = float(self.required_attr("beta"))
        self.norm_coefficient = float(self.required_attr("norm_coefficient"))
        mode = self.required_attr("mode")
        self.mode = mode.decode() if isinstance(mode, bytes) else mode
        if self.mode not in ("standard", "nesterov"):
            self.fail(f"mode must be 'standard' or 'nesterov', got '{self.mode}'")

    def run(self, rate, step, *tensors):
        r = float(rate)
        beta = self.beta if float(step) > 0 else 1.0
        new_x, new_v = [], []
        for x, g, v in _groups(tensors, 3, self):
            g_reg = self.norm_coefficient * x + g
            v_new = self.alpha * v + beta * g_reg
            direction = g_reg + self.alpha * v_new if self.mode == "nesterov" else v_new
            new_x.append((x - r * direction).astype(x.dtype, copy=False))
            new_v.append(v_new.astype(v.dtype, copy=False))
        return tuple(new_x + new_v)
