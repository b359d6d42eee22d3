"""``carrack compile MODEL.onnx -o DIR --target native|wasm32 [--dim S=N ...] [--max-dim S=N ...]``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from carrack.backends.c.build import TARGETS


def _sizes(items: Sequence[str] | None, flag: str) -> dict[str, int]:
    sizes = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit():
            raise SystemExit(f"carrack: {flag} expects SYMBOL=SIZE (a positive integer), got '{item}'")
        sizes[name.strip()] = int(value)
    return sizes


def cmd_compile(args: argparse.Namespace) -> int:
    from carrack.backends.c.build import compile_model

    compiled = compile_model(args.model, args.output, args.target, _sizes(args.dim, "--dim"),
                             _sizes(args.max_dim, "--max-dim"), embed_weights=args.embed_weights)
    print(f"wrote {compiled.directory}: {', '.join(compiled.files)}")
    if args.serve:
        if args.target != "wasm32":
            raise SystemExit("carrack: --serve serves a WebAssembly build: add --target wasm32")
        from carrack.backends.c.page import serve

        serve(compiled.directory, args.port)
    return 0


def add_compile_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("compile", help="compile a model to C and build a native library or a WebAssembly module")
    c.add_argument("model")
    c.add_argument("-o", "--output", required=True, metavar="DIR")
    c.add_argument("--target", choices=TARGETS, default="native")
    c.add_argument("--dim", action="append", metavar="SYMBOL=SIZE", help="fix a symbolic dim to SIZE")
    c.add_argument("--max-dim", action="append", metavar="SYMBOL=SIZE",
                   help="make a symbolic dim a run-time argument of at most SIZE (the arena is sized for it)")
    c.add_argument("--embed-weights", action="store_true",
                   help="assemble the weights into the library or module itself (weights.bin is then not loaded)")
    c.add_argument("--serve", action="store_true",
                   help="then serve DIR over HTTP (its index.html is an example page for image classifiers)")
    c.add_argument("--port", type=int, default=8000, help="port for --serve (default 8000)")
    c.set_defaults(func=cmd_compile)
