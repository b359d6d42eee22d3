"""An InferenceSession that runs a compiled native library instead of its Python program when the inputs allow.

    options = carrack.SessionOptions()
    options.add_session_config_entry("session.carrack.compiled_executor", "native")
    options.add_session_config_entry("session.carrack.compiled_max_dims", "batch=8")   # every symbolic dim
    session = carrack.InferenceSession("model.onnx", options)

At session creation the plan is compiled (`carrack compile --target native` into a temporary directory, with the
system C compiler); a run whose inputs are arrays of the inputs' types within the declared maxima goes to the
library (no per-node Python dispatch), any other run (other dtypes, larger dims, profiling, overridden initializers)
to the session's own program. A model with operators the C backend lacks warns once and keeps the Python program.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from carrack.backends.c.compiled import DTYPES
from carrack.errors import InvalidArgument, UnsupportedModel

EXECUTOR_KEY = "session.carrack.compiled_executor"
MAX_DIMS_KEY = "session.carrack.compiled_max_dims"


def _config(options, key: str) -> str:
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:
        return ""


def parse_max_dims(text: str) -> dict[str, int]:
    """'batch=8,sequence=128' -> {'batch': 8, 'sequence': 128}."""
    sizes = {}
    for item in filter(None, (part.strip() for part in text.replace(";", ",").split(","))):
        name, _, value = item.partition("=")
        if not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise InvalidArgument(f"{MAX_DIMS_KEY}: expected NAME=SIZE entries separated by commas (SIZE >= 1), "
                                  f"got '{item}'")
        sizes[name.strip()] = int(value)
    return sizes


class CompiledExecutor:
    """The compiled library of a session's plan, and the test of whether a run's inputs fit it."""

    def __init__(self, directory: str):
        from carrack.backends.c.compiled import CompiledModel

        self.directory = directory
        self.model = CompiledModel(directory)
        self._inputs = self.model.get_inputs()
        self._maxima = {d["name"]: d["max"] for d in self.model.manifest["dims"]}
        weakref.finalize(self, shutil.rmtree, directory, True)

    def fits(self, feed: Mapping[str, Any]) -> bool:
        if set(feed) != {i.name for i in self._inputs}:
            return False
        sizes: dict[str, int] = {}
        for info in self._inputs:
            value = feed[info.name]
            if not isinstance(value, np.ndarray) or value.dtype != DTYPES[info.dtype][0] \
                    or value.ndim != len(info.shape):
                return False
            for want, got in zip(info.shape, value.shape):
                if isinstance(want, int):
                    if want != got:
                        return False
                elif want not in self._maxima or not 1 <= got <= self._maxima[want] or sizes.setdefault(want,
                                                                                                        got) != got:
                    return False
        return True

    def run(self, feed: Mapping[str, Any]) -> list[np.ndarray]:
        return self.model.run(None, feed)


def compiled_executor(plan, options) -> CompiledExecutor | None:
    """The session's compiled executor when its options ask for one (None otherwise, or when the model has
    operators the C backend lacks, with a warning)."""
    target = _config(options, EXECUTOR_KEY)
    if not target:
        return None
    if target != "native":
        raise InvalidArgument(f"{EXECUTOR_KEY} must be 'native' (the only executor a session loads), got '{target}'")
    from carrack.backends.c.build import compile_model

    maxima = parse_max_dims(_config(options, MAX_DIMS_KEY))
    directory = tempfile.mkdtemp(prefix="carrack-compiled-")
    try:
        compile_model(plan.model, directory, "native", max_dims=maxima)
    except UnsupportedModel as e:
        shutil.rmtree(directory, ignore_errors=True)
        warnings.warn(f"{EXECUTOR_KEY}: the model runs on the session's own program: {e}", stacklevel=3)
        return None
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return CompiledExecutor(directory)
