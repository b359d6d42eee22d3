"""carrack.llm beside llama.cpp on the same GGUF files: prompt processing and generation tokens/s, interleaved.

    python benchmarks/llm_vs_llamacpp.py                       # F16, Q8_0, Q4_0, Q4_K_M; 512 + 128 tokens; 1, 2 threads
    python benchmarks/llm_vs_llamacpp.py --types Q4_K_M --threads 1 --prompt 128 --generate 32

The model is TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads / 4 KV heads, FFN 5632, vocab 32000) with
N(0, 0.02) random weights and a placeholder SentencePiece vocabulary (llama.cpp refuses a file without one), written
once to $CARRACK_MODELS (default ~/.cache/carrack-bench): F16, Q8_0 and Q4_0 by carrack.llm.convert, Q4_K_M by
llama.cpp's own quantizer (`llama_model_quantize`) from the F16 file. Each engine loads the file with n_threads
threads, evaluates the same random prompt in one batch (prompt tokens/s), then generates greedily one token at a
time (generation tokens/s); the engines alternate within every repeat so both see the same machine load, and the
best repeat is kept. "weights GB/s" is the bytes of the model's matrices read per generated token times tokens/s,
against the machine's memory bandwidth (a numpy copy, read + write): generation can go no faster than that.

llama.cpp comes from llama-cpp-python, built from source once outside the repository, e.g.

    python -m venv --system-site-packages /opt/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /opt/llama-venv/bin/pip install --no-binary llama-cpp-python llama-cpp-python
    PYTHONPATH=$PWD /opt/llama-venv/bin/python benchmarks/llm_vs_llamacpp.py

(--system-site-packages keeps numpy, gguf and carrack's dependencies). Without llama_cpp the script says so, times
carrack alone and skips the Q4_K_M file, which it cannot make.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.llm_generate import TINYLLAMA, copy_bandwidth_gbs, model_dir, write_random_llama  # noqa: E402

LLAMA_CPP_MISSING = ("llama.cpp: llama_cpp is not importable here; build llama-cpp-python from source once (see this "
                     "script's docstring) and run the script with that environment's python. Timing carrack only.")


def llama_cpp_module():
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def add_placeholder_vocab(writer, n_vocab: int = TINYLLAMA["vocab_size"]) -> None:
    """A SentencePiece-style vocabulary of n_vocab tokens (<unk>, <s>, </s>, the 256 byte tokens, then made-up
    pieces): both engines need one to load the file; the benchmark feeds token ids, never text."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [f"\u2581t{i}" for i in range(n_vocab - len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259)  # unknown, control, byte, normal
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([-float(i) for i in range(n_vocab)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def make_file(file_type: str, layers: int, llama_cpp) -> str | None:
    """The model file of one type, written on first use; None when it cannot be made here."""
    path = os.path.join(model_dir(), f"tinyllama-random-{layers}L-{file_type}.gguf")
    if os.path.exists(path):
        return path
    t0 = time.perf_counter()
    if file_type == "Q4_K_M":
        if llama_cpp is None:
            print("Q4_K_M: skipped (llama.cpp's quantizer makes it; llama_cpp is missing)")
            return None
        source = make_file("F16", layers, llama_cpp)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = os.cpu_count() or 1
        if llama_cpp.llama_model_quantize(source.encode(), path.encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize failed to write {path}")
    else:
        config = {**TINYLLAMA, "num_hidden_layers": layers}
        write_random_llama(path + ".part", config, file_type, extra_metadata=add_placeholder_vocab)
        os.replace(path + ".part", path)
    print(f"wrote {path} ({os.path.getsize(path) / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


class CarrackEngine:
    name = "carrack"

    def __init__(self, path: str, threads: int, n_ctx: int):
        from carrack.llm import Llama

        self.llm = Llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads)
        decoder = self.llm.decoder
        matrices = {id(m): m for layer in decoder.layers for m in vars(layer).values() if hasattr(m, "nbytes")
                    and getattr(m, "ndim", 2) == 2}
        matrices[id(decoder.output)] = decoder.output
        #: bytes of weights read per generated token as carrack holds them (F16 is held as float32)
        self.streamed_bytes = sum(m.nbytes for m in matrices.values())

    def run(self, prompt: list[int], n_generate: int) -> tuple[float, float]:
        self.llm.reset()
        return timed(self.llm.eval, prompt, n_generate)


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, path: str, threads: int, n_ctx: int, llama_cpp, extra_bufts: bool):
        from carrack.gguf.reader import read_gguf

        tensors = read_gguf(path).tensors
        #: bytes of weights read per generated token as stored in the file (the embedding reads one row)
        self.streamed_bytes = sum(t.nbytes for name, t in tensors.items()
                                  if len(t.shape) == 2 and name != "token_embd.weight")
        with model_params(llama_cpp, use_extra_bufts=extra_bufts):
            self.llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                                       n_threads_batch=threads, verbose=False)

    def run(self, prompt: list[int], n_generate: int) -> tuple[float, float]:
        self.llm.reset()

        def evaluate(tokens):
            self.llm.eval(tokens)
            return self.llm.scores[self.llm.n_tokens - 1]

        return timed(evaluate, prompt, n_generate)


@contextlib.contextmanager
def model_params(llama_cpp, **fields):
    """llama_cpp.Llama builds its llama_model_params from llama_model_default_params() and offers no argument for
    some fields (use_extra_bufts): set them there while a model loads."""
    low_level = llama_cpp.llama_cpp
    default = low_level.llama_model_default_params

    def with_fields():
        params = default()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    low_level.llama_model_default_params = with_fields
    try:
        yield
    finally:
        low_level.llama_model_default_params = default


def timed(evaluate, prompt: list[int], n_generate: int) -> tuple[float, float]:
    """(prompt tokens/s, generation tokens/s): the prompt in one call, then greedy tokens one call each."""
    t0 = time.perf_counter()
    logits = np.asarray(evaluate(prompt))
    t1 = time.perf_counter()
    for _ in range(n_generate):
        logits = np.asarray(evaluate([int(np.argmax(logits.reshape(-1, logits.shape[-1])[-1]))]))
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), n_generate / (t2 - t1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="F16,Q8_0,Q4_0,Q4_K_M")
    parser.add_argument("--layers", type=int, default=TINYLLAMA["num_hidden_layers"])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--generate", type=int, default=128)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--llamacpp-extra-bufts", action="store_true",
                        help="let llama.cpp use its extra weight buffer types (AMX, repacked blocks); off by default "
                             "because on the AVX-512 + AMX VM this was written on, llama.cpp (llama-cpp-python 0.3.36) "
                             "crashed in its first batch of more than one token with them")
    args = parser.parse_args()

    llama_cpp = llama_cpp_module()
    if llama_cpp is None:
        print(LLAMA_CPP_MISSING)
    else:
        print(f"llama.cpp: llama-cpp-python {llama_cpp.__version__}, "
              f"{llama_cpp.llama_print_system_info().decode().strip()}")
    bandwidth = copy_bandwidth_gbs()
    if llama_cpp is not None:
        print(f"llama.cpp extra buffer types (AMX, repacked blocks): {'on' if args.llamacpp_extra_bufts else 'off'}")
    print(f"machine: {os.cpu_count()} cores, numpy copy bandwidth {bandwidth:.1f} GB/s (read + write); "
          f"prompt {args.prompt} tokens, generation {args.generate} tokens, best of {args.repeats}", flush=True)
    n_ctx = args.prompt + args.generate + 16
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, TINYLLAMA["vocab_size"], args.prompt)]
    rows = []
    for file_type in args.types.split(","):
        path = make_file(file_type, args.layers, llama_cpp)
        if path is None:
            continue
        for threads in (int(t) for t in args.threads.split(",")):
            engines = [CarrackEngine(path, threads, n_ctx)]
            if llama_cpp is not None:
                engines.append(LlamaCppEngine(path, threads, n_ctx, llama_cpp, args.llamacpp_extra_bufts))
            results = {engine.name: [] for engine in engines}
            for _ in range(args.repeats):
                for engine in engines:  # interleaved: both see the same machine load
                    results[engine.name].append(engine.run(prompt, args.generate))
            best = {name: (max(r[0] for r in runs), max(r[1] for r in runs)) for name, runs in results.items()}
            for engine in engines:
                pp, tg = best[engine.name]
                rows.append((file_type, threads, engine.name, pp, tg, engine.streamed_bytes * tg / 1e9))
                print(format_row(rows[-1], best), flush=True)
            del engines
            gc.collect()
    print("\n| file | threads | engine | prompt tok/s | generation tok/s | weights GB/s | carrack / llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(markdown_row(row, rows))
    return 0


def format_row(row, best) -> str:
    file_type, threads, name, pp, tg, gbs = row
    return f"{file_type:7s} {threads:2d} threads {name:10s} prompt {pp:8.1f} tok/s  generation {tg:7.2f} tok/s  " \
           f"weights {gbs:6.2f} GB/s"


def markdown_row(row, rows) -> str:
    file_type, threads, name, pp, tg, gbs = row
    ratio = ""
    other = next((r for r in rows if r[:2] == row[:2] and r[2] == "llama.cpp"), None)
    if name == "carrack" and other is not None:
        ratio = f"prompt {pp / other[3]:.2f}x, generation {tg / other[4]:.2f}x"
    return f"| {file_type} | {threads} | {name} | {pp:.1f} | {tg:.2f} | {gbs:.2f} | {ratio} |"


if __name__ == "__main__":
    sys.exit(main())
