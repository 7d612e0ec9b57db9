"""Constructs the real producers write around attention (tests/data/producers/), each on a small graph."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from decoding import PROMPTS, count, generate, max_differences
from onnx_kvcache import GqaFusionPass, optimize_model
from onnx_kvcache.passes.fusion._attention_facts import _strip_repeat, mask_condition
from onnx_kvcache.passes.fusion._base import bypass_input_copies
from onnx_kvcache.passes.fusion._symbolic import SymbolicEvaluator, Unprovable

from builders.exported import build_decoder, exported_config


def _const(name: str, array: np.ndarray) -> ir.Value:
    return ir.Value(name=name, const_value=ir.tensor(array))


def _ints(name: str, values: list[int]) -> ir.Value:
    return _const(name, np.array(values, np.int64))


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []

    def __call__(self, op: str, inputs: list, **attrs) -> ir.Value:
        node = ir.node(op, inputs, attributes=attrs)
        self.nodes.append(node)
        return node.outputs[0]


@pytest.mark.parametrize("op", ["Concat", "Identity"])
def test_a_copy_of_a_past_input_is_read_as_the_input(op):
    past = ir.val("past_key_values.0.key", ir.DataType.FLOAT, ["batch", 2, "past", 16])
    new = ir.val("new", ir.DataType.FLOAT, ["batch", 2, "seq", 16])
    g = _Builder()
    copy = g(op, [past], **({"axis": -2} if op == "Concat" else {}))
    length = g("Shape", [copy])
    present = g("Concat", [copy, new], axis=-2)
    graph = ir.Graph([past, new], [present, length], nodes=g.nodes, opset_imports={"": 18})
    assert bypass_input_copies(graph) == 1
    assert [n.op_type for n in graph] == ["Shape", "Concat"]
    assert all(n.inputs[0] is past for n in graph)


def test_a_copy_that_is_a_graph_output_stays():
    past = ir.val("past", ir.DataType.FLOAT, ["batch", 2, "past", 16])
    g = _Builder()
    copy = g("Identity", [past])
    graph = ir.Graph([past], [copy], nodes=g.nodes, opset_imports={"": 18})
    assert bypass_input_copies(graph) == 0 and len(graph) == 1


def _repeat(*, whole: bool, clone: bool) -> tuple[ir.Value, ir.Value, list[ir.Node], list[ir.Value]]:
    """torch's unoptimized repeat_kv: present[:, :, None, :, :] (whole Slices), Expand, clone, Reshape."""
    present = ir.val("present", ir.DataType.FLOAT, ["batch", 2, "total", 16])
    g = _Builder()
    end = 2**63 - 1 if whole else 3
    sliced = g("Slice", [present, _ints("s0", [0]), _ints("e0", [end]), _ints("a0", [2]), _ints("st0", [1])])
    unsqueezed = g("Unsqueeze", [sliced, _ints("ax", [2])])
    sliced2 = g("Slice", [unsqueezed, _ints("s1", [0]), _ints("e1", [2**63 - 1]), _ints("a1", [3])])
    batch = g("Shape", [present], start=0, end=1)
    total = g("Shape", [present], start=2, end=3)
    target = g("Concat", [batch, _ints("kv", [2]), _ints("group", [2]), total, _ints("h", [16])], axis=0)
    expanded = g("Expand", [sliced2, target])
    copied = g("Identity", [expanded]) if clone else expanded
    shape = g("Concat", [batch, _ints("heads", [4]), total, _ints("h2", [16])], axis=0)
    out = g("Reshape", [copied, shape], allowzero=1)
    return out, present, g.nodes, [present]


@pytest.mark.parametrize("clone", [True, False])
def test_repeat_kv_through_whole_slices_and_a_clone_is_a_repeat(clone):
    out, present, nodes, inputs = _repeat(whole=True, clone=clone)
    ir.Graph(inputs, [out], nodes=nodes, opset_imports={"": 18})
    base, group, chain = _strip_repeat(SymbolicEvaluator(), out)
    assert base is present and group == 2
    assert {n.op_type for n in chain} >= {"Reshape", "Expand", "Unsqueeze", "Slice"}


def test_repeat_kv_through_a_slice_that_cuts_is_refused():
    out, _, nodes, inputs = _repeat(whole=False, clone=True)
    ir.Graph(inputs, [out], nodes=nodes, opset_imports={"": 18})
    with pytest.raises(Unprovable, match=r"Expand .* changes axis 3"):
        _strip_repeat(SymbolicEvaluator(), out)


def _cumsum_mask(**cumsum) -> tuple[ir.Value, ir.Value]:
    """``c[b, i] >= c[b, j]`` for ``c = CumSum(attention_mask)`` along the columns, 4-D."""
    mask = ir.val("attention_mask", ir.DataType.INT64, ["batch", "total"])
    g = _Builder()
    positions = g("CumSum", [mask, _const("axis", np.array(1, np.int64))], **cumsum)
    seen = g(
        "GreaterOrEqual",
        [g("Unsqueeze", [positions, _ints("a2", [2])]), g("Unsqueeze", [positions, _ints("a1", [1])])],
    )
    seen = g("Unsqueeze", [seen, _ints("heads", [1])])  # [batch, 1, query, key]
    ir.Graph([mask], [seen], nodes=g.nodes, opset_imports={"": 18})
    return mask, seen


def _condition(mask: ir.Value, seen: ir.Value):
    total = SymbolicEvaluator().shape(mask)[1]
    return mask_condition(SymbolicEvaluator(), seen, query_len=total, kv_len=total)


@pytest.mark.parametrize(("cumsum", "col"), [({}, "query"), ({"exclusive": 1}, "query - 1")])
def test_a_mask_of_cumsum_positions_compares_running_sums(cumsum, col):
    """mobius (gemma3, granite, olmo2, smollm3): positions counted by CumSum(attention_mask)."""
    (atom,) = _condition(*_cumsum_mask(**cumsum)).atoms
    assert {str(s) for s in atom.lhs.lookups} == {
        f"cumsum(attention_mask)[batch, {col.replace('query', 'key')}]",
        f"cumsum(attention_mask)[batch, {col}]",
    }


def test_a_reverse_cumsum_mask_is_refused_naming_it():
    with pytest.raises(Unprovable, match="token positions counted by CumSum of attention_mask"):
        _condition(*_cumsum_mask(reverse=1))


def test_a_mask_comparing_the_padding_values_is_refused_naming_it():
    """``attention_mask == 1`` reads the values, not nonzero/zero: not a padding lookup."""
    from onnx_kvcache.passes.fusion._attention_facts import mask_facts
    from onnx_kvcache.passes.fusion._symbolic import ZERO

    mask = ir.val("attention_mask", ir.DataType.INT64, ["batch", "total"])
    g = _Builder()
    one = g("Equal", [mask, _ints("one", [1])])
    seen = g("Unsqueeze", [one, _ints("axes", [1, 2])])  # [batch, 1, 1, key]
    ir.Graph([mask], [seen], nodes=g.nodes, opset_imports={"": 18})
    total = SymbolicEvaluator().shape(mask)[1]
    cond = mask_condition(SymbolicEvaluator(), seen, query_len=total, kv_len=total)
    with pytest.raises(Unprovable, match="compares an input's values"):
        mask_facts(cond, past=ZERO)


def _constant(g: _Builder, values: int | list[int]) -> ir.Value:
    return g("Constant", [], value=ir.tensor(np.array(values, np.int64)))


def _dim(g: _Builder, value: ir.Value, axis: int) -> ir.Value:
    """TorchScript's ``x.size(axis)`` as a 1-element tensor."""
    size = g("Gather", [g("Shape", [value]), _constant(g, axis)], axis=0)
    return g("Unsqueeze", [size, _constant(g, [0])])


def _reshaped_attention_output(model: ir.Model, heads: int, *, own_shape: bool = True) -> int:
    """transformers 5's TorchScript export: each attention output reshaped to its own shape,
    ``[batch, heads, seq, head]``, before its transpose, the head size read from the repeated V
    (``Shape(repeat_kv(present))``); not ``own_shape``: to ``[batch, seq, heads, head]``, a
    Reshape that moves elements. Returns how many it reshaped."""
    graph, done = model.graph, 0
    for matmul in [n for n in graph if n.op_type == "MatMul"]:
        attn, values = matmul.outputs[0], matmul.inputs[1]
        merges = [
            u
            for u, _ in attn.uses()
            if u.op_type == "Transpose" and list(u.attributes["perm"].as_ints()) == [0, 2, 1, 3]
        ]
        if not merges or values is None:
            continue
        g = _Builder()
        dims = [_dim(g, attn, 0), _constant(g, [heads]), _dim(g, attn, 2), _dim(g, values, 3)]
        if not own_shape:
            dims[1], dims[2] = dims[2], dims[1]
        reshaped = g("Reshape", [attn, g("Concat", dims, axis=0)])
        graph.insert_after(matmul, g.nodes)
        merges[0].replace_input_with(0, reshaped)
        done += 1
    return done


@pytest.mark.parametrize("own_shape", [True, False])
def test_an_attention_output_reshaped_before_its_transpose(own_shape):
    """torch-tf5/torchscript-opset18/llama: a Reshape of the attention output to its own shape is
    read through, so it goes with the attention, and with it the Shape of the repeated V that kept
    repeat_kv reading the present cache (which then could not be converted). A Reshape that moves
    elements stays, reading the fused output turned back to BNSH."""
    config = exported_config("optimum-llama", num_layers=2, vocab_size=300)
    assert config.kv_num_heads < config.num_heads  # repeat_kv is written

    def export() -> ir.Model:
        model = build_decoder(config)
        assert _reshaped_attention_output(model, config.num_heads, own_shape=own_shape) == 2
        return model

    original, model = export(), export()
    assert GqaFusionPass()(model).modified and count(model, "GroupQueryAttention") == 2
    worst = max_differences(generate(original, PROMPTS["single"]), generate(model, PROMPTS["single"]))
    assert max(worst.values()) < 1e-4, worst
    presents = [v for v in model.graph.outputs if v.name.startswith("present")]
    only_shapes = all(u.op_type == "Shape" for v in presents for u, _ in v.uses())
    assert only_shapes is own_shape  # no repeat_kv left; else V's, read by the Reshape's Shape
    if own_shape:
        scales = {i: (0.05, 0.05) for i in range(2)}
        converted = optimize_model(model, ep="cpu", format="int8", scales=scales)
        assert all(
            v.dtype == ir.DataType.INT8 for v in converted.graph.outputs if v.name.startswith("present")
        )
