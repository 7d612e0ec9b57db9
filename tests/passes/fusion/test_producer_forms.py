"""Constructs the real producers write around attention (tests/data/producers/), each on a small graph."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache.passes.fusion._base import bypass_input_copies
from onnx_kvcache.passes.fusion._match import _strip_repeat, mask_condition
from onnx_kvcache.passes.fusion._symbolic import SymbolicEvaluator, Unprovable


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
    with pytest.raises(Unprovable, match="Expand changes axis 3"):
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
    from onnx_kvcache.passes.fusion._match import mask_facts
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
