"""Control-flow kernels: If, Loop, Scan and SequenceMap, which run compiled subgraphs.

Each subgraph is compiled once in `setup`; `execute` receives the outer-scope values the subgraphs read and hands
them to every subgraph run. Loop-carried values may be tensors, sequences (lists) or optionals (None when empty).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from carrack.errors import RunFailure
from carrack.ir.dtypes import to_numpy
from carrack.ir.graph import Graph, ValueInfo
from carrack.ir.types import TensorType
from carrack.ops.registry import Kernel, register
from carrack.runtime.allocator import CHECK_THRESHOLD, check_allocation


def _scalar_bool(value: Any, what: str) -> bool:
    arr = np.asarray(value)
    if arr.size != 1:
        raise RunFailure(f"{what} must hold exactly one element, got shape {arr.shape}")
    return bool(arr.reshape(-1)[0])


def _empty_stack(info: ValueInfo) -> np.ndarray:
    """The stacked scan output of zero iterations: shape (0, *element shape) when the body declares it."""
    t = info.type
    if not isinstance(t, TensorType):
        return np.zeros((0,), np.float32)
    dtype = to_numpy(t.elem_type) if t.elem_type else np.dtype(np.float32)
    dims = () if t.shape is None else tuple(d if isinstance(d, int) else 0 for d in t.shape)
    return np.zeros((0, *dims), dtype=dtype)


def _stack(parts: list[np.ndarray], axis: int, info: ValueInfo, what: str) -> np.ndarray:
    if not parts:
        empty = _empty_stack(info)
        return np.moveaxis(empty, 0, axis) if empty.ndim > axis else empty
    try:
        return np.stack(parts, axis=axis)
    except ValueError as e:
        shapes = sorted({tuple(np.shape(p)) for p in parts})
        raise RunFailure(f"{what} has different shapes in different iterations ({shapes}): {e}") from None


@register("If", since=1)
class If(Kernel):
    def setup(self) -> None:
        self.then_branch = self.ctx.compile(self.required_attr("then_branch"))
        self.else_branch = self.ctx.compile(self.required_attr("else_branch"))

    def execute(self, inputs: Sequence[Any], scope: Mapping[str, Any]) -> tuple:
        branch = self.then_branch if _scalar_bool(inputs[0], "If condition") else self.else_branch
        return tuple(branch.run([], scope))


@register("Loop", since=1)
class Loop(Kernel):
    def setup(self) -> None:
        body: Graph = self.required_attr("body")
        self.body = self.ctx.compile(body)
        self.n_carried = len(self.node.inputs) - 2
        if len(body.inputs) != self.n_carried + 2:
            self.fail(f"body has {len(body.inputs)} inputs; expected {self.n_carried + 2} "
                      "(iteration number, condition, and one per loop-carried value)")
        if len(body.outputs) < self.n_carried + 1:
            self.fail(f"body has {len(body.outputs)} outputs; expected at least {self.n_carried + 1} "
                      "(condition and one per loop-carried value)")
        self.scan_infos = body.outputs[1 + self.n_carried:]

    def execute(self, inputs: Sequence[Any], scope: Mapping[str, Any]) -> tuple:
        trip_count, cond, *carried = list(inputs) + [None] * (2 - len(inputs))
        limit = None if trip_count is None else int(np.asarray(trip_count).reshape(-1)[0])
        keep_going = True if cond is None else _scalar_bool(cond, "Loop condition")
        cond_value = np.array(keep_going)
        scans: list[list[np.ndarray]] = [[] for _ in self.scan_infos]
        i = scanned = 0
        while keep_going and (limit is None or i < limit):
            outs = self.body.run([np.array(i, dtype=np.int64), cond_value, *carried], scope)
            cond_value = outs[0]
            carried = outs[1:1 + self.n_carried]
            for acc, value in zip(scans, outs[1 + self.n_carried:]):
                acc.append(value)
                scanned += np.asarray(value).nbytes
            if scanned >= CHECK_THRESHOLD:  # the stacked outputs will need as much again
                check_allocation(2 * scanned, f"{self.node.label()} scan outputs after {i + 1} iterations")
            keep_going = _scalar_bool(cond_value, "Loop body condition output")
            i += 1
        stacked = [_stack(acc, 0, info, f"Loop scan output '{info.name}'") for acc, info in zip(scans, self.scan_infos)]
        return (*carried, *stacked)


def _axis(axis: int, rank: int, what: str) -> int:
    if not -rank <= axis < rank:
        raise RunFailure(f"{what} {axis} is out of range for rank {rank}")
    return axis % rank


@register("Scan", since=9)
class Scan(Kernel):
    def setup(self) -> None:
        body: Graph = self.required_attr("body")
        self.body = self.ctx.compile(body)
        self.n_scan_in = self.required_attr("num_scan_inputs")
        self.n_states = len(self.node.inputs) - self.n_scan_in
        n_scan_out = len(body.outputs) - self.n_states
        if self.n_states < 0 or n_scan_out < 0:
            self.fail(f"num_scan_inputs={self.n_scan_in} does not fit {len(self.node.inputs)} inputs and "
                      f"{len(body.outputs)} body outputs")
        self.in_axes = self.attr("scan_input_axes", [0] * self.n_scan_in)
        self.in_reverse = [bool(d) for d in self.attr("scan_input_directions", [0] * self.n_scan_in)]
        self.out_axes = self.attr("scan_output_axes", [0] * n_scan_out)
        self.out_reverse = [bool(d) for d in self.attr("scan_output_directions", [0] * n_scan_out)]
        if len(self.in_axes) != self.n_scan_in or len(self.in_reverse) != self.n_scan_in:
            self.fail(f"scan_input_axes/scan_input_directions need {self.n_scan_in} entries")
        if len(self.out_axes) != n_scan_out or len(self.out_reverse) != n_scan_out:
            self.fail(f"scan_output_axes/scan_output_directions need {n_scan_out} entries")
        self.scan_infos = body.outputs[self.n_states:]

    def execute(self, inputs: Sequence[Any], scope: Mapping[str, Any]) -> tuple:
        states = list(inputs[:self.n_states])
        xs = inputs[self.n_states:]
        axes = [_axis(a, np.ndim(x), "scan_input_axes entry") for a, x in zip(self.in_axes, xs)]
        lengths = {x.shape[a] for x, a in zip(xs, axes)}
        if len(lengths) > 1:
            raise RunFailure(f"Scan inputs have different lengths along their scan axes: {sorted(lengths)}")
        n = lengths.pop() if lengths else 0
        scans: list[list[np.ndarray]] = [[] for _ in self.scan_infos]
        for t in range(n):
            slices = [np.take(x, n - 1 - t if rev else t, axis=a) for x, a, rev in zip(xs, axes, self.in_reverse)]
            outs = self.body.run([*states, *slices], scope)
            states = outs[:self.n_states]
            for acc, value in zip(scans, outs[self.n_states:]):
                acc.append(value)
            scanned = sum(np.asarray(acc[-1]).nbytes for acc in scans if acc) * (t + 1)
            if scanned >= CHECK_THRESHOLD:  # the stacked outputs will need as much again
                check_allocation(2 * scanned, f"{self.node.label()} scan outputs after {t + 1} iterations")
        stacked = []
        for acc, axis, rev, info in zip(scans, self.out_axes, self.out_reverse, self.scan_infos):
            parts = acc[::-1] if rev else acc
            rank = (np.ndim(parts[0]) if parts else _empty_stack(info).ndim - 1) + 1
            stacked.append(_stack(parts, _axis(axis, rank, "scan_output_axes entry"), info,
                                  f"Scan output '{info.name}'"))
        return (*states, *stacked)


@register("Scan", since=8)
class ScanBatched(Kernel):
    """Scan-8: axis 0 of every state and scan input is a batch axis, scanned along axis 1 per batch row."""

    def setup(self) -> None:
        body: Graph = self.required_attr("body")
        self.body = self.ctx.compile(body)
        self.n_scan_in = self.required_attr("num_scan_inputs")
        self.n_states = len(self.node.inputs) - 1 - self.n_scan_in
        if self.n_states < 0:
            self.fail(f"num_scan_inputs={self.n_scan_in} does not fit {len(self.node.inputs)} inputs")
        self.reverse = [bool(d) for d in self.attr("directions", [0] * self.n_scan_in)]
        self.scan_infos = body.outputs[self.n_states:]

    def execute(self, inputs: Sequence[Any], scope: Mapping[str, Any]) -> tuple:
        seq_lens, states0, xs = inputs[0], inputs[1:1 + self.n_states], inputs[1 + self.n_states:]
        batch, max_len = (xs[0].shape[0], xs[0].shape[1]) if xs else (states0[0].shape[0], 0)
        lens = [max_len] * batch if seq_lens is None else [int(v) for v in np.asarray(seq_lens).reshape(-1)]
        final_states: list[list[np.ndarray]] = [[] for _ in states0]
        scan_rows: list[list[np.ndarray]] = [[] for _ in self.scan_infos]
        for b in range(batch):
            states = [s[b] for s in states0]
            steps: list[list[np.ndarray]] = [[] for _ in self.scan_infos]
            n = lens[b]
            for t in range(n):
                slices = [x[b, n - 1 - t if rev else t] for x, rev in zip(xs, self.reverse)]
                outs = self.body.run([*states, *slices], scope)
                states = outs[:self.n_states]
                for acc, value in zip(steps, outs[self.n_states:]):
                    acc.append(value)
            for acc, s in zip(final_states, states):
                acc.append(s)
            for rows, acc, info in zip(scan_rows, steps, self.scan_infos):
                rows.append(self._padded(acc, max_len, info))
        outs_states = [np.stack(acc) for acc in final_states]
        outs_scans = [_stack(rows, 0, info, f"Scan output '{info.name}'") for rows, info in
                      zip(scan_rows, self.scan_infos)]
        return (*outs_states, *outs_scans)

    @staticmethod
    def _padded(parts: list[np.ndarray], max_len: int, info: ValueInfo) -> np.ndarray:
        """Stack one batch row's outputs, zero-padded to the longest sequence (the spec leaves the pad undefined)."""
        stacked = _stack(parts, 0, info, f"Scan output '{info.name}'")
        if stacked.shape[0] == max_len:
            return stacked
        pad = np.zeros((max_len - stacked.shape[0], *stacked.shape[1:]), dtype=stacked.dtype)
        return np.concatenate([stacked, pad])


@register("SequenceMap", since=17)
class SequenceMap(Kernel):
    def setup(self) -> None:
        self.body = self.ctx.compile(self.required_attr("body"))
        self.n_outputs = len(self.node.outputs)

    def execute(self, inputs: Sequence[Any], scope: Mapping[str, Any]) -> tuple:
        first = inputs[0]
        if not isinstance(first, list):
            raise RunFailure("SequenceMap's first input must be a sequence")
        for extra in inputs[1:]:
            if isinstance(extra, list) and len(extra) != len(first):
                raise RunFailure(f"SequenceMap input sequences differ in length: {len(first)} and {len(extra)}")
        results: list[list[Any]] = [[] for _ in range(self.n_outputs)]
        for i in range(len(first)):
            args = [x[i] if isinstance(x, list) else x for x in inputs]
            for acc, value in zip(results, self.body.run(args, scope)):
                acc.append(value)
        return tuple(results)
