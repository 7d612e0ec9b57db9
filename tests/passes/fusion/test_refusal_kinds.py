"""Every refusal names the graph: each kind of :data:`REFUSAL_KINDS`, given on a producer's file.

Each case is a committed producer's file, as it is or changed in one place (surgery.py), that a
fusion must refuse with that kind; the refusal's text names a node or value of the file. No
refusal of any case is of the generic kind (every rule of this project's fusions has a kind).
"""

from __future__ import annotations

import pathlib
import re
import warnings

import numpy as np
import onnx_ir as ir
import pytest
import surgery

from onnx_kvcache.passes.fusion._base import REFUSAL_KINDS, FusionRefusalCode, summarize_refusals
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass

OPTIMUM = "optimum/optimum-cli/llama"
DYNAMO = "torch-tf5/dynamo-opset23-optimize/llama"
MOBIUS = "mobius/mobius-default/llama"
Code = FusionRefusalCode


def _layer(model: ir.Model, op_type: str, layer: int) -> ir.Node:
    """The ``layer``-th node of ``op_type`` (each layer has one Attention)."""
    return [n for n in model.graph if n.op_type == op_type][layer]


def _scores(model: ir.Model, layer: int = 0) -> str:
    """K scaled by another factor than Q."""
    k_scale = surgery.node(model, f"/model/layers.{layer}/self_attn/Mul_9").inputs[1]
    surgery.set_constant(model, k_scale, np.array(0.25, np.float32))  # Q's is sqrt(1 / sqrt(16))
    return f"/model/layers.{layer}/self_attn/MatMul_1"


def _cache(model: ir.Model, layer: int = 0) -> str:
    """The concatenated cache is no graph output."""
    model.graph.outputs.remove(surgery.value(model, f"present.{layer}.key"))
    return f"/model/layers.{layer}/self_attn/MatMul_1"


def _repeat(model: ir.Model, layer: int = 0) -> str:
    """repeat_kv's Unsqueeze inserts its axis before the head axis."""
    unsqueeze = surgery.node(model, f"/model/layers.{layer}/self_attn/Unsqueeze_12")
    surgery.set_constant(model, unsqueeze.inputs[1], np.array([1], np.int64))
    return f"/model/layers.{layer}/self_attn/MatMul_1"


def _shapes(model: ir.Model, layer: int = 0) -> str:
    """A 3-D Attention whose q_num_heads does not divide its query width."""
    node = _layer(model, "Attention", layer)
    node.attributes["q_num_heads"] = ir.Attr("q_num_heads", ir.AttributeType.INT, 3)
    return node.name


def _mask(model: ir.Model, layer: int = 0) -> str:
    """An Attention that is not causal (is_causal=0 over a padding mask)."""
    node = _layer(model, "Attention", layer)
    node.attributes["is_causal"] = ir.Attr("is_causal", ir.AttributeType.INT, 0)
    return node.name


def _attention_node(model: ir.Model, layer: int = 0) -> str:
    """softmax in float16."""
    node = _layer(model, "Attention", layer)
    node.attributes["softmax_precision"] = ir.Attr("softmax_precision", ir.AttributeType.INT, 10)
    return node.name


def _operator(model: ir.Model, layer: int = 0) -> str:
    """The mask passes through an operator whose values no rule follows (Xor with False)."""
    mask = surgery.node(model, f"/model/layers.{layer}/self_attn/Slice_4").outputs[0]
    false = surgery.constant(model, np.array(False), f"false.{layer}")
    surgery.insert_after(model, mask, "Xor", (false,), name=f"/inserted/Xor_{layer}")
    return f"/model/layers.{layer}/self_attn/MatMul_1"


def _unknown_shape(model: ir.Model, layer: int = 0) -> str:
    """An operator of another domain, without value_info, before the projections."""
    norm = surgery.value(model, f"/model/layers.{layer}/input_layernorm/Mul_1_output_0")
    surgery.insert_after(model, norm, "Scale", domain="com.example", name=f"/inserted/Scale_{layer}")
    return f"/model/layers.{layer}/self_attn/MatMul_1"


def _malformed(model: ir.Model, layer: int = 0) -> str:
    """The mask's Slice reads an axis the tensor does not have."""
    node = surgery.node(model, f"/model/layers.{layer}/self_attn/Slice_4")
    axes = surgery.constant(model, np.array([7], np.int64), f"bad.axes.{layer}")
    node.replace_input_with(3, axes) if len(node.inputs) > 3 else node.resize_inputs(4)
    node.replace_input_with(3, axes)
    return f"/model/layers.{layer}/self_attn/MatMul_1"


def _unknown_attention(model: ir.Model, layer: int = 0) -> str:
    """An operator between the softmax and its MatMul with V: no fusion's candidate."""
    softmax = surgery.node(model, f"/model/layers.{layer}/self_attn/Softmax")
    surgery.insert_after(model, softmax.outputs[0], "Mish", name=f"/inserted/Mish_{layer}")
    return softmax.name


def _in_function(model: ir.Model, layer: int = 0) -> str:
    node = _layer(model, "Attention", 0)  # the earlier layers moved already: the next is first
    surgery.into_function(model, node)
    return node.name


def _in_subgraph(model: ir.Model, layer: int = 0) -> str:
    node = _layer(model, "Attention", 0)
    flag = surgery.constant(model, np.array(True), f"flag.{layer}")
    surgery.into_subgraph(model, node, flag)
    return f"{node.name}/then"


def _opset(model: ir.Model, layer: int = 0) -> str:
    """An opset that predates the fused graph's operators (Shape with start and end)."""
    model.opset_imports[""] = 14
    return "/model/layers.0/self_attn/MatMul_1"


def _as_it_is(model: ir.Model, layer: int = 0) -> None:
    return None


#: kind -> (file, change, the node the refusal names: None when the change says so)
CASES = {
    Code.SCORES: (OPTIMUM, _scores),
    Code.CACHE: (OPTIMUM, _cache),
    Code.STATIC_CACHE: ("mobius/mobius-static/llama", _as_it_is),
    Code.REPEAT: (OPTIMUM, _repeat),
    Code.SHAPES: (MOBIUS, _shapes),
    Code.MASK: (MOBIUS, _mask),
    Code.ATTENTION_NODE: (MOBIUS, _attention_node),
    Code.OPERATOR: (OPTIMUM, _operator),
    Code.UNKNOWN_SHAPE: (OPTIMUM, _unknown_shape),
    Code.MALFORMED: (OPTIMUM, _malformed),
    Code.OPSET: (OPTIMUM, _opset),
    Code.UNKNOWN_ATTENTION: (OPTIMUM, _unknown_attention),
    Code.IN_FUNCTION: (DYNAMO, _in_function),
    Code.IN_SUBGRAPH: (DYNAMO, _in_subgraph),
}


def _refusals(path: str, change) -> tuple[list, str | None, set[str]]:
    """The refusals of the changed file, the node the change names, and the file's names."""
    model = surgery.load(path)
    named = change(model)
    names = _names(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = GqaFusionPass()(model).report
    return list(report.refusals), named, names


def test_every_kind_has_a_case():
    assert set(CASES) | {Code.UNPROVABLE} == set(Code) == set(REFUSAL_KINDS)


@pytest.mark.parametrize("kind", sorted(CASES, key=lambda k: k.value), ids=lambda k: k.value)
def test_each_kind_is_given_on_a_producers_file_naming_the_graph(kind):
    path, change = CASES[kind]
    refusals, named, names = _refusals(path, change)
    assert refusals, f"{kind}: nothing refused"
    assert all(r.code is not Code.UNPROVABLE for r in refusals), [(r.code, r.text) for r in refusals]
    mine = [r for r in refusals if r.code is kind]
    assert mine, [(r.code, r.text) for r in refusals]
    first = mine[0]
    if named is not None:
        assert first.node.name == named
    assert "\n" not in first.text
    if kind is Code.ATTENTION_NODE:  # the node itself: the attribute it has
        assert re.search(r"\w+=\w+", first.text), first.text
        return
    if kind is Code.OPSET:  # the model's header: its opset
        assert "opset 14" in first.text, first.text
        return
    names |= _names_of(first.node.graph) | {"moved_attention"}
    quoted = set(re.findall(r"'([^']+)'", first.text)) | set(re.findall(r"[\w/.]+", first.text))
    assert quoted & (names - {first.node.name, ""}), first.text


def _names_of(graph) -> set[str]:
    if graph is None:
        return set()
    return {n.name for n in graph} | {v.name for n in graph for v in n.outputs}


def _names(model: ir.Model) -> set[str]:
    names = {v.name for v in model.graph.inputs} | {v.name for v in model.graph.outputs}
    for node in model.graph:
        names.add(node.name)
        names.update(v.name for v in node.outputs)
    return names


def test_a_reason_raised_again_keeps_its_first_kind_and_place():
    """Two layers refused for different causes are two reasons in the summary, each said once."""
    model = surgery.load(OPTIMUM)
    _operator(model)  # layer 0: its mask through Xor
    k_scale = surgery.node(model, "/model/layers.1/self_attn/Mul_9").inputs[1]
    surgery.set_constant(model, k_scale, np.array(0.25, np.float32))  # layer 1: its scores
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = GqaFusionPass()(model).report
    kinds = [r.code for r in report.refusals]
    assert kinds == [Code.OPERATOR, Code.SCORES]
    summary = summarize_refusals(report.refusals)
    assert summary.count("(1; first") == 2 and "Xor" in summary and "by different factors" in summary


def test_found_no_attention_only_when_there_is_none(tmp_path):
    """A file whose attention no fusion takes says which softmax, not that there is none."""
    from onnx_kvcache import convert_model

    model = surgery.load(OPTIMUM)
    _unknown_attention(model)
    softmax = surgery.node(model, "/model/layers.1/self_attn/Softmax")
    surgery.insert_after(model, softmax.outputs[0], "Mish", name="/inserted/Mish_1")
    path = tmp_path / "model.onnx"
    ir.save(model, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = convert_model(path, tmp_path / "out.onnx", format="int8", ep="cpu")
    text = " ".join(result.reasons)
    assert not result.converted and not (tmp_path / "out.onnx").exists()
    assert "found no attention" not in text and "/model/layers.0/self_attn/Softmax" in text, text


def test_the_docs_list_every_kind():
    page = (pathlib.Path(__file__).parents[3] / "docs" / "exporting.md").read_text(encoding="utf-8")
    for code, meaning in REFUSAL_KINDS.items():
        assert f"| `{code.value}` | {meaning} |" in page, code
