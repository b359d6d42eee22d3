"""Weights are memory-mapped from external data files and used without a copy when aligned in the file.

A file offset that is a multiple of 64 maps to a 64-byte-aligned address (mappings start page-aligned), so such
tensors are read-only views of the file; odd offsets and byte-swapping get one aligned copy. The big test loads and
runs a model with ~200 MB of external weights in a fresh interpreter and bounds its peak RSS growth.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.onnx.importer import load_model
from carrack.onnx.tensors import IN_PLACE_RAW_BYTES
from tests.rss_probe import PEAK_RSS_PRELUDE

ALIGN = 64
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def external_tensor(name: str, dtype: np.dtype, shape: tuple[int, ...], location: str, offset: int,
                    length: int | None = None) -> TensorProto:
    t = TensorProto()
    t.name = name
    t.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    t.dims.extend(shape)
    t.data_location = TensorProto.EXTERNAL
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize if length is None else length
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def write_at(path: str, pieces: list[tuple[int, np.ndarray]]) -> None:
    """Write each array's little-endian bytes at its file offset (gaps are filled with 0xAB)."""
    end = max(off + a.nbytes for off, a in pieces)
    with open(path, "wb") as f:
        f.write(b"\xab" * end)
        for off, a in pieces:
            f.seek(off)
            f.write(np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes())


def mapping_of(a: np.ndarray):
    """The np.memmap (file mapping) an array is a view of, or None if it owns a copy."""
    base = a
    while base is not None and not isinstance(base, np.memmap):
        base = base.base if isinstance(base, np.ndarray) else None
    return base


def _model(nodes, inputs, outputs, inits) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_aligned_offsets_are_views_odd_offsets_are_copies(tmp_path):
    rng = np.random.default_rng(0)
    skews = {"w0": 0, "w64": 64, "w4096": 4096, "w1": 1, "w3": 3}
    arrays = {n: rng.standard_normal((128, 128)).astype(np.float32) for n in skews}  # 64 KiB each
    arrays["shape"] = np.array([128, 128], np.int64)
    offsets = {n: i * 81920 + skews.get(n, 0) for i, n in enumerate(arrays)}
    write_at(str(tmp_path / "weights.bin"), [(offsets[n], a) for n, a in arrays.items()])
    inits = [external_tensor(n, a.dtype, a.shape, "weights.bin", offsets[n]) for n, a in arrays.items()]
    names = list(skews)
    nodes = [helper.make_node("Sum", names, ["s"]), helper.make_node("Reshape", ["s", "shape"], ["r"]),
             helper.make_node("MatMul", ["x", "r"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 128])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 128])
    path = tmp_path / "model.onnx"
    onnx.save_model(_model(nodes, [x], [y], inits), str(path))

    graph = load_model(str(path)).graph
    for name, expected in arrays.items():
        w = graph.initializers[name]
        assert np.array_equal(w, expected) and w.dtype == expected.dtype and w.ctypes.data % ALIGN == 0, name
        if offsets[name] % ALIGN == 0 and expected.nbytes >= IN_PLACE_RAW_BYTES:
            assert mapping_of(w) is not None and not w.flags.writeable, f"{name} should be a view of the file"
        else:  # odd offset, or too small to be worth pinning the mapping
            assert mapping_of(w) is None, f"{name} must be an aligned copy"
    views = [graph.initializers[n] for n in ("w0", "w64", "w4096")]
    assert len({id(mapping_of(v)) for v in views}) == 1, "one mapping per file"

    # every initializer is external, and the model runs
    sess = carrack.InferenceSession(str(path))
    xv = rng.standard_normal((2, 128)).astype(np.float32)
    total = sum(arrays[n] for n in names)
    np.testing.assert_allclose(sess.run(None, {"x": xv})[0], xv @ total, rtol=1e-4, atol=1e-4)


def test_every_dtype_size_and_offset_from_external_files(tmp_path):
    """Each dtype at an aligned and at an odd offset, small and >= 64 KiB: values exact, always 64-byte aligned."""
    pieces, inits, expected = [], [], {}
    offset = 0
    for dtype in (np.float32, np.float64, np.float16, np.int64, np.int32, np.int8, np.uint8, np.bool_):
        for count in (5, IN_PLACE_RAW_BYTES // np.dtype(dtype).itemsize + 7):
            for skew in (0, 1, 3):
                values = (np.arange(count) % 11).astype(dtype)
                name = f"{np.dtype(dtype).name}_{count}_{skew}"
                pieces.append((offset + skew, values))
                inits.append(external_tensor(name, values.dtype, values.shape, "w.bin", offset + skew))
                expected[name] = values
                offset = (offset + skew + values.nbytes + 4095) // 4096 * 4096
    write_at(str(tmp_path / "w.bin"), pieces)
    outputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
               for n, v in expected.items()]
    onnx.save_model(_model([], [], outputs, inits), str(tmp_path / "m.onnx"))
    graph = load_model(str(tmp_path / "m.onnx")).graph
    for name, values in expected.items():
        w = graph.initializers[name]
        assert w.dtype == values.dtype and np.array_equal(w, values), name
        assert w.ctypes.data % ALIGN == 0, name
        in_place = name.endswith("_0") and values.nbytes >= IN_PLACE_RAW_BYTES
        assert (mapping_of(w) is not None) == in_place, name


def test_large_raw_data_inside_the_protobuf(tmp_path):
    values = np.random.default_rng(1).standard_normal(IN_PLACE_RAW_BYTES // 4 * 3).astype(np.float32)
    small = np.arange(7, dtype=np.int64)
    nodes = [helper.make_node("Identity", ["big"], ["y"]), helper.make_node("Identity", ["small"], ["z"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, values.shape),
               helper.make_tensor_value_info("z", TensorProto.INT64, small.shape)]
    inits = [numpy_helper.from_array(values, "big"), numpy_helper.from_array(small, "small")]
    model = _model(nodes, [], outputs, inits)
    for source in (model.SerializeToString(), model):
        graph = load_model(source).graph
        big = graph.initializers["big"]
        assert big.ctypes.data % ALIGN == 0 and np.array_equal(big, values)
        if big.base is not None and not big.flags.writeable:
            assert isinstance(big.base, (bytes, np.ndarray))  # used in place: a read-only view of the raw bytes
        assert graph.initializers["small"].ctypes.data % ALIGN == 0


_PEAK_SCRIPT = PEAK_RSS_PRELUDE + textwrap.dedent("""
    path, x_len = sys.argv[1], int(sys.argv[2])
    x = np.linspace(-1, 1, x_len, dtype=np.float32).reshape(1, x_len)
    sess = carrack.InferenceSession(path)
    y = sess.run(None, {"x": x})[0]
    peak = status("VmHWM")
    views = [w.base is not None and not w.flags.writeable for w in sess._model.graph.initializers.values()]
    # reference after measuring: numpy reads the same file through its own mapping
    w1 = np.memmap(sys.argv[3], np.float32, "r", 0, (x_len, int(sys.argv[4])))
    w2 = np.memmap(sys.argv[3], np.float32, "r", w1.nbytes, (int(sys.argv[4]), x_len))
    ok = bool(np.allclose(y, (x @ w1) @ w2, rtol=1e-4, atol=1e-3))
    print(json.dumps(dict(baseline=baseline, peak=peak, reset=reset, views=views, ok=ok)))
""")


def test_200mb_external_weights_load_without_a_second_copy(tmp_path):
    """~200 MB of external weights: peak RSS growth (load + one run) stays under 1.3x the weight bytes."""
    n_in, n_mid = 1000, 25_000  # two float32 matrices of 100 MB each
    data_path = tmp_path / "weights.bin"
    block = np.random.default_rng(2).standard_normal((100, n_mid)).astype(np.float32) / 100
    with open(data_path, "wb") as f:
        for _ in range(n_in // 100):  # w1 [n_in, n_mid] then w2 [n_mid, n_in], written in 10 MB pieces
            f.write(block.tobytes())
        for _ in range(n_mid // 100):
            f.write(block[:, :n_in].tobytes())
    w1_bytes = n_in * n_mid * 4
    weight_bytes = 2 * w1_bytes
    assert os.path.getsize(data_path) == weight_bytes
    inits = [external_tensor("w1", np.float32, (n_in, n_mid), "weights.bin", 0),
             external_tensor("w2", np.float32, (n_mid, n_in), "weights.bin", w1_bytes)]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n_in])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n_in])
    model_path = tmp_path / "model.onnx"
    onnx.save_model(_model(nodes, [x], [y], inits), str(model_path))
    assert os.path.getsize(model_path) < 4096

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(model_path), str(n_in), str(data_path),
                           str(n_mid)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = result["peak"] - result["baseline"]
    print(f"weights {weight_bytes / 2**20:.1f} MiB, peak RSS growth {growth / 2**20:.1f} MiB "
          f"({growth / weight_bytes:.2f}x, high-water mark reset: {result['reset']})")
    assert result["ok"], "wrong result"
    assert all(result["views"]), "weights were copied instead of mapped"
    assert growth < 1.3 * weight_bytes, f"peak RSS grew by {growth / 2**20:.1f} MiB for {weight_bytes / 2**20:.1f} MiB"


def test_external_data_needs_a_path():
    t = external_tensor("w", np.float32, (2,), "w.bin", 0)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    model = _model([helper.make_node("Identity", ["w"], ["y"])], [], [y], [t])
    with pytest.raises(carrack.InvalidModel, match="not loaded from a path"):
        carrack.InferenceSession(model.SerializeToString())
