"""``carrack gguf info FILE`` and ``carrack gguf dump FILE --tensor NAME [--save out.npy]``."""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any

import numpy as np

from carrack.gguf.reader import GGUFField, GGUFFile, GGUFTensor
from carrack.gguf.types import GGML_NUMPY_DTYPES, GGMLType, GGUFValueType

MAX_ITEMS_SHOWN = 6
MAX_STRING_SHOWN = 80


def add_gguf_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the `gguf` command (with `info` and `dump`) to carrack's subcommands."""
    g = subparsers.add_parser("gguf", help="inspect GGUF model files")
    sub = g.add_subparsers(dest="gguf_command", required=True)
    info = sub.add_parser("info", help="metadata, tensor table and totals by type of a GGUF file")
    info.add_argument("file")
    info.set_defaults(func=cmd_info)
    dump = sub.add_parser("dump", help="print (and optionally save) one tensor's values")
    dump.add_argument("file")
    dump.add_argument("--tensor", required=True, metavar="NAME")
    dump.add_argument("--save", metavar="OUT.npy", help="save the values (dequantized if quantized) with np.save")
    dump.set_defaults(func=cmd_dump)
    return g


def cmd_info(args: argparse.Namespace) -> int:
    with GGUFFile(args.file) as f:
        print(
            f"file: {f.path}  (GGUF v{f.version}, {f.byte_order}-endian, {f.file_size} bytes, "
            f"alignment {f.alignment}, tensor data at offset {f.data_offset})"
        )
        print(f"metadata ({len(f.fields)} keys):")
        key_width = max((len(k) for k in f.fields), default=0)
        for field in f.fields.values():
            print(f"  {field.key:{key_width}s}  {_type_label(field):14s}  {_format_value(field.value)}")
        _print_tensor_table(list(f.tensors.values()))
    return 0


def cmd_dump(args: argparse.Namespace) -> int:
    with GGUFFile(args.file) as f:
        if args.tensor not in f.tensors:
            close = [n for n in f.tensors if args.tensor in n][:10]
            hint = f"; names containing it: {', '.join(close)}" if close else ""
            raise SystemExit(f"carrack: {args.file} has no tensor named '{args.tensor}'{hint}")
        tensor = f.tensors[args.tensor]
        print(
            f"{tensor.name}: {tensor.type.name} shape {list(tensor.shape)} ({tensor.n_elements} elements, "
            f"{tensor.nbytes} bytes at offset {tensor.offset})"
        )
        values = tensor_values(tensor)
        print(f"values: {values.dtype} {list(values.shape)}")
        with np.printoptions(precision=4, threshold=50, edgeitems=3):
            print(values)
        if values.size:
            as64 = values.astype(np.float64)
            print(f"min {as64.min():.6g}  max {as64.max():.6g}  mean {as64.mean():.6g}  std {as64.std():.6g}")
        if args.save:
            saved = values.astype(np.float32) if values.dtype == GGML_NUMPY_DTYPES[GGMLType.BF16] else values
            np.save(args.save, np.ascontiguousarray(saved), allow_pickle=False)  # .npy has no bfloat16: float32
            print(f"saved {saved.dtype} {list(saved.shape)} to {args.save}")
    return 0


def tensor_values(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's values: its own dtype for plain types, dequantized (float32) for block-quantized ones."""
    if not tensor.type.is_quantized:
        return np.array(tensor.data())  # a copy, independent of the file mapping
    from carrack.gguf.dequant import dequantize  # written separately; only needed for quantized tensors

    return np.asarray(dequantize(tensor.raw(), tensor.type, tensor.shape))


def _print_tensor_table(tensors: list[GGUFTensor]) -> None:
    print(f"tensors ({len(tensors)}):")
    if not tensors:
        return
    rows = [(t.name, t.type.name, str(list(t.shape)), str(t.nbytes)) for t in tensors]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(("name", "type", "shape", "bytes"))]
    header = ("name", "type", "shape", "bytes")
    for row in (header, *rows):
        cells = [cell.rjust(w) if i == 3 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        print("  " + "  ".join(cells).rstrip())
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in tensors:
        entry = totals[t.type.name]
        entry[0] += 1
        entry[1] += t.n_elements
        entry[2] += t.nbytes
    print("totals by type:")
    for name, (count, elements, nbytes) in sorted(totals.items(), key=lambda kv: -kv[1][2]):
        print(f"  {name:8s} {count:6d} tensors  {elements:14d} elements  {nbytes:14d} bytes")
    all_elements = sum(t.n_elements for t in tensors)
    all_bytes = sum(t.nbytes for t in tensors)
    print(f"  {'total':8s} {len(tensors):6d} tensors  {all_elements:14d} elements  {all_bytes:14d} bytes")


def _type_label(field: GGUFField) -> str:
    if field.type != GGUFValueType.ARRAY:
        return field.type.name.lower()
    assert field.element_type is not None
    return f"[{field.element_type.name.lower()} x {len(field.value)}]"


def _format_value(value: Any) -> str:
    if isinstance(value, str):
        return _abbreviate_string(value)
    if isinstance(value, (np.ndarray, list)):
        items = [_format_value(v) for v in value[:MAX_ITEMS_SHOWN]]
        if len(value) > MAX_ITEMS_SHOWN:
            items.append(f"... ({len(value)} items)")
        return "[" + ", ".join(items) + "]"
    if isinstance(value, (float, np.floating)):
        return f"{float(value):.7g}"  # float32 values without their float64 noise
    if isinstance(value, np.generic):
        return repr(value.item())
    return repr(value)


def _abbreviate_string(s: str) -> str:
    if len(s) <= MAX_STRING_SHOWN:
        return repr(s)
    return repr(s[:MAX_STRING_SHOWN]) + f"... ({len(s)} chars)"
