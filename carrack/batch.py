"""``carrack batch``: score a Parquet file (or a folder of .npy files or images) with a model on Ray, locally or on a
cluster, and write the outputs next to the id column as Parquet, sorted by id.

The model is compiled once, here on the driver; its plan goes to the workers through Ray's object store
(carrack.ray.predict). With no ``--address`` a local Ray instance is started (loopback, no dashboard, a small
object store); with one, the job joins that cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import carrack
from carrack.errors import CarrackError, InvalidArgument

LOCAL_OBJECT_STORE_BYTES = 256 * 2**20
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
PROGRESS_EVERY_S = 1.0


def add_batch_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("batch", help="score a Parquet file or a folder of .npy files / images on Ray (pip install "
                                     "'carrack[ray]')")
    b.add_argument("model")
    b.add_argument("--input", required=True, help="Parquet file or folder, or a folder of .npy files or images")
    b.add_argument("--output", required=True, help="Parquet file to write (outputs next to the id column)")
    b.add_argument("--input-column", action="append", metavar="NAME=COLUMN",
                   help="feed model input NAME from dataset column COLUMN (default: the column of the same name)")
    b.add_argument("--output-column", action="append", metavar="NAME[=COLUMN]",
                   help="write model output NAME (as COLUMN); default: every output under its own name")
    b.add_argument("--id-column", default="id", help="the row id column (files: their names); default 'id'")
    b.add_argument("--batch-size", type=int, default=256)
    b.add_argument("--workers", type=int, default=1, help="actors, each with its own session (default 1)")
    b.add_argument("--cpus-per-worker", type=float, default=1, help="CPUs (and intra-op threads) per actor")
    b.add_argument("--address", help="join a Ray cluster: 'auto' or HOST:PORT (default: start a local instance)")
    b.add_argument("--on-error", choices=["raise", "column"], default="raise",
                   help="a malformed row stops the job naming the row (raise) or goes to an 'error' column")
    b.add_argument("--check-finite", action="store_true", help="refuse rows with NaN or infinity in float inputs")
    b.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    b.set_defaults(func=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    try:
        from carrack import ray as carrack_ray
    except ImportError as e:
        raise SystemExit(f"carrack batch: {e}") from None
    if args.workers < 1 or args.batch_size < 1:
        raise SystemExit("carrack batch: --workers and --batch-size must be at least 1")
    session = carrack.InferenceSession(args.model)
    connect(args.address, args.workers, args.cpus_per_worker)
    dataset, total = read_input(args.input, args.id_column)
    # blocks of several batches each, enough of them that every worker gets some
    dataset = dataset.repartition(max(1, min(-(-total // args.batch_size), 8 * args.workers)))
    started = time.perf_counter()
    scored = carrack_ray.predict(
        dataset, session, input_columns=parse_pairs(args.input_column, "--input-column"),
        output_columns=parse_outputs(args.output_column), id_column=args.id_column, on_error=args.on_error,
        concurrency=args.workers, batch_size=args.batch_size, num_cpus=args.cpus_per_worker,
        check_finite=args.check_finite, report_worker=True)
    try:
        table = collect(scored, total, quiet=args.quiet)
    except Exception as e:  # Ray wraps the worker's exception: report the carrack error inside it
        raise CarrackError(root_message(e)) from None
    elapsed = time.perf_counter() - started
    table, workers = finish(table, total, args.id_column)
    write_parquet(table, args.output)
    print_summary(table, elapsed, workers, args)
    return 0


# -- Ray ---------------------------------------------------------------------------------------------------------------
def connect(address: str | None, workers: int, cpus_per_worker: float) -> None:
    """Join the cluster at `address`, or start a local instance with room for the workers and a reader."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    logging.getLogger("ray.data").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"ray\..*")
    if not ray.is_initialized():
        if address:
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        else:
            cpus = max(os.cpu_count() or 1, int(np.ceil(workers * cpus_per_worker))) + 1
            ray.init(num_cpus=cpus, object_store_memory=LOCAL_OBJECT_STORE_BYTES, include_dashboard=False,
                     _node_ip_address="127.0.0.1", logging_level="WARNING", log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the progress lines are ours (rows/s on stderr)
    context.print_on_execution_start = False


def read_input(path: str, id_column: str) -> tuple[Any, int]:
    """The dataset at `path` and its row count: Parquet, or one row per .npy file / image (id: the file name)."""
    import ray

    if "://" in path:  # object storage (s3://, gs://, ...): Parquet, read by Ray where its tasks run
        return _parquet(ray.data.read_parquet(path), path, id_column)
    source = Path(path)
    if not source.exists():
        raise InvalidArgument(f"--input {path}: no such file or folder")
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    suffixes = {p.suffix.lower() for p in files}
    if suffixes and suffixes <= {".parquet"} or not source.is_dir():
        return _parquet(ray.data.read_parquet(str(source)), path, id_column)
    if suffixes == {".npy"}:
        dataset = ray.data.read_binary_files([str(p) for p in files], include_paths=True)
        return dataset.map_batches(_decode_npy, fn_kwargs={"id_column": id_column}, batch_format="numpy"), len(files)
    if suffixes <= IMAGE_SUFFIXES:
        dataset = ray.data.read_images([str(p) for p in files], include_paths=True)
        return dataset.map_batches(_id_from_path, fn_kwargs={"id_column": id_column}, batch_format="numpy"), len(files)
    raise InvalidArgument(f"--input {path}: a folder of Parquet, .npy or image files only (found {sorted(suffixes)})")


def _parquet(dataset: Any, path: str, id_column: str) -> tuple[Any, int]:
    columns = dataset.schema().names
    if id_column not in columns:
        raise InvalidArgument(f"--input {path} has no id column '{id_column}' (columns: {columns}); "
                              "name one with --id-column")
    return dataset, dataset.count()


def _decode_npy(batch: dict[str, np.ndarray], id_column: str) -> dict[str, np.ndarray]:
    import io

    arrays = [np.load(io.BytesIO(raw), allow_pickle=False) for raw in batch["bytes"]]
    shapes = {a.shape for a in arrays}
    data = np.stack(arrays) if len(shapes) == 1 else _object_array(arrays)
    return {id_column: _names(batch["path"]), "data": data}


def _id_from_path(batch: dict[str, np.ndarray], id_column: str) -> dict[str, np.ndarray]:
    return {id_column: _names(batch["path"]), "image": batch["image"]}


def _names(paths: np.ndarray) -> np.ndarray:
    return np.array([os.path.basename(str(p)) for p in paths], dtype=object)


def _object_array(items: list) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def collect(scored: Any, total: int, quiet: bool = False) -> Any:
    """Stream the scored batches to the driver, printing rows done and rows/s to stderr."""
    import pyarrow as pa

    tables, done = [], 0
    started = last = time.perf_counter()
    for batch in scored.iter_batches(batch_format="pyarrow", batch_size=None):
        tables.append(batch)
        done += batch.num_rows
        now = time.perf_counter()
        if not quiet and (now - last >= PROGRESS_EVERY_S or done == total):
            last = now
            rate = done / max(now - started, 1e-9)
            share = f" ({100 * done / total:.0f}%)" if total else ""
            end = "\r" if sys.stderr.isatty() and done < total else "\n"
            print(f"carrack batch: {done:,}/{total:,} rows{share}, {rate:,.0f} rows/s", end=end, file=sys.stderr,
                  flush=True)
    # a batch without errors has an all-null error column: unify it with the string one of other batches
    return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})


def root_message(error: BaseException) -> str:
    """The message of the carrack error a Ray task raised, without Ray's wrapping: Ray keeps only the text of
    the worker's traceback, whose line 'carrack.<module>.<Error>: message' is the one to show."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, CarrackError):
            return str(seen)
        for line in reversed(str(seen).splitlines()):
            name, sep, message = line.strip().partition(": ")
            if sep and name.startswith("carrack.") and " " not in name:
                return message
        seen = getattr(seen, "cause", None) or seen.__cause__
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__


# -- output ------------------------------------------------------------------------------------------------------------
def finish(table: Any, total: int, id_column: str) -> tuple[Any, dict[str, tuple[int, float]]]:
    """Check every input row came back once, sort by id, and split off the per-worker bookkeeping columns."""
    import pyarrow.compute as pc

    from carrack.ray import SECONDS_COLUMN, WORKER_COLUMN

    if table.num_rows != total:
        raise CarrackError(f"{table.num_rows:,} rows came back for {total:,} input rows")
    distinct = len(pc.unique(table[id_column]))
    if distinct != table.num_rows:
        raise CarrackError(f"{table.num_rows - distinct:,} ids appear more than once in column '{id_column}' "
                           "(the input's ids must be unique)")
    table = table.sort_by(id_column)
    workers: dict[str, tuple[int, float]] = {}
    for worker, seconds in zip(table[WORKER_COLUMN].to_pylist(), table[SECONDS_COLUMN].to_pylist()):
        rows, busy = workers.get(worker, (0, 0.0))
        workers[worker] = (rows + 1, busy + seconds)
    return table.drop_columns([WORKER_COLUMN, SECONDS_COLUMN]), workers


def write_parquet(table: Any, path: str) -> None:
    """Tensor columns become fixed-size lists (their per-row shape in the field metadata), readable without Ray."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fields, columns = [], []
    for field, column in zip(table.schema, table.columns):
        if isinstance(field.type, pa.ExtensionType):
            values = np.stack(column.to_numpy(zero_copy_only=False)) if column.num_chunks else np.empty((0,))
            flat = values.reshape(len(values), -1)
            column = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
            field = pa.field(field.name, column.type, metadata={"carrack.shape": json.dumps(list(values.shape[1:]))})
        fields.append(field)
        columns.append(column)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_arrays(columns, schema=pa.schema(fields)), path)


def print_summary(table: Any, elapsed: float, workers: dict[str, tuple[int, float]], args: argparse.Namespace) -> None:
    from carrack.ray import ERROR_COLUMN

    rows = table.num_rows
    print(f"carrack batch: {rows:,} rows in {elapsed:.1f} s ({rows / max(elapsed, 1e-9):,.0f} rows/s) on "
          f"{len(workers)} worker(s); wrote {args.output}")
    for worker, (count, busy) in sorted(workers.items()):
        print(f"  worker {worker}: {count:,} rows, {busy:.1f} s busy, {count / max(busy, 1e-9):,.0f} rows/s")
    if ERROR_COLUMN in table.column_names:
        failed = rows - table[ERROR_COLUMN].null_count
        print(f"  {failed:,} malformed row(s): reasons in column '{ERROR_COLUMN}'")


# -- arguments ---------------------------------------------------------------------------------------------------------
def parse_pairs(items: Sequence[str] | None, flag: str) -> dict[str, str]:
    pairs = {}
    for item in items or ():
        name, sep, column = item.partition("=")
        if not sep or not name or not column:
            raise SystemExit(f"carrack batch: {flag} expects NAME=COLUMN, got '{item}'")
        pairs[name] = column
    return pairs


def parse_outputs(items: Sequence[str] | None) -> dict[str, str] | None:
    if not items:
        return None
    return {name: column or name for name, _, column in (item.partition("=") for item in items)}
