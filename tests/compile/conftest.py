from __future__ import annotations

import pytest

from tests.compile.models import MODELS, export


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """name -> (onnx path, run-time maxima) for every test model, exported once."""
    directory = tmp_path_factory.mktemp("compile_models")
    return {name: export(name, directory) for name in MODELS}
