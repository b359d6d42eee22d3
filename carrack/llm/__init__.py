"""Run GGUF language models: a KV-cached decoder (model.py), tokenizers from the file (tokenizer.py), sampling
(sampling.py) and `Llama`, the API of llama-cpp-python (api.py); `carrack generate` / `carrack chat` (cli.py)."""

from __future__ import annotations

from carrack.llm.api import Llama
from carrack.llm.model import Decoder, MemoryPlan
from carrack.llm.tokenizer import Tokenizer

__all__ = ["Decoder", "Llama", "MemoryPlan", "Tokenizer"]
