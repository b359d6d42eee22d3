"""onnxruntime's `capi` package path under carrack: `carrack.capi.onnxruntime_pybind11_state` holds the error classes
that code written for onnxruntime catches (carrack's own errors subclass them)."""
