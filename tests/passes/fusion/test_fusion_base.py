"""fusion/_base: the one fusion loop, its typed refusals and the report every fusion returns."""

from __future__ import annotations

import types
import warnings

import onnx_ir as ir
import pytest
from test_attention_fusion import attention_in_a_function, exported

from decoding import count
from onnx_kvcache import KvCacheWarning
from onnx_kvcache.passes.fusion._attention_facts import MaskFacts
from onnx_kvcache.passes.fusion._base import (
    FusionPass,
    FusionRefusal,
    FusionRefusalCode,
    FusionReport,
    FusionResult,
    Refused,
    summarize_refusals,
)
from onnx_kvcache.passes.fusion._symbolic import Unprovable
from onnx_kvcache.passes.fusion.attention_fusion import AttentionFusionPass
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass
from onnx_kvcache.passes.fusion.sdpa_fusion import DecomposedAttentionFusionPass

from builders.exported import ExportStyle

F = ir.DataType.FLOAT


class Relus(FusionPass):
    """A toy fusion: "fuses" a Relu named ``fuse*`` by removing the Relu after it, refuses
    ``odd*`` with a code of its own and any other Relu as unprovable."""

    label = "Relu"
    padding = MaskFacts(causal=True, window=4, padding="attention_mask")

    def is_candidate(self, node: ir.Node) -> bool:
        return node.op_type == "Relu"

    def match(self, ev, graph, node):
        if node.name.startswith("odd"):
            raise Refused(FusionRefusal(FusionRefusalCode.IN_FUNCTION, node, "a refusal of its own"))
        if not node.name.startswith("fuse"):
            raise Unprovable(f"{node.name} is no attention")
        return types.SimpleNamespace(node=node, mask=self.padding)

    def rewrite(self, writer, match):
        (user, _), *_ = match.node.outputs[0].uses()
        user.outputs[0].replace_all_uses_with(match.node.outputs[0], replace_graph_outputs=True)
        writer.graph.remove(user, safe=True)
        return match.node


class RelusEverywhere(Relus):
    reports_elsewhere = True


def relu(x: ir.Value, name: str) -> ir.Node:
    node = ir.node("Relu", [x], name=name)
    node.outputs[0].name, node.outputs[0].type = f"{name}_out", ir.TensorType(F)
    return node


def relus_everywhere() -> ir.Model:
    """Relus in the main graph, in both branches of an If and in a model-local function."""
    x = ir.val("x", F, [2])
    cond = ir.val("cond", ir.DataType.BOOL, [])
    fuse = relu(x, "fuse")
    drop = relu(fuse.outputs[0], "drop")  # removed by fuse's rewrite: never looked at
    odd = relu(drop.outputs[0], "odd")
    plain = relu(odd.outputs[0], "plain")
    branches = {}
    for branch in ("then", "else"):
        inner = relu(plain.outputs[0], branch)
        branches[f"{branch}_branch"] = ir.Graph([], inner.outputs, nodes=[inner], name=branch)
    choose = ir.node("If", [cond], branches, name="if")
    choose.outputs[0].name = "y"
    body_x = ir.val("bx", F, [2])
    body = relu(body_x, "inner")
    function = ir.Function("local", "f", graph=ir.Graph([body_x], body.outputs, nodes=[body]), attributes=[])
    graph = ir.Graph(
        [x, cond],
        [choose.outputs[0]],
        nodes=[fuse, drop, odd, plain, choose],
        opset_imports={"": 23, "local": 1},
    )
    return ir.Model(graph, ir_version=10, functions=[function])


def codes(report: FusionReport) -> list[tuple[FusionRefusalCode, str]]:
    return [(r.code, r.node.name) for r in report.refusals]


@pytest.mark.parametrize(
    ("fusion", "elsewhere"),
    [(Relus, []), (RelusEverywhere, [("then", "subgraph"), ("else", "subgraph"), ("inner", "function")])],
    ids=["main_graph_only", "reports_elsewhere"],
)
def test_the_loop_fuses_the_main_graph_and_refuses_subgraphs_and_functions(fusion, elsewhere):
    model = relus_everywhere()
    fusion_pass = fusion()
    result = fusion_pass(model)
    assert isinstance(result, FusionResult) and result.report is fusion_pass.report
    assert result.modified and fusion_pass.fused == 1
    where = {"subgraph": FusionRefusalCode.IN_SUBGRAPH, "function": FusionRefusalCode.IN_FUNCTION}
    assert codes(result.report) == [
        (FusionRefusalCode.IN_FUNCTION, "odd"),
        (FusionRefusalCode.UNPROVABLE, "plain"),
        *((where[kind], name) for name, kind in elsewhere),
    ]
    texts = [r.text for r in result.report.refusals]
    assert texts[:2] == ["a refusal of its own", "plain is no attention"]
    if elsewhere:
        assert texts[2:] == ["inside a control-flow subgraph of If node 'if' (not fused)"] * 2 + [
            "inside function f (not fused)"
        ]
    assert "drop" not in {n.name for n in model.graph}
    assert (result.report.padded, result.report.padded_windows) == (1, 1)
    assert model.opset_imports["com.microsoft"] == 1


def test_attention_in_a_function_is_refused_with_its_code_and_node():
    model = attention_in_a_function()
    fusion = AttentionFusionPass()
    with pytest.warns(KvCacheWarning, match="inside function attend"):
        result = fusion(model)
    (refusal,) = result.report.refusals
    (attention,) = model.functions[("local", "attend", "")]
    assert refusal == FusionRefusal(
        FusionRefusalCode.IN_FUNCTION, attention, "inside function attend (not fused)"
    )
    assert fusion.refused == [str(refusal)] == ["attention: inside function attend (not fused)"]


@pytest.mark.parametrize(
    ("fusion", "opset", "warns"),
    [(AttentionFusionPass, 23, True), (DecomposedAttentionFusionPass, 20, False)],
    ids=["attention", "decomposed"],
)
def test_an_unprovable_attention_is_refused_with_its_code_node_and_reason(fusion, opset, warns):
    """The Attention fusion warns its refusals; the decomposed one leaves that to GqaFusionPass."""
    model = exported(exported=ExportStyle(mask="bidirectional", opset=opset))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        report = fusion()(model).report
    assert len(said) == warns and all(issubclass(w.category, KvCacheWarning) for w in said)
    assert report.fused == 0 and len(report.refusals) == 2
    for refusal in report.refusals:
        assert refusal.code is FusionRefusalCode.MASK and refusal.node.graph is model.graph
        mask = refusal.node.inputs[3].name if refusal.node.op_type == "Attention" else None
        assert refusal.text.startswith("the mask '") and refusal.text.endswith(
            "is not causal (a query would see later keys)"
        )
        assert mask is None or f"'{mask}' (with is_causal=0)" in refusal.text
        assert str(refusal) == f"{refusal.node.name}: {refusal.text}"


def test_reports_merge():
    x = ir.val("x", F, [2])
    kept, other = relu(x, "kept"), relu(x, "other")
    ir.Graph([x], [kept.outputs[0]], nodes=[kept])
    first = FusionReport(2, (FusionRefusal(FusionRefusalCode.UNPROVABLE, kept, "one"),), padded=1)
    second = FusionReport(1, (FusionRefusal(FusionRefusalCode.IN_SUBGRAPH, other, "two"),), 1, 1)
    merged = first + second
    assert (merged.fused, merged.padded, merged.padded_windows) == (3, 2, 1)
    assert merged.refused == ["kept: one", "other: two"]
    assert FusionReport() + merged == merged


def test_gqa_fusion_returns_and_keeps_the_merged_report():
    model = exported()
    fusion = GqaFusionPass()
    with pytest.warns(KvCacheWarning, match="a prompt padded anywhere"):
        result = fusion(model)
    assert isinstance(result, FusionResult) and result.report is fusion.report
    assert fusion.fused == result.report.fused == count(model, "GroupQueryAttention") == 2
    assert result.report.padded == 2 and fusion.refused == []


def _head_size_rule(size: int) -> Unprovable:
    try:
        raise Unprovable(f"head size {size}: needs a multiple of 8")  # one rule, whatever the size
    except Unprovable as reason:
        return reason


def _odd() -> Unprovable:
    try:
        raise Unprovable("odd")
    except Unprovable as reason:
        return reason


def test_refusals_of_one_rule_are_one_reason_in_the_summary():
    """Refusals raised at one place are grouped by that place, not by reading their text."""
    x = ir.val("x", F, [2])
    nodes = [relu(x, f"layers.{k}/attention") for k in range(3)] + [ir.node("Relu", [x])]
    odd = _odd()
    try:
        raise Unprovable("odd")  # the same text, another rule
    except Unprovable as reason:
        also_odd = reason
    raised = [_head_size_rule(12), _head_size_rule(20), odd, also_odd]
    assert raised[0].rule == raised[1].rule != odd.rule != also_odd.rule
    refusals = [FusionRefusal(FusionRefusalCode.UNPROVABLE, n, str(e), e.rule) for n, e in zip(nodes, raised)]
    said = summarize_refusals(refusals, "thing(s)")
    assert said == (
        "4 thing(s) not provably GroupQueryAttention with a KV cache: head size 12: needs a multiple "
        "of 8 (2; first layers.0/attention); odd (1; first layers.2/attention); odd (1; first <unnamed>)"
    )
