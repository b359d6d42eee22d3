"""Native libraries with the session kernels run MobileNetV2's inverted-residual blocks fused, as the session does:
one invres.c call a block whose expanded map is large (BLOCK_MIN_EXPANDED_BYTES; the tests set it to 0 to fuse
every block of a small network), its two 1x1 weights packed at compile time, its band scratch a block of the arena
(model_arena_bytes counts it); the results equal the session's, at fixed and run-time batch sizes. Portable
libraries and WebAssembly modules keep the three convolutions."""

from __future__ import annotations

import ctypes
import re
import shutil

import numpy as np
import pytest

import carrack
from carrack.backends.c import emit_native
from carrack.backends.c.build import compile_model, library_name, plan_for_build
from carrack.backends.c.emit import emit
from carrack.backends.c.emit_native import BLOCK_SOURCE, INCLUDED_BY_BLOCK, block_scratch_floats
from carrack.native import invres
from carrack.onnx.importer import load_model
from tests.compile.models import session_outputs
from tests.compile.test_native_kernels import needs_avx512
from tests.helpers import randomize_batch_norms

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                reason="no C compiler (apt-get install gcc)")

#: the network's input, and its blocks: (channels, out channels, stride); 57x50 maps are cut in bands, the 15x13
#: and 8x7 ones (at most 256 output pixels) are split by channels
INPUT = (1, 3, 57, 50)
BLOCKS = [(8, 8, 1), (8, 12, 2), (12, 12, 1), (12, 16, 2), (16, 16, 1), (16, 20, 2)]


class Block(torch.nn.Module):
    """expand 1x1 -> BatchNorm -> ReLU6 -> depthwise 3x3 -> BatchNorm -> ReLU6 -> project 1x1 -> BatchNorm (+ x)"""

    def __init__(self, channels: int, out_channels: int, stride: int):
        super().__init__()
        wide = 6 * channels
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(channels, wide, 1, bias=False), torch.nn.BatchNorm2d(wide), torch.nn.ReLU6(),
            torch.nn.Conv2d(wide, wide, 3, stride=stride, padding=1, groups=wide, bias=False),
            torch.nn.BatchNorm2d(wide), torch.nn.ReLU6(),
            torch.nn.Conv2d(wide, out_channels, 1, bias=False), torch.nn.BatchNorm2d(out_channels))
        self.residual = stride == 1 and channels == out_channels

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


@pytest.fixture(scope="module")
def network(tmp_path_factory) -> str:
    """A MobileNetV2-like stack with a run-time batch: a stem, BLOCKS, a 1x1 head."""
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU6(),
                              *(Block(*b) for b in BLOCKS), torch.nn.Conv2d(20, 32, 1), torch.nn.ReLU6())
    randomize_batch_norms(net)
    path = tmp_path_factory.mktemp("blocks") / "blocks.onnx"
    torch.onnx.export(net.eval(), (torch.randn(*INPUT),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}}, dynamo=False)
    return str(path)


def _scratch_blocks(source: str) -> list[int]:
    """The arena bytes the layout gives each invres_f32_threads call's scratch (its ninth argument)."""
    sizes = []
    for call in re.findall(r"invres_f32_threads\(([^;]*)\);", source):
        scratch = " ".join(call.split()).split(", ")[8]
        index = re.fullmatch(r"\(float \*\)\(r->arena \+ r->off\[(\d+)\]\)", scratch).group(1)
        sizes.append(int(re.search(rf"off\[{index}\] = o; end\[{index}\] = o \+ cr_align\((\d+)\)", source).group(1)))
    return sizes


def _feed(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, *INPUT[1:])).astype(np.float32)}


@pytest.fixture
def fuse_every_block(monkeypatch):
    monkeypatch.setattr(emit_native, "BLOCK_MIN_EXPANDED_BYTES", 0)


@needs_avx512
def test_every_block_is_one_invres_call_equal_to_the_session(network, tmp_path, fuse_every_block):
    compile_model(network, tmp_path, "native", dims={"batch": 1})
    source = (tmp_path / "model.c").read_text()
    assert source.count("invres_f32_threads(") == len(BLOCKS)
    assert source.count("packconv_f32_threads(") == 2 and "dwconv2d_f32(" not in source  # the stem and the head
    assert (tmp_path / BLOCK_SOURCE).is_file() and (tmp_path / INCLUDED_BY_BLOCK).is_file()
    library = ctypes.CDLL(str(tmp_path / library_name()))
    assert not hasattr(library, "invres_f32_threads") and not hasattr(library, "packconv_f32_threads")
    feed = _feed(1)
    got = carrack.CompiledModel(tmp_path).run(None, feed)[0]
    np.testing.assert_allclose(got, session_outputs(network, feed)[0], rtol=1e-5, atol=1e-5)


@needs_avx512
def test_the_arena_holds_each_blocks_scratch_at_every_batch_size(network, tmp_path, fuse_every_block):
    """--max-dim batch=3: the small maps' scratch grows with the batch; the layout gives each call the bytes
    invres.c's invres_scratch_floats asks at one thread, and every batch size equals the session."""
    compile_model(network, tmp_path, "native", max_dims={"batch": 3})
    source = (tmp_path / "model.c").read_text()
    assert source.count("invres_f32_threads(") == len(BLOCKS)
    model = carrack.CompiledModel(tmp_path)
    library = ctypes.CDLL(str(tmp_path / library_name()))
    library.model_arena_bytes.restype = ctypes.c_int64
    arena = [library.model_arena_bytes((ctypes.c_int64 * 1)(batch)) for batch in (1, 2, 3)]
    assert arena[0] < arena[1] < arena[2]
    for batch in (1, 2, 3):
        feed = _feed(batch, seed=batch)
        np.testing.assert_allclose(model.run(None, feed)[0], session_outputs(network, feed)[0], rtol=1e-5, atol=1e-5)
    fixed = tmp_path / "fixed"
    compile_model(network, fixed, "native", dims={"batch": 3})
    lib = invres.library()
    if lib is not None:  # the layout's sizes against the kernel's own count at one thread
        expected = []
        h, w = (INPUT[2] - 1) // 2 + 1, (INPUT[3] - 1) // 2 + 1
        for channels, out_channels, stride in BLOCKS:
            g = invres.Geometry(3, channels, 6 * channels, out_channels, h, w, stride)
            band, _ = invres.plan_bands(g, 1)
            expected.append(4 * lib.invres_scratch_floats(3, 6 * channels, h, w, stride, band, 1))
            h, w = g.out_height, g.out_width
        assert _scratch_blocks((fixed / "model.c").read_text()) == expected


@needs_avx512
def test_blocks_with_small_expanded_maps_run_as_three_calls(network, tmp_path):
    """At batch 8 the first two blocks' expanded maps (48 x 29 x 25 floats an image) pass 1 MiB: fused; the
    later, smaller ones run their convolutions through packconv.c and dwconv.c."""
    compile_model(network, tmp_path, "native", dims={"batch": 8})
    source = (tmp_path / "model.c").read_text()
    assert source.count("invres_f32_threads(") == 2
    small = len(BLOCKS) - 2
    assert source.count("packconv_f32_threads(") == 2 + 2 * small and source.count("dwconv2d_f32(") == small
    feed = _feed(8, seed=4)
    got = carrack.CompiledModel(tmp_path).run(None, feed)[0]
    np.testing.assert_allclose(got, session_outputs(network, feed)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(invres.library() is None, reason="invres.c needs AVX-512 (not in this build)")
@pytest.mark.parametrize("n, ce, h, w, stride, band", [
    (1, 48, 57, 50, 1, 5), (2, 36, 29, 25, 2, 3), (1, 48, 29, 25, 1, 29),  # bands
    (3, 72, 15, 13, 1, 15), (2, 96, 15, 13, 2, 8), (1, 144, 7, 7, 1, 7)])  # small maps
def test_scratch_size_is_invres_scratch_floats_at_one_thread(n, ce, h, w, stride, band):
    assert block_scratch_floats(n, ce, h, w, stride, band) == invres.library().invres_scratch_floats(
        n, ce, h, w, stride, band, 1)


def test_plans_without_the_session_kernels_keep_the_convolutions(network, fuse_every_block):
    """WebAssembly modules and portable libraries (native_kernels False) plan the three convolutions, also from a
    model that holds the fused nodes (a session's plan); the fused plan's source is reproducible."""
    fused = plan_for_build(load_model(network), 99, native_kernels=True)
    assert [n.op_type for n in fused.graph.nodes].count("InvertedResidual") == len(BLOCKS)
    for model in (load_model(network), fused.model):
        ops = [n.op_type for n in plan_for_build(model, 99, native_kernels=False).graph.nodes]
        assert "InvertedResidual" not in ops and ops.count("Conv") + ops.count("FusedConv") == 2 + 3 * len(BLOCKS)
    again = plan_for_build(load_model(network), 99, native_kernels=True)
    first, second = (emit(p, {"batch": 2}, native_kernels=True) for p in (fused, again))
    assert first.source == second.source and first.weights == second.weights


@needs_avx512
def test_portable_library_runs_the_convolutions(network, tmp_path):
    compile_model(network, tmp_path, "native", dims={"batch": 2}, native_kernels=False)
    assert "invres_f32_threads" not in (tmp_path / "model.c").read_text()
    feed = _feed(2, seed=7)
    got = carrack.CompiledModel(tmp_path).run(None, feed)[0]
    np.testing.assert_allclose(got, session_outputs(network, feed)[0], rtol=1e-5, atol=1e-5)


@needs_avx512
def test_a_block_without_expansion_runs_fused(tmp_path, fuse_every_block):
    """MobileNetV2's first block (depthwise 3x3 -> 1x1 projection, no expansion) is one invres call too, with no
    expansion weights, and equals the session."""
    torch.manual_seed(5)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU6(),
        torch.nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU6(),
        torch.nn.Conv2d(16, 8, 1, bias=False), torch.nn.BatchNorm2d(8))
    path = tmp_path / "separable.onnx"
    torch.onnx.export(net.eval(), (torch.randn(*INPUT),), str(path), input_names=["x"], output_names=["y"],
                      dynamo=False)
    out = tmp_path / "lib"
    compile_model(str(path), out, "native")
    source = (out / "model.c").read_text()
    assert source.count("invres_f32_threads(") == 1 and "dwconv2d_f32(" not in source
    assert re.search(r"invres_f32_threads\(\s*[^,]+,\s*NULL,", source)
    feed = _feed(1, seed=9)
    got = carrack.CompiledModel(out).run(None, feed)[0]
    np.testing.assert_allclose(got, session_outputs(str(path), feed)[0], rtol=1e-5, atol=1e-5)
