"""Session-scoped fixtures: small torch CNN and transformer models, exported to ONNX and quantized by
onnxruntime.quantization in each of its modes."""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx
import pytest

torch = pytest.importorskip("torch")
quantization = pytest.importorskip("onnxruntime.quantization")

from tests.quant.helpers import quantize_static  # noqa: E402 - once onnxruntime is known to be there

CNN_INPUT = (1, 3, 16, 16)
SEQ_INPUT = (2, 8, 32)


class SmallCnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.c3 = nn.Conv2d(32, 32, 1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.c2(x))
        x = x + torch.relu(self.c3(torch.relu(self.dw(x))))
        x = torch.nn.functional.max_pool2d(x, 2)
        return self.fc(x.mean((2, 3)))


def _export(module: torch.nn.Module, shape: tuple[int, ...], path: Path) -> Path:
    torch.manual_seed(0)
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(*shape),), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"])
    return path


@pytest.fixture(scope="session")
def quant_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quant")


@pytest.fixture(scope="session")
def float_models(quant_dir) -> dict[str, tuple[Path, tuple[int, ...]]]:
    torch.manual_seed(0)
    cnn = _export(SmallCnn(), CNN_INPUT, quant_dir / "cnn.onnx")
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, batch_first=True, dropout=0.0)
    transformer = _export(torch.nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False), SEQ_INPUT,
                          quant_dir / "transformer.onnx")
    return {"cnn": (cnn, CNN_INPUT), "transformer": (transformer, SEQ_INPUT)}


#: variant -> keyword arguments of quantize_static (None: quantize_dynamic)
STATIC_VARIANTS = {
    "qdq": {"quant_format": "QDQ"},
    "qoperator": {"quant_format": "QOperator"},
    "qdq_per_channel": {"quant_format": "QDQ", "per_channel": True},
    "qoperator_per_channel_reduce_range": {"quant_format": "QOperator", "per_channel": True, "reduce_range": True},
}


@pytest.fixture(scope="session")
def quantized_model(float_models, quant_dir):
    """quantized_model(model, variant) -> path of the quantized file, built once per session."""
    cache: dict[tuple[str, str], Path] = {}

    def build(model: str, variant: str) -> Path:
        key = (model, variant)
        if key not in cache:
            source, shape = float_models[model]
            target = quant_dir / f"{model}_{variant}.onnx"
            if variant == "dynamic":
                quantization.quantize_dynamic(str(source), str(target))
            elif variant == "dynamic_per_channel_reduce_range":
                quantization.quantize_dynamic(str(source), str(target), per_channel=True, reduce_range=True)
            elif variant == "nbits":
                from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

                quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), block_size=16, is_symmetric=False)
                quantizer.process()
                quantizer.model.save_model_to_file(str(target))
            else:
                quantize_static(source, target, shape, 4, **STATIC_VARIANTS[variant])
            cache[key] = target
        return cache[key]

    return build
