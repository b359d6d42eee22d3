"""Hugging Face optimum on carrack: the only change is carrack.install_as_onnxruntime() before optimum is imported.

Tiny random-weight BERT and GPT-2 models are exported with optimum in the test; a subprocess runs them with optimum on
onnxruntime, another on carrack (the import swap stays in that process), and the outputs are compared.
optimum's onnxruntime integration (optimum-onnx) pins transformers < 4.58, so .ci/run installs it in an overlay
environment of its own (the `optimum` extra) and runs this file there; elsewhere it skips.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("optimum") is None
                                or importlib.util.find_spec("optimum.onnxruntime") is None,
                                reason="optimum with its onnxruntime integration is not installed "
                                       "(pip install -e '.[optimum]'; .ci/run does it in an overlay env)")

PROBE = os.path.join(os.path.dirname(__file__), "optimum_probe.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe(*args: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
               TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run([sys.executable, PROBE, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"optimum_probe {args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimum")
    _probe("export-run", str(root / "models"), str(root / "onnxruntime.npz"))
    _probe("run", str(root / "models"), "carrack", str(root / "carrack.npz"))
    return dict(np.load(root / "onnxruntime.npz")), dict(np.load(root / "carrack.npz"))


def test_the_carrack_run_used_carrack_and_the_reference_run_onnxruntime(outcomes):
    reference, carrack_run = outcomes
    assert str(carrack_run["session_class"]).startswith("carrack.")
    assert "carrack" in str(carrack_run["engine"])
    assert str(reference["session_class"]).startswith("onnxruntime.")


@pytest.mark.parametrize("name", ["seqcls_logits", "seqcls_logits_iobinding", "pipeline_scores", "feature_hidden",
                                  "pipeline_features", "causal_logits"])
def test_outputs_match_onnxruntime(outcomes, name):
    reference, carrack_run = outcomes
    assert carrack_run[name].shape == reference[name].shape
    np.testing.assert_allclose(carrack_run[name], reference[name], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["generated", "generated_iobinding"])
def test_greedy_generation_matches_onnxruntime(outcomes, name):
    reference, carrack_run = outcomes
    np.testing.assert_array_equal(carrack_run[name], reference[name])
    assert carrack_run[name].shape == (2, 12)
    assert len(np.unique(carrack_run[name][:, 4:])) > 2  # the tiny model's greedy tokens vary (a meaningful check)
