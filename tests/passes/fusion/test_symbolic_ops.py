"""The evaluator's rules for graphs without value_info (``_symbolic_ops``), on a real optimum export."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache.passes.fusion._attention_facts import mask_condition, mask_facts
from onnx_kvcache.passes.fusion._symbolic import (
    Affine,
    Conj,
    MaskAt,
    Symbol,
    SymbolicEvaluator,
    Unprovable,
    axis,
    parse_dim,
)

FIXTURE = pathlib.Path(__file__).parents[2] / "data" / "optimum_llama" / "model.onnx"


@pytest.fixture(scope="module")
def export():
    model = ir.load(FIXTURE)
    return model, SymbolicEvaluator()


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


def test_a_slice_end_that_is_not_the_axis_length_is_a_length_of_its_own():
    x = ir.val("x", ir.DataType.FLOAT, ["batch", 8])
    n = ir.val("n", ir.DataType.INT64, [])
    ends = ir.node("Unsqueeze", [n, ir.Value(name="axes", const_value=ir.tensor(np.array([0], np.int64)))])
    starts = ir.Value(name="starts", const_value=ir.tensor(np.array([0], np.int64)))
    axes = ir.Value(name="axis", const_value=ir.tensor(np.array([0], np.int64)))
    sliced = ir.node("Slice", [x, starts, ends.outputs[0], axes])
    ir.Graph([x, n], [sliced.outputs[0]], nodes=[ends, sliced], opset_imports={"": 18})
    ev = SymbolicEvaluator()
    rows, _ = ev.shape(sliced.outputs[0])  # ONNX's inference of the Slice: its rank, lengths unknown
    assert rows != dims("batch")[0] and rows.terms[0][0].kind.name == "FRESH"


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


def _const(name: str, array: np.ndarray) -> ir.Value:
    return ir.Value(name=name, const_value=ir.tensor(array))


@pytest.mark.parametrize(
    ("numerator", "denominator", "want"),
    [(129, 2, 64), (128, 2, 64), (7, 7, 1), (0, 3, 0)],
)
def test_an_integer_div_of_constants_floors_as_onnx_truncates(numerator, denominator, want):
    # torch's chunk: (size + 1) / 2 (phi3's fused gate/up projection)
    div = ir.node(
        "Div", [_const("a", np.array(numerator, np.int64)), _const("b", np.array(denominator, np.int64))]
    )
    ir.Graph([], [div.outputs[0]], nodes=[div], opset_imports={"": 18})
    assert SymbolicEvaluator().values(div.outputs[0], "quotient") == (Affine(const=want),)


def test_an_integer_div_of_a_symbolic_length_still_needs_divisibility():
    n = ir.val("n", ir.DataType.INT64, [1])
    shape = ir.node("Shape", [ir.val("x", ir.DataType.FLOAT, ["seq"])])
    div = ir.node("Div", [shape.outputs[0], _const("two", np.array(2, np.int64))])
    ir.Graph([n, shape.inputs[0]], [div.outputs[0]], nodes=[shape, div], opset_imports={"": 18})
    with pytest.raises(Unprovable, match="divisible"):
        SymbolicEvaluator().values(div.outputs[0], "quotient")


@pytest.mark.parametrize(
    ("array", "want"),
    [
        (np.array(0.0, np.float32), 0),  # torch's unoptimized dynamo Range start / step
        (np.array(1.0, np.float32), 1),
        (np.array(3, np.int32), 3),
        (np.array(0.5, np.float32), None),  # not an integer: not followed
    ],
)
def test_castlike_of_a_constant_to_an_integer_keeps_integral_values(array, want):
    like = ir.val("like", ir.DataType.INT64, [])
    cast = ir.node("CastLike", [_const("c", array), like])
    ir.Graph([like], [cast.outputs[0]], nodes=[cast], opset_imports={"": 18})
    ev = SymbolicEvaluator()
    if want is None:
        with pytest.raises(Unprovable):
            ev.values(cast.outputs[0], "cast")
    else:
        assert ev.values(cast.outputs[0], "cast") == (Affine(const=want),)


def _flat_lookup(rows: str, key_length: str) -> tuple[ir.Value, list[ir.Node], list[ir.Value]]:
    """TorchScript's padding lookup: Gather(Flatten(mask), b * width + j), b over ``rows``
    and j over ``key_length`` (the mask is declared ``[batch, total]``)."""
    mask = ir.val("attention_mask", ir.DataType.INT64, ["batch", "total"])
    b_len = ir.val("b_len", ir.DataType.FLOAT, [rows])
    j_len = ir.val("j_len", ir.DataType.FLOAT, [key_length])
    nodes: list[ir.Node] = []

    def add(op, inputs, **attrs):
        node = ir.node(op, inputs, attributes=attrs)
        nodes.append(node)
        return node.outputs[0]

    zero, one = _const("zero", np.array(0, np.int64)), _const("one", np.array(1, np.int64))
    b = add("Range", [zero, add("Squeeze", [add("Shape", [b_len])]), one])
    j = add("Range", [zero, add("Squeeze", [add("Shape", [j_len])]), one])
    b = add("Unsqueeze", [b, _const("ax1", np.array([1], np.int64))])  # [rows, 1]
    width = add("Gather", [add("Shape", [mask]), _const("i1", np.array(1, np.int64))], axis=0)
    flat = add("Flatten", [add("Cast", [mask], to=ir.DataType.BOOL)], axis=2)
    index = add("Add", [j, add("Mul", [b, width])])
    out = add("Gather", [flat, index], axis=0)
    return out, nodes, [mask, b_len, j_len]


@pytest.mark.parametrize("key_length", ["total", "past + seq"])
def test_the_flat_padding_lookup_reads_the_mask_over_any_key_range(key_length):
    out, nodes, inputs = _flat_lookup("batch", key_length)
    ir.Graph(inputs, [out], nodes=nodes, opset_imports={"": 18})
    looked_up = SymbolicEvaluator().eval(out)  # [batch, key, 1]: attention_mask[b, j] != 0
    assert looked_up.shape == dims("batch", key_length, 1)
    assert looked_up.elem == Conj.of(MaskAt("attention_mask", Affine.of(axis(0)), Affine.of(axis(1))))


def test_the_flat_padding_lookup_needs_the_rows_of_the_mask():
    out, nodes, inputs = _flat_lookup("rows", "total")  # rows != batch: may read another row
    ir.Graph(inputs, [out], nodes=nodes, opset_imports={"": 18})
    ev = SymbolicEvaluator()
    assert ev.eval(out).elem is None
