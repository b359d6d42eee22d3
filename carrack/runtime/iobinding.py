"""IOBinding: onnxruntime's way of binding inputs and outputs (arrays, raw CPU buffers, OrtValues) before a run.

Bound inputs are used without copying; an output bound to a preallocated buffer receives the result in that buffer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from carrack.errors import InvalidArgument
from carrack.runtime.ortvalue import OrtValue, _require_cpu, element_dtype

if TYPE_CHECKING:
    from carrack.runtime.options import RunOptions
    from carrack.runtime.session import InferenceSession


def array_at(buffer_ptr: int, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """A writable numpy view of `prod(shape)` elements of `dtype` at the CPU address `buffer_ptr` (not copied)."""
    dims = tuple(int(d) for d in shape)
    count = int(np.prod(dims, dtype=np.int64))
    if count and not buffer_ptr:
        raise InvalidArgument(f"buffer_ptr is null for a tensor of shape {list(dims)}")
    if count == 0:
        return np.empty(dims, dtype)
    raw = (ctypes.c_byte * (count * dtype.itemsize)).from_address(int(buffer_ptr))
    return np.frombuffer(raw, dtype=dtype).reshape(dims)


class IOBinding:
    """``session.io_binding()`` (or ``IOBinding(session)``): bind, then ``session.run_with_iobinding(binding)``."""

    def __init__(self, session: InferenceSession):
        self._session = session
        self._inputs: dict[str, Any] = {}
        self._outputs: dict[str, OrtValue | None] = {}  # None: let the run allocate it
        self._results: list[OrtValue] = []

    # -- inputs ----------------------------------------------------------------------------------------------------
    def bind_cpu_input(self, name: str, arr_on_cpu: Any) -> None:
        self._inputs[self._input_name(name)] = arr_on_cpu

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any, shape: Sequence[int],
                   buffer_ptr: int) -> None:
        """Bind the tensor already at `buffer_ptr` (CPU memory the caller keeps alive for the run)."""
        _require_cpu(device_type)
        self._inputs[self._input_name(name)] = array_at(buffer_ptr, shape, element_dtype(element_type))

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self._inputs[self._input_name(name)] = _checked_ortvalue(name, ortvalue).numpy()

    def synchronize_inputs(self) -> None:
        """Nothing to wait for on the CPU."""

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    # -- outputs ---------------------------------------------------------------------------------------------------
    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0, element_type: Any = None,
                    shape: Sequence[int] | None = None, buffer_ptr: int | None = None) -> None:
        """Bind an output: to a buffer at `buffer_ptr` of that type and shape, or (no buffer) to memory the run
        allocates."""
        _require_cpu(device_type)
        name = self._output_name(name)
        if buffer_ptr is None:
            self._outputs[name] = None
            return
        if element_type is None or shape is None:
            raise InvalidArgument(f"bind_output('{name}') with a buffer_ptr needs its element_type and shape")
        self._outputs[name] = OrtValue(array_at(buffer_ptr, shape, element_dtype(element_type)))

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        self._outputs[self._output_name(name)] = _checked_ortvalue(name, ortvalue)

    def synchronize_outputs(self) -> None:
        """Nothing to wait for on the CPU."""

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._results = []

    def get_outputs(self) -> list[OrtValue]:
        """The bound outputs of the last run, in binding order."""
        return list(self._results)

    def get_outputs_as_ortvaluevector(self) -> list[OrtValue]:
        return self.get_outputs()

    def copy_outputs_to_cpu(self) -> list[Any]:
        """Copies of the last run's outputs as numpy arrays."""
        return [_copy(v.numpy()) for v in self._results]

    # -- the run ---------------------------------------------------------------------------------------------------
    def run(self, run_options: RunOptions | None = None) -> None:
        names = list(self._outputs)
        if not names:
            raise InvalidArgument("run_with_iobinding: no output is bound (bind_output or bind_ortvalue_output)")
        values = self._session.run(names, self._inputs, run_options)
        self._results = [self._deliver(name, value) for name, value in zip(names, values)]

    def _deliver(self, name: str, value: Any) -> OrtValue:
        bound = self._outputs[name]
        if bound is None:
            return OrtValue(value)
        target = bound.numpy()
        if not isinstance(value, np.ndarray) or value.shape != target.shape or value.dtype != target.dtype:
            got = f"{value.dtype} {list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
            raise InvalidArgument(f"output '{name}' is bound to a {target.dtype} buffer of shape "
                                  f"{list(target.shape)}, but the run produced {got}")
        np.copyto(target, value)
        return bound

    def _input_name(self, name: str) -> str:
        known = [v.name for v in self._session.get_inputs()] + [
            v.name for v in self._session.get_overridable_initializers()]
        if name not in known:
            raise InvalidArgument(f"cannot bind input '{name}': the model's inputs are {known}")
        return name

    def _output_name(self, name: str) -> str:
        known = [v.name for v in self._session.get_outputs()]
        if name not in known:
            raise InvalidArgument(f"cannot bind output '{name}': the model's outputs are {known}")
        return name


#: onnxruntime's name for the object IOBinding wraps; carrack has one class for both
SessionIOBinding = IOBinding


def _checked_ortvalue(name: str, value: Any) -> OrtValue:
    if not isinstance(value, OrtValue):
        raise InvalidArgument(f"'{name}' must be bound to an OrtValue, got {type(value).__name__}")
    return value


def _copy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
