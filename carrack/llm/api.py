"""`Llama`: GGUF language models behind the API Python users of GGUF know from llama-cpp-python.

    llm = Llama("model.gguf", n_ctx=2048, seed=0)
    out = llm("Once upon a time", max_tokens=32, temperature=0.0)
    out["choices"][0]["text"]
    for chunk in llm.create_chat_completion([{"role": "user", "content": "Hi"}], stream=True): ...

Completions return llama-cpp-python's dicts (id, object, created, model, choices, usage; chunks when streamed).
The KV cache keeps the tokens of the last call, so a prompt that extends the previous one only evaluates its new
tokens.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from carrack.errors import InvalidArgument
from carrack.llm.model import Decoder, MemoryPlan
from carrack.llm.sampling import SamplingParams, sample_token
from carrack.llm.tokenizer import Tokenizer
from carrack.runtime.blas import limited_blas_threads

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a fresh random seed

# used when the file has no tokenizer.chat_template (llama.cpp falls back to ChatML as well)
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                   "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")


class Llama:
    """A GGUF language model: tokenizer, KV-cached decoder and sampler."""

    def __init__(self, model_path: str | os.PathLike[str], n_ctx: int = 512, n_batch: int = 512,
                 n_threads: int | None = None, seed: int = DEFAULT_SEED, verbose: bool = False,
                 memory_limit_bytes: int | None = None, dequantize: bool = False, activations: str = "int8"):
        self.model_path = os.fspath(model_path)
        # native kernels and numpy's BLAS both run on this many threads during evaluation
        self.n_threads = n_threads or os.cpu_count() or 1
        self.verbose = verbose
        self.decoder = Decoder(self.model_path, n_ctx=n_ctx, n_batch=n_batch, dequantize=dequantize,
                               memory_limit_bytes=memory_limit_bytes, n_threads=self.n_threads,
                               activations=activations)
        metadata = self.decoder.gguf.metadata
        self.metadata = metadata
        self._tokenizer = Tokenizer(metadata, self.model_path) if "tokenizer.ggml.model" in metadata else None
        self._rng = np.random.default_rng(None if seed == DEFAULT_SEED else seed)
        self._tokens: list[int] = []  # what the KV cache holds, position by position

    # ---------------------------------------------------------------------------------------------------------
    # model facts

    def n_ctx(self) -> int:
        return self.decoder.n_ctx

    def n_vocab(self) -> int:
        return self.decoder.hp.n_vocab

    def token_bos(self) -> int | None:
        return self.tokenizer.bos_id

    def token_eos(self) -> int | None:
        return self.tokenizer.eos_id

    def memory_plan(self) -> MemoryPlan:
        """Weights + KV cache + scratch, known before the first token."""
        return self.decoder.memory_plan()

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise InvalidArgument(f"{self.model_path} has no tokenizer (tokenizer.ggml.* metadata); pass token ids")
        return self._tokenizer

    def set_seed(self, seed: int) -> None:
        self._rng = np.random.default_rng(None if seed == DEFAULT_SEED else seed)

    # ---------------------------------------------------------------------------------------------------------
    # tokens

    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """The bytes of `tokens`; with `prev_tokens` (what came before them) they are a continuation, so a
        SentencePiece leading space is kept."""
        if prev_tokens:
            return b"".join(self.tokenizer.token_to_piece(int(t), special) for t in tokens)
        return self.tokenizer.decode(tokens, special=special)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), n_vocab] of a full forward of `ids` from position 0."""
        self.reset()
        with limited_blas_threads(self.n_threads):
            out = self.decoder.forward(ids, 0, all_logits=True)
        self._tokens = [int(t) for t in ids]
        return out

    def reset(self) -> None:
        self._tokens = []
        self.decoder.reset()

    def eval(self, tokens: Sequence[int]) -> np.ndarray:
        """Evaluate `tokens` after those already in the cache; logits of the last one [n_vocab]."""
        with limited_blas_threads(self.n_threads):
            logits = self.decoder.forward(tokens, len(self._tokens), all_logits=False)
        self._tokens.extend(int(t) for t in tokens)
        return logits[-1]

    def _prefill(self, prompt: list[int]) -> np.ndarray:
        """Logits after `prompt`, reusing the cached prefix it shares with the previous call."""
        common = 0
        for cached, new in zip(self._tokens, prompt[:-1]):
            if cached != new:
                break
            common += 1
        self._tokens = self._tokens[:common]
        return self.eval(prompt[common:])

    def generate(self, prompt: Sequence[int], max_tokens: int, params: SamplingParams,
                 rng: np.random.Generator) -> Iterator[int]:
        """Token ids sampled after `prompt`, until an end-of-generation token (not yielded), max_tokens or n_ctx."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise InvalidArgument("the prompt has no tokens")
        if len(prompt) >= self.n_ctx():
            raise InvalidArgument(f"the prompt has {len(prompt)} tokens, more than n_ctx={self.n_ctx()} allows")
        logits = self._prefill(prompt)
        limit = self.n_ctx() - len(prompt)
        max_tokens = limit if max_tokens is None or max_tokens <= 0 else min(max_tokens, limit)
        for produced in range(max_tokens):
            token = sample_token(logits, self._tokens, params, rng)
            if self._tokenizer is not None and self._tokenizer.is_end_of_generation(token):
                return
            yield token
            if produced + 1 < max_tokens:
                logits = self.eval([token])

    # ---------------------------------------------------------------------------------------------------------
    # completions

    def create_completion(self, prompt: str | bytes | Sequence[int], max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05, echo: bool = False,
                          stop: str | Sequence[str] | None = None, repeat_penalty: float = 1.0, top_k: int = 40,
                          seed: int | None = None, stream: bool = False, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0,
                          **other: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """A completion of `prompt` (text or token ids) in llama-cpp-python's layout; chunks when `stream`.
        Its other arguments are accepted at their default values only (suffix, logprobs, typical_p, ...)."""
        _check_defaults(other)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty)
        prompt_ids = self.tokenize(prompt) if isinstance(prompt, str | bytes) else [int(t) for t in prompt]
        rng = self._rng if seed is None else np.random.default_rng(seed)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        chunks = self._completion_chunks(prompt_ids, max_tokens, params, rng, stops)
        meta = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_path}
        prefix = self.detokenize(prompt_ids).decode("utf-8", errors="replace") if echo else ""
        if stream:
            return self._stream_completion(meta, chunks, prefix)
        text, finish, n_generated = prefix, "length", 0
        for piece, reason, count in chunks:
            text += piece
            finish, n_generated = reason or finish, count
        return {**meta, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
                "usage": _usage(len(prompt_ids), n_generated)}

    __call__ = create_completion

    @staticmethod
    def _stream_completion(meta: dict[str, Any], chunks, prefix: str) -> Iterator[dict[str, Any]]:
        if prefix:
            yield {**meta, "choices": [{"text": prefix, "index": 0, "logprobs": None, "finish_reason": None}]}
        for piece, reason, _ in chunks:
            yield {**meta, "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": reason}]}

    def _completion_chunks(self, prompt_ids: list[int], max_tokens: int | None, params: SamplingParams,
                           rng: np.random.Generator, stops: list[str]) -> Iterator[tuple[str, str | None, int]]:
        """(text, finish_reason or None, tokens generated so far); the last chunk carries the finish reason.
        Text that could be the start of a stop string is held back until it is known not to be one."""
        decoder = self.tokenizer.stream()
        pending = ""
        n_generated = 0
        budget = self.n_ctx() - len(prompt_ids) if max_tokens is None or max_tokens <= 0 else max_tokens
        for token in self.generate(prompt_ids, budget, params, rng):
            n_generated += 1
            pending += decoder.push(token)
            cut = _first_stop(pending, stops)
            if cut is not None:
                yield pending[:cut], "stop", n_generated
                return
            keep = _stop_prefix_length(pending, stops)
            if len(pending) > keep:
                yield pending[:len(pending) - keep], None, n_generated
                pending = pending[len(pending) - keep:]
        pending += decoder.flush()
        cut = _first_stop(pending, stops)
        if cut is not None:
            yield pending[:cut], "stop", n_generated
            return
        yield pending, "length" if n_generated >= budget else "stop", n_generated

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The file's tokenizer.chat_template (ChatML if it has none) rendered with jinja2."""
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("chat templates need jinja2: pip install 'carrack[llm]'") from e

        def raise_exception(message: str) -> None:
            raise InvalidArgument(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        tok = self.tokenizer
        template = env.from_string(tok.chat_template or CHATML_TEMPLATE)
        bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
        eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
        return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               bos_token=bos, eos_token=eos)

    def create_chat_completion(self, messages: Sequence[dict[str, Any]], temperature: float = 0.2,
                               top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                               stream: bool = False, stop: str | Sequence[str] | None = None,
                               seed: int | None = None, max_tokens: int | None = None, repeat_penalty: float = 1.0,
                               frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                               **other: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """A chat reply in llama-cpp-python's layout (chat.completion, or chat.completion.chunk when streamed)."""
        text = self.apply_chat_template(messages)
        tok = self.tokenizer
        bos_text = tok.tokens[tok.bos_id] if tok.bos_id is not None else None
        add_bos = tok.add_bos and not (bos_text and text.startswith(bos_text))
        prompt_ids = tok.encode(text, add_special=add_bos, parse_special=True)
        completion = self.create_completion(prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                            min_p=min_p, stop=stop, repeat_penalty=repeat_penalty, top_k=top_k,
                                            seed=seed, stream=stream, frequency_penalty=frequency_penalty,
                                            presence_penalty=presence_penalty, **other)
        meta = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": self.model_path}
        if stream:
            return _chat_chunks(meta, completion)
        choice = completion["choices"][0]
        return {**meta, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": choice["text"]},
                             "logprobs": None, "finish_reason": choice["finish_reason"]}],
                "usage": completion["usage"]}


def _chat_chunks(meta: dict[str, Any], completion: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    head = {**meta, "object": "chat.completion.chunk"}
    yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}]}
    for chunk in completion:
        choice = chunk["choices"][0]
        if choice["text"]:
            yield {**head, "choices": [{"index": 0, "delta": {"content": choice["text"]}, "logprobs": None,
                                        "finish_reason": None}]}
        if choice["finish_reason"]:
            yield {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": choice["finish_reason"]}]}


# llama-cpp-python arguments carrack does not implement, and the value that means "off" for each
_NO_OP_ARGUMENTS = {"suffix": None, "logprobs": None, "typical_p": 1.0, "tfs_z": 1.0, "mirostat_mode": 0,
                    "grammar": None, "logits_processor": None, "stopping_criteria": None, "logit_bias": None,
                    "tools": None, "tool_choice": None, "functions": None, "function_call": None,
                    "response_format": None, "top_logprobs": None}


def _check_defaults(arguments: dict[str, Any]) -> None:
    for name, value in arguments.items():
        if name not in _NO_OP_ARGUMENTS:
            raise InvalidArgument(f"unknown completion argument '{name}'")
        if value != _NO_OP_ARGUMENTS[name]:
            raise InvalidArgument(f"completion argument {name}={value!r} is not supported by carrack.llm (only "
                                  f"{_NO_OP_ARGUMENTS[name]!r})")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _first_stop(text: str, stops: list[str]) -> int | None:
    positions = [text.find(s) for s in stops if s and s in text]
    return min(positions) if positions else None


def _stop_prefix_length(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:length]):
                best = length
                break
    return best
