"""A differential fuzz of the fusions' symbolic evaluator against onnxruntime.

    python benchmarks/symbolic_fuzz.py --cases N --seed S [--jobs J] [--start I] [--op OP]
        [--only K] [--quiet]

Each case is a random graph over symbolic dimensions (float ``x [A, B, C]``, integer inputs
``m [R, K]`` (int64) and ``n [R, K]`` (int32) read by entries, ``ids [S]``) built from the
operators of the evaluator's rule table
(:data:`~onnx_kvcache.passes.fusion._symbolic_rules.RULES`: shape arithmetic, index ranges,
masks, casts, gathers, slices, reductions, ...), one builder per row (:data:`BUILDERS`), at
one opset of 12 to 24, each operator in the form that opset defines (``axes`` an attribute or
an input, ``Split``'s sizes, ``num_outputs``, ``Shape``'s ``start``/``end``, a softmax's
default axis). Constants are drawn small, negative, at the narrow types' boundaries and at
int64's extremes; half are initializers, half ``Constant`` nodes. Every node's output is a
graph output. One evaluator evaluates them all; onnxruntime (CPU, no graph optimizations)
then runs the graph at four sizes of the dimensions (some 0, all 1, small, one of 1000) and
entries of ``m``/``n`` (0/1, small signed, boundaries, the type's extremes), and every claim
the evaluator makes is compared with what onnxruntime computed: each shape and element type
(fresh dimensions bound on first sight), an integer tensor's element form and small vectors'
values (exact integers), a boolean's condition, an index stack, a float mask (0 where kept,
its fill elsewhere) and a float constant. A claim that differs is a disagreement: it is
printed with the case's graph, the sizes and the inputs, reproducible with
``--seed S --only K``. The last line reads ``N cases, D disagreements``. ``--jobs`` shares the
same cases among processes, ``--start`` begins at a later case (a long run in parts); ``--op``
begins every case with one operator (one rule's fuzz).

What is not a disagreement, and why:

- the evaluator declines (Unprovable, or a value left opaque): a refusal is always sound;
- onnxruntime does not load the graph (a form the opset does not define, types that do not
  match): the graph computes nothing, so nothing the evaluator says of it is wrong;
- a node onnxruntime refuses at some sizes (an index past an empty axis, shapes that do not
  broadcast): it and what reads it compute nothing there; the rest of the graph is run
  without them and compared;
- a run in which an int64 ``Add``, ``Sub``, ``Mul``, ``Neg``, ``CumSum`` or ``ReduceSum``
  overflowed (checked against the same operation in exact integers on the run's own
  values): onnxruntime wraps, while the evaluator's integers are exact. Its claims hold for
  every run without an overflow (the premise a length or token count satisfies); such a run
  is counted apart. A narrowing ``Cast`` is no overflow: it wraps by definition and is
  compared.

An evaluator exception other than Unprovable is a disagreement too.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import multiprocessing
import re
import sys
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnx_kvcache.passes.fusion._symbolic import SymbolicEvaluator, Unprovable
from onnx_kvcache.passes.fusion._symbolic_rules import MICROSOFT
from onnx_kvcache.passes.fusion._symbolic_values import (
    MASKED_BELOW,
    Additive,
    Affine,
    Conj,
    FloatConst,
    Le,
    MaskAt,
    SymbolKind,
    SymTensor,
)

I64, I32, F32, BOOL = ir.DataType.INT64, ir.DataType.INT32, ir.DataType.FLOAT, ir.DataType.BOOL
NARROW = (ir.DataType.INT32, ir.DataType.INT16, ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.UINT32)
INT64_MAX, INT64_MIN = int(np.iinfo(np.int64).max), int(np.iinfo(np.int64).min)
BOUNDARIES = (127, 128, -128, -129, 255, 256, 2**15, 2**31 - 1, 2**31, -(2**31), 2**32, 2**62)
EXTREMES = (INT64_MAX, INT64_MIN, INT64_MAX - 1, INT64_MIN + 1)
OPSETS = range(12, 25)
DIMS = ("A", "B", "C", "R", "K", "S")
LARGE = 1000
"""The large size one dimension takes in some runs."""


# ---- building a case ----


@dataclasses.dataclass
class Item:
    """A value the case may read: its element type group and rank."""

    value: ir.Value
    kind: str  # "int" (int64), "narrow", "bool", "float"
    rank: int


class Case:
    """One random graph under construction, at one opset."""

    def __init__(self, rng: np.random.Generator, opset: int) -> None:
        self.rng = rng
        self.opset = opset
        self.x = ir.val("x", F32, ["A", "B", "C"])
        self.m = ir.val("m", I64, ["R", "K"])
        self.ids = ir.val("ids", I64, ["S"])
        self.n = ir.val("n", I32, ["R", "K"])
        self.nodes: list[ir.Node] = []
        self.consts: list[ir.Value] = []
        self.domains = {"": opset}
        self.pool = [
            Item(self.x, "float", 3),
            Item(self.m, "int", 2),
            Item(self.ids, "int", 1),
            Item(self.n, "narrow", 2),
        ]

    # -- nodes and constants

    def op(self, op_type: str, inputs, outputs: int = 1, domain: str = "", kind=None, rank=None, **attrs):
        node = ir.node(op_type, list(inputs), attrs or None, domain=domain, num_outputs=outputs)
        node.name = f"n{len(self.nodes)}"
        for k, out in enumerate(node.outputs):
            out.name = f"{node.name}_{k}"
        self.nodes.append(node)
        if domain:
            self.domains[domain] = 1
        if kind is not None:
            self.pool.append(Item(node.outputs[0], kind, rank))
        return node.outputs[0]

    def const(self, array) -> ir.Value:
        """A constant: an initializer, or (half the time) a Constant node."""
        array = np.asarray(array)
        if self.rng.integers(2):
            value = ir.Value(name=f"c{len(self.consts)}", const_value=ir.tensor(array))
            self.consts.append(value)
            return value
        return self.op("Constant", [], value=ir.tensor(array))

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

    def model(self) -> ir.Model:
        outputs = [v for n in self.nodes for v in n.outputs]
        graph = ir.Graph(
            [self.x, self.m, self.ids, self.n], outputs, nodes=self.nodes, opset_imports=dict(self.domains)
        )
        for value in self.consts:
            graph.register_initializer(value)
        return ir.Model(graph, ir_version=10)


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
for _op in (
    "Sqrt", "Reciprocal", "Sigmoid", "Tanh", "Cos", "Sin", "Exp", "Erf", "Relu", "Abs", "IsNaN",
    "IsInf", "Gelu", "Softplus", "Log", "Floor", "Ceil", "Round", "Sign",
):  # fmt: skip
    BUILDERS[("", _op)] = _unary(_op)
for _op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2"):
    BUILDERS[("", _op)] = _reduce(_op)

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


# ---- the evaluator's claims made concrete ----


class Mismatch(Exception):
    """A claim that differs from what onnxruntime computed."""


class Unbound(Exception):
    """A claim reads a symbol with no concrete value here (a fresh dimension not yet seen)."""


@dataclasses.dataclass
class Run:
    """One onnxruntime run: the sizes, the inputs, fresh dimensions bound so far."""

    dims: dict[str, int]
    feeds: dict[str, np.ndarray]
    exact: bool
    fresh: dict[str, int] = dataclasses.field(default_factory=dict)


def _array(x, exact: bool) -> np.ndarray:
    return np.asarray(x, dtype=object if exact else np.int64)


def concrete(form: Affine, run: Run, grid: list[np.ndarray]) -> np.ndarray:
    """``form``'s value (at every index of ``grid``), in exact integers where they may be large."""
    exact = run.exact or abs(form.const) > 2**31 or any(abs(c) > 2**31 for _, c in form.terms)
    total = _array(form.const, exact)
    for symbol, c in form.terms:
        total = total + _array(c, exact) * _array(_symbol(symbol, run, grid), exact)
    return total


def _symbol(symbol, run: Run, grid: list[np.ndarray]):
    kind = symbol.kind
    if kind is SymbolKind.DIM:
        return run.dims[symbol.name]
    if kind is SymbolKind.FRESH:
        if symbol.name not in run.fresh:
            raise Unbound(str(symbol))
        return run.fresh[symbol.name]
    if kind is SymbolKind.AXIS:
        return grid[int(symbol.name)]
    if kind is SymbolKind.MAX:
        inner = concrete(symbol.form, run, grid)
        return np.where(inner > 0, inner, 0)
    if kind is SymbolKind.PRODUCT:
        total = 1
        for factor, power in symbol.form.terms:
            total = total * _symbol(factor, run, grid) ** power
        return total
    if kind in (SymbolKind.ENTRY, SymbolKind.COUNT):
        return _lookup(symbol.at.source, symbol.at.row, symbol.at.col, run, grid, kind is SymbolKind.COUNT)
    raise Unbound(str(symbol))


def _lookup(source: str, row: Affine, col: Affine, run: Run, grid, count: bool = False) -> np.ndarray:
    data = run.feeds[source].astype(object if run.exact else np.int64)
    r, k = (concrete(f, run, grid) for f in (row, col))
    if count:
        data = np.concatenate([np.zeros((data.shape[0], 1), data.dtype), np.cumsum(data, axis=1)], axis=1)
        k = k + 1
    r, k = np.broadcast_arrays(r, k)
    if r.size and (r.min() < 0 or r.max() >= data.shape[0] or k.min() < 0 or k.max() >= data.shape[1]):
        raise Mismatch(f"it reads {source}[{row}, {col}] outside {source}'s {list(run.feeds[source].shape)}")
    return data[r.astype(np.int64), k.astype(np.int64)]


def condition(cond: Conj, run: Run, grid: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    out = np.ones(shape, bool)
    for atom in cond.atoms:
        if isinstance(atom, Le):
            out &= np.broadcast_to(np.asarray(concrete(atom.lhs, run, grid) <= 0, bool), shape)
        else:
            assert isinstance(atom, MaskAt)
            found = _lookup(atom.source, atom.row, atom.col, run, grid)
            out &= np.broadcast_to(np.asarray(found != 0, bool), shape)
    return out


def _same(claimed: np.ndarray, got: np.ndarray, what: str) -> None:
    claimed = np.broadcast_to(claimed, got.shape)
    if got.dtype == bool or claimed.dtype == bool:
        equal = np.asarray(claimed, bool) == got
    else:
        equal = np.asarray(claimed == got.astype(object), bool)
    if not equal.all():
        at = tuple(int(i) for i in np.argwhere(~equal)[0])
        raise Mismatch(f"{what} at {list(at)}: said {claimed[at]}, onnxruntime {got[at]}")


_KINDS = {"int": "iu", "bool": "b", "float": "f", "data": "f"}


def check_shape(tensor: SymTensor, got: np.ndarray, run: Run) -> None:
    if "?" not in (kinds := _KINDS.get(tensor.kind, "?")) and got.dtype.kind not in kinds:
        raise Mismatch(f"said {tensor.kind} elements, onnxruntime's are {got.dtype}")
    if tensor.rank != got.ndim:
        raise Mismatch(
            f"said rank {tensor.rank} ({_shown(tensor.shape)}), onnxruntime's shape is {list(got.shape)}"
        )
    for k, dim in enumerate(tensor.shape):
        if len(dim.terms) == 1 and dim.terms[0][0].kind is SymbolKind.FRESH and dim.terms[0][1] == 1:
            name = dim.terms[0][0].name
            run.fresh.setdefault(name, got.shape[k] - dim.const)
        try:
            size = int(concrete(dim, run, []))
        except Unbound:
            continue
        if size != got.shape[k]:
            raise Mismatch(f"said shape {_shown(tensor.shape)}, onnxruntime's is {list(got.shape)}")


def _shown(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def check_elements(tensor: SymTensor, got: np.ndarray, run: Run) -> int:
    """Compare what ``tensor`` says of the elements with ``got``; how many claims it made."""
    said = 0
    if tensor.values is not None and tensor.rank <= 1:
        if len(tensor.values) != got.size:
            raise Mismatch(f"said {len(tensor.values)} values, onnxruntime has {got.size}")
        if got.size:
            claimed = np.array([concrete(v, run, []) for v in tensor.values], dtype=object)
            _same(claimed.reshape(got.shape), got, "values")
        said += 1
    if tensor.conds is not None:
        claimed = np.array([condition(c, run, [], ()) for c in tensor.conds]).reshape(-1)
        if claimed.size != got.size:
            raise Mismatch(f"said {claimed.size} conditions, onnxruntime has {got.size}")
        _same(claimed.reshape(got.shape), got, "conditions")
        said += 1
    if tensor.stack is not None and got.size:
        inner = list(np.indices(got.shape[:-1], dtype=np.int64))
        forms = [np.broadcast_to(concrete(f, run, inner), got.shape[:-1]) for f in tensor.stack]
        if got.shape[-1] != len(forms):
            raise Mismatch(f"said a stack of {len(forms)}, onnxruntime's last axis is {got.shape[-1]}")
        _same(np.stack(forms, -1), got, "index stack")
        said += 1
    if tensor.elem is not None and got.size:
        said += _check_elem(tensor.elem, got, run)
    return said


def _check_elem(elem, got: np.ndarray, run: Run) -> int:
    grid = list(np.indices(got.shape, dtype=np.int64))
    if isinstance(elem, Affine):
        _same(concrete(elem, run, grid), got, f"element {elem}")
    elif isinstance(elem, Conj):
        _same(condition(elem, run, grid, got.shape), got, "condition")
    elif isinstance(elem, Additive):
        keep = condition(elem.cond, run, grid, got.shape)
        if not np.all(got[keep] == 0) or not np.all(got[~keep] <= MASKED_BELOW):
            raise Mismatch(f"said a mask (0 where kept), onnxruntime {got.reshape(-1)[:8]} ...")
        if elem.fill is not None and not np.all(got[~keep] == elem.fill):
            raise Mismatch(f"said a mask filled with {elem.fill}, onnxruntime {got[~keep][:4]}")
    elif isinstance(elem, FloatConst) and not np.array_equal(
        got, np.full(got.shape, elem.value, got.dtype), equal_nan=True
    ):
        raise Mismatch(f"said {elem.value} everywhere, onnxruntime {got.reshape(-1)[:4]}")
    return 1


# ---- onnxruntime's runs ----


def sizes(rng: np.random.Generator) -> list[dict[str, int]]:
    """The runs' sizes: some 0, all 1, small, and one dimension large."""
    small = {d: int(rng.integers(1, 6)) for d in DIMS}
    zeros = dict(small, **{str(d): 0 for d in rng.choice(DIMS, int(rng.integers(1, 3)), replace=False)})
    ones = {d: 1 for d in DIMS}
    large = dict({d: int(rng.integers(1, 4)) for d in DIMS}, **{str(rng.choice(DIMS)): LARGE})
    return [zeros, ones, small, large]


def entries(rng: np.random.Generator, shape: tuple[int, ...], dtype=np.int64) -> np.ndarray:
    """An integer input's entries: 0/1 mostly, else small signed, boundaries or the extremes."""
    mode = rng.random()
    if mode < 0.5:
        return rng.integers(0, 2, shape).astype(dtype)
    if mode < 0.7:
        return rng.integers(-3, 4, shape).astype(dtype)
    info = np.iinfo(dtype)
    extremes = (int(info.max), int(info.min), int(info.max) - 1, int(info.min) + 1) if mode > 0.85 else ()
    values = [v for v in (0, 1, -1, *BOUNDARIES, *(-b for b in BOUNDARIES)) if info.min <= v <= info.max]
    return rng.choice(np.array([*values, *extremes], object), shape).astype(dtype)


def feeds_for(rng: np.random.Generator, dims: dict[str, int]) -> dict[str, np.ndarray]:
    return {
        "x": rng.standard_normal((dims["A"], dims["B"], dims["C"])).astype(np.float32),
        "m": entries(rng, (dims["R"], dims["K"])),
        "ids": rng.integers(0, 9, dims["S"]).astype(np.int64),
        "n": entries(rng, (dims["R"], dims["K"]), np.int32),
    }


_WRAPS = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}


def overflowed(model: ir.Model, values: dict[str, np.ndarray]) -> bool:
    """Whether an int64 Add, Sub, Mul or Neg of the run wrapped (its exact result differs), or a
    CumSum or ReduceSum may have (the sum of its input's magnitudes exceeds int64)."""
    for node in model.graph:
        out = values.get(node.outputs[0].name)
        if out is None or out.dtype != np.int64:
            continue
        inputs = [values.get(v.name) if v is not None else None for v in node.inputs]
        if node.op_type in _WRAPS and all(i is not None for i in inputs[:2]):
            exact = _WRAPS[node.op_type](inputs[0].astype(object), inputs[1].astype(object))
        elif node.op_type == "Neg" and inputs[0] is not None:
            exact = -inputs[0].astype(object)
        elif node.op_type in ("CumSum", "ReduceSum") and inputs[0] is not None:
            if sum(abs(int(v)) for v in inputs[0].reshape(-1)) > INT64_MAX:
                return True
            continue
        else:
            continue
        if np.shape(exact) == out.shape and not np.all(exact == out.astype(object)):
            return True
    return False


def _session(model: onnx.ModelProto, names: list[str] | None = None):
    """A one-thread CPU session without graph optimizations; with ``names``, of the graph that
    computes only those outputs."""
    proto = model
    if names is not None:
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        kept = set(names)
        outputs = [o for o in proto.graph.output if o.name in kept]
        needed = set(kept)
        nodes = []
        for node in reversed(proto.graph.node):
            if any(o in needed for o in node.output):
                nodes.append(node)
                needed.update(node.input)
        del proto.graph.output[:]
        proto.graph.output.extend(outputs)
        del proto.graph.node[:]
        proto.graph.node.extend(reversed(nodes))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


# ---- a case: the evaluator's claims against onnxruntime's runs ----


@dataclasses.dataclass
class Tally:
    cases: int = 0
    loaded: int = 0
    runs: int = 0
    refused_runs: int = 0
    overflowed_runs: int = 0
    shapes: int = 0
    elements: int = 0
    declined: int = 0
    disagreements: int = 0
    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass
class Disagreement:
    case: int
    value: str
    text: str
    dims: dict[str, int] | None = None
    feeds: dict[str, np.ndarray] | None = None


def claims(model: ir.Model) -> tuple[dict[str, SymTensor | None], list[Disagreement]]:
    """The evaluator's answer for every node output (None: declined), one evaluator for the graph."""
    ev = SymbolicEvaluator()
    found: dict[str, SymTensor | None] = {}
    crashed = []
    for node in model.graph:
        for value in node.outputs:
            try:
                found[value.name] = ev.eval(value)
            except Unprovable:
                found[value.name] = None
            except Exception as error:  # a rule that breaks is a finding too
                found[value.name] = None
                crashed.append(
                    Disagreement(-1, value.name, f"the evaluator raised {type(error).__name__}: {error}")
                )
    return found, crashed


def run_case(seed: int, index: int, tally: Tally) -> list[Disagreement]:
    case = build_case(seed, index)
    model = case.model()
    tally.cases += 1
    said, found = claims(model)
    try:
        proto = ir.to_proto(model)
        session = _session(proto)
    except Exception:
        return [dataclasses.replace(d, case=index) for d in found]
    tally.loaded += 1
    tally.ops.update((n.domain, n.op_type) for n in model.graph if n.op_type != "Constant")
    tally.declined += sum(1 for t in said.values() if t is None or not t.known)
    names = [o.name for o in session.get_outputs()]
    for d in found:
        d.case = index
    for dims in sizes(case.rng):
        found += _compare_run(case, model, proto, session, names, said, dims, tally)
    return found


_FAILED_NODE = re.compile(r"running \S+ node\. Name:'([^']*)'")


def _without(model: ir.Model, name: str, names: list[str]) -> list[str]:
    """``names`` less the outputs of node ``name`` and of every node that reads them."""
    lost: set[str] = set()
    for node in model.graph:  # in order: a reader comes after what it reads
        if node.name == name or any(v is not None and v.name in lost for v in node.inputs):
            lost.update(o.name for o in node.outputs)
    return [n for n in names if n not in lost]


def run_pruned(model: ir.Model, proto, session, names: list[str], feeds) -> dict[str, np.ndarray] | None:
    """onnxruntime's outputs at ``feeds``; where a node refuses these sizes, the outputs that do not
    depend on it, from the graph without it (onnxruntime runs every node of a graph, fetched or
    not). None: nothing could be computed."""
    for _ in range(8):
        if not names:
            return None
        try:
            return dict(zip(names, (np.asarray(o) for o in session.run(names, feeds))))
        except Exception as error:
            failed = _FAILED_NODE.search(str(error))
            if failed is None:
                return None
            names = _without(model, failed.group(1), names)
            try:
                session = _session(proto, names)
            except Exception:
                return None
    return None


def _compare_run(case, model, proto, session, names, said, dims, tally: Tally) -> list[Disagreement]:
    feeds = feeds_for(case.rng, dims)
    values = run_pruned(model, proto, session, names, feeds)
    if values is None:
        tally.refused_runs += 1
        return []
    values |= {v.name: np.asarray(v.const_value.numpy()) for v in model.graph.initializers.values()}
    values |= feeds
    if overflowed(model, values):
        tally.overflowed_runs += 1
        return []
    tally.runs += 1
    large = max(int(np.abs(feeds[k].astype(object)).max(initial=0)) for k in ("m", "n"))
    run = Run(dims, feeds, exact=large >= 2**31)
    found = []
    ordered = sorted(said.items(), key=lambda kv: kv[1] is None)
    for phase in ("shape", "elements"):
        for name, tensor in ordered:
            if tensor is None or name not in values or name in {d.value for d in found}:
                continue
            try:
                if phase == "shape":
                    check_shape(tensor, values[name], run)
                    tally.shapes += 1
                else:
                    tally.elements += check_elements(tensor, values[name], run)
            except Unbound:
                continue
            except Mismatch as why:
                found.append(Disagreement(0, name, str(why), dims, feeds))
    return found


def _op_option() -> str:
    return "" if FIRST is None else f" --op {'.'.join(p for p in FIRST if p)}"


def report(seed: int, index: int, d: Disagreement) -> str:
    case = build_case(seed, index)
    model = case.model()
    node = next((n for n in model.graph if any(o.name == d.value for o in n.outputs)), None)
    where = f"{node.op_type} node {node.name!r}" if node is not None else "?"
    lines = [
        f"disagreement: case {index} (--seed {seed} --only {index}{_op_option()}), opset {case.opset}: "
        f"value {d.value!r} of {where}: {d.text}"
    ]
    if d.dims is not None:
        lines.append(f"  sizes {d.dims}")
        lines.append(f"  m = {d.feeds['m'].tolist() if d.feeds['m'].size <= 64 else '(large)'}")
        lines.append(f"  ids = {d.feeds['ids'].tolist() if d.feeds['ids'].size <= 64 else '(large)'}")
    text = onnx.printer.to_text(ir.to_proto(model).graph)
    lines.extend("  " + line for line in text.splitlines())
    return "\n".join(lines)


def _chunk(job: tuple[int, int, int, bool]) -> tuple[Tally, list[str]]:
    """Cases ``start`` to ``stop`` of ``seed``: their tally and the reports of their disagreements."""
    seed, start, stop, quiet = job
    tally, reports = Tally(), []
    for index in range(start, stop):
        for d in run_case(seed, index, tally):
            tally.disagreements += 1
            if not quiet:
                reports.append(report(seed, index, d))
    return tally, reports


def _add(total: Tally, part: Tally) -> None:
    for field in dataclasses.fields(Tally):
        if field.name != "ops":
            setattr(total, field.name, getattr(total, field.name) + getattr(part, field.name))
    total.ops.update(part.ops)


def fuzz(
    cases: int,
    seed: int,
    only: int | None = None,
    out=None,
    quiet: bool = False,
    jobs: int = 1,
    start: int = 0,
) -> Tally:
    """Cases ``start .. start + cases - 1`` of ``seed`` (or case ``only``), over ``jobs``
    processes, in order: the same cases and the same reports whatever ``jobs``."""
    out = out or sys.stdout
    tally = Tally()
    first, last = (only, only + 1) if only is not None else (start, start + cases)
    chunks = [(seed, k, min(k + _CHUNK, last), quiet) for k in range(first, last, _CHUNK)]
    with multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        parts = pool.imap(_chunk, chunks) if pool is not None else map(_chunk, chunks)
        for (_, _, stop, _), (part, reports) in zip(chunks, parts):
            _add(tally, part)
            for text in reports:
                print(text, file=out)
            if stop % 10000 == 0:
                print(
                    f"{tally.cases} cases (to case {stop - 1}), {tally.disagreements} disagreements so far",
                    file=sys.stderr,
                    flush=True,
                )
    return tally


_CHUNK = 500
"""Cases a process takes at a time."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000, help="how many random graphs")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the cases")
    parser.add_argument("--only", type=int, default=None, help="run only case K of the seed (a reproduction)")
    parser.add_argument("--start", type=int, default=0, help="the first case (the cases of a longer run)")
    parser.add_argument("--quiet", action="store_true", help="print only the counts")
    parser.add_argument("--jobs", type=int, default=1, help="processes that share the cases")
    parser.add_argument("--op", default=None, help="begin every case with this operator (com.microsoft.X)")
    args = parser.parse_args(argv)
    global FIRST
    FIRST = None if args.op is None else (args.op.rpartition(".")[0], args.op.rpartition(".")[2])
    if FIRST is not None and FIRST not in BUILDERS:
        parser.error(f"--op {args.op}: not an operator of the rule table")
    start = time.perf_counter()
    tally = fuzz(args.cases, args.seed, args.only, quiet=args.quiet, jobs=args.jobs, start=args.start)
    seconds = time.perf_counter() - start
    print(
        f"{tally.loaded} of {tally.cases} graphs loaded by onnxruntime, {tally.runs} runs compared "
        f"({tally.refused_runs} refused by onnxruntime, {tally.overflowed_runs} with an int64 overflow), "
        f"{tally.shapes} shapes and {tally.elements} element claims checked, {tally.declined} values "
        f"declined, {len(tally.ops)} operators, {seconds:.1f} s"
    )
    print(f"{tally.cases} cases, {tally.disagreements} disagreements")
    return 1 if tally.disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
