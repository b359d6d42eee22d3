"""The channel-blocked layout pass: chains of float convolutions run on [N, C/16, H, W, 16] tensors.

onnxruntime reorders chains of convolutions into NCHWc (each pixel's channels in blocks of the vector width) so
that no convolution packs its input, maps have no pixel tails and each pixel's channel block is one cache line.
This pass does the same for carrack, after the fusions (so residual Adds and activations are already inside
FusedConv): every 2-D Conv / FusedConv of group 1 with a constant float32 weight whose input and output channel
counts are multiples of 16, output rows at least MIN_OUTPUT_WIDTH wide (and, with a residual, a residual of the
output's shape), connected to another such convolution through its input or residual, becomes a
carrack.BlockedConv node (blockconv.c). A chain of them exchanges blocked tensors; a carrack.BlockChannels node
converts a value entering the chain, an UnblockChannels node each chain value read by anything else (a pool, a
graph output). A convolution with no blocked neighbour is left as it is (a reorder on each side would cost more
than it saves), and so is every model with channel counts that are not multiples of 16.

It runs in an InferenceSession's plan where blockconv.c has its AVX-512 tile (`session_blocked_layout`) when the
session's options ask for it: ``add_session_config_entry("carrack.blocked_layout", "1")`` (or, for every session
of a process, the environment variable CARRACK_BLOCKED_LAYOUT=1). It is off by default:
inside resnet50 the blocked convolutions win on the 56x56 layers but lose to packconv.c where a layer's weights
come from memory (the 14x14 and 7x7 stages: packconv.c streams the next panel's weights while its 64-pixel tiles
run, a blocked tile reuses a weight load over at most 6 pixels), and the reorders at the chains' ends take the
rest, so the whole model is no faster with it (a quiet A/B ties: 57.3 vs 58.2 ms at one thread).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping

import numpy as np
from onnx import TensorProto

from carrack.ir.graph import Graph, Node
from carrack.native.convolution import ACTIVATIONS
from carrack.passes.facts import Fact, tensor_fact
from carrack.passes.shape_inference import rule
from carrack.passes.shape_rules import window_dims

#: SessionOptions config entry: "1" (the pass runs where blockconv.c is vectorized) or "0" (the default)
CONFIG_KEY = "carrack.blocked_layout"
#: environment variable giving the default of CONFIG_KEY for every session of the process
ENV_KEY = "CARRACK_BLOCKED_LAYOUT"
CARRACK = "carrack"
MS = "com.microsoft"
BLOCK = 16
#: output rows narrower than this stay NCHW: a row of 7 runs as a 6-pixel tile and a 1-pixel one (two tiles each
#: loading every weight for 7 pixels), which packconv.c's 64-pixel panels over the whole map beat (resnet50's 7x7
#: stage: 1.2-1.4x packconv's time blocked)
MIN_OUTPUT_WIDTH = 8
#: suffix of a blocked value's name (the NCHW value it holds keeps its own name)
SUFFIX = "__nchw16c"

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("carrack_blocked_layout", default=False)


def enabled_by(options) -> bool:
    """Whether a session with these SessionOptions asks for the pass (its config entry, else the environment's
    CARRACK_BLOCKED_LAYOUT, else off)."""
    entries = getattr(options, "_configs", None) or {}
    value = str(entries.get(CONFIG_KEY, os.environ.get(ENV_KEY, "0"))).strip().lower()
    if value not in ("0", "1", "true", "false", "on", "off"):
        from carrack.errors import InvalidArgument

        raise InvalidArgument(f"session config entry {CONFIG_KEY!r} must be '1' or '0', got {value!r}")
    # a compiled executor compiles the plan's model, whose emitters know the plain convolutions only
    return value in ("1", "true", "on") and not entries.get("session.carrack.compiled_executor")


@contextlib.contextmanager
def session_blocked_layout(on: bool = True) -> Iterator[None]:
    """Plans built inside (an InferenceSession's) run the pass where blockconv.c is vectorized, when `on`."""
    from carrack.native import blockconv

    token = _ENABLED.set(on and blockconv.vectorized())
    try:
        yield
    finally:
        _ENABLED.reset(token)


def active() -> bool:
    return _ENABLED.get()


def _ints(node: Node, name: str, default: list[int]) -> list[int]:
    return [int(v) for v in node.attrs.get(name, default)]


def _blockable(node: Node, constants: Mapping[str, np.ndarray], facts: Mapping[str, Fact]) -> bool:
    """Whether `node` is a convolution blockconv.c runs (see the module's docstring)."""
    if not ((node.op_type == "Conv" and node.domain == "") or
            (node.op_type == "FusedConv" and node.domain in (MS, CARRACK))):
        return False
    inputs = node.inputs
    if len(inputs) < 2 or not inputs[0] or len(node.outputs) != 1:
        return False
    w = constants.get(inputs[1])
    if not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.ndim != 4:
        return False
    if w.shape[0] % BLOCK or w.shape[1] % BLOCK or int(node.attrs.get("group", 1)) != 1:
        return False
    if len(inputs) > 2 and inputs[2]:
        b = constants.get(inputs[2])
        if not isinstance(b, np.ndarray) or b.dtype != np.float32 or b.shape != (w.shape[0],):
            return False
    attrs = node.attrs
    if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
        return False
    if list(attrs.get("kernel_shape", w.shape[2:])) != list(w.shape[2:]):
        return False
    if attrs.get("activation", "") not in ACTIVATIONS:
        return False
    x, y = facts.get(inputs[0]), facts.get(node.outputs[0])
    if x is None or y is None or x.shape is None or y.shape is None or len(x.shape) != 4 or len(y.shape) != 4:
        return False
    if x.tensor.elem_type != TensorProto.FLOAT or x.shape[1] != w.shape[1]:
        return False
    if not isinstance(y.shape[3], int) or y.shape[3] < MIN_OUTPUT_WIDTH:
        return False
    if len(inputs) > 3 and inputs[3]:
        z = facts.get(inputs[3])
        if z is None or z.shape is None or tuple(z.shape) != tuple(y.shape):
            return False
    return True


def _blocked_attrs(node: Node, kernel: tuple[int, ...]) -> dict:
    attrs = {"kernel_shape": [int(k) for k in kernel], "strides": _ints(node, "strides", [1, 1]),
             "pads": _ints(node, "pads", [0, 0, 0, 0]), "dilations": _ints(node, "dilations", [1, 1])}
    if node.attrs.get("activation", ""):
        attrs["activation"] = node.attrs["activation"]
        params = node.attrs.get("activation_params")
        if params:
            attrs["activation_params"] = [float(v) for v in params]
    return attrs


def _chains(blockable: list[Node], producer: Mapping[str, Node]) -> list[list[Node]]:
    """The blockable convolutions grouped by chain (connected through an input or residual), in graph order."""
    parent = {id(n): id(n) for n in blockable}

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for node in blockable:
        for name in _blocked_inputs(node):
            source = producer.get(name)
            if source is not None and id(source) in parent:
                parent[root(id(source))] = root(id(node))
    groups: dict[int, list[Node]] = {}
    for node in blockable:
        groups.setdefault(root(id(node)), []).append(node)
    return list(groups.values())


def _blocked_inputs(node: Node) -> list[str]:
    """The inputs of a convolution that are blocked in a chain: X, and Z when it has one."""
    return [node.inputs[0]] + ([node.inputs[3]] if len(node.inputs) > 3 and node.inputs[3] else [])


def apply_blocked_layout(graph: Graph, facts: Mapping[str, Fact]) -> int:
    """Rewrite `graph`'s chains of blockable convolutions (see the module's docstring) in place; returns how many
    convolutions now run blocked."""
    constants = graph.initializers
    blockable = [n for n in graph.nodes if _blockable(n, constants, facts)]
    if len(blockable) < 2:
        return 0
    producer = {o: n for n in graph.nodes for o in n.outputs if o}
    chosen = [chain for chain in _chains(blockable, producer) if len(chain) >= 2]
    if not chosen:
        return 0
    in_chain = {id(n) for chain in chosen for n in chain}
    readers: dict[str, list[tuple[Node, int]]] = {}
    for n in graph.nodes:
        for k, name in enumerate(n.inputs):
            readers.setdefault(name, []).append((n, k))
        for sub in n.subgraphs():  # a subgraph reads outer values by name: keep those plain
            for name in sub.free_names():
                readers.setdefault(name, []).append((n, -1))
    taken = set(producer) | set(constants) | {v.name for v in graph.inputs}
    graph_outputs = {v.name for v in graph.outputs}

    def fresh(base: str) -> str:
        name, k = base + SUFFIX, 1
        while name in taken:
            name, k = f"{base}{SUFFIX}_{k}", k + 1
        taken.add(name)
        return name

    blocked: dict[str, str] = {}  # plain value name -> its blocked value's name
    nodes: list[Node] = []
    for node in graph.nodes:
        if id(node) not in in_chain:
            nodes.append(node)
            continue
        for name in _blocked_inputs(node):
            if name not in blocked:  # enters the chain here
                blocked[name] = fresh(name)
                nodes.append(Node("BlockChannels", [name], [blocked[name]], {}, domain=CARRACK,
                                  name=f"{node.name or name}_block"))
        out = node.outputs[0]
        blocked[out] = fresh(out)
        w = constants[node.inputs[1]]
        inputs = [blocked[node.inputs[0]], node.inputs[1], node.inputs[2] if len(node.inputs) > 2 else "",
                  blocked[node.inputs[3]] if len(node.inputs) > 3 and node.inputs[3] else ""]
        while not inputs[-1]:
            inputs.pop()
        nodes.append(Node("BlockedConv", inputs, [blocked[out]], _blocked_attrs(node, w.shape[2:]), domain=CARRACK,
                          name=node.name))
        plain_readers = [r for r, k in readers.get(out, []) if id(r) not in in_chain or k not in (0, 3)]
        if plain_readers or out in graph_outputs:
            nodes.append(Node("UnblockChannels", [blocked[out]], [out], {}, domain=CARRACK,
                              name=f"{node.name or out}_unblock"))
    graph.nodes[:] = nodes
    return len(in_chain)


@rule("BlockedConv", domain=CARRACK)
def blocked_conv_rule(node, ins, version):
    """[N, C/16, H, W, 16] -> [N, M/16, OH, OW, 16] (M: the weight's output channels)."""
    x, w = ins[0].shape, ins[1].shape
    if x is None or w is None or len(x) != 5:
        return [tensor_fact(ins[0].elem_type, None)]
    kernel = node.attrs.get("kernel_shape") or list(w[2:])
    out_blocks = w[0] // BLOCK if isinstance(w[0], int) else None
    return [tensor_fact(ins[0].elem_type, (x[0], out_blocks, *window_dims(node, x[2:4], kernel), BLOCK))]


@rule("BlockChannels", domain=CARRACK)
def block_channels_rule(node, ins, version):
    x = ins[0].shape
    if x is None or len(x) != 4:
        return [tensor_fact(ins[0].elem_type, None)]
    blocks = x[1] // BLOCK if isinstance(x[1], int) else None
    return [tensor_fact(ins[0].elem_type, (x[0], blocks, x[2], x[3], BLOCK))]


@rule("UnblockChannels", domain=CARRACK)
def unblock_channels_rule(node, ins, version):
    x = ins[0].shape
    if x is None or len(x) != 5:
        return [tensor_fact(ins[0].elem_type, None)]
    channels = x[1] * BLOCK if isinstance(x[1], int) else None
    return [tensor_fact(ins[0].elem_type, (x[0], channels, x[2], x[3]))]
