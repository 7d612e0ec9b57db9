"""DecomposedAttentionFusionPass: below-opset-23 exports' attention -> GroupQueryAttention.

The graphs are the exported builder's opset-20 mode: scaled dot-product attention as the
exporter's op library decomposes it, transformers' rotate_half and RMS norm written out.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from decoding import PROMPTS, count, generate, max_differences
from onnx_kvcache import GqaFusionPass, optimize_model
from onnx_kvcache.errors import FusionSkippedWarning, PaddingAssumptionWarning
from onnx_kvcache.passes.fusion.sdpa_fusion import DecomposedAttentionFusionPass

from builders.exported import ExportStyle, build_decoder, exported_config
from conftest import gqa_nodes


def exported(arch: str = "llama", **style) -> ir.Model:
    return build_decoder(
        exported_config(arch, num_layers=2, vocab_size=300, exported=ExportStyle(opset=20, **style))
    )


@pytest.mark.parametrize(
    ("arch", "prompt"),
    [
        ("llama", "single"),
        ("llama", "right_padded"),
        ("qwen3", "single"),
        ("qwen3", "right_padded"),
        ("mistral", "single"),
    ],
)
def test_fused_decoder_equals_the_export(arch, prompt):
    original, model = exported(arch), exported(arch)
    assert DecomposedAttentionFusionPass()(model).modified
    assert count(model, "GroupQueryAttention") == 2 and count(model, "Softmax") == 0
    worst = max_differences(generate(original, PROMPTS[prompt]), generate(model, PROMPTS[prompt]))
    assert max(worst.values()) < 1e-4, worst


@pytest.mark.parametrize("prompt", ["single", "right_padded"])
@pytest.mark.parametrize(
    "style",
    [{"kv_repeat": "tile"}, {"kv_repeat": "tile", "attention": "eager", "attention_sinks": True}],
    ids=["tile", "tile_with_sinks"],
)
def test_kv_heads_tiled_fuse_with_the_query_heads_regrouped(style, prompt):
    """K/V repeated by Tile (query head h reads KV head h mod kv_heads) fuse: GQA reads the query
    heads regrouped (its sinks with them), its output heads are put back."""
    original, model = exported(**style), exported(**style)
    assert DecomposedAttentionFusionPass()(model).modified
    assert count(model, "GroupQueryAttention") == 2 and count(model, "Tile") == 0
    worst = max_differences(generate(original, PROMPTS[prompt]), generate(model, PROMPTS[prompt]))
    assert max(worst.values()) < 1e-4, worst


def test_scale_and_window_carry_over():
    model = exported("mistral")
    DecomposedAttentionFusionPass()(model)
    node = gqa_nodes(model)[0]
    assert node.attributes["scale"].as_float() == pytest.approx(32**-0.5)
    assert node.attributes["local_window_size"].as_int() == 4


def _constant(model: ir.Model, name: str, array) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(np.asarray(array), name=name))
    value.dtype, value.shape = value.const_value.dtype, value.const_value.shape
    model.graph.register_initializer(value)
    return value


def guarded(fill: float) -> ir.Model:
    """Each softmax followed by ``Where(IsNaN(p), fill, p)``."""
    model = exported()
    fill_value = _constant(model, "nan_fill", np.float32(fill))
    for softmax in [n for n in model.graph if n.op_type == "Softmax"]:
        probs = softmax.outputs[0]
        isnan = ir.node("IsNaN", [probs], name=f"{softmax.name}/IsNaN")
        where = ir.node("Where", [isnan.outputs[0], fill_value, probs], name=f"{softmax.name}/Where")
        model.graph.insert_after(softmax, [isnan, where])
        for user, index in list(probs.uses()):
            if user not in (isnan, where):
                user.replace_input_with(index, where.outputs[0])
    return model


def q_scaled_by(factor: float) -> ir.Model:
    model = exported()
    value = _constant(model, "q_factor", np.float32(factor))
    for matmul in [n for n in model.graph if n.op_type == "MatMul" and n.inputs[0].producer() is not None]:
        mul = matmul.inputs[0].producer()
        if mul.op_type == "Mul" and [u.op_type for u, _ in matmul.outputs[0].uses()] == ["Add"]:
            mul.replace_input_with(1, value)
    return model


def scaled_through_sqrt(q_scale: float, k_scale: float | None = None, *, constant: bool = True) -> ir.Model:
    """Q and K^T each scaled by ``Sqrt(CastLike(scale, operand))``, as torch's unoptimized
    dynamo export writes sdpa's ``sqrt(scale)`` factors; ``constant`` False: the scale a graph
    input."""
    model = exported()
    if constant:
        scales = [_constant(model, f"scale_{i}", np.float32(s)) for i, s in enumerate((q_scale, k_scale))]
    else:
        scales = [ir.val("scale", ir.DataType.FLOAT, [])] * 2
        model.graph.inputs.append(scales[0])
    for matmul in [n for n in model.graph if n.op_type == "MatMul"]:
        operands = [v.producer() for v in matmul.inputs]
        if [u.op_type for u, _ in matmul.outputs[0].uses()] != ["Add"] or None in operands:
            continue  # not the scores MatMul (a projection reads a weight)
        for index, operand in enumerate(matmul.inputs):
            mul = operand.producer()
            assert mul.op_type == "Mul"
            scale = scales[index] if k_scale is not None or not constant else scales[0]
            like = ir.node("CastLike", [scale, mul.inputs[0]], name=f"{mul.name}/CastLike")
            root = ir.node("Sqrt", like.outputs, name=f"{mul.name}/Sqrt")
            model.graph.insert_before(mul, [like, root])
            mul.replace_input_with(1, root.outputs[0])
    return model


@pytest.mark.parametrize("scale", [0.125, 32**-0.5])
def test_factors_written_as_sqrt_of_a_cast_scale_are_constants(scale):
    """torch's unoptimized opset-18 export (tests/data/producers/torch-tf4.57/dynamo-opset18-nooptimize)."""
    original, model = scaled_through_sqrt(scale), scaled_through_sqrt(scale)
    assert DecomposedAttentionFusionPass()(model).modified and count(model, "GroupQueryAttention") == 2
    node = gqa_nodes(model)[0]
    assert node.attributes["scale"].as_float() == pytest.approx(np.float32(scale), rel=1e-6)
    worst = max_differences(
        generate(original, PROMPTS["right_padded"]), generate(model, PROMPTS["right_padded"])
    )
    assert max(worst.values()) < 1e-4, worst


def dropout_in_training_mode() -> ir.Model:
    model = exported()
    training = _constant(model, "training", np.bool_(True))
    for node in model.graph:
        if node.op_type == "Dropout":
            node.resize_inputs(3)
            node.replace_input_with(2, training)
    return model


def test_a_nan_guard_after_the_softmax_is_followed():
    original, model = guarded(0.0), guarded(0.0)
    assert DecomposedAttentionFusionPass()(model).modified and count(model, "IsNaN") == 0
    worst = max_differences(generate(original, PROMPTS["single"]), generate(model, PROMPTS["single"]))
    assert max(worst.values()) < 1e-4


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: exported(mask="bidirectional"), "is not causal (a query would see later keys)"),
        (lambda: q_scaled_by(0.3), "different factors"),
        (dropout_in_training_mode, "Dropout in training mode"),
        (lambda: guarded(0.5), "not a NaN guard"),
        (lambda: scaled_through_sqrt(0.125, 0.25), "different factors"),
        (lambda: scaled_through_sqrt(0.125, constant=False), "without a transpose of its last two axes"),
    ],
    ids=[
        "bidirectional",
        "unequal_factors",
        "training_dropout",
        "nan_fill",
        "unequal_sqrt_factors",
        "sqrt_of_an_input",
    ],
)
def test_unprovable_attention_is_left_alone(make, reason):
    model = make()
    before = ir.to_proto(model).SerializeToString()
    fusion = DecomposedAttentionFusionPass()
    assert not fusion(model).modified
    assert len(fusion.refused) == 2 and all(reason in why for _, why in fusion.refused)
    assert ir.to_proto(model).SerializeToString() == before


def test_attention_no_fusion_takes_is_reported_once():
    model = guarded(0.5)
    with pytest.warns(FusionSkippedWarning, match="2 decomposed attention.*not a NaN guard") as record:
        GqaFusionPass()(model)
    assert len(record) == 1 and count(model, "GroupQueryAttention") == 0


def test_optimize_model_fuses_then_quantizes():
    model = optimize_model(
        exported("qwen3"),
        ep="cpu",
        format="int8",
        scales={0: (0.1, 0.05), 1: (0.1, 0.05)},
    )
    gqa = gqa_nodes(model)
    assert len(gqa) == 2 and {n.inputs[3].dtype for n in gqa} == {ir.DataType.INT8}
    history = generate(model, PROMPTS["single"])
    assert all(np.all(np.isfinite(out["logits"])) for _, out in history)


def _chunks(model: ir.Model, chunks: int = 3, seq: int = 3) -> list[dict]:
    """Feed ``chunks`` steps of ``seq`` tokens each at batch 1 (a static-seq export's only shape)."""
    from onnx_kvcache.model_io._sessions import create_session

    session = create_session(model)
    names = [o.name for o in session.get_outputs()]
    caches = [v for v in model.graph.inputs if v.name.startswith("past_key_values")]
    rng = np.random.default_rng(0)
    feeds = {v.name: np.zeros((1, 2, 0, 32), np.float32) for v in caches}
    results = []
    for step in range(chunks):
        feeds |= {
            "input_ids": rng.integers(0, 300, (1, seq)),
            "attention_mask": np.ones((1, (step + 1) * seq), np.int64),
            "position_ids": np.arange(step * seq, (step + 1) * seq)[None],
        }
        result = dict(zip(names, session.run(None, feeds)))
        results.append(result)
        feeds = {v.name: result[v.name.replace("past_key_values", "present")] for v in caches}
    return results


def test_a_static_batch_and_seq_export_fuses():
    """transformers 5.24 at opset 20 with batch 1 / seq 3 fixed, shapes folded by the optimizer."""
    original, model = exported(static_shapes=(1, 3, None)), exported(static_shapes=(1, 3, None))
    assert model.graph.inputs[0].shape == ir.Shape([1, 3])
    with pytest.warns(PaddingAssumptionWarning, match="a prompt padded anywhere"):
        optimize_model(model)
    assert count(model, "GroupQueryAttention") == 2
    for want, got in zip(_chunks(original), _chunks(model)):
        assert all(np.abs(want[name] - got[name]).max() < 1e-4 for name in want)


def test_a_fully_static_export_is_refused_with_a_reason():
    """Past fixed too: the optimizer folds repeat_kv's Reshape into the key transpose's."""
    model = exported(static_shapes=(1, 3, 5))
    fusion = DecomposedAttentionFusionPass()
    assert not fusion(model).modified
    assert len(fusion.refused) == 2
    assert all("first Reshape reads a 5-D tensor" in why for _, why in fusion.refused)
