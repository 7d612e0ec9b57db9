"""Rules that once disagreed with onnxruntime (a reviewer's four cases), each right or refused now.

Each case builds the small graph, shows the evaluator's old claim is gone, and where the
evaluator still answers, checks the answer against onnxruntime CPU at concrete sizes (0 and 1
among them). A refusal (Unprovable, or values left unknown) is always sound.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir
import pytest
import surgery
from test_symbolic_rules import Graph, check

from decoding import count
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.passes.fusion import _opsets as opsets
from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode
from onnx_kvcache.passes.fusion._symbolic import SymbolicEvaluator, Unprovable
from onnx_kvcache.passes.fusion._symbolic_values import Affine, Conj, Le, Symbol, axis
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass
from onnx_kvcache.passes.fusion.sdpa_fusion import DecomposedAttentionFusionPass, match_decomposed

from builders.exported import ExportStyle, build_decoder, exported_config

I64 = ir.DataType.INT64
INT64_MAX = np.iinfo(np.int64).max


def _run(model: ir.Model, feeds: dict) -> np.ndarray:
    session = create_session(model)
    names = {i.name for i in session.get_inputs()}
    return np.asarray(session.run(None, {k: v for k, v in feeds.items() if k in names})[0])


def _feeds(dims: dict) -> dict:
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((dims["A"], dims["B"], dims["C"])).astype(np.float32),
        "m": rng.integers(0, 2, (dims["R"], dims["K"])).astype(np.int64),
        "ids": rng.integers(0, 9, dims["S"]).astype(np.int64),
    }


SIZES = [
    {"A": a, "B": 2, "C": 3, "R": r, "K": k, "S": s}
    for a, r, k, s in [(1, 1, 0, 0), (1, 2, 1, 0), (2, 1, 5, 1), (1, 3, 2, 3), (2, 2, 4, 7), (1, 1, 3, 3)]
]


# ---- Softmax: opset 12's default axis is 1, over every axis from it at once ----


def _softmax(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    e = np.exp(x - x.max(axis=axes, keepdims=True))
    return e / e.sum(axis=axes, keepdims=True)


@pytest.mark.parametrize(
    ("version", "given", "per_row"),
    [(12, None, False), (12, -1, True), (12, 3, True), (12, 2, False), (13, None, True), (23, None, True)],
)
def test_softmax_axis_is_read_as_the_opset_computes_it(version, given, per_row):
    x = ir.val("x", ir.DataType.FLOAT, [2, 3, 4, 5])
    node = ir.node("Softmax", [x], {"axis": given} if given is not None else None, name="sm")
    node.outputs[0].name = "y"
    graph = ir.Graph([x], [node.outputs[0]], nodes=[node], opset_imports={"": version})
    assert (opsets.softmax_axis(node, 4) == 3) is per_row
    data = np.random.default_rng(1).standard_normal((2, 3, 4, 5)).astype(np.float32)
    got = create_session(ir.Model(graph, ir_version=8)).run(None, {"x": data})[0]
    agrees = np.allclose(got, _softmax(data, (3,)), atol=1e-6)
    assert agrees is per_row  # onnxruntime: one softmax per row exactly where the rule says so


def _decoder_without_softmax_axis(version: int) -> ir.Model:
    model = build_decoder(
        exported_config("llama", num_layers=2, vocab_size=300, exported=ExportStyle(opset=20))
    )
    for node in model.graph:
        if node.op_type == "Softmax":
            node.attributes.pop("axis", None)
    model.opset_imports[""] = version
    return model


def test_a_softmax_without_axis_below_opset_13_is_refused():
    """Once both layers fused: opset 12 normalizes over heads, queries and keys together. (The
    pass refuses such a model by its opset first; the softmax rule refuses it on its own.)"""
    model = _decoder_without_softmax_axis(12)
    candidates = [n for n in model.graph if DecomposedAttentionFusionPass().is_candidate(n)]
    assert len(candidates) == 2
    ev = SymbolicEvaluator()
    for node in candidates:
        with pytest.raises(Unprovable, match=r"\(no axis, opset 12\) is not over the last axis"):
            match_decomposed(ev, model.graph, node)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fusion = DecomposedAttentionFusionPass()
        fusion(model)
    assert fusion.fused == 0 and len(fusion.report.refusals) == 2
    assert count(model, "GroupQueryAttention") == 0


def test_a_softmax_without_axis_from_opset_13_fuses():
    model = _decoder_without_softmax_axis(20)
    assert DecomposedAttentionFusionPass()(model).modified
    assert count(model, "GroupQueryAttention") == 2


# ---- Slice from a symbolic negative start: m[:, -S:] ----


def _tail(g: Graph, extra: int) -> ir.Value:
    """``m[:, -(S + extra):]``, ``S`` the length of ``ids``."""
    start = g.op("Neg", [g.op("Shape", [g.ids])])
    if extra:
        start = g.op("Sub", [start, g.const(np.array([extra]))])
    return g.op("Slice", [g.m, start, g.const(np.array([INT64_MAX])), g.const(np.array([1]))])


def test_a_slice_from_minus_a_length_is_not_that_many_more():
    """``m[:, -S:]`` is ``min(S, K)`` columns (all ``K`` at ``S = 0``), once said ``K + S``."""
    g = Graph()
    out = _tail(g, 0)
    model = g.model(out)
    try:
        shape = SymbolicEvaluator().eval(out).shape
    except Unprovable:
        return
    k, s = Affine.of(Symbol.dim("K")), Affine.of(Symbol.dim("S"))
    assert shape[1] != k + s
    for dims in SIZES:  # whatever it says instead holds
        feeds = _feeds(dims)
        check(SymbolicEvaluator().eval(out), _run(model, feeds), dims, feeds)


@pytest.mark.parametrize("extra", [1, 3])
def test_a_slice_from_a_start_proven_negative_counts_from_the_end(extra):
    g = Graph()
    out = _tail(g, extra)
    model = g.model(out)
    tensor = SymbolicEvaluator().eval(out)
    for dims in SIZES:
        feeds = _feeds(dims)
        got = _run(model, feeds)
        assert got.shape[1] == min(dims["K"], dims["S"] + extra)
        check(tensor, got, dims, feeds)


# ---- Cast to a narrower integer type wraps ----


def _wrapped(g: Graph, to: ir.DataType) -> ir.Value:
    """``Cast(Cast(Range(0, K) - 3, to), int64) <= 0``."""
    shifted = g.op("Sub", [g.arange(g.m, 1), g.const(np.int64(3))])
    back = g.op("Cast", [g.op("Cast", [shifted], to=to)], to=I64)
    return g.op("LessOrEqual", [back, g.const(np.int64(0))])


@pytest.mark.parametrize("to", [ir.DataType.UINT8, ir.DataType.UINT32, ir.DataType.INT8, ir.DataType.INT32])
def test_a_narrowing_cast_does_not_keep_values_it_wraps(to):
    """``@0 - 3 <= 0`` (true at 0..3) was said of uint8's wrapped values (true only at 3)."""
    g = Graph()
    out = _wrapped(g, to)
    model = g.model(out)
    tensor = SymbolicEvaluator().eval(out)
    assert tensor.elem != Conj.of(Le(Affine.of(axis(0)) - 3))
    for dims in SIZES:
        feeds = _feeds(dims)
        check(tensor, _run(model, feeds), dims, feeds)


def test_a_narrowing_cast_keeps_constants_the_type_holds():
    g = Graph()
    out = g.op("Cast", [g.const(np.array([3, -2, 7], np.int64))], to=ir.DataType.INT8)
    g.model(out)
    tensor = SymbolicEvaluator().eval(out)
    assert tensor.values == tuple(Affine(const=v) for v in (3, -2, 7))
    wrapped = Graph()
    out = wrapped.op("Cast", [wrapped.const(np.array([3, -2, 7], np.int64))], to=ir.DataType.UINT8)
    wrapped.model(out)
    assert SymbolicEvaluator().eval(out).values is None


# ---- Squeeze without axes removes the axes of length 1 at run time ----


def test_a_squeeze_without_axes_of_symbolic_lengths_is_refused():
    """``Squeeze(m)`` of ``m [R, K]`` is rank 1 when ``R`` is 1: once said rank 2."""
    g = Graph()
    out = g.op("Squeeze", [g.m])
    model = g.model(out)
    with pytest.raises(Unprovable):
        SymbolicEvaluator().eval(out)
    feeds = _feeds({"A": 1, "B": 1, "C": 1, "R": 1, "K": 3, "S": 1})
    assert _run(model, feeds).shape == (3,)


def test_a_squeeze_without_axes_of_constant_lengths_is_followed():
    g = Graph()
    grid = g.op("Unsqueeze", [g.op("Shape", [g.x]), g.const(np.array([0]))])  # [1, 3]
    out = g.op("Squeeze", [grid])
    model = g.model(out)
    tensor = SymbolicEvaluator().eval(out)
    feeds = _feeds(SIZES[2])
    assert tensor.shape == (Affine(const=3),)
    check(tensor, _run(model, feeds), SIZES[2], feeds)


# ---- the rules read axes in the form the opset defines ----


@pytest.mark.parametrize(
    ("version", "as_input", "follows"),
    [(12, False, True), (12, True, False), (13, True, True), (13, False, False)],
)
def test_squeeze_axes_are_read_in_the_opsets_form(version, as_input, follows):
    g = Graph()
    g.opsets[""] = version
    unit = g.op("Reshape", [g.op("Shape", [g.x]), g.const(np.array([1, 3]))])
    axes = {"axes": [0]} if not as_input else {}
    out = g.op("Squeeze", [unit, *([g.const(np.array([0]))] if as_input else [])], **axes)
    g.model(out)
    try:
        tensor = SymbolicEvaluator().eval(out)
    except Unprovable as reason:
        assert not follows and "opset" in str(reason)
        return
    assert follows and tensor.shape == (Affine(const=3),)


# ---- a declared shape the operator's own rule contradicts ----


def test_a_value_info_that_contradicts_its_operator_is_refused_naming_both():
    """The rotated query declared with 8 heads where its Add computes 4 (from its declared inputs):
    once trusted (the proof reads the query's heads), now a refusal that names both shapes."""
    model = surgery.load("torch-tf4.57/dynamo-opset18-optimize/llama")
    queries = [
        n.outputs[0]
        for n in model.graph
        if n.op_type == "Add" and n.outputs[0].name in ("add_236", "add_541")
    ]
    for query in queries:
        assert query.shape[1] == 4
        query.shape = ir.Shape([query.shape[0], 8, query.shape[2], query.shape[3]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = GqaFusionPass()(model).report
    assert report.fused == 0 and report.refusals
    refusal = report.refusals[0]
    assert refusal.code is FusionRefusalCode.MALFORMED, refusal.text
    assert "'add_236' is declared [batch, 8, seq, 16] but Add node" in refusal.text
    assert "computes [batch, 4, seq, 16]" in refusal.text


def test_an_integer_value_info_that_contradicts_its_operator_is_refused():
    g = Graph()
    shape = g.op("Shape", [g.x])
    shape.shape = ir.Shape([4])  # Shape of a 3-D tensor: 3 elements
    g.model(shape)
    with pytest.raises(Unprovable, match=r"declared \[4\] but Shape node 'n0' computes \[3\]"):
        SymbolicEvaluator().eval(shape)


def test_a_value_info_that_names_a_length_is_trusted():
    """A name the computation does not prove different (``seq`` where it computes ``S``) is the
    model's word for that length, as before."""
    g = Graph()
    out = g.op("Unsqueeze", [g.arange(g.m, 1), g.const(np.array([0]))])
    out.shape = ir.Shape([1, "total"])
    g.model(out)
    assert SymbolicEvaluator().eval(out).shape[1] == Affine.of(Symbol.dim("K"))


def test_an_export_relabelled_below_its_opset_is_refused_as_malformed():
    """An opset-18 export relabelled 17: its ReduceMean reads axes as an input, which opset 17 does
    not define (onnxruntime does not load it); the refusal names the node, not a shape lost after it."""
    model = build_decoder(exported_config("optimum-llama", num_layers=2, vocab_size=300))
    model.opset_imports[""] = 17
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = GqaFusionPass()(model).report
    assert report.fused == 0 and report.refusals
    for refusal in report.refusals:
        assert refusal.code is FusionRefusalCode.MALFORMED
        assert "ReduceMean node" in refusal.text and "opset 17 reads as an attribute" in refusal.text


# ---- CumSum: exclusive, reverse, the axis an input (negative, int32, 0-D or 1-D) ----

I32 = ir.DataType.INT32


def _cumsum_source(g: Graph, source: str) -> ir.Value:
    """What the CumSum sums: ``m`` itself, moved, cast, cut, or a constant of its shape."""
    if source == "entries":
        return g.m
    if source == "transposed":
        return g.op("Transpose", [g.m], perm=[1, 0])
    if source == "unsqueezed":
        return g.op("Unsqueeze", [g.m, g.const(np.array([0]))])
    if source == "int32":
        return g.op("Cast", [g.m], to=I32)
    if source == "int32 input":  # an int32 attention mask
        g.m = ir.val("m", I32, ["R", "K"])
        return g.m
    if source == "cut":  # m[:, 1:]
        return g.op(
            "Slice", [g.m, g.const(np.array([1])), g.const(np.array([INT64_MAX])), g.const(np.array([1]))]
        )
    fill = ir.tensor(np.array([3], np.int32 if source == "constant32" else np.int64))
    return g.op("ConstantOfShape", [g.op("Shape", [g.m])], value=fill)


def _cumsum_graph(source: str, along: int, axis_form: str, exclusive: int, reverse: int) -> tuple:
    g = Graph()
    x = _cumsum_source(g, source)
    dtype = np.int32 if axis_form.startswith("int32") else np.int64
    shaped = np.array([along], dtype) if axis_form.endswith("1-D") else np.array(along, dtype)
    out = g.op("CumSum", [x, g.const(shaped)], exclusive=exclusive, reverse=reverse)
    return g, out


def _cumsum_feeds(dims: dict, rng: np.random.Generator, values: str, dtype: type) -> dict:
    feeds = _feeds(dims)
    shape = (dims["R"], dims["K"])
    if values == "0/1":
        feeds["m"] = rng.integers(0, 2, shape).astype(dtype)
    elif values == "small":
        feeds["m"] = rng.integers(-5, 6, shape).astype(dtype)
    else:  # past int32's range when summed
        feeds["m"] = rng.integers(2**30, 2**31 - 1, shape).astype(dtype)
    return feeds


CUMSUM_SOURCES = [
    "entries",
    "transposed",
    "unsqueezed",
    "int32",
    "int32 input",
    "cut",
    "constant",
    "constant32",
]
ANSWERS = {("entries", 1), ("entries", -1), ("transposed", 0), ("transposed", -2), ("unsqueezed", 2)}
"""(source, axis) of running counts of ``m``'s rows the rule follows (forward only)."""


@pytest.mark.parametrize("source", CUMSUM_SOURCES)
@pytest.mark.parametrize(("exclusive", "reverse"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_a_cumsum_is_what_onnxruntime_computes_or_declined(source, exclusive, reverse):
    """Every axis (negative included), as an int64 or int32 input, 0-D or 1-D: where the rule
    answers, its shape and elements are onnxruntime's at every size (0 included) on 0/1 masks,
    small integers of either sign and large ones. The forward running counts of ``m``'s rows and
    int64 constants' counts (any direction) are answered; a reverse count of entries, and any
    narrower type (whose running sum wraps: an int32 mask of large entries), are declined."""
    rng = np.random.default_rng(len(source) + 2 * exclusive + reverse)
    rank = 3 if source == "unsqueezed" else 2
    answered = 0
    for along in range(-rank, rank):
        for axis_form in ("int64 0-D", "int64 1-D", "int32 0-D", "int32 1-D"):
            g, out = _cumsum_graph(source, along, axis_form, exclusive, reverse)
            model = g.model(out)
            try:
                tensor = SymbolicEvaluator().eval(out)
            except Unprovable:
                tensor = None
            if tensor is None or tensor.elem is None:
                follows = source == "constant" or ((source, along) in ANSWERS and not reverse)
                assert not follows or source in ("int32", "int32 input", "constant32"), (source, along)
                continue
            answered += 1
            for dims in SIZES:
                for values in ("0/1", "small", "large"):
                    feeds = _cumsum_feeds(
                        dims, rng, values, np.int32 if source == "int32 input" else np.int64
                    )
                    assert check(tensor, _run(model, feeds), dims, feeds) or 0 in dims.values()
    assert (
        answered
        or source in ("cut", "int32", "int32 input", "constant32")
        or (reverse and source != "constant")
    )


# ---- found by benchmarks/symbolic_fuzz.py ----


def test_a_concat_whose_first_part_may_be_empty_is_not_shaped_by_it():
    """``Concat(m [R, K], ids[None] [1, S], axis=1)``: onnxruntime skips an empty part whatever its
    other lengths, so at ``K = 0`` it gives ``[1, S]``. Once said ``[R, K + S]``."""
    g = Graph()
    out = g.op("Concat", [g.m, g.op("Unsqueeze", [g.ids, g.const(np.array([0]))])], axis=1)
    model = g.model(out)
    tensor = SymbolicEvaluator().eval(out)
    r, k, s = (Affine.of(Symbol.dim(d)) for d in "RKS")
    assert tensor.shape != (r, k + s)
    for dims in [
        {"A": 1, "B": 1, "C": 1, "R": 2, "K": 0, "S": 3},
        {"A": 1, "B": 1, "C": 1, "R": 1, "K": 2, "S": 3},
    ]:
        feeds = _feeds(dims)
        check(tensor, _run(model, feeds), dims, feeds)


def test_a_concat_of_parts_proven_alike_keeps_its_shape():
    g = Graph()
    out = g.op("Concat", [g.m, g.op("Neg", [g.m])], axis=1)
    g.model(out)
    r, k = (Affine.of(Symbol.dim(d)) for d in "RK")
    assert SymbolicEvaluator().eval(out).shape == (r, k.scale(2))


def test_a_nonzero_of_a_scalar_has_one_row():
    """onnxruntime's NonZero of a 0-D tensor is ``[1, n]``; once said ``[0, n]``."""
    g = Graph()
    out = g.op("NonZero", [g.op("Gather", [g.op("Shape", [g.m]), g.const(np.int64(1))])])
    model = g.model(out)
    tensor = SymbolicEvaluator().eval(out)
    assert tensor.shape[0] == Affine(const=1)
    for dims in SIZES:
        feeds = _feeds(dims)
        assert _run(model, feeds).shape == (1, int(dims["K"] != 0))


@pytest.mark.parametrize("value", [2**53 + 1, INT64_MAX - 1, -(2**62) - 1])
def test_an_int64_sum_beyond_a_double_is_not_claimed(value):
    """onnxruntime sums int64 through doubles: ``ReduceSum([2**53 + 1])`` is ``2**53``. Once
    claimed exactly."""
    g = Graph()
    filled = g.op("ConstantOfShape", [g.const(np.array([1]))], value=ir.tensor(np.array([value], np.int64)))
    out = g.op("ReduceSum", [filled], keepdims=0)
    model = g.model(out)
    tensor = SymbolicEvaluator().eval(out)
    assert tensor.elem is None and tensor.values is None
    assert int(_run(model, _feeds(SIZES[0]))) != value


def test_a_small_int64_sum_is_still_claimed():
    g = Graph()
    filled = g.op("ConstantOfShape", [g.op("Shape", [g.m])], value=ir.tensor(np.array([3], np.int64)))
    out = g.op("ReduceSum", [filled, g.const(np.array([1]))], keepdims=0)
    model = g.model(out)
    tensor = SymbolicEvaluator().eval(out)
    assert tensor.elem == Affine.of(Symbol.dim("K")).scale(3)
    for dims in SIZES:
        feeds = _feeds(dims)
        check(tensor, _run(model, feeds), dims, feeds)


def test_the_evaluators_constants_are_its_own():
    """A small constant read by one evaluator is not kept for the next (one graph's, not the
    process's): two evaluators read the same bytes each."""
    g = Graph()
    out = g.op(
        "Add", [g.op("Shape", [g.m]), g.op("Constant", [], value=ir.tensor(np.array([1, 2], np.int64)))]
    )
    g.model(out)
    first, second = SymbolicEvaluator(), SymbolicEvaluator()
    assert first.eval(out) == second.eval(out)
    assert first._constants and second._constants
    assert next(iter(first._constants.values())) is not next(iter(second._constants.values()))
