"""`carrack.CompiledModel(DIR)`: a model built by ``carrack compile --target native``, run with the session's API.

Inputs are accepted in any layout numpy can describe (any alignment, strides or byte order): each is copied into
a 64-byte-aligned, C-ordered, native-endian buffer of its element type (float32, int64, int32, int16, bool, uint8, int8)
when it is not one already. The run-time dims are read
from the inputs' shapes and checked against the declared maxima before the library is called.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from carrack.errors import CarrackError, InvalidArgument, RunFailure

ALIGNMENT = 64
#: the most dims an input or output of a compiled model may have (the C API's shape buffers)
MAX_RANK_IO = 16
#: the manifest's element types: numpy dtype and the session's type string
DTYPES = {"float32": (np.dtype("=f4"), "tensor(float)"), "int64": (np.dtype("=i8"), "tensor(int64)"),
          "int32": (np.dtype("=i4"), "tensor(int32)"), "bool": (np.dtype("bool"), "tensor(bool)"),
          "uint8": (np.dtype("u1"), "tensor(uint8)"), "int8": (np.dtype("i1"), "tensor(int8)"),
          "int16": (np.dtype("=i2"), "tensor(int16)")}


def aligned_empty(count: int, dtype: np.dtype, alignment: int = ALIGNMENT) -> np.ndarray:
    """A 1-D array of `count` elements whose data starts on an `alignment`-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(count * dtype.itemsize + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + count * dtype.itemsize].view(dtype)


#: library path -> (library, its weights, the lock its runs take): a process loads a library once (a second
#: dlopen of the same file returns the same handle, whose arena and weights pointer are shared)
_LOADED: dict[str, tuple[ctypes.CDLL, np.ndarray, threading.Lock]] = {}
_LOADING = threading.Lock()


def _load_library(library: Path, weights_path: Path, weight_bytes: int, embedded: bool = False):
    key = str(library.resolve())
    with _LOADING:
        if key in _LOADED:
            return _LOADED[key]
        lib = ctypes.CDLL(key)
        lib.model_init.argtypes = [ctypes.c_void_p]
        lib.model_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.model_arena_bytes.argtypes = [ctypes.c_void_p]
        lib.model_arena_bytes.restype = ctypes.c_int64
        lib.model_output_shape.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        if embedded:  # the library holds its weights: model_init(NULL) points at them
            code = lib.model_init(None)
            if code:
                raise CarrackError(f"CompiledModel: model_init failed with code {code}")
            _LOADED[key] = (lib, None, threading.Lock())
            return _LOADED[key]
        raw = np.fromfile(weights_path, dtype=np.uint8)
        if raw.size != weight_bytes:
            raise CarrackError(f"CompiledModel: {weights_path.name} holds {raw.size} bytes, model.json says "
                               f"{weight_bytes}")
        weights = aligned_empty(max(1, raw.size), np.uint8)
        weights[:raw.size] = raw
        code = lib.model_init(weights.ctypes.data)
        if code:
            raise CarrackError(f"CompiledModel: model_init failed with code {code}")
        _LOADED[key] = (lib, weights, threading.Lock())
        return _LOADED[key]


class IOInfo:
    """An input's or output's name, type and shape (symbolic dims as names), like a session's NodeArg."""

    def __init__(self, entry: Mapping[str, Any]):
        self.name: str = entry["name"]
        self.shape: list[int | str] = list(entry["shape"])
        self.dtype: str = entry.get("dtype", "float32")
        self.type = DTYPES[self.dtype][1]

    def __repr__(self) -> str:
        return f"IOInfo(name={self.name!r}, type={self.type!r}, shape={self.shape})"


class CompiledModel:
    """A compiled model directory (`carrack compile ... --target native`) loaded with ctypes."""

    def __init__(self, directory: str | os.PathLike):
        from carrack.backends.c.build import library_name

        self.directory = Path(directory)
        manifest_path = self.directory / "model.json"
        if not manifest_path.is_file():
            raise CarrackError(f"CompiledModel: '{self.directory}' holds no model.json; make it with "
                               "carrack compile MODEL.onnx -o DIR --target native")
        self.manifest = json.loads(manifest_path.read_text())
        library = self.directory / library_name()
        if not library.is_file():
            raise CarrackError(f"CompiledModel: '{self.directory}' holds no {library.name}; it was compiled for "
                               "another target: compile it with --target native")
        weights = self.manifest["weights"]
        self._lib, self._weights, self._lock = _load_library(library, self.directory / weights["file"],
                                                             weights["bytes"], weights.get("embedded", False))
        self._dims = [d["name"] for d in self.manifest["dims"]]
        self._maxima = {d["name"]: d["max"] for d in self.manifest["dims"]}
        self._inputs = [IOInfo(e) for e in self.manifest["inputs"]]
        self._outputs = [IOInfo(e) for e in self.manifest["outputs"]]

    def get_inputs(self) -> list[IOInfo]:
        return list(self._inputs)

    def get_outputs(self) -> list[IOInfo]:
        return list(self._outputs)

    def arena_bytes(self, dims: Mapping[str, int]) -> int:
        """Arena bytes a run with these run-time dims uses (at most the capacity fixed at compile time)."""
        values = np.array([int(dims[name]) for name in self._dims] or [0], dtype=np.int64)
        return int(self._lib.model_arena_bytes(values.ctypes.data))

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        """Outputs for `input_feed` (name -> array), like `InferenceSession.run`."""
        unknown = sorted(set(input_feed) - {i.name for i in self._inputs})
        if unknown:
            raise InvalidArgument(f"CompiledModel.run: unknown input name(s) {unknown}; the model's inputs are "
                                  f"{[i.name for i in self._inputs]}")
        sizes: dict[str, int] = {}
        buffers = [self._input_buffer(info, input_feed, sizes) for info in self._inputs]
        dims = np.array([sizes.get(name, 1) for name in self._dims] or [0], dtype=np.int64)
        outputs = []
        shape = np.zeros(MAX_RANK_IO, dtype=np.int64)
        for k in range(len(self._outputs)):
            rank = self._lib.model_output_shape(k, dims.ctypes.data, shape.ctypes.data)
            dims_k = tuple(int(d) for d in shape[:rank])
            dtype = DTYPES[self._outputs[k].dtype][0]
            outputs.append(aligned_empty(int(np.prod(dims_k)), dtype).reshape(dims_k))
        in_pointers = (ctypes.c_void_p * max(1, len(buffers)))(*[b.ctypes.data for b in buffers])
        out_pointers = (ctypes.c_void_p * max(1, len(outputs)))(*[o.ctypes.data for o in outputs])
        with self._lock:  # one static arena per library
            code = self._lib.model_run(dims.ctypes.data, in_pointers, out_pointers)
        if code:
            reason = self.manifest["run_errors"].get(str(code), "unknown error")
            raise RunFailure(f"CompiledModel.run: the compiled model failed with code {code}: {reason}")
        if output_names is None:
            return outputs
        names = [o.name for o in self._outputs]
        missing = [n for n in output_names if n not in names]
        if missing:
            raise InvalidArgument(f"CompiledModel.run: unknown output name(s) {missing}; outputs are {names}")
        return [outputs[names.index(n)] for n in output_names]

    def _input_buffer(self, info: IOInfo, feed: Mapping[str, Any], sizes: dict[str, int]) -> np.ndarray:
        if info.name not in feed:
            raise InvalidArgument(f"CompiledModel.run: missing input '{info.name}' ({info.dtype} {info.shape})")
        value = np.asarray(feed[info.name])
        expected = DTYPES[info.dtype][0]
        if value.dtype.newbyteorder("=") != expected:
            raise InvalidArgument(f"CompiledModel.run: input '{info.name}' must be {info.dtype}, got {value.dtype}")
        if value.ndim != len(info.shape):
            raise InvalidArgument(f"CompiledModel.run: input '{info.name}' must have rank {len(info.shape)} "
                                  f"(shape {info.shape}), got shape {list(value.shape)}")
        for axis, (want, got) in enumerate(zip(info.shape, value.shape)):
            if isinstance(want, int):
                if want != got:
                    raise InvalidArgument(f"CompiledModel.run: input '{info.name}' dim {axis} must be {want}, "
                                          f"got {got} (shape {list(value.shape)})")
                continue
            if want not in self._maxima:
                raise InvalidArgument(f"CompiledModel.run: input '{info.name}' dim {axis} is '{want}', an "
                                      "expression the loader cannot read sizes from")
            if sizes.setdefault(want, got) != got:
                raise InvalidArgument(f"CompiledModel.run: dim '{want}' is {sizes[want]} in one input and {got} "
                                      f"in input '{info.name}'")
            if not 1 <= got <= self._maxima[want]:
                raise InvalidArgument(f"CompiledModel.run: input '{info.name}' dim {axis} ('{want}') must be in "
                                      f"1..{self._maxima[want]} (its declared maximum), got {got}")
        ready = (value.dtype == expected and value.flags.c_contiguous
                 and value.ctypes.data % ALIGNMENT == 0)
        if ready:
            return value
        buffer = aligned_empty(value.size, expected).reshape(value.shape)
        buffer[...] = value  # any strides or byte order, converted in the copy
        return buffer
