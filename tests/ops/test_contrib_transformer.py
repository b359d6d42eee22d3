"""com.microsoft kernels of onnxruntime's transformer optimizer: on tiny random-weight transformers models exported by
torch and optimized by onnxruntime.transformers.optimizer (with and without float16 conversion), and single nodes
against onnxruntime for each attribute variant."""

from __future__ import annotations

import collections
import itertools
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper

import carrack

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
MS = "com.microsoft"
RNG = np.random.default_rng(0)


def _ort_run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _assert_close(got: list, expected: list, tol: float) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, e.dtype, g.shape, e.shape)
        np.testing.assert_allclose(g.astype(np.float32), e.astype(np.float32), rtol=tol, atol=tol)


def _contrib_ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node if n.domain == MS)


# -- models from onnxruntime's transformer optimizer ---------------------------------------------------------------

def _export(module, args: tuple, names: list[str], path, dynamic: bool = True) -> str:
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        axes = {n: {0: "batch", 1: "sequence"} for n in names} if dynamic else None
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17, input_names=names,
                          output_names=["y"], dynamic_axes=axes)
    return str(path)


class _FirstOutput(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model(*args, return_dict=False)[0]


def _optimize(path: str, model_type: str, float16: bool = False, **options) -> onnx.ModelProto:
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    fusion = FusionOptions(model_type)
    for name, value in options.items():
        setattr(fusion, name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimized = optimize_model(path, model_type=model_type, num_heads=4, hidden_size=32,
                                   optimization_options=fusion)
        if float16:
            optimized.convert_float_to_float16(keep_io_types=True)
    return optimized.model


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> tuple[str, dict]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37, max_position_embeddings=64, attn_implementation="eager")
    ids = torch.randint(0, 99, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.int64)
    mask[1, 5:] = 0
    segments = torch.zeros(2, 7, dtype=torch.int64)
    segments[:, 4:] = 1
    names = ["input_ids", "attention_mask", "token_type_ids"]
    path = _export(_FirstOutput(transformers.BertModel(config)), (ids, mask, segments), names,
                   tmp_path_factory.mktemp("bert") / "bert.onnx")
    return path, {n: a.numpy() for n, a in zip(names, (ids, mask, segments))}


BERT_VARIANTS = {
    "default": ({}, {"EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu"}),
    "multi_head_attention": ({"use_multi_head_attention": True}, {"EmbedLayerNormalization", "MultiHeadAttention"}),
    "gelu_approximation": ({"enable_gelu_approximation": True}, {"EmbedLayerNormalization", "FastGelu"}),
}


@pytest.mark.parametrize("float16", [False, True], ids=["float32", "float16"])
@pytest.mark.parametrize("variant", list(BERT_VARIANTS))
def test_optimized_bert(bert, variant, float16):
    path, feeds = bert
    options, expected_ops = BERT_VARIANTS[variant]
    model = _optimize(path, "bert", float16, **options)
    assert expected_ops <= set(_contrib_ops(model))
    _assert_close(carrack.InferenceSession(model).run(None, feeds), _ort_run(model, feeds), 2e-3 if float16 else 1e-4)


def test_optimized_bert_gemm_fast_gelu(bert):
    """GemmFastGelu has no onnxruntime CPU kernel: compare with onnxruntime on the same model fused one step less
    (MatMul + FastGelu)."""
    path, feeds = bert
    fused = _optimize(path, "bert", enable_gelu_approximation=True, enable_gemm_fast_gelu=True)
    unfused = _optimize(path, "bert", enable_gelu_approximation=True)
    assert _contrib_ops(fused)["GemmFastGelu"] == 2 and "GemmFastGelu" not in _contrib_ops(unfused)
    _assert_close(carrack.InferenceSession(fused).run(None, feeds), _ort_run(unfused, feeds), 1e-4)


@pytest.mark.parametrize("float16", [False, True], ids=["float32", "float16"])
def test_optimized_t5_encoder(float16, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                   use_cache=False, attn_implementation="eager")
    ids, mask = torch.randint(0, 99, (2, 7)), torch.ones(2, 7, dtype=torch.int64)
    names = ["input_ids", "attention_mask"]
    path = _export(_FirstOutput(transformers.T5EncoderModel(config)), (ids, mask), names, tmp_path / "t5.onnx")
    model = _optimize(path, "t5", float16)
    assert _contrib_ops(model)["SkipSimplifiedLayerNormalization"] >= 3
    assert any(n.op_type == "SimplifiedLayerNormalization" for n in model.graph.node)
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    _assert_close(carrack.InferenceSession(model).run(None, feeds), _ort_run(model, feeds), 5e-3 if float16 else 1e-4)


class _DiffusionFeedForward(torch.nn.Module):
    """A diffusion transformer block's feed-forward: LayerNorm of the residual, GEGLU, projection, residual add."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.proj = torch.nn.Linear(width, 4 * width)
        self.out = torch.nn.Linear(2 * width, width)

    def forward(self, x, h):
        residual = x + h
        hidden, gate = self.proj(self.norm(residual)).chunk(2, dim=-1)
        return self.out(hidden * torch.nn.functional.gelu(gate)) + residual


@pytest.mark.parametrize("float16", [False, True], ids=["float32", "float16"])
def test_optimized_unet_feed_forward(float16, tmp_path):
    """BiasSplitGelu and BiasAdd (onnxruntime runs them on GPUs only): compared with onnxruntime on the export."""
    torch.manual_seed(0)
    module = _DiffusionFeedForward()
    x, h = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    path = _export(module, (x, h), ["x", "h"], tmp_path / "ff.onnx")
    model = _optimize(path, "unet", float16)
    assert {"BiasSplitGelu", "BiasAdd"} <= set(_contrib_ops(model))
    feeds = {"x": x.numpy(), "h": h.numpy()}
    expected = _ort_run(onnx.load(path), feeds)
    _assert_close(carrack.InferenceSession(model).run(None, feeds), expected, 1e-2 if float16 else 1e-5)


# -- single nodes against onnxruntime ------------------------------------------------------------------------------

def _node_model(op: str, feeds: dict, inits: dict, inputs: list[str], n_out: int, domain: str = MS,
                **attrs) -> onnx.ModelProto:
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, inputs, outs, domain=domain, **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), None) for k, v in feeds.items()],
        [onnx.ValueInfoProto(name=o) for o in outs],
        initializer=[onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17),
                                                                 helper.make_opsetid(MS, 1)])


def _compare_node(op: str, feeds: dict, inputs: list[str], n_out: int, inits: dict | None = None, tol: float = 1e-5,
                  domain: str = MS, **attrs) -> None:
    model = _node_model(op, feeds, inits or {}, inputs, n_out, domain, **attrs)
    _assert_close(carrack.InferenceSession(model).run(None, feeds), _ort_run(model, feeds), tol)


def _rand(*shape, dtype=np.float32, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


@pytest.mark.parametrize("segments, mask, positions, n_out",
                         [(True, True, False, 2), (False, False, False, 2), (True, False, True, 3),
                          (False, True, True, 3), (True, True, False, 3)])
def test_embed_layer_normalization(segments, mask, positions, n_out):
    batch, seq, hidden = 3, 6, 16
    feeds = {"ids": RNG.integers(0, 20, (batch, seq)).astype(np.int32)}
    inits = {"word": _rand(20, hidden), "pos": _rand(12, hidden), "gamma": _rand(hidden), "beta": _rand(hidden)}
    inputs = ["ids", "seg" if segments else "", "word", "pos", "segemb" if segments else "", "gamma", "beta"]
    if segments:
        feeds["seg"] = RNG.integers(0, 2, (batch, seq)).astype(np.int32)
        inits["segemb"] = _rand(2, hidden)
    inputs.append("mask" if mask else "")
    if mask:
        feeds["mask"] = (np.arange(seq)[None, :] < np.array([[6], [3], [1]])).astype(np.int32)
    if positions:
        feeds["position_ids"] = RNG.integers(0, 12, (batch, seq)).astype(np.int32)
        inputs.append("position_ids")
    _compare_node("EmbedLayerNormalization", feeds, inputs, n_out, inits, epsilon=1e-5)


def test_embed_layer_normalization_rejects_ids_outside_the_table():
    feeds = {"ids": np.array([[1, 25]], np.int32)}
    inits = {"word": _rand(20, 8), "pos": _rand(4, 8), "gamma": _rand(8), "beta": _rand(8)}
    model = _node_model("EmbedLayerNormalization", feeds, inits, ["ids", "", "word", "pos", "", "gamma", "beta"], 1)
    with pytest.raises(carrack.errors.CarrackError, match=r"input_ids must be in \[0, 20\)"):
        carrack.InferenceSession(model).run(None, feeds)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("axis, n_out", [(-1, 1), (-1, 2), (1, 2), (2, 1)])
def test_simplified_layer_normalization(axis, n_out, dtype):
    x = _rand(2, 3, 8, dtype=dtype)
    feeds = {"x": x, "scale": _rand(*x.shape[axis:], dtype=dtype)}
    _compare_node("SimplifiedLayerNormalization", feeds, ["x", "scale"], n_out, domain="", axis=axis, epsilon=1e-4,
                  tol=2e-3 if dtype == np.float16 else 1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bias, outputs, rank", [(False, 1, 3), (True, 1, 3), (True, 4, 3), (False, 4, 2)])
def test_skip_simplified_layer_normalization(bias, outputs, rank, dtype):
    shape = (2, 5, 16) if rank == 3 else (7, 16)
    feeds = {"x": _rand(*shape, dtype=dtype), "skip": _rand(*shape, dtype=dtype), "gamma": _rand(16, dtype=dtype)}
    if bias:
        feeds["bias"] = _rand(16, dtype=dtype)
    model = _node_model("SkipSimplifiedLayerNormalization", feeds, {}, list(feeds), outputs, epsilon=1e-6)
    if outputs == 4:  # onnxruntime leaves the mean output unset: drop it from the comparison
        model.graph.node[0].output[1] = ""
        del model.graph.output[1]
    _assert_close(carrack.InferenceSession(model).run(None, feeds), _ort_run(model, feeds),
                  2e-3 if dtype == np.float16 else 1e-5)


ROTARY_CASES = list(itertools.product([3, 4], [0, 1], [0, 4], ["start", "per_token"], [np.float32, np.float16]))


@pytest.mark.parametrize("rank, interleaved, rotary_dim, positions, dtype", ROTARY_CASES)
def test_rotary_embedding(rank, interleaved, rotary_dim, positions, dtype):
    batch, seq, heads, head = 2, 5, 3, 8
    x = _rand(batch, seq, heads * head, dtype=dtype) if rank == 3 else _rand(batch, heads, seq, head, dtype=dtype)
    half = (rotary_dim or head) // 2
    position_ids = (np.array([3], np.int64) if positions == "start"
                    else RNG.integers(0, 16, (batch, seq)).astype(np.int64))
    feeds = {"x": x, "position_ids": position_ids, "cos": _rand(16, half, dtype=dtype),
             "sin": _rand(16, half, dtype=dtype)}
    attrs = {"interleaved": interleaved}
    if rotary_dim or rank == 3:
        attrs.update(num_heads=heads)
    if rotary_dim:
        attrs.update(rotary_embedding_dim=rotary_dim)
    _compare_node("RotaryEmbedding", feeds, list(feeds), 1, tol=1e-2 if dtype == np.float16 else 1e-5, **attrs)


def _equivalent_graph(nodes: list, feeds: dict, inits: dict) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), None) for k, v in feeds.items()],
        [onnx.ValueInfoProto(name="y0")], initializer=[onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_bias_add_and_bias_split_gelu_single_nodes(dtype):
    """No onnxruntime CPU kernels: compared with onnxruntime running the ONNX ops they fuse."""
    tol = 1e-2 if dtype == np.float16 else 1e-5
    x, bias, skip = _rand(2, 6, 8, dtype=dtype), _rand(8, dtype=dtype), _rand(2, 6, 8, dtype=dtype)
    got = carrack.InferenceSession(_node_model("BiasAdd", {"x": x, "bias": bias, "skip": skip}, {},
                                               ["x", "bias", "skip"], 1)).run(None, {"x": x, "bias": bias,
                                                                                     "skip": skip})
    plain = _equivalent_graph([helper.make_node("Add", ["x", "bias"], ["t"]),
                               helper.make_node("Add", ["t", "skip"], ["y0"])], {"x": x, "bias": bias, "skip": skip},
                              {})
    _assert_close(got, _ort_run(plain, {"x": x, "bias": bias, "skip": skip}), tol)
    feeds = {"x": _rand(2, 6, 10, dtype=dtype), "bias": _rand(10, dtype=dtype)}
    got = carrack.InferenceSession(_node_model("BiasSplitGelu", feeds, {}, ["x", "bias"], 1)).run(None, feeds)
    plain = _equivalent_graph([helper.make_node("Add", ["x", "bias"], ["t"]),
                               helper.make_node("Split", ["t"], ["left", "right"], axis=-1, num_outputs=2),
                               helper.make_node("Gelu", ["right"], ["g"]),
                               helper.make_node("Mul", ["left", "g"], ["y0"])], feeds, {})
    _assert_close(got, _ort_run(plain, feeds), tol)


@pytest.mark.parametrize("bias", [False, True])
def test_gemm_fast_gelu_single_node(bias):
    feeds = {"x": _rand(2, 5, 12)}
    inits = {"w": _rand(12, 7)}
    inputs = ["x", "w"]
    if bias:
        inits["b"] = _rand(7)
        inputs.append("b")
    got = carrack.InferenceSession(_node_model("GemmFastGelu", feeds, inits, inputs, 1)).run(None, feeds)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"])]
    if bias:
        nodes.append(helper.make_node("Add", ["t", "b"], ["tb"]))
    nodes.append(helper.make_node("Gelu", ["tb" if bias else "t"], ["y0"], approximate="tanh"))
    _assert_close(got, _ort_run(_equivalent_graph(nodes, feeds, inits), feeds), 1e-5)


def _vit(transformers):
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                                    image_size=32, patch_size=8, attn_implementation="eager")
    return transformers.ViTModel(config), (torch.randn(2, 3, 32, 32),), ["pixel_values"], {"Gelu"}


def _clip_text(transformers):
    config = transformers.CLIPTextConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=37, max_position_embeddings=64,
                                         attn_implementation="eager")
    return transformers.CLIPTextModel(config), (torch.randint(0, 99, (2, 7)),), ["input_ids"], {"QuickGelu"}


def _bart_encoder(transformers):
    config = transformers.BartConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
                                     decoder_ffn_dim=37, max_position_embeddings=64, use_cache=False,
                                     attn_implementation="eager")
    ids, mask = torch.randint(0, 99, (2, 7)), torch.ones(2, 7, dtype=torch.int64)
    return (transformers.BartModel(config).get_encoder(), (ids, mask), ["input_ids", "attention_mask"],
            {"SkipLayerNormalization", "BiasGelu"})


@pytest.mark.parametrize("float16", [False, True], ids=["float32", "float16"])
@pytest.mark.parametrize("model_type, build", [("vit", _vit), ("clip", _clip_text), ("bart", _bart_encoder)])
def test_optimized_encoders(model_type, build, float16, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    module, args, names, expected_ops = build(transformers)
    dynamic = model_type != "vit"
    path = _export(_FirstOutput(module), args, names, tmp_path / f"{model_type}.onnx", dynamic=dynamic)
    model = _optimize(path, model_type, float16)
    assert expected_ops <= set(_contrib_ops(model))
    feeds = {n: a.numpy() for n, a in zip(names, args)}
    _assert_close(carrack.InferenceSession(model).run(None, feeds), _ort_run(model, feeds), 5e-3 if float16 else 1e-4)
