"""A small CNN exported by torch.onnx with dynamic batch, height and width, for the plan tests."""

from __future__ import annotations

import warnings
from pathlib import Path


def export_small_cnn(path: Path, pooled: bool) -> str:
    """Conv + BN + ReLU, depthwise + 1x1 with a residual, a strided conv, a global mean and a linear head; `pooled`:
    a ceil-mode max pool before the mean and a softmax after the head. Writes `path` and returns it as a str."""
    import torch

    torch.manual_seed(0)
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU6(), nn.Conv2d(8, 8, 1))
            self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
            self.head = nn.Linear(16, 5)

        def forward(self, x):
            x = self.stem(x)
            x = torch.relu(self.down(x + self.dw(x)))
            if not pooled:
                return self.head(x.mean(dim=(2, 3)))
            x = nn.functional.max_pool2d(x, 2, ceil_mode=True)
            return torch.softmax(self.head(x.mean(dim=(2, 3))), -1)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Net().eval(), (torch.randn(1, 3, 16, 16),), str(path), input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch", 2: "height", 3: "width"}},
                          opset_version=17, dynamo=False)
    return str(path)
