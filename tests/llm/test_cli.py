"""`carrack generate` and `carrack chat` on a tiny model with a trained tokenizer."""

from __future__ import annotations

import io
import sys

import pytest

from carrack.cli import main
from carrack.llm import Llama
from carrack.llm.convert import BPEVocab
from tests.llm.tiny_models import tiny_model, write_gguf
from tests.llm.tokenizer_data import CHATML, train_bpe


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    reference = train_bpe("llama-bpe")
    vocab = BPEVocab(reference, "llama-bpe", bos="<|endoftext|>", eos="<|im_end|>", add_bos=True,
                     chat_template=CHATML)
    model = tiny_model("llama", vocab_size=reference.get_vocab_size())
    return write_gguf(model, tmp_path_factory.mktemp("cli"), "Q8_0", vocab=vocab)


def test_generate_streams_the_greedy_completion(model_path, capsys):
    assert main(["generate", model_path, "-p", "Hello", "-n", "12", "--temp", "0", "-c", "64"]) == 0
    out, err = capsys.readouterr()
    expected = Llama(model_path, n_ctx=64)("Hello", max_tokens=12, temperature=0.0)["choices"][0]["text"]
    assert out == "Hello" + expected + "\n"
    assert "tokens/s" in err and "generation: " in err


def test_dry_run_prints_the_memory_plan_only(model_path, capsys):
    assert main(["generate", model_path, "--dry-run", "-c", "256"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "KV cache" in err and "total" in err


def test_chat_answers_each_line(model_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi!\nHow are you?\n/exit\n"))
    assert main(["chat", model_path, "-n", "6", "--seed", "3", "-c", "128"]) == 0
    out, err = capsys.readouterr()
    assert out.count("> ") == 3
    assert err.count("generation: ") == 2


def test_missing_file_is_a_clear_error(tmp_path, capsys):
    missing = str(tmp_path / "nope.gguf")
    assert main(["generate", missing, "-p", "x"]) == 1
    assert f"no model file '{missing}'" in capsys.readouterr().err
