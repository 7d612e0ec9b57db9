"""The value types of :mod:`onnx_kvcache.passes.fusion._symbolic`: what the evaluator computes.

A symbolic value is a :class:`SymTensor`: a shape of :class:`Affine` forms over
:class:`Symbol` s (dimension names, fresh dimensions, axis and attention indices, opaque
maxima, products of lengths, entries and running sums of a 2-D integer input;
:class:`SymbolKind`), and an element expression: an affine form (integers), a :class:`Conj`
of :class:`Le` and :class:`MaskAt` atoms (booleans), an :class:`Additive` mask or a
:class:`FloatConst` (floats). The module docstring of
:mod:`~onnx_kvcache.passes.fusion._symbolic` states what each symbol means and how messages
print it; the operator rules that build these values are
:mod:`~onnx_kvcache.passes.fusion._symbolic_index`,
:mod:`~onnx_kvcache.passes.fusion._symbolic_lookup` and
:mod:`~onnx_kvcache.passes.fusion._symbolic_ops`, their table
:data:`~onnx_kvcache.passes.fusion._symbolic_rules.RULES`.

Here too: shape-dimension parsing (:func:`parse_dim`), broadcasting
(:func:`broadcast_shapes`, :func:`aligned_elem`), small constants (:func:`constant_array`),
opaque maxima (:func:`max_of`, :func:`min_of`) and :func:`nonnegative`. What cannot be
proven raises :class:`Unprovable`.
"""

from __future__ import annotations

__all__ = [
    "Additive",
    "Affine",
    "Conj",
    "Contradiction",
    "Evaluator",
    "FloatConst",
    "Le",
    "Lookup",
    "MaskAt",
    "Origin",
    "SymTensor",
    "Symbol",
    "SymbolKind",
    "Unprovable",
    "constant_array",
    "check_declared",
    "nonnegative",
]

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode, KindedReason

MASKED_BELOW = -65504.0
"""An additive mask value at or below this (float16's lowest, or -inf) zeroes softmax."""

_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})
_INT_TYPES = frozenset(
    {
        ir.DataType.INT64,
        ir.DataType.INT32,
        ir.DataType.INT16,
        ir.DataType.INT8,
        ir.DataType.UINT8,
        ir.DataType.UINT16,
        ir.DataType.UINT32,
        ir.DataType.UINT64,
    }
)
_MAX_CONST_ELEMENTS = 64


def _kind_of(dtype: ir.DataType | None) -> str:
    """A tensor's kind by its element type: ``int``, ``bool``, or ``data`` (anything else)."""
    if dtype in _INT_TYPES:
        return "int"
    if dtype == ir.DataType.BOOL:
        return "bool"
    return "data"


class Unprovable(KindedReason):
    """The evaluator cannot prove what a value computes; the message says why.

    ``rule`` is the reason's key: refusals of one key are one reason, whatever numbers or names
    their messages hold. A key given (``operator:...``, ``shape:...``) is kept; else it is the
    place the reason was first raised (file and line), read from its traceback when asked.
    ``kind`` is its :class:`~onnx_kvcache.passes.fusion._refusals.FusionRefusalCode` (None: the
    proof step's, :func:`~onnx_kvcache.passes.fusion._refusals.proof_step`). A reason raised
    again (:meth:`again`, :meth:`wrapped`) keeps its first kind, text and key."""

    def __init__(self, *args: object, kind: FusionRefusalCode | None = None, rule: str | None = None) -> None:
        super().__init__(*args)
        self.kind = kind
        self._rule = rule

    @property
    def rule(self) -> str:
        """The key given, else where the reason was first raised ("" while never raised)."""
        if self._rule is None:
            tb = self.__traceback__
            if tb is None:
                return ""
            while tb.tb_next is not None:  # the innermost frame: where it was raised
                tb = tb.tb_next
            self._rule = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        return self._rule

    def again(self) -> Unprovable:
        """The same reason, to raise again (its kind and place kept)."""
        return type(self)(*self.args, kind=self.kind, rule=self.rule)

    def wrapped(self, prefix: str) -> Unprovable:
        """The same reason said after ``prefix`` (its kind and place kept)."""
        return type(self)(f"{prefix}{self}", kind=self.kind, rule=self.rule)


class Contradiction(Unprovable):
    """A declared shape (value_info) that the shape its operator computes proves wrong: the model
    says two things of one value, and no proof trusts either (:func:`check_declared`)."""


def check_declared(
    value: ir.Value, declared: Sequence[Affine], computed: Sequence[Affine], node: ir.Node | None
) -> None:
    """Raise :class:`Contradiction` (malformed) when ``declared`` and ``computed`` differ in rank or
    in a dimension by a nonzero constant (``3`` and ``4``, ``past + seq`` and ``past + seq + 1``):
    shapes no value of the dimension names makes equal. Names that may be equal are not compared
    (a declared name is the model's word for a length)."""
    differ = len(declared) != len(computed) or any(
        (d - c).is_const and (d - c).const != 0 for d, c in zip(declared, computed)
    )
    if not differ:
        return
    where = f"{node.op_type} node {node.name!r}" if node is not None else "its producer"
    raise Contradiction(
        f"value {value.name!r} is declared [{', '.join(map(str, declared))}] but {where} computes "
        f"[{', '.join(map(str, computed))}] from its inputs: the export's value_info contradicts its "
        "own graph",
        kind=FusionRefusalCode.MALFORMED,
    )


class SymbolKind(enum.IntEnum):
    """What a :class:`Symbol` stands for (see the module docstring); forms list their terms
    in this order."""

    INDEX = 0
    FRESH = 1
    AXIS = 2
    DIM = 3
    MAX = 4
    ENTRY = 5
    COUNT = 6
    PRODUCT = 7


@dataclasses.dataclass(frozen=True, order=True)
class Symbol:
    """One variable of an :class:`Affine` form: its kind and name."""

    kind: SymbolKind
    name: str
    form: Affine | None = dataclasses.field(default=None, compare=False)
    """For :attr:`SymbolKind.MAX`: the ``e`` of ``max(0, e)`` (``name`` identifies it); for
    :attr:`SymbolKind.PRODUCT`: its factors, each symbol's coefficient its power."""
    at: Lookup | None = dataclasses.field(default=None, compare=False)
    """For :attr:`SymbolKind.ENTRY` and :attr:`SymbolKind.COUNT`: the input and the indices
    (``name`` identifies them)."""

    @staticmethod
    def dim(name: str) -> Symbol:
        """A dimension the graph names."""
        return Symbol(SymbolKind.DIM, name)

    @staticmethod
    def index(name: str) -> Symbol:
        """One of attention's indices (batch, head, query, key)."""
        return Symbol(SymbolKind.INDEX, name)

    @staticmethod
    def fresh(number: int) -> Symbol:
        """The ``number``-th unnamed dimension."""
        return Symbol(SymbolKind.FRESH, str(number))

    @staticmethod
    def maximum(form: Affine) -> Symbol:
        """``max(0, form)``, one symbol per (normalized) form."""
        return Symbol(SymbolKind.MAX, _key(form), form)

    @staticmethod
    def product(factors: Sequence[Symbol]) -> Symbol:
        """The product of two or more length symbols (a Reshape's flattened axes), one symbol per
        multiset of factors: a later Reshape that splits them again divides it exactly."""
        form = ZERO
        for factor in factors:
            form = form + Affine.of(factor)
        return Symbol(SymbolKind.PRODUCT, _key(form), form)

    @staticmethod
    def entry(source: str, row: Affine, col: Affine) -> Symbol:
        """``source[row, col]``: an entry of a 2-D integer graph input."""
        return Symbol(SymbolKind.ENTRY, f"{source}|{_key(row)}|{_key(col)}", at=Lookup(source, row, col))

    @staticmethod
    def count(source: str, row: Affine, col: Affine) -> Symbol:
        """``source[row, 0] + ... + source[row, col]``: a CumSum along the input's columns."""
        return Symbol(SymbolKind.COUNT, f"{source}|{_key(row)}|{_key(col)}", at=Lookup(source, row, col))

    def subs(self, mapping: Mapping[Symbol, Affine]) -> Symbol:
        """A lookup symbol with ``mapping`` applied to its indices (others: itself)."""
        if self.at is None:
            return self
        row, col = self.at.row.subs(mapping), self.at.col.subs(mapping)
        if (row, col) == (self.at.row, self.at.col):
            return self
        make = Symbol.entry if self.kind is SymbolKind.ENTRY else Symbol.count
        return make(self.at.source, row, col)

    def __str__(self) -> str:
        return _SHOWN[self.kind](self)


def _key(form: Affine) -> str:
    """``form`` spelled out unambiguously (kinds named): what identifies a symbol over it."""
    return ",".join(f"{s.kind.name}:{s.name}*{c}" for s, c in form.terms) + f"+{form.const}"


@dataclasses.dataclass(frozen=True)
class Lookup:
    """Where an :attr:`SymbolKind.ENTRY` or :attr:`SymbolKind.COUNT` symbol reads."""

    source: str
    row: Affine
    col: Affine


_SHOWN: dict[SymbolKind, Callable[[Symbol], str]] = {
    SymbolKind.INDEX: lambda s: s.name,
    SymbolKind.FRESH: lambda s: f"?{s.name}",
    SymbolKind.AXIS: lambda s: f"@{s.name}",
    SymbolKind.DIM: lambda s: s.name,
    SymbolKind.MAX: lambda s: f"max(0, {s.form})",
    SymbolKind.ENTRY: lambda s: f"{s.at.source}[{s.at.row}, {s.at.col}]" if s.at else s.name,
    SymbolKind.COUNT: lambda s: f"cumsum({s.at.source})[{s.at.row}, {s.at.col}]" if s.at else s.name,
    SymbolKind.PRODUCT: lambda s: (
        "*".join(str(f) for f, k in s.form.terms for _ in range(k)) if s.form else s.name
    ),
}


@dataclasses.dataclass(frozen=True)
class Affine:
    """``const + sum(coefficient * symbol)`` with integer coefficients."""

    terms: tuple[tuple[Symbol, int], ...] = ()
    const: int = 0

    @staticmethod
    def of(value: int | Symbol) -> Affine:
        return Affine(const=value) if isinstance(value, int) else Affine(((value, 1),))

    @staticmethod
    def _make(terms: Mapping[Symbol, int], const: int) -> Affine:
        return Affine(tuple(sorted((k, v) for k, v in terms.items() if v)), const)

    def __add__(self, other: Affine | int) -> Affine:
        other = other if isinstance(other, Affine) else Affine(const=other)
        terms = dict(self.terms)
        for name, coefficient in other.terms:
            terms[name] = terms.get(name, 0) + coefficient
        return Affine._make(terms, self.const + other.const)

    def __neg__(self) -> Affine:
        return Affine(tuple((k, -v) for k, v in self.terms), -self.const)

    def __sub__(self, other: Affine | int) -> Affine:
        return self + (-(other if isinstance(other, Affine) else Affine(const=other)))

    def scale(self, factor: int) -> Affine:
        return Affine._make({k: v * factor for k, v in self.terms}, self.const * factor)

    @property
    def is_const(self) -> bool:
        return not self.terms

    def coefficient(self, symbol: Symbol) -> int:
        return dict(self.terms).get(symbol, 0)

    @property
    def symbols(self) -> frozenset[Symbol]:
        return frozenset(k for k, _ in self.terms)

    def subs(self, mapping: Mapping[Symbol, Affine]) -> Affine:
        out = Affine(const=self.const)
        for name, coefficient in self.terms:
            if name in mapping:
                out = out + mapping[name].scale(coefficient)
            else:  # a lookup's indices are substituted too
                out = out + Affine(((name.subs(mapping), coefficient),))
        return out

    @property
    def lookups(self) -> frozenset[Symbol]:
        """The entry and running-sum symbols of the form."""
        return frozenset(k for k, _ in self.terms if k.at is not None)

    def __str__(self) -> str:
        parts = [f"{'' if v == 1 else '-' if v == -1 else f'{v}*'}{k}" for k, v in self.terms]
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts).replace("+ -", "- ")


ONE = Affine(const=1)
ZERO = Affine(const=0)


@dataclasses.dataclass(frozen=True)
class Le:
    """The condition ``lhs <= 0``."""

    lhs: Affine

    def subs(self, mapping: Mapping[Symbol, Affine]) -> Le:
        return Le(self.lhs.subs(mapping))


@dataclasses.dataclass(frozen=True)
class MaskAt:
    """The condition ``source[row, col] != 0`` for a 2-D graph input ``source``."""

    source: str
    row: Affine
    col: Affine

    def subs(self, mapping: Mapping[Symbol, Affine]) -> MaskAt:
        return MaskAt(self.source, self.row.subs(mapping), self.col.subs(mapping))


Atom = Le | MaskAt


@dataclasses.dataclass(frozen=True)
class Conj:
    """The conjunction of ``atoms``; no atoms is True."""

    atoms: frozenset[Atom] = frozenset()

    @staticmethod
    def of(*atoms: Atom) -> Conj:
        kept = set()
        for atom in atoms:
            if isinstance(atom, Le) and atom.lhs.is_const:
                if atom.lhs.const > 0:
                    return FALSE
                continue
            kept.add(atom)
        return Conj(frozenset(kept))

    def __and__(self, other: Conj) -> Conj:
        return Conj.of(*self.atoms, *other.atoms)

    @property
    def is_false(self) -> bool:
        return self == FALSE

    def subs(self, mapping: Mapping[Symbol, Affine]) -> Conj:
        return Conj.of(*(atom.subs(mapping) for atom in self.atoms))

    def negate(self) -> Conj:
        if self == TRUE:
            return FALSE
        if self.is_false:
            return TRUE
        if len(self.atoms) == 1:
            (atom,) = self.atoms
            if isinstance(atom, Le):  # not (x <= 0)  <=>  -x + 1 <= 0 over integers
                return Conj.of(Le(-atom.lhs + 1))
        zero = self._entry_is_zero()
        if zero is not None:  # not (m[r, c] == 0)  <=>  m[r, c] != 0
            return Conj.of(zero)
        raise Unprovable("the negation of a compound condition is not followed")

    def _entry_is_zero(self) -> MaskAt | None:
        """``m[r, c] != 0`` when this is ``m[r, c] == 0`` (``m[r, c] <= 0`` and ``-m[r, c] <= 0``)."""
        if len(self.atoms) != 2 or not all(isinstance(a, Le) for a in self.atoms):
            return None
        first, second = (a.lhs for a in self.atoms if isinstance(a, Le))
        if first + second != ZERO or first.const or len(first.terms) != 1:
            return None
        ((symbol, coefficient),) = first.terms
        if abs(coefficient) != 1 or symbol.kind is not SymbolKind.ENTRY or symbol.at is None:
            return None
        return MaskAt(symbol.at.source, symbol.at.row, symbol.at.col)


TRUE = Conj()
FALSE = Conj(frozenset({Le(ONE)}))


@dataclasses.dataclass(frozen=True)
class Additive:
    """A float mask: 0 where ``cond`` holds, a softmax-zeroing value elsewhere."""

    cond: Conj
    fill: float | None = dataclasses.field(default=None, compare=False)
    """That value where it is one value (a mask is equal to another whatever its fill)."""

    def subs(self, mapping: Mapping[Symbol, Affine]) -> Additive:
        return Additive(self.cond.subs(mapping), self.fill)


@dataclasses.dataclass(frozen=True)
class FloatConst:
    value: float

    def subs(self, mapping: Mapping[Symbol, Affine]) -> FloatConst:
        return self


Elem = Affine | Conj | Additive | FloatConst


@dataclasses.dataclass(frozen=True)
class SymTensor:
    """A tensor for all inputs at once: symbolic shape and element expression.

    ``elem`` is in terms of the axis symbols ``@0 .. @{rank-1}`` (None: unknown,
    e.g. float data). ``values`` lists a small integer tensor's elements (rank 0 or
    1); ``stack`` lists the components of an index tensor whose last axis stacks
    them (GatherND indices); ``source`` names the graph input a tensor is.
    """

    shape: tuple[Affine, ...]
    kind: str  # "int", "bool", "float", "data"
    elem: Elem | None = None
    values: tuple[Affine, ...] | None = None
    stack: tuple[Affine, ...] | None = None
    source: str | None = None
    conds: tuple[Conj, ...] | None = None
    """A small boolean vector's elements (comparisons of known integer vectors)."""
    origin: Origin | None = dataclasses.field(default=None, compare=False)
    """Where its values were lost (None: nowhere said): what a proof that needs them names."""

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def known(self) -> bool:
        """Whether anything is known of its values (else only its shape)."""
        return not (
            self.elem is None
            and self.values is None
            and self.stack is None
            and self.conds is None
            and self.source is None
        )

    def element(self) -> Elem:
        if self.elem is not None:
            return self.elem
        if self.values is not None and len(self.values) == 1:
            return self.values[0]
        if self.origin is not None:
            raise self.origin.unprovable()
        raise Unprovable("a tensor's elements are not known")


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a tensor's values were lost: the node that computes it, and why (the first reason
    a rule gave, or None: its operator has no rule for values)."""

    node: ir.Node | None
    """None: a graph input or initializer (``reason`` says why)."""
    index: int
    computes: str
    """What the operator computes, in words ("" when it has no rule)."""
    reason: Unprovable | None = None

    def unprovable(self) -> Unprovable:
        """The refusal of a proof that needs these values."""
        if self.reason is not None or self.node is None:
            return (
                self.reason.again()
                if self.reason is not None
                else Unprovable("a tensor's elements are not known", rule="values:unknown")
            )
        node = self.node
        output = node.outputs[self.index].name if self.index < len(node.outputs) else None
        what = f" ({self.computes})" if self.computes else ""
        domain = f" of domain {node.domain}" if node.domain not in ("", "ai.onnx") else ""
        return Unprovable(
            f"its values come from {node.op_type}{domain} node {node.name!r}{what}, output {output!r}, "
            "whose values no rule of the evaluator follows",
            kind=FusionRefusalCode.OPERATOR,
            rule=f"operator:{node.domain}:{node.op_type}",
        )


def axis(k: int) -> Symbol:
    """The index along axis ``k`` of the tensor an element expression describes."""
    return Symbol(SymbolKind.AXIS, str(k))


_TERM = re.compile(r"\s*([+-])?\s*(?:(\d+)\s*\*\s*)?([A-Za-z_][\w.]*|\d+)\s*")


def parse_dim(dim: object, fresh: Callable[[], Symbol]) -> Affine:
    """A shape dimension as an affine form: ints, names, sums like ``past + seq``."""
    if isinstance(dim, int):
        return Affine(const=dim)
    text = None if dim is None else str(dim)
    if not text or text == "None":
        return Affine.of(fresh())
    out, pos = ZERO, 0
    while pos < len(text):
        match = _TERM.match(text, pos)
        if not match or match.end() == pos:
            return Affine.of(Symbol.dim(text))
        sign = -1 if match.group(1) == "-" else 1
        factor = int(match.group(2) or 1) * sign
        atom = match.group(3)
        out = out + (
            Affine(const=int(atom) * factor) if atom.isdigit() else Affine.of(Symbol.dim(atom)).scale(factor)
        )
        pos = match.end()
        if pos < len(text) and text[pos] not in "+-":
            return Affine.of(Symbol.dim(text))
    return out


def _shift(elem: Elem, mapping: Mapping[Symbol, Affine]) -> Elem:
    return elem.subs(mapping)


def broadcast_shapes(*shapes: Sequence[Affine]) -> tuple[Affine, ...]:
    rank = max(len(s) for s in shapes)
    out: list[Affine] = []
    for k in range(rank):
        dims = [s[k - rank + len(s)] for s in shapes if k - rank + len(s) >= 0]
        chosen = ONE
        for dim in dims:
            if dim in (ONE, chosen):
                continue
            if chosen == ONE:
                chosen = dim
            elif not _equal(chosen, dim):
                raise Unprovable(f"cannot prove that dimensions {chosen} and {dim} broadcast")
        out.append(chosen)
    return tuple(out)


def aligned_elem(tensor: SymTensor, out_shape: Sequence[Affine]) -> Elem:
    """``tensor``'s element in the axis variables of a broadcast result of ``out_shape``."""
    elem = tensor.element()
    offset = len(out_shape) - tensor.rank
    mapping = {}
    for k, dim in enumerate(tensor.shape):
        mapping[axis(k)] = ZERO if dim == ONE else Affine.of(axis(k + offset))
    return _shift(elem, mapping)


def constant_array(value: ir.Value) -> np.ndarray | None:
    """A small constant's values (initializer or Constant node); weights are never read."""
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant" and producer.domain == "":
        for name, attr in producer.attributes.data.items():
            if name == "value" and attr.type == ir.AttributeType.TENSOR:
                tensor = attr.value
            elif name in _CONSTANT_ATTRIBUTES:
                return np.asarray(attr.value, dtype=_CONSTANT_ATTRIBUTES[name])
    if tensor is None:
        return None
    dims = getattr(getattr(tensor, "raw", None), "dims", None)  # a proto's: no Shape built to count
    if math.prod(dims if dims is not None else tensor.shape.dims) > _MAX_CONST_ELEMENTS:
        return None
    return np.asarray(tensor.numpy())


_CONSTANT_ATTRIBUTES = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def _kind(dtype: ir.DataType | None) -> str:
    if dtype in _INT_TYPES:
        return "int"
    if dtype == ir.DataType.BOOL:
        return "bool"
    if dtype in _FLOAT_TYPES:
        return "float"
    raise Unprovable(f"element type {dtype} is not followed")


def max_of(a: Affine, b: Affine) -> Affine:
    """``max(a, b)`` as an affine form over one opaque symbol ``max(0, e)``.

    ``max(a, b) = b + max(0, a - b)``; ``e`` is normalized (its first coefficient positive,
    else ``a + max(0, b - a)``), so every computation of the same maximum names the same
    symbol. Where one side is the larger for every value of the symbols (proven by
    :mod:`~onnx_kvcache.passes.fusion._piecewise`: ``max(0, past - max(0, past - 3))`` is
    ``past - max(0, past - 3)``), that side is the result and no symbol is made. Forms that
    are equal but written differently are compared with :func:`~onnx_kvcache.passes.fusion.
    _piecewise.equal`. Maxima over index variables (axes, attention's indices) are refused:
    substitution does not reach inside them.
    """
    e = a - b
    if e.is_const:
        return b + max(0, e.const)
    if any(symbol.kind in _INDICES for symbol in e.symbols):
        raise Unprovable("a maximum over tensor indices is not followed")
    from onnx_kvcache.passes.fusion._piecewise import always_nonnegative  # it reads these types

    if always_nonnegative(e):  # one side is the maximum for every value: no new symbol
        return a
    if always_nonnegative(-e):
        return b
    base = b
    if e.terms[0][1] < 0:
        e, base = -e, a
    return base + Affine.of(Symbol.maximum(e))


_INDICES = frozenset({SymbolKind.AXIS, SymbolKind.INDEX, SymbolKind.ENTRY, SymbolKind.COUNT})
_LENGTHS = frozenset({SymbolKind.DIM, SymbolKind.FRESH, SymbolKind.MAX, SymbolKind.PRODUCT})


def _equal(a: Affine, b: Affine) -> bool:
    from onnx_kvcache.passes.fusion._piecewise import equal  # it reads these types

    return equal(a, b)


def nonnegative(form: Affine) -> bool:
    """``form >= 0`` for every value of its symbols: a sum of lengths and a constant >= 0."""
    return form.const >= 0 and all(c > 0 and s.kind in _LENGTHS for s, c in form.terms)


def min_of(a: Affine, b: Affine) -> Affine:
    return a + b - max_of(a, b)


class Evaluator(Protocol):
    """What the operator rules read of the evaluator
    (:class:`~onnx_kvcache.passes.fusion._symbolic.SymbolicEvaluator`, which reads the rules: the
    rules' modules name this instead, so that none of them imports the evaluator's)."""

    def eval(self, value: ir.Value | None) -> SymTensor: ...

    def shape(self, value: ir.Value | None) -> tuple[Affine, ...]: ...

    def values(self, value: ir.Value | None, what: str) -> tuple[Affine, ...]: ...

    def const_ints(self, value: ir.Value | None, what: str) -> list[int] | None: ...

    def scalar(self, value: ir.Value | None, what: str) -> Affine: ...

    def dtype(self, value: ir.Value | None) -> ir.DataType | None: ...

    def declared_shape(self, value: ir.Value) -> tuple[Affine, ...]: ...

    def fresh(self) -> Symbol: ...
