"""onnxruntime's Python session classes at its module path: onnxruntime.capi.onnxruntime_inference_collection."""

from carrack.runtime.iobinding import IOBinding
from carrack.runtime.options import RunOptions, SessionOptions
from carrack.runtime.ortvalue import OrtDevice, OrtValue
from carrack.runtime.session import InferenceSession, ModelMetadata, NodeArg

Session = InferenceSession

__all__ = ["IOBinding", "InferenceSession", "ModelMetadata", "NodeArg", "OrtDevice", "OrtValue", "RunOptions",
           "Session", "SessionOptions"]
