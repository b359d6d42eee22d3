"""The example page beside a compiled image classifier (index.html), and a server for the directory.

The page needs an image-like model: one float input [1, 3, H, W] with H and W fixed (compile with --dim for any
symbolic dims) and one output of class scores. ``carrack compile ... --target wasm32 --serve`` serves it; so does
``python -m http.server`` in the directory (modules and WebAssembly must come over HTTP, not file://).
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
from pathlib import Path

TEMPLATE = Path(__file__).parent / "index.html.in"


def is_image_classifier(manifest: dict) -> bool:
    inputs, outputs = manifest["inputs"], manifest["outputs"]
    if len(inputs) != 1 or not outputs or inputs[0].get("dtype", "float32") != "float32" \
            or outputs[0].get("dtype", "float32") != "float32":
        return False  # the page feeds a Float32Array image and reads float scores
    shape = inputs[0]["shape"]
    return len(shape) == 4 and shape[0] == 1 and shape[1] in (1, 3) and all(isinstance(d, int) for d in shape[2:])


def page_source() -> str:
    return TEMPLATE.read_text()


class _Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                      ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json"}

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass


def serve(directory: str | os.PathLike, port: int = 8000, host: str = "127.0.0.1",
          background: bool = False) -> http.server.ThreadingHTTPServer:
    """Serve `directory` over HTTP (``background``: in a daemon thread, returning the server to shut down)."""
    handler = functools.partial(_Handler, directory=str(directory))
    server = http.server.ThreadingHTTPServer((host, port), handler)
    if background:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    else:
        print(f"serving {directory} at http://{host}:{server.server_address[1]}/ (Ctrl-C stops)")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    return server
