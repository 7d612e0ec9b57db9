"""Float16AttentionPass: a float32 model's GroupQueryAttention computed in float16 around its
quantized cache, so that CUDA (no float32 GQA) runs it; checked against onnxruntime's schema,
its CPU kernel (int8/int4 take float16 queries) and the CUDA-rule emulation (fp8)."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import (
    Float16AttentionPass,
    GqaFusionPass,
    KvCacheQuantizationPass,
    KvCacheRunner,
    check_kv_cache_support,
)
from onnx_kvcache.cache.operators import GQA
from onnx_kvcache.cache.sites import find_gqa_sites
from onnx_kvcache.errors import KvCachePreconditionError
from onnx_kvcache.model_io._sessions import create_session, import_onnxruntime
from onnx_kvcache.models.decoder import build_decoder

from conftest import FORMATS, GRANULARITIES, gqa_model

DATA = pathlib.Path(__file__).parents[1] / "data"
F16, F32 = ir.DataType.FLOAT16, ir.DataType.FLOAT
MODELS = {
    "decoder": lambda: build_decoder(num_layers=2, vocab_size=300),
    "torch_export": lambda: _fused(ir.load(DATA / "export_llama_opset23.onnx")),
    "optimum": lambda: _fused(ir.load(DATA / "optimum_llama" / "model.onnx")),
    "qk_norm_rotary_in_node": lambda: gqa_model(layers=2, qk_norm=True),
}


def _fused(model: ir.Model) -> ir.Model:
    with pytest.warns(Warning):  # the padding assumption, said by the fusion
        GqaFusionPass()(model)
    return model


def _scales(model: ir.Model, granularity: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    scales = {}
    for site in find_gqa_sites(model):
        n = 1 if granularity == "per_tensor" else site.kv_num_heads * site.head_size()
        scales[site.layer_id] = (np.full(n, 0.05, np.float32), np.full(n, 0.04, np.float32))
    return scales


def _quantized(model: ir.Model, fmt: str, granularity: str) -> ir.Model:
    KvCacheQuantizationPass(fmt, granularity, _scales(model, granularity))(model)
    return model


def _schema_types(node: ir.Node) -> dict[str, str]:
    """Each type parameter of GroupQueryAttention's installed schema bound by ``node``; asserts
    every present input and output fits its parameter and the parameter binds one type."""
    ort = import_onnxruntime()
    schema = next(
        s
        for s in ort.capi.onnxruntime_pybind11_state.get_all_operator_schema()
        if s.name == GQA.op_type and s.domain == GQA.domain
    )
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    bound: dict[str, str] = {}
    pairs = [*zip(schema.inputs, node.inputs), *zip(schema.outputs, node.outputs)]
    for formal, value in pairs:
        if value is None or value.dtype is None:  # undeclared (an index computed upstream): ORT infers it
            continue
        name = value.dtype.name.lower() if value.dtype != F32 else "float"
        actual = f"tensor({name})"
        if formal.typeStr in allowed:
            assert actual in allowed[formal.typeStr], (formal.name, actual)
            assert bound.setdefault(formal.typeStr, actual) == actual, (formal.name, actual, bound)
        else:
            assert actual == formal.typeStr, (formal.name, actual)
    return bound


def _io_types(model: ir.Model) -> list[tuple[str, ir.DataType | None]]:
    return [(v.name, v.dtype) for v in [*model.graph.inputs, *model.graph.outputs]]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("make", MODELS)
def test_the_attention_computes_in_float16_exactly_as_the_schema_types_it(make, fmt, granularity):
    model = _quantized(MODELS[make](), fmt, granularity)
    reference = model.clone()
    weights = {name: (v.dtype, v.shape) for name, v in model.graph.initializers.items()}
    assert not check_kv_cache_support(model, "cuda", fmt, granularity).supported  # float32 queries
    assert Float16AttentionPass()(model).modified
    for site in find_gqa_sites(model, with_cache_only=False):
        bound = _schema_types(site.node)
        assert bound["T"] == "tensor(float16)"
        assert bound["T_CACHE"] != "tensor(float)"
        for slot in site.node.inputs:
            if slot is not None and slot.dtype == F16 and slot.producer() is not None:
                assert slot.producer().op_type == "Cast"
    assert _io_types(model) == _io_types(reference)  # the caller's I/O as it was
    assert {name: (v.dtype, v.shape) for name, v in model.graph.initializers.items()} == weights
    assert check_kv_cache_support(model, "cuda", fmt, granularity).supported
    assert not Float16AttentionPass()(model).modified  # nothing left to do


def test_shared_inputs_are_cast_once_and_graph_outputs_keep_their_names():
    model = _quantized(gqa_model(layers=3), "int8", "per_tensor")
    outputs = [v.name for v in model.graph.outputs]
    Float16AttentionPass()(model)
    casts = [n for n in model.graph if n.op_type == "Cast"]
    assert sum(n.inputs[0].name == "cos_cache" for n in casts) == 1  # read by 3 nodes
    assert [v.name for v in model.graph.outputs] == outputs
    for value in model.graph.outputs:
        if value.name.startswith("output."):
            assert value.dtype == F32 and value.producer().op_type == "Cast"
    ir.serde.serialize_model(model)  # a model onnx can write


@pytest.mark.parametrize("dtype", [F32, ir.DataType.BFLOAT16])
def test_a_float_cache_is_refused_before_anything_changes(dtype):
    model = gqa_model(layers=2)
    for value in [*model.graph.inputs, *model.graph.outputs]:
        if "past" in value.name or "present" in value.name:
            value.dtype = dtype
    before = [n.op_type for n in model.graph]
    with pytest.raises(KvCachePreconditionError, match="quantize the cache first"):
        Float16AttentionPass()(model)
    assert [n.op_type for n in model.graph] == before


@pytest.mark.parametrize("dtype", [F16, ir.DataType.BFLOAT16])
def test_float16_and_bfloat16_attention_is_left_alone(dtype):
    model = gqa_model(layers=1, dtype=dtype)
    assert not Float16AttentionPass()(model).modified


def test_a_float16_cache_is_kept():
    model = gqa_model(layers=1)
    for value in [*model.graph.inputs, *model.graph.outputs]:
        if "past" in value.name or "present" in value.name:
            value.dtype = F16
    assert Float16AttentionPass()(model).modified
    assert _schema_types(next(iter(n for n in model.graph if n.op_type == GQA.op_type)))["T_CACHE"] == (
        "tensor(float16)"
    )


def _logits(model: ir.Model, ids: list[int], **kwargs) -> np.ndarray:
    runner = KvCacheRunner(model, **kwargs)
    first = runner.prefill(ids[:24])[0]
    rest = [runner.step(t)[0] for t in ids[24:]]
    return np.concatenate([first, np.stack(rest)])


IDS = [int(i) for i in np.random.default_rng(3).integers(1, 300, 40)]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_cpu_kernel_runs_it_as_the_float32_attention_within_float16_rounding(fmt):
    """onnxruntime's CPU GQA takes float16 queries with int8/int4 caches: the real kernel."""
    direct = _quantized(build_decoder(num_layers=2, vocab_size=300), fmt, "per_tensor")
    halved = direct.clone()
    Float16AttentionPass()(halved)
    a, b = _logits(direct, IDS, semantics="cpu"), _logits(halved, IDS, semantics="cpu")
    assert not KvCacheRunner(halved, semantics="cpu").emulated  # the kernel itself
    diff = np.abs(a - b).max()
    assert 0 < diff < 2e-2 * np.abs(a).max()  # float16 rounding: present, and small


def test_fp8_through_the_cuda_rule_emulation_is_the_float32_attention_within_float16_rounding():
    direct = _quantized(build_decoder(num_layers=2, vocab_size=300), "fp8", "per_tensor")
    halved = direct.clone()
    Float16AttentionPass()(halved)
    runner = KvCacheRunner(halved)
    assert runner.kernel_rule == "cuda (emulated on CPU)"
    a, b = _logits(direct, IDS), _logits(halved, IDS)
    diff = np.abs(a - b).max()
    assert 0 < diff < 2e-2 * np.abs(a).max()
    assert np.array_equal(a.argmax(-1), b.argmax(-1))


def test_onnxruntime_resolves_the_fp8_graph_and_lacks_only_the_cpu_kernel():
    model = _quantized(build_decoder(num_layers=2, vocab_size=300), "fp8", "per_tensor")
    Float16AttentionPass()(model)
    with pytest.raises(Exception, match="NOT_IMPLEMENTED") as refused:
        create_session(model)
    # the CPU kernels (T float and float16) differ from it in the cache's type only
    kernel = "(tensor(float16),tensor(uint8),tensor(int8),), but the node in the model has the following type"
    assert f"{kernel} (tensor(float8e4m3fn))" in str(refused.value)


def test_a_query_whose_type_the_graph_does_not_state_is_cast_too(tmp_path):
    """mobius writes no value_info: the query (a MatMul's output) has no stated type, the rotary
    tables say T is float32. Every T input reaches the node as float16, so CUDA's kernel gets one
    type (before, the query stayed float32 beside float16 tables)."""
    path = pathlib.Path(__file__).parents[1] / "data" / "producers" / "mobius" / "mobius-cpu-gqa" / "llama"
    model = ir.load(path / "model.onnx")
    assert all(site.input("query").dtype is None for site in find_gqa_sites(model))
    KvCacheQuantizationPass("fp8", "per_tensor", {0: (0.1, 0.1), 1: (0.1, 0.1)})(model)
    Float16AttentionPass()(model)
    for site in find_gqa_sites(model):
        types = {name: site.input(name).dtype for name in GQA.t_inputs if site.input(name) is not None}
        assert set(types.values()) == {ir.DataType.FLOAT16}, types
