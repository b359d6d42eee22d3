"""Convolution steps bound to a reused arena (Conv.bind_into -> BoundConvolution.bind_call): after the binding run,
a run calls each convolution's native kernel with arguments converted once, with no per-call checks; results are
the unbound executor's bits at 1, 2 and 4 threads and onnxruntime's within float32 rounding, a failed bound call
takes the general path, and arrays the kernel cannot take are refused at binding."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.native import convolution as native_conv
from carrack.passes.fusions import without_block_fusion
from carrack.runtime.session import InferenceSession
from tests.helpers import session_at

pytestmark = pytest.mark.skipif(native_conv.load() is None, reason="native convolution kernels not built here")


@pytest.fixture(scope="module")
def blocks_model(tmp_path_factory) -> str:
    """MobileNetV2 inverted-residual blocks exported by torch.onnx: expand 1x1 + ReLU6, depthwise 3x3 (stride 1
    and 2) + ReLU6, project 1x1 with and without the residual, a plain ReLU block and a Hardswish head conv."""
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self, channels: int, out_channels: int, stride: int, act=torch.nn.ReLU6):
            super().__init__()
            wide = 6 * channels
            self.body = torch.nn.Sequential(
                torch.nn.Conv2d(channels, wide, 1), act(),
                torch.nn.Conv2d(wide, wide, 3, stride=stride, padding=1, groups=wide), act(),
                torch.nn.Conv2d(wide, out_channels, 1))
            self.residual = stride == 1 and channels == out_channels

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU6(),
                              Block(8, 8, 1), Block(8, 12, 2), Block(12, 12, 1, torch.nn.ReLU),
                              Block(12, 16, 2), torch.nn.Conv2d(16, 32, 1), torch.nn.Hardswish()).eval()
    path = tmp_path_factory.mktemp("bound_steps") / "blocks.onnx"
    torch.onnx.export(net, (torch.randn(1, 3, 37, 41),), str(path), input_names=["x"], output_names=["y"],
                      dynamo=False)
    return str(path)


#: where packconv.c does not run (builds without AVX-512), the 1x1 convolutions take numpy's BLAS and allocate their
#: results, so the executor binds none of the steps reading them: nothing to test there
needs_packed = pytest.mark.skipif(native_conv.load() is None or not native_conv.load().packs,
                                  reason="1x1 convolutions run on numpy's BLAS in this build: no bound steps")


def _session(path: str, threads: int, bind: bool = True) -> InferenceSession:
    with without_block_fusion():  # the blocks' convolutions as steps of their own, not invres.c's one call
        return session_at(path, threads, bind)


def _inputs(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [{"x": rng.standard_normal((1, 3, 37, 41)).astype(np.float32)} for _ in range(count)]


@needs_packed
def test_bound_steps_skip_the_per_call_path_and_keep_the_bits(blocks_model, monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    feeds = _inputs(5)
    expected = [ort.InferenceSession(blocks_model, providers=["CPUExecutionProvider"]).run(None, f)[0] for f in feeds]
    unbound = _session(blocks_model, 1, bind=False)
    reference = [unbound.run(None, f)[0] for f in feeds]
    per_call = []
    original = native_conv.BoundConvolution.__call__
    monkeypatch.setattr(native_conv.BoundConvolution, "__call__",
                        lambda self, *a: per_call.append(self) or original(self, *a))
    for threads in (1, 2, 4):
        session = _session(blocks_model, threads)
        session.run(None, feeds[0])
        session.run(None, feeds[0])  # the first run that reuses the arena binds its steps
        per_call.clear()
        for feed, e, r in zip(feeds, expected, reference):  # contents change every run: the calls read them
            y = session.run(None, feed)[0]
            assert np.array_equal(y, r)
            np.testing.assert_allclose(y, e, rtol=1e-4, atol=1e-5)
        # every convolution but the first (it reads the caller's input array, a new object each run) is bound
        assert len(per_call) == len(feeds)


@needs_packed
def test_failed_bound_call_takes_the_general_path(blocks_model, monkeypatch):
    feeds = _inputs(3)
    reference = [_session(blocks_model, 1, bind=False).run(None, f)[0] for f in feeds]
    failed = []
    original = native_conv.BoundConvolution.bind_call

    def failing(self, x, out, z):
        if original(self, x, out, z) is None:
            return None

        def fails() -> bool:
            out.fill(np.nan)  # what a kernel that gave up part way may leave behind
            failed.append(self)
            return False
        return fails

    monkeypatch.setattr(native_conv.BoundConvolution, "bind_call", failing)
    session = _session(blocks_model, 1)
    for _ in range(2):
        session.run(None, feeds[0])
    for feed, r in zip(feeds, reference):
        assert np.array_equal(session.run(None, feed)[0], r)
    assert failed


def test_binding_refuses_arrays_the_kernel_cannot_take():
    kernels = native_conv.load()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 1, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    bound = kernels.bind("depthwise", (1, 8, 10, 10), w, bias, (1, 1), (1, 1, 1, 1), (1, 1), 8,
                         native_conv.NO_ACTIVATION)
    x = rng.standard_normal((1, 8, 10, 10)).astype(np.float32)
    out = np.empty((1, 8, 10, 10), np.float32)
    call = bound.bind_call(x, out, None)
    assert call is not None and call()
    np.testing.assert_array_equal(out, bound(x, None, None))
    wide = np.empty((1, 8, 10, 20), np.float32)
    assert bound.bind_call(x, x, None) is None  # the output would overwrite the input it reads
    assert bound.bind_call(x, wide[..., ::2], None) is None  # not contiguous
    assert bound.bind_call(x, np.empty((1, 8, 5, 20), np.float32), None) is None  # another shape
    assert bound.bind_call(x.astype(np.float64), out, None) is None
    assert bound.bind_call(x, out, out) is None  # no residual in this binding
