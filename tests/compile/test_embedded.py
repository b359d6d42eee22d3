"""`carrack compile --embed-weights`: the library or module carries its own weights (assembled from weights.bin, 64
bytes aligned), runs with no weights.bin beside it and gives the same bits as the build that loads weights.bin."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import carrack
from carrack.backends.c.build import compile_model, library_name
from carrack.cli import main
from tests.compile.helpers import needs_compiler, needs_wasm, run_in_node
from tests.compile.models import feeds

MODEL = "small_cnn"


def _without_weights_file(directory) -> int:
    """Removes weights.bin (what a user shipping only the binary leaves behind) and returns its size."""
    weights = directory / "weights.bin"
    size = weights.stat().st_size
    weights.unlink()
    return size


@needs_compiler
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


@needs_compiler
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


@needs_wasm
def test_wasm_module_runs_without_weights_file(exported, tmp_path):
    path, maxima = exported[MODEL]
    loaded, embedded = tmp_path / "loaded", tmp_path / "embedded"
    compile_model(path, loaded, "wasm32", max_dims=maxima)
    compile_model(path, embedded, "wasm32", max_dims=maxima, embed_weights=True)
    size = _without_weights_file(embedded)
    assert (embedded / "model.wasm").stat().st_size > size
    outputs = []
    for directory in (loaded, embedded):  # the same feed through each module in Node: every output's bytes
        work = tmp_path / f"{directory.name}_node"
        work.mkdir()
        run = run_in_node(directory, work, feeds(MODEL)[:1])["runs"][0]
        outputs.append([Path(entry["file"]).read_bytes() for entry in run["outputs"].values()])
    assert outputs[0] == outputs[1] and outputs[0] and all(outputs[0])
