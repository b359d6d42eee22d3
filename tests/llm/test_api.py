"""carrack.llm.Llama: llama-cpp-python's API on a tiny qwen2 model with a trained BPE tokenizer and ChatML."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.errors import MemoryLimitExceeded
from carrack.llm import Llama
from carrack.llm.convert import BPEVocab, SentencePieceVocab
from tests.llm.tiny_models import tiny_model, torch, transformers_greedy, write_gguf
from tests.llm.tokenizer_data import CHATML, train_bpe, train_sentencepiece

COMPLETION_KEYS = {"id", "object", "created", "model", "choices", "usage"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(GGUF path, transformers model, tokenizers reference) for a qwen2 model whose vocab is the trained BPE's."""
    reference = train_bpe("qwen2")
    model = tiny_model("qwen2", vocab_size=reference.get_vocab_size())
    vocab = BPEVocab(reference, "qwen2", bos="<|endoftext|>", eos="<|im_end|>", chat_template=CHATML)
    path = write_gguf(model, tmp_path_factory.mktemp("qwen"), "F32", vocab=vocab)
    return path, model, reference


def _reference_greedy(model, reference, prompt_ids, steps):
    tokens = transformers_greedy(model, np.asarray(prompt_ids), steps)
    eos = reference.token_to_id("<|im_end|>")
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


def test_greedy_completion_matches_transformers(qwen):
    path, model, reference = qwen
    llm = Llama(path, n_ctx=128, seed=0)
    prompt = "The quick brown fox"
    prompt_ids = llm.tokenize(prompt.encode())
    assert prompt_ids == reference.encode(prompt).ids  # qwen2: no BOS
    out = llm(prompt, max_tokens=24, temperature=0.0)
    assert set(out) == COMPLETION_KEYS and out["object"] == "text_completion"
    expected = _reference_greedy(model, reference, prompt_ids, 24)
    choice = out["choices"][0]
    assert choice["text"] == reference.decode(expected)
    assert choice["finish_reason"] == ("length" if len(expected) == 24 else "stop")
    assert out["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(expected),
                            "total_tokens": len(prompt_ids) + len(expected)}


def test_stream_gives_the_same_text(qwen):
    path, _, _ = qwen
    llm = Llama(path, n_ctx=128)
    whole = llm("Grüße 😀", max_tokens=20, temperature=0.0)["choices"][0]["text"]
    chunks = list(llm("Grüße 😀", max_tokens=20, temperature=0.0, stream=True))
    assert all(set(c) == {"id", "object", "created", "model", "choices"} for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_seeded_sampling_is_reproducible(qwen):
    path, _, _ = qwen
    llm = Llama(path, n_ctx=128)
    runs = [llm("Hello", max_tokens=16, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=s)["choices"][0]["text"]
            for s in (7, 7, 8, 9)]
    assert runs[0] == runs[1]
    assert len(set(runs)) > 1
    seeded = [Llama(path, n_ctx=128, seed=3)("Hello", max_tokens=8, temperature=1.0)["choices"][0]["text"]
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_stop_string_cuts_the_text(qwen):
    path, _, _ = qwen
    llm = Llama(path, n_ctx=128)
    full = llm("The", max_tokens=24, temperature=0.0)["choices"][0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), f"need a non-blank stop string from {full!r}"
    cut = llm("The", max_tokens=24, temperature=0.0, stop=[stop])
    assert cut["choices"][0]["text"] == full[:full.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    streamed = "".join(c["choices"][0]["text"] for c in llm("The", max_tokens=24, temperature=0.0, stop=stop,
                                                             stream=True))
    assert streamed == full[:full.find(stop)]


def test_chat_completion_uses_the_template(qwen):
    path, _, reference = qwen
    llm = Llama(path, n_ctx=256)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    rendered = llm.apply_chat_template(messages)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n"
                        "<|im_start|>assistant\n")
    prompt_ids = reference.encode(rendered).ids
    assert prompt_ids.count(reference.token_to_id("<|im_start|>")) == 3
    reply = llm.create_chat_completion(messages, max_tokens=12, temperature=0.0)
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["role"] == "assistant"
    expected = llm(prompt_ids, max_tokens=12, temperature=0.0)["choices"][0]["text"]
    assert reply["choices"][0]["message"]["content"] == expected
    chunks = list(llm.create_chat_completion(messages, max_tokens=12, temperature=0.0, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] is not None


def test_logits_tokenize_detokenize(qwen):
    path, model, reference = qwen
    llm = Llama(path, n_ctx=64)
    ids = llm.tokenize("naïve café 敏捷".encode(), add_bos=False)
    assert llm.detokenize(ids) == "naïve café 敏捷".encode()
    logits = llm.logits(ids)
    assert logits.shape == (len(ids), llm.n_vocab())
    with torch.no_grad():
        expected = model(torch.tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-3, rtol=0)


def test_prompt_prefix_is_reused(qwen):
    path, _, _ = qwen
    llm = Llama(path, n_ctx=128)
    first = llm("The quick brown", max_tokens=4, temperature=0.0)
    evaluated = []
    original = llm.decoder.forward
    llm.decoder.forward = lambda tokens, start=None, all_logits=True: (evaluated.append(len(tokens)),
                                                                        original(tokens, start, all_logits))[1]
    again = llm("The quick brown", max_tokens=4, temperature=0.0)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert evaluated[0] == 1  # only the last prompt token is evaluated again


def test_memory_plan_and_limit(qwen):
    path, _, _ = qwen
    plan = Llama(path, n_ctx=128).memory_plan()
    assert plan.total_bytes > plan.kv_cache_bytes > 0
    with pytest.raises(MemoryLimitExceeded, match="memory_limit_bytes"):
        Llama(path, n_ctx=128, memory_limit_bytes=plan.total_bytes - 1)


def test_sentencepiece_llama_model_adds_bos(tmp_path):
    proto = train_sentencepiece()
    vocab = SentencePieceVocab(proto)
    model = tiny_model("llama", vocab_size=vocab.processor.get_piece_size())
    llm = Llama(write_gguf(model, tmp_path, "Q8_0", vocab=vocab), n_ctx=64)
    ids = llm.tokenize(b"Hello world")
    assert ids == [vocab.processor.bos_id(), *vocab.processor.encode("Hello world")]
    out = llm("Hello world", max_tokens=8, temperature=0.0)
    assert out["usage"]["prompt_tokens"] == len(ids)


def test_other_llama_cpp_arguments_only_at_their_defaults(qwen):
    from carrack.errors import InvalidArgument

    path, _, _ = qwen
    llm = Llama(path, n_ctx=64)
    out = llm("Hi", max_tokens=2, temperature=0.0, logprobs=None, suffix=None, typical_p=1.0)
    assert out["usage"]["completion_tokens"] <= 2
    with pytest.raises(InvalidArgument, match="logprobs=5"):
        llm("Hi", max_tokens=2, logprobs=5)
    with pytest.raises(InvalidArgument, match="'bogus'"):
        llm("Hi", bogus=1)


def test_detokenize_continuation_keeps_the_space(tmp_path):
    proto = train_sentencepiece()
    vocab = SentencePieceVocab(proto)
    llm = Llama(write_gguf(tiny_model("llama", vocab_size=vocab.processor.get_piece_size()), tmp_path, vocab=vocab),
                n_ctx=32)
    ids = llm.tokenize(b"Hello world", add_bos=False)
    assert llm.detokenize(ids) == b"Hello world"
    split = next(i for i in range(1, len(ids)) if llm.detokenize(ids[i:i + 1], prev_tokens=ids[:i]).startswith(b" "))
    assert llm.detokenize(ids[:split]) + llm.detokenize(ids[split:], prev_tokens=ids[:split]) == b"Hello world"


def test_file_without_tokenizer_runs_from_ids(tmp_path):
    from carrack.errors import InvalidArgument

    llm = Llama(write_gguf(tiny_model("qwen3"), tmp_path), n_ctx=32)
    with pytest.raises(InvalidArgument, match="has no tokenizer"):
        llm.tokenize(b"hello")
    with pytest.raises(InvalidArgument, match="has no tokenizer"):
        llm([5, 6, 7], max_tokens=3)  # a completion is text
    from carrack.llm.sampling import SamplingParams

    ids = list(llm.generate([5, 6, 7], 4, SamplingParams(temperature=0.0), np.random.default_rng(0)))
    assert len(ids) == 4
    assert ids[0] == int(np.argmax(llm.logits([5, 6, 7])[-1]))
