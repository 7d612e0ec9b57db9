"""The evaluator's rules for graphs without value_info (``_symbolic_ops``), on a real optimum export."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache.passes.fusion._match import mask_condition, mask_facts
from onnx_kvcache.passes.fusion._symbolic import Affine, Symbol, SymbolicEvaluator, Unprovable, parse_dim

FIXTURE = pathlib.Path(__file__).parents[2] / "data" / "optimum_llama" / "model.onnx"


@pytest.fixture(scope="module")
def export():
    model = ir.load(FIXTURE)
    ev = SymbolicEvaluator()
    ev.prime(model.graph)
    return model, ev


def node(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if n.name == name)


def dims(*texts: str | int) -> tuple[Affine, ...]:
    return tuple(parse_dim(t, lambda: Symbol.fresh(0)) for t in texts)


def test_activations_get_shapes_and_types_from_the_inputs(export):
    model, ev = export
    softmax = node(model, "/model/layers.2/self_attn/Softmax").outputs[0]
    assert softmax.shape is None and softmax.dtype is None  # the file says nothing
    total = "past_sequence_length + sequence_length"
    assert ev.shape(softmax) == dims("batch_size", 4, "sequence_length", total)
    assert ev.dtype(softmax) == ir.DataType.FLOAT
    assert ev.dtype(node(model, "/model/layers.0/self_attn/IsNaN").outputs[0]) == ir.DataType.BOOL
    assert ev.shape(node(model, "/model/layers.0/self_attn/o_proj/MatMul").outputs[0]) == dims(
        "batch_size", "sequence_length", 128
    )


def test_the_expand_target_idiom_is_followed(export):
    model, ev = export
    target = node(model, "/model/Where").outputs[0]  # Where(shape == -1, 1, shape)
    assert ev.values(target, "target") == dims(
        "batch_size", 1, "sequence_length", "past_sequence_length + sequence_length"
    )


def test_the_mask_is_causal_and_reads_attention_mask(export):
    model, ev = export
    mask = node(model, "/model/layers.0/self_attn/Where_2").outputs[0]  # Where(sliced, 0, -inf)
    cond = mask_condition(
        ev,
        mask,
        query_len=dims("sequence_length")[0],
        kv_len=dims("past_sequence_length + sequence_length")[0],
    )
    facts = mask_facts(cond, past=dims("past_sequence_length")[0])
    assert facts.causal and facts.window is None and facts.padding == "attention_mask"


def test_a_slice_end_that_is_not_the_axis_length_is_not_followed():
    x = ir.val("x", ir.DataType.FLOAT, ["batch", 8])
    n = ir.val("n", ir.DataType.INT64, [])
    ends = ir.node("Unsqueeze", [n, ir.Value(name="axes", const_value=ir.tensor(np.array([0], np.int64)))])
    starts = ir.Value(name="starts", const_value=ir.tensor(np.array([0], np.int64)))
    axes = ir.Value(name="axis", const_value=ir.tensor(np.array([0], np.int64)))
    sliced = ir.node("Slice", [x, starts, ends.outputs[0], axes])
    ir.Graph([x, n], [sliced.outputs[0]], nodes=[ends, sliced], opset_imports={"": 18})
    ev = SymbolicEvaluator()
    with pytest.raises(Unprovable, match="Slice end"):
        ev.eval(sliced.outputs[0])


@pytest.mark.parametrize(
    ("attrs", "sizes", "want"),
    [({"axis": -1}, [32, 96], [(32,), (96,)]), ({"axis": 2, "num_outputs": 2}, None, [(64,), (64,)])],
)
def test_a_split_of_activations_gives_each_part_its_shape(attrs, sizes, want):
    """phi3's fused gate/up projection, chunked in two: layers after it keep their shapes."""
    x = ir.val("x", ir.DataType.FLOAT, ["batch", "seq", 128])
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 18})
    inputs = [x]
    if sizes is not None:
        split = ir.Value(name="sizes", const_value=ir.tensor(np.array(sizes, np.int64), name="sizes"))
        graph.register_initializer(split)
        inputs.append(split)
    node = ir.Node("", "Split", inputs, ir.convenience.convert_attributes(attrs), num_outputs=2)
    graph.append(node)
    ev = SymbolicEvaluator()
    for output, (last,) in zip(node.outputs, want):
        assert output.shape is None
        assert ev.shape(output) == dims("batch", "seq", last)
