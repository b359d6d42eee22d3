"""`carrack compile --embed-weights`: the library or module carries its own weights (assembled from weights.bin, 64
bytes aligned), runs with no weights.bin beside it and gives the same bits as the build that loads weights.bin."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess

import numpy as np
import pytest

import carrack
from carrack.backends.c.build import compile_model, library_name
from carrack.cli import main
from tests.compile.models import feeds

MODEL = "small_cnn"
needs_cc = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                              reason="no C compiler (apt-get install gcc)")
needs_wasm = pytest.mark.skipif(shutil.which("node") is None or importlib.util.find_spec("ziglang") is None,
                                reason="needs node (apt-get install nodejs) and ziglang (pip install 'carrack[wasm]')")


def _without_weights_file(directory) -> int:
    """Removes weights.bin (what a user shipping only the binary leaves behind) and returns its size."""
    weights = directory / "weights.bin"
    size = weights.stat().st_size
    weights.unlink()
    return size


@needs_cc
def test_native_library_runs_without_weights_file(exported, tmp_path):
    path, maxima = exported[MODEL]
    loaded, embedded = tmp_path / "loaded", tmp_path / "embedded"
    compile_model(path, loaded, "native", max_dims=maxima)
    assert main(["compile", str(path), "-o", str(embedded), "--embed-weights",
                 *[f"--max-dim={k}={v}" for k, v in maxima.items()]]) == 0
    size = _without_weights_file(embedded)
    assert size > 1000
    assert json.loads((embedded / "model.json").read_text())["weights"]["embedded"] is True
    assert (embedded / library_name()).stat().st_size > size  # the bytes are in the library
    with_file, alone = carrack.CompiledModel(loaded), carrack.CompiledModel(embedded)
    for feed in feeds(MODEL):
        for want, got in zip(with_file.run(None, feed), alone.run(None, feed)):
            assert want.tobytes() == got.tobytes()


@needs_cc
def test_embedded_symbol_is_aligned_and_holds_the_file(exported, tmp_path):
    """The symbol model_init(NULL) uses starts on a 64-byte boundary and holds weights.bin's bytes."""
    import ctypes

    path, maxima = exported[MODEL]
    # the portable kernels: model.c alone is the probe's one source (the session kernels are sources of their own)
    compile_model(path, tmp_path, "native", max_dims=maxima, embed_weights=True, native_kernels=False)
    weights = (tmp_path / "weights.bin").read_bytes()
    source = (tmp_path / "model.c").read_text()
    source += ("\nconst unsigned char *model_embedded_address(void) { return model_embedded_weights; }\n")
    (tmp_path / "probe.c").write_text(source)
    compiler = next(c for c in ("cc", "gcc", "clang") if shutil.which(c))
    subprocess.run([compiler, "-std=c11", "-O1", "-fPIC", "-shared", "-o", "libprobe.so", "probe.c", "-lm"],
                   cwd=tmp_path, check=True, capture_output=True)
    lib = ctypes.CDLL(str(tmp_path / "libprobe.so"))
    lib.model_embedded_address.restype = ctypes.c_void_p
    address = lib.model_embedded_address()
    assert address % 64 == 0
    assert ctypes.string_at(address, len(weights)) == weights


NODE_DRIVER = r"""
import fs from "node:fs";
import { pathToFileURL } from "node:url";
const [dir, input, shape, out] = process.argv.slice(2);
const { load } = await import(pathToFileURL(`${dir}/model.mjs`).href);
const m = await load(pathToFileURL(`${dir}/model.wasm`));
const bytes = fs.readFileSync(input);
const data = new Float32Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength));
const result = Object.values(m.run({ x: { data, shape: JSON.parse(shape) } }))[0];
fs.writeFileSync(out, new Uint8Array(result.buffer, result.byteOffset, result.byteLength));
"""


@needs_wasm
def test_wasm_module_runs_without_weights_file(exported, tmp_path):
    path, maxima = exported[MODEL]
    loaded, embedded = tmp_path / "loaded", tmp_path / "embedded"
    compile_model(path, loaded, "wasm32", max_dims=maxima)
    compile_model(path, embedded, "wasm32", max_dims=maxima, embed_weights=True)
    size = _without_weights_file(embedded)
    assert (embedded / "model.wasm").stat().st_size > size
    (tmp_path / "driver.mjs").write_text(NODE_DRIVER)
    feed = feeds(MODEL)[0]
    (x,) = feed.values()
    x.astype(np.float32).tofile(tmp_path / "x.bin")
    outputs = []
    for directory in (loaded, embedded):
        out = tmp_path / f"{directory.name}.out"
        subprocess.run(["node", str(tmp_path / "driver.mjs"), str(directory), str(tmp_path / "x.bin"),
                        json.dumps(list(x.shape)), str(out)], check=True, capture_output=True, timeout=120)
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1] and len(outputs[0]) > 0
