"""symbolic: dimensions, masks proven for every input, and what is refused."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache.passes.fusion._attention_facts import MaskFacts, mask_condition, mask_facts
from onnx_kvcache.passes.fusion._symbolic import (
    Affine,
    Symbol,
    SymbolicEvaluator,
    Unprovable,
    parse_dim,
    reshape_dims,
)

from builders.exported import build_decoder, exported_config

FIXTURE = pathlib.Path(__file__).parents[2] / "data" / "export_llama_opset23.onnx"
PAST, SEQ = Affine.of(Symbol.dim("past")), Affine.of(Symbol.dim("seq"))


@pytest.mark.parametrize(
    ("dim", "want"),
    [
        (4, Affine(const=4)),
        ("past + seq", PAST + SEQ),
        ("2*seq - 1", SEQ.scale(2) - 1),
        ("(past + seq)", Affine.of(Symbol.dim("(past + seq)"))),
    ],
)
def test_dimensions_are_affine_forms(dim, want):
    assert parse_dim(dim, lambda: Symbol.fresh(0)) == want


def test_unnamed_dimensions_equal_nothing():
    ev = SymbolicEvaluator()
    value = ir.val("x", ir.DataType.FLOAT, [None, None])
    first, second = ev.declared_shape(value)
    assert first != second


def attention_masks(model: ir.Model) -> list[tuple[ir.Node, MaskFacts]]:
    ev = SymbolicEvaluator()
    out = []
    for node in model.graph:
        if node.op_type == "Attention":
            cond = mask_condition(ev, node.inputs[3], query_len=SEQ, kv_len=PAST + SEQ)
            out.append((node, mask_facts(cond, past=PAST)))
    return out


def test_the_torch_export_mask_is_causal_and_padding():
    facts = {f for _, f in attention_masks(ir.load(FIXTURE))}
    assert facts == {MaskFacts(causal=True, window=None, padding="attention_mask")}


def test_gemma2_alternates_window_and_full_masks():
    facts = [f for _, f in attention_masks(build_decoder(exported_config("gemma2", num_layers=4)))]
    assert [f.window for f in facts] == [4, None, 4, None]
    assert all(f.causal and f.padding == "attention_mask" for f in facts)


def mask_graph(build) -> tuple[SymbolicEvaluator, ir.Value]:
    """A ``[1, 1, seq, past + seq]`` mask from ``build(tape, const, q_idx, kv_idx, mask)``."""
    ids = ir.val("input_ids", ir.DataType.INT64, ["batch", "seq"])
    cache = ir.val("past_key_values.0.key", ir.DataType.FLOAT, ["batch", 2, "past", 32])
    mask = ir.val("attention_mask", ir.DataType.INT64, ["batch", "total"])
    graph = ir.Graph([ids, cache, mask], [], nodes=[], opset_imports={"": 23})
    tape = ir.tape.Tape(graph)

    def const(array):
        return tape.initializer(ir.tensor(np.asarray(array), name=f"c{len(graph.initializers)}"))

    seq = tape.op("Squeeze", [tape.op("Shape", [ids], {"start": 1, "end": 2})])
    past = tape.op("Squeeze", [tape.op("Shape", [cache], {"start": 2, "end": 3})])
    zero, one = const(np.array(0)), const(np.array(1))
    q_idx = tape.op(
        "Unsqueeze", [tape.op("Add", [tape.op("Range", [zero, seq, one]), past]), const([0, 1, 3])]
    )
    total = tape.op("Add", [past, seq])
    kv_idx = tape.op("Unsqueeze", [tape.op("Range", [zero, total, one]), const([0, 1, 2])])
    return SymbolicEvaluator(), build(tape, const, q_idx, kv_idx, mask)


def test_an_additive_mask_with_minus_infinity_is_proven():
    def build(tape, const, q_idx, kv_idx, mask):
        causal = tape.op("LessOrEqual", [kv_idx, q_idx])
        return tape.op("Where", [causal, const(np.float32(0)), const(np.float32(-np.inf))])

    ev, mask = mask_graph(build)
    cond = mask_condition(ev, mask, query_len=SEQ, kv_len=PAST + SEQ)
    assert mask_facts(cond, past=PAST) == MaskFacts(causal=True)


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (
            lambda tape, const, q, kv, m: tape.op(
                "Where", [tape.op("LessOrEqual", [kv, q]), const(np.float32(0)), const(np.float32(-1e4))]
            ),
            "not 0 and a masking value",
        ),
        (
            lambda tape, const, q, kv, m: tape.op(
                "Or", [tape.op("LessOrEqual", [kv, q]), tape.op("Greater", [kv, q])]
            ),
            "disjunction",
        ),
        (
            lambda tape, const, q, kv, m: tape.op(
                "Equal",
                [tape.op("Cast", [tape.op("LessOrEqual", [kv, q])], {"to": ir.DataType.INT64}), const(1)],
            ),
            "Cast from bool to int",
        ),
    ],
    ids=["finite_fill", "disjunction", "bool_arithmetic"],
)
def test_what_cannot_be_followed_is_refused(build, reason):
    ev, mask = mask_graph(build)
    with pytest.raises(Unprovable, match=reason):
        mask_condition(ev, mask, query_len=SEQ, kv_len=PAST + SEQ)


def test_a_diagonal_off_the_cache_length_is_named():
    cond_of = attention_masks(build_decoder(exported_config("llama", num_layers=1)))[0][0]
    ev = SymbolicEvaluator()
    cond = mask_condition(ev, cond_of.inputs[3], query_len=SEQ, kv_len=PAST + SEQ)
    with pytest.raises(Unprovable, match=r"key <= query \+ past, not \+ the cache length past - 1"):
        mask_facts(cond, past=PAST - 1)


@pytest.mark.parametrize(
    ("dims", "target", "want"),
    [
        (
            (Affine.of(Symbol.dim("b")), SEQ, Affine(const=128)),
            (Affine.of(Symbol.dim("b")), SEQ, Affine(const=-1), Affine(const=32)),
            4,
        ),
        (
            (Affine.of(Symbol.dim("b")), Affine(const=2), Affine(const=2), PAST + SEQ, Affine(const=32)),
            (Affine.of(Symbol.dim("b")), Affine(const=-1), PAST + SEQ, Affine(const=32)),
            4,
        ),
    ],
)
def test_reshape_infers_minus_one(dims, target, want):
    out = reshape_dims(dims, target, allowzero=True)
    assert out[target.index(Affine(const=-1))] == Affine(const=want)


def test_reshape_flattens_lengths_into_their_product_and_splits_it_again():
    """An MoE block's ``[B, S, H] -> [-1, H] -> [E, B, -1, H]`` (optimum's gpt_oss): the flattened
    axis is one product symbol, and dividing it by ``B`` gives ``S`` back; an unknown length does
    not divide it."""
    batch = Affine.of(Symbol.dim("b"))
    hidden = Affine(const=64)
    (flat, _) = reshape_dims((batch, SEQ, hidden), (Affine(const=-1), hidden), allowzero=False)
    assert flat == Affine.of(Symbol.product([Symbol.dim("b"), Symbol.dim("seq")])) and str(flat) == "b*seq"
    split = reshape_dims(
        (Affine(const=4), flat, hidden), (Affine(const=4), batch, Affine(const=-1), hidden), allowzero=False
    )
    assert split == (Affine(const=4), batch, SEQ, hidden)
    with pytest.raises(Unprovable):
        reshape_dims((flat, hidden), (PAST, Affine(const=-1)), allowzero=False)


def test_weights_are_never_read(tmp_path):
    """A large initializer is its shape: its data (here a file that does not exist) is not read."""
    graph = ir.Graph([], [], nodes=[], opset_imports={"": 23})
    missing = ir.ExternalTensor(
        "missing.data",
        0,
        4096,
        ir.DataType.BOOL,
        shape=ir.Shape([1, 1, 64, 64]),
        name="big",
        base_dir=tmp_path,
    )
    big = ir.Value(name="big", const_value=missing)
    graph.register_initializer(big)
    tensor = SymbolicEvaluator().eval(big)
    assert tensor.shape == tuple(Affine(const=d) for d in (1, 1, 64, 64)) and not tensor.known
    with pytest.raises(Unprovable, match="too large"):
        tensor.element()


def _evaluate(build) -> object:
    """The element of the last value ``build(tape)`` makes, from a graph with input ``ids [seq]``."""
    ids = ir.val("ids", ir.DataType.INT64, ["seq"])
    graph = ir.Graph([ids], [], nodes=[], opset_imports={"": 18})
    tape = ir.tape.Tape(graph)
    out = build(tape, ids)
    for node in tape.nodes:
        graph.append(node)
    for value in tape.initializers:
        graph.register_initializer(value)
    return SymbolicEvaluator().eval(out)


@pytest.mark.parametrize(("fill", "want"), [(1.0, "true"), (0.0, "false"), (-2.5, "true")])
def test_a_uniform_float_cast_to_bool_is_where_it_is_not_zero(fill, want):
    """transformers 4.57's ``new_ones(seq, dtype=bool)``: Expand(1.0, [seq]) then Cast to bool."""
    from onnx_kvcache.passes.fusion._symbolic import FALSE, TRUE

    def build(tape, ids):
        one = tape.initializer(ir.tensor(np.array(fill, np.float32), name="fill"))
        shape = tape.op("Shape", [ids])
        return tape.op("Cast", [tape.op("Expand", [one, shape])], {"to": ir.DataType.BOOL})

    tensor = _evaluate(build)
    assert tensor.kind == "bool" and tensor.shape == (SEQ,)
    assert tensor.elem == (TRUE if want == "true" else FALSE)


def test_a_reshape_to_minus_one_by_one_keeps_the_elements():
    """``arange(seq).view(-1, 1)``: the -1 resolved, the element followed to the new axes."""
    from onnx_kvcache.passes.fusion._symbolic import axis

    def build(tape, ids):
        zero = tape.initializer(ir.tensor(np.array(0, np.int64), name="zero"))
        one = tape.initializer(ir.tensor(np.array(1, np.int64), name="one"))
        target = tape.initializer(ir.tensor(np.array([-1, 1], np.int64), name="target"))
        length = tape.op("Squeeze", [tape.op("Shape", [ids])])
        return tape.op("Reshape", [tape.op("Range", [zero, length, one]), target])

    tensor = _evaluate(build)
    assert tensor.shape == (SEQ, Affine(const=1)) and tensor.elem == Affine.of(axis(0))
