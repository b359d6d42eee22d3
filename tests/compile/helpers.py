"""Shared by the compile tests: the toolchain markers, running a compiled wasm32 module in Node, and the check that
a compiled model (native library or module in Node) gives the session's bits."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import carrack
from carrack.backends.c.build import compile_model

NODE = shutil.which("node")
needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                    reason="no C compiler (apt-get install gcc)")
needs_wasm = pytest.mark.skipif(
    NODE is None or importlib.util.find_spec("ziglang") is None,
    reason="needs node (apt-get install nodejs) and ziglang (pip install 'carrack[wasm]')")

# --------------------------------------------------------------------------------------------------- Node driver

NODE_DRIVER = r"""
import fs from "node:fs";
import { pathToFileURL } from "node:url";
const [dir, casesPath, outPath] = process.argv.slice(2);
const { load } = await import(pathToFileURL(`${dir}/model.mjs`).href);
const m = await load(pathToFileURL(`${dir}/model.wasm`));
const ARRAYS = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array, uint8: Uint8Array,
                 int8: Int8Array, bool: Uint8Array };
const same = (a, b) => a.length === b.length && a.every((v, i) => Object.is(v, b[i]));
function typed(file, dtype) {
  const bytes = fs.readFileSync(file);
  const size = ARRAYS[dtype].BYTES_PER_ELEMENT;
  return new ARRAYS[dtype](bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength), 0,
                           bytes.byteLength / size);
}
function variants(data, dtype, shape) {  // the same values at an odd byte offset, byte-swapped, strided
  const size = ARRAYS[dtype].BYTES_PER_ELEMENT;
  const raw = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  const odd = new Uint8Array(raw.length + 3); odd.set(raw, 3);
  const swapped = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i += size) for (let j = 0; j < size; j++) swapped[i + j] = raw[i + size - 1 - j];
  const wide = new Uint8Array(raw.length * 2 + 1);  // every element followed by a gap, from byte 1
  for (let i = 0; i < raw.length; i += size) wide.set(raw.subarray(i, i + size), 1 + 2 * i);
  const strides = shape.map((_, axis) => 2 * size * shape.slice(axis + 1).reduce((a, b) => a * b, 1));
  return {
    odd_offset: { bytes: odd.subarray(3), dtype, shape },
    byte_swapped: { bytes: swapped, dtype, shape, littleEndian: false },
    strided: { bytes: wide.subarray(1), dtype, shape, strides },
  };
}
const report = { runs: [], errors: {} };
for (const c of JSON.parse(fs.readFileSync(casesPath, "utf8"))) {
  const feeds = Object.fromEntries(c.inputs.map((i) => [i.name, { data: typed(i.file, i.dtype), shape: i.shape }]));
  if (c.error) {
    try { m.run(feeds); report.errors[c.error] = null; }
    catch (e) { report.errors[c.error] = `${e.constructor.name}: ${e.message}`; }
    continue;
  }
  const outputs = m.run(feeds);
  const run = { outputs: {}, variants: {} };
  for (const [name, value] of Object.entries(outputs)) {
    const file = `${c.inputs[0].file}.${name.replace(/\W/g, "_")}.out`;
    fs.writeFileSync(file, new Uint8Array(value.buffer));
    run.outputs[name] = { file, shape: value.shape, type: value.constructor.name };
  }
  for (const input of c.inputs) {
    for (const [kind, feed] of Object.entries(variants(feeds[input.name].data, input.dtype, input.shape))) {
      const got = m.run({ ...feeds, [input.name]: feed });
      run.variants[`${input.name}:${kind}`] = Object.keys(outputs).every((name) => same(got[name], outputs[name]));
    }
  }
  report.runs.push(run);
}
const first = m.inputs[0];
try { m.run({ [first.name]: new Float64Array(4) }); }
catch (e) { report.errors.dtype = `${e.constructor.name}: ${e.message}`; }
fs.writeFileSync(outPath, JSON.stringify(report));
"""


def run_in_node(directory, work, feeds: list[dict[str, np.ndarray]], errors: dict[str, dict] | None = None) -> dict:
    """Run `feeds` through the compiled module in Node; `errors` maps a name to feeds expected to fail."""
    cases = []
    for k, (label, feed) in enumerate([(None, f) for f in feeds] + list((errors or {}).items())):
        inputs = []
        for name, value in feed.items():
            path = work / f"case{k}_{name}.bin"
            value = np.ascontiguousarray(value)
            (value.astype(value.dtype.newbyteorder("<")) if value.dtype.itemsize > 1 else value).tofile(path)
            dtype = "bool" if value.dtype == np.bool_ else value.dtype.name
            inputs.append({"name": name, "file": str(path), "dtype": dtype, "shape": list(value.shape)})
        cases.append({"inputs": inputs, **({"error": label} if label else {})})
    (work / "cases.json").write_text(json.dumps(cases))
    (work / "driver.mjs").write_text(NODE_DRIVER)
    done = subprocess.run([NODE, str(work / "driver.mjs"), str(directory), str(work / "cases.json"),
                           str(work / "report.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads((work / "report.json").read_text())


NUMPY_OF_JS = {"Float32Array": "<f4", "BigInt64Array": "<i8", "Int32Array": "<i4", "Uint8Array": "u1",
               "Int8Array": "i1"}


def node_outputs(run: dict, expected: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for entry, want in zip(run["outputs"].values(), expected):
        data = np.fromfile(entry["file"], dtype=NUMPY_OF_JS[entry["type"]]).reshape(entry["shape"])
        out.append(data.astype(bool) if want.dtype == np.bool_ else data)
    return out


def assert_compiled_equals_session(model: Path, out: Path, target: str, feeds: list[dict[str, np.ndarray]],
                                   max_dims: dict[str, int], kernels: tuple[str, ...] = ()) -> list[list[np.ndarray]]:
    """Compile `model` into `out` for `target` ("native" or "wasm32"; its C must call each of `kernels`) and check
    that every output of the library, or of the module in Node, has the session's dtype, shape and bits on every
    feed; returns the session's outputs."""
    compile_model(model, out, target, max_dims=max_dims)
    code = (out / "model.c").read_text()
    missing = [k for k in kernels if f"{k}(" not in code]
    assert not missing, f"the compiled model.c does not call {missing}"
    session = carrack.InferenceSession(str(model))
    wants = [session.run(None, feed) for feed in feeds]
    if target == "native":
        compiled = carrack.CompiledModel(out)
        gots = [compiled.run(None, feed) for feed in feeds]
    else:
        report = run_in_node(out, out.parent, feeds)
        gots = [node_outputs(run, want) for run, want in zip(report["runs"], wants)]
    assert len(gots) == len(wants)
    for got, want in zip(gots, wants):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
    return wants
