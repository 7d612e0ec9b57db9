"""Every row of the evaluator's rule table against onnxruntime, on random inputs (a property test).

For each operator of :data:`RULES`, a builder writes a small graph the way exporters use the
operator (over graph inputs with named dimensions: float data ``x [A, B, C]``, an integer
2-D input ``m [R, K]`` read by entries, ``ids [S]`` for lengths), with random parameters. The
evaluator's answer (shape, and elements where it claims them: an integer element or values,
a condition, a stack of index forms, a mask) is made concrete for random dimension sizes and
input values and must equal what onnxruntime computes. A rule may decline (values unknown, or
Unprovable), but over the draws each row must answer at least once. The graphs' base and the
comparison with onnxruntime are the differential fuzz's (benchmarks/symbolic_fuzz.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import pytest

from benchmark_scripts import load
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.passes.fusion._symbolic import SymbolicEvaluator, Unprovable
from onnx_kvcache.passes.fusion._symbolic_rules import MICROSOFT, RULES
from onnx_kvcache.passes.fusion._symbolic_values import SymTensor

fuzz = load("symbolic_fuzz")
graphs = fuzz.graphs
DRAWS = 8
I64, F32, BOOL, NARROW = graphs.I64, graphs.F32, graphs.BOOL, graphs.NARROW


class Graph(graphs.Graph):
    """The fuzz's graph at opset 23, with initializers only and ranges from 0."""

    def __init__(self) -> None:
        super().__init__(23)

    def length(self, of: ir.Value, axis: int) -> ir.Value:
        """A scalar dimension of ``of``."""
        return self.op("Squeeze", [self.op("Shape", [of], start=axis, end=axis + 1)])

    def arange(self, of: ir.Value, axis: int, start: int = 0) -> ir.Value:
        return self.op("Range", [self.const(np.int64(start)), self.length(of, axis), self.const(np.int64(1))])


def check(tensor: SymTensor, got: np.ndarray, dims: dict, feeds: dict) -> bool:
    """Assert what the evaluator says of ``tensor`` holds of ``got`` (the fuzz's comparison: a
    Mismatch fails the test); whether it said elements."""
    run = fuzz.Run(dims, feeds, exact=False)
    fuzz.check_shape(tensor, got, run)
    try:
        return fuzz.check_elements(tensor, got, run) > 0
    except fuzz.Unbound:  # the answer reads a symbol with no concrete value (a fresh dimension)
        return False


# ---- the cases: one builder per row ----

Builder = Callable[[Graph, np.random.Generator], ir.Value]


def _vector(g: Graph, rng) -> ir.Value:
    """A shape vector: dims of x, maybe with a constant."""
    return g.op("Concat", [g.op("Shape", [g.x]), g.const(rng.integers(1, 4, 1))], axis=0)


def _index_grid(g: Graph, rng) -> ir.Value:
    """An int tensor [R, K] whose element is an affine form of its indices (and a lookup)."""
    rows = g.op("Unsqueeze", [g.arange(g.m, 0), g.const(np.array([1]))])
    cols = g.op("Unsqueeze", [g.arange(g.m, 1), g.const(np.array([0]))])
    scaled = g.op("Mul", [rows, g.const(np.int64(rng.integers(-2, 3)))])
    return g.op("Add", [scaled, cols])


def _condition(g: Graph, rng) -> ir.Value:
    """A bool [R, K]: a comparison of index forms, maybe AND the entries of m."""
    grid = _index_grid(g, rng)
    cut = g.op("LessOrEqual", [grid, g.const(np.int64(rng.integers(-3, 6)))])
    if rng.integers(2):
        return g.op("And", [cut, g.op("Cast", [g.m], to=BOOL)])
    return cut


def _mask(g: Graph, rng) -> ir.Value:
    zero, low = (
        g.const(np.float32(0)),
        g.const(np.float32(-np.inf if rng.integers(2) else np.finfo(np.float32).min)),
    )
    return g.op("Where", [_condition(g, rng), zero, low])


def _unary(op: str) -> Builder:
    return lambda g, rng: g.op(op, [g.op("Abs", [g.x])] if op in ("Sqrt", "Log") else [g.x])


def _binary(op: str) -> Builder:
    def build(g: Graph, rng) -> ir.Value:
        if rng.integers(2):
            ints = _index_grid(g, rng)
            other = g.const(np.int64(rng.integers(1, 4)))
            return g.op(op, [ints, other] if rng.integers(2) else [other, ints])
        return g.op(op, [g.x, g.op("Abs", [g.op("ReduceMean", [g.x, g.const(np.array([1]))])])])

    return build


def _compare(op: str) -> Builder:
    def build(g: Graph, rng) -> ir.Value:
        if rng.integers(3) == 0:  # of vectors
            return g.op(op, [g.op("Shape", [g.x]), g.const(rng.integers(1, 4, 3))])
        return g.op(op, [_index_grid(g, rng), g.const(np.int64(rng.integers(0, 6)))])

    return build


def _reduce(op: str) -> Builder:
    def build(g: Graph, rng) -> ir.Value:
        if op in ("ReduceSum", "ReduceMax", "ReduceMin") and rng.integers(3):  # integers, mostly
            shape = g.op(
                "Concat",
                [g.const(np.array([int(rng.integers(1, 4))])), g.op("Shape", [g.m], start=1)],
                axis=0,
            )
            filled = g.op("ConstantOfShape", [shape], value=ir.tensor(np.array([3], np.int64)))
            return g.op(
                op, [filled, g.const(np.array([int(rng.integers(0, 2))]))], keepdims=int(rng.integers(2))
            )
        return g.op(op, [g.x, g.const(np.array([int(rng.integers(-3, 3))]))], keepdims=int(rng.integers(2)))

    return build


def _gather(g: Graph, rng) -> ir.Value:
    choice = rng.integers(3)
    if choice == 0:
        return g.op("Gather", [g.op("Shape", [g.x]), g.const(np.int64(rng.integers(-3, 3)))])
    if choice == 1:  # the entries of m at a range of columns
        return g.op("Gather", [g.m, g.arange(g.m, 1)], axis=1)
    return g.op("Gather", [g.x, g.const(rng.integers(0, 1, (2, 2)))], axis=0)


def _index_stack(g: Graph) -> ir.Value:
    """An int64 [R, K, 2]: the (row, column) of every entry of m."""
    rows = g.op(
        "Unsqueeze", [g.op("Unsqueeze", [g.arange(g.m, 0), g.const(np.array([1]))]), g.const(np.array([2]))]
    )
    cols = g.op(
        "Unsqueeze", [g.op("Unsqueeze", [g.arange(g.m, 1), g.const(np.array([0]))]), g.const(np.array([2]))]
    )
    shape = g.op("Concat", [g.op("Shape", [g.m]), g.const(np.array([1]))], axis=0)
    return g.op("Concat", [g.op("Expand", [rows, shape]), g.op("Expand", [cols, shape])], axis=-1)


def _gather_nd(g: Graph, rng) -> ir.Value:
    stack = _index_stack(g)
    data = g.m if rng.integers(2) else _index_grid(g, rng)
    return g.op("GatherND", [data, stack])


def _scatter_nd(g: Graph, rng) -> ir.Value:
    stack = _index_stack(g)
    updates = _index_grid(g, rng)
    return g.op("ScatterND", [g.op("Mul", [g.m, g.const(np.int64(0))]), stack, updates])


def _trilu(g: Graph, rng) -> ir.Value:
    k = g.const(np.int64(rng.integers(-2, 3)))
    upper = int(rng.integers(2))
    shape = g.op("Shape", [g.m])
    choice = rng.integers(3)
    if choice == 0:
        fill = ir.tensor(np.array([np.finfo(np.float32).min], np.float32))
    elif choice == 1:
        fill = ir.tensor(np.array([True]))
    else:
        fill = ir.tensor(np.array([0.0], np.float32))
    return g.op("Trilu", [g.op("ConstantOfShape", [shape], value=fill), k], upper=upper)


def _tile(g: Graph, rng) -> ir.Value:
    repeats = g.const(rng.integers(1, 3, 2))
    source = (
        _index_grid(g, rng)
        if rng.integers(2)
        else g.op("Unsqueeze", [g.arange(g.m, 1), g.const(np.array([0]))])
    )
    return g.op("Tile", [source, repeats])


def _nonzero(g: Graph, rng) -> ir.Value:
    lengths = g.const(np.full(int(rng.integers(1, 5)), int(rng.integers(1, 4)), np.int64))
    limit = g.op("ReduceMax", [lengths], keepdims=0)
    steps = g.op("Range", [g.const(np.int64(0)), limit, g.const(np.int64(1))])
    return g.op("NonZero", [g.op("Less", [steps, g.op("Unsqueeze", [lengths, g.const(np.array([1]))])])])


def _cumsum(g: Graph, rng) -> ir.Value:
    if rng.integers(2):
        return g.op("CumSum", [g.m, g.const(np.int64(1))], exclusive=int(rng.integers(2)))
    ones = g.op("ConstantOfShape", [g.op("Shape", [g.m])], value=ir.tensor(np.array([2], np.int64)))
    return g.op(
        "CumSum",
        [ones, g.const(np.int64(rng.integers(0, 2)))],
        exclusive=int(rng.integers(2)),
        reverse=int(rng.integers(2)),
    )


def _range(g: Graph, rng) -> ir.Value:
    start = g.const(np.int64(rng.integers(-2, 3)))
    step = int(rng.choice([1, -1, 2]))
    limit = g.length(g.m, 1) if step != 2 else g.const(np.int64(rng.integers(0, 9)))
    if step == -1:
        start, limit = limit, start
    return g.op("Range", [start, limit, g.const(np.int64(step))])


def _where(g: Graph, rng) -> ir.Value:
    choice = rng.integers(3)
    if choice == 0:
        return _mask(g, rng)
    cond = _condition(g, rng)
    if choice == 1:  # between equal integers
        same = g.const(np.int64(rng.integers(0, 5)))
        return g.op("Where", [cond, same, same])
    return g.op(
        "Where",
        [
            g.op("Equal", [g.op("Shape", [g.x]), g.const(np.int64(-1))]),
            g.const(np.int64(1)),
            g.op("Shape", [g.x]),
        ],
    )


def _causal_fill(g: Graph) -> ir.Value:
    """A float [R, K]: float32's lowest above the diagonal, 0 elsewhere (a causal mask's fill)."""
    fill = g.op(
        "ConstantOfShape",
        [g.op("Shape", [g.m])],
        value=ir.tensor(np.array([np.finfo(np.float32).min], np.float32)),
    )
    return g.op("Trilu", [fill, g.const(np.int64(1))], upper=1)


def _mul(g: Graph, rng) -> ir.Value:
    if rng.integers(2):  # a mask of a finite fill times a condition
        upper = _causal_fill(g)
        return g.op("Mul", [upper, g.op("Cast", [_condition(g, rng)], to=F32)])
    return _binary("Mul")(g, rng)


def _equal(g: Graph, rng) -> ir.Value:
    if rng.integers(2):  # the padding test of a mask plus the entries
        upper = _causal_fill(g)
        summed = g.op("Add", [upper, g.op("Cast", [g.m], to=F32)])
        return g.op("Equal", [summed, g.const(np.float32(0))])
    return _compare("Equal")(g, rng)


def _reshape(g: Graph, rng) -> ir.Value:
    if rng.integers(2):
        return g.op("Reshape", [g.arange(g.m, 1), g.const(np.array([-1, 1]))])
    return g.op("Reshape", [g.x, g.const(np.array([0, -1]))])


def _slice(g: Graph, rng) -> ir.Value:
    if rng.integers(3) == 0:  # m[:, -(S + c):], S a length (0 included): negative or not at S = 0
        start = g.op("Sub", [g.op("Neg", [g.op("Shape", [g.ids])]), g.const(np.array([rng.integers(0, 3)]))])
        ends = g.const(np.array([np.iinfo(np.int64).max if rng.integers(2) else rng.integers(-2, 4)]))
        return g.op("Slice", [g.m, start, ends, g.const(np.array([1]))])
    if rng.integers(2):
        return g.op(
            "Slice",
            [g.op("Shape", [g.x]), g.const(np.array([int(rng.integers(-2, 2))])), g.const(np.array([3]))],
        )
    end = g.op("Unsqueeze", [g.length(g.m, 1), g.const(np.array([0]))])
    return g.op(
        "Slice",
        [_index_grid(g, rng), g.const(np.array([int(rng.integers(0, 2))])), end, g.const(np.array([1]))],
    )


def _split(g: Graph, rng) -> ir.Value:
    return g.op("Split", [g.op("Concat", [g.x, g.x], axis=2)], outputs=2, axis=2, num_outputs=2)


def _matmul_nbits(g: Graph, rng) -> ir.Value:
    n, k, block = 8, 16, 16
    weight = g.const(rng.integers(0, 255, (n, 1, block // 2), dtype=np.uint8))
    scales = g.const(np.ones(n, np.float32))
    wide = g.op("Pad", [g.x, g.const(np.array([0, 0, 0, 0, 0, k]))])
    flat = g.op("Slice", [wide, g.const(np.array([0])), g.const(np.array([k])), g.const(np.array([2]))])
    return g.op("MatMulNBits", [flat, weight, scales], domain=MICROSOFT, K=k, N=n, bits=4, block_size=block)


def _skip_norm(g: Graph, rng) -> ir.Value:
    width = g.const(np.ones(4, np.float32))
    wide = g.op("Pad", [g.x, g.const(np.array([0, 0, 0, 0, 0, 4]))])
    x4 = g.op("Slice", [wide, g.const(np.array([0])), g.const(np.array([4])), g.const(np.array([2]))])
    return g.op("SkipSimplifiedLayerNormalization", [x4, x4, width], domain=MICROSOFT)


def _norm(op: str, domain: str = "") -> Builder:
    def build(g: Graph, rng) -> ir.Value:
        wide = g.op("Pad", [g.x, g.const(np.array([0, 0, 0, 0, 0, 4]))])
        x4 = g.op("Slice", [wide, g.const(np.array([0])), g.const(np.array([4])), g.const(np.array([2]))])
        scale = g.const(np.ones(4, np.float32))
        inputs = [x4, scale] + ([g.const(np.zeros(4, np.float32))] if op == "LayerNormalization" else [])
        return g.op(op, inputs, domain=domain, axis=-1)

    return build


def _rotary(domain: str) -> Builder:
    def build(g: Graph, rng) -> ir.Value:
        x = g.op("Pad", [g.x, g.const(np.array([0, 0, 0, 0, 0, 8]))])
        x8 = g.op("Slice", [x, g.const(np.array([0])), g.const(np.array([8])), g.const(np.array([2]))])
        if domain:
            positions = g.op(
                "Mul",
                [
                    g.op("Unsqueeze", [g.arange(x8, 1), g.const(np.array([0]))]),
                    g.op(
                        "Mul",
                        [g.op("Unsqueeze", [g.arange(x8, 0), g.const(np.array([1]))]), g.const(np.int64(0))],
                    ),
                ],
            )
            cache = g.const(np.ones((16, 4), np.float32))
            return g.op("RotaryEmbedding", [x8, positions, cache, cache], domain=domain)
        x4d = g.op("Unsqueeze", [x8, g.const(np.array([1]))])
        cache = g.op(
            "Expand",
            [
                g.const(np.ones((1, 1, 4), np.float32)),
                g.op("Concat", [g.op("Shape", [x8], end=2), g.const(np.array([4]))], axis=0),
            ],
        )
        return g.op("RotaryEmbedding", [x4d, cache, cache])

    return build


CASES: dict[tuple[str, str], Builder] = {
    ("", "Identity"): lambda g, rng: g.op("Identity", [_index_grid(g, rng)]),
    ("", "Shape"): lambda g, rng: g.op("Shape", [g.x], start=int(rng.integers(-3, 2))),
    ("", "Size"): lambda g, rng: g.op(
        "Size", [g.op("Unsqueeze", [g.arange(g.m, 1), g.const(np.array([0]))])]
    ),
    ("", "Squeeze"): lambda g, rng: (
        g.op(
            "Squeeze",
            [g.m if rng.integers(2) else g.op("Unsqueeze", [g.op("Shape", [g.x]), g.const(np.array([0]))])],
        )
        if rng.integers(3) == 0  # without axes: of lengths that may be 1, or of constant lengths
        else g.op(
            "Squeeze",
            [g.op("Unsqueeze", [_index_grid(g, rng), g.const(np.array([1]))]), g.const(np.array([1]))],
        )
    ),
    ("", "Unsqueeze"): lambda g, rng: g.op(
        "Unsqueeze", [_index_grid(g, rng), g.const(np.array([int(rng.integers(-3, 3))]))]
    ),
    ("", "Add"): _binary("Add"),
    ("", "Sub"): _binary("Sub"),
    ("", "Mul"): _mul,
    ("", "Div"): lambda g, rng: (
        g.op("Div", [g.op("Shape", [g.x]), g.const(np.int64(rng.integers(1, 3)))])
        if rng.integers(2)
        else g.op("Div", [g.x, g.const(np.float32(2))])
    ),
    ("", "Pow"): lambda g, rng: g.op("Pow", [g.x, g.const(np.float32(2))]),
    ("", "Mod"): lambda g, rng: g.op("Mod", [_index_grid(g, rng), g.const(np.int64(3))]),
    ("", "Neg"): lambda g, rng: g.op("Neg", [_index_grid(g, rng)]),
    ("", "Range"): _range,
    ("", "Equal"): _equal,
    ("", "Less"): _compare("Less"),
    ("", "LessOrEqual"): _compare("LessOrEqual"),
    ("", "Greater"): _compare("Greater"),
    ("", "GreaterOrEqual"): _compare("GreaterOrEqual"),
    ("", "And"): lambda g, rng: g.op("And", [_condition(g, rng), _condition(g, rng)]),
    ("", "Or"): lambda g, rng: g.op("Or", [_condition(g, rng), g.const(np.array(bool(rng.integers(2))))]),
    ("", "Xor"): lambda g, rng: g.op("Xor", [_condition(g, rng), g.const(np.array(False))]),
    ("", "Not"): lambda g, rng: g.op(
        "Not", [g.op("LessOrEqual", [_index_grid(g, rng), g.const(np.int64(3))])]
    ),
    ("", "Cast"): lambda g, rng: g.op(
        "Cast",
        [
            g.m
            if rng.integers(3) == 0
            else g.op("Sub", [_index_grid(g, rng), g.const(np.int64(rng.integers(-2, 4)))])
        ],
        to=int(rng.choice(NARROW if rng.integers(2) else [BOOL, I64])),
    ),
    ("", "CastLike"): lambda g, rng: g.op("CastLike", [g.const(np.float32(rng.integers(0, 5))), g.ids]),
    ("", "Where"): _where,
    ("", "Expand"): lambda g, rng: g.op(
        "Expand", [g.op("Unsqueeze", [g.arange(g.m, 1), g.const(np.array([0]))]), g.op("Shape", [g.m])]
    ),
    ("", "Max"): lambda g, rng: g.op("Max", [g.op("Shape", [g.x]), g.const(np.int64(rng.integers(0, 4)))]),
    ("", "Min"): lambda g, rng: g.op("Min", [g.op("Shape", [g.x]), g.const(np.int64(rng.integers(0, 4)))]),
    ("", "Concat"): lambda g, rng: (
        _vector(g, rng) if rng.integers(2) else g.op("Concat", [_index_grid(g, rng), g.m], axis=1)
    ),
    ("", "Transpose"): lambda g, rng: g.op("Transpose", [_index_grid(g, rng)], perm=[1, 0]),
    ("", "Reshape"): _reshape,
    ("", "Slice"): _slice,
    ("", "ConstantOfShape"): lambda g, rng: g.op(
        "ConstantOfShape", [g.op("Shape", [g.m])], value=ir.tensor(np.array([rng.integers(0, 3)], np.int64))
    ),
    ("", "Gather"): _gather,
    ("", "GatherND"): _gather_nd,
    ("", "ScatterND"): _scatter_nd,
    ("", "ScatterElements"): lambda g, rng: g.op(
        "ScatterElements",
        [g.x, g.const(np.zeros((1, 1, 1), np.int64)), g.const(np.ones((1, 1, 1), np.float32))],
        axis=2,
    ),
    ("", "Trilu"): _trilu,
    ("", "Tile"): _tile,
    ("", "NonZero"): _nonzero,
    ("", "CumSum"): _cumsum,
    ("", "Split"): _split,
    ("", "MatMul"): lambda g, rng: g.op("MatMul", [g.x, g.op("Transpose", [g.x], perm=[0, 2, 1])]),
    ("", "MatMulInteger"): lambda g, rng: g.op(
        "MatMulInteger",
        [
            g.op("Cast", [g.m], to=ir.DataType.UINT8),
            g.op(
                "Cast",
                [
                    g.op("Transpose", [g.m]),
                ],
                to=ir.DataType.UINT8,
            ),
        ],
    ),
    ("", "Softmax"): lambda g, rng: g.op("Softmax", [g.x], axis=-1),
    ("", "LogSoftmax"): lambda g, rng: g.op("LogSoftmax", [g.x], axis=-1),
    ("", "Flatten"): lambda g, rng: g.op("Flatten", [g.x], axis=int(rng.integers(0, 3))),
    ("", "Dropout"): lambda g, rng: g.op("Dropout", [g.x]),
    ("", "DynamicQuantizeLinear"): lambda g, rng: g.op("DynamicQuantizeLinear", [g.x], outputs=3),
    ("", "LayerNormalization"): _norm("LayerNormalization"),
    ("", "RMSNormalization"): _norm("RMSNormalization"),
    ("", "SimplifiedLayerNormalization"): _norm("SimplifiedLayerNormalization"),
    ("", "RotaryEmbedding"): _rotary(""),
    (MICROSOFT, "MatMulNBits"): _matmul_nbits,
    (MICROSOFT, "SkipSimplifiedLayerNormalization"): _skip_norm,
    (MICROSOFT, "RotaryEmbedding"): _rotary(MICROSOFT),
}
CASES |= {("", op): _unary(op) for op in graphs.UNARY} | {("", op): _reduce(op) for op in graphs.REDUCTIONS}


def test_every_row_has_a_case():
    assert sorted(CASES) == sorted(RULES)


def _feeds(rng) -> tuple[dict, dict]:
    """Sizes from 1 (axes Squeeze and broadcasting treat alike) up, and in a third of the draws
    one of them 0 (an empty tensor: a prompt with no past, a mask without columns)."""
    dims = {"A": int(rng.integers(1, 4)), "B": int(rng.integers(1, 4)), "C": int(rng.integers(1, 5))}
    dims |= {"R": int(rng.integers(1, 4)), "K": int(rng.integers(1, 6)), "S": int(rng.integers(1, 5))}
    if rng.integers(3) == 0:
        dims[str(rng.choice(sorted(dims)))] = 0
    feeds = {
        "x": rng.standard_normal((dims["A"], dims["B"], dims["C"])).astype(np.float32),
        "m": rng.integers(0, 2, (dims["R"], dims["K"])).astype(np.int64),
        "ids": rng.integers(0, 9, dims["S"]).astype(np.int64),
    }
    return dims, feeds


@pytest.mark.parametrize("key", sorted(CASES), ids=lambda k: f"{k[0] or 'onnx'}.{k[1]}")
def test_each_rule_computes_what_onnxruntime_does(key):
    rng = np.random.default_rng(sum(map(ord, "".join(key))))
    answered, said = 0, 0
    for _ in range(DRAWS):
        g = Graph()
        out = CASES[key](g, rng)
        model = g.model([out])
        assert any(n.op_type == key[1] and n.domain == key[0] for n in model.graph)
        try:
            tensor = SymbolicEvaluator().eval(out)
        except Unprovable:
            continue
        dims, feeds = _feeds(rng)
        session = create_session(model)
        try:
            got = session.run(
                None, {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}}
            )[0]
        except Exception as error:  # the graph does not run at these sizes (an index past an empty axis)
            assert 0 in dims.values(), error
            continue
        said += check(tensor, np.asarray(got), dims, feeds)
        answered += 1
    assert answered, f"{key}: the rule never answered"
    assert said or not RULES[key].values, f"{key}: its value rules never said what the values are"
