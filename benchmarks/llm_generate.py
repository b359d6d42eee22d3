"""carrack.llm generation speed on a llama-architecture GGUF with random weights (nothing downloaded).

    python benchmarks/llm_generate.py --types Q8_0,Q4_0 --prompt 128 --generate 32 --threads 1,2

Writes TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads / 4 KV heads, FFN 5632, vocab 32000; --layers
to shorten it) to $CARRACK_MODELS (default ~/.cache/carrack-bench) once per type, then times prompt processing
and generation with the native quantized kernels and with the numpy fallback (CARRACK_NATIVE=0 at call time),
interleaved in one run, and reports tokens/s and the weight bytes streamed per second against this machine's
measured copy bandwidth (the physical limit of generation).

The side-by-side run with llama.cpp on the same files is benchmarks/llm_vs_llamacpp.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 rope_parameters={"rope_theta": 10000.0})


def model_dir() -> str:
    path = os.environ.get("CARRACK_MODELS") or os.path.join(os.path.expanduser("~"), ".cache", "carrack-bench")
    os.makedirs(path, exist_ok=True)
    return path


def write_random_llama(path: str, config: dict, file_type: str, seed: int = 0, extra_metadata=None) -> str:
    """A llama GGUF with N(0, 0.02) weights (norms 1), written tensor by tensor (never the whole model in RAM);
    `extra_metadata(writer)`, when given, adds keys (a vocabulary) before the tensors."""
    import gguf

    from carrack.llm.convert import _LLAMA_FILE_TYPE, encode_tensor, write_hparams

    cfg = SimpleNamespace(**config)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    write_hparams(writer, "llama", cfg)
    writer.add_file_type(_LLAMA_FILE_TYPE[file_type])
    if extra_metadata is not None:
        extra_metadata(writer)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    shapes = {"token_embd.weight": (cfg.vocab_size, cfg.hidden_size), "output_norm.weight": (cfg.hidden_size,),
              "output.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (cfg.hidden_size,), f"blk.{i}.ffn_norm.weight": (cfg.hidden_size,),
                       f"blk.{i}.attn_q.weight": (cfg.hidden_size, cfg.hidden_size),
                       f"blk.{i}.attn_k.weight": (kv, cfg.hidden_size), f"blk.{i}.attn_v.weight": (kv, cfg.hidden_size),
                       f"blk.{i}.attn_output.weight": (cfg.hidden_size, cfg.hidden_size),
                       f"blk.{i}.ffn_gate.weight": (cfg.intermediate_size, cfg.hidden_size),
                       f"blk.{i}.ffn_up.weight": (cfg.intermediate_size, cfg.hidden_size),
                       f"blk.{i}.ffn_down.weight": (cfg.hidden_size, cfg.intermediate_size)})
    for name, shape in shapes.items():
        data = (np.ones(shape, np.float32) if len(shape) == 1
                else (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)))
        encoded, ggml_type = encode_tensor(data, file_type)
        raw_dtype = None if ggml_type.name in ("F32", "F16") else gguf.GGMLQuantizationType(int(ggml_type))
        writer.add_tensor(name, encoded, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a large numpy copy, best of 3."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def time_model(llm, prompt: list[int], n_generate: int) -> tuple[float, float]:
    """(prompt tokens/s, generation tokens/s) of one greedy run from an empty cache."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    token = 1
    for _ in range(n_generate):
        logits = llm.eval([token])
        token = int(np.argmax(logits))
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), n_generate / (t2 - t1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="Q8_0,Q4_0")
    parser.add_argument("--layers", type=int, default=TINYLLAMA["num_hidden_layers"])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--generate", type=int, default=32)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from carrack.llm import Llama

    config = {**TINYLLAMA, "num_hidden_layers": args.layers}
    bandwidth = copy_bandwidth_gbs()
    print(f"machine: {os.cpu_count()} cores, numpy copy bandwidth {bandwidth:.1f} GB/s (read + write)")
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, config["vocab_size"], args.prompt)]
    print(f"{'type':6s} {'threads':>7s} {'kernels':8s} {'prompt tok/s':>12s} {'gen tok/s':>10s} {'weights GB/s':>12s}")
    for file_type in args.types.split(","):
        path = os.path.join(model_dir(), f"llama-{args.layers}L-{file_type}.gguf")
        if not os.path.exists(path):
            t0 = time.perf_counter()
            write_random_llama(path, config, file_type)
            print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
        llm = Llama(path, n_ctx=args.prompt + args.generate + 8)
        weights = llm.memory_plan().weight_bytes
        for threads in (int(t) for t in args.threads.split(",")):
            llm.n_threads = threads  # BLAS during evaluation
            for layer in llm.decoder.layers:  # the native kernels
                for m in vars(layer).values():
                    if hasattr(m, "threads"):
                        m.threads = threads
            if hasattr(llm.decoder.output, "threads"):
                llm.decoder.output.threads = threads
            results = {"native": [], "numpy": []}
            for _ in range(args.repeats):  # interleaved: both see the same machine load
                for kind in results:
                    os.environ["CARRACK_NATIVE"] = "1" if kind == "native" else "0"
                    results[kind].append(time_model(llm, prompt, args.generate))
            os.environ["CARRACK_NATIVE"] = "1"
            for kind, runs in results.items():
                pp = max(r[0] for r in runs)
                tg = max(r[1] for r in runs)
                print(f"{file_type:6s} {threads:7d} {kind:8s} {pp:12.1f} {tg:10.2f} {weights * tg / 1e9:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
