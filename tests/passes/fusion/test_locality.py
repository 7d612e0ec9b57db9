"""Proofs are local: operators without a rule around an attention the fusions know do not block it.

Each case changes a committed producer's file the way a new architecture does (a LayerNorm
instead of an RMSNorm, an operator the evaluator has no rule for, an MoE router's TopK /
OneHot / ScatterElements between two layers, such an operator without value_info in an export
that declares the rest). Every layer must still fuse, and the fused model compute as the
changed export does (logits and each row's real tokens' cache entries within 1e-4 over a
7-token prefill and 3 decode steps, alone and in a left-padded batch of 2).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir
import pytest
import surgery

from decoding import generate, max_differences
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass

HIDDEN = 64
TOLERANCE = 1e-4
OPTIMUM = "optimum/optimum-cli/llama"
DYNAMO = "torch-tf5/dynamo-opset23-optimize/llama"


def _layer_norm(model: ir.Model) -> None:
    """starcoder2/stablelm: LayerNormalization (with a bias) where llama has its RMSNorm."""
    scale = surgery.constant(model, np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32), "ln.scale")
    bias = surgery.constant(model, np.linspace(-0.1, 0.1, HIDDEN, dtype=np.float32), "ln.bias")
    norm = surgery.value(model, "/model/layers.0/input_layernorm/Mul_1_output_0")
    surgery.insert_after(model, norm, "LayerNormalization", (scale, bias), axis=-1, epsilon=1e-5)


def _no_rule(model: ir.Model) -> None:
    """An activation the evaluator has no row for (ONNX's inference gives its shape)."""
    norm = surgery.value(model, "/model/layers.1/input_layernorm/Mul_1_output_0")
    surgery.insert_after(model, norm, "Mish")


def _router(model: ir.Model) -> None:
    """An MoE router between the layers: TopK of the softmax, OneHot, ScatterElements, each
    without a rule; the residual stream scaled by what they select."""
    h = surgery.value(model, "/model/layers.0/Add_1_output_0")
    readers = list(h.uses())
    rng = np.random.default_rng(0)
    c = surgery.constant
    weight = c(model, rng.standard_normal((HIDDEN, 4)).astype(np.float32), "router.weight")
    k, depth = c(model, np.array([2], np.int64), "router.k"), c(model, np.array(4, np.int64), "router.depth")
    onoff = c(model, np.array([0.0, 1.0], np.float32), "router.onoff")
    zero = c(model, np.array(0.0, np.float32), "router.zero")
    axes2, last = (
        c(model, np.array([2], np.int64), "router.axes2"),
        c(model, np.array([-1], np.int64), "router.last"),
    )
    logits = ir.node("MatMul", [h, weight], name="/router/MatMul")
    probs = ir.node("Softmax", [logits.outputs[0]], {"axis": -1}, name="/router/Softmax")
    top = ir.node("TopK", [probs.outputs[0], k], {"axis": -1}, num_outputs=2, name="/router/TopK")
    onehot = ir.node("OneHot", [top.outputs[1], depth, onoff], {"axis": -1}, name="/router/OneHot")
    chosen = ir.node("ReduceSum", [onehot.outputs[0], axes2], {"keepdims": 0}, name="/router/ReduceSum")
    empty = ir.node("Mul", [probs.outputs[0], zero], name="/router/Zeros")
    weights = ir.node(
        "ScatterElements",
        [empty.outputs[0], top.outputs[1], top.outputs[0]],
        {"axis": -1},
        name="/router/Scatter",
    )
    picked = ir.node("Mul", [weights.outputs[0], chosen.outputs[0]], name="/router/Mul")
    gate = ir.node("ReduceSum", [picked.outputs[0], last], {"keepdims": 1}, name="/router/Gate")
    scaled = ir.node("Mul", [h, gate.outputs[0]], name="/router/Scaled")
    out = ir.node("Add", [h, scaled.outputs[0]], name="/router/Add")
    nodes = [logits, probs, top, onehot, chosen, empty, weights, picked, gate, scaled, out]
    for made in nodes:
        for i, o in enumerate(made.outputs):
            o.name = f"{made.name}_output_{i}"
    anchor = h.producer()
    for made in reversed(nodes):
        model.graph.insert_after(anchor, made)
    for user, slot in readers:
        user.replace_input_with(slot, out.outputs[0])


def _declared_elsewhere(model: ir.Model) -> None:
    """An operator without a rule and without value_info before the query projection of an
    export that declares every other shape: the projection's own value_info shapes it."""
    q_proj = next(n for n in model.graph if n.op_type == "MatMul" and n.outputs[0].name == "linear")
    surgery.insert_after(model, q_proj.inputs[0], "Mish")


CASES = {
    "layer_norm": (OPTIMUM, _layer_norm),
    "operator_without_rule": (OPTIMUM, _no_rule),
    "moe_router": (OPTIMUM, _router),
    "undeclared_in_a_declared_export": (DYNAMO, _declared_elsewhere),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_layer_fuses_and_computes_as_the_changed_export(case):
    path, change = CASES[case]
    export = surgery.load(path)
    change(export)
    fused = export.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = GqaFusionPass()(fused).report
    assert report.fused == 2 and not report.refusals, report.refused
    masks = {"single": np.ones((1, 7), np.int64), "left_padded": np.array([[1] * 7, [0] * 3 + [1] * 4])}
    for name, mask in masks.items():
        worst = max_differences(generate(export, mask), generate(fused, mask))
        assert worst["logits"] < TOLERANCE and worst["present"] < TOLERANCE, (name, worst)


def test_an_undeclared_operator_is_not_evaluated_where_value_info_shapes_what_follows():
    """Locality itself: the proof of the dynamo export never looks at the inserted node."""
    from onnx_kvcache.passes.fusion._symbolic import SymbolicEvaluator

    export = surgery.load(DYNAMO)
    _declared_elsewhere(export)
    inserted = surgery.node(export, "/inserted/Mish")
    ev = SymbolicEvaluator()
    query = next(n for n in export.graph if n.op_type == "Attention").inputs[0]
    assert len(ev.shape(query)) == 4
    assert inserted.outputs[0] not in ev._cache
