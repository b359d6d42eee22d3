"""A tiny GPT-2 with past key values exported by torch.onnx, as optimum exports decoders for text generation."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import numpy as np

LAYERS, HEADS, HIDDEN, VOCAB = 2, 4, 32, 97
#: the decoder the runtime tests run token by token: 2 layers, 4 heads, hidden 64, a vocabulary of 100
TINY_HEADS, TINY_HIDDEN, TINY_VOCAB = 4, 64, 100
TINY_PAST_NAMES = [f"past_key_values.{i}.{k}" for i in range(2) for k in ("key", "value")]


def export_gpt2_with_past(path: Path, dynamo: bool, layers: int = LAYERS, heads: int = HEADS, hidden: int = HIDDEN,
                          vocab: int = VOCAB) -> list[str]:
    """Write the model; returns its past input names (past_key_values.N.key/value) in order."""
    import torch
    import transformers
    from transformers import DynamicCache

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=1024, vocab_size=vocab)
    model = transformers.GPT2LMHeadModel(config).eval()
    past = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    present = [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]

    class WithPast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, *pkv):
            cache = DynamicCache()
            for i in range(layers):
                cache.update(pkv[2 * i], pkv[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                             use_cache=True)
            flat = []
            for layer in out.past_key_values.layers:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    example = (torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long),
               *[torch.randn(1, heads, 4, hidden // heads) for _ in past])
    names = ["input_ids", "attention_mask", *past]
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
            past_seq = torch.export.Dim("past_seq")
            total = torch.export.Dim.AUTO
            shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, tuple({0: batch, 2: past_seq} for _ in past))
            torch.onnx.export(WithPast(), example, str(path), input_names=names, output_names=["logits", *present],
                              dynamic_shapes=shapes, dynamo=True, opset_version=18)
        else:
            axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total_seq"}}
            axes.update({p: {0: "batch", 2: "past_seq"} for p in past})
            axes.update({p: {0: "batch", 2: "total_seq"} for p in present})
            torch.onnx.export(WithPast(), example, str(path), input_names=names, output_names=["logits", *present],
                              dynamic_axes=axes, opset_version=17, dynamo=False)
    return past



def tiny_gpt2_with_past(directory: Path) -> bytes:
    """GPT2LMHeadModel of the TINY_* sizes with past key values (torch.onnx's TorchScript exporter)."""
    path = Path(directory) / "gpt2.onnx"
    export_gpt2_with_past(path, False, 2, TINY_HEADS, TINY_HIDDEN, TINY_VOCAB)
    return path.read_bytes()


def greedy_decode(run, past_names: list[str], prompt: np.ndarray, steps: int, heads: int = HEADS,
                  head_size: int = HIDDEN // HEADS) -> tuple[list[int], list[np.ndarray]]:
    """Prompt then `steps` greedy tokens with the KV cache fed back; returns the tokens and every step's logits."""
    past = {p: np.zeros((prompt.shape[0], heads, 0, head_size), np.float32) for p in past_names}
    ids, total, tokens, logits = prompt, prompt.shape[1], [], []
    for _ in range(steps):
        outs = run({"input_ids": ids, "attention_mask": np.ones((prompt.shape[0], total), np.int64), **past})
        logits.append(outs[0])
        nxt = outs[0][:, -1].argmax(-1)
        tokens.append(int(nxt[0]))
        ids = nxt[:, None].astype(np.int64)
        past = dict(zip(past_names, outs[1:]))
        total += 1
    return tokens, logits
