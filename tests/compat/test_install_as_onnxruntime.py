"""carrack.install_as_onnxruntime(): `import onnxruntime` gives carrack in that process (checked in subprocesses so
the swap does not leak into other tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_import_onnxruntime_resolves_to_carrack():
    done = _python("""
        import importlib.metadata, importlib.util
        import numpy as np
        import carrack
        stand_in = carrack.install_as_onnxruntime()
        import onnxruntime
        from onnxruntime import InferenceSession, IOBinding, OrtValue, SessionOptions
        from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, NoSuchFile
        from onnxruntime.capi.onnxruntime_inference_collection import OrtValue as CollectionOrtValue
        from onnxruntime.transformers.io_binding_helper import TypeHelper
        assert onnxruntime is stand_in and carrack.install_as_onnxruntime() is stand_in
        assert InferenceSession is carrack.InferenceSession and IOBinding is carrack.IOBinding
        assert OrtValue is CollectionOrtValue is carrack.OrtValue
        assert issubclass(carrack.InvalidArgument, InvalidArgument) and issubclass(carrack.RunFailure, Fail)
        assert carrack.__version__ == "0.1.0" and onnxruntime.__carrack_version__ == carrack.__version__
        assert onnxruntime.__version__ == importlib.metadata.version("onnxruntime") == "1.32.0"
        assert importlib.util.find_spec("onnxruntime") is not None
        assert TypeHelper.ort_type_to_numpy_type("tensor(int64)") is np.int64
        assert importlib.util.find_spec("onnxruntime.training") is None
        try:
            import onnxruntime.quantization
        except ModuleNotFoundError as e:
            assert "onnxruntime.quantization" in str(e), e
        else:
            raise AssertionError("onnxruntime.quantization imported")
        try:
            InferenceSession("/absent/model.onnx")
        except NoSuchFile as e:
            print("ok", type(e).__name__)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok ModelFileNotFound"


def test_installing_after_the_real_onnxruntime_was_imported_is_refused():
    done = _python("""
        import onnxruntime
        import carrack
        try:
            carrack.install_as_onnxruntime()
        except RuntimeError as e:
            print("refused:", e)
    """)
    assert done.returncode == 0, done.stderr
    assert "refused: onnxruntime is already imported" in done.stdout
