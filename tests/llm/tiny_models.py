"""Tiny transformers language models with random weights, one per architecture carrack.llm runs, and their GGUF."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

VOCAB = 300
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)

ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma2", "phi3"]


def tiny_config(arch: str, vocab_size: int = VOCAB, hidden: int = 64):
    common = {**_COMMON, "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden}
    if arch == "llama":  # Llama 3 style: GQA and llama3 rope scaling (original context 64 puts frequencies in
        # all three bands of the scaling)
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return transformers.LlamaConfig(rope_parameters=rope, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    if arch == "gemma2":  # query_pre_attn_scalar = head_dim: the attention scale llama.cpp uses for gemma2
        return transformers.Gemma2Config(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **common)
    if arch == "phi3":
        return transformers.Phi3Config(**common)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, f16_weights: bool = False, vocab_size: int = VOCAB, hidden: int = 64):
    """A random-weight model: matrices N(0, 0.15), norm weights around 1, so that logits and attention are far from
    uniform (gemma2's norms add the 1 themselves)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size, hidden)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.15)
            if name.endswith("norm.weight") and arch != "gemma2":
                param.add_(1.0)
            if f16_weights and param.ndim == 2:  # what an F16 file holds; 1-D tensors stay F32 there
                param.copy_(param.half().float())
    return model


def write_gguf(model, directory: str, file_type: str = "F32", vocab=None) -> str:
    from carrack.llm.convert import from_transformers

    path = os.path.join(directory, f"{model.config.model_type}-{file_type}.gguf")
    return from_transformers(model, path, file_type, vocab=vocab)


def prompt_ids(n: int = 12, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, n)


def transformers_greedy(model, ids: np.ndarray, steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor(ids)[None], max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()
