"""The example page of a compiled image classifier in headless Chromium (Debian's, driven by Playwright): it loads
the WebAssembly module, classifies a chosen image and shows the top-5 and the latency; the top-5 equal carrack's
Python session on the same pixels."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from carrack.backends.c.build import compile_model
from carrack.backends.c.page import serve
from tests.compile.models import session_outputs

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--no-first-run"]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("playwright") is None or not os.path.exists(CHROMIUM)
    or importlib.util.find_spec("ziglang") is None or importlib.util.find_spec("PIL") is None,
    reason="needs playwright (pip), chromium (apt-get install chromium), ziglang and pillow")

MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


def test_page_classifies_an_image_like_the_session(exported, tmp_path):
    from PIL import Image
    from playwright.sync_api import sync_playwright

    path, _ = exported["residual_cnn"]
    site = tmp_path / "site"
    compiled = compile_model(path, site, "wasm32", dims={"batch": 1, "height": 32, "width": 32})
    assert "index.html" in compiled.files
    pixels = np.random.default_rng(5).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    image = tmp_path / "image.png"
    Image.fromarray(pixels, "RGB").save(image)

    x = ((pixels.transpose(2, 0, 1).astype(np.float32) / 255 - MEAN) / STD)[None]
    scores = session_outputs(path, {"x": x.astype(np.float32)})[0].reshape(-1).astype(np.float64)
    probabilities = np.exp(scores - scores.max())
    probabilities /= probabilities.sum()
    want = np.argsort(-probabilities, kind="stable")[:5]

    server = serve(site, port=0, background=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/index.html")
            page.wait_for_selector("body[data-state=ready]", timeout=30_000)
            page.set_input_files("#image", str(image))
            page.wait_for_selector("body[data-state=done]", timeout=30_000)
            items = page.query_selector_all("#top5 li")
            got = [int(item.get_attribute("data-class")) for item in items]
            got_probabilities = [float(item.get_attribute("data-probability")) for item in items]
            latency = float(page.get_attribute("#latency", "data-ms"))
            text = page.inner_text("#top5")
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
    assert not errors
    assert got == list(want)
    np.testing.assert_allclose(got_probabilities, probabilities[want], rtol=1e-4, atol=1e-6)
    assert latency >= 0
    assert f"class {want[0]}: {100 * probabilities[want[0]]:.2f}%" in text


def test_pages_are_written_only_for_image_classifiers(exported, tmp_path):
    path, maxima = exported["mlp"]
    assert "index.html" not in compile_model(path, tmp_path, "wasm32", max_dims=maxima).files
