"""KvCacheQuantizationPass on PagedAttention: what onnxruntime-genai's builder writes, checked.

The converted paged decoder is compared, structurally, with the graph the builder writes for
the same scales (``tests/genai_builder.py`` restates its code path), and with genai's own
``kv_cache_variant.py`` where it applies (per-channel int8 <-> int4). onnxruntime has no CPU
PagedAttention kernel: session creation must fail with NOT_IMPLEMENTED only, which proves the
graph's types resolve.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheQuantizationPass
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.errors import ScalesAdjustedWarning, UnitScalesWarning
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.models.decoder import build_decoder

from conftest import FORMATS, GRANULARITIES, paged_model
from genai_builder import builder_quantized_paged, structure

LAYERS, KV, HEAD = 2, 2, 32


def paged_decoder(**overrides) -> ir.Model:
    config = {"num_layers": LAYERS, "vocab_size": 300, "dtype": "float16", "paged": True, "head_size": HEAD}
    return build_decoder(**(config | overrides))


def scale_file(
    tmp_path, granularity: str, fmt: str, kv: int = KV, head: int = HEAD, qmax: float | None = None
):
    """A genai-format scale file (flat lists per layer), calibrated against ``fmt``'s qmax."""
    rng = np.random.default_rng(7)
    n = 1 if granularity == "per_tensor" else kv * head
    k = [(rng.random(n) * 0.05 + 0.01).astype(np.float32).tolist() for _ in range(LAYERS)]
    v = [(rng.random(n) * 0.05 + 0.01).astype(np.float32).tolist() for _ in range(LAYERS)]
    doc = {"scales": {"k_scales": k, "v_scales": v}, "qmax": qmax or get_format(fmt).qmax}
    path = tmp_path / f"scales.{fmt}.{granularity}.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_what_the_genai_builder_writes(fmt, granularity, tmp_path):
    path = scale_file(tmp_path, granularity, fmt)
    ours = paged_decoder()
    KvCacheQuantizationPass(fmt, granularity, str(path))(ours)
    theirs = builder_quantized_paged(paged_decoder(), fmt, granularity, path)
    assert structure(ours) == structure(theirs)
    node = find_attention_sites(ours)[0].node
    assert "kv_cache_bit_width" not in node.attributes
    assert ("k_cache_dtype" in node.attributes) == (fmt == "int4")
    scale = node.inputs[14].const_value.numpy()
    assert scale.shape == ((KV, 1, HEAD) if granularity == "per_channel" else (1,))


def test_retargeted_scale_file_matches_the_builder_too(tmp_path):
    """An int8-calibrated file used for int4: both scale by 128/8 (the builder in float64)."""
    path = scale_file(tmp_path, "per_channel", "int4", qmax=128.0)
    ours = paged_decoder()
    KvCacheQuantizationPass("int4", "per_channel", str(path))(ours)
    theirs = builder_quantized_paged(paged_decoder(), "int4", "per_channel", path)
    a = find_attention_sites(ours)[0].node.inputs[14].const_value.numpy()
    b = next(n for n in theirs.graph if n.op_type == "PagedAttention").inputs[14].const_value.numpy()
    np.testing.assert_allclose(a, b, rtol=1e-7)


def _genai_kv_cache_variant():
    import onnxruntime_genai.models as models

    folder = os.path.dirname(models.__file__)
    sys.path.insert(0, folder)
    try:
        return importlib.import_module("kv_cache_variant").KVCacheVariant
    finally:
        sys.path.remove(folder)


@pytest.mark.parametrize(("source", "target"), [("int8", "int4"), ("int4", "int8")])
def test_matches_genai_kv_cache_variant(source, target, tmp_path):
    """genai's own tool rewrites a per-channel paged graph to another integer format."""
    pytest.importorskip("onnxruntime_genai")
    variant = _genai_kv_cache_variant()
    target_scales = scale_file(tmp_path, "per_channel", target)
    src = builder_quantized_paged(
        paged_decoder(), source, "per_channel", scale_file(tmp_path, "per_channel", source)
    )
    ir.save(src, tmp_path / "model.onnx")
    variant(f"{target}_per_channel").create(tmp_path / "model.onnx", tmp_path / "variant.onnx", target_scales)
    theirs = ir.load(tmp_path / "variant.onnx")
    ours = paged_decoder()
    KvCacheQuantizationPass(target, "per_channel", str(target_scales))(ours)
    mine, genai = structure(ours), structure(theirs)
    assert mine["io"] == genai["io"]
    for name, node in mine["nodes"].items():
        assert node["attributes"] == genai["nodes"][name]["attributes"]
        assert node["inputs"][14:16] == genai["nodes"][name]["inputs"][14:16]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_session_fails_only_with_not_implemented(fmt, granularity, tmp_path):
    model = paged_decoder()
    KvCacheQuantizationPass(fmt, granularity, str(scale_file(tmp_path, granularity, fmt)))(model)
    with pytest.raises(
        Exception, match="NOT_IMPLEMENTED : Could not find an implementation for PagedAttention"
    ):
        create_session(model)


@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT16, ir.DataType.BFLOAT16])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_single_node_types_resolve_for_both_query_dtypes(fmt, granularity, dtype):
    """bf16 decoders stop at the CPU's missing bf16 MatMul first; one node isolates the op."""
    model = paged_model(dtype=dtype)
    n = 1 if granularity == "per_tensor" else KV * 16
    KvCacheQuantizationPass(fmt, granularity, {0: (np.full(n, 0.1), np.full(n, 0.1))})(model)
    with pytest.raises(
        Exception, match="NOT_IMPLEMENTED : Could not find an implementation for PagedAttention"
    ):
        create_session(model)


def test_wrong_scale_shape_would_not_be_the_builders():
    """The same conversion with GQA's flat per-channel vector differs from the builder's graph."""
    ours = paged_decoder()
    KvCacheQuantizationPass(
        "int8",
        "per_channel",
        {i: (np.full(KV * HEAD, 0.02), np.full(KV * HEAD, 0.02)) for i in range(LAYERS)},
    )(ours)
    node = find_attention_sites(ours)[0].node
    assert node.inputs[14].shape == ir.Shape([KV, 1, HEAD])
    assert node.inputs[14].const_value.numpy().shape == (KV, 1, HEAD)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_latent_cache_gets_the_key_side_only(fmt, granularity):
    model = build_decoder(
        num_layers=LAYERS, vocab_size=300, dtype="float16", paged=True, latent=True, head_size=HEAD
    )
    n = 1 if granularity == "per_tensor" else HEAD
    scales = {i: (np.full(n, 0.03, np.float32), np.full(n, 0.5, np.float32)) for i in range(LAYERS)}
    with pytest.warns(
        ScalesAdjustedWarning, match=r"Layer\(s\) \[0, 1\] keep one \(LATENT\) cache.*V scales"
    ):
        KvCacheQuantizationPass(fmt, granularity, scales)(model)
    row = get_format(fmt)
    for site in find_attention_sites(model):
        node = site.node
        assert site.single_cache and node.inputs[4] is None
        assert len(node.inputs) == 17 and node.inputs[15] is None  # no v_scale
        k = node.inputs[14].const_value.numpy()
        assert k.shape == ((1, 1, HEAD) if granularity == "per_channel" else (1,))
        np.testing.assert_allclose(k, 0.03)  # the layer's K scale; its V entry is ignored
        quant = {"k_quant_type", "v_quant_type", "k_cache_dtype", "v_cache_dtype", "kv_cache_bit_width"}
        assert quant & set(node.attributes) == (
            {"k_quant_type", "k_cache_dtype"} if fmt == "int4" else {"k_quant_type"}
        )
        assert node.inputs[3].dtype == row.dtype and node.outputs[1].dtype == row.dtype
        assert node.inputs[3].shape[3] == row.packed_dim(HEAD)
    with pytest.raises(Exception, match=r"NOT_IMPLEMENTED.*PagedAttention"):
        create_session(model)


def test_never_emits_float4e2m1_and_only_known_cache_dtypes():
    model = paged_decoder()
    KvCacheQuantizationPass("int4", "per_tensor", {i: (0.1, 0.1) for i in range(LAYERS)})(model)
    values = {a.value for n in model.graph for k, a in n.attributes.items() if k.endswith("_cache_dtype")}
    assert values == {"int4"}


def test_second_run_is_a_no_op_and_another_format_requantizes():
    model = paged_decoder()
    scales = {i: (0.1, 0.1) for i in range(LAYERS)}
    KvCacheQuantizationPass("int4", "per_tensor", scales)(model)
    assert not KvCacheQuantizationPass("int4", "per_tensor", scales)(model).modified
    assert KvCacheQuantizationPass("int8", "per_tensor", scales)(model).modified
    direct = paged_decoder()
    KvCacheQuantizationPass("int8", "per_tensor", scales)(direct)
    assert structure(model) == structure(direct)
    assert not {"k_cache_dtype", "v_cache_dtype"} & set(find_attention_sites(model)[0].node.attributes)


def test_a_fp4_cache_is_not_mistaken_for_int4():
    model = paged_model(dtype=ir.DataType.FLOAT16)
    node = next(iter(model.graph))
    for slot in (3, 4):
        node.inputs[slot].dtype = ir.DataType.UINT8
    node.attributes["k_quant_type"] = ir.AttrString("k_quant_type", "PER_TENSOR")
    node.attributes["k_cache_dtype"] = ir.AttrString("k_cache_dtype", "float4e2m1")
    with pytest.raises(KvCacheError, match=r"float4e2m1.*does not know"):  # never requantized
        KvCacheQuantizationPass("int4", "per_tensor", {0: (0.1, 0.1)})(model)


def test_mismatched_block_sizes_are_an_error():
    model = paged_model(dtype=ir.DataType.FLOAT16)
    node = next(iter(model.graph))
    node.inputs[3].shape = ir.Shape(["num_blocks", 16, KV, 16])
    node.inputs[4].shape = ir.Shape(["num_blocks", 32, KV, 16])
    text = ir.to_onnx_text(model)
    with pytest.raises(KvCacheError, match="differ in block_size"):
        KvCacheQuantizationPass("int8", "per_tensor", {0: (0.1, 0.1)})(model)
    assert ir.to_onnx_text(model) == text


def test_cache_heads_must_match_kv_num_heads():
    model = paged_model(dtype=ir.DataType.FLOAT16)
    node = next(iter(model.graph))
    node.inputs[3].shape = ir.Shape(["num_blocks", "block_size", 3, 16])
    with pytest.raises(KvCacheError, match="3 heads on axis 2"):
        KvCacheQuantizationPass("int8", "per_tensor", {0: (0.1, 0.1)})(model)


def test_int_formats_need_scales_on_paged_models_too():
    with pytest.raises(KvCacheError, match="needs calibrated scales"):
        KvCacheQuantizationPass("int8", "per_tensor")(paged_decoder())


def test_fp8_without_scales_warns_and_uses_unit_scales():
    model = paged_decoder()
    with pytest.warns(UnitScalesWarning, match="unit scales"):
        KvCacheQuantizationPass("fp8", "per_channel")(model)
    scale = find_attention_sites(model)[0].node.inputs[14].const_value.numpy()
    assert scale.shape == (KV, 1, HEAD) and np.all(scale == 1)


def test_mixed_model_converts_both_operators():
    """A GQA decoder layer and a PagedAttention node in one graph: each gets its own layout."""
    gqa = build_decoder(num_layers=1, vocab_size=300)
    paged = paged_model(dtype=ir.DataType.FLOAT16, layers=1)
    for value in [*paged.graph.inputs, *paged.graph.outputs, *paged.graph.initializers.values()]:
        value.name = f"paged_{value.name}".replace("paged_past_key_values.0", "past_key_values.9")
    paged.graph.initializers.clear()
    for node in list(paged.graph):
        paged.graph.remove(node)
        gqa.graph.append(node)
        for value in node.inputs:
            if value is not None and value.const_value is not None:
                gqa.graph.register_initializer(value)
    moved_in, moved_out = list(paged.graph.inputs), list(paged.graph.outputs)
    paged.graph.inputs.clear()
    paged.graph.outputs.clear()
    gqa.graph.inputs.extend(moved_in)
    gqa.graph.outputs.extend(moved_out)
    sites = find_attention_sites(gqa)
    assert {(s.op.op_type, s.layer_id) for s in sites} == {("GroupQueryAttention", 0), ("PagedAttention", 9)}
    size = {"gqa": 64, "paged": KV * 16}
    scales = {s.layer_id: (np.full(size[s.op.name], 0.02), np.full(size[s.op.name], 0.02)) for s in sites}
    KvCacheQuantizationPass("int8", "per_channel", scales)(gqa)
    shapes = {s.op.op_type: s.node.inputs[s.op.slot("k_scale")].shape for s in find_attention_sites(gqa)}
    assert shapes == {"GroupQueryAttention": ir.Shape([64]), "PagedAttention": ir.Shape([KV, 1, 16])}


@pytest.mark.parametrize(
    ("granularity", "size", "hint"),
    [
        ("per_channel", 1, "These scales are per tensor"),
        ("per_tensor", 3, "another shape: calibrate this model"),  # per channel ones merge by max
        ("per_channel", 2 * KV * HEAD, "another shape: calibrate this model"),
    ],
)
def test_scale_size_errors_say_what_is_wrong(granularity, size, hint):
    scales = {i: (np.full(size, 0.1), np.full(size, 0.1)) for i in range(LAYERS)}
    with pytest.raises(KvCacheError, match=hint):
        KvCacheQuantizationPass("int8", granularity, scales)(paged_decoder())


def test_latent_scales_from_a_two_cache_model_are_refused_by_size():
    model = build_decoder(num_layers=LAYERS, vocab_size=300, paged=True, latent=True, head_size=HEAD)
    scales = {i: (np.full(KV * HEAD, 0.1), np.full(KV * HEAD, 0.1)) for i in range(LAYERS)}
    with pytest.raises(
        KvCacheError, match=r"need 32 element\(s\) per cache \(kv_num_heads 1 x head_size 32\)"
    ):
        KvCacheQuantizationPass("int8", "per_channel", scales)(model)
