"""DFT, STFT, windows and MelWeightMatrix against onnxruntime and numpy.fft."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack


def _model(op: str, inputs: dict[str, np.ndarray | None], opset: int, out_type: int = TensorProto.FLOAT,
           **attrs) -> onnx.ModelProto:
    names = [n if v is not None else "" for n, v in inputs.items()]
    while names and names[-1] == "":
        names.pop()
    node = helper.make_node(op, names, ["y"], **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(inputs[n].dtype), None)
                    for n in names if n]
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info("y", out_type, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _run_both(model: onnx.ModelProto, feed: dict) -> tuple[np.ndarray, np.ndarray]:
    feed = {k: v for k, v in feed.items() if v is not None}
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = carrack.InferenceSession(model.SerializeToString()).run(None, feed)[0]
    return got, expected


def _carrack(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    return carrack.InferenceSession(model.SerializeToString()).run(
        None, {k: v for k, v in feed.items() if v is not None})[0]


def _complex(z: np.ndarray) -> np.ndarray:
    return np.stack([z.real, z.imag], axis=-1)


RNG = np.random.default_rng(0)
REAL = RNG.standard_normal((2, 8, 6, 1)).astype(np.float32)
CPLX = RNG.standard_normal((2, 8, 6, 2)).astype(np.float32)


@pytest.mark.parametrize("x", [REAL, CPLX], ids=["real", "complex"])
@pytest.mark.parametrize("axis", [1, 2, -2, -3])
@pytest.mark.parametrize("inverse", [0, 1])
@pytest.mark.parametrize("dft_length", [None, 5, 11])
def test_dft20_against_numpy(x, axis, inverse, dft_length):
    feed = {"x": x, "dft_length": None if dft_length is None else np.array(dft_length, np.int64),
            "axis": np.array(axis, np.int64)}
    got = _carrack(_model("DFT", feed, 20, inverse=inverse), feed)
    z = x[..., 0] if x.shape[-1] == 1 else x[..., 0] + 1j * x[..., 1]
    fn = np.fft.ifft if inverse else np.fft.fft
    expected = _complex(fn(z.astype(np.complex128), n=dft_length, axis=axis % x.ndim))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("axis", [1, 2])
@pytest.mark.parametrize("dft_length", [None, 6, 9])
def test_dft17_rfft_and_irfft_against_onnxruntime(axis, dft_length):
    length = None if dft_length is None else np.array(dft_length, np.int64)
    feed = {"x": REAL, "dft_length": length}
    got, expected = _run_both(_model("DFT", feed, 17, onesided=1, axis=axis), feed)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    spectrum = _complex(np.fft.rfft(REAL[..., 0], axis=axis)).astype(np.float32)
    feed = {"x": spectrum, "dft_length": length}
    got = _carrack(_model("DFT", feed, 17, onesided=1, inverse=1, axis=axis), feed)
    n = dft_length if dft_length is not None else 2 * (spectrum.shape[axis] - 1)
    expected = np.fft.irfft(spectrum[..., 0] + 1j * spectrum[..., 1], n=n, axis=axis)[..., None]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("inverse", [0, 1])
def test_dft17_complex_against_onnxruntime(inverse):
    feed = {"x": CPLX}
    got, expected = _run_both(_model("DFT", feed, 17, inverse=inverse, axis=1), feed)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_dft_double_and_float16_keep_dtype():
    for dtype in (np.float64, np.float16):
        feed = {"x": REAL.astype(dtype)}
        got = _carrack(_model("DFT", feed, 17, axis=1), feed)
        assert got.dtype == dtype
        np.testing.assert_allclose(got.astype(np.float64), _complex(np.fft.fft(REAL[..., 0], axis=1)),
                                   rtol=1e-2, atol=2e-2)


def test_dft_rejects_last_axis():
    feed = {"x": REAL, "dft_length": None, "axis": np.array(3, np.int64)}
    with pytest.raises(carrack.RunFailure):
        _carrack(_model("DFT", feed, 20), feed)


@pytest.mark.parametrize("onesided", [0, 1])
@pytest.mark.parametrize("with_window", [False, True])
@pytest.mark.parametrize("step", [3, 8])
def test_stft_against_onnxruntime(onesided, with_window, step):
    signal = RNG.standard_normal((2, 40, 1)).astype(np.float32)
    window = np.hanning(10).astype(np.float32) if with_window else None
    feed = {"signal": signal, "frame_step": np.array(step, np.int64), "window": window,
            "frame_length": np.array(10, np.int64)}
    got, expected = _run_both(_model("STFT", feed, 17, onesided=onesided), feed)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_stft_complex_signal():
    signal = RNG.standard_normal((1, 20, 2)).astype(np.float32)
    feed = {"signal": signal, "frame_step": np.array(4, np.int64), "window": None,
            "frame_length": np.array(8, np.int64)}
    got = _carrack(_model("STFT", feed, 17, onesided=0), feed)
    z = signal[0, :, 0] + 1j * signal[0, :, 1]
    expected = np.stack([np.fft.fft(z[s:s + 8]) for s in range(0, 13, 4)])
    np.testing.assert_allclose(got[0], _complex(expected), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.DOUBLE])
def test_windows_against_onnxruntime(op, periodic, dtype):
    feed = {"size": np.array(17, np.int64)}
    got, expected = _run_both(_model(op, feed, 17, out_type=dtype, periodic=periodic, output_datatype=dtype), feed)
    assert got.dtype == expected.dtype
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_symmetric_windows_match_numpy():
    for op, fn in (("HannWindow", np.hanning), ("HammingWindow", None), ("BlackmanWindow", np.blackman)):
        feed = {"size": np.array(12, np.int32)}
        got = _carrack(_model(op, feed, 17, out_type=TensorProto.DOUBLE, periodic=0,
                              output_datatype=TensorProto.DOUBLE), feed)
        if fn is not None:
            np.testing.assert_allclose(got, fn(12), atol=1e-12)


def test_window_integer_output_type():
    feed = {"size": np.array(8, np.int64)}
    got = _carrack(_model("HannWindow", feed, 17, out_type=TensorProto.INT32, output_datatype=TensorProto.INT32), feed)
    assert got.dtype == np.int32 and got.shape == (8,)


@pytest.mark.parametrize("args", [(8, 16, 8192, 0.0, 4096.0), (10, 64, 16000, 100.0, 7000.0),
                                  (20, 512, 22050, 20.0, 11025.0), (5, 31, 8000, 300.0, 3000.0)])
def test_mel_weight_matrix_against_onnxruntime(args):
    n_mel, n_dft, rate, low, high = args
    feed = {"num_mel_bins": np.array(n_mel, np.int64), "dft_length": np.array(n_dft, np.int64),
            "sample_rate": np.array(rate, np.int64), "lower_edge_hertz": np.array(low, np.float32),
            "upper_edge_hertz": np.array(high, np.float32)}
    got, expected = _run_both(_model("MelWeightMatrix", feed, 17), feed)
    assert got.shape == (n_dft // 2 + 1, n_mel) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
