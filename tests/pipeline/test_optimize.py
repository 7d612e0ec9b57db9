"""optimize_model: fusion policy, gating with warnings or errors, and pass-manager use."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from exported_attention import exported_decoder
from onnx_kvcache import Fp8KvCachePass, GqaFusionPass, KvCacheError, KvCacheWarning, optimize_model
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.errors import (
    Float16AttentionWarning,
    KvCacheTypeError,
    NotConvertedWarning,
    ScalesAdjustedWarning,
)

from conftest import gqa_model, gqa_nodes

SCALES = {0: (0.1, 0.2)}


def quant_type(model):
    node = gqa_nodes(model)[0]
    attr = node.attributes.get("k_quant_type")
    return attr.as_string() if attr else "NONE"


def test_fp8_on_cuda_for_a_fp16_model():
    model = gqa_model(dtype=ir.DataType.FLOAT16)
    out = optimize_model(model, fp8_kv_cache=True, scales=SCALES)
    assert out is model and quant_type(model) == "PER_TENSOR"
    assert model.graph.inputs[3].dtype == ir.DataType.FLOAT8E4M3FN


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (
            {"ep": "dml", "format": "int8"},
            "no GroupQueryAttention kernel for an int8",
        ),
        ({"ep": "cpu", "fp8_kv_cache": True}, "no GroupQueryAttention kernel for an fp8"),
        ({"ep": "webgpu", "format": "int8"}, "no GroupQueryAttention kernel"),
    ],
)
def test_declines_with_one_warning_or_raises_when_strict(kwargs, reason):
    model = gqa_model()
    with pytest.warns(KvCacheWarning, match=reason) as record:
        optimize_model(model, scales=SCALES, **kwargs)
    assert len(record) == 1 and quant_type(model) == "NONE"
    with pytest.raises(KvCacheError, match=reason):
        optimize_model(model, scales=SCALES, strict=True, **kwargs)
    assert quant_type(model) == "NONE"


@pytest.mark.parametrize("provider", ["cuda", "auto"])
def test_fp8_for_a_float32_model_computes_its_attention_in_float16(provider):
    model = gqa_model()
    weights = dict(model.graph.initializers)
    with pytest.warns(Float16AttentionWarning, match="weights and every other node stay float32") as said:
        optimize_model(model, fp8_kv_cache=True, scales=SCALES, ep=provider, strict=True)
    assert len([w for w in said if w.category is Float16AttentionWarning]) == 1
    assert quant_type(model) == "PER_TENSOR" and model.graph.inputs[3].dtype == ir.DataType.FLOAT8E4M3FN
    gqa = gqa_nodes(model)[0]
    assert gqa.inputs[0].dtype == ir.DataType.FLOAT16 and gqa.inputs[0].producer().op_type == "Cast"
    assert dict(model.graph.initializers).keys() - weights.keys() == {
        "past_key_values.0.key_scale",
        "past_key_values.0.value_scale",
    }


def test_fp8_that_converts_nothing_is_seen_in_the_model_or_raised_with_strict():
    """The docstring's advice: a model returned as it was is told by its cache, or by strict."""
    model = gqa_model()
    with pytest.warns(NotConvertedWarning):
        optimize_model(model, fp8_kv_cache=True, ep="cpu")
    assert not any(s.cache_format for s in find_attention_sites(model))
    with pytest.raises(KvCacheError, match="fp8"):
        optimize_model(model, fp8_kv_cache=True, ep="cpu", strict=True)


def test_check_device_without_gpu_declines():
    from onnx_kvcache.capabilities.device import cuda_compute_capability

    if cuda_compute_capability() is not None:
        pytest.skip("this machine has a GPU")
    model = gqa_model(dtype=ir.DataType.FLOAT16)
    with pytest.raises(KvCacheError, match="no CUDA GPU"):
        optimize_model(model, fp8_kv_cache=True, scales=SCALES, check_device=True, strict=True)


def test_accepts_proto_and_path_and_scale_file(tmp_path):
    model = gqa_model()
    path = tmp_path / "m.onnx"
    ir.save(model, path)
    scales = tmp_path / "s.json"
    scales.write_text('{"scales": {"k_scales": [0.1], "v_scales": [0.2]}}')
    from_path = optimize_model(path, ep="cpu", format="int8", scales=scales)
    from_proto = optimize_model(onnx.load(path), ep="cpu", format="int4", scales=SCALES)
    assert isinstance(from_path, ir.Model) and from_path.graph.inputs[3].dtype == ir.DataType.INT8
    assert from_proto.graph.inputs[3].dtype == ir.DataType.UINT8


def test_fusion_auto_runs_only_without_gqa(caplog):
    with caplog.at_level(logging.INFO, logger="onnx_kvcache"):
        optimize_model(gqa_model(), ep="cpu", format="int8", scales=SCALES)
    assert not any("GroupQueryAttention nodes" in r.getMessage() for r in caplog.records)
    caplog.clear()
    graph = ir.Graph([ir.val("x", ir.DataType.FLOAT, [2])], [], nodes=[], opset_imports={"": 21})
    y = ir.Node("", "Relu", [graph.inputs[0]], num_outputs=1, name="relu")
    graph.append(y)
    graph.outputs.append(y.outputs[0])
    plain = ir.Model(graph, ir_version=10)
    with (
        caplog.at_level(logging.INFO, logger="onnx_kvcache"),
        pytest.warns(KvCacheWarning, match="no GroupQueryAttention"),
    ):
        optimize_model(plain, fp8_kv_cache=True)
    assert any("GroupQueryAttention nodes 0 -> 0" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="onnx_kvcache"):
        optimize_model(gqa_model(), fuse_attention=True)
    assert any("GroupQueryAttention nodes" in r.getMessage() for r in caplog.records)


def test_pass_manager_chains_fusion_then_fp8():
    model = gqa_model(dtype=ir.DataType.FLOAT16, layers=2)
    manager = ir.passes.PassManager([GqaFusionPass(), Fp8KvCachePass({0: (0.1, 0.2), 1: (0.3, 0.4)})])
    result = manager(model)
    assert result.modified and quant_type(result.model) == "PER_TENSOR"
    values = [
        n.inputs[12].const_value.numpy() for n in result.model.graph if n.op_type == "GroupQueryAttention"
    ]
    np.testing.assert_allclose(np.concatenate(values), [0.1, 0.3])


def test_without_format_only_fuses():
    model = gqa_model()
    assert optimize_model(model) is model and quant_type(model) == "NONE"


def count_gqa(model):
    """GroupQueryAttention sites: a node wrapped for the CPU (its prompt in float) counts once."""
    return len(gqa_nodes(model))


def exported_feeds():
    ids = np.array([[3, 1, 4, 1, 5]])
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.arange(5)[None],
        "past_key_values.0.key": np.zeros((1, 2, 0, 16), np.float32),
        "past_key_values.0.value": np.zeros((1, 2, 0, 16), np.float32),
    }


def test_auto_fusion_turns_an_export_into_a_quantized_gqa():
    from onnx_kvcache.model_io._sessions import create_session

    model = exported_decoder()
    want = create_session(model).run(None, exported_feeds())[0]
    assert count_gqa(model) == 0
    optimize_model(model, ep="cpu", format="int8", scales={0: (0.05, 0.05)})
    assert count_gqa(model) == 1 and quant_type(model) == "PER_TENSOR"
    feeds = exported_feeds()
    feeds["past_key_values.0.key"] = feeds["past_key_values.0.key"].astype(np.int8)
    feeds["past_key_values.0.value"] = feeds["past_key_values.0.value"].astype(np.int8)
    logits, present_k, _ = create_session(model).run(None, feeds)
    assert present_k.dtype == np.int8
    np.testing.assert_allclose(logits, want, atol=0.1 * np.abs(want).max())


def test_fusion_off_leaves_an_export_unconverted():
    model = exported_decoder()
    with pytest.warns(KvCacheWarning, match="no GroupQueryAttention"):
        optimize_model(
            model,
            ep="cpu",
            format="int8",
            scales=SCALES,
            fuse_attention=False,
        )
    assert count_gqa(model) == 0


def test_pass_manager_fuses_an_export_then_quantizes():
    from onnx_kvcache import KvCacheQuantizationPass

    model = exported_decoder()
    result = ir.passes.PassManager(
        [
            GqaFusionPass(),
            KvCacheQuantizationPass("int4", "per_channel", {0: (np.full(32, 0.3), np.full(32, 0.2))}),
        ]
    )(model)
    assert result.modified and count_gqa(result.model) == 1
    assert result.model.graph.inputs[3].dtype == ir.DataType.UINT8
    assert result.model.graph.inputs[3].shape[3] == 8


def test_a_refusal_is_a_not_converted_warning():
    from onnx_kvcache import optimize_model
    from onnx_kvcache.errors import NotConvertedWarning

    from builders.exported import build_decoder

    model = build_decoder(num_layers=1, dtype="float16")
    with pytest.warns(NotConvertedWarning, match="KV cache not converted to fp8 per_tensor for cpu"):
        assert optimize_model(model, ep="cpu", fp8_kv_cache=True) is model


def test_gqa_fusion_reports_modified_honestly():
    """modified is whether a fusion changed the model: not for a model already fused."""
    model = gqa_model()
    assert not GqaFusionPass()(model).modified  # nothing to fuse, nothing changed
    export = exported_decoder()
    assert GqaFusionPass()(export).modified and count_gqa(export) == 1
    assert not GqaFusionPass()(export).modified


def test_granularity_defaults_to_the_one_the_scales_record():
    from onnx_kvcache import KvCacheQuantizationPass, KvCacheScales

    head = gqa_model().graph.inputs[3].shape[3]
    per_channel = KvCacheScales.from_mapping(
        {0: (np.full(2 * head, 0.1), np.full(2 * head, 0.2))}, granularity="per_channel"
    )
    assert KvCacheQuantizationPass("int8", scales=per_channel).granularity == "per_channel"
    assert KvCacheQuantizationPass("int8").granularity is None  # the model's own, else per tensor
    assert KvCacheQuantizationPass("int8", "per_tensor", per_channel).granularity == "per_tensor"  # max
    per_tensor = KvCacheScales.from_mapping({0: (0.1, 0.2)}, granularity="per_tensor")
    with pytest.raises(KvCacheError, match=r"scales are per_tensor .* not per_channel"):
        KvCacheQuantizationPass("int8", "per_channel", per_tensor)  # coarser for finer: refused
    model = optimize_model(gqa_model(), ep="cpu", format="int8", scales=per_channel)
    assert quant_type(model) == "PER_CHANNEL"
    with pytest.warns(ScalesAdjustedWarning, match="merged into one per tensor, their max"):
        model = optimize_model(
            gqa_model(),
            format="int8",
            granularity="per_tensor",
            scales=per_channel,
        )
    assert quant_type(model) == "PER_TENSOR"


def test_a_failed_call_leaves_the_model_as_it_was():
    """A refusal or an error after fusing: the caller's model is not fused either."""
    from builders.exported import build_decoder, exported_config

    export = build_decoder(exported_config("llama", num_layers=2, vocab_size=300))
    text = ir.to_onnx_text(export)
    with pytest.raises(KvCacheError, match=r"needs calibrated scales.*Pass scales=PATH"):
        optimize_model(export, format="int8")
    assert ir.to_onnx_text(export) == text
    scales = {0: (0.05, 0.05), 1: (0.05, 0.05)}
    with pytest.warns(
        NotConvertedWarning, match=r"^KV cache not converted to int8 per_tensor for webgpu: "
    ) as said:
        optimize_model(export, ep="webgpu", format="int8", scales=scales)
    assert ir.to_onnx_text(export) == text and len(said) == 1  # nothing about a fusion not kept
    optimize_model(export, ep="webgpu")  # the float attention runs there: fused
    assert count_gqa(export) == 2


def test_scales_that_record_no_granularity_fit_the_model(tmp_path):
    """onnxruntime-genai's scale files say no granularity: the sizes decide, per model."""
    from onnx_kvcache import KvCacheQuantizationPass

    head = gqa_model().graph.inputs[3].shape[3]
    genai_file = tmp_path / "scales.json"
    genai_file.write_text(
        json.dumps({"scales": {"k_scales": [[0.1] * 2 * head], "v_scales": [[0.2] * 2 * head]}})
    )
    quantize = KvCacheQuantizationPass("int8", scales=genai_file)
    assert quantize.granularity is None
    model = gqa_model()
    quantize(model)
    assert quant_type(model) == "PER_CHANNEL"
    model = optimize_model(gqa_model(), ep="cpu", format="int8", scales=genai_file)
    assert quant_type(model) == "PER_CHANNEL"
    with pytest.warns(
        ScalesAdjustedWarning, match="merged into one per tensor, their max"
    ):  # as a node's own
        model = optimize_model(gqa_model(), format="int8", granularity="per_tensor", scales=genai_file)
    assert quant_type(model) == "PER_TENSOR"


def test_cache_options_without_a_format():
    """Scales name their format, as in convert; other cache options need one."""
    from onnx_kvcache import KvCacheScales

    int8 = KvCacheScales.from_mapping({0: (0.1, 0.2)}, format="int8")
    model = optimize_model(gqa_model(), ep="cpu", scales=int8)
    assert model.graph.inputs[3].dtype == ir.DataType.INT8
    with pytest.raises(KvCacheError, match="record no format: name it"):
        optimize_model(gqa_model(), scales={0: (0.1, 0.2)})
    with pytest.raises(
        KvCacheError, match=r"^granularity='per_channel' applies to a quantized cache: .* drop it\.$"
    ):
        optimize_model(gqa_model(), granularity="per_channel")  # names what was given, nothing else
    with pytest.raises(KvCacheError, match=r"^shared_kv_scale=True applies to a quantized cache"):
        optimize_model(gqa_model(), shared_kv_scale=True)
    with pytest.raises(KvCacheError, match="ep must name a provider"):
        optimize_model(gqa_model(), ep="", scales=int8)
    for wrong in (
        dict(ep=123),
        dict(fuse_attention=None),
    ):  # a wrong type is a TypeError, as in convert_model
        with pytest.raises(KvCacheTypeError, match=r"^(ep|fuse_attention) must be .*, got (int|NoneType)"):
            optimize_model(gqa_model(), scales=int8, **wrong)


def test_scales_that_fit_no_granularity_name_the_layer():
    head = gqa_model(layers=2).graph.inputs[3].shape[3]
    odd = {0: (0.1, 0.2), 1: (np.full(3, 0.1), np.full(3, 0.2))}
    with pytest.raises(KvCacheError, match=r"scales of layer 1 have 3 element\(s\) per cache, which fits no"):
        optimize_model(gqa_model(layers=2), ep="cpu", format="int8", scales=odd)
    mixed = {0: (0.1, 0.2), 1: (np.full(2 * head, 0.1), np.full(2 * head, 0.2))}
    with pytest.raises(
        KvCacheError, match=r"fit different granularities \(\{0: 'per_tensor', 1: 'per_channel'\}\)"
    ):
        optimize_model(gqa_model(layers=2), ep="cpu", format="int8", scales=mixed)


def half_guarded_fp16_export(layers_spoiled: int = 1) -> ir.Model:
    """A float16 optimum-llama export whose first layers' NaN guards fill 0.5: unfusable."""
    from builders.exported import build_decoder, exported_config

    model = build_decoder(exported_config("optimum-llama", num_layers=2, dtype="float16"))
    guards = [n for n in model.graph if n.op_type == "Where" and n.inputs[0].producer().op_type == "IsNaN"]
    for i, node in enumerate(guards[:layers_spoiled]):
        half = ir.Value(
            name=f"half_fill_{i}",
            type=ir.TensorType(ir.DataType.FLOAT16),
            shape=ir.Shape([1]),
            const_value=ir.tensor(np.array([0.5], np.float16), name=f"half_fill_{i}"),
        )
        model.graph.register_initializer(half)
        node.replace_input_with(1, half)
    return model


def bidirectional_export() -> ir.Model:
    from builders.exported import ExportStyle, build_decoder, exported_config

    config = exported_config(
        "llama", num_layers=2, vocab_size=300, exported=ExportStyle(opset=20, mask="bidirectional")
    )
    return build_decoder(config)


@pytest.mark.parametrize(
    ("make", "kwargs", "reason"),
    [
        (half_guarded_fp16_export, {"fp8_kv_cache": True}, r"fused 1 layer\(s\) but left 1 unfused"),
        (
            half_guarded_fp16_export,
            {"format": "int8", "scales": {0: (0.05, 0.05), 1: (0.05, 0.05)}},
            r"fused 1 layer\(s\) but left 1 unfused",
        ),
        (
            bidirectional_export,
            {
                "ep": "cpu",
                "format": "int8",
                "scales": {0: (0.1, 0.1), 1: (0.1, 0.1)},
            },
            r"fused nothing: 2 attention node\(s\) not provably .*the mask .*is not causal",
        ),
    ],
    ids=["partial_fp8", "partial_int8_scales", "bidirectional_int8"],
)
def test_an_unfused_layer_converts_nothing(make, kwargs, reason):
    """All or nothing, as convert: a layer fusion leaves is a refusal saying why, model as it was."""
    model = make()
    text = ir.to_onnx_text(model)
    with pytest.warns(
        NotConvertedWarning, match=rf"^KV cache not converted: attention fusion {reason}"
    ) as said:
        optimize_model(model, **kwargs)
    assert ir.to_onnx_text(model) == text
    assert not any("scales cover" in str(w.message) or "has no GroupQuery" in str(w.message) for w in said)
    with pytest.raises(KvCacheError, match=reason):
        optimize_model(make(), strict=True, **kwargs)


def test_a_model_read_with_a_data_file_is_saved_elsewhere_as_the_readme_says(tmp_path):
    """README: saved elsewhere without external_data= the model names the original data file and
    loads nowhere else; with it the weights are written beside the new model."""
    import pathlib
    import shutil

    import onnxruntime as ort

    producer = (
        pathlib.Path(__file__).parents[1] / "data" / "producers" / "mobius" / "mobius-default" / "llama"
    )
    shutil.copytree(producer, tmp_path / "in")
    scales = {0: (0.02, 0.02), 1: (0.02, 0.02)}
    with pytest.warns(KvCacheWarning):  # the export's padding assumption
        model = optimize_model(str(tmp_path / "in" / "model.onnx"), format="int8", scales=scales)
    (tmp_path / "out").mkdir()
    ir.save(model, tmp_path / "out" / "bare.onnx")
    with pytest.raises(Exception, match="External data path does not exist"):
        ort.InferenceSession(str(tmp_path / "out" / "bare.onnx"))
    ir.save(model, tmp_path / "out" / "m.onnx", external_data="m.onnx.data")
    assert (tmp_path / "out" / "m.onnx.data").stat().st_size > 200_000
    ort.InferenceSession(str(tmp_path / "out" / "m.onnx"))
