"""Write a transformers causal LM to a GGUF file the way llama.cpp's convert_hf_to_gguf.py does.

Used by the tests and benchmarks to make GGUF models locally (random weights from a tiny config, nothing downloaded).
The conventions are llama.cpp's, read from convert_hf_to_gguf.py and gguf-py's constants:

- tensor names token_embd, blk.N.attn_q/k/v/output, ffn_gate/up/down, attn_norm, ffn_norm, output_norm, output
  (phi3 keeps its fused attn_qkv and gate+up in ffn_up; gemma2 adds attn_post_norm and ffn_post_norm);
- llama's q/k projection rows are permuted from HF's rotate-half layout to the adjacent-pair layout its rope uses
  (``permute`` below); the NeoX-rope architectures (qwen2, qwen3, gemma2, phi3) keep HF's layout;
- llama3-style rope scaling becomes a ``rope_freqs`` tensor of per-frequency divisors;
- gemma2 norm weights are stored with the +1 of its RMSNorm folded in;
- 1-D tensors stay F32; 2-D weights take the file type (quantized types fall back to F16 for rows that are not a
  multiple of the block size, as llama.cpp does).

Needs the optional packages torch, transformers and gguf (extras ``[test]``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from carrack.errors import UnsupportedModel
from carrack.gguf.quant import quantize
from carrack.gguf.types import GGML_BLOCK_SIZES, GGMLType

# HF architecture class name -> GGUF general.architecture
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Phi3ForCausalLM": "phi3",
}

FILE_TYPES = {"F32": GGMLType.F32, "F16": GGMLType.F16, "Q8_0": GGMLType.Q8_0, "Q4_0": GGMLType.Q4_0,
              "Q4_1": GGMLType.Q4_1, "Q5_0": GGMLType.Q5_0, "Q5_1": GGMLType.Q5_1, "BF16": GGMLType.BF16}
# general.file_type (llama.cpp's LlamaFileType) of each
_LLAMA_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "BF16": 32}

_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# gemma2 has four norms per layer: its post_attention_layernorm is a post-norm, the pre-FFN norm is separate
_GEMMA2_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_layernorm": "attn_post_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "ffn_post_norm",
}
_GLOBAL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_architecture(model: Any) -> str:
    """The GGUF architecture name of a transformers model (UnsupportedModel if the converter does not know it)."""
    names = list(getattr(model.config, "architectures", None) or [type(model).__name__])
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    raise UnsupportedModel(f"no GGUF conversion for transformers architecture {names}; "
                           f"known: {sorted(HF_ARCHITECTURES)}")


def permute_for_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half row order of a q/k projection (or bias) -> llama.cpp's adjacent-pair order, per head."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp stores for llama3 rope scaling: each frequency is divided by its factor."""
    base = float(rope.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = float(rope.get("factor", 8.0))
    low_freq_factor = float(rope.get("low_freq_factor", 1.0))
    high_freq_factor = float(rope.get("high_freq_factor", 4.0))
    old_context = float(rope.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _rope_parameters(config: Any) -> dict[str, Any]:
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in rope and getattr(config, "rope_theta", None) is not None:
        rope["rope_theta"] = config.rope_theta
    return rope


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def write_hparams(writer: Any, arch: str, config: Any) -> None:
    """The {arch}.* metadata llama.cpp's converter writes for these architectures."""
    n_head = config.num_attention_heads
    n_head_kv = getattr(config, "num_key_value_heads", None) or n_head
    head_dim = _head_dim(config)
    rope = _rope_parameters(config)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(n_head))
    writer.add_head_count_kv(int(n_head_kv))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    if arch != "gemma2":
        writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    _write_rope_scaling(writer, arch, rope)
    if arch in ("llama", "phi3"):
        partial = float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0))
        writer.add_rope_dimension_count(int(head_dim * partial))
    if arch == "llama":
        writer.add_vocab_size(int(config.vocab_size))
    if getattr(config, "head_dim", None) is not None or arch == "gemma2":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        writer.add_sliding_window(int(config.sliding_window))
    if arch == "phi3" and getattr(config, "sliding_window", None):
        writer.add_sliding_window(int(config.sliding_window))


def _write_rope_scaling(writer: Any, arch: str, rope: dict[str, Any]) -> None:
    """Linear scaling as llama.cpp's converter writes it; llama3-style goes in the rope_freqs tensor."""
    kind = str(rope.get("rope_type", rope.get("type", "default"))).lower()
    if kind in ("default", "none", "llama3"):
        return
    if kind != "linear":
        raise UnsupportedModel(f"rope scaling '{kind}' of this {arch} model is not supported by carrack.llm")
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(float(rope["factor"]))


def gguf_tensors(model: Any, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every tensor of the model, with llama.cpp's renames and rewrites."""
    config = model.config
    n_head = config.num_attention_heads
    n_head_kv = getattr(config, "num_key_value_heads", None) or n_head
    layer_names = _GEMMA2_LAYER_TENSORS if arch == "gemma2" else _LAYER_TENSORS
    rope = _rope_parameters(config)
    if arch == "llama" and str(rope.get("rope_type", "")).lower() == "llama3":
        yield "rope_freqs.weight", llama3_rope_factors(rope, _head_dim(config))
    state = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in state.items():
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue
        data = tensor.detach().float().numpy()
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = _gguf_name(stem, layer_names)
        if gguf_name is None:
            raise UnsupportedModel(f"no GGUF name for tensor '{hf_name}' of a {arch} model")
        if arch == "llama" and stem.endswith("self_attn.q_proj"):
            data = permute_for_rope(data, n_head)
        elif arch == "llama" and stem.endswith("self_attn.k_proj"):
            data = permute_for_rope(data, n_head_kv)
        if arch == "gemma2" and stem.endswith("norm"):
            data = data + 1.0
        yield f"{gguf_name}.{suffix}", np.ascontiguousarray(data, dtype=np.float32)


def _gguf_name(stem: str, layer_names: dict[str, str]) -> str | None:
    if stem in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[stem]
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in layer_names:
        return f"blk.{int(parts[2])}.{layer_names[parts[3]]}"
    return None


def encode_tensor(data: np.ndarray, file_type: str) -> tuple[np.ndarray, GGMLType]:
    """A tensor as llama.cpp stores it in a file of `file_type`: 1-D stays F32, 2-D takes the file type."""
    target = FILE_TYPES[file_type]
    if data.ndim < 2 or target == GGMLType.F32:
        return data.astype(np.float32), GGMLType.F32
    if target == GGMLType.F16:
        return data.astype(np.float16), GGMLType.F16
    if target == GGMLType.BF16:  # the upper 16 bits of float32, rounded to nearest even; as bytes for the writer
        bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return rounded.view(np.uint8), GGMLType.BF16
    if data.shape[-1] % GGML_BLOCK_SIZES[target][0]:
        return data.astype(np.float16), GGMLType.F16
    return quantize(data, target), target


def from_transformers(model: Any, path: str | os.PathLike[str], file_type: str = "F32",
                      vocab: Any | None = None) -> str:
    """Write `model` (a transformers causal LM) to `path` as GGUF of `file_type` (F32, F16, Q8_0, Q4_0, ...).

    `vocab` writes tokenizer metadata: a carrack.llm.vocab_writer.VocabSpec (see there); without it the file has
    no tokenizer (the model still runs from token ids).
    """
    import gguf

    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {sorted(FILE_TYPES)}, got {file_type!r}")
    arch = gguf_architecture(model)
    path = os.fspath(path)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"carrack-test-{arch}")
    write_hparams(writer, arch, model.config)
    writer.add_file_type(_LLAMA_FILE_TYPE[file_type])
    if vocab is not None:
        vocab.write(writer)
    for name, data in gguf_tensors(model, arch):
        encoded, ggml_type = encode_tensor(data, file_type)
        if ggml_type in (GGMLType.F32, GGMLType.F16):
            writer.add_tensor(name, encoded)
        else:
            writer.add_tensor(name, encoded, raw_dtype=gguf.GGMLQuantizationType(int(ggml_type)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class SentencePieceVocab:
    """A "llama" (SentencePiece) tokenizer for the GGUF metadata, from a trained sentencepiece model, as
    llama.cpp's _set_vocab_sentencepiece writes it (pieces, scores, token types, BOS/EOS/UNK, add_bos)."""

    def __init__(self, model_proto: bytes, add_space_prefix: bool = True, chat_template: str | None = None):
        import sentencepiece

        self.processor = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.add_space_prefix = add_space_prefix
        self.chat_template = chat_template

    def token_types(self) -> list[int]:
        sp = self.processor
        types = []
        for i in range(sp.get_piece_size()):
            if sp.is_unknown(i):
                types.append(2)
            elif sp.is_control(i):
                types.append(3)
            elif sp.is_unused(i):
                types.append(5)
            elif sp.is_byte(i):
                types.append(6)
            else:
                types.append(1)
        return types

    def write(self, writer: Any) -> None:
        sp = self.processor
        n = sp.get_piece_size()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
        writer.add_token_scores([float(sp.get_score(i)) for i in range(n)])
        writer.add_token_types(self.token_types())
        writer.add_add_space_prefix(self.add_space_prefix)
        for kind, token in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unk", sp.unk_id()), ("pad", sp.pad_id())):
            if token >= 0:
                getattr(writer, f"add_{kind}_token_id")(token)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)


class BPEVocab:
    """A "gpt2" (byte-level BPE) tokenizer for the GGUF metadata, from a `tokenizers` BPE tokenizer, as llama.cpp's
    _set_vocab_gpt2 writes it: tokens by id, merges as "a b", special added tokens as control tokens."""

    def __init__(self, tokenizer: Any, pre: str, bos: str | None = None, eos: str | None = None,
                 add_bos: bool = False, chat_template: str | None = None):
        import json

        self.spec = json.loads(tokenizer.to_str())
        self.tokenizer = tokenizer
        self.pre = pre
        self.bos, self.eos, self.add_bos = bos, eos, add_bos
        self.chat_template = chat_template

    def write(self, writer: Any) -> None:
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        tokens = [""] * len(vocab)
        for text, token in vocab.items():
            tokens[token] = text
        special = {t["content"]: t["special"] for t in self.spec.get("added_tokens", [])}
        types = [(3 if special[t] else 4) if t in special else 1 for t in tokens]
        merges = [m if isinstance(m, str) else " ".join(m) for m in self.spec["model"]["merges"]]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        if self.bos is not None:
            writer.add_bos_token_id(vocab[self.bos])
        if self.eos is not None:
            writer.add_eos_token_id(vocab[self.eos])
        writer.add_add_bos_token(self.add_bos)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)
