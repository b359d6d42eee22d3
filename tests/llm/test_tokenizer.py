"""carrack's GGUF tokenizers against the libraries that trained them, on a multilingual sample."""

from __future__ import annotations

import pytest

from carrack.errors import UnsupportedModel
from carrack.gguf import read_gguf
from carrack.llm.convert import BPEVocab, SentencePieceVocab
from carrack.llm.tokenizer import Tokenizer
from tests.llm.tokenizer_data import SAMPLE, SPECIAL_TOKENS, train_bpe, train_sentencepiece, vocab_gguf


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    import sentencepiece

    proto = train_sentencepiece()
    path = vocab_gguf(SentencePieceVocab(proto), tmp_path_factory.mktemp("spm") / "spm.gguf")
    return sentencepiece.SentencePieceProcessor(model_proto=proto), Tokenizer(read_gguf(path).metadata)


@pytest.fixture(scope="module", params=["llama-bpe", "qwen2", "default", "gpt-2"])
def bpe_pair(request, tmp_path_factory):
    reference = train_bpe(request.param)
    vocab = BPEVocab(reference, request.param, bos="<|endoftext|>", eos="<|im_end|>")
    path = vocab_gguf(vocab, tmp_path_factory.mktemp("bpe") / "bpe.gguf", arch="qwen2")
    return reference, Tokenizer(read_gguf(path).metadata)


@pytest.mark.parametrize("text", SAMPLE)
def test_sentencepiece_tokenization_matches(spm_pair, text):
    reference, tokenizer = spm_pair
    expected = reference.encode(text)
    assert tokenizer.encode(text, add_special=False) == expected
    assert tokenizer.decode(expected).decode("utf-8") == reference.decode(expected)


def test_sentencepiece_bos_and_byte_fallback(spm_pair):
    reference, tokenizer = spm_pair
    ids = tokenizer.encode("rare 🦩", add_special=True)
    assert ids[0] == reference.bos_id()
    assert any(reference.is_byte(i) for i in ids), "the unseen emoji should fall back to byte tokens"
    assert tokenizer.encode(b"rare \xf0\x9f\xa6\xa9", add_special=True) == ids


@pytest.mark.parametrize("text", SAMPLE)
def test_bpe_tokenization_matches(bpe_pair, text):
    reference, tokenizer = bpe_pair
    expected = reference.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text, add_special=False) == expected
    assert tokenizer.decode(expected).decode("utf-8") == reference.decode(expected)


def test_bpe_special_tokens_are_parsed_only_when_asked(bpe_pair):
    reference, tokenizer = bpe_pair
    text = "<|im_start|>user\nHi 😀<|im_end|>\n"
    assert tokenizer.encode(text, add_special=False, parse_special=True) == \
        reference.encode(text, add_special_tokens=False).ids
    plain = tokenizer.encode(text, add_special=False, parse_special=False)
    assert not set(plain) & {reference.token_to_id(t) for t in SPECIAL_TOKENS}
    assert tokenizer.decode(plain) == text.encode()


def test_bpe_add_bos_follows_the_file(tmp_path):
    reference = train_bpe("llama-bpe")
    with_bos = Tokenizer(read_gguf(vocab_gguf(BPEVocab(reference, "llama-bpe", bos="<|endoftext|>", add_bos=True),
                                              tmp_path / "a.gguf")).metadata)
    assert with_bos.encode("hi")[0] == reference.token_to_id("<|endoftext|>")
    assert with_bos.encode("hi", add_special=False)[0] != reference.token_to_id("<|endoftext|>")


@pytest.mark.parametrize("which", ["spm", "bpe"])
def test_streaming_never_splits_a_character(spm_pair, bpe_pair, which):
    tokenizer = spm_pair[1] if which == "spm" else bpe_pair[1]
    text = "Emoji: 😀🎉 👨‍👩‍👧 🦩 and 敏捷的狐狸 ✓"
    ids = tokenizer.encode(text, add_special=False)
    stream = tokenizer.stream()
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    byte_pieces = [tokenizer.token_to_piece(t) for t in ids]
    assert any(_splits_a_character(p) for p in byte_pieces), "the sample should put a character across tokens"


def _splits_a_character(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_unknown_pre_tokenizer_is_named(tmp_path):
    reference = train_bpe("gpt-2")
    path = vocab_gguf(BPEVocab(reference, "klingon-v9"), tmp_path / "a.gguf")
    with pytest.raises(UnsupportedModel, match="klingon-v9"):
        Tokenizer(read_gguf(path).metadata)
