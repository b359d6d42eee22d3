"""`carrack generate MODEL.gguf -p PROMPT` and `carrack chat MODEL.gguf`: streamed text, then tokens/s."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np


def add_llm_parser(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text with a GGUF language model")
    _common_arguments(g)
    g.add_argument("-p", "--prompt", default="", help="prompt text")
    g.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--dry-run", action="store_true",
                   help="load the model, print its memory plan (weights + KV cache + scratch) and stop")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="chat with a GGUF language model (its chat template; EOF or /exit ends)")
    _common_arguments(c)
    c.add_argument("-n", "--n-predict", type=int, default=256, help="most tokens per reply (default 256)")
    c.add_argument("--system", default=None, help="a system message")
    c.set_defaults(func=cmd_chat)


def _common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a .gguf file")
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="context length n_ctx (default 2048)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one)")
    p.add_argument("-t", "--threads", type=int, default=None)


def _load(args: argparse.Namespace):
    from carrack.errors import InvalidArgument
    from carrack.llm.api import DEFAULT_SEED, Llama

    if not os.path.isfile(args.model):
        raise InvalidArgument(f"no model file '{args.model}'")
    seed = DEFAULT_SEED if args.seed is None else args.seed
    return Llama(args.model, n_ctx=args.ctx_size, n_threads=args.threads, seed=seed)


def _sampling(args: argparse.Namespace):
    from carrack.llm.sampling import SamplingParams

    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _load(args)
    plan = llm.memory_plan()
    hp = llm.decoder.hp
    print(f"{args.model}: {hp.arch.name}, {hp.n_layer} layers, n_embd {hp.n_embd}, vocab {hp.n_vocab}, "
          f"n_ctx {llm.n_ctx()}", file=sys.stderr)
    print("memory plan:\n  " + plan.summary().replace("\n", "\n  "), file=sys.stderr)
    if args.dry_run:
        return 0
    prompt = llm.tokenize(args.prompt.encode("utf-8"), add_bos=True)
    _stream_tokens(llm, prompt, args.n_predict, args, echo=args.prompt)
    return 0


def _stream_tokens(llm, prompt: list[int], n_predict: int, args: argparse.Namespace, echo: str = "") -> str:
    rng = np.random.default_rng(args.seed)
    stream = llm.tokenizer.stream()
    out = sys.stdout
    if echo:
        out.write(echo)
        out.flush()
    t0 = time.perf_counter()
    t_first = None
    text, n_generated = [], 0
    for token in llm.generate(prompt, n_predict, _sampling(args), rng):
        if t_first is None:
            t_first = time.perf_counter()
        n_generated += 1
        piece = stream.push(token)
        text.append(piece)
        out.write(piece)
        out.flush()
    tail = stream.flush()
    text.append(tail)
    out.write(tail + "\n")
    t_end = time.perf_counter()
    t_first = t_first or t_end
    prompt_s, gen_s = t_first - t0, t_end - t_first
    gen_rate = (n_generated - 1) / gen_s if n_generated > 1 and gen_s > 0 else float("nan")
    print(f"prompt: {len(prompt)} tokens, {len(prompt) / prompt_s:.1f} tokens/s | generation: {n_generated} tokens, "
          f"{gen_rate:.1f} tokens/s", file=sys.stderr)
    return "".join(text)


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _load(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    tok = llm.tokenizer
    while True:
        sys.stdout.write("> ")
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        text = llm.apply_chat_template(messages)
        bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else None
        prompt = tok.encode(text, add_special=tok.add_bos and not (bos and text.startswith(bos)), parse_special=True)
        reply = _stream_tokens(llm, prompt, args.n_predict, args)
        messages.append({"role": "assistant", "content": reply})
