"""Build carrack's benchmark model suite locally (random weights, nothing downloaded).

Models, written to $CARRACK_MODELS (default ~/.cache/carrack-bench) as NAME.onnx plus a NAME.json sidecar that
says how to feed them:

  resnet50      ResNet-50-like CNN (bottleneck blocks 3-4-6-3), 1x3x224x224, dynamic batch, BatchNorm kept
  mobilenetv2   MobileNetV2-like CNN (inverted residuals, depthwise convs, ReLU6), 1x3x224x224, dynamic batch
  bert_base     transformers BertModel(BertConfig()), batch 1 x 128 tokens, dynamic batch and sequence
  gpt2          transformers GPT2Model(GPT2Config()), no KV cache, batch 1 x 64 tokens, dynamic batch and sequence
  vit_small     transformers ViTModel, hidden 384, 12 layers, 6 heads, patch 16, 1x3x224x224, dynamic batch
  encoder_1024  Conv+BatchNorm+ReLU image encoder on 1x3x1024x1024 (large activations: the memory benchmark)
  light_*       the onnx wheel's backend/test/data/light models, copied as they are

torch is needed for the first six (transformers for bert_base, gpt2, vit_small); a model whose dependencies are
missing is skipped with a message. CNNs go through the TorchScript exporter with constant folding off so that
BatchNormalization nodes stay in the graph as a training framework's export has them; the transformer models go
through torch.onnx's dynamo exporter (falling back to the TorchScript one).

Usage: python benchmarks/make_models.py [--only a,b] [--force] [--list]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import onnx

OPSET = 18
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def models_dir() -> Path:
    return Path(os.environ.get("CARRACK_MODELS") or Path.home() / ".cache" / "carrack-bench")


# --------------------------------------------------------------------------------------------- torch definitions
def _torch_nets():
    """The CNN architectures, defined here so that nothing is downloaded (torchvision is not needed)."""
    import torch
    from torch import nn

    def conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: type | None = nn.ReLU):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, act()) if act else nn.Sequential(*layers)

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, mid: int, stride: int):
            super().__init__()
            cout = 4 * mid
            self.body = nn.Sequential(conv_bn(cin, mid, 1), conv_bn(mid, mid, 3, stride),
                                      conv_bn(mid, cout, 1, act=None))
            self.shortcut = conv_bn(cin, cout, 1, stride, act=None) if stride != 1 or cin != cout else nn.Identity()
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.body(x) + self.shortcut(x))

    class ResNet50Like(nn.Module):
        def __init__(self, classes: int = 1000):
            super().__init__()
            layers: list[nn.Module] = [conv_bn(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1)]
            cin = 64
            for stage, repeats in enumerate((3, 4, 6, 3)):
                mid = 64 << stage
                for i in range(repeats):
                    layers.append(Bottleneck(cin, mid, 2 if i == 0 and stage > 0 else 1))
                    cin = 4 * mid
            self.features = nn.Sequential(*layers)
            self.head = nn.Linear(cin, classes)

        def forward(self, x):
            return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int):
            super().__init__()
            hidden = cin * expand
            expand_layers = [conv_bn(cin, hidden, 1, act=nn.ReLU6)] if expand != 1 else []
            self.body = nn.Sequential(*expand_layers, conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
                                      conv_bn(hidden, cout, 1, act=None))
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            y = self.body(x)
            return x + y if self.residual else y

    class MobileNetV2Like(nn.Module):
        # (expansion, channels, repeats, first stride)
        SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                    (6, 320, 1, 1))

        def __init__(self, classes: int = 1000):
            super().__init__()
            layers: list[nn.Module] = [conv_bn(3, 32, 3, 2, act=nn.ReLU6)]
            cin = 32
            for expand, cout, repeats, stride in self.SETTINGS:
                for i in range(repeats):
                    layers.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
                    cin = cout
            layers.append(conv_bn(cin, 1280, 1, act=nn.ReLU6))
            self.features = nn.Sequential(*layers)
            self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes))

        def forward(self, x):
            return self.head(self.features(x).mean(dim=(2, 3)))

    class Encoder1024(nn.Module):
        """Plain strided Conv+BN+ReLU pyramid: 1024^2 RGB -> 256 x 64 x 64 latent."""

        def __init__(self):
            super().__init__()
            plan = [(3, 16, 2), (16, 16, 1), (16, 32, 2), (32, 32, 1), (32, 64, 2), (64, 64, 1), (64, 128, 2),
                    (128, 128, 1)]
            self.stages = nn.Sequential(*(conv_bn(cin, cout, 3, stride) for cin, cout, stride in plan))
            self.project = nn.Conv2d(128, 256, 1)

        def forward(self, x):
            return self.project(self.stages(x))

    return {"resnet50": ResNet50Like, "mobilenetv2": MobileNetV2Like, "encoder_1024": Encoder1024}


def _randomize(model):
    """Seeded random weights with non-trivial BatchNorm statistics (fresh BN layers would be identities)."""
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.weight.data = 0.75 + 0.5 * torch.rand(n, generator=gen)
            m.bias.data = 0.1 * torch.randn(n, generator=gen)
            m.running_mean.data = 0.1 * torch.randn(n, generator=gen)
            m.running_var.data = 0.75 + 0.5 * torch.rand(n, generator=gen)
        elif isinstance(m, nn.Conv2d):
            fan_in = m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]
            m.weight.data = torch.randn(m.weight.shape, generator=gen) * (2.0 / fan_in) ** 0.5
    return model.eval()


# --------------------------------------------------------------------------------------------- model specs
def _image_input(size: int) -> dict:
    return {"name": "input", "shape": [1, 3, size, size], "dtype": "float32", "fill": "randn"}


def _token_inputs(names: list[str], seq: int, vocab: int) -> list[dict]:
    fills = {"input_ids": {"fill": "randint", "high": vocab}, "attention_mask": {"fill": "ones"},
             "token_type_ids": {"fill": "zeros"}}
    return [{"name": n, "shape": [1, seq], "dtype": "int64", **fills[n]} for n in names]


def _build_cnn(name: str):
    import torch

    net = _randomize(_torch_nets()[name]())
    size = 1024 if name == "encoder_1024" else 224
    spec = [_image_input(size)]
    return net, (torch.randn(*spec[0]["shape"]),), spec, {"input": {0: "batch"}}, ["output"], "legacy-keep-bn"


def _build_transformer(name: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if name == "bert_base":
        config = tf.BertConfig()
        model, names, seq = tf.BertModel(config, add_pooling_layer=False), ["input_ids", "attention_mask",
                                                                            "token_type_ids"], 128
    elif name == "gpt2":
        config = tf.GPT2Config(use_cache=False)
        model, names, seq = tf.GPT2Model(config), ["input_ids"], 64
    else:
        config = tf.ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                              image_size=224, patch_size=16)
        model = tf.ViTModel(config, add_pooling_layer=False)
        spec = [dict(_image_input(224), name="pixel_values")]
        return (_FirstOutput(model).eval(), (torch.randn(2, 3, 224, 224),), spec, {"pixel_values": {0: "batch"}},
                ["last_hidden_state"], "dynamo")
    spec = _token_inputs(names, seq, config.vocab_size)
    # example batch 2: torch.export specialises a dim whose example size is 1
    args = tuple(torch.ones(2, seq, dtype=torch.int64) if s["fill"] == "ones" else
                 torch.randint(0, s.get("high", 2), (2, seq)) for s in spec)
    axes = {n: {0: "batch", 1: "sequence"} for n in names}
    return _FirstOutput(model).eval(), args, spec, axes, ["last_hidden_state"], "dynamo"


def _FirstOutput(model):  # noqa: N802 - a factory standing in for a class
    import torch

    class FirstOutput(torch.nn.Module):
        """Return only the last hidden state, as a plain tensor (exporters dislike ModelOutput dicts)."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return self.model(*args, return_dict=False)[0]

    return FirstOutput()


BUILDERS: dict[str, tuple[Callable, tuple[str, ...], str]] = {
    "resnet50": (_build_cnn, ("torch",), "cnn"),
    "mobilenetv2": (_build_cnn, ("torch",), "cnn"),
    "bert_base": (_build_transformer, ("torch", "transformers"), "transformer"),
    "gpt2": (_build_transformer, ("torch", "transformers"), "transformer"),
    "vit_small": (_build_transformer, ("torch", "transformers"), "transformer"),
    "encoder_1024": (_build_cnn, ("torch",), "memory"),
}
LIGHT_MODELS = sorted(p.stem[len("light_"):] for p in LIGHT_DIR.glob("light_*.onnx")) if LIGHT_DIR.is_dir() else []


def all_model_names() -> list[str]:
    return list(BUILDERS) + [f"light_{n}" for n in LIGHT_MODELS]


# --------------------------------------------------------------------------------------------- export
def _export(net, args, path: Path, spec: list[dict], axes: dict, outputs: list[str], exporter: str) -> str:
    import torch

    names = [s["name"] for s in spec]
    if exporter == "dynamo":
        try:
            dims = {"batch": torch.export.Dim("batch", max=1024), "sequence": torch.export.Dim("sequence", max=512)}
            # forward(*args): one positional parameter holding every input
            shapes = (tuple({a: dims[d] for a, d in axes.get(n, {}).items()} for n in names),)
            torch.onnx.export(net, args, str(path), input_names=names, output_names=outputs, dynamo=True,
                              dynamic_shapes=shapes, opset_version=OPSET, external_data=False)
            return "torch.onnx dynamo"
        except Exception as e:  # noqa: BLE001 - fall back to the TorchScript exporter
            print(f"  dynamo export failed ({type(e).__name__}: {str(e)[:200]}); trying the TorchScript exporter")
    torch.onnx.export(net, args, str(path), input_names=names, output_names=outputs, dynamo=False,
                      dynamic_axes=axes, opset_version=OPSET, do_constant_folding=exporter != "legacy-keep-bn")
    kept = " (constant folding off: BatchNorm kept)" if exporter == "legacy-keep-bn" else ""
    return "torch.onnx TorchScript" + kept


def _sidecar(path: Path, spec: list[dict], kind: str, exporter: str, seconds: float) -> dict:
    model = onnx.load(str(path), load_external_data=False)
    return {"inputs": spec, "kind": kind, "exporter": exporter, "export_s": round(seconds, 1),
            "opsets": {d.domain or "ai.onnx": d.version for d in model.opset_import},
            "nodes": len(model.graph.node), "bytes": path.stat().st_size,
            "op_counts": dict(Counter(n.op_type for n in model.graph.node).most_common())}


def _light_spec(path: Path) -> list[dict]:
    """Feed spec of a light model: its real inputs (initializers listed as graph inputs are not fed)."""
    graph = onnx.load(str(path)).graph
    inits = {i.name for i in graph.initializer}
    spec = []
    for v in graph.input:
        if v.name in inits:
            continue
        shape = [d.dim_value or 1 for d in v.type.tensor_type.shape.dim]
        spec.append({"name": v.name, "shape": shape, "dtype": "float32", "fill": "randn"})
    return spec


def missing_deps(deps: tuple[str, ...]) -> list[str]:
    import importlib.util

    return [d for d in deps if importlib.util.find_spec(d) is None]


def make(name: str, out: Path, force: bool = False) -> Path | None:
    """Write NAME.onnx and NAME.json into `out`; returns the model path, or None when it was skipped."""
    path = out / f"{name}.onnx"
    if path.exists() and (out / f"{name}.json").exists() and not force:
        return path
    t0 = time.perf_counter()
    if name.startswith("light_"):
        shutil.copyfile(LIGHT_DIR / f"{name}.onnx", path)
        info = _sidecar(path, _light_spec(path), "light", "onnx wheel light model (as shipped)", 0.0)
    else:
        build, deps, kind = BUILDERS[name]
        lacking = missing_deps(deps)
        if lacking:
            print(f"skipping {name}: needs {', '.join(lacking)} (pip install {' '.join(lacking)})")
            return None
        net, args, spec, axes, outputs, exporter = build(name)
        exporter = _export(net, args, path, spec, axes, outputs, exporter)
        info = _sidecar(path, spec, kind, exporter, time.perf_counter() - t0)
    (out / f"{name}.json").write_text(json.dumps(info, indent=1))
    print(f"{name}: {info['nodes']} nodes, {info['bytes'] / 2**20:.1f} MiB, {info['exporter']} "
          f"({time.perf_counter() - t0:.0f} s)")
    return path


def _limit_threads() -> None:
    """Exports need no parallelism; the benchmark machine is often shared."""
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated model names (default: all)")
    p.add_argument("--force", action="store_true", help="rebuild models that already exist")
    p.add_argument("--list", action="store_true", help="print the model names and exit")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(all_model_names()))
        return 0
    names = args.only.split(",") if args.only else all_model_names()
    unknown = [n for n in names if n not in all_model_names()]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {all_model_names()}")
    _limit_threads()
    out = models_dir()
    out.mkdir(parents=True, exist_ok=True)
    print(f"models directory: {out}")
    failed = []
    for name in names:
        try:
            make(name, out, args.force)
        except Exception as e:  # noqa: BLE001 - one broken export must not stop the suite
            failed.append(name)
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[:500]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
