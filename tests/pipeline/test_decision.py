"""The decision pipeline: fused, unfused, refused and strict requests; the target; gating's codes."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, check_kv_cache_support
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.capabilities.refusals import Parameter, RefusalCode
from onnx_kvcache.errors import (
    Float16AttentionWarning,
    FusionSkippedWarning,
    NotConvertedWarning,
    SkippedNodeWarning,
)
from onnx_kvcache.pipeline import decision as pipeline
from onnx_kvcache.pipeline.decision import Entry, Request, carry_out, decide, fuse_unless_attention
from onnx_kvcache.scales.files import as_kv_cache_scales

from builders.exported import ExportStyle, build_decoder, exported_config
from conftest import gqa_model

SCALES = as_kv_cache_scales({0: (0.1, 0.2)})


def export(mask: str = "causal") -> ir.Model:
    """A float32 llama export without attention nodes (two layers)."""
    return build_decoder(exported_config("llama", num_layers=2, exported=ExportStyle(opset=20, mask=mask)))


def codes(decision) -> list[RefusalCode]:
    return [r.code for r in decision.refusals]


def cache_dtype(model: ir.Model) -> ir.DataType:
    return next(v for v in model.graph.inputs if "past_key" in (v.name or "")).dtype


@pytest.mark.parametrize("entry", list(Entry))
def test_a_model_with_attention_is_not_fused_and_its_target_is_inferred(entry):
    model = gqa_model()
    decision = decide(Request(model, entry, "int8", scales=SCALES))
    assert not decision.fusion.ran and decision.model is model and decision.converted
    assert (decision.target, decision.why) == ("cpu", "a float32 model")
    assert (decision.format.name, decision.granularity.name) == ("int8", "per_tensor")
    assert carry_out(decision) and cache_dtype(model) == ir.DataType.INT8


def test_convert_takes_the_targets_first_format_and_optimize_none():
    convert = decide(Request(gqa_model(), Entry.CONVERT, scales=SCALES, target="cpu"))
    assert convert.format.name == "int8" and convert.why == ""  # given: nothing inferred
    model = gqa_model()
    optimize = decide(Request(model, Entry.OPTIMIZE, target="cpu"))
    assert optimize.format is None and optimize.converted
    assert carry_out(optimize) and cache_dtype(model) == ir.DataType.FLOAT


@pytest.mark.parametrize(("entry", "in_copy"), [(Entry.CONVERT, False), (Entry.OPTIMIZE, True)])
def test_an_export_is_fused_first_and_its_warnings_wait(entry, in_copy, recwarn):
    model = export()
    scales = as_kv_cache_scales({0: (0.1, 0.2), 1: (0.1, 0.2)})
    decision = decide(Request(model, entry, "int8", scales=scales, target="cpu"))
    assert decision.fusion.ran and decision.fusion.fused == 2 and decision.fusion.refusal is None
    assert (decision.model is not model) == in_copy
    assert decision.fusion.recorded and not recwarn.list  # the padding fact waits for the conversion
    assert decision.converted and carry_out(decision)
    assert cache_dtype(decision.model) == ir.DataType.INT8
    assert [str(w.message) for w in recwarn] == [str(w.message) for w in decision.fusion.recorded]


def test_fuse_unless_attention_leaves_a_model_with_attention_alone():
    model = gqa_model()
    text = ir.to_onnx_text(model)
    fusion = fuse_unless_attention(model)
    assert fusion.had_attention and not fusion.ran and fusion.model is model
    assert ir.to_onnx_text(model) == text
    assert not fuse_unless_attention(export(), when=False).ran
    copy = export()
    fused = fuse_unless_attention(copy, in_copy=True)
    assert fused.model is not copy and fused.modified and fused.fused == 2
    assert not fuse_unless_attention(copy).had_attention  # the copy was fused, not the model


@pytest.mark.parametrize("entry", list(Entry))
def test_an_unfused_layer_refuses_a_conversion(entry):
    decision = decide(Request(export("bidirectional"), entry, "int8", target="cpu"))
    assert codes(decision) == [RefusalCode.ATTENTION_UNFUSED]
    assert decision.refusals[0].parameter is None
    head = {Entry.CONVERT: "Not converted: ", Entry.OPTIMIZE: "KV cache not converted: "}[entry]
    assert decision.message.startswith(head + "attention fusion fused nothing")
    with pytest.warns(NotConvertedWarning, match="fused nothing"):
        assert not carry_out(decision)


def test_optimize_fusing_only_is_not_refused_by_an_unfused_layer():
    decision = decide(Request(export("bidirectional"), Entry.OPTIMIZE, target="cpu"))
    assert decision.converted and decision.fusion.refusal is not None


def test_convert_refuses_a_model_with_nothing_to_convert():
    model = gqa_model()
    carry_out(decide(Request(model, Entry.CONVERT, "int8", scales=SCALES, target="cpu")))
    again = decide(Request(model, Entry.CONVERT, "int8", target="cpu", name="m.onnx"))
    assert codes(again) == [RefusalCode.ALREADY_CONVERTED]
    assert again.refusals[0].text == "m.onnx is already int8 per_tensor: nothing to convert."
    x = ir.val("x", ir.DataType.FLOAT, [1])
    graph = ir.Graph([x], [x], nodes=[], opset_imports={"": 21})
    empty = decide(Request(ir.Model(graph, ir_version=10), Entry.CONVERT, "int8", target="cpu"))
    assert codes(empty) == [RefusalCode.NO_ATTENTION] and "docs/exporting.md" in empty.message


@pytest.mark.parametrize(
    ("model", "target", "fmt", "expected"),
    [
        (gqa_model, "cpu", "fp8", [RefusalCode.FORMAT_UNSUPPORTED]),
        (lambda: gqa_model(dtype=ir.DataType.BFLOAT16), "cpu", "int8", [RefusalCode.QUERY_DTYPE_UNSUPPORTED]),
        (gqa_model, "webgpu", "int8", [RefusalCode.FORMAT_UNSUPPORTED]),
        (gqa_model, "dml", "int8", [RefusalCode.FORMAT_UNSUPPORTED]),
        (lambda: gqa_model(qk_norm=True), "cpu", "int8", [RefusalCode.QK_NORM_UNSUPPORTED]),
    ],
)
def test_gating_refuses_with_codes(model, target, fmt, expected):
    decision = decide(Request(model(), Entry.OPTIMIZE, fmt, scales=SCALES, target=target))
    assert codes(decision) == expected
    assert decision.message.startswith(f"KV cache not converted to {fmt} per_tensor for {target}: ")


def test_an_unknown_provider_is_named_first_by_convert_only():
    convert = decide(Request(gqa_model(), Entry.CONVERT, "int8", scales=SCALES, target="tpu"))
    optimize = decide(Request(gqa_model(), Entry.OPTIMIZE, "int8", scales=SCALES, target="tpu"))
    assert codes(convert) == [RefusalCode.UNKNOWN_PROVIDER] * 2
    assert convert.refusals[0].text == "'tpu' is not a provider onnx-kvcache knows."
    assert codes(optimize) == [RefusalCode.UNKNOWN_PROVIDER]
    assert {r.parameter for r in convert.refusals} == {Parameter.EP}


def test_the_inferred_target_is_explained_by_optimize(monkeypatch):
    monkeypatch.setattr(pipeline, "cuda_compute_capability", lambda: (8, 6))  # no fp8 there
    model = gqa_model()
    optimize = decide(Request(model, Entry.OPTIMIZE, "fp8", scales=SCALES, check_device=True))
    convert = decide(Request(gqa_model(), Entry.CONVERT, "fp8", scales=SCALES, check_device=True))
    assert optimize.target == convert.target == "cuda"  # an fp8 cache runs only there
    assert "(inferred: fp8 caches run only on CUDA; name the target with" in optimize.message
    assert convert.message.startswith("KV cache not converted to fp8 per_tensor for cuda: ")


def test_optimize_refuses_a_fused_attention_the_target_cannot_run():
    decision = decide(Request(export(), Entry.OPTIMIZE, target="cuda"))
    assert codes(decision) == [RefusalCode.QUERY_DTYPE_UNSUPPORTED]
    assert decision.message.startswith("Attention not fused for cuda: ")


def test_no_cuda_device_is_a_refusal_of_check_device(monkeypatch):
    monkeypatch.setattr(pipeline, "cuda_compute_capability", lambda: None)
    model = gqa_model(dtype=ir.DataType.FLOAT16)
    decision = decide(Request(model, Entry.OPTIMIZE, "fp8", scales=SCALES, target="cuda", check_device=True))
    assert codes(decision)[-1] is RefusalCode.NO_CUDA_DEVICE
    assert decision.refusals[-1].parameter is Parameter.CHECK_DEVICE
    monkeypatch.setattr(pipeline, "cuda_compute_capability", lambda: (8, 6))
    low = decide(Request(model, Entry.OPTIMIZE, "fp8", scales=SCALES, target="cuda", check_device=True))
    assert codes(low) == [RefusalCode.COMPUTE_CAPABILITY_TOO_LOW]


def test_gating_codes_for_runtime_and_granularity():
    model = gqa_model()
    old = check_kv_cache_support(model, "cpu", "int8", runtime_version="1.20")
    assert [r.code for r in old.refusals] == [RefusalCode.RUNTIME_TOO_OLD] and old.reasons == (
        old.refusals[0].text,
    )
    paged = check_kv_cache_support(None, "cuda", "int8", op="PagedAttention", runtime_version="1.29")
    assert [r.code for r in paged.refusals] == [RefusalCode.RUNTIME_TOO_OLD]
    none = check_kv_cache_support(None, "cpu", None, op="PagedAttention")
    assert [r.code for r in none.refusals] == [RefusalCode.NO_KERNEL]


@pytest.mark.parametrize("entry", list(Entry))
def test_strict_raises_the_refusal(entry):
    with pytest.raises(KvCacheError, match="no GroupQueryAttention kernel for an fp8") as raised:
        decide(Request(gqa_model(), entry, "fp8", scales=SCALES, target="cpu", strict=True))
    assert str(raised.value).startswith("KV cache not converted to fp8 per_tensor for cpu: ")


def test_strict_convert_raises_an_early_refusal_bare():
    with pytest.raises(KvCacheError) as raised:
        decide(Request(export("bidirectional"), Entry.CONVERT, "int8", target="cpu", strict=True))
    assert str(raised.value).startswith("attention fusion fused nothing")


def test_requests_and_decisions_are_frozen():
    decision = decide(Request(gqa_model(), Entry.OPTIMIZE, target="cpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.request.format = "int8"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.target = "cuda"  # type: ignore[misc]


def tapped(layers: int = 2) -> ir.Model:
    """GQA layers whose first past key is also read by a Mul: the pass would skip that layer."""
    model = gqa_model(layers=layers)
    past = next(v for v in model.graph.inputs if v.name == "past_key_values.0.key")
    tap = ir.Node("", "Mul", [past, past], num_outputs=1, name="double")
    model.graph.append(tap)
    model.graph.outputs.append(tap.outputs[0])
    tap.outputs[0].name = "doubled"
    return model


SCALES2 = as_kv_cache_scales({0: (0.1, 0.2), 1: (0.1, 0.2)})


@pytest.mark.parametrize("entry", list(Entry))
def test_a_cache_left_in_its_type_refuses_the_conversion_naming_the_layers(entry):
    model = tapped()
    text = ir.to_onnx_text(model)
    decision = decide(Request(model, entry, "int8", scales=SCALES2, target="cpu"))
    assert codes(decision) == [RefusalCode.PARTIAL_CONVERSION]
    assert decision.refusals[0].parameter is Parameter.ALLOW_PARTIAL
    message = str(decision.message)
    assert "\n" not in message
    assert "layer(s) 0 would keep float32 caches while the others become int8" in message
    assert "also read by Mul node 'double'" in message and message.endswith("only with allow_partial=True.")
    with pytest.warns(NotConvertedWarning, match=r"layer\(s\) 0 would keep"):
        assert not carry_out(decision)
    assert ir.to_onnx_text(model) == text


def test_every_cache_left_in_its_type_is_refused_too():
    decision = decide(Request(tapped(layers=1), Entry.CONVERT, "int8", scales=SCALES, target="cpu"))
    assert codes(decision) == [RefusalCode.PARTIAL_CONVERSION]
    assert "layer(s) 0 would keep float32 caches (" in decision.message


@pytest.mark.parametrize(("entry", "head"), [(Entry.CONVERT, "layer(s) 0"), (Entry.OPTIMIZE, "KV cache not")])
def test_strict_raises_a_partial_conversion(entry, head):
    with pytest.raises(KvCacheError) as raised:
        decide(Request(tapped(), entry, "int8", scales=SCALES2, target="cpu", strict=True))
    assert str(raised.value).startswith(head)


@pytest.mark.parametrize("entry", list(Entry))
def test_allow_partial_converts_the_other_caches(entry):
    model = tapped()
    decision = decide(Request(model, entry, "int8", scales=SCALES2, target="cpu", allow_partial=True))
    assert decision.converted
    with pytest.warns(SkippedNodeWarning, match="read by Mul node 'double'"):
        assert carry_out(decision)
    dtypes = {v.name: v.dtype for v in decision.model.graph.inputs if v.name.startswith("past")}
    assert dtypes["past_key_values.0.key"] == ir.DataType.FLOAT
    assert dtypes["past_key_values.1.key"] == ir.DataType.INT8


def test_allow_partial_converts_the_layers_a_fusion_fused():
    from test_optimize import half_guarded_fp16_export

    scales = as_kv_cache_scales({0: (0.05, 0.05), 1: (0.05, 0.05)})
    refused = decide(Request(half_guarded_fp16_export(), Entry.CONVERT, "int8", scales=scales, target="cpu"))
    assert codes(refused) == [RefusalCode.ATTENTION_UNFUSED]
    assert refused.message.endswith(
        "allow_partial=True converts the fused layers alone, leaving the others as they are."
    )
    scales = as_kv_cache_scales({1: (0.05, 0.05)})  # layer 0 stays unfused
    request = Request(
        half_guarded_fp16_export(), Entry.CONVERT, "int8", scales=scales, target="cpu", allow_partial=True
    )
    decision = decide(request)
    assert decision.converted and decision.fusion.fused == 1
    with pytest.warns(FusionSkippedWarning, match="not provably"):
        assert carry_out(decision)
    assert count_int8(decision.model) == 2  # the fused layer's past key and value


def count_int8(model: ir.Model) -> int:
    return sum(v.dtype == ir.DataType.INT8 for v in model.graph.inputs)


@pytest.mark.parametrize("entry", list(Entry))
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_a_float32_model_for_cuda_converts_with_its_attention_in_float16(entry, fmt):
    """Rule 7: CUDA takes no float32 query; the row of ADAPTATIONS lifts that refusal."""
    model = gqa_model()
    decision = decide(Request(model, entry, fmt, scales=SCALES, target="cuda"))
    assert decision.converted and decision.adaptation is pipeline.ADAPTATIONS[0]
    with pytest.warns(
        Float16AttentionWarning, match="cuda has no float32 GroupQueryAttention: the 1 attention"
    ):
        assert carry_out(decision)
    assert check_kv_cache_support(decision.model, "cuda", fmt).supported
    assert cache_dtype(decision.model) == get_format(fmt).dtype


@pytest.mark.parametrize(
    ("model", "target", "fmt"),
    [
        (lambda: gqa_model(dtype=ir.DataType.FLOAT16), "cuda", "fp8"),  # nothing to cure
        (gqa_model, "cpu", "int8"),  # cpu takes float32
        (lambda: gqa_model(dtype=ir.DataType.BFLOAT16), "cpu", "int8"),  # not float32: refused as it is
    ],
)
def test_no_adaptation_where_none_is_needed_or_none_cures(model, target, fmt):
    decision = decide(Request(model(), Entry.OPTIMIZE, fmt, scales=SCALES, target=target))
    assert decision.adaptation is None


def test_an_adaptation_lifts_only_the_refusal_it_cures(monkeypatch):
    monkeypatch.setattr(pipeline, "cuda_compute_capability", lambda: (8, 6))
    decision = decide(
        Request(gqa_model(), Entry.OPTIMIZE, "fp8", scales=SCALES, target="cuda", check_device=True)
    )
    assert codes(decision) == [RefusalCode.COMPUTE_CAPABILITY_TOO_LOW] and decision.adaptation is None


def test_an_export_fused_for_cuda_converts_only_when_a_format_is_asked():
    fused_only = decide(Request(export(), Entry.OPTIMIZE, target="cuda"))
    assert codes(fused_only) == [RefusalCode.QUERY_DTYPE_UNSUPPORTED]
    converted = decide(Request(export(), Entry.OPTIMIZE, "fp8", target="cuda"))
    assert converted.converted and converted.adaptation is not None
