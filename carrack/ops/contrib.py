"""com.microsoft contrib kernels that onnxruntime tools and carrack's optimizer emit."""

from __future__ import annotations
