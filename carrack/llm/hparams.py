"""Architecture descriptions and hyperparameters of GGUF decoder-only language models, from the file's metadata.

Each architecture llama.cpp names in general.architecture maps to an `Architecture`: which rope layout it uses
(llama.cpp's LLAMA_ROPE_TYPE_NORM, adjacent pairs, for llama; NEOX, halves, for the others), whether it has q/k/v
biases, per-head q/k norms, fused projections, gemma2's extras. Keys are gguf-py's constants ({arch}.block_count, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from carrack.errors import InvalidModel, UnsupportedModel


@dataclass(frozen=True)
class Architecture:
    name: str
    rope_neox: bool  # rotate (x[i], x[i + d/2]) pairs instead of (x[2i], x[2i+1])
    activation: str = "silu"  # of the gate: silu (SwiGLU) or gelu_tanh (GeGLU)
    qkv_bias: bool = False  # optional biases are used when present; this only documents the usual case
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (qwen3)
    fused_qkv: bool = False  # one attn_qkv matrix (phi3)
    fused_gate_up: bool = False  # ffn_up holds gate then up rows (phi3)
    post_norms: bool = False  # attn_post_norm and ffn_post_norm after each sublayer (gemma2)
    embedding_scale: bool = False  # token embeddings times sqrt(n_embd) (gemma2)
    alternating_sliding_window: bool = False  # even layers attend within the sliding window (gemma2)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", rope_neox=False),
    "qwen2": Architecture("qwen2", rope_neox=True, qkv_bias=True),
    "qwen3": Architecture("qwen3", rope_neox=True, qk_norm=True),
    "gemma2": Architecture("gemma2", rope_neox=True, activation="gelu_tanh", post_norms=True, embedding_scale=True,
                           alternating_sliding_window=True),
    "phi3": Architecture("phi3", rope_neox=True, fused_qkv=True, fused_gate_up=True),
}


@dataclass(frozen=True)
class HParams:
    arch: Architecture
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    n_ctx_train: int
    attention_scale: float
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    sliding_window: int = 0
    rope_freq_scale: float = 1.0  # linear rope scaling: positions are multiplied by this (1 / scaling factor)

    def uses_sliding_window(self, layer: int) -> bool:
        return self.arch.alternating_sliding_window and self.sliding_window > 0 and layer % 2 == 0


def read_hparams(metadata: dict[str, Any], n_vocab: int, where: str) -> HParams:
    """Hyperparameters from GGUF metadata; UnsupportedModel for an unknown architecture, InvalidModel for a
    missing key. `n_vocab` comes from the token embedding's shape (the vocab_size key is optional)."""
    arch_name = metadata.get("general.architecture")
    if arch_name is None:
        raise InvalidModel(f"{where}: no general.architecture key; is this a language model GGUF?")
    arch = ARCHITECTURES.get(str(arch_name))
    if arch is None:
        raise UnsupportedModel(f"{where}: architecture '{arch_name}' is not supported by carrack.llm "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})")

    def key(suffix: str, default: Any = None) -> Any:
        full = f"{arch.name}.{suffix}"
        if full in metadata:
            return metadata[full]
        if default is None:
            raise InvalidModel(f"{where}: missing metadata key '{full}' needed by the {arch.name} architecture")
        return default

    n_embd = int(key("embedding_length"))
    n_head = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", n_embd // n_head))
    n_ff = key("feed_forward_length")
    if not isinstance(n_ff, int | float):
        n_ff = max(int(v) for v in n_ff)  # a per-layer array in some files; every layer is the same here
    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=int(key("block_count")),
        n_head=n_head,
        n_head_kv=int(_scalar(key("attention.head_count_kv", n_head))),
        head_dim=head_dim,
        n_ff=int(n_ff),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_dim=int(key("rope.dimension_count", head_dim)),
        n_ctx_train=int(key("context_length")),
        attention_scale=float(key("attention.scale", head_dim ** -0.5)),
        attn_softcap=float(key("attn_logit_softcapping", 0.0)),
        final_softcap=float(key("final_logit_softcapping", 0.0)),
        sliding_window=int(key("attention.sliding_window", 0)),
        rope_freq_scale=_rope_freq_scale(key, where),
    )


def _rope_freq_scale(key: Any, where: str) -> float:
    """llama.cpp's rope scaling keys: none, or linear (positions divided by the factor; older files write
    rope.scale_linear). llama3-style scaling arrives as the rope_freqs tensor instead. YaRN and LongRoPE change the
    attention as well as the angles: refused by name rather than run with plain rope."""
    kind = str(key("rope.scaling.type", "none")).lower()
    factor = float(key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0) or 1.0)
    if kind == "none" and factor == 1.0:
        return 1.0
    if kind in ("linear", "none"):
        if not factor > 0:
            raise InvalidModel(f"{where}: rope scaling factor {factor} must be positive")
        return 1.0 / factor
    raise UnsupportedModel(f"{where}: rope scaling type '{kind}' is not supported by carrack.llm "
                           "(supported: none, linear, and llama3-style rope_freqs)")


def _scalar(value: Any) -> Any:
    if isinstance(value, int | float):
        return value
    return max(value)  # per-layer arrays (e.g. head_count_kv) in some files
