"""The decoder forward against transformers, per architecture, for F32, F16 and quantized GGUF files."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.errors import InvalidModel, UnsupportedModel
from carrack.llm.model import Decoder, _layer_matrices
from tests.llm.tiny_models import ARCHITECTURES, prompt_ids, tiny_model, torch, transformers_greedy, write_gguf

STEPS = 32


def greedy(decoder: Decoder, ids: np.ndarray, steps: int) -> list[int]:
    decoder.reset()
    logits = decoder.forward(ids, all_logits=False)
    tokens = []
    for _ in range(steps):
        token = int(np.argmax(logits[-1]))
        tokens.append(token)
        logits = decoder.forward([token], all_logits=False)
    return tokens


@pytest.mark.parametrize("file_type", ["F32", "F16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_and_greedy_tokens_match_transformers(arch, file_type, tmp_path):
    model = tiny_model(arch, f16_weights=file_type == "F16")
    decoder = Decoder(write_gguf(model, tmp_path, file_type), n_ctx=64)
    ids = prompt_ids()
    with torch.no_grad():
        expected = model(torch.tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(decoder.forward(ids, 0), expected, atol=1e-3, rtol=0)
    assert greedy(decoder, ids, STEPS) == transformers_greedy(model, ids, STEPS)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_incremental_decoding_equals_one_batch(arch, tmp_path):
    """The KV cache written token by token gives the logits of the whole sequence in one batch."""
    decoder = Decoder(write_gguf(tiny_model(arch), tmp_path), n_ctx=64, n_batch=5)  # prompt in chunks of 5
    ids = prompt_ids(20)
    whole = decoder.forward(ids, 0)
    decoder.reset()
    head = decoder.forward(ids[:13])
    tail = [decoder.forward([t]) for t in ids[13:]]
    np.testing.assert_allclose(np.concatenate([head, *tail]), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_file_matches_its_dequantized_float_path(arch, file_type, tmp_path):
    path = write_gguf(tiny_model(arch), tmp_path, file_type)
    quantized = Decoder(path, n_ctx=64, activations="float")
    reference = Decoder(path, n_ctx=64, dequantize=True)
    assert any(type(m).__name__ == "QuantizedLinear" for m in vars(quantized.layers[0]).values())
    ids = prompt_ids()
    np.testing.assert_allclose(quantized.forward(ids, 0), reference.forward(ids, 0), atol=1e-4, rtol=0)
    assert greedy(quantized, ids, STEPS) == greedy(reference, ids, STEPS)


def test_q8_0_file_stays_close_to_the_float_model(tmp_path):
    model = tiny_model("llama")
    ids = prompt_ids()
    with torch.no_grad():
        expected = model(torch.tensor(ids)[None]).logits[0].numpy()
    path = write_gguf(model, tmp_path, "Q8_0")
    got = Decoder(path, n_ctx=64, activations="float").forward(ids, 0)
    assert np.abs(got - expected).max() < 0.05 * np.abs(expected).max()
    got_int8 = Decoder(path, n_ctx=64).forward(ids, 0)  # 8-bit activations on top of 8-bit weights
    assert np.abs(got_int8 - expected).max() < 0.1 * np.abs(expected).max()


def test_llama_rope_permutation_matters(tmp_path):
    """Reading a llama file with NeoX rope (the wrong layout for it) changes the logits: the test above can fail."""
    import dataclasses

    decoder = Decoder(write_gguf(tiny_model("llama"), tmp_path), n_ctx=64)
    ids = prompt_ids()
    right = decoder.forward(ids, 0)
    decoder.hp = dataclasses.replace(decoder.hp, arch=dataclasses.replace(decoder.hp.arch, rope_neox=True))
    assert np.abs(decoder.forward(ids, 0) - right).max() > 1e-2


def test_memory_plan_counts_weights_and_cache(tmp_path):
    decoder = Decoder(write_gguf(tiny_model("llama"), tmp_path, "Q8_0"), n_ctx=64)
    plan = decoder.memory_plan()
    hp = decoder.hp
    assert plan.kv_cache_bytes == 2 * hp.n_layer * hp.n_head_kv * 64 * hp.head_dim * 4
    assert plan.weight_bytes < sum(t.nbytes for t in decoder.gguf.tensors.values()) * 1.5
    assert plan.total_bytes == plan.weight_bytes + plan.kv_cache_bytes + plan.scratch_bytes > 0
    assert "KV cache" in plan.summary()


def _rewrite(src: str, dst: str, drop_tensor: str | None = None, arch: str | None = None,
             extra: dict | None = None) -> str:
    import gguf

    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch or old_arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        name = field.name.replace(f"{old_arch}.", f"{arch}.", 1) if arch else field.name
        writer.add_key_value(name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for name, value in (extra or {}).items():
        writer.add_string(name, value) if isinstance(value, str) else writer.add_float32(name, value)
    for tensor in reader.tensors:
        if tensor.name != drop_tensor:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_missing_tensor_is_named(tmp_path):
    src = write_gguf(tiny_model("llama"), tmp_path)
    bad = _rewrite(src, str(tmp_path / "bad.gguf"), drop_tensor="blk.1.ffn_gate.weight")
    with pytest.raises(InvalidModel, match=r"blk\.1\.ffn_gate\.weight"):
        Decoder(bad)


def test_unknown_architecture_is_named(tmp_path):
    src = write_gguf(tiny_model("llama"), tmp_path)
    bad = _rewrite(src, str(tmp_path / "bad.gguf"), arch="mamba9")
    with pytest.raises(UnsupportedModel, match="mamba9"):
        Decoder(bad)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    """rope.scaling.type = linear (positions divided by the factor), as llama.cpp's converter writes it."""
    import transformers

    from tests.llm.tiny_models import _COMMON

    torch.manual_seed(0)
    config = transformers.LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                                      **_COMMON)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.15)
    decoder = Decoder(write_gguf(model, tmp_path), n_ctx=64)
    assert decoder.hp.rope_freq_scale == 0.25
    ids = prompt_ids()
    with torch.no_grad():
        expected = model(torch.tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(decoder.forward(ids, 0), expected, atol=1e-3, rtol=0)
    assert greedy(decoder, ids, 16) == transformers_greedy(model, ids, 16)


def test_yarn_rope_scaling_is_refused_by_name(tmp_path):
    src = write_gguf(tiny_model("qwen2"), tmp_path)
    bad = _rewrite(src, str(tmp_path / "yarn.gguf"), extra={"qwen2.rope.scaling.type": "yarn",
                                                            "qwen2.rope.scaling.factor": 4.0})
    with pytest.raises(UnsupportedModel, match="rope scaling type 'yarn'"):
        Decoder(bad)


def test_context_overflow_and_bad_token_are_clear_errors(tmp_path):
    from carrack.errors import InvalidArgument

    decoder = Decoder(write_gguf(tiny_model("qwen2"), tmp_path), n_ctx=8)
    with pytest.raises(InvalidArgument, match="n_ctx=8"):
        decoder.forward(np.arange(3, 12), 0)
    with pytest.raises(InvalidArgument, match="token id 300"):
        decoder.forward([300], 0)


@pytest.mark.parametrize("file_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("n_batch", [16, 64])
def test_scratch_of_the_plan_covers_prompt_processing(file_type, n_batch, tmp_path):
    """What numpy allocates while a prompt fills the whole context stays within the plan's scratch bytes."""
    import tracemalloc

    decoder = Decoder(write_gguf(tiny_model("llama"), tmp_path, file_type), n_ctx=128, n_batch=n_batch)
    scratch = decoder.memory_plan().scratch_bytes
    tracemalloc.start()
    try:
        decoder.forward(prompt_ids(127), 0, all_logits=False)
        decoder.forward([5], all_logits=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= scratch


def test_tied_embeddings_serve_as_the_output(tmp_path):
    """Models with tie_word_embeddings (small qwen2s) have no output.weight: token_embd is the output matrix."""
    from tests.llm.tiny_models import tiny_config, transformers

    config = tiny_config("qwen2")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.15)
    decoder = Decoder(write_gguf(model, tmp_path, "Q8_0"), n_ctx=64, activations="float")
    assert "output.weight" not in decoder.gguf.tensors and decoder.output is decoder.embeddings
    ids = prompt_ids()
    reference = Decoder(decoder.gguf.path, n_ctx=64, dequantize=True)
    np.testing.assert_allclose(decoder.forward(ids, 0), reference.forward(ids, 0), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(torch.tensor(ids)[None]).logits[0].numpy()
    assert np.abs(decoder.forward(ids, 0) - expected).max() < 0.05 * np.abs(expected).max()


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K"])
def test_k_quant_file_matches_its_dequantized_float_path(ggml_type, tmp_path):
    """carrack does not quantize to K-quants, so the matrices of a 256-wide llama are random K-quant blocks (finite
    scales); the quantized decoder (native K-quant kernels while generating) must equal the dequantized one."""
    import gguf

    from carrack.gguf.types import GGMLType
    from tests.native.test_qdot import random_blocks

    src = Decoder(write_gguf(tiny_model("llama", hidden=256), tmp_path), n_ctx=64).gguf
    writer = gguf.GGUFWriter(str(tmp_path / f"{ggml_type}.gguf"), "llama")
    for field in gguf.GGUFReader(src.path).fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    kind = GGMLType[ggml_type]
    for index, (name, tensor) in enumerate(src.tensors.items()):
        if len(tensor.shape) == 2:
            blocks = random_blocks(kind, *tensor.shape, seed=index, scale=0.002)
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType(int(kind)))
        else:
            writer.add_tensor(name, np.array(tensor.data()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = str(tmp_path / f"{ggml_type}.gguf")
    quantized, reference = Decoder(path, n_ctx=64, activations="float"), Decoder(path, n_ctx=64, dequantize=True)
    assert quantized.layers[0].w_up.ggml_type == kind
    ids = prompt_ids()
    expected = reference.forward(ids, 0)
    np.testing.assert_allclose(quantized.forward(ids, 0), expected, atol=1e-4 * np.abs(expected).max(), rtol=0)
    assert greedy(quantized, ids, 16) == greedy(reference, ids, 16)
    # the default, 8-bit activations: the prompt's GEMM and the token-by-token fused matrix-vector kernels compute
    # the same products (their precision against float is checked per kernel in tests/native/test_qdot.py: these
    # random K-quant blocks make weights up to ~8 in size, which amplify any activation rounding layer by layer)
    int8 = Decoder(path, n_ctx=64)
    assert int8.layers[0].w_up.int8
    batch = int8.forward(ids, 0)
    int8.reset()
    steps = np.stack([int8.forward([t])[-1] for t in ids])
    # (not bit for bit: the two orders of float additions can put an activation on either side of a rounding step)
    np.testing.assert_allclose(steps, batch, atol=5e-3 * np.abs(batch).max(), rtol=0)


@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_int8_activations_stay_near_the_dequantized_float_path(arch, file_type, tmp_path):
    """The default, 8-bit activations (llama.cpp's scheme; the kernels themselves are checked exactly in
    tests/native/test_qdot.py): on these tiny random models (hidden 64, weights N(0, 0.15)) every logit stays within
    6% of the largest, and the top token agrees at most positions."""
    path = write_gguf(tiny_model(arch), tmp_path, file_type)
    quantized = Decoder(path, n_ctx=64)
    assert quantized.layers[0].w_up.int8
    reference = Decoder(path, n_ctx=64, dequantize=True)
    ids = prompt_ids()
    got, expected = quantized.forward(ids, 0), reference.forward(ids, 0)
    assert np.abs(got - expected).max() < 0.06 * np.abs(expected).max()
    assert (got.argmax(axis=1) == expected.argmax(axis=1)).mean() >= 0.9


def test_activation_mode_is_checked(tmp_path):
    with pytest.raises(ValueError, match="activations='int4': expected one of 'int8', 'float'"):
        Decoder(write_gguf(tiny_model("llama"), tmp_path, "Q8_0"), n_ctx=64, activations="int4")


def test_bf16_file_matches_transformers(tmp_path):
    model = tiny_model("llama")
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:  # what a BF16 file holds (round to nearest even, as torch rounds)
                param.copy_(param.bfloat16().float())
    decoder = Decoder(write_gguf(model, tmp_path, "BF16"), n_ctx=64)
    assert decoder.layers[0].wq.weight.dtype == np.uint16
    ids = prompt_ids()
    with torch.no_grad():
        expected = model(torch.tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(decoder.forward(ids, 0), expected, atol=1e-3, rtol=0)
    assert greedy(decoder, ids, STEPS) == transformers_greedy(model, ids, STEPS)


def test_f16_weights_stay_16_bit_in_memory_and_plan(tmp_path):
    model = tiny_model("llama", f16_weights=True)
    f16 = Decoder(write_gguf(model, tmp_path, "F16"), n_ctx=64)
    reference = Decoder(write_gguf(model, tmp_path, "F16"), n_ctx=64, dequantize=True)
    matrices = {id(m): m for layer in f16.layers for m in _layer_matrices(layer)}
    matrices.update({id(f16.embeddings): f16.embeddings, id(f16.output): f16.output})
    assert all(m.weight.dtype == np.float16 for m in matrices.values())
    assert f16.memory_plan().float_copies == () and reference.memory_plan().float_copies
    matrix_bytes = sum(m.nbytes for m in matrices.values())
    assert reference.memory_plan().weight_bytes - f16.memory_plan().weight_bytes == matrix_bytes
    ids = prompt_ids(20)  # more rows than the matrix-vector kernel takes: the widened-panel BLAS product
    np.testing.assert_allclose(f16.forward(ids, 0), reference.forward(ids, 0), atol=1e-4, rtol=0)
    assert greedy(f16, ids, 8) == greedy(reference, ids, 8)


def test_f16_generation_groups_the_projections_that_share_x(tmp_path, monkeypatch):
    """An F16 llama's q/k/v and gate/up are one halfmat call each while generating, with the logits of one call
    per matrix."""
    from carrack.native import halfmat

    if halfmat.library() is None:
        pytest.skip("native kernels unavailable (no C compiler?)")
    path = write_gguf(tiny_model("llama", f16_weights=True), tmp_path, "F16")
    grouped, separate = Decoder(path, n_ctx=64), Decoder(path, n_ctx=64)
    for layer in separate.layers:
        layer.qkv.half_group = layer.gate_up.half_group = None
    calls = []
    original = halfmat.ProductGroup.__call__

    def counting(group, x):
        calls.append(len(group.weights))
        return original(group, x)

    ids = prompt_ids(12)
    expected = [separate.forward(ids, 0, all_logits=False)] + [separate.forward([t]) for t in (5, 9, 17)]
    grouped.forward(ids, 0, all_logits=False)
    monkeypatch.setattr(halfmat.ProductGroup, "__call__", counting)
    got = [grouped.forward([t]) for t in (5, 9, 17)]
    n_layer = len(grouped.layers)
    # per token and layer: q/k/v (3 matrices), wo, gate/up (2), down; then the output matrix
    assert calls == ([3, 1, 2, 1] * n_layer + [1]) * 3
    for g, e in zip(got, expected[1:]):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_native_row_kernels_equal_the_numpy_steps(arch, tmp_path, monkeypatch):
    """llmrows.c's norms, rope, SiLU * up and attention (gemma2's softcapped, sliding-window layers too) give the
    numpy steps' logits and tokens, and the same logits at 1, 2 and 4 threads (a prompt long enough to split every
    row kernel, hidden 128)."""
    from carrack.native import llmrows

    if llmrows.library() is None:
        pytest.skip("native kernels unavailable (no C compiler?)")
    path = write_gguf(tiny_model(arch, hidden=128), tmp_path)
    ids = prompt_ids(280)
    by_threads = []
    for threads in (1, 2, 4):
        decoder = Decoder(path, n_ctx=300, n_threads=threads)
        by_threads.append(decoder.forward(ids, 0))
    native_tokens = greedy(decoder, ids[:40], 8)
    for other in by_threads[1:]:
        np.testing.assert_array_equal(by_threads[0], other)
    monkeypatch.setattr(llmrows, "library", lambda: None)
    numpy_decoder = Decoder(path, n_ctx=300)
    expected = numpy_decoder.forward(ids, 0)  # float32 rounding apart (sums in another order, exp to ~1 ulp)
    np.testing.assert_allclose(by_threads[0], expected, atol=2e-5 * np.abs(expected).max(), rtol=0)
    assert greedy(numpy_decoder, ids[:40], 8) == native_tokens
