"""`carrack compile --target wasm32`: Node loads model.wasm through the generated ES module and runs every test
model; the outputs equal carrack's Python session within float32 rounding, inputs at odd byte offsets, strided and
byte-swapped (prepared on the JS side) give the same bytes, bad feeds raise JS Errors naming the input with
expected and got, and the module imports nothing and keeps its memory size through every run."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import numpy as np
import pytest

from carrack.backends.c import build
from carrack.backends.c.build import ToolchainMissing, compile_model
from tests.compile.helpers import NODE, needs_wasm
from tests.compile.models import MODELS, SHAPES, feeds, session_outputs

DRIVER = r"""
import fs from "node:fs";
import { pathToFileURL } from "node:url";
const [dir, casesPath, outPath, simd] = process.argv.slice(2);
const { load } = await import(pathToFileURL(`${dir}/model.mjs`).href);
const m = await load(pathToFileURL(`${dir}/model.wasm`), { relaxed: simd === "relaxed" });
const module = await WebAssembly.compile(fs.readFileSync(`${dir}/model.wasm`));
const report = { imports: WebAssembly.Module.imports(module).length, memory: [m.memory.buffer.byteLength],
                 memoryBytes: m.memoryBytes, simd: m.simd, runs: [], errors: {} };
const same = (a, b) => a.length === b.length && a.every((v, i) => Object.is(v, b[i]));
function variants(data, shape) {
  const raw = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  const odd = new Uint8Array(raw.length + 3); odd.set(raw, 3);
  const swapped = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i += 4) for (let j = 0; j < 4; j++) swapped[i + j] = raw[i + 3 - j];
  const last = shape[shape.length - 1];
  const wide = new Float32Array(data.length * 2);  // every element followed by a gap
  for (let i = 0; i < data.length; i++) wide[2 * i + 1] = data[i];
  const strides = shape.map((_, axis) => 8 * shape.slice(axis + 1).reduce((a, b) => a * b, 1));
  return {
    odd_offset: { bytes: odd.subarray(3), dtype: "float32", shape },
    byte_swapped: { bytes: swapped, dtype: "float32", shape, littleEndian: false },
    strided: { bytes: new Uint8Array(wide.buffer, 4), dtype: "float32", shape, strides },
    odd_strided_swapped: (() => {
      const b = new Uint8Array(wide.byteLength + 1);
      const w = new Uint8Array(wide.buffer);
      for (let i = 0; i < w.length; i += 4) for (let j = 0; j < 4; j++) b[1 + i + j] = w[i + 3 - j];
      return { bytes: b.subarray(5), dtype: "float32", shape, strides, littleEndian: false };
    })(),
    last,
  };
}
for (const c of JSON.parse(fs.readFileSync(casesPath, "utf8"))) {
  const bytes = fs.readFileSync(c.file);
  const data = new Float32Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength));
  const outputs = m.run({ x: { data, shape: c.shape } });
  const run = { outputs: {}, variants: {} };
  for (const [name, value] of Object.entries(outputs)) {
    const file = `${c.file}.${name.replace(/\W/g, "_")}.out`;
    fs.writeFileSync(file, new Uint8Array(value.buffer));
    run.outputs[name] = { file, shape: value.shape };
  }
  const { last, ...rest } = variants(data, c.shape);
  for (const [kind, feed] of Object.entries(rest)) {
    const got = m.run({ x: feed });
    run.variants[kind] = Object.keys(outputs).every((name) => same(got[name], outputs[name]));
  }
  report.runs.push(run);
  report.memory.push(m.memory.buffer.byteLength);
}
const shape = JSON.parse(fs.readFileSync(casesPath, "utf8"))[0].shape;
const count = shape.reduce((a, b) => a * b, 1);
const attempts = {
  name: () => m.run({ image: new Float32Array(count) }),
  missing: () => m.run({}),
  dtype: () => m.run({ x: new Int32Array(count) }),
  bytes_dtype: () => m.run({ x: { bytes: new Uint8Array(count * 4), dtype: "float64", shape } }),
  size: () => m.run({ x: { bytes: new Uint8Array(count * 4 - 1), dtype: "float32", shape } }),
  maximum: () => m.run({ x: { data: new Float32Array(count * 100), shape: [shape[0] * 100, ...shape.slice(1)] } }),
};
for (const [kind, attempt] of Object.entries(attempts)) {
  try { attempt(); report.errors[kind] = null; }
  catch (e) { report.errors[kind] = `${e.constructor.name}: ${e.message}`; }
}
report.memory.push(m.memory.buffer.byteLength);
fs.writeFileSync(outPath, JSON.stringify(report));
"""


def run_in_node(directory, cases_dir, name, simd="simd128", node_flags=()):
    cases = []
    for k, feed in enumerate(feeds(name)):
        path = cases_dir / f"{name}_{k}.bin"
        feed["x"].astype("<f4").tofile(path)
        cases.append({"file": str(path), "shape": list(feed["x"].shape)})
    (cases_dir / "cases.json").write_text(json.dumps(cases))
    driver = cases_dir / "driver.mjs"
    driver.write_text(DRIVER)
    report_path = cases_dir / "report.json"
    done = subprocess.run([NODE, *node_flags, str(driver), str(directory), str(cases_dir / "cases.json"),
                           str(report_path), simd], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(report_path.read_text())


@pytest.fixture(scope="module")
def wasm_builds(exported, tmp_path_factory):
    """name -> the directory of its wasm32 build (model.wasm and model.relaxed.wasm)"""
    builds = {}
    for name, (path, maxima) in exported.items():
        builds[name] = tmp_path_factory.mktemp(f"wasm_{name}")
        compile_model(path, builds[name], "wasm32", max_dims=maxima)
    return builds


@pytest.fixture(scope="module")
def wasm_reports(wasm_builds, tmp_path_factory):
    return {name: run_in_node(directory, tmp_path_factory.mktemp(f"node_{name}"), name)
            for name, directory in wasm_builds.items()}


#: Node 20's V8 has relaxed SIMD behind this flag; Node 22+ has it on
RELAXED_FLAG = "--experimental-wasm-relaxed-simd"


def _node_flags_for_relaxed_simd(model_mjs) -> list[str] | None:
    probe = f"import('{model_mjs.as_uri()}').then((m) => process.exit(m.hasRelaxedSimd() ? 0 : 1))"
    for flags in ([], [RELAXED_FLAG]):
        if subprocess.run([NODE, *flags, "-e", probe], capture_output=True, timeout=60).returncode == 0:
            return flags
    return None


@pytest.fixture(scope="module")
def relaxed_reports(wasm_builds, tmp_path_factory):
    flags = _node_flags_for_relaxed_simd(next(iter(wasm_builds.values())) / "model.mjs")
    if flags is None:
        pytest.skip(f"this node ({NODE}) has no relaxed SIMD, even with {RELAXED_FLAG}")
    return {name: run_in_node(directory, tmp_path_factory.mktemp(f"relaxed_{name}"), name, "relaxed", flags)
            for name, directory in wasm_builds.items()}


@needs_wasm
@pytest.mark.parametrize("name", list(MODELS))
def test_node_outputs_equal_the_session(exported, wasm_reports, name):
    path, _ = exported[name]
    report = wasm_reports[name]
    for feed, run in zip(feeds(name), report["runs"]):
        want = session_outputs(path, feed)
        got = [np.fromfile(o["file"], dtype="<f4").reshape(o["shape"]) for o in run["outputs"].values()]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert len(report["runs"]) == len(SHAPES[name])
    assert report["simd"] == "simd128"


@needs_wasm
@pytest.mark.parametrize("name", list(MODELS))
def test_relaxed_simd_build_equals_the_session(exported, relaxed_reports, name):
    """model.relaxed.wasm (fused multiply-adds) gives the session's results within float32 rounding, any layout
    of the inputs gives the same bytes, and its memory is the plain build's."""
    path, _ = exported[name]
    report = relaxed_reports[name]
    assert report["simd"] == "relaxed"
    for feed, run in zip(feeds(name), report["runs"], strict=True):
        got = [np.fromfile(o["file"], dtype="<f4").reshape(o["shape"]) for o in run["outputs"].values()]
        for g, w in zip(got, session_outputs(path, feed), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert all(run["variants"].values())
    assert set(report["memory"]) == {report["memoryBytes"]}


@needs_wasm
@pytest.mark.parametrize("name", list(MODELS))
def test_inputs_in_any_layout_give_the_same_bytes(wasm_reports, name):
    for run in wasm_reports[name]["runs"]:
        assert run["variants"] == {"odd_offset": True, "byte_swapped": True, "strided": True,
                                   "odd_strided_swapped": True}


@needs_wasm
def test_bad_feeds_raise_errors_naming_the_input(wasm_reports):
    errors = wasm_reports["small_cnn"]["errors"]
    assert errors["name"] == "Error: carrack: unknown input 'image'; expected inputs: x"
    assert errors["missing"] == "Error: carrack: missing input 'x' (expected float32 [batch, 3, 16, 16])"
    assert errors["dtype"] == "Error: carrack: input 'x': expected dtype float32 (a Float32Array), got Int32Array"
    assert errors["bytes_dtype"] == "Error: carrack: input 'x': expected dtype float32, got float64"
    assert errors["size"] == "Error: carrack: input 'x': expected 3072 bytes (float32 [1, 3, 16, 16]), got 3071"
    assert errors["maximum"] == ("Error: carrack: input 'x': expected dim 0 ('batch') in 1..4 (its declared "
                                 "maximum), got 100")


@needs_wasm
@pytest.mark.parametrize("name", list(MODELS))
def test_memory_is_fixed_and_nothing_is_imported(exported, wasm_reports, name):
    report = wasm_reports[name]
    assert report["imports"] == 0
    assert set(report["memory"]) == {report["memoryBytes"]}
    from carrack.backends.c.emit import emit
    from carrack.onnx.importer import load_model
    from carrack.plan import build_plan

    path, maxima = exported[name]
    emitted = emit(build_plan(load_model(str(path)), 99), None, maxima)
    assert report["memoryBytes"] == build.wasm_memory_bytes(emitted)


@needs_wasm
def test_wasm_build_is_reproducible(exported, tmp_path):
    path, maxima = exported["sequence_mlp"]
    for run in ("a", "b"):
        compile_model(path, tmp_path / run, "wasm32", max_dims=maxima)
    for name in ("model.wasm", "model.relaxed.wasm", "model.mjs", "model.c", "weights.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_missing_wasm_toolchain_names_the_package(exported, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ziglang" else real(name, *a))
    path, maxima = exported["mlp"]
    with pytest.raises(ToolchainMissing, match=r"pip install 'carrack\[wasm\]'"):
        compile_model(path, tmp_path, "wasm32", max_dims=maxima)


REAL_DRIVER = r"""
import fs from "node:fs";
import { pathToFileURL } from "node:url";
const [dir, outPath] = process.argv.slice(2);
const { load } = await import(pathToFileURL(`${dir}/model.mjs`).href);
const m = await load(pathToFileURL(`${dir}/model.wasm`));
const input = m.inputs[0];
const n = input.shape.reduce((a, b) => a * b, 1);
const x = new Float32Array(n).map((_, i) => i / n);  // onnx's dummy input for its light models
const y = m.run({ [input.name]: x })[m.outputs[0].name];
fs.writeFileSync(outPath, new Uint8Array(y.buffer));
"""


@needs_wasm
@pytest.mark.parametrize("name", ["shufflenet", "squeezenet"])
def test_real_architecture_in_node(name, tmp_path):
    """A real architecture from the onnx wheel (grouped convolutions and channel shuffles; fire modules) compiles,
    runs in Node and reproduces onnx's expected output. The wheel's weights are constant placeholders, so this checks
    the graph end to end; the numbers are checked on the random-weight torch models above."""
    import os

    import onnx
    from onnx import numpy_helper

    light = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    compile_model(f"{light}/light_{name}.onnx", tmp_path / "out", "wasm32")
    (tmp_path / "driver.mjs").write_text(REAL_DRIVER)
    done = subprocess.run([NODE, str(tmp_path / "driver.mjs"), str(tmp_path / "out"), str(tmp_path / "y.bin")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    expected = numpy_helper.to_array(onnx.load_tensor(f"{light}/light_{name}_output_0.pb"))
    got = np.fromfile(tmp_path / "y.bin", dtype="<f4").reshape(expected.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
