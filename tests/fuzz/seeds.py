"""Seed inputs for the mutation fuzzer: real ONNX models (the onnx wheel's light, simple and pytorch-converted backend
test models with their inputs, plus small torch exports made here) and GGUF files written by gguf-py."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import ModelProto, numpy_helper

ONNX_SUITES = ("light", "simple", "pytorch-converted")


@dataclass
class Seed:
    name: str
    data: bytes
    feeds: dict[str, np.ndarray] = field(default_factory=dict)


def onnx_wheel_seeds(max_bytes: int = 1 << 20) -> list[Seed]:
    """The backend test models of the onnx wheel below max_bytes, with their recorded inputs where they have them."""
    root = Path(onnx.__file__).parent / "backend" / "test" / "data"
    seeds = []
    for suite in ONNX_SUITES:
        for path in sorted(glob.glob(str(root / suite / "*.onnx")) + glob.glob(str(root / suite / "*/model.onnx"))):
            if os.path.getsize(path) > max_bytes:
                continue
            data = Path(path).read_bytes()
            seeds.append(Seed(f"{suite}/{Path(path).parent.name if path.endswith('model.onnx') else Path(path).stem}",
                              data, _recorded_inputs(path, data)))
    return seeds


def _recorded_inputs(model_path: str, data: bytes) -> dict[str, np.ndarray]:
    files = sorted(glob.glob(os.path.join(os.path.dirname(model_path), "test_data_set_0", "input_*.pb")))
    if not files:
        return {}
    model = ModelProto.FromString(data)
    initialized = {t.name for t in model.graph.initializer}
    names = [v.name for v in model.graph.input if v.name not in initialized]
    feeds = {}
    for name, f in zip(names, files):
        t = onnx.TensorProto()
        t.ParseFromString(Path(f).read_bytes())
        feeds[name] = numpy_helper.to_array(t)
    return feeds


_TORCH_EXPORTS = r'''
import sys, torch
out = sys.argv[1]
torch.manual_seed(0)

class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.a = torch.nn.Linear(8, 16); self.b = torch.nn.Linear(16, 4)
    def forward(self, x):
        return torch.softmax(self.b(torch.relu(self.a(x))), -1)

class SmallConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1); self.bn = torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 8, 3, stride=2, groups=8); self.fc = torch.nn.Linear(8, 5)
    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.c1(x))), 2)
        x = torch.nn.functional.avg_pool2d(self.c2(x), 1).mean((2, 3))
        return self.fc(x)

class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16); self.att = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.ln = torch.nn.LayerNorm(16); self.up = torch.nn.Linear(16, 32)
    def forward(self, ids):
        x = self.emb(ids); y, _ = self.att(x, x, x, need_weights=False)
        x = self.ln(x + y)
        return torch.nn.functional.gelu(self.up(x)).cumsum(1)[:, -1:, :].expand(-1, ids.shape[1], -1)

cases = [
    ("torch_mlp", Mlp(), (torch.randn(2, 8),), {"x": {0: "batch"}}),
    ("torch_conv", SmallConv(), (torch.randn(1, 3, 12, 12),), {"x": {0: "batch", 2: "h", 3: "w"}}),
    ("torch_attention", Attention(), (torch.randint(0, 32, (2, 5)),), {"x": {0: "batch", 1: "seq"}}),
]
for name, module, args, axes in cases:
    torch.onnx.export(module.eval(), args, f"{out}/{name}.onnx", dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"], dynamic_axes=axes)
'''


def torch_export_seeds(folder: str | os.PathLike) -> list[Seed]:
    """Three small torch models (MLP, conv net, attention block) exported by torch.onnx into `folder` (once; the
    exports run in a child so that the fuzzer's process never imports torch); [] without torch."""
    folder = Path(folder)
    names = ["torch_mlp", "torch_conv", "torch_attention"]
    if not all((folder / f"{n}.onnx").exists() for n in names):
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-c", _TORCH_EXPORTS, str(folder)], capture_output=True, timeout=600)
        if done.returncode != 0:
            return []
    return [Seed(n, (folder / f"{n}.onnx").read_bytes()) for n in names]


def gguf_seeds(folder: str | os.PathLike) -> list[bytes]:
    """GGUF files written by gguf-py: metadata of every kind, plain and quantized tensors, both byte orders."""
    from tests.gguf import ARRAY, FLOAT32, STRING, UINT8, UINT64, simple_raw_file, write_with_gguf_py

    path = Path(folder) / "seed.gguf"
    meta = [("general.architecture", "llama", STRING), ("s", "text", STRING), ("arr", ["a", "bc", ""], ARRAY, STRING),
            ("u", [1, 2, 3], ARRAY, UINT8), ("nested", [[1, 2], [3]], ARRAY), ("f", 0.5, FLOAT32),
            ("big", 2**40, UINT64)]
    rng = np.random.default_rng(0)
    tensors = [("w", rng.standard_normal((3, 4)).astype(np.float32), None),
               ("i", np.arange(5, dtype=np.int8), None),
               ("h", np.arange(6, dtype=np.float16).reshape(3, 2), None),
               ("q8", rng.integers(0, 255, (2, 34), dtype=np.uint8), 8),
               ("q4", rng.integers(0, 255, (2, 18), dtype=np.uint8), 2)]
    seeds = []
    for big_endian in (False, True):
        write_with_gguf_py(path, tensors, metadata=meta, big_endian=big_endian, alignment=32)
        seeds.append(path.read_bytes())
    seeds.append(simple_raw_file().tobytes())
    return seeds
