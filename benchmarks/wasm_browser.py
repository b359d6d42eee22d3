"""`carrack compile --target wasm32` against onnxruntime-web (wasm backend, SIMD, 1 thread) in headless Chromium:
latency (median of interleaved runs, one page per engine, timed inside the page), bytes the page downloads
(WebAssembly, JavaScript and weights or model, as Chromium counts them) and the peak WebAssembly memory.

    # once, outside the repository (nothing is downloaded when the benchmark runs):
    npm install --prefix ~/.cache/carrack-bench/ort-web onnxruntime-web
    python benchmarks/make_models.py --only mobilenetv2,resnet50,bert_base
    python benchmarks/wasm_browser.py mobilenetv2 resnet50 bert_base resnet50_qdq [--iters 7]

Models come from $CARRACK_MODELS (default ~/.cache/carrack-bench) with their NAME.json feed sidecars;
resnet50_qdq is made here from resnet50.onnx by onnxruntime.quantization.quantize_static (QDQ format, uint8
activations and int8 weights, calibrated on 4 random images) the first time it is asked for. A model that carrack
cannot compile yet is run by onnxruntime-web alone, and the table lists the operators that stopped it.

Peak memory: carrack's module has one memory, fixed when it is built; for onnxruntime-web the page wraps
`WebAssembly.Memory` and `WebAssembly.instantiate` to see every memory the runtime makes and reads its size after
the runs (a WebAssembly memory never shrinks, so its size then is its peak). The pages are served cross-origin
isolated (COOP/COEP) so that onnxruntime-web's threaded build may use its shared memory; it is told 1 thread.
Needs playwright (pip) and Debian's chromium (/usr/bin/chromium, or $CHROMIUM).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from carrack.backends.c.build import compile_model  # noqa: E402
from carrack.errors import CarrackError  # noqa: E402

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--no-first-run", "--disable-background-timer-throttling", "--disable-renderer-backgrounding"]
ORT_WEB_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")


def models_dir() -> Path:
    return Path(os.environ.get("CARRACK_MODELS") or Path.home() / ".cache" / "carrack-bench")


def default_ort_web() -> Path:
    return models_dir() / "ort-web" / "node_modules" / "onnxruntime-web" / "dist"


# models ------------------------------------------------------------------------------------------------------------

def make_qdq_resnet50(directory: Path) -> Path:
    """resnet50.onnx quantized by onnxruntime's own quantize_static (QDQ, per-tensor, 4 random calibration images)."""
    target = directory / "resnet50_qdq.onnx"
    if target.exists():
        return target
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    source = directory / "resnet50.onnx"
    if not source.exists():
        raise SystemExit(f"{source} is missing: python benchmarks/make_models.py --only resnet50")

    class RandomImages(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.batches = iter([{"input": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}
                                 for _ in range(4)])

        def get_next(self):
            return next(self.batches, None)

    with tempfile.TemporaryDirectory() as scratch:
        prepared = Path(scratch) / "prepared.onnx"
        quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
        quantize_static(str(prepared), str(target), RandomImages(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    spec = json.loads((directory / "resnet50.json").read_text())
    (directory / "resnet50_qdq.json").write_text(json.dumps({"inputs": spec["inputs"], "kind": "cnn",
                                                             "made_by": "onnxruntime.quantization.quantize_static"}))
    return target


def model_files(name: str) -> tuple[Path, list[dict]]:
    directory = models_dir()
    path = make_qdq_resnet50(directory) if name == "resnet50_qdq" else directory / f"{name}.onnx"
    sidecar = path.with_suffix(".json")
    if not path.exists() or not sidecar.exists():
        raise SystemExit(f"{path} (or its sidecar) is missing: python benchmarks/make_models.py --only {name}")
    return path, json.loads(sidecar.read_text())["inputs"]


def symbol_sizes(path: Path, spec: list[dict]) -> dict[str, int]:
    """The model's symbolic input dims sized from the sidecar's feed shapes."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    shapes = {entry["name"]: entry["shape"] for entry in spec}
    sizes = {}
    for value in graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param and value.name in shapes:
                sizes[dim.dim_param] = int(shapes[value.name][axis])
    return sizes


def compile_for_browser(path: Path, spec: list[dict], out: Path) -> str | None:
    """Compile into `out`; None when it worked, else what stopped it (the unsupported operators, counted)."""
    try:
        compile_model(path, out, "wasm32", dims=symbol_sizes(path, spec))
    except CarrackError as e:
        return _summarize_failure(e)
    return None


def _summarize_failure(error: CarrackError) -> str:
    missing = getattr(error, "missing", None)
    if not missing:
        return str(error).splitlines()[0]
    counts: dict[str, int] = {}
    for op, _ in missing:
        counts[op] = counts.get(op, 0) + 1
    return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in sorted(counts.items(), key=lambda kv: -kv[1]))


# the page ------------------------------------------------------------------------------------------------------------

PAGE = """<!doctype html><meta charset="utf-8"><title>carrack vs onnxruntime-web</title>
<script type="module">
const params = new URLSearchParams(location.search);
const engine = params.get("engine"), model = params.get("model");
const spec = await (await fetch(`/spec/${model}.json`)).json();
const memories = [];
const NativeMemory = WebAssembly.Memory;
WebAssembly.Memory = function (descriptor) { const m = new NativeMemory(descriptor); memories.push(m); return m; };
WebAssembly.Memory.prototype = NativeMemory.prototype;
for (const name of ["instantiate", "instantiateStreaming"]) {
  const native = WebAssembly[name];
  WebAssembly[name] = async (...args) => {
    const result = await native.apply(WebAssembly, args);
    const memory = (result.instance ?? result).exports?.memory;
    if (memory instanceof NativeMemory) memories.push(memory);
    return result;
  };
}

function lcg(seed) {
  let s = seed >>> 0;
  return () => { s = (Math.imul(s, 1664525) + 1013904223) >>> 0; return s / 4294967296; };
}
function fill(entry) {
  const count = entry.shape.reduce((a, b) => a * b, 1), next = lcg(7);
  if (entry.dtype === "int64") {
    const data = new BigInt64Array(count);
    for (let i = 0; i < count; i++)
      data[i] = BigInt(entry.fill === "ones" ? 1 : entry.fill === "zeros" ? 0 : Math.floor(next() * (entry.high ?? 2)));
    return data;
  }
  const data = new Float32Array(count);
  for (let i = 0; i < count; i++) data[i] = (next() + next() + next() - 1.5) * 2;
  return data;
}

let runOnce;
if (engine === "ort") {
  const ort = await import("/ort/ort.wasm.min.mjs");
  ort.env.wasm.numThreads = 1;
  ort.env.wasm.simd = true;
  ort.env.wasm.proxy = false;
  ort.env.wasm.wasmPaths = "/ort/";
  const session = await ort.InferenceSession.create(`/models/${model}.onnx`,
    { executionProviders: ["wasm"], graphOptimizationLevel: "all" });
  const feeds = {};
  for (const entry of spec) feeds[entry.name] = new ort.Tensor(entry.dtype, fill(entry), entry.shape);
  runOnce = async () => { const t = performance.now(); await session.run(feeds); return performance.now() - t; };
} else {
  const { load, hasRelaxedSimd } = await import(`/carrack/${model}/model.mjs`);
  const m = await load(`/carrack/${model}/model.wasm`, { relaxed: engine === "carrack" && hasRelaxedSimd() });
  window.simd = m.simd;
  const feeds = {};
  for (const entry of spec) feeds[entry.name] = { data: fill(entry), shape: entry.shape };
  runOnce = async () => { const t = performance.now(); m.run(feeds); return performance.now() - t; };
}
window.runOnce = runOnce;
window.peakMemory = () => Math.max(0, ...memories.map((m) => m.buffer.byteLength));
window.isolated = crossOriginIsolated;
document.body.dataset.state = "ready";
</script><body></body>
"""


class _IsolatedHandler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                      ".wasm": "application/wasm", ".json": "application/json"}

    def end_headers(self) -> None:
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass


def build_site(site: Path, ort_web: Path) -> None:
    (site / "ort").mkdir(parents=True)
    for name in ORT_WEB_FILES:
        if not (ort_web / name).exists():
            raise SystemExit(f"{ort_web / name} is missing: npm install --prefix "
                             f"{ort_web.parent.parent.parent} onnxruntime-web")
        (site / "ort" / name).symlink_to(ort_web / name)
    for folder in ("models", "spec", "carrack"):
        (site / folder).mkdir()
    (site / "bench.html").write_text(PAGE)


class Engine:
    """One engine's page: its downloads counted as Chromium finishes them."""

    def __init__(self, browser, origin: str, engine: str, model: str):
        self.page = browser.new_page()
        self.downloaded = 0
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("requestfinished", self._count)
        self.page.goto(f"{origin}/bench.html?engine={engine}&model={model}")
        try:
            self.page.wait_for_selector("body[data-state=ready]", state="attached", timeout=600_000)
        except Exception:
            raise RuntimeError(f"{engine} on {model} did not load: {self.errors}") from None

    def _count(self, request) -> None:
        if "/bench.html" in request.url or "/spec/" in request.url:
            return
        self.downloaded += max(0, request.sizes()["responseBodySize"])

    def run_once(self) -> float:
        return float(self.page.evaluate("runOnce()"))

    def peak_memory(self) -> int:
        return int(self.page.evaluate("peakMemory()"))


def measure(browser, origin: str, site: Path, name: str, iters: int) -> dict:
    path, spec = model_files(name)
    (site / "models" / f"{name}.onnx").symlink_to(path)
    (site / "spec" / f"{name}.json").write_text(json.dumps(spec))
    stopped = compile_for_browser(path, spec, site / "carrack" / name)
    engines = {"onnxruntime-web": Engine(browser, origin, "ort", name)}
    if stopped is None:
        engines["carrack"] = Engine(browser, origin, "carrack", name)  # relaxed SIMD where Chromium has it
        engines["carrack-simd128"] = Engine(browser, origin, "carrack-simd128", name)  # ort-web's instruction set
    times: dict[str, list[float]] = {engine: [] for engine in engines}
    for engine in engines.values():
        engine.run_once()  # warm-up
    for _ in range(iters):
        for label, engine in engines.items():
            times[label].append(engine.run_once())
    row = {"model": name, "stopped": stopped}
    for label, engine in engines.items():
        row[label] = {"ms": float(np.median(times[label])), "downloaded": engine.downloaded,
                      "peak_memory": engine.peak_memory(), "simd": engine.page.evaluate("window.simd ?? null")}
        engine.page.close()
    if stopped is None:
        manifest = json.loads((site / "carrack" / name / "model.json").read_text())
        row["carrack"]["plan_bytes"] = manifest["arena_capacity"] + manifest["weights"]["bytes"]
    return row


def format_row(row: dict) -> str:
    ort = row["onnxruntime-web"]
    cells = [f"{row['model']:13s}", f"ort-web {ort['ms']:8.1f} ms {ort['downloaded'] / 1e6:7.1f} MB "
             f"mem {ort['peak_memory'] / 1e6:7.1f} MB"]
    if row["stopped"]:
        cells.append(f"carrack: not compiled ({row['stopped']})")
    else:
        c = row["carrack"]
        cells.append(f"carrack ({c['simd']}) {c['ms']:8.1f} ms {c['downloaded'] / 1e6:7.1f} MB "
                     f"mem {c['peak_memory'] / 1e6:7.1f} MB (plan {c['plan_bytes'] / 1e6:.1f} MB)  "
                     f"carrack/ort-web {c['ms'] / ort['ms']:.2f}x")
        plain = row["carrack-simd128"]
        cells.append(f"simd128 only {plain['ms']:8.1f} ms ({plain['ms'] / ort['ms']:.2f}x)")
    return "  ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="mobilenetv2, resnet50, bert_base, resnet50_qdq, ...")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--ort-web", type=Path, default=default_ort_web(),
                        help="onnxruntime-web's dist directory (npm install onnxruntime-web)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        site = Path(scratch)
        build_site(site, args.ort_web)
        handler = functools.partial(_IsolatedHandler, directory=str(site))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        origin = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
                for name in args.models:
                    rows.append(measure(browser, origin, site, name, args.iters))
                    print(format_row(rows[-1]), flush=True)
                browser.close()
        finally:
            server.shutdown()
            server.server_close()
            shutil.rmtree(site / "carrack", ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
