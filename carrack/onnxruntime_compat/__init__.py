"""``carrack.install_as_onnxruntime()``: make ``import onnxruntime`` give carrack in this process.

After the call, ``import onnxruntime`` (and the submodules code written for onnxruntime imports:
``onnxruntime.capi.onnxruntime_pybind11_state``, ``onnxruntime.capi.onnxruntime_inference_collection``,
``onnxruntime.transformers.io_binding_helper``) resolve to carrack's implementations, and
``importlib.metadata.version("onnxruntime")`` answers, so libraries such as Hugging Face optimum run on carrack
unchanged. The stand-in module's ``__version__`` is the onnxruntime API version carrack follows
(ONNXRUNTIME_API_VERSION); ``carrack.__version__`` stays carrack's own. Other onnxruntime submodules
(quantization, the transformers graph optimizer, training) are not provided: importing them raises
ModuleNotFoundError, and importlib.util.find_spec finds none of them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
import types
from typing import Any

#: the onnxruntime release whose Python API carrack's stand-in follows (its tests compare against it)
ONNXRUNTIME_API_VERSION = "1.32.0"

_SUBMODULES = {
    "onnxruntime.capi": "carrack.capi",
    "onnxruntime.capi.onnxruntime_pybind11_state": "carrack.capi.onnxruntime_pybind11_state",
    "onnxruntime.capi._pybind_state": "carrack.capi.onnxruntime_pybind11_state",
    "onnxruntime.capi.onnxruntime_inference_collection": "carrack.capi.onnxruntime_inference_collection",
    "onnxruntime.transformers.io_binding_helper": "carrack.onnxruntime_compat.io_binding_helper",
}


def install_as_onnxruntime() -> types.ModuleType:
    """Make ``import onnxruntime`` resolve to carrack in this process; returns the stand-in module.

    Call it before anything imports onnxruntime (a module that already imported the real onnxruntime would keep
    it, so that case raises RuntimeError). Calling it again is harmless.
    """
    current = sys.modules.get("onnxruntime")
    if current is not None:
        if getattr(current, "__carrack_version__", None) is not None:
            return current
        raise RuntimeError("onnxruntime is already imported in this process; call carrack.install_as_onnxruntime() "
                           "before anything imports onnxruntime")
    root = _root_module()
    sys.modules["onnxruntime"] = root
    transformers = _package("onnxruntime.transformers")
    sys.modules["onnxruntime.transformers"] = transformers
    root.transformers = transformers  # type: ignore[attr-defined]
    for name, target in _SUBMODULES.items():
        module = importlib.import_module(target)
        sys.modules[name] = module
        parent, _, leaf = name.rpartition(".")
        setattr(sys.modules[parent], leaf, module)
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder())
    return root


def _package(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"carrack's stand-in for {name}")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []  # a package whose submodules come only from sys.modules
    return module


def _root_module() -> types.ModuleType:
    import carrack
    import carrack.capi

    root = _package("onnxruntime")
    root.capi = carrack.capi  # type: ignore[attr-defined]
    for name in carrack.__all__:
        setattr(root, name, getattr(carrack, name))
    root.__doc__ = f"carrack {carrack.__version__} standing in for onnxruntime (carrack.install_as_onnxruntime)"
    root.__version__ = ONNXRUNTIME_API_VERSION
    root.version = ONNXRUNTIME_API_VERSION  # type: ignore[attr-defined]
    root.__carrack_version__ = carrack.__version__  # type: ignore[attr-defined]
    root.package_name = "carrack"  # type: ignore[attr-defined]
    root.cuda_version = ""  # type: ignore[attr-defined]
    root.get_version_string = lambda: ONNXRUNTIME_API_VERSION  # type: ignore[attr-defined]
    return root


class _StandInDistribution(importlib.metadata.Distribution):
    """What importlib.metadata reports for 'onnxruntime' while carrack stands in for it."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            import carrack

            return (f"Metadata-Version: 2.1\nName: onnxruntime\nVersion: {ONNXRUNTIME_API_VERSION}\n"
                    f"Summary: carrack {carrack.__version__} standing in for onnxruntime\n")
        return None

    def locate_file(self, path: Any) -> Any:
        import carrack

        return os.path.join(os.path.dirname(carrack.__file__), str(path))


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Answers importlib.metadata's questions about the onnxruntime distribution while carrack stands in for it."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        return None  # modules come from sys.modules; onnxruntime submodules carrack lacks are simply not found

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and name.lower().replace("_", "-") == "onnxruntime":
            return [_StandInDistribution()]
        return []
