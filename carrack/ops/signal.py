"""Signal processing: DFT, STFT, the cosine-sum windows and MelWeightMatrix (numpy.fft underneath).

Complex tensors travel as real ones with a trailing dimension of 2 (real, imaginary); real signals have a
trailing dimension of 1.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from carrack.ir.dtypes import to_numpy
from carrack.ops.registry import Kernel, register


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """numpy.fft keeps float32 and float64; narrower floats go through float32."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _to_complex(x: np.ndarray) -> np.ndarray:
    """[..., 1] real or [..., 2] (real, imaginary) -> complex [...]."""
    x = x.astype(_compute_dtype(x.dtype), copy=False)
    if x.shape[-1] == 1:
        return x[..., 0].astype(np.result_type(x.dtype, np.complex64))
    return x[..., 0] + 1j * x[..., 1]


def _from_complex(z: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.stack([z.real, z.imag], axis=-1).astype(dtype, copy=False)


def _scalar(v, default: int | None = None) -> int | None:
    return default if v is None or np.size(v) == 0 else int(np.asarray(v).reshape(-1)[0])


class _DFTBase(Kernel):
    def setup(self) -> None:
        self.inverse = bool(self.attr("inverse", 0))
        self.onesided = bool(self.attr("onesided", 0))

    def _dft(self, x: np.ndarray, dft_length: int | None, axis: int) -> np.ndarray:
        rank = x.ndim
        if not (-rank <= axis <= -2 or 0 <= axis <= rank - 2):
            raise ValueError(f"axis {axis} is out of range for a rank-{rank} input (the last axis holds re/im)")
        axis = axis % rank
        if x.shape[-1] not in (1, 2):
            raise ValueError(f"the last dimension must be 1 (real) or 2 (complex), got {x.shape[-1]}")
        if self.onesided and self.inverse:
            n = dft_length if dft_length is not None else 2 * (x.shape[axis] - 1)
            out = np.fft.irfft(_to_complex(x), n=n, axis=axis)
            return out[..., None].astype(x.dtype, copy=False)
        z = _to_complex(x)
        n = dft_length if dft_length is not None else x.shape[axis]
        if self.inverse:
            out = np.fft.ifft(z, n=n, axis=axis)
        elif self.onesided and x.shape[-1] == 1:
            out = np.fft.rfft(z.real, n=n, axis=axis)
        else:
            out = np.fft.fft(z, n=n, axis=axis)
            if self.onesided:
                out = np.take(out, np.arange(n // 2 + 1), axis=axis)
        return _from_complex(out, x.dtype)


@register("DFT", since=17)
class DFT17(_DFTBase):
    """Opset 17-19: the axis is an attribute (default 1)."""

    def setup(self) -> None:
        super().setup()
        self.axis = int(self.attr("axis", 1))

    def run(self, x, dft_length=None):
        return self._dft(x, _scalar(dft_length), self.axis)


@register("DFT", since=20)
class DFT20(_DFTBase):
    """Opset 20+: the axis is an optional input (default -2, the last signal axis)."""

    def run(self, x, dft_length=None, axis=None):
        return self._dft(x, _scalar(dft_length), _scalar(axis, -2))


@register("STFT", since=17)
class STFT(Kernel):
    def setup(self) -> None:
        self.onesided = bool(self.attr("onesided", 1))

    def run(self, signal, frame_step, window=None, frame_length=None):
        if signal.ndim == 2:
            signal = signal[..., None]
        step = _scalar(frame_step)
        length = _scalar(frame_length)
        if length is None:
            length = window.shape[0] if window is not None else signal.shape[1]
        if window is not None and window.shape[0] != length:
            raise ValueError(f"window has length {window.shape[0]}, frame_length is {length}")
        if step is None or step <= 0 or length <= 0 or length > signal.shape[1]:
            raise ValueError(f"bad frame_step {step} / frame_length {length} for a signal of length "
                             f"{signal.shape[1]}")
        z = _to_complex(signal)  # [batch, signal_length]
        frames = np.lib.stride_tricks.sliding_window_view(z, length, axis=1)[:, ::step]  # [batch, frames, length]
        if window is not None:
            w = window.astype(_compute_dtype(window.dtype), copy=False)
            frames = frames * w
        real = signal.shape[-1] == 1 and not np.iscomplexobj(frames)
        if self.onesided and real:
            spectrum = np.fft.rfft(frames.real, axis=-1)
        else:
            spectrum = np.fft.fft(frames, axis=-1)
            if self.onesided:
                spectrum = spectrum[..., : length // 2 + 1]
        return _from_complex(spectrum, signal.dtype)


class _CosineWindow(Kernel):
    """w[n] = sum_k (-1)^k a_k cos(2 pi k n / N); N = size (periodic) or size - 1 (symmetric)."""

    coefficients: tuple[float, ...] = ()

    def setup(self) -> None:
        self.periodic = bool(self.attr("periodic", 1))
        self.dtype = to_numpy(self.attr("output_datatype", TensorProto.FLOAT))

    def run(self, size):
        n = _scalar(size)
        if n is None or n < 0:
            raise ValueError(f"window size must be a non-negative scalar, got {size}")
        period = max(n if self.periodic else n - 1, 1)
        phase = 2 * np.pi * np.arange(n, dtype=np.float64) / period
        w = np.zeros(n, dtype=np.float64)
        for k, a in enumerate(self.coefficients):
            w += (-1) ** k * a * np.cos(k * phase)
        return w.astype(self.dtype)


@register("HannWindow", since=17)
class HannWindow(_CosineWindow):
    coefficients = (0.5, 0.5)


@register("HammingWindow", since=17)
class HammingWindow(_CosineWindow):
    coefficients = (25 / 46, 21 / 46)


@register("BlackmanWindow", since=17)
class BlackmanWindow(_CosineWindow):
    coefficients = (0.42, 0.5, 0.08)


@register("MelWeightMatrix", since=17)
class MelWeightMatrix(Kernel):
    """Triangular filters, peak 1, between edges spaced evenly on the mel scale and rounded down to DFT bins."""

    def setup(self) -> None:
        self.dtype = to_numpy(self.attr("output_datatype", TensorProto.FLOAT))

    def run(self, num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz):
        n_mel, n_dft, rate = _scalar(num_mel_bins), _scalar(dft_length), _scalar(sample_rate)
        n_bins = n_dft // 2 + 1
        low, high = (_mel(float(np.asarray(v).reshape(-1)[0])) for v in (lower_edge_hertz, upper_edge_hertz))
        step = (high - low) / (n_mel + 2)
        edges_hz = 700 * np.expm1((np.arange(n_mel + 2) * step + low) / 2595 * np.log(10))
        edges = np.floor((n_dft + 1) * edges_hz / rate).astype(np.int64)
        left, center, right = edges[None, :-2], edges[None, 1:-1], edges[None, 2:]
        j = np.arange(n_bins)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            rising = (j - left) / (center - left)
            falling = (right - j) / (right - center)
        out = np.where((left <= j) & (j < center), rising, 0.0)
        out = np.where((center < j) & (j < right), falling, out)
        out = np.where(j == center, 1.0, out)
        return out.astype(self.dtype)


def _mel(hz: float) -> float:
    return 2595 * np.log10(1 + hz / 700)
