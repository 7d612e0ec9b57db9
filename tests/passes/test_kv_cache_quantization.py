"""KvCacheQuantizationPass: structure, rules, errors, and CPU numerics vs a reference."""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import Fp8KvCachePass, KvCacheError, KvCacheQuantizationPass, KvCacheWarning
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cache.sites import find_gqa_sites, layer_id_from_name
from onnx_kvcache.errors import ScalesAdjustedWarning, SkippedNodeWarning, UnitScalesWarning
from onnx_kvcache.model_io._sessions import create_session

from conftest import CPU_FORMATS, FORMATS, GRANULARITIES, gqa_model, reference_step, run_gqa_steps

KV, HEAD = 2, 16


def scales_for(layers, granularity, k=0.05, v=0.04):
    n = 1 if granularity == "per_tensor" else KV * HEAD
    return {i: (np.full(n, k + 0.01 * i, np.float32), np.full(n, v, np.float32)) for i in layers}


def gqa_nodes(model):
    return [s.node for s in find_gqa_sites(model, with_cache_only=False)]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_retypes_cache_io_and_adds_scales(fmt, granularity):
    model = gqa_model(layers=2, head=HEAD, kv_heads=KV)
    result = KvCacheQuantizationPass(fmt, granularity, scales_for([0, 1], granularity))(model)
    assert result.modified
    row = get_format(fmt)
    for i, node in enumerate(gqa_nodes(model)):
        for value in (*node.inputs[3:5], *node.outputs[1:3]):
            assert value.dtype == row.dtype
            assert value.shape[3] == (HEAD // 2 if fmt == "int4" else HEAD)
            assert not isinstance(value.shape[2], int)  # symbolic dims stay symbolic
        k, v = node.inputs[12], node.inputs[13]
        assert k.is_initializer() and v.is_initializer()
        assert k.name == f"past_key_values.{i}.key_scale" and v.name == f"past_key_values.{i}.value_scale"
        expected = 1 if granularity == "per_tensor" else KV * HEAD
        assert k.const_value.numpy().shape == (expected,) and k.dtype == ir.DataType.FLOAT
        np.testing.assert_allclose(k.const_value.numpy(), 0.05 + 0.01 * i, rtol=1e-6)
        quant = "PER_TENSOR" if granularity == "per_tensor" else "PER_CHANNEL"
        assert node.attributes["k_quant_type"].as_string() == quant
        assert node.attributes["v_quant_type"].as_string() == quant
        assert node.attributes["kv_cache_bit_width"].as_int() == row.bit_width
        assert node.attributes["num_heads"].as_int() == 4 and node.attributes["do_rotary"].as_int() == 1


def test_keeps_inputs_above_13_and_other_attributes():
    model = gqa_model(qk_norm=True)
    node = gqa_nodes(model)[0]
    node.attributes["softcap"] = ir.AttrFloat32("softcap", 30.0)
    qn, kn = node.inputs[14], node.inputs[15]
    KvCacheQuantizationPass("int8", scales=scales_for([0], "per_tensor"))(model)
    assert len(node.inputs) == 16 and node.inputs[14] is qn and node.inputs[15] is kn
    assert node.attributes["softcap"].as_float() == 30.0


def test_grows_short_input_list_only_to_14():
    model = gqa_model(rotary=False)
    node = gqa_nodes(model)[0]
    node.resize_inputs(7)
    KvCacheQuantizationPass("fp8", scales=scales_for([0], "per_tensor"))(model)
    assert len(node.inputs) == 14 and all(node.inputs[i] is None for i in range(7, 12))


def test_node_without_cache_is_left_alone():
    model = gqa_model(layers=2)
    node = gqa_nodes(model)[1]
    for slot in (3, 4):
        node.replace_input_with(slot, None)
    KvCacheQuantizationPass("int8", scales=scales_for([0], "per_tensor"))(model)
    assert "k_quant_type" not in node.attributes and len(node.inputs) < 13


def test_cache_produced_by_a_node_is_skipped_with_warning():
    model = gqa_model(layers=2)
    node = gqa_nodes(model)[1]
    past = node.inputs[3]
    ident = ir.Node("", "Identity", [past], num_outputs=1, name="copy_cache")
    model.graph.insert_before(node, ident)
    node.replace_input_with(3, ident.outputs[0])
    with pytest.warns(SkippedNodeWarning, match=r"gqa\.1.*produced by Identity"):
        KvCacheQuantizationPass("int8", scales=scales_for([0, 1], "per_tensor"))(model)
    assert "k_quant_type" not in node.attributes
    assert gqa_nodes(model)[0].attributes["k_quant_type"].as_string() == "PER_TENSOR"


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_initializer_cache_is_retyped_with_its_value(fmt):
    model = gqa_model()
    node = gqa_nodes(model)[0]
    for slot in (3, 4):
        old = node.inputs[slot]
        init = ir.Value(
            name=f"{old.name}_init", const_value=ir.tensor(np.zeros((1, KV, 0, HEAD), np.float32))
        )
        init.dtype, init.shape = ir.DataType.FLOAT, ir.Shape([1, KV, 0, HEAD])
        model.graph.register_initializer(init)
        node.replace_input_with(slot, init)
        model.graph.inputs.remove(old)
    KvCacheQuantizationPass(fmt, scales=scales_for([0], "per_tensor"))(model)
    row = get_format(fmt)
    value = node.inputs[3]
    assert value.dtype == row.dtype and value.const_value.dtype == row.dtype
    assert tuple(value.const_value.shape) == (1, KV, 0, row.packed_dim(HEAD))


def test_non_empty_initializer_cache_is_skipped():
    model = gqa_model()
    node = gqa_nodes(model)[0]
    old = node.inputs[3]
    init = ir.Value(name="frozen", const_value=ir.tensor(np.ones((1, KV, 2, HEAD), np.float32)))
    model.graph.register_initializer(init)
    node.replace_input_with(3, init)
    model.graph.inputs.remove(old)
    with pytest.warns(SkippedNodeWarning, match="non-empty initializer"):
        result = KvCacheQuantizationPass("int8", scales=scales_for([0], "per_tensor"))(model)
    assert not result.modified


def test_cache_shared_by_two_nodes_gets_one_scale():
    model = gqa_model(layers=2)
    a, b = gqa_nodes(model)
    for slot in (3, 4):
        old = b.inputs[slot]
        b.replace_input_with(slot, a.inputs[slot])
        model.graph.inputs.remove(old)
    KvCacheQuantizationPass("int8", scales=scales_for([0], "per_tensor"))(model)
    assert a.inputs[12] is b.inputs[12] and a.inputs[13] is b.inputs[13]
    assert a.inputs[12] is not a.inputs[13]
    assert b.outputs[1].dtype == ir.DataType.INT8


def test_shared_kv_scale_is_one_tensor_holding_the_max_and_warns_when_far_apart():
    model = gqa_model(layers=2)
    scales = {0: (0.02, 0.03), 1: (0.05, 0.01)}
    with pytest.warns(
        ScalesAdjustedWarning, match=r"in layer\(s\) 1 a scale .* \(up to 5.0x for layer 1's V\)"
    ):
        KvCacheQuantizationPass("fp8", scales=scales, shared_kv_scale=True)(model)
    for node, expected in zip(gqa_nodes(model), (0.03, 0.05)):
        assert node.inputs[12] is node.inputs[13]
        np.testing.assert_allclose(node.inputs[12].const_value.numpy(), [expected])
    assert gqa_nodes(model)[0].inputs[12] is not gqa_nodes(model)[1].inputs[12]


def test_shared_kv_scale_is_quiet_when_the_scales_are_close():
    model = gqa_model()
    KvCacheQuantizationPass("fp8", scales={0: (0.02, 0.03)}, shared_kv_scale=True)(model)  # 1.5x


@pytest.mark.parametrize("fmt", FORMATS)
def test_second_run_is_a_noop_and_new_scales_update(fmt):
    model = gqa_model(layers=2)
    KvCacheQuantizationPass(fmt, scales=scales_for([0, 1], "per_tensor"))(model)
    text = ir.to_onnx_text(model)
    assert not KvCacheQuantizationPass(fmt, scales=scales_for([0, 1], "per_tensor"))(model).modified
    assert not KvCacheQuantizationPass(fmt)(model).modified  # no scales: keep existing, no warning
    assert ir.to_onnx_text(model) == text
    result = KvCacheQuantizationPass(fmt, scales=scales_for([0, 1], "per_tensor", k=0.2))(model)
    assert result.modified
    np.testing.assert_allclose(gqa_nodes(model)[0].inputs[12].const_value.numpy(), [0.2])
    assert len(model.graph.initializers) == 2 + 4  # cos/sin + one scale per cache


@pytest.mark.parametrize(("first", "second"), [("fp8", "int8"), ("int8", "int4"), ("int4", "fp8")])
def test_requantizing_without_scales_needs_constant_ones(first, second):
    """A quantized cache whose scales are graph inputs cannot be retargeted: give scales."""
    model = gqa_model()
    KvCacheQuantizationPass(first, scales=scales_for([0], "per_tensor"))(model)
    node = gqa_nodes(model)[0]
    fed = ir.val("k_scale_input", ir.DataType.FLOAT, [1])
    model.graph.inputs.append(fed)
    node.replace_input_with(12, fed)
    text = ir.to_onnx_text(model)
    with pytest.raises(KvCacheError, match=rf"its key cache is {first} per_tensor, but its k_scale reads"):
        KvCacheQuantizationPass(second)(model)
    assert ir.to_onnx_text(model) == text
    KvCacheQuantizationPass(second, scales=scales_for([0], "per_tensor"))(model)  # given: converts
    assert node.inputs[3].dtype == get_format(second).dtype


def test_fp8_without_scales_uses_unit_scales_and_warns_once():
    model = gqa_model(layers=3)
    with pytest.warns(UnitScalesWarning, match="unit scales") as record:
        Fp8KvCachePass()(model)
    assert len([w for w in record if issubclass(w.category, KvCacheWarning)]) == 1
    for node in gqa_nodes(model):
        np.testing.assert_array_equal(node.inputs[12].const_value.numpy(), [1.0])


@pytest.mark.parametrize("fmt", CPU_FORMATS)
def test_integer_formats_require_scales(fmt):
    model = gqa_model()
    with pytest.raises(KvCacheError, match="needs calibrated scales"):
        KvCacheQuantizationPass(fmt)(model)
    assert gqa_nodes(model)[0].inputs[3].dtype == ir.DataType.FLOAT


def test_missing_layers_are_listed_and_nothing_changes():
    model = gqa_model(layers=4)
    text = ir.to_onnx_text(model)
    with pytest.raises(KvCacheError, match=r"layer\(s\) \[1, 3\]"):
        KvCacheQuantizationPass("fp8", scales=scales_for([0, 2], "per_tensor"))(model)
    assert ir.to_onnx_text(model) == text


@pytest.mark.parametrize("scales", ["per_tensor", "odd"])
def test_wrong_element_count_is_an_error(scales):
    """Per-channel caches need per-channel scales (per-channel scales for a per-tensor cache are
    merged by their max instead: tests/passes/test_kv_cache_quantization_requantize.py)."""
    given = scales_for([0], "per_tensor") if scales == "per_tensor" else {0: ([0.1] * 7, [0.1] * 7)}
    with pytest.raises(KvCacheError, match="element"):
        KvCacheQuantizationPass("int8", "per_channel", given)(gqa_model())


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_invalid_scale_values_are_errors(bad):
    with pytest.raises(KvCacheError, match="finite and > 0"):
        KvCacheQuantizationPass("fp8", scales={0: (bad, 1.0)})(gqa_model())


def test_scales_are_retargeted_between_formats():
    from onnx_kvcache import KvCacheScales

    fp8_scales = KvCacheScales({0: [448.0 / 448]}, {0: [224.0 / 448]}, format="fp8")
    model = gqa_model()
    KvCacheQuantizationPass("int8", scales=fp8_scales)(model)
    np.testing.assert_allclose(gqa_nodes(model)[0].inputs[12].const_value.numpy(), [448.0 / 128])


@pytest.mark.parametrize(
    ("name", "layer"),
    [
        ("past_key_values.3.key", 3),
        ("past_key_12", 12),
        ("model.layers.7.attn.past_key", 7),
        ("cache/layer-5/k", 5),
        ("pkv9k", 9),
        ("past_key", None),
    ],
)
def test_layer_ids_from_names(name, layer):
    assert layer_id_from_name(name) == layer


def test_layer_ids_fall_back_to_node_order():
    model = gqa_model(layers=3, names="cache_{kind}_l{i}")
    model.graph.inputs[3].name = "cache_key_x"  # one name without a number
    ids = [s.layer_id for s in find_gqa_sites(model)]
    assert ids == [0, 1, 2]
    model = gqa_model(layers=3, names="layer{i}_{kind}")
    assert [s.layer_id for s in find_gqa_sites(model)] == [0, 1, 2]


def test_pass_logs_one_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="onnx_kvcache"):
        KvCacheQuantizationPass("int8", scales=scales_for([0, 1], "per_tensor"))(gqa_model(layers=2))
    lines = [r for r in caplog.records if "GroupQueryAttention node(s)" in r.getMessage()]
    assert len(lines) == 1 and "2 GroupQueryAttention" in lines[0].getMessage()


def _function_model() -> ir.Model:
    """The GQA node lives in a model-local function called from the main graph."""
    inner = gqa_model()
    node = gqa_nodes(inner)[0]
    f_inputs = [ir.Value(name=v.name) for v in inner.graph.inputs]
    mapping = dict(zip(inner.graph.inputs, f_inputs))
    cos, sin = node.inputs[7], node.inputs[8]
    c_cos = ir.Node("", "Constant", [], [ir.AttrTensor("value", cos.const_value)], num_outputs=1)
    c_sin = ir.Node("", "Constant", [], [ir.AttrTensor("value", sin.const_value)], num_outputs=1)
    new_inputs = [mapping.get(v, v) if v is not None else None for v in node.inputs]
    new_inputs[7], new_inputs[8] = c_cos.outputs[0], c_sin.outputs[0]
    outs = [ir.Value(name=f"f_out{i}") for i in range(3)]
    f_node = ir.Node(
        "com.microsoft",
        "GroupQueryAttention",
        new_inputs,
        attributes=list(node.attributes.values()),
        outputs=outs,
    )
    f_graph = ir.Graph(
        f_inputs, outs, nodes=[c_cos, c_sin, f_node], opset_imports={"": 21, "com.microsoft": 1}
    )
    function = ir.Function("custom", "Attention", graph=f_graph, attributes={})
    main_inputs = [ir.val(v.name, v.dtype, v.shape) for v in inner.graph.inputs]
    outputs = [ir.val(v.name, v.dtype, v.shape) for v in inner.graph.outputs]
    call = ir.Node("custom", "Attention", main_inputs, outputs=outputs)
    graph = ir.Graph(
        main_inputs, outputs, nodes=[call], opset_imports={"": 21, "com.microsoft": 1, "custom": 1}
    )
    return ir.Model(graph, ir_version=10, functions=[function])


@pytest.mark.parametrize("fmt", CPU_FORMATS)
def test_gqa_in_a_function_converts_and_runs(fmt):
    model = _function_model()
    reference = gqa_model()
    KvCacheQuantizationPass(fmt, scales=scales_for([0], "per_tensor"))(model)
    KvCacheQuantizationPass(fmt, scales=scales_for([0], "per_tensor"))(reference)
    function = next(iter(model.functions.values()))
    node = next(n for n in function if n.op_type == "GroupQueryAttention")
    assert node.inputs[12].producer().op_type == "Constant"
    assert model.graph.inputs[3].dtype == get_format(fmt).dtype
    assert model.graph.outputs[1].dtype == get_format(fmt).dtype
    got = list(run_gqa_steps(create_session(model), reference, [3, 1]))
    want = list(run_gqa_steps(create_session(reference), reference, [3, 1]))
    for (_, a), (_, b) in zip(got, want):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_gqa_in_an_if_subgraph_converts_and_runs():
    flat = gqa_model()
    node = gqa_nodes(flat)[0]

    def branch(name):
        outs = [ir.Value(name=f"{name}_out{i}") for i in range(3)]
        attrs = list(node.attributes.values())
        inner = ir.Node(
            "com.microsoft", "GroupQueryAttention", list(node.inputs), attributes=attrs, outputs=outs
        )
        return ir.Graph([], outs, nodes=[inner], name=name), inner, outs

    then, inner, outs = branch("then")
    orelse, else_node, _ = branch("else")
    cond = ir.val("cond", ir.DataType.BOOL, [])
    results = [ir.val(v.name, v.dtype, v.shape) for v in flat.graph.outputs]
    flat.graph.remove(node)
    flat.graph.outputs.clear()
    if_node = ir.Node(
        "",
        "If",
        [cond],
        attributes=[ir.AttrGraph("then_branch", then), ir.AttrGraph("else_branch", orelse)],
        outputs=results,
    )
    flat.graph.append(if_node)
    flat.graph.outputs.extend(results)
    flat.graph.inputs.append(cond)
    KvCacheQuantizationPass("int8", scales=scales_for([0], "per_tensor"))(flat)
    assert inner.attributes["k_quant_type"].as_string() == "PER_TENSOR"
    assert else_node.attributes["k_quant_type"].as_string() == "PER_TENSOR"
    assert results[1].dtype == ir.DataType.INT8 and outs[1].dtype == ir.DataType.INT8
    session = create_session(flat)
    feeds = {
        "query.0": np.ones((1, 2, 64), np.float32),
        "key.0": np.ones((1, 2, 32), np.float32),
        "value.0": np.ones((1, 2, 32), np.float32),
        "past_key_values.0.key": np.zeros((1, 2, 0, 16), np.int8),
        "past_key_values.0.value": np.zeros((1, 2, 0, 16), np.int8),
        "seqlens_k": np.array([1], np.int32),
        "total_sequence_length": np.array(2, np.int32),
        "cond": np.array(True),
    }
    _, present_k, _ = session.run(None, feeds)
    assert present_k.dtype == np.int8 and present_k.shape == (1, 2, 2, 16)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_graph_type_checks_in_onnxruntime(granularity):
    ort = pytest.importorskip("onnxruntime")
    model = gqa_model(dtype=ir.DataType.FLOAT16)
    KvCacheQuantizationPass("fp8", granularity, scales_for([0], granularity))(model)
    with pytest.raises(Exception, match=r"NOT_IMPLEMENTED.*GroupQueryAttention") as info:
        create_session(model)
    assert isinstance(info.value, ort.capi.onnxruntime_pybind11_state.NotImplemented)


def test_fp8_model_serializes_and_reloads_unchanged(tmp_path):
    model = gqa_model(layers=2)
    Fp8KvCachePass(scales_for([0, 1], "per_tensor"))(model)
    ir.save(model, tmp_path / "m.onnx")
    again = ir.load(tmp_path / "m.onnx")
    assert ir.to_onnx_text(again) == ir.to_onnx_text(model)
    assert again.graph.inputs[3].dtype == ir.DataType.FLOAT8E4M3FN


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT, ir.DataType.FLOAT16])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", CPU_FORMATS)
def test_cpu_kernel_matches_quantized_reference(fmt, granularity, dtype, interleaved):
    """int8/int4 on onnxruntime CPU == quantize-store-dequantize attention, over decode."""
    model = gqa_model(dtype=dtype, interleaved=interleaved, head=HEAD, kv_heads=KV)
    rng = np.random.default_rng(7)
    n = 1 if granularity == "per_tensor" else KV * HEAD
    row = get_format(fmt)
    k_scale = (rng.uniform(2.5, 4.0, n) / row.qmax).astype(np.float32)
    v_scale = (rng.uniform(2.5, 4.0, n) / row.qmax).astype(np.float32)
    KvCacheQuantizationPass(fmt, granularity, {0: (k_scale, v_scale)})(model)
    session = create_session(model)
    tol = 4e-3 if dtype == ir.DataType.FLOAT16 else 2e-5
    for feeds, (out, present_k, present_v) in run_gqa_steps(session, model, [5, 1, 1, 1]):
        _, want_k, want_v = reference_step(model, feeds, row, k_scale, v_scale)
        assert present_k.dtype == row.numpy_dtype() and present_k.shape == want_k.shape
        # What is stored: the reference's codes, but for rare ties at .5 (fp16, RoPE order).
        for got, want, scale in ((present_k, want_k, k_scale), (present_v, want_v, v_scale)):
            s4 = scale.reshape(-1, 1) if n == 1 else scale.reshape(1, KV, 1, HEAD)
            levels = np.abs(row.dequantize(got, s4, HEAD) - row.dequantize(want, s4, HEAD)) / s4
            assert levels.max() <= 1.0001
            assert np.mean(levels > 0.5) < (0.05 if dtype == ir.DataType.FLOAT16 else 0.01)
        # What is read: attention over the stored cache, dequantized, current tokens included.
        want, _, _ = reference_step(model, feeds, row, k_scale, v_scale, stored=(present_k, present_v))
        np.testing.assert_allclose(out.astype(np.float32), want, atol=tol, rtol=tol)


def _kv_sharing_model() -> ir.Model:
    """Layer 1 reads layer 0's present as its past (cross-layer KV sharing)."""
    model = gqa_model(layers=2)
    a, b = gqa_nodes(model)
    for slot, out in ((3, 1), (4, 2)):
        old = b.inputs[slot]
        b.replace_input_with(slot, a.outputs[out])
        model.graph.inputs.remove(old)
    return model


@pytest.mark.parametrize("fmt", CPU_FORMATS)
def test_a_node_reading_another_nodes_present_converts_with_it(fmt):
    model = _kv_sharing_model()
    a, b = gqa_nodes(model)
    assert [s.layer_id for s in find_gqa_sites(model)] == [0, 0]
    KvCacheQuantizationPass(fmt, scales=scales_for([0], "per_tensor"))(model)
    assert a.inputs[12] is b.inputs[12] and b.attributes["k_quant_type"].as_string() == "PER_TENSOR"
    assert b.inputs[3].dtype == b.outputs[1].dtype == get_format(fmt).dtype
    feeds = {
        "query.0": np.ones((1, 2, 64), np.float32),
        "key.0": np.ones((1, 2, 32), np.float32),
        "value.0": np.ones((1, 2, 32), np.float32),
        "query.1": np.ones((1, 2, 64), np.float32),
        "key.1": np.ones((1, 2, 32), np.float32),
        "value.1": np.ones((1, 2, 32), np.float32),
        "past_key_values.0.key": np.zeros(
            (1, 2, 0, get_format(fmt).packed_dim(16)), get_format(fmt).numpy_dtype()
        ),
        "past_key_values.0.value": np.zeros(
            (1, 2, 0, get_format(fmt).packed_dim(16)), get_format(fmt).numpy_dtype()
        ),
        "seqlens_k": np.array([1], np.int32),
        "total_sequence_length": np.array(2, np.int32),
    }
    create_session(model).run(None, feeds)  # type-checks and runs


def test_a_present_read_by_another_op_skips_the_whole_group():
    model = _kv_sharing_model()
    a = gqa_nodes(model)[0]
    tap = ir.Node("", "Identity", [a.outputs[1]], num_outputs=1, name="tap")
    model.graph.append(tap)
    model.graph.outputs.append(tap.outputs[0])
    text = ir.to_onnx_text(model)
    with pytest.warns(SkippedNodeWarning, match=r"gqa\.0, gqa\.1.*read by Identity node 'tap'"):
        result = KvCacheQuantizationPass("int8", scales=scales_for([0], "per_tensor"))(model)
    assert not result.modified and ir.to_onnx_text(model) == text


def test_malformed_gqa_node_is_a_clear_error():
    model = gqa_model()
    node = gqa_nodes(model)[0]
    del node.attributes["kv_num_heads"]
    with pytest.raises(KvCacheError, match="lacks num_heads or kv_num_heads"):
        KvCacheQuantizationPass("fp8")(model)


def test_unknown_head_size_asks_for_shape_inference():
    model = gqa_model()
    for value in model.graph.inputs:
        value.shape = None
    with pytest.raises(KvCacheError, match="Run shape inference"):
        KvCacheQuantizationPass("int8", "per_channel", scales_for([0], "per_channel"))(model)


def test_an_unrelated_initializer_with_the_scale_name_is_left_alone():
    model = gqa_model()
    taken = ir.Value(name="past_key_values.0.key_scale", const_value=ir.tensor(np.array([7.0], np.float32)))
    model.graph.register_initializer(taken)
    user = ir.Node("", "Identity", [taken], num_outputs=1, name="reader")
    model.graph.append(user)
    model.graph.outputs.append(user.outputs[0])
    KvCacheQuantizationPass("int8", scales=scales_for([0], "per_tensor"))(model)
    node = gqa_nodes(model)[0]
    assert taken.const_value.numpy().tolist() == [7.0] and node.inputs[12] is not taken
    assert node.inputs[12].name == "past_key_values.0.key_scale_1"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_symbolic_head_dimension_becomes_the_static_packed_size(fmt):
    """onnxruntime-genai allocates caches from the declared shape: int4 must say 16, not kv_cache_dim."""
    from onnx_kvcache.models.decoder import build_decoder

    model = build_decoder(num_layers=2, head_size=32, symbolic_cache_dim=True)
    KvCacheQuantizationPass(fmt, scales=scales_for([0, 1], "per_tensor"))(model)
    caches = [v for v in (*model.graph.inputs, *model.graph.outputs) if "key" in v.name or "value" in v.name]
    assert len(caches) == 8
    want = 16 if fmt == "int4" else "kv_cache_dim"
    assert {v.shape[3] if isinstance(v.shape[3], int) else str(v.shape[3]) for v in caches} == {want}


def test_a_past_read_by_another_op_skips_the_node_and_the_model_still_loads():
    model = gqa_model()
    past = model.graph.inputs[3]
    assert past.name == "past_key_values.0.key"
    tap = ir.Node("", "Mul", [past, past], num_outputs=1, name="double")
    model.graph.append(tap)
    model.graph.outputs.append(tap.outputs[0])
    text = ir.to_onnx_text(model)
    with pytest.warns(
        SkippedNodeWarning, match=r"past cache 'past_key_values\.0\.key' is also read by Mul node 'double'"
    ):
        result = KvCacheQuantizationPass("int8", scales=scales_for([0], "per_tensor"))(model)
    assert not result.modified and ir.to_onnx_text(model) == text
    create_session(model)


READERS = {  # Shape/Size of a past [1, 2, 5, 16]: what each gives, in every format
    "length": ("Shape", {"start": 2, "end": 3}, [5]),
    "leading": ("Shape", {"end": -1}, [1, 2, 5]),
    "whole": ("Shape", {}, [1, 2, 5, 16]),
    "from_length": ("Shape", {"start": 2}, [5, 16]),
    "head": ("Shape", {"start": -1}, [16]),
    "empty": ("Shape", {"start": 3, "end": 1}, []),
    "size": ("Size", {}, 1 * 2 * 5 * 16),
}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("side", ["past", "present"])
def test_shape_and_size_readers_convert_and_still_see_the_head_size(reader, fmt, side):
    """Issue 28, part 4: readers of the dimensions never keep a cache float; int4 packs the head
    dimension, and what such a reader gives is unchanged (run on onnxruntime's CPU kernel)."""
    op_type, attrs, want = READERS[reader]
    model = gqa_model()
    cache = model.graph.inputs[3] if side == "past" else model.graph.outputs[1]
    assert cache.name == ("past_key_values.0.key" if side == "past" else "present.0.key")
    tap = ir.Node("", op_type, [cache], attributes=ir.convenience.convert_attributes(attrs), name="tap")
    model.graph.append(tap)
    model.graph.outputs.append(tap.outputs[0])
    tap.outputs[0].name = "dims"
    assert KvCacheQuantizationPass(fmt, scales=scales_for([0], "per_tensor"))(model).modified
    past = model.graph.inputs[3]
    assert past.dtype == (ir.DataType.UINT8 if fmt == "int4" else ir.DataType.INT8)
    packed = fmt == "int4"
    feeds = {
        "query.0": np.zeros((1, 1, 64), np.float32),
        "key.0": np.zeros((1, 1, 32), np.float32),
        "value.0": np.zeros((1, 1, 32), np.float32),
        "past_key_values.0.key": np.zeros(
            (1, 2, 4 if side == "present" else 5, 8 if packed else 16), past.dtype.numpy()
        ),
        "past_key_values.0.value": np.zeros(
            (1, 2, 4 if side == "present" else 5, 8 if packed else 16), past.dtype.numpy()
        ),
        "seqlens_k": np.array([4 if side == "present" else 5], np.int32),
        "total_sequence_length": np.array(5 if side == "present" else 6, np.int32),
    }
    (dims,) = create_session(model).run(["dims"], feeds)
    assert np.asarray(dims).tolist() == want
    rewritten = packed and reader not in ("length", "leading", "empty")  # int4 and the head seen
    assert (tap.graph is None) == rewritten


def test_a_graph_input_named_like_a_scale_keeps_its_name():
    model = gqa_model()
    taken = ir.val("past_key_values.0.key_scale", ir.DataType.FLOAT, [1])
    model.graph.inputs.append(taken)
    KvCacheQuantizationPass("int8", scales=scales_for([0], "per_tensor"))(model)
    node = gqa_nodes(model)[0]
    assert node.inputs[12] is not taken and node.inputs[12].name == "past_key_values.0.key_scale_1"
    names = [v.name for v in (*model.graph.inputs, *model.graph.initializers.values())]
    assert len(names) == len(set(names))


def test_a_scale_file_is_read_once_when_the_pass_is_made(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"scales": {"k_scales": [0.1], "v_scales": [0.2]}, "qmax": 128}')
    convert = KvCacheQuantizationPass("int8", scales=path)
    path.unlink()  # a PassManager may run the pass again: it does not reread the file
    assert convert(gqa_model()).modified and convert(gqa_model()).modified
    with pytest.raises(KvCacheError, match="is missing"):
        KvCacheQuantizationPass("int8", scales=path)


@pytest.mark.parametrize(("fmt", "ir_version"), [("fp8", 9), ("int8", 8), ("int4", 8)])
def test_a_float8_cache_raises_the_ir_version_to_9(fmt, ir_version):
    """Float8 is an IR 9 type: an IR 8 model (TorchScript exports) declaring it must say 9."""
    import onnx

    model = gqa_model()
    model.ir_version = 8
    KvCacheQuantizationPass(fmt, scales={0: (0.05, 0.05)})(model)
    assert model.ir_version == ir_version
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


PRODUCERS = __import__("pathlib").Path(__file__).parents[1] / "data" / "producers" / "mobius"


@pytest.mark.parametrize("form", ["mobius-cpu-gqa", "mobius-cuda-f16"])
def test_a_packed_cache_of_a_graph_without_value_info_still_tells_its_head_size(tmp_path, form):
    """mobius writes no value_info: the head size was only on the cache's last dimension, which
    int4 packs. The converted model still tells it (the query's width), so the runner, evaluate
    and a requantization read it; onnxruntime and onnx.checker take the model."""
    import onnx

    from onnx_kvcache import KvCacheRunner

    model = ir.load(PRODUCERS / form / "llama" / "model.onnx")
    KvCacheQuantizationPass("int4", "per_tensor", {0: (0.2, 0.2), 1: (0.2, 0.2)})(model)
    assert all(site.head_size() == 16 for site in find_gqa_sites(model))
    path = tmp_path / "model.int4.onnx"
    ir.save(model, path, external_data="model.int4.onnx.data")
    onnx.checker.check_model(str(path), full_check=True)
    assert len(KvCacheRunner(path).generate([1, 72, 101, 108], 3)) == 3
    KvCacheQuantizationPass("int8", "per_tensor")(model)  # its own scales, unpacked: head size 16 again
    assert {v.shape[3] for v in model.graph.inputs if v.name.startswith("past_key_values")} == {16}
