"""The ES module (model.mjs) beside a compiled model.wasm: the manifest embedded in a fixed loader template."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE = Path(__file__).parent / "model.mjs.in"


def module_source(manifest: dict, memory_bytes: int) -> str:
    text = TEMPLATE.read_text()
    return (text.replace("/*MANIFEST*/", json.dumps(manifest, sort_keys=True))
            .replace("/*MEMORY_BYTES*/", str(int(memory_bytes))))
