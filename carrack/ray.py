"""Batch inference on Ray Data: one carrack session per actor, built from a compiled plan shipped once.

``carrack.ray.predict(dataset, model)`` puts the session (its optimized plan: graph, constants, expressions) in Ray's
object store once; every actor of the pool unpickles it into an executor without optimizing the graph again, sets
``intra_op_num_threads`` from the CPUs Ray gave it, and scores the batches ``Dataset.map_batches`` hands it.
``CarrackPredictor`` is the class-based UDF for those who call ``map_batches`` themselves.

Needs the optional dependency: ``pip install 'carrack[ray]'``.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

try:
    import ray
    import ray.data
    from ray.data.block import BlockAccessor
except ImportError as e:  # the optional extra is missing: say which one
    raise ImportError(f"carrack.ray needs Ray Data: pip install 'carrack[ray]' ({e})") from e

import carrack
from carrack.errors import InvalidArgument, RunFailure

ERROR_COLUMN = "error"
# bookkeeping columns the CLI reads for its per-worker summary and drops before writing
WORKER_COLUMN = "__carrack_worker"
SECONDS_COLUMN = "__carrack_seconds"
ON_ERROR = ("raise", "column")

_NUMPY_OF = {"float": np.float32, "double": np.float64, "float16": np.float16, "int64": np.int64,
             "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "uint16": np.uint16,
             "uint32": np.uint32, "uint64": np.uint64, "bool": np.bool_}

class MalformedRows(InvalidArgument):
    """Rows of a batch the model cannot take (wrong shape or type, a missing value, NaN where refused)."""

    def __init__(self, problems: Mapping[Any, str]):
        self.problems = dict(problems)
        shown = "; ".join(f"row id {rid!r}: {why}" for rid, why in list(self.problems.items())[:5])
        more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        super().__init__(f"{len(self.problems)} malformed row(s): {shown}{more}; "
                         "pass on_error='column' (CLI: --on-error column) to score the rest and record these")


def _load_session(model: Any) -> carrack.InferenceSession:
    """A session from an object-store reference (the plan as the driver compiled it), a session, or a model file."""
    if isinstance(model, ray.ObjectRef):
        model = ray.get(model)
    if isinstance(model, carrack.InferenceSession):
        return model
    return carrack.InferenceSession(model)


def _assigned_cpus() -> int:
    """The CPUs Ray allocated to this actor (1 outside an actor or with a fractional allocation)."""
    if not ray.is_initialized():  # asking the runtime context would start a local Ray instance
        return 1
    try:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    except AssertionError:  # Ray asserts the caller is a worker: this is the driver
        return 1
    return max(1, int(cpus))


def _element_dtype(arg: carrack.NodeArg) -> np.dtype:
    kind = arg.type[len("tensor("):-1] if arg.type.startswith("tensor(") else arg.type
    if kind not in _NUMPY_OF:
        raise InvalidArgument(f"model input '{arg.name}' has type {arg.type}; carrack.ray feeds numeric tensors only")
    return np.dtype(_NUMPY_OF[kind])


def batch_columns(batch: Any) -> dict[str, np.ndarray]:
    """A Ray Data batch (dict of numpy arrays, pandas DataFrame, pyarrow Table) as one numpy array per column;
    tensor columns come back as (rows, ...) arrays, ragged ones as object arrays of per-row arrays."""
    if isinstance(batch, Mapping):
        return {name: np.asarray(values) if not isinstance(values, np.ndarray) else values
                for name, values in batch.items()}
    return dict(BlockAccessor.for_block(batch).to_numpy())


class CarrackPredictor:
    """Class-based UDF for ``ray.data.Dataset.map_batches``: one carrack session per actor.

    ``model``: the ``ray.ObjectRef`` of a session the driver put in the object store (what ``predict`` passes; the
    actor unpickles the compiled plan and optimizes nothing), a session, or a model path (then each actor compiles).
    ``input_columns``: model input name -> dataset column (inputs not named read the column of the same name; a
    model with one input and no such column reads the batch's only column besides the id).
    ``output_columns``: the outputs to return, as a list of names or a mapping output name -> column name
    (default: every output under its own name). Returns the id column and the outputs (``keep_columns=True``: every
    input column too); ``on_error='column'`` scores the good rows and writes the others' reasons to ``error``.
    ``preprocess``: a function of the column dict run first (normalising images, tokenising text, ...).
    """

    def __init__(self, model: Any, input_columns: Mapping[str, str] | None = None,
                 output_columns: Sequence[str] | Mapping[str, str] | None = None, id_column: str = "id",
                 on_error: str = "raise", check_finite: bool = False, keep_columns: bool = False,
                 preprocess: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
                 report_worker: bool = False, threads: int | None = None):
        if on_error not in ON_ERROR:
            raise InvalidArgument(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        started = time.perf_counter()
        self.session = _load_session(model)
        self.threads = threads or _assigned_cpus()
        # the session was unpickled in this process: its options are this actor's own copy
        self.session.get_session_options().intra_op_num_threads = self.threads
        self.inputs = self.session.get_inputs()
        self.input_dtypes = {arg.name: _element_dtype(arg) for arg in self.inputs}
        self.input_columns = _input_mapping(self.inputs, input_columns)
        self.output_columns = _output_mapping(self.session.get_outputs(), output_columns)
        self.id_column, self.on_error, self.check_finite = id_column, on_error, check_finite
        self.keep_columns, self.preprocess, self.report_worker = keep_columns, preprocess, report_worker
        self.worker = f"{ray.util.get_node_ip_address()}:{os.getpid()}" if ray.is_initialized() else str(os.getpid())
        self.load_seconds = time.perf_counter() - started

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        started = time.perf_counter()
        columns = batch_columns(batch)
        if self.preprocess is not None:
            columns = dict(self.preprocess(columns))
        if self.id_column not in columns:
            raise InvalidArgument(f"the batch has no id column '{self.id_column}' (columns: {sorted(columns)}); "
                                  "name it with id_column= (CLI: --id-column)")
        ids = columns[self.id_column]
        problems: dict[int, str] = {}
        feeds = {arg.name: self._feed_column(arg, columns, problems) for arg in self.inputs}
        self._check_finite(feeds, problems)
        if problems and self.on_error == "raise":
            raise MalformedRows({_plain(ids[i]): why for i, why in sorted(problems.items())})
        good = np.array([i for i in range(len(ids)) if i not in problems], dtype=np.int64)
        results, good = self._score(feeds, good, ids, problems)
        out = dict(columns) if self.keep_columns else {self.id_column: ids}
        out.update(_scatter(results, good, len(ids), self.output_columns, self.session.get_outputs()))
        if self.on_error == "column":
            out[ERROR_COLUMN] = np.array([problems.get(i) for i in range(len(ids))], dtype=object)
        if self.report_worker:
            out[WORKER_COLUMN] = np.full(len(ids), self.worker, dtype=object)
            out[SECONDS_COLUMN] = np.full(len(ids), (time.perf_counter() - started) / max(len(ids), 1))
        return out

    # -- feeding ---------------------------------------------------------------------------------------------------
    def _feed_column(self, arg: carrack.NodeArg, columns: dict[str, np.ndarray],
                     problems: dict[int, str]) -> list[np.ndarray | None] | np.ndarray:
        """The column for model input `arg`, cast to its type: a (rows, ...) array, or a list of per-row arrays
        (None for rows recorded in `problems`) when the rows do not stack."""
        name = self.input_columns.get(arg.name) or arg.name
        if name not in columns and len(self.inputs) == 1 and not self.input_columns:
            name = _only_data_column(columns, self.id_column) or name
        if name not in columns:
            raise InvalidArgument(f"model input '{arg.name}' reads column '{name}', which the batch lacks "
                                  f"(columns: {sorted(columns)}); map it with input_columns={{'{arg.name}': COLUMN}} "
                                  "(CLI: --input-column NAME=COLUMN)")
        values = columns[name]
        dtype, row_shape = self.input_dtypes[arg.name], _declared_row_shape(arg)
        if values.dtype != object:
            values = _channels_first(values, row_shape, batched=True)
            whole = _cast(values, dtype)
            if whole is not None and _shape_fits(whole.shape[1:], row_shape):
                return whole
        rows = []
        for i, value in enumerate(values):
            row, why = _row_value(value, dtype, row_shape, arg.name, name)
            rows.append(row)
            if why:
                problems.setdefault(i, why)
        return rows

    def _check_finite(self, feeds: dict[str, Any], problems: dict[int, str]) -> None:
        if not self.check_finite:
            return
        for name, values in feeds.items():
            if self.input_dtypes[name].kind != "f":
                continue
            if isinstance(values, np.ndarray):
                finite = np.isfinite(values.reshape(len(values), -1)).all(axis=1)
                values = [None if ok else values[i] for i, ok in enumerate(finite)]
            for i, row in enumerate(values):
                if row is not None and not np.all(np.isfinite(row)):
                    problems.setdefault(i, f"input '{name}' has NaN or infinity (refused: check_finite)")

    # -- running ---------------------------------------------------------------------------------------------------
    def _score(self, feeds: dict[str, Any], good: np.ndarray, ids: np.ndarray,
               problems: dict[int, str]) -> tuple[list[np.ndarray] | None, np.ndarray]:
        """Run the good rows as one batch; if the batch fails, row by row to name the rows that fail. Returns the
        outputs and the rows they are of."""
        if len(good) == 0:
            return None, good
        stacked, odd_shapes = _stack(feeds, good)
        failures = odd_shapes
        if not failures:
            try:
                return self.session.run(list(self.output_columns), stacked), good
            except Exception as batch_error:
                failures = self._failing_rows(feeds, good)
                if not failures:  # every row alone succeeds: the batch failed as a whole
                    raise RunFailure(f"the batch of rows with ids {_plain(ids[good[0]])!r}..{_plain(ids[good[-1]])!r}"
                                     f" failed: {batch_error}") from batch_error
        if self.on_error == "raise":
            raise MalformedRows({_plain(ids[i]): why for i, why in sorted(failures.items())})
        problems.update(failures)
        return self._score(feeds, np.array([i for i in good if i not in failures], np.int64), ids, problems)

    def _failing_rows(self, feeds: dict[str, Any], good: np.ndarray) -> dict[int, str]:
        failures = {}
        for i in good:
            row_feed = {name: values[i:i + 1] if isinstance(values, np.ndarray) else values[i][None]
                        for name, values in feeds.items()}
            try:
                self.session.run(list(self.output_columns), row_feed)
            except Exception as e:
                failures[int(i)] = f"the model failed on this row: {type(e).__name__}: {e}"
        return failures


def _stack(feeds: dict[str, Any], good: np.ndarray) -> tuple[dict[str, np.ndarray], dict[int, str]]:
    """The good rows of each input as one array, and the rows (batch positions) whose shape differs from the
    most common one (symbolic dims must agree within a batch)."""
    stacked, odd = {}, {}
    for name, values in feeds.items():
        if isinstance(values, np.ndarray):
            stacked[name] = values if len(good) == len(values) else values[good]
            continue
        shapes = {int(i): values[i].shape for i in good}
        common = Counter(shapes.values()).most_common(1)[0][0]
        for i, shape in shapes.items():
            if shape != common:
                odd.setdefault(i, f"input '{name}' has shape {shape}, the other rows of its batch {common}")
        if not odd:
            stacked[name] = np.stack([values[i] for i in good])
    return stacked, odd


def _scatter(results: list[np.ndarray] | None, good: np.ndarray, n: int, output_columns: dict[str, str],
             outputs: list[carrack.NodeArg]) -> dict[str, np.ndarray]:
    """Output columns of `n` rows: the results at the good rows, NaN (or 0 for integers) at the others."""
    declared = {arg.name: arg for arg in outputs}
    columns = {}
    for k, (output, column) in enumerate(output_columns.items()):
        if results is not None and len(good) == n:
            columns[column] = results[k]
            continue
        if results is not None:
            row_shape, dtype = results[k].shape[1:], results[k].dtype
        else:
            row_shape = tuple(d if isinstance(d, int) else 1 for d in (declared[output].shape or [None])[1:])
            dtype = np.dtype(np.float32)
        filled = np.full((n, *row_shape), np.nan if dtype.kind == "f" else 0, dtype=dtype)
        if results is not None:
            filled[good] = results[k]
        columns[column] = filled
    return columns


def _row_value(value: Any, dtype: np.dtype, row_shape: tuple, input_name: str,
               column: str) -> tuple[np.ndarray | None, str | None]:
    """One row's value as an array of the model's type, or None and why not."""
    if value is None or (isinstance(value, float) and np.isnan(value) and row_shape):
        return None, f"column '{column}' has no value (input '{input_name}')"
    try:
        array = np.asarray(value)
    except Exception:
        return None, f"column '{column}' value is not an array (input '{input_name}')"
    if array.dtype == object:
        try:
            array = np.stack([np.asarray(v) for v in array]) if array.ndim == 1 and array.size else array
        except Exception:
            return None, f"column '{column}' value is ragged, not a {dtype} tensor (input '{input_name}')"
    array = _channels_first(array, row_shape, batched=False)
    cast = _cast(array, dtype)
    if cast is None:
        return None, (f"column '{column}' holds {array.dtype} values {_preview(array)}, not convertible to {dtype} "
                      f"(input '{input_name}')")
    if not _shape_fits(cast.shape, row_shape):
        expected = tuple(d if isinstance(d, int) else "?" for d in row_shape)
        return None, f"column '{column}' value has shape {cast.shape}, input '{input_name}' expects {expected}"
    return cast, None


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """`values` as `dtype` when nothing is lost in meaning (None otherwise): numbers to floats, integers to
    integers, floats to integers only when every value is whole."""
    if values.dtype == dtype:
        return values
    kind = values.dtype.kind
    if kind not in "biuf":
        try:
            values = values.astype(np.float64)
        except (TypeError, ValueError):
            return None
        kind = "f"
    if dtype.kind in "iub" and kind == "f":
        if not np.all(np.isfinite(values)) or not np.all(values == np.round(values)):
            return None
    return values.astype(dtype)


def _channels_first(values: np.ndarray, row_shape: tuple, batched: bool) -> np.ndarray:
    """Images as Ray's image reader decodes them (height, width, channels) for a model that takes
    (channels, height, width): moved when the declared channel count matches the last axis only."""
    rank = values.ndim - (1 if batched else 0)
    if rank != 3 or len(row_shape) != 3 or not isinstance(row_shape[0], int):
        return values
    shape = values.shape[-3:]
    if shape[-1] == row_shape[0] and shape[0] != row_shape[0]:
        axes = (0, 3, 1, 2) if batched else (2, 0, 1)
        return np.ascontiguousarray(values.transpose(axes))
    return values


def _declared_row_shape(arg: carrack.NodeArg) -> tuple:
    return tuple((arg.shape or [None])[1:]) if arg.shape is not None else ()


def _shape_fits(shape: tuple, declared: tuple) -> bool:
    return len(shape) == len(declared) and all(not isinstance(d, int) or d == s for s, d in zip(shape, declared))


def _only_data_column(columns: Mapping[str, Any], id_column: str) -> str | None:
    """The batch's only column besides the id (and a reader's 'path'): what a one-input model reads when no column
    has its input's name (Ray's readers name it 'image' or 'data')."""
    others = [c for c in columns if c not in (id_column, "path")]
    return others[0] if len(others) == 1 else None


def _input_mapping(inputs: list[carrack.NodeArg], given: Mapping[str, str] | None) -> dict[str, str]:
    names = [arg.name for arg in inputs]
    unknown = sorted(set(given or {}) - set(names))
    if unknown:
        raise InvalidArgument(f"input_columns names {unknown}, which are not inputs of the model (inputs: {names})")
    return dict(given or {})


def _output_mapping(outputs: list[carrack.NodeArg], given: Sequence[str] | Mapping[str, str] | None) -> dict[str, str]:
    names = [arg.name for arg in outputs]
    if given is None:
        return {name: name for name in names}
    mapping = dict(given) if isinstance(given, Mapping) else {name: name for name in given}
    unknown = sorted(set(mapping) - set(names))
    if unknown:
        raise InvalidArgument(f"output_columns names {unknown}, which are not outputs of the model (outputs: {names})")
    return mapping


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _preview(array: np.ndarray) -> str:
    text = repr(array.reshape(-1)[:3].tolist())
    return text if len(text) < 60 else text[:57] + "..."


def predict(dataset: ray.data.Dataset, model: Any, *, input_columns: Mapping[str, str] | None = None,
            output_columns: Sequence[str] | Mapping[str, str] | None = None, id_column: str = "id",
            on_error: str = "raise", concurrency: int = 1, batch_size: int | None = 256, num_cpus: float = 1,
            batch_format: str = "numpy", check_finite: bool = False, keep_columns: bool = False,
            preprocess: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
            report_worker: bool = False, max_restarts: int = -1, max_task_retries: int = -1,
            sort: bool = False) -> ray.data.Dataset:
    """Score `dataset` with `model` on a pool of `concurrency` actors of `num_cpus` CPUs each.

    `model` (a session, a model path, or the ObjectRef of a session) is compiled once here, on the driver, and put
    in the object store once; actors load the plan from there. Actors that die are restarted and their batches
    retried (`max_restarts`, `max_task_retries`; -1: without limit). `sort=True` orders the result by `id_column`.
    """
    if not isinstance(model, ray.ObjectRef):
        model = ray.put(_load_session(model))
    options = dict(input_columns=input_columns, output_columns=output_columns, id_column=id_column,
                   on_error=on_error, check_finite=check_finite, keep_columns=keep_columns, preprocess=preprocess,
                   report_worker=report_worker)
    with warnings.catch_warnings():
        # Ray 2.60 deprecates actor options such as max_restarts given as keywords but names no replacement yet
        warnings.filterwarnings("ignore", message=".*ray_remote_args.* is deprecated")
        scored = dataset.map_batches(
            CarrackPredictor, fn_constructor_kwargs=dict(model=model, **options),
            compute=ray.data.ActorPoolStrategy(size=concurrency), batch_size=batch_size, num_cpus=num_cpus,
            batch_format=batch_format, max_restarts=max_restarts, max_task_retries=max_task_retries)
    return scored.sort(id_column) if sort else scored


__all__ = ["CarrackPredictor", "MalformedRows", "batch_columns", "predict", "ERROR_COLUMN"]
