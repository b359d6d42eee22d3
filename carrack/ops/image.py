"""ImageDecoder: encoded image bytes -> uint8 HWC pixels, decoded by Pillow (an optional dependency)."""

from __future__ import annotations

import io

import numpy as np

from carrack.errors import RunFailure
from carrack.ops.registry import Kernel, register

_CHANNELS = {"RGB": 3, "BGR": 3, "Grayscale": 1}


@register("ImageDecoder", since=20)
class ImageDecoder(Kernel):
    def setup(self) -> None:
        self.pixel_format = self.attr("pixel_format", "RGB")
        if self.pixel_format not in _CHANNELS:
            self.fail(f"pixel_format must be RGB, BGR or Grayscale, got {self.pixel_format!r}")

    def run(self, encoded):
        try:
            from PIL import Image, UnidentifiedImageError
        except ImportError:
            raise RunFailure("ImageDecoder needs Pillow: pip install pillow") from None
        data = np.ascontiguousarray(encoded, dtype=np.uint8).tobytes()
        try:
            with Image.open(io.BytesIO(data)) as img:
                pixels = np.asarray(img.convert("L" if self.pixel_format == "Grayscale" else "RGB"))
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
            # The spec's answer to undecodable data: an empty image, not an error.
            return np.zeros((0, 0, _CHANNELS[self.pixel_format]), dtype=np.uint8)
        if self.pixel_format == "Grayscale":
            return pixels[:, :, None].astype(np.uint8, copy=True)
        if self.pixel_format == "BGR":
            pixels = pixels[:, :, ::-1]
        return np.ascontiguousarray(pixels, dtype=np.uint8)
