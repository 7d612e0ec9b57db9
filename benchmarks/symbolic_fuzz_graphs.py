"""The random graphs of benchmarks/symbolic_fuzz.py: one builder per row of the evaluator's rule
table (:data:`BUILDERS`), each writing its operator the way exporters use it, in the form the
case's opset defines, over what the case built so far (:class:`Case`); :func:`build_case` draws
case ``index`` of a seed. Its :class:`Graph` (the inputs, nodes and constants of a case) and
operator lists serve tests/passes/fusion/test_symbolic_rules.py's one-rule graphs too."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes.fusion._symbolic_rules import MICROSOFT

I64, I32, F32, BOOL = ir.DataType.INT64, ir.DataType.INT32, ir.DataType.FLOAT, ir.DataType.BOOL
NARROW = (ir.DataType.INT32, ir.DataType.INT16, ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.UINT32)
INT64_MAX, INT64_MIN = int(np.iinfo(np.int64).max), int(np.iinfo(np.int64).min)
BOUNDARIES = (127, 128, -128, -129, 255, 256, 2**15, 2**31 - 1, 2**31, -(2**31), 2**32, 2**62)
EXTREMES = (INT64_MAX, INT64_MIN, INT64_MAX - 1, INT64_MIN + 1)
OPSETS = range(12, 25)
DIMS = ("A", "B", "C", "R", "K", "S")
LARGE = 1000
"""The large size one dimension takes in some runs."""
UNARY = (
    "Sqrt", "Reciprocal", "Sigmoid", "Tanh", "Cos", "Sin", "Exp", "Erf", "Relu", "Abs", "IsNaN",
    "IsInf", "Gelu", "Softplus", "Log", "Floor", "Ceil", "Round", "Sign",
)  # fmt: skip
"""The rule table's one-input float operators."""
REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2")


# ---- building a case ----


@dataclasses.dataclass
class Item:
    """A value the case may read: its element type group and rank."""

    value: ir.Value
    kind: str  # "int" (int64), "narrow", "bool", "float"
    rank: int


class Graph:
    """A graph under construction over the inputs every case may read (float ``x [A, B, C]``,
    integer ``m [R, K]`` read by entries, ``ids [S]`` for lengths): nodes, initializers."""

    def __init__(self, opset: int) -> None:
        self.x = ir.val("x", F32, ["A", "B", "C"])
        self.m = ir.val("m", I64, ["R", "K"])
        self.ids = ir.val("ids", I64, ["S"])
        self.inputs = [self.x, self.m, self.ids]
        self.nodes: list[ir.Node] = []
        self.consts: list[ir.Value] = []
        self.opsets = {"": opset}

    def op(self, op_type: str, inputs, outputs: int = 1, domain: str = "", **attrs) -> ir.Value:
        node = ir.node(op_type, list(inputs), attrs or None, domain=domain, num_outputs=outputs)
        node.name = f"n{len(self.nodes)}"
        for k, out in enumerate(node.outputs):
            out.name = f"{node.name}_{k}"
        self.nodes.append(node)
        if domain:
            self.opsets[domain] = 1
        return node.outputs[0]

    def const(self, array) -> ir.Value:
        """An initializer."""
        value = ir.Value(name=f"c{len(self.consts)}", const_value=ir.tensor(np.asarray(array)))
        self.consts.append(value)
        return value

    def model(self, outputs: ir.Value | list[ir.Value] | None = None) -> ir.Model:
        """The model computing ``outputs`` (one value, a list, or None: every node's outputs)."""
        if isinstance(outputs, ir.Value):
            outputs = [outputs]
        outputs = [v for n in self.nodes for v in n.outputs] if outputs is None else outputs
        graph = ir.Graph(self.inputs, outputs, nodes=self.nodes, opset_imports=dict(self.opsets))
        for value in self.consts:
            graph.register_initializer(value)
        return ir.Model(graph, ir_version=10)


class Case(Graph):
    """One random graph under construction, at one opset, over one more input (int32 ``n [R, K]``);
    what it built so far is its pool."""

    def __init__(self, rng: np.random.Generator, opset: int) -> None:
        super().__init__(opset)
        self.rng = rng
        self.opset = opset
        self.n = ir.val("n", I32, ["R", "K"])
        self.inputs.append(self.n)
        self.pool = [
            Item(self.x, "float", 3),
            Item(self.m, "int", 2),
            Item(self.ids, "int", 1),
            Item(self.n, "narrow", 2),
        ]

    # -- nodes and constants

    def op(self, op_type: str, inputs, outputs: int = 1, domain: str = "", kind=None, rank=None, **attrs):
        out = super().op(op_type, inputs, outputs, domain, **attrs)
        if kind is not None:
            self.pool.append(Item(out, kind, rank))
        return out

    def const(self, array) -> ir.Value:
        """A constant: an initializer, or (half the time) a Constant node."""
        if self.rng.integers(2):
            return super().const(array)
        return self.op("Constant", [], value=ir.tensor(np.asarray(array)))

    def ints(self, array) -> ir.Value:
        return self.const(np.asarray(array, np.int64))

    def number(self) -> int:
        """An integer constant: small mostly, else a boundary or an int64 extreme."""
        draw = self.rng.random()
        if draw < 0.7:
            return int(self.rng.integers(-3, 7))
        if draw < 0.9:
            return int(self.rng.choice(BOUNDARIES)) * (1 if self.rng.integers(3) else -1)
        return int(self.rng.choice(EXTREMES))

    def pick(self, kind: str, ranks=None) -> Item | None:
        found = [i for i in self.pool if i.kind == kind and (ranks is None or i.rank in ranks)]
        return found[int(self.rng.integers(len(found)))] if found else None

    # -- the opset's forms

    def moved(self, op: str, inputs, ints, since: int, name: str = "axes", **attrs) -> ir.Value:
        """``op`` with its ``name`` (list or None) as an attribute before ``since``, an input after."""
        if ints is None or (not ints and self.opset < since):
            return self.op(op, inputs, **attrs)
        if self.opset >= since:
            return self.op(op, [*inputs, self.ints(ints)], **attrs)
        return self.op(op, inputs, **{name: list(ints)}, **attrs)

    def unsqueeze(self, v: ir.Value, axes, kind=None, rank=None) -> ir.Value:
        out = self.moved("Unsqueeze", [v], axes, 13)
        if kind is not None:
            self.pool.append(Item(out, kind, rank))
        return out

    # -- idioms

    def shape(self, item: Item) -> ir.Value:
        return self.op("Shape", [item.value], kind="int", rank=1)

    def length(self, v: ir.Value, axis: int) -> ir.Value:
        return self.op("Gather", [self.op("Shape", [v]), self.ints(axis)], kind="int", rank=0)

    def arange(self, v: ir.Value, axis: int) -> ir.Value:
        start = self.ints(int(self.rng.integers(-2, 3))) if self.rng.integers(3) == 0 else self.ints(0)
        return self.op("Range", [start, self.length(v, axis), self.ints(1)], kind="int", rank=1)

    def grid(self) -> ir.Value:
        """An int64 [R, K] (or [R, S]) that is an affine form of its indices."""
        rows = self.unsqueeze(self.arange(self.m, 0), [1])
        cols_of = (self.m, 1) if self.rng.integers(3) else (self.ids, 0)
        cols = self.unsqueeze(self.arange(*cols_of), [0])
        scaled = self.op("Mul", [rows, self.ints(int(self.rng.integers(-2, 3)))])
        return self.op("Add", [scaled, cols], kind="int", rank=2)

    def condition(self) -> ir.Value:
        cut = self.op("LessOrEqual", [self.grid(), self.ints(self.number())], kind="bool", rank=2)
        if self.rng.integers(2):
            return self.op("And", [cut, self.op("Cast", [self.m], to=BOOL)], kind="bool", rank=2)
        return cut

    def mask(self) -> ir.Value:
        low = np.float32(-np.inf if self.rng.integers(2) else np.finfo(np.float32).min)
        return self.op(
            "Where", [self.condition(), self.const(np.float32(0)), self.const(low)], kind="float", rank=2
        )

    def int_item(self, ranks=None) -> Item:
        item = self.pick("int", ranks)
        if item is None or self.rng.integers(4) == 0:
            choice = int(self.rng.integers(3))
            if choice == 0:
                self.shape(self.pick("float") or Item(self.x, "float", 3))
            elif choice == 1:
                self.grid()
            else:
                self.arange(self.m, int(self.rng.integers(2)))
            item = self.pick("int", ranks) or Item(self.m, "int", 2)
        return item

    def bool_item(self) -> Item:
        item = self.pick("bool")
        if item is None or self.rng.integers(3) == 0:
            self.condition()
            item = self.pick("bool")
        assert item is not None
        return item

    def float_item(self) -> Item:
        item = self.pick("float")
        return item if item is not None else Item(self.x, "float", 3)


Builder = Callable[[Case], object]


# ---- one builder per row of the rule table ----


def _any(c: Case) -> Item:
    kind = str(c.rng.choice(["int", "int", "bool", "float"]))
    return c.int_item() if kind == "int" else c.bool_item() if kind == "bool" else c.float_item()


def _shape(c: Case) -> None:
    item = _any(c)
    attrs = {}
    if c.opset >= 15 and c.rng.integers(2):
        attrs["start"] = int(c.rng.integers(-4, 4))
        if c.rng.integers(2):
            attrs["end"] = int(c.rng.integers(-4, 5))
    c.op("Shape", [item.value], kind="int", rank=1, **attrs)


def _squeeze(c: Case) -> None:
    choice = int(c.rng.integers(3))
    item = _any(c)
    if choice == 0:  # of axes just inserted
        at = int(c.rng.integers(-(item.rank + 1), item.rank + 1))
        v = c.unsqueeze(item.value, [at])
        c.pool.append(Item(c.moved("Squeeze", [v], [at], 13), item.kind, item.rank))
    elif choice == 1:  # without axes: the unit axes at run time
        c.op("Squeeze", [item.value])
    elif item.rank:
        c.moved("Squeeze", [item.value], [int(c.rng.integers(-item.rank, item.rank))], 13)


def _unsqueeze(c: Case) -> None:
    item = _any(c)
    axes = [int(c.rng.integers(-(item.rank + 1), item.rank + 1))]
    if c.rng.integers(3) == 0:
        axes.append(int(c.rng.integers(-(item.rank + 2), item.rank + 2)))
    c.unsqueeze(item.value, axes, item.kind, item.rank + len(axes))


def _other_int(c: Case, item: Item) -> ir.Value:
    """A second integer operand: a constant scalar or vector, or another integer value."""
    choice = int(c.rng.integers(4))
    if choice == 0:
        return c.ints(c.number())
    if choice == 1 and item.rank == 1:
        return c.ints([c.number() for _ in range(int(c.rng.integers(1, 4)))])
    if choice == 2:
        return c.int_item([0, item.rank]).value
    return c.ints(int(c.rng.integers(-3, 4)))


def _arith(op: str) -> Builder:
    def build(c: Case) -> None:
        choice = int(c.rng.integers(6))
        if choice == 0:  # float data
            f = c.float_item()
            c.op(op, [f.value, c.const(np.float32(c.rng.integers(-2, 3)))], kind="float", rank=f.rank)
        elif choice == 1 and op == "Add":  # masks
            other = c.mask() if c.rng.integers(2) else c.const(np.float32(0))
            c.op(op, [c.mask(), other], kind="float", rank=2)
        elif choice == 1 and op == "Mul":  # a finite fill times a condition
            fill = np.array([np.finfo(np.float32).min], np.float32)
            full = c.op("ConstantOfShape", [c.op("Shape", [c.m])], value=ir.tensor(fill))
            upper = c.op("Trilu", [full, c.ints(1)], upper=1) if c.opset >= 14 else full
            c.op(op, [upper, c.op("Cast", [c.condition()], to=F32)], kind="float", rank=2)
        else:
            item = c.int_item()
            a, b = item.value, _other_int(c, item)
            c.op(op, [a, b] if c.rng.integers(2) else [b, a], kind="int", rank=item.rank)

    return build


def _div(c: Case) -> None:
    if c.rng.integers(4) == 0:
        f = c.float_item()
        c.op("Div", [f.value, c.const(np.float32(2))], kind="float", rank=f.rank)
        return
    item = c.int_item([0, 1]) if c.rng.integers(2) else Item(c.ints(c.number()), "int", 0)
    divisor = int(c.rng.choice([1, 2, 3, 4, 7, -2, -3, 2**31]))
    c.op("Div", [item.value, c.ints(divisor)], kind="int", rank=item.rank)


def _mod(c: Case) -> None:
    if c.rng.integers(4) == 0:
        f = c.float_item()
        c.op("Mod", [f.value, c.const(np.float32(2))], fmod=1, kind="float", rank=f.rank)
        return
    item = c.int_item()
    c.op("Mod", [item.value, c.ints(int(c.rng.choice([2, 3, -3, 5])))], kind="int", rank=item.rank)


def _neg(c: Case) -> None:
    item = c.int_item()
    c.op("Neg", [item.value], kind="int", rank=item.rank)


def _bound(c: Case) -> ir.Value:
    """A Range bound: a length, a small constant, or a length moved by a constant."""
    choice = int(c.rng.integers(4))
    if choice == 0:
        return c.ints(int(c.rng.integers(-5, 9)))
    length = c.length(*[(c.m, 0), (c.m, 1), (c.ids, 0), (c.x, 2)][int(c.rng.integers(4))])
    if choice == 1:
        return c.op("Sub", [length, c.ints(int(c.rng.integers(-3, 4)))])
    if choice == 2:
        return c.op("Neg", [length])
    return length


def _range(c: Case) -> None:
    delta = int(c.rng.choice([1, 1, -1, 2, -2, 3]))
    c.op("Range", [_bound(c), _bound(c), c.ints(delta)], kind="int", rank=1)


def _compare(op: str) -> Builder:
    def build(c: Case) -> None:
        choice = int(c.rng.integers(4))
        if choice == 0 and op == "Equal":  # the padding test: a mask plus the entries, equal to 0
            summed = c.op("Add", [c.mask(), c.op("Cast", [c.m], to=F32)])
            c.op(op, [summed, c.const(np.float32(0))], kind="bool", rank=2)
            return
        if choice == 1:  # of vectors
            shape = c.shape(_any(c))
            c.op(op, [shape, c.ints([c.number() for _ in range(3)])], kind="bool", rank=1)
            return
        item = c.int_item()
        a, b = item.value, _other_int(c, item)
        c.op(op, [a, b] if c.rng.integers(2) else [b, a], kind="bool", rank=item.rank)

    return build


def _logic(op: str) -> Builder:
    def build(c: Case) -> None:
        a = c.bool_item()
        b = c.const(np.array(bool(c.rng.integers(2)))) if c.rng.integers(3) == 0 else c.bool_item().value
        c.op(op, [a.value, b] if c.rng.integers(2) else [b, a.value], kind="bool", rank=a.rank)

    return build


def _not(c: Case) -> None:
    a = c.bool_item()
    c.op("Not", [a.value], kind="bool", rank=a.rank)


_KIND_OF = {I64: "int", BOOL: "bool", F32: "float", **{t: "narrow" for t in NARROW}}


def _cast(c: Case) -> None:
    choice = int(c.rng.integers(5))
    if choice == 0:
        item = c.bool_item()
    elif choice == 1:
        item = c.pick("narrow") or c.int_item()
    elif choice == 2:  # one float everywhere
        full = c.op(
            "ConstantOfShape",
            [c.op("Shape", [c.m])],
            value=ir.tensor(np.array([0.0, 1.0, np.nan][int(c.rng.integers(3))], np.float32).reshape(1)),
        )
        item = Item(full, "float", 2)
    else:
        item = c.int_item()
    to = c.rng.choice([*NARROW, BOOL, I64, I64, F32])
    to = ir.DataType(int(to))
    c.op("Cast", [item.value], to=int(to), kind=_KIND_OF[to], rank=item.rank)


def _cast_like(c: Case) -> None:
    if c.opset < 15:
        return
    like = c.pick("narrow") if c.rng.integers(2) else None
    like_value = like.value if like is not None else c.ids
    kind = like.kind if like is not None else "int"
    if c.rng.integers(2):
        source = c.const(np.float32(c.rng.choice([0.0, 1.0, 3.0, -2.0, 2.5, 300.0, 1e10])))
        c.op("CastLike", [source, like_value], kind=kind, rank=0)
    else:
        item = c.int_item()
        c.op("CastLike", [item.value, like_value], kind=kind, rank=item.rank)


def _where(c: Case) -> None:
    choice = int(c.rng.integers(4))
    if choice == 0:
        c.mask()
    elif choice == 1:
        cond = c.bool_item()
        a, b = c.int_item(), c.int_item()
        same = c.rng.integers(2)
        c.op(
            "Where",
            [cond.value, a.value, a.value if same else b.value],
            kind="int",
            rank=max(cond.rank, a.rank),
        )
    elif choice == 2:
        cond = c.bool_item()
        c.op("Where", [cond.value, c.bool_item().value, c.bool_item().value], kind="bool", rank=cond.rank)
    else:  # torch's Expand target Where(shape == -1, 1, shape)
        shape = c.shape(_any(c))
        equal = c.op("Equal", [shape, c.ints(-1)])
        c.op("Where", [equal, c.ints(1), shape], kind="int", rank=1)


def _target(c: Case, rank: int) -> ir.Value:
    """An Expand or ConstantOfShape target: a shape vector."""
    choice = int(c.rng.integers(3))
    if choice == 0:
        return c.op("Shape", [c.m])
    if choice == 1:
        return c.op("Concat", [c.op("Shape", [c.m]), c.ints([int(c.rng.integers(1, 3))])], axis=0)
    return c.ints([int(c.rng.integers(0, 3)) for _ in range(max(rank, 1))])


def _expand(c: Case) -> None:
    item = _any(c)
    target = _target(c, item.rank)
    c.op("Expand", [item.value, target], kind=item.kind, rank=max(item.rank, 3))


def _extremum(op: str) -> Builder:
    def build(c: Case) -> None:
        item = c.int_item([0, 1])
        others = [_other_int(c, item) for _ in range(int(c.rng.integers(1, 3)))]
        c.op(op, [item.value, *others], kind="int", rank=item.rank)

    return build


def _concat(c: Case) -> None:
    if c.rng.integers(2):
        parts = [c.int_item([1]).value for _ in range(int(c.rng.integers(1, 3)))]
        parts.append(c.ints([c.number() for _ in range(int(c.rng.integers(1, 3)))]))
        c.op("Concat", parts, axis=0, kind="int", rank=1)
        return
    grid = c.grid()
    other = c.m if c.rng.integers(2) else c.grid()
    c.op("Concat", [grid, other], axis=int(c.rng.choice([-1, 0, 1])), kind="int", rank=2)


def _transpose(c: Case) -> None:
    item = _any(c)
    if item.rank < 2:
        item = Item(c.grid(), "int", 2)
    perm = {} if c.rng.integers(3) == 0 else {"perm": [int(p) for p in c.rng.permutation(item.rank)]}
    c.op("Transpose", [item.value], kind=item.kind, rank=item.rank, **perm)


def _reshape(c: Case) -> None:
    choice = int(c.rng.integers(3))
    if choice == 0:
        item = c.int_item([1])
        target = [-1] if c.rng.integers(2) else [int(c.rng.integers(1, 4))]
    elif choice == 1:
        item = Item(c.grid(), "int", 2)
        target = [[0, -1], [-1, 1], [-1], [1, -1, 1], [0, 1, -1]][int(c.rng.integers(5))]
    else:
        item = c.float_item()
        target = [[0, -1], [-1], [0, 0, -1, 1]][int(c.rng.integers(3))]
    attrs = {"allowzero": 1} if c.opset >= 14 and c.rng.integers(4) == 0 else {}
    c.op("Reshape", [item.value, c.ints(target)], kind=item.kind, rank=len(target), **attrs)


def _slice_bound(c: Case) -> ir.Value:
    choice = int(c.rng.integers(5))
    if choice == 0:  # -S, maybe moved by a constant
        start = c.op("Neg", [c.op("Shape", [c.ids])])
        return c.op("Sub", [start, c.ints([int(c.rng.integers(-2, 3))])]) if c.rng.integers(2) else start
    if choice == 1:  # a length
        return c.unsqueeze(c.length(c.m, int(c.rng.integers(2))), [0])
    return c.ints([c.number()])


def _slice(c: Case) -> None:
    item = _any(c)
    if item.rank == 0:
        item = c.int_item([1, 2])
    inputs = [item.value, _slice_bound(c), _slice_bound(c)]
    if c.rng.integers(2):
        inputs.append(c.ints([int(c.rng.integers(-item.rank, item.rank))]))
        if c.rng.integers(3) == 0:
            inputs.append(c.ints([int(c.rng.choice([1, -1, 2]))]))
    c.op("Slice", inputs, kind=item.kind, rank=item.rank)


def _constant_of_shape(c: Case) -> None:
    choice = int(c.rng.integers(3))
    value = [
        np.array([c.number()], np.int64),
        np.array([bool(c.rng.integers(2))]),
        np.array([c.rng.choice([0.0, 1.0, -np.inf, np.finfo(np.float32).min])], np.float32),
    ][choice]
    kind = ["int", "bool", "float"][choice]
    target = _target(c, 1)
    c.op("ConstantOfShape", [target], value=ir.tensor(value), kind=kind, rank=3)


def _stack(c: Case) -> ir.Value:
    """The [R, K, 2] index stack (row, column) of every position of m."""
    rows = c.unsqueeze(c.unsqueeze(c.arange(c.m, 0), [1]), [2])
    cols = c.unsqueeze(c.unsqueeze(c.arange(c.m, 1), [0]), [2])
    shape = c.op("Concat", [c.op("Shape", [c.m]), c.ints([1])], axis=0)
    return c.op("Concat", [c.op("Expand", [rows, shape]), c.op("Expand", [cols, shape])], axis=-1)


def _gather(c: Case) -> None:
    choice = int(c.rng.integers(4))
    if choice == 0:  # a vector by constant indices
        item = c.int_item([1])
        index = c.ints(c.number() if c.rng.integers(2) else int(c.rng.integers(-3, 3)))
        c.op("Gather", [item.value, index], kind="int", rank=0)
    elif choice == 1:  # m's entries at a range
        at = int(c.rng.integers(2))
        data = c.m if c.rng.integers(2) else c.grid()
        c.op("Gather", [data, c.arange(c.m, at)], axis=at, kind="int", rank=2)
    elif choice == 2:  # the padding lookup Gather(Flatten(m), row * width + col)
        flat = c.op("Flatten", [c.m], axis=2)
        rows = c.unsqueeze(c.arange(c.m, 0), [1])
        width = c.unsqueeze(c.length(c.m, 1), [0])
        cols = c.unsqueeze(c.arange(c.m if c.rng.integers(2) else c.ids, 1 if c.rng.integers(2) else 0), [0])
        index = c.op("Add", [c.op("Mul", [rows, width]), cols])
        c.op("Gather", [flat, index], kind="int", rank=3)
    else:
        f = c.float_item()
        c.op("Gather", [f.value, c.ints(np.zeros((2, 2), np.int64))], axis=0, kind="float", rank=f.rank + 1)


def _gather_nd(c: Case) -> None:
    data = c.m if c.rng.integers(2) else c.grid()
    if c.rng.integers(3) == 0:
        index = c.ints([[int(c.rng.integers(-1, 2)), int(c.rng.integers(-1, 3))]])
        c.op("GatherND", [data, index], kind="int", rank=1)
        return
    c.op("GatherND", [data, _stack(c)], kind="int", rank=2)


def _scatter_nd(c: Case) -> None:
    zeros = c.op("Mul", [c.m, c.ints(0)])
    c.op("ScatterND", [zeros, _stack(c), c.grid()], kind="int", rank=2)


def _scatter_elements(c: Case) -> None:
    f = c.float_item()
    if f.rank != 3:
        f = Item(c.x, "float", 3)
    c.op(
        "ScatterElements",
        [f.value, c.ints(np.zeros((1, 1, 1), np.int64)), c.const(np.ones((1, 1, 1), np.float32))],
        axis=2,
        kind="float",
        rank=3,
    )


def _trilu(c: Case) -> None:
    if c.opset < 14:
        return
    k = c.ints(c.number() if c.rng.integers(4) == 0 else int(c.rng.integers(-2, 3)))
    choice = int(c.rng.integers(4))
    if choice == 0:
        fill = [np.finfo(np.float32).min, 0.0, -np.inf, 1.0][int(c.rng.integers(4))]
        source = c.op(
            "ConstantOfShape", [c.op("Shape", [c.m])], value=ir.tensor(np.array([fill], np.float32))
        )
        kind = "float"
    elif choice == 1:
        source, kind = c.condition(), "bool"
    elif choice == 2:
        source, kind = c.mask(), "float"
    else:
        source, kind = (c.grid() if c.rng.integers(2) else c.m), "int"
    c.op("Trilu", [source, k], upper=int(c.rng.integers(2)), kind=kind, rank=2)


def _tile(c: Case) -> None:
    item = _any(c)
    if item.rank == 0:
        item = Item(c.grid(), "int", 2)
    repeats = c.ints([int(c.rng.integers(0, 3)) for _ in range(item.rank)])
    c.op("Tile", [item.value, repeats], kind=item.kind, rank=item.rank)


def _nonzero(c: Case) -> None:
    if c.rng.integers(2):
        lengths = c.ints(np.full(int(c.rng.integers(1, 5)), int(c.rng.integers(1, 4))))
        limit = c.op("ReduceMax", [lengths], keepdims=0)
        steps = c.op("Range", [c.ints(0), limit, c.ints(1)])
        c.op("NonZero", [c.op("Less", [steps, c.unsqueeze(lengths, [1])])], kind="int", rank=2)
        return
    c.op("NonZero", [_any(c).value], kind="int", rank=2)


def _cumsum(c: Case) -> None:
    choice = int(c.rng.integers(3))
    if choice == 0:
        source, rank = c.m, 2
    elif choice == 1:
        source = c.op(
            "ConstantOfShape", [c.op("Shape", [c.m])], value=ir.tensor(np.array([c.number()], np.int64))
        )
        rank = 2
    else:
        item = c.int_item([1, 2])
        source, rank = item.value, item.rank
    axis = int(c.rng.integers(-rank, rank))
    c.op(
        "CumSum",
        [source, c.ints(axis)],
        exclusive=int(c.rng.integers(2)),
        reverse=int(c.rng.integers(4) == 0),
        kind="int",
        rank=rank,
    )


def _split(c: Case) -> None:
    if c.rng.integers(2):  # a shape vector in parts
        item, axis = Item(c.op("Shape", [c.x]), "int", 1), 0
        sizes = [[1, 2], [2, 1], [3, 0], [1, 1, 1]][int(c.rng.integers(4))]
    else:
        item = Item(c.op("Concat", [c.x, c.x], axis=2), "float", 3)
        axis, sizes = 2, None
    parts = len(sizes) if sizes is not None else 2
    if sizes is None and c.opset >= 18:
        c.op(
            "Split", [item.value], outputs=parts, axis=axis, num_outputs=parts, kind=item.kind, rank=item.rank
        )
        return
    if sizes is None:
        c.op("Split", [item.value], outputs=parts, axis=axis, kind=item.kind, rank=item.rank)
        return
    if c.opset >= 13:
        c.op("Split", [item.value, c.ints(sizes)], outputs=parts, axis=axis, kind="int", rank=1)
    else:
        c.op("Split", [item.value], outputs=parts, axis=axis, split=sizes, kind="int", rank=1)


def _float_op(op: str, **attrs) -> Builder:
    def build(c: Case) -> None:
        f = c.float_item()
        c.op(op, [f.value], kind="float", rank=f.rank, **attrs)

    return build


def _softmax(op: str) -> Builder:
    def build(c: Case) -> None:
        f = c.float_item()
        attrs = {"axis": int(c.rng.integers(-f.rank, f.rank))} if f.rank and c.rng.integers(2) else {}
        c.op(op, [f.value], kind="float", rank=f.rank, **attrs)

    return build


def _unary(op: str) -> Builder:
    def build(c: Case) -> None:
        if op == "Gelu" and c.opset < 20:
            return
        f = c.float_item()
        source = c.op("Abs", [f.value]) if op in ("Sqrt", "Log") else f.value
        c.op(op, [source], kind="bool" if op in ("IsNaN", "IsInf") else "float", rank=f.rank)

    return build


def _reduce(op: str) -> Builder:
    def build(c: Case) -> None:
        ints = op in ("ReduceSum", "ReduceMax", "ReduceMin") and c.rng.integers(3) > 0
        item = c.int_item() if ints else c.float_item()
        if ints and c.rng.integers(2):
            shape = c.op("Concat", [c.ints([int(c.rng.integers(0, 3))]), c.op("Shape", [c.m])], axis=0)
            full = c.op("ConstantOfShape", [shape], value=ir.tensor(np.array([c.number()], np.int64)))
            item = Item(full, "int", 3)
        since = 13 if op == "ReduceSum" else 18
        axes = (
            None
            if c.rng.integers(4) == 0
            else [int(c.rng.integers(-item.rank, item.rank))]
            if item.rank
            else []
        )
        attrs = {"keepdims": int(c.rng.integers(2))}
        if c.opset >= since and c.rng.integers(3) == 0:
            attrs["noop_with_empty_axes"] = 1
        out = c.moved(op, [item.value], axes, since, **attrs)
        c.pool.append(Item(out, item.kind, item.rank))

    return build


def _flatten(c: Case) -> None:
    item = _any(c)
    c.op("Flatten", [item.value], axis=int(c.rng.integers(-item.rank, item.rank + 1)), kind=item.kind, rank=2)


def _narrow(c: Case, width: int) -> ir.Value:
    """``x`` with its last axis ``width`` long (padded, then sliced)."""
    wide = c.op("Pad", [c.x, c.ints([0, 0, 0, 0, 0, width])])
    return c.op("Slice", [wide, c.ints([0]), c.ints([width]), c.ints([2])])


def _norm(op: str, domain: str = "", since: int = 12) -> Builder:
    def build(c: Case) -> None:
        if c.opset < since:
            return
        x4 = _narrow(c, 4)
        scale = c.const(np.ones(4, np.float32))
        bias = [c.const(np.zeros(4, np.float32))] if op == "LayerNormalization" else []
        if op == "SkipSimplifiedLayerNormalization":
            c.op(op, [x4, x4, scale], domain=domain, kind="float", rank=3)
            return
        c.op(op, [x4, scale, *bias], domain=domain, axis=-1, kind="float", rank=3)

    return build


def _rotary(domain: str) -> Builder:
    def build(c: Case) -> None:
        if not domain and c.opset < 23:
            return
        x8 = _narrow(c, 8)
        if domain:
            rows = c.op("Mul", [c.unsqueeze(c.arange(x8, 0), [1]), c.ints(0)])
            positions = c.op("Mul", [c.unsqueeze(c.arange(x8, 1), [0]), rows])
            cache = c.const(np.ones((16, 4), np.float32))
            c.op("RotaryEmbedding", [x8, positions, cache, cache], domain=domain, kind="float", rank=3)
            return
        x4d = c.unsqueeze(x8, [1])
        shape = c.op(
            "Concat", [c.op("Slice", [c.op("Shape", [x8]), c.ints([0]), c.ints([2])]), c.ints([4])], axis=0
        )
        cache = c.op("Expand", [c.const(np.ones((1, 1, 4), np.float32)), shape])
        c.op("RotaryEmbedding", [x4d, cache, cache], kind="float", rank=4)

    return build


def _matmul_nbits(c: Case) -> None:
    n, k, block = 8, 16, 16
    weight = c.const(c.rng.integers(0, 255, (n, 1, block // 2), dtype=np.uint8))
    scales = c.const(np.ones(n, np.float32))
    c.op(
        "MatMulNBits",
        [_narrow(c, k), weight, scales],
        domain=MICROSOFT,
        K=k,
        N=n,
        bits=4,
        block_size=block,
        kind="float",
        rank=3,
    )


def _matmul_integer(c: Case) -> None:
    a = c.op("Cast", [c.m], to=int(ir.DataType.UINT8))
    b = c.op("Cast", [c.op("Transpose", [c.m])], to=int(ir.DataType.UINT8))
    c.op("MatMulInteger", [a, b], kind="narrow", rank=2)


BUILDERS: dict[tuple[str, str], Builder] = {
    ("", "Identity"): lambda c: (lambda i: c.op("Identity", [i.value], kind=i.kind, rank=i.rank))(_any(c)),
    ("", "Shape"): _shape,
    ("", "Size"): lambda c: c.op("Size", [_any(c).value], kind="int", rank=0),
    ("", "Squeeze"): _squeeze,
    ("", "Unsqueeze"): _unsqueeze,
    ("", "Add"): _arith("Add"),
    ("", "Sub"): _arith("Sub"),
    ("", "Mul"): _arith("Mul"),
    ("", "Div"): _div,
    ("", "Pow"): lambda c: c.op("Pow", [c.float_item().value, c.const(np.float32(2))], kind="float", rank=3),
    ("", "Mod"): _mod,
    ("", "Neg"): _neg,
    ("", "Range"): _range,
    ("", "Equal"): _compare("Equal"),
    ("", "Less"): _compare("Less"),
    ("", "LessOrEqual"): _compare("LessOrEqual"),
    ("", "Greater"): _compare("Greater"),
    ("", "GreaterOrEqual"): _compare("GreaterOrEqual"),
    ("", "And"): _logic("And"),
    ("", "Or"): _logic("Or"),
    ("", "Xor"): _logic("Xor"),
    ("", "Not"): _not,
    ("", "Cast"): _cast,
    ("", "CastLike"): _cast_like,
    ("", "Where"): _where,
    ("", "Expand"): _expand,
    ("", "Max"): _extremum("Max"),
    ("", "Min"): _extremum("Min"),
    ("", "Concat"): _concat,
    ("", "Transpose"): _transpose,
    ("", "Reshape"): _reshape,
    ("", "Slice"): _slice,
    ("", "ConstantOfShape"): _constant_of_shape,
    ("", "Gather"): _gather,
    ("", "GatherND"): _gather_nd,
    ("", "ScatterND"): _scatter_nd,
    ("", "ScatterElements"): _scatter_elements,
    ("", "Trilu"): _trilu,
    ("", "Tile"): _tile,
    ("", "NonZero"): _nonzero,
    ("", "CumSum"): _cumsum,
    ("", "Split"): _split,
    ("", "MatMul"): lambda c: c.op(
        "MatMul", [c.x, c.op("Transpose", [c.x], perm=[0, 2, 1])], kind="float", rank=3
    ),
    ("", "MatMulInteger"): _matmul_integer,
    ("", "Softmax"): _softmax("Softmax"),
    ("", "LogSoftmax"): _softmax("LogSoftmax"),
    ("", "Flatten"): _flatten,
    ("", "Dropout"): _float_op("Dropout"),
    ("", "DynamicQuantizeLinear"): lambda c: c.op("DynamicQuantizeLinear", [c.float_item().value], outputs=3),
    ("", "LayerNormalization"): _norm("LayerNormalization", since=17),
    ("", "RMSNormalization"): _norm("RMSNormalization", since=23),
    ("", "SimplifiedLayerNormalization"): _norm("SimplifiedLayerNormalization"),
    ("", "RotaryEmbedding"): _rotary(""),
    (MICROSOFT, "MatMulNBits"): _matmul_nbits,
    (MICROSOFT, "SkipSimplifiedLayerNormalization"): _norm("SkipSimplifiedLayerNormalization", MICROSOFT),
    (MICROSOFT, "RotaryEmbedding"): _rotary(MICROSOFT),
}
BUILDERS |= {("", op): _unary(op) for op in UNARY} | {("", op): _reduce(op) for op in REDUCTIONS}

#: The opset from which an operator (or the form the builder writes) exists.
SINCE = {
    ("", "Trilu"): 14,
    ("", "CastLike"): 15,
    ("", "LayerNormalization"): 17,
    ("", "Gelu"): 20,
    ("", "RMSNormalization"): 23,
    ("", "RotaryEmbedding"): 23,
}


FIRST: tuple[str, str] | None = None
"""The operator every case begins with (``--op``; None: one drawn per case)."""


def build_case(seed: int, index: int) -> Case:
    """Case ``index`` of ``seed``: one operator of the table first (at an opset that has it),
    then up to seven more, each on what the case built so far."""
    rng = np.random.default_rng([seed, index])
    keys = sorted(BUILDERS)
    first = FIRST or keys[int(rng.integers(len(keys)))]
    case = Case(rng, int(rng.integers(max(OPSETS[0], SINCE.get(first, 0)), OPSETS[-1] + 1)))
    BUILDERS[first](case)
    for _ in range(int(rng.integers(0, 8))):
        key = keys[int(rng.integers(len(keys)))]
        if SINCE.get(key, 0) <= case.opset:
            BUILDERS[key](case)
    return case
