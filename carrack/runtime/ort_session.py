"""The parts of onnxruntime's InferenceSession API beyond `run`: OrtValue runs, IOBinding, asynchronous runs,
providers, and the SessionOptions that change the model (free-dimension overrides, added initializers).

`InferenceSession` inherits `OrtSessionApi`; everything here goes through the session's own `run`.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from carrack.errors import InvalidArgument, RunTerminated, UnknownProvider
from carrack.ir.dims import Sym
from carrack.ir.graph import Model, ValueInfo
from carrack.ir.types import TensorType
from carrack.runtime.environment import ALL_PROVIDERS, AVAILABLE_PROVIDERS
from carrack.runtime.iobinding import IOBinding
from carrack.runtime.options import RunOptions, SessionOptions
from carrack.runtime.ortvalue import OrtValue, as_value

_LOG = logging.getLogger("carrack")


class OrtSessionApi:
    """Mixed into InferenceSession; relies on its `run`, `get_inputs` and `_profiler`."""

    _fallback_enabled = True

    def _record_source(self, path_or_bytes: Any, providers: Sequence[Any] | None,
                       provider_options: Sequence[Any] | None) -> None:
        """onnxruntime's private attributes that libraries read (optimum reads `_model_path`)."""
        is_path = isinstance(path_or_bytes, (str, os.PathLike))
        self._model_path = os.fspath(path_or_bytes) if is_path else None
        self._model_bytes = path_or_bytes if isinstance(path_or_bytes, (bytes, bytearray)) else None
        self._check_providers_at_start(providers)
        self._providers = list(AVAILABLE_PROVIDERS)
        self._provider_options = provider_options

    def io_binding(self) -> IOBinding:
        return IOBinding(self)  # type: ignore[arg-type]

    def run_with_iobinding(self, iobinding: IOBinding, run_options: RunOptions | None = None) -> None:
        binding = getattr(iobinding, "_iobinding", iobinding)  # onnxruntime's wrapper keeps the binding there
        if not isinstance(binding, IOBinding):
            raise InvalidArgument(f"run_with_iobinding expects session.io_binding(), got {type(iobinding).__name__}")
        binding.run(run_options)

    def run_with_ort_values(self, output_names: Sequence[str] | None, input_dict_ort_values: Mapping[str, OrtValue],
                            run_options: RunOptions | None = None) -> list[OrtValue]:
        """`run` with OrtValues in and out."""
        if not isinstance(input_dict_ort_values, Mapping):
            raise InvalidArgument("run_with_ort_values expects a dict of input name -> OrtValue")
        feed = {name: as_value(value) for name, value in input_dict_ort_values.items()}
        return [OrtValue(v) for v in self.run(output_names, feed, run_options)]  # type: ignore[attr-defined]

    def run_async(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                  callback: Callable[[list[Any], Any, str], None], user_data: Any,
                  run_options: RunOptions | None = None) -> None:
        """Run on another thread, then call ``callback(outputs, user_data, error_message)``: outputs is empty and
        the message says why when the run failed ('' when it succeeded)."""
        if not callable(callback):
            raise InvalidArgument(f"run_async: callback must be callable, got {type(callback).__name__}")

        def work() -> None:
            try:
                outputs = self.run(output_names, input_feed, run_options)  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001 - reported to the callback, as onnxruntime does
                callback([], user_data, str(e))
                return
            callback(outputs, user_data, "")

        threading.Thread(target=work, name="carrack-run-async", daemon=True).start()

    def set_providers(self, providers: Sequence[Any] | None = None,
                      provider_options: Sequence[Mapping[str, Any]] | None = None) -> None:
        """carrack runs on its CPU engine whatever the list says: as onnxruntime without those providers, a known but
        unavailable provider (CUDA ...) gets a UserWarning and the CPU; an unknown name raises RuntimeError."""
        _check_providers(providers, unknown_falls_back=False)

    def _check_providers_at_start(self, providers: Sequence[Any] | None) -> None:
        # at construction onnxruntime falls back to the CPU for unknown names too (with fallback enabled)
        _check_providers(providers, unknown_falls_back=True)

    def disable_fallback(self) -> None:
        self._fallback_enabled = False

    def enable_fallback(self) -> None:
        self._fallback_enabled = True

    def get_profiling_start_time_ns(self) -> int:
        """When profiling started (ns since the epoch); 0 when the session does not profile."""
        profiler = self._profiler  # type: ignore[attr-defined]
        return 0 if profiler is None else profiler.start_time_ns

    def create_ortvalue_from_shape_and_type(self, shape: Sequence[int], element_type: Any,
                                            device: Any = None) -> OrtValue:
        return OrtValue.ortvalue_from_shape_and_type(shape, element_type)


def _check_providers(providers: Sequence[Any] | None, unknown_falls_back: bool) -> None:
    for provider in providers or ():
        name = provider[0] if isinstance(provider, tuple) else provider
        if name in AVAILABLE_PROVIDERS:
            continue
        if name not in ALL_PROVIDERS and not unknown_falls_back:
            raise UnknownProvider(f"Unknown Provider Type: {name}")
        warnings.warn(f"Specified provider '{name}' is not in available provider names. Available providers: "
                      f"'{', '.join(AVAILABLE_PROVIDERS)}' (carrack runs on its CPU engine)", UserWarning,
                      stacklevel=4)


_TERMINATE_FLAG = operator.attrgetter("terminate")


def terminate_check(run_options: RunOptions | None) -> Callable[[], bool] | None:
    """A callable the run loop calls between nodes: true once run_options.terminate is set. A run whose flag is
    already set stops before its first node."""
    if run_options is None:
        return None
    if run_options.terminate:
        raise RunTerminated()
    return functools.partial(_TERMINATE_FLAG, run_options)  # C-level calls: cheap once per node


def apply_session_options(model: Model, options: SessionOptions) -> Model:
    """The model as SessionOptions change it: free dims fixed by name or denotation, initializers added."""
    model = _fix_free_dims(model, options._free_dims, options._free_dims_by_denotation)
    if options._initializers:
        model = _add_initializers(model, options._initializers)
    return model


def _fix_free_dims(model: Model, by_name: Mapping[str, int], by_denotation: Mapping[str, int]) -> Model:
    if not by_name and not by_denotation:
        return model
    graph = model.graph
    sizes: dict[Sym, int] = {Sym(name): size for name, size in by_name.items()}
    fixed_axes: dict[tuple[str, int], int] = {}
    for (input_name, axis), denotation in model.dim_denotations.items():
        if denotation in by_denotation:
            fixed_axes[(input_name, axis)] = by_denotation[denotation]
            dim = _input_dim(graph.inputs, input_name, axis)
            if isinstance(dim, Sym):
                sizes.setdefault(dim, by_denotation[denotation])

    def fix(v: ValueInfo, is_input: bool) -> ValueInfo:
        t = v.type
        if not isinstance(t, TensorType) or t.shape is None:
            return v
        shape = tuple(_fixed(d, sizes, fixed_axes.get((v.name, axis)) if is_input else None)
                      for axis, d in enumerate(t.shape))
        return v if shape == t.shape else replace(v, type=replace(t, shape=shape))

    graph = replace(graph, inputs=[fix(v, True) for v in graph.inputs],
                    outputs=[fix(v, False) for v in graph.outputs],
                    value_info={k: fix(v, False) for k, v in graph.value_info.items()})
    return replace(model, graph=graph)


def _fixed(dim: Any, sizes: Mapping[Sym, int], axis_size: int | None) -> Any:
    if isinstance(dim, int):
        return dim
    if axis_size is not None:
        return axis_size
    return sizes.get(dim, dim) if isinstance(dim, Sym) else dim


def _input_dim(inputs: list[ValueInfo], name: str, axis: int) -> Any:
    for v in inputs:
        if v.name == name and isinstance(v.type, TensorType) and v.type.shape is not None and axis < len(v.type.shape):
            return v.type.shape[axis]
    return None


def _add_initializers(model: Model, added: Mapping[str, OrtValue]) -> Model:
    """Initializers named in `added` take its values; other names are ignored (with a warning), as onnxruntime
    ignores them."""
    graph = model.graph
    unknown = sorted(set(added) - set(graph.initializers))
    if unknown:
        _LOG.warning("SessionOptions.add_initializer: the model has no initializer named %s (ignored)", unknown)
    initializers = dict(graph.initializers)
    for name, value in added.items():
        array = value.numpy()
        if not isinstance(array, np.ndarray):
            raise InvalidArgument(f"SessionOptions.add_initializer('{name}'): the OrtValue must hold a tensor")
        if name in initializers:
            initializers[name] = array
    return replace(model, graph=replace(graph, initializers=initializers))
