"""Locally trained tokenizers (sentencepiece's trainer, tokenizers' BPE trainer) and the text they are checked on."""

from __future__ import annotations

import io
import os

import pytest

TRAIN_LINES = [
    "The quick brown fox jumps over the lazy dog, doesn't it? I'll say it's 1234 times faster.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München!",
    "Le renard brun rapide saute par-dessus le chien paresseux. Ça coûte 12,50 €.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "敏捷的棕色狐狸跳过了懒狗。我们今天去北京。",
    "素早い茶色の狐がのろまな犬を飛び越える。",
    "빠른 갈색 여우가 게으른 개를 뛰어넘는다.",
    "Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο.",
    "def main():\n    return {'key': [1, 2, 3]}  # comment\n\n\tindented\ttabs",
    "Emoji: 😀 🎉 👍🏽 and numbers 3.14159, 2025-01-01, $99.99 (50% off)!",
    "   leading spaces and    runs     of   spaces   ",
    "We're here; they've gone. You'd think we'd LEARN. SHE'LL see.",
]

# checked text: some characters never seen in training (byte fallback / byte-level), emoji with modifiers and ZWJ,
# whitespace runs, newlines, mixed scripts
SAMPLE = [
    "Hello world! The quick brown fox doesn't jump.",
    "  two leading spaces, trailing three   ",
    "tabs\tand\nnewlines\n\n\nand CRLF\r\n end",
    "Grüße, naïve café — 敏捷的狐狸 and 素早い犬 in één zin.",
    "Emoji: 😀🎉 family 👨‍👩‍👧‍👦 thumbs 👍🏽 flag 🇫🇷 rare 🦩🪐",
    "Numbers 1234567 3.14159 and 2025-11-24, $12.50!!",
    "Ωμέγα и Юникод ☃ ✓ ∑ ∫ ℵ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "I'LL, you'RE, they'Ve: contractions in CAPS",
    "          ",
    "x",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def training_text(repeat: int = 30) -> list[str]:
    lines = []
    for i in range(repeat):
        for line in TRAIN_LINES:
            lines.append(line if i % 2 == 0 else line.swapcase())
    return lines


def train_sentencepiece(vocab_size: int = 1000) -> bytes:
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    # llama's settings: BPE pieces with scores, byte fallback, digits split, no normalisation, whitespace kept
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text()), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, allow_whitespace_only_pieces=True, character_coverage=1.0, num_threads=1,
        minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    return model.getvalue()


def bpe_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    from carrack.llm.tokenizer import PRE_TOKENIZERS

    expressions, _ = PRE_TOKENIZERS[pre]
    splits = [pre_tokenizers.Split(Regex(e), behavior="isolated") for e in expressions]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_bpe(pre: str, vocab_size: int = 700):
    """A byte-level BPE tokenizer with the pre-tokenizer llama.cpp uses for `pre` (its regexes, then bytes)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from carrack.llm.tokenizer import PRE_TOKENIZERS

    tokenizer = Tokenizer(models.BPE(ignore_merges=PRE_TOKENIZERS[pre][1]))
    tokenizer.pre_tokenizer = bpe_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_text(), trainer)
    return tokenizer


def vocab_gguf(vocab, path: str, arch: str = "llama") -> str:
    """A GGUF file holding only tokenizer metadata."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    vocab.write(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)
