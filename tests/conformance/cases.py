"""The ONNX backend conformance cases, collected from the installed onnx package (no copied data).

* node cases: ``onnx.backend.test.case.node.collect_testcases`` (models and data built in memory);
* model folders shipped in the wheel: ``backend/test/data/{simple,pytorch-converted,pytorch-operator}``;
* ``light`` real-architecture models: fed onnx's dummy input (arange(n)/n, unknown dims = 1) and compared with the
  shipped ``*_output_0.pb`` at the tolerances from ``onnx.backend.test.case.model``.
"""

from __future__ import annotations

import functools
import glob
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

DATA_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
MODEL_GROUPS = ("simple", "pytorch-converted", "pytorch-operator")


@dataclass
class Case:
    id: str
    rtol: float
    atol: float
    model: onnx.ModelProto | None = None
    model_path: str | None = None
    data_sets: list[tuple[list[Any], list[Any]]] | None = None  # filled lazily for folder cases


@functools.lru_cache(maxsize=1)
def node_cases() -> dict[str, Case]:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    return {c.name: Case(c.name, c.rtol, c.atol, model=c.model,
                         data_sets=[([_as_value(a) for a in ins], [_as_value(o) for o in outs])
                                    for ins, outs in c.data_sets])
            for c in cases}


def _as_value(v: Any) -> Any:
    """onnx hands some exotic-typed data over as TensorProto; tests feed and compare numpy arrays."""
    return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v


def case_ops(case_id: str) -> set[str]:
    """The op types a node case is about: its graph's top-level ops, and those of its unexpanded twin."""
    cases = node_cases()
    ops = {n.op_type for n in cases[case_id].model.graph.node}
    if "_expanded" in case_id:
        twin = cases.get(case_id.split("_expanded")[0])
        if twin is not None:
            ops |= {n.op_type for n in twin.model.graph.node}
    return ops


def selected_node_case_ids() -> list[str]:
    """All node case ids; ``CARRACK_OPS=Relu,Add`` narrows them to cases about those ops (for kernel work)."""
    wanted = {o.strip() for o in os.environ.get("CARRACK_OPS", "").split(",") if o.strip()}
    ids = list(node_cases())
    return [c for c in ids if not wanted or case_ops(c) & wanted]


def folder_case_ids() -> list[str]:
    ids = []
    for group in MODEL_GROUPS:
        for d in sorted(glob.glob(os.path.join(DATA_DIR, group, "*", "model.onnx"))):
            ids.append(f"{group}/{os.path.basename(os.path.dirname(d))}")
    return ids


def light_case_ids() -> list[str]:
    return [f"light/{os.path.basename(p)[len('light_'):-len('.onnx')]}"
            for p in sorted(glob.glob(os.path.join(DATA_DIR, "light", "light_*.onnx")))]


def folder_case(case_id: str) -> Case:
    folder = os.path.join(DATA_DIR, case_id)
    path = os.path.join(folder, "model.onnx")
    model = onnx.load(path)
    types = {v.name: v.type for v in model.graph.input} | {v.name: v.type for v in model.graph.output}
    inits = {t.name for t in model.graph.initializer}
    in_types = [v.type for v in model.graph.input if v.name not in inits]
    out_types = [v.type for v in model.graph.output]
    del types
    data_sets = []
    for ds in sorted(glob.glob(os.path.join(folder, "test_data_set_*"))):
        n_in = len(glob.glob(os.path.join(ds, "input_*.pb")))
        n_out = len(glob.glob(os.path.join(ds, "output_*.pb")))
        ins = [_load_pb(os.path.join(ds, f"input_{i}.pb"), in_types[i]) for i in range(n_in)]
        outs = [_load_pb(os.path.join(ds, f"output_{i}.pb"), out_types[i]) for i in range(n_out)]
        data_sets.append((ins, outs))
    return Case(case_id, 1e-3, 1e-7, model=model, model_path=path, data_sets=data_sets)


def light_case(case_id: str) -> Case:
    from onnx.backend.test.case.model import collect_testcases

    name = case_id.split("/", 1)[1]
    tols = {c.model_name: (c.rtol, c.atol) for c in collect_testcases() if c.kind == "real"}
    rtol, atol = tols.get(name, (1e-3, 1e-7))
    path = os.path.join(DATA_DIR, "light", f"light_{name}.onnx")
    model = onnx.load(path)
    inits = {t.name for t in model.graph.initializer}
    ins = [_dummy_input(v) for v in model.graph.input if v.name not in inits]
    out = numpy_helper.to_array(_read_tensor(os.path.join(DATA_DIR, "light", f"light_{name}_output_0.pb")))
    return Case(case_id, rtol, atol, model=model, model_path=path, data_sets=[(ins, [out])])


def _dummy_input(v: onnx.ValueInfoProto) -> np.ndarray:
    shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in v.type.tensor_type.shape.dim)
    n = int(np.prod(shape))
    return (np.arange(n).reshape(shape) / n).astype(np.float32)


def _read_tensor(path: str) -> onnx.TensorProto:
    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return t


def _load_pb(path: str, tp: onnx.TypeProto) -> Any:
    with open(path, "rb") as f:
        data = f.read()
    if tp.HasField("sequence_type"):
        seq = onnx.SequenceProto()
        seq.ParseFromString(data)
        return numpy_helper.to_list(seq)
    if tp.HasField("optional_type"):
        opt = onnx.OptionalProto()
        opt.ParseFromString(data)
        return numpy_helper.to_optional(opt)
    t = onnx.TensorProto()
    t.ParseFromString(data)
    return numpy_helper.to_array(t)
