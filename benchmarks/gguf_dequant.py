"""Dequantization throughput, carrack vs gguf-py, per ggml type (a script, not a test).

    python benchmarks/gguf_dequant.py [--mb 100] [--types Q4_K,Q8_0] [--repeat 1] [--no-gguf]

For every type, random blocks (with finite f16 scales) totalling about --mb megabytes of raw data are decoded to
float32 by both implementations; the table shows raw megabytes decoded per second (best of --repeat) and checks that
the two results are equal. gguf-py is only needed to run the comparison, never by carrack itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from carrack.gguf.dequant import dequantize, supported_types  # noqa: E402
from carrack.gguf.types import GGML_BLOCK_SIZES, GGMLType  # noqa: E402


def random_raw(ggml_type: GGMLType, megabytes: float, rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, int]]:
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    per_row = max(1, 4096 // block_size)
    rows = max(1, int(megabytes * 1e6) // (per_row * type_size))
    if block_size == 1:  # plain types: real values of the stored dtype
        values = (rng.standard_normal((rows, per_row)) * 100).astype(ggml_type.numpy_dtype.newbyteorder("<"))
        return values.view(np.uint8).reshape(rows, -1), (rows, per_row)
    raw = rng.integers(0, 256, size=(rows, per_row * type_size), dtype=np.uint8)
    blocks = raw.reshape(rows * per_row, type_size)
    scale_fields = _f16_fields(ggml_type)
    for offset in scale_fields:
        scales = rng.uniform(-1, 1, len(blocks)).astype("<f2").view(np.uint8).reshape(-1, 2)
        blocks[:, offset : offset + 2] = scales
    return raw, (rows, per_row * block_size)


def _f16_fields(ggml_type: GGMLType) -> tuple[int, ...]:
    T = GGMLType
    last = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q6_K: (208,), T.TQ1_0: (52,), T.TQ2_0: (64,), T.Q4_1: (0, 2),
            T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2)}  # fmt: skip
    if ggml_type in last:
        return last[ggml_type]
    return () if ggml_type in (T.MXFP4, T.NVFP4, T.IQ1_M, T.Q8_K) else (0,)


def best_time(fn, repeat: int) -> tuple[float, np.ndarray]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="raw megabytes per type (default 100)")
    parser.add_argument("--types", default="", help="comma-separated type names (default: all)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-gguf", action="store_true", help="time carrack only")
    args = parser.parse_args()

    try:
        if args.no_gguf:
            raise ImportError
        import gguf
        import gguf.quants
    except ImportError:
        gguf = None
    types = [GGMLType[name] for name in args.types.split(",")] if args.types else supported_types()
    rng = np.random.default_rng(0)
    print(f"{'type':8s} {'MB':>7s} {'carrack MB/s':>13s} {'gguf-py MB/s':>13s} {'speed-up':>9s}  equal")
    for ggml_type in types:
        raw, shape = random_raw(ggml_type, args.mb, rng)
        mb = raw.nbytes / 1e6
        ours_s, ours = best_time(lambda: dequantize(raw, ggml_type, shape), args.repeat)  # noqa: B023
        line = f"{ggml_type.name:8s} {mb:7.1f} {mb / ours_s:13.1f}"
        gguf_type = gguf and gguf.GGMLQuantizationType(int(ggml_type))
        if gguf is not None and (gguf_type in gguf.quants._type_traits or gguf_type.name in ("F32", "F16")):
            with np.errstate(all="ignore"):
                ref_s, ref = best_time(lambda: gguf.quants.dequantize(raw, gguf_type), args.repeat)  # noqa: B023
            equal = np.array_equal(ours, np.asarray(ref, dtype=np.float32).reshape(shape), equal_nan=True)
            line += f" {mb / ref_s:13.1f} {ref_s / ours_s:8.2f}x  {equal}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
