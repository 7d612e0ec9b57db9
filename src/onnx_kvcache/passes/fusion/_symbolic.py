"""Symbolic evaluation of the index and mask subgraphs that exporters write around attention.

Exporters build attention masks and shape vectors from ``Shape``, ``Range``,
``Unsqueeze``, comparisons and ``GatherND``. :class:`SymbolicEvaluator` evaluates such
a subgraph for *every* input at once, so a fusion can prove what a mask computes rather
than match one exporter's op sequence:

- a dimension is an integer affine form (:class:`Affine`) over the graph's symbolic
  dimension names. Two values that name a dimension alike (``batch``, ``past``) are the
  same length: that is the model's declared interface. An unnamed dimension is a fresh
  symbol, equal to nothing else;
- an integer tensor's element is an affine form over its axis indices (``@0``, ``@1``,
  ...); a boolean tensor's element is a conjunction (:class:`Conj`) of ``form <= 0``
  atoms (:class:`Le`) and lookups into a 2-D graph input (:class:`MaskAt`); a float
  mask is :class:`Additive` (0 where a condition holds, a value that zeroes softmax
  elsewhere);
- float data (Q, K, V) is followed by shape only, through elementwise arithmetic and
  Slices too;
- ``Max``/``Min`` of lengths (transformers 5.x's sliding-window sizes) are one opaque
  symbol ``max(0, e)`` per normalized ``e``, compared only for identity;
- a constant-folded integer tensor that is an affine function of its indices (a folded
  ``Range``, a ``GatherND`` index grid) is read as that function;
- a 2-D integer graph input's element is its entry symbol ``m[@0, @1]``; ``Cast`` of one
  entry to bool is the lookup ``m[r, c] != 0`` (:class:`MaskAt`), a ``CumSum`` along its
  columns the running sum ``cumsum(m)[r, c]``;
- ``ties`` (:class:`SymbolicEvaluator`) state equations between the dimensions the graph
  names, applied to every declared shape (a caller that knows two lengths are equal
  whenever the graph runs says so).

Every rule is exact. What the evaluator cannot follow raises :class:`Unprovable` with
the reason; the caller then leaves the graph alone. Graphs without shape annotations
(TorchScript exports) are followed from their inputs by the rules of
:mod:`onnx_kvcache.passes.fusion._symbolic_ops` (call :meth:`SymbolicEvaluator.prime` first on deep ones).

The value types (symbols, forms, conditions, :class:`SymTensor`) are
:mod:`onnx_kvcache.passes.fusion._symbolic_values`; this module is the evaluator and its
operator rules, and re-exports those types.

Symbols (:class:`Symbol`, of a :class:`SymbolKind`; how messages print them):

- ``past``, ``batch``, ``past + seq`` (:attr:`SymbolKind.DIM`): a dimension the graph names;
  a name that is no sum (``(past + seq)``) is one symbol;
- ``?3`` (:attr:`SymbolKind.FRESH`): an unnamed dimension, equal only to itself;
- ``@0``, ``@1`` (:attr:`SymbolKind.AXIS`): the index along a tensor's axis 0, 1, ... in
  the element expression of that tensor;
- ``batch``, ``head``, ``query``, ``key`` (:attr:`SymbolKind.INDEX`): attention's indices
  (:mod:`onnx_kvcache.passes.fusion._match` names a mask's axes so: batch ``b``, head,
  query row ``i``, key column ``j``);
- ``max(0, e)`` (:attr:`SymbolKind.MAX`): the opaque maximum of :func:`max_of`;
- ``m[r, c]`` (:attr:`SymbolKind.ENTRY`): the entry of a 2-D integer graph input ``m`` at
  row ``r``, column ``c`` (affine forms, substituted into like any other);
- ``cumsum(m)[r, c]`` (:attr:`SymbolKind.COUNT`): ``m[r, 0] + ... + m[r, c]``, a ``CumSum``
  of such an input along its columns (mobius's token positions counted from
  ``attention_mask``); ``0`` at ``c = -1``.

Dimensions in the fusions' rules: ``B`` batch, ``N`` query heads (``num_heads``), ``N_kv``
KV heads (``kv_num_heads``), ``S`` new tokens (the query length), ``P`` the past cache's
length, ``P + S`` the present cache's (the mask's key columns), ``H`` the head size, ``W``
a sliding window.
"""

from __future__ import annotations

__all__ = [
    "Additive",
    "Affine",
    "Conj",
    "Le",
    "Lookup",
    "MaskAt",
    "SymTensor",
    "Symbol",
    "SymbolKind",
    "SymbolicEvaluator",
    "Unprovable",
    "constant_array",
    "nonnegative",
]

import contextlib
import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes.fusion._symbolic_values import (
    _FLOAT_TYPES,
    _MAX_CONST_ELEMENTS,
    FALSE,
    MASKED_BELOW,
    ONE,
    TRUE,
    ZERO,
    Additive,
    Affine,
    Conj,
    Elem,
    FloatConst,
    Le,
    Lookup,
    MaskAt,
    Symbol,
    SymbolKind,
    SymTensor,
    Unprovable,
    _kind,
    _shift,
    aligned_elem,
    axis,
    broadcast_shapes,
    constant_array,
    max_of,
    min_of,
    nonnegative,
    parse_dim,
)
from onnx_kvcache.passes.fusion._symbolic_values import (
    _INT_TYPES as _INT_TYPES,  # the rules of _symbolic_ops read it from here
)

Handler = Callable[["SymbolicEvaluator", ir.Node], SymTensor]
_HANDLERS: dict[str, Handler] = {}
OutputHandler = Callable[["SymbolicEvaluator", ir.Node, int], SymTensor]
_OUTPUT_HANDLERS: dict[tuple[str, str], OutputHandler] = {}
"""(domain, op_type) -> handler of one output of a node (multi-output and contrib ops)."""


def _handles(*op_types: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for op_type in op_types:
            _HANDLERS[op_type] = fn
        return fn

    return register


class SymbolicEvaluator:
    """Evaluates values of one graph (or function) symbolically; results are cached."""

    def __init__(self, ties: Mapping[Symbol, Affine] | None = None) -> None:
        self._cache: dict[ir.Value, SymTensor | Unprovable] = {}
        self._declared: dict[ir.Value, tuple[Affine, ...]] = {}
        self._dtypes: dict[ir.Value, ir.DataType | None] = {}
        self._fresh = 0
        self.ties: Mapping[Symbol, Affine] = dict(ties or {})
        """Dimension symbols replaced in every declared shape: equations that hold whenever
        the graph runs (the caller proves them)."""

    def prime(self, graph: ir.Graph) -> None:
        """Evaluate every value of ``graph`` in order, so that later queries recurse shallowly.

        Graphs without shape annotations (TorchScript exports) are followed from their
        inputs through every layer; without this, a deep model would exceed Python's
        recursion limit. What cannot be followed is remembered, not retried.
        """
        for node in graph:
            for output in node.outputs:
                self.dtype(output)
                with contextlib.suppress(Unprovable):
                    self.eval(output)

    def dtype(self, value: ir.Value | None) -> ir.DataType | None:
        """The element type of ``value``: declared, else inferred from its producer."""
        if value is None:
            return None
        if value.dtype is not None:
            return value.dtype
        if value not in self._dtypes:
            self._dtypes[value] = infer_dtype(self, value)
        return self._dtypes[value]

    def fresh(self) -> Symbol:
        self._fresh += 1
        return Symbol.fresh(self._fresh)

    def declared_shape(self, value: ir.Value) -> tuple[Affine, ...]:
        """The shape a value is annotated with; an unnamed dimension is one fresh symbol."""
        if value not in self._declared:
            if value.shape is None:
                raise Unprovable(f"value {value.name!r} has no known rank")
            dims = (d.value if isinstance(d, ir.SymbolicDim) else d for d in value.shape)
            self._declared[value] = tuple(parse_dim(d, self.fresh).subs(self.ties) for d in dims)
        return self._declared[value]

    def shape(self, value: ir.Value | None) -> tuple[Affine, ...]:
        """The symbolic shape of any value: computed where followed, else declared."""
        try:
            return self.eval(value).shape
        except Unprovable:
            if value is None:
                raise
            return self.declared_shape(value)

    def eval(self, value: ir.Value | None) -> SymTensor:
        if value is None:
            raise Unprovable("a required input is missing")
        cached = self._cache.get(value)
        if cached is None:
            try:
                cached = self._eval(value)
            except Unprovable as reason:
                cached = reason
            except (IndexError, KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
                producer = value.producer()  # a malformed node (missing inputs, bad attributes)
                what = (
                    f"{producer.op_type} node {producer.name!r}" if producer is not None else repr(value.name)
                )
                cached = Unprovable(f"{what} is not followed ({type(e).__name__}: {e})")
            self._cache[value] = cached
        if isinstance(cached, Unprovable):
            raise Unprovable(*cached.args)
        return cached

    def _eval(self, value: ir.Value) -> SymTensor:
        array = constant_array(value)
        if array is not None:
            return _from_constant(array, value.dtype or ir.DataType.from_numpy(array.dtype))
        producer = value.producer()
        if producer is not None:
            output_handler = _OUTPUT_HANDLERS.get((producer.domain or "", producer.op_type))
            if output_handler is not None:
                return output_handler(self, producer, value.index() or 0)
        if producer is None:
            tensor = value.const_value
            kind = _kind(value.dtype if value.dtype is not None or tensor is None else tensor.dtype)
            if kind == "float":
                return SymTensor(self.declared_shape(value), "data")
            if not value.is_graph_input():
                raise Unprovable(f"constant {value.name!r} is too large to follow")
            shape = self.declared_shape(value)
            elem = None
            if kind == "int" and len(shape) == 2 and value.name:  # its entries, looked up
                elem = Affine.of(Symbol.entry(value.name, Affine.of(axis(0)), Affine.of(axis(1))))
            return SymTensor(shape, kind, elem, source=value.name)
        handler = _HANDLERS.get(producer.op_type) if producer.domain in ("", "ai.onnx") else None
        if handler is None:
            if value.dtype in _FLOAT_TYPES:
                return SymTensor(self.declared_shape(value), "data")
            raise Unprovable(f"{producer.op_type} node {producer.name!r} is not followed")
        try:
            return handler(self, producer)
        except (IndexError, KeyError, ValueError, TypeError, ZeroDivisionError, OverflowError) as error:
            # a node that breaks its operator's rules (an axis out of range, ranks that do not
            # match, an attribute of the wrong kind or value): nothing to prove about it
            raise Unprovable(f"{producer.op_type} node {producer.name!r} is malformed ({error})") from None

    def values(self, value: ir.Value | None, what: str) -> tuple[Affine, ...]:
        tensor = self.eval(value)
        if tensor.values is None:
            raise Unprovable(f"{what} is not a known integer vector")
        return tensor.values

    def scalar(self, value: ir.Value | None, what: str) -> Affine:
        values = self.values(value, what)
        if len(values) != 1:
            raise Unprovable(f"{what} is not a scalar")
        return values[0]

    def const_ints(self, value: ir.Value | None, what: str) -> list[int] | None:
        if value is None:
            return None
        values = self.values(value, what)
        if not all(v.is_const for v in values):
            raise Unprovable(f"{what} is not constant")
        return [v.const for v in values]


_MAX_FIT_ELEMENTS = 65536


def _affine_fit(array: np.ndarray) -> Affine | None:
    """``c0 + sum(c_k * @k)`` when an integer constant is exactly that over its indices (a
    constant-folded ``Range`` or index grid), else None."""
    if not array.size or array.size > _MAX_FIT_ELEMENTS:
        return None
    if array.ndim <= 1:  # most constants (axes, indices, shapes): the same fit without the grid
        c0 = int(array.reshape(-1)[0])
        delta = int(array[1]) - c0 if array.size > 1 else 0
        if array.ndim and not np.array_equal(c0 + delta * np.arange(array.size, dtype=np.int64), array):
            return None
        return Affine._make({axis(0): delta}, c0)
    origin = (0,) * array.ndim
    c0 = int(array[origin])
    coefficients = []
    for k, size in enumerate(array.shape):
        step = (*origin[:k], 1, *origin[k + 1 :])
        coefficients.append(int(array[step]) - c0 if size > 1 else 0)
    grid = np.indices(array.shape, dtype=np.int64) if array.ndim else np.zeros((0,), np.int64)
    fitted = c0 + sum((c * g for c, g in zip(coefficients, grid)), np.zeros(array.shape, np.int64))
    if not np.array_equal(fitted, array):
        return None
    return Affine._make({axis(k): c for k, c in enumerate(coefficients)}, c0)


def _from_constant(array: np.ndarray, dtype: ir.DataType | None) -> SymTensor:
    shape = tuple(Affine(const=int(d)) for d in array.shape)
    kind = _kind(dtype)
    if kind == "int":
        values = None
        if array.ndim <= 1 and array.size <= _MAX_CONST_ELEMENTS:
            values = tuple(Affine(const=int(x)) for x in array.reshape(-1))
        elem = _affine_fit(array)
        stack = None
        if elem is None and array.ndim > 1 and array.size <= _MAX_FIT_ELEMENTS:
            fits = [_affine_fit(array[..., k : k + 1]) for k in range(array.shape[-1])]
            parts = [f for f in fits if f is not None]
            if len(parts) == len(fits):
                stack = tuple(p.subs({axis(array.ndim - 1): ZERO}) for p in parts)
        return SymTensor(shape, "int", elem, values, stack)
    if array.size and np.all(array == array.flat[0]):
        if kind == "bool":
            return SymTensor(shape, "bool", TRUE if bool(array.flat[0]) else FALSE)
        return SymTensor(shape, "float", FloatConst(float(array.flat[0])))
    if kind == "float":  # a table (rotary frequencies): its shape is followed, not its values
        return SymTensor(shape, "data")
    raise Unprovable("a non-uniform bool constant is not followed")


def _attr_int(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.as_int())


def _attr_ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else [int(x) for x in attr.as_ints()]


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


def _axes(ev: SymbolicEvaluator, node: ir.Node, index: int = 1) -> list[int] | None:
    return _attr_ints(node, "axes") or ev.const_ints(_input(node, index), f"axes of {node.name}")


@_handles("Identity")
def _identity(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    return ev.eval(node.inputs[0])


@_handles("Shape")
def _shape(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    dims = ev.shape(node.inputs[0])
    rank = len(dims)
    start = _attr_int(node, "start", 0)
    end = _attr_int(node, "end", rank)
    start, end = (max(0, min(rank, x + rank if x < 0 else x)) for x in (start, end))
    picked = dims[start:end]
    return SymTensor((Affine(const=len(picked)),), "int", values=picked)


@_handles("Squeeze", "Unsqueeze")
def _squeeze(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    x = ev.eval(node.inputs[0])
    axes = _axes(ev, node)
    unsqueeze = node.op_type == "Unsqueeze"
    if unsqueeze:
        if axes is None:
            raise Unprovable("Unsqueeze without axes")
        rank = x.rank + len(axes)
        axes = sorted(a + rank if a < 0 else a for a in axes)
        shape: list[Affine] = []
        mapping: dict[Symbol, Affine] = {}
        old = 0
        for k in range(rank):
            if k in axes:
                shape.append(ONE)
            else:
                shape.append(x.shape[old])
                mapping[axis(old)] = Affine.of(axis(k))
                old += 1
    else:
        axes = sorted(
            a + x.rank if a < 0 else a for a in (axes or [k for k, d in enumerate(x.shape) if d == ONE])
        )
        if any(x.shape[a] != ONE for a in axes):
            raise Unprovable("Squeeze of a dimension not proven to be 1")
        shape, mapping, new = [], {}, 0
        for k, dim in enumerate(x.shape):
            if k in axes:
                mapping[axis(k)] = ZERO
            else:
                shape.append(dim)
                mapping[axis(k)] = Affine.of(axis(new))
                new += 1
    elem = None if x.elem is None else _shift(x.elem, mapping)
    values = x.values if x.values is not None and len(x.values) == 1 and len(shape) <= 1 else None
    return SymTensor(tuple(shape), x.kind, elem, values)


def _binary_values(
    a: SymTensor, b: SymTensor, fn: Callable[[Affine, Affine], Affine]
) -> tuple[Affine, ...] | None:
    if a.values is None or b.values is None or a.rank > 1 or b.rank > 1:
        return None
    if len(a.values) == len(b.values):
        return tuple(fn(x, y) for x, y in zip(a.values, b.values))
    if len(a.values) == 1:
        return tuple(fn(a.values[0], y) for y in b.values)
    if len(b.values) == 1:
        return tuple(fn(x, b.values[0]) for x in a.values)
    return None


def _mul(x: Affine, y: Affine) -> Affine:
    if x.is_const:
        return y.scale(x.const)
    if y.is_const:
        return x.scale(y.const)
    raise Unprovable(f"the product {x} * {y} is not affine")


@_handles("Add", "Sub", "Mul")
def _arith(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    a, b = ev.eval(node.inputs[0]), ev.eval(node.inputs[1])
    shape = broadcast_shapes(a.shape, b.shape)
    if "data" in (a.kind, b.kind) and {a.kind, b.kind} <= {"data", "float"}:
        return SymTensor(shape, "data")  # float data (Q, K, V): its shape only
    if a.kind == "float" and b.kind == "float" and node.op_type == "Add":
        ea, eb = aligned_elem(a, shape), aligned_elem(b, shape)
        if isinstance(ea, FloatConst) and ea.value == 0.0:
            return SymTensor(shape, "float", eb)
        if isinstance(eb, FloatConst) and eb.value == 0.0:
            return SymTensor(shape, "float", ea)
        if isinstance(ea, Additive) and isinstance(eb, Additive):
            return SymTensor(shape, "float", Additive(ea.cond & eb.cond))
        raise Unprovable("a float Add that is not a sum of masks")
    if a.kind != "int" or b.kind != "int":
        raise Unprovable(f"{node.op_type} of {a.kind} and {b.kind} tensors is not followed")
    fn: Callable[[Affine, Affine], Affine] = {
        "Add": lambda x, y: x + y,
        "Sub": lambda x, y: x - y,
        "Mul": _mul,
    }[node.op_type]
    values = _binary_values(a, b, fn)
    elem = None
    try:
        ea, eb = aligned_elem(a, shape), aligned_elem(b, shape)
        if isinstance(ea, Affine) and isinstance(eb, Affine):
            elem = fn(ea, eb)
    except Unprovable:
        elem = None
    return SymTensor(shape, "int", elem, values)


@_handles("Neg", "Cos", "Sin", "Tanh", "Sigmoid", "Sqrt", "Reciprocal", "Exp", "Softmax")
def _elementwise_data(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    """A float op of one data tensor that keeps its shape."""
    x = ev.eval(node.inputs[0])
    if x.kind != "data":
        raise Unprovable(f"{node.op_type} of a {x.kind} tensor is not followed")
    return SymTensor(x.shape, "data")


@_handles("Range")
def _range(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    start = ev.scalar(node.inputs[0], "Range start")
    limit = ev.scalar(node.inputs[1], "Range limit")
    delta = ev.scalar(node.inputs[2], "Range delta")
    if delta != ONE:
        raise Unprovable(f"Range with step {delta}")
    return SymTensor((limit - start,), "int", start + Affine.of(axis(0)))


_COMPARE: dict[str, Callable[[Affine, Affine], Conj]] = {
    "LessOrEqual": lambda x, y: Conj.of(Le(x - y)),
    "Less": lambda x, y: Conj.of(Le(x - y + 1)),
    "GreaterOrEqual": lambda x, y: Conj.of(Le(y - x)),
    "Greater": lambda x, y: Conj.of(Le(y - x + 1)),
    "Equal": lambda x, y: Conj.of(Le(x - y), Le(y - x)),
}


@_handles(*_COMPARE)
def _compare(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    a, b = ev.eval(node.inputs[0]), ev.eval(node.inputs[1])
    shape = broadcast_shapes(a.shape, b.shape)
    if a.kind != "int" or b.kind != "int":
        raise Unprovable(f"{node.op_type} of {a.kind} tensors is not followed")
    ea, eb = aligned_elem(a, shape), aligned_elem(b, shape)
    assert isinstance(ea, Affine) and isinstance(eb, Affine)
    return SymTensor(shape, "bool", _COMPARE[node.op_type](ea, eb))


@_handles("And", "Or")
def _logic(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    a, b = ev.eval(node.inputs[0]), ev.eval(node.inputs[1])
    shape = broadcast_shapes(a.shape, b.shape)
    ea, eb = aligned_elem(a, shape), aligned_elem(b, shape)
    if not isinstance(ea, Conj) or not isinstance(eb, Conj):
        raise Unprovable(f"{node.op_type} of non-boolean tensors")
    if node.op_type == "And":
        return SymTensor(shape, "bool", ea & eb)
    for x, y in ((ea, eb), (eb, ea)):
        if x == TRUE:
            return SymTensor(shape, "bool", TRUE)
        if x.is_false:
            return SymTensor(shape, "bool", y)
    raise Unprovable("a disjunction of conditions is not followed")


@_handles("Not")
def _not(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    x = ev.eval(node.inputs[0])
    elem = x.element()
    if not isinstance(elem, Conj):
        raise Unprovable("Not of a non-boolean tensor")
    return SymTensor(x.shape, "bool", elem.negate())


@_handles("Cast")
def _cast(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    x = ev.eval(node.inputs[0])
    to = ir.DataType(_attr_int(node, "to", 0))
    kind = _kind(to)
    if kind == x.kind or (kind == "float" and x.kind == "data"):
        if _widens(node.inputs[0], to):
            return x
        elem = None if isinstance(x.elem, Affine) and x.elem.lookups else x.elem  # values may change
        return dataclasses.replace(x, elem=elem, source=None)
    if kind == "float" and x.kind == "int" and x.elem is None and x.values is None and x.source is None:
        return SymTensor(x.shape, "data")  # integer data as floats (positions for rotary): shape only
    if kind == "bool" and x.kind == "int" and x.source is not None and x.rank == 2:
        return SymTensor(x.shape, "bool", Conj.of(MaskAt(x.source, Affine.of(axis(0)), Affine.of(axis(1)))))
    entry = _entry(x.elem) if x.kind == "int" else None
    if kind == "bool" and entry is not None and entry.kind is SymbolKind.ENTRY and entry.at is not None:
        # one entry of a 2-D input, moved by Unsqueeze/Expand/Transpose: its lookup != 0
        return SymTensor(x.shape, "bool", Conj.of(MaskAt(entry.at.source, entry.at.row, entry.at.col)))
    if kind == "bool" and x.kind == "float" and isinstance(x.elem, FloatConst):
        # one float everywhere (transformers 4.57's ``new_ones``, Expand(1.0) then Cast): it is
        # True exactly where it is not 0 (NaN included)
        return SymTensor(x.shape, "bool", FALSE if x.elem.value == 0.0 else TRUE)
    raise Unprovable(f"Cast from {x.kind} to {kind} is not followed")


def _entry(elem: Elem | None) -> Symbol | None:
    """The lookup symbol ``elem`` is exactly (coefficient 1, no constant), or None."""
    if not isinstance(elem, Affine) or elem.const or len(elem.terms) != 1:
        return None
    ((symbol, coefficient),) = elem.terms
    return symbol if coefficient == 1 and symbol.at is not None else None


def _widens(value: ir.Value | None, to: ir.DataType) -> bool:
    """An integer Cast that keeps every value (so a 0/1 mask stays one)."""
    dtype = value.dtype if value is not None else None
    return dtype is not None and to.itemsize >= dtype.itemsize and to.is_signed() == dtype.is_signed()


@_handles("Where")
def _where(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    c, x, y = (ev.eval(v) for v in node.inputs)
    shape = broadcast_shapes(c.shape, x.shape, y.shape)
    ec, ex, ey = (aligned_elem(t, shape) for t in (c, x, y))
    if not isinstance(ec, Conj) or not isinstance(ex, FloatConst) or not isinstance(ey, FloatConst):
        raise Unprovable("Where that does not select between two mask constants")
    if ex.value == 0.0 and ey.value <= MASKED_BELOW:
        return SymTensor(shape, "float", Additive(ec))
    if ey.value == 0.0 and ex.value <= MASKED_BELOW:
        return SymTensor(shape, "float", Additive(ec.negate()))
    raise Unprovable(f"Where selects {ex.value} and {ey.value}, not 0 and a masking value")


@_handles("Expand")
def _expand(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    x = ev.eval(node.inputs[0])
    target = ev.values(node.inputs[1], "Expand shape")
    shape = broadcast_shapes(x.shape, target)
    elem = None if x.elem is None and x.values is None else aligned_elem(x, shape)
    if x.kind == "data":
        elem = None
    return SymTensor(shape, x.kind, elem)


@_handles("Max", "Min")
def _extremum(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    parts = [ev.eval(v) for v in node.inputs]
    if not parts:
        raise Unprovable(f"{node.op_type} without inputs")
    shape = broadcast_shapes(*(p.shape for p in parts))
    fn = max_of if node.op_type == "Max" else min_of
    values = None
    if len(parts) == 2 and all(p.kind == "int" for p in parts):
        try:
            values = _binary_values(parts[0], parts[1], fn)
        except Unprovable:
            values = None
    return SymTensor(shape, parts[0].kind, values=values)


@_handles("Concat")
def _concat(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    parts = [ev.eval(v) for v in node.inputs]
    rank = parts[0].rank
    along = _attr_int(node, "axis", 0)
    along = along + rank if along < 0 else along
    shape = list(parts[0].shape)
    shape[along] = sum((p.shape[along] for p in parts[1:]), parts[0].shape[along])
    if all(p.values is not None for p in parts) and rank == 1:
        values = tuple(v for p in parts for v in p.values or ())
        return SymTensor(tuple(shape), "int", values=values)
    if (
        along == rank - 1
        and rank > 1
        and all(p.kind == "int" and p.shape[-1] == ONE for p in parts)
        and all(p.elem is not None or p.values is not None for p in parts)
    ):
        stack = []
        for p in parts:
            elem = p.element()
            assert isinstance(elem, Affine)
            stack.append(elem.subs({axis(rank - 1): ZERO}))
        return SymTensor(tuple(shape), "int", stack=tuple(stack))
    return SymTensor(tuple(shape), parts[0].kind)


@_handles("GatherND")
def _gather_nd(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    data, indices = ev.eval(node.inputs[0]), ev.eval(node.inputs[1])
    if _attr_int(node, "batch_dims", 0) != 0:
        raise Unprovable("GatherND with batch_dims")
    if indices.stack is None or len(indices.stack) != data.rank:
        raise Unprovable("GatherND indices are not a stack of one index per data axis")
    elem = data.element()
    mapping = {axis(k): e for k, e in enumerate(indices.stack)}
    return SymTensor(indices.shape[:-1], data.kind, _shift(elem, mapping))


@_handles("Gather")
def _gather(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    data = ev.eval(node.inputs[0])
    index = ev.const_ints(node.inputs[1], "Gather indices")
    if data.values is None or data.rank != 1 or index is None or _attr_int(node, "axis", 0) != 0:
        raise Unprovable("Gather other than of a known vector by constant indices")
    picked = tuple(data.values[i] for i in index)
    indices_rank = ev.eval(node.inputs[1]).rank
    return SymTensor((Affine(const=len(picked)),) if indices_rank else (), "int", values=picked)


@_handles("Transpose")
def _transpose(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    x = ev.eval(node.inputs[0])
    perm = _attr_ints(node, "perm") or list(reversed(range(x.rank)))
    shape = tuple(x.shape[p] for p in perm)
    elem = None
    if x.elem is not None:
        elem = _shift(x.elem, {axis(p): Affine.of(axis(k)) for k, p in enumerate(perm)})
    return SymTensor(shape, x.kind, elem)


def reshape_dims(
    in_shape: Sequence[Affine], target: Sequence[Affine], *, allowzero: bool
) -> tuple[Affine, ...]:
    """The output shape of Reshape(``in_shape`` -> ``target``), ``0``/``-1`` resolved."""
    out: list[Affine | None] = []
    for k, dim in enumerate(target):
        if dim == ZERO and not allowzero:
            if k >= len(in_shape):
                raise Unprovable("Reshape copies a dimension the input does not have")
            out.append(in_shape[k])
        elif dim == Affine(const=-1):
            out.append(None)
        else:
            out.append(dim)
    unknown = [k for k, d in enumerate(out) if d is None]
    if len(unknown) > 1:
        raise Unprovable("Reshape with more than one -1")
    if unknown:
        have = Counter(d for d in in_shape if not d.is_const)
        want = Counter(d for d in out if d is not None and not d.is_const)
        if want - have:
            raise Unprovable("Reshape target dimensions do not divide the input's")
        rest = list((have - want).elements())
        numerator = math.prod(d.const for d in in_shape if d.is_const)
        denominator = math.prod(d.const for d in out if d is not None and d.is_const)
        if len(rest) > 1 or denominator == 0 or numerator % denominator:
            raise Unprovable("cannot infer the -1 of a Reshape")
        ratio = numerator // denominator
        out[unknown[0]] = rest[0].scale(ratio) if rest else Affine(const=ratio)
    return tuple(d for d in out if d is not None)


@_handles("Reshape")
def _reshape(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    x = ev.eval(node.inputs[0])
    target = ev.values(node.inputs[1], "Reshape shape")
    shape = reshape_dims(x.shape, target, allowzero=bool(_attr_int(node, "allowzero", 0)))
    if x.values is not None and len(x.values) == 1 and len(shape) <= 1:
        return SymTensor(shape, x.kind, values=x.values)
    return SymTensor(shape, x.kind)


_LARGE = 2**31
"""A Slice bound at or beyond this reaches the end of any real axis."""


def _sliced_length(n: Affine, start: Affine, end: Affine) -> Affine:
    """Length of ``x[start:end]`` (step 1) along an axis of length ``n``, as ONNX clamps."""

    def clamp(bound: Affine) -> Affine:  # into [0, n]
        if bound == ZERO:
            return ZERO
        if bound.is_const and bound.const >= _LARGE:
            return n
        if bound.is_const and bound.const <= -_LARGE:
            return ZERO
        if bound.is_const and bound.const < 0:  # n + bound, clamped at 0
            return max_of(n + bound, ZERO)
        if bound.is_const:
            return min_of(bound, n) if not n.is_const else Affine(const=min(bound.const, n.const))
        if nonnegative(bound) and nonnegative(n - bound):  # within [0, n]: as it is
            return bound
        return bound if bound == n else min_of(bound, n)

    lo, hi = clamp(start), clamp(end)
    if hi == n or lo == ZERO:  # both clamped into [0, n]: no negative length to cut
        return hi - lo
    return max_of(hi - lo, ZERO)


def _slice_tensor(ev: SymbolicEvaluator, node: ir.Node, x: SymTensor) -> SymTensor:
    """A Slice of a tensor along some axes (step 1): its shape; a mask's elements when the
    slice keeps every element (a start of 0, an end at or beyond the axis)."""
    starts = ev.values(node.inputs[1], "Slice starts")
    ends = ev.values(node.inputs[2], "Slice ends")
    axes = ev.const_ints(_input(node, 3), "Slice axes") or list(range(len(starts)))
    steps = ev.const_ints(_input(node, 4), "Slice steps") or [1] * len(starts)
    if not (len(starts) == len(ends) == len(axes) == len(steps)) or any(step != 1 for step in steps):
        raise Unprovable("a Slice with steps other than 1 is not followed")
    shape = list(x.shape)
    shifts: dict[Symbol, Affine] | None = {}
    for axis_, start, end in zip(axes, starts, ends):
        k = axis_ + x.rank if axis_ < 0 else axis_
        if not 0 <= k < x.rank:
            raise Unprovable("a Slice axis is out of range")
        length = _sliced_length(shape[k], start, end)
        if shifts is not None and start != ZERO:
            # a start proven within the axis is where the slice begins: element @k is x's @k + start
            inside = start.is_const and start.const > 0 and nonnegative(shape[k] - start)
            if inside or (nonnegative(start) and nonnegative(shape[k] - start)):
                shifts[axis(k)] = Affine.of(axis(k)) + start
            else:
                shifts = None
        shape[k] = length
    elem = None if x.elem is None or shifts is None else x.elem.subs(shifts)
    return SymTensor(tuple(shape), x.kind, elem)


@_handles("Slice")
def _slice(ev: SymbolicEvaluator, node: ir.Node) -> SymTensor:
    x = ev.eval(node.inputs[0])
    if x.values is None or x.rank != 1:
        return _slice_tensor(ev, node, x)
    starts = ev.const_ints(node.inputs[1], "Slice starts")
    ends = ev.const_ints(node.inputs[2], "Slice ends")
    axes = ev.const_ints(_input(node, 3), "Slice axes") or [0]
    steps = ev.const_ints(_input(node, 4), "Slice steps") or [1]
    if starts is None or ends is None or axes != [0] or steps != [1]:
        raise Unprovable("Slice other than of a known vector with constant bounds")
    n = len(x.values)
    start, end = (max(0, min(n, v + n if v < 0 else v)) for v in (starts[0], ends[0]))
    picked = x.values[start:end]
    return SymTensor((Affine(const=len(picked)),), "int", values=picked)


_BOOL_OPS = frozenset(
    {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Not", "IsNaN", "IsInf"}
)
_INT64_OPS = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})
_FIXED: dict[tuple[str, int], ir.DataType] = {
    ("MatMulInteger", 0): ir.DataType.INT32,
    ("DynamicQuantizeLinear", 0): ir.DataType.UINT8,
    ("DynamicQuantizeLinear", 1): ir.DataType.FLOAT,
    ("DynamicQuantizeLinear", 2): ir.DataType.UINT8,
    ("TopK", 1): ir.DataType.INT64,
    ("Dropout", 1): ir.DataType.BOOL,
}
_FROM_INPUT = {"Where": 1, "DequantizeLinear": 1, "CastLike": 1}


def infer_dtype(ev: SymbolicEvaluator, value: ir.Value) -> ir.DataType | None:
    """The element type of an unannotated ``value`` from its producer (None: unknown)."""
    node = value.producer()
    if node is None:
        tensor = value.const_value
        return tensor.dtype if tensor is not None else None
    op, index = node.op_type, value.index() or 0
    if (op, index) in _FIXED:
        return _FIXED[(op, index)]
    if op == "Cast":
        try:
            return ir.DataType(_attr_int(node, "to", 0))
        except ValueError:  # not an element type: the node is malformed
            return None
    if op in _BOOL_OPS:
        return ir.DataType.BOOL
    if op in _INT64_OPS:
        return ir.DataType.INT64
    if op in ("Constant", "ConstantOfShape"):
        for name, attr in node.attributes.items():
            if attr.type == ir.AttributeType.TENSOR:
                return attr.value.dtype
            if name.startswith("value_"):
                return ir.DataType.FLOAT if "float" in name else ir.DataType.INT64
        return ir.DataType.FLOAT if op == "ConstantOfShape" else None
    if op == "QuantizeLinear":
        zero_point = _input(node, 2)
        return ev.dtype(zero_point) if zero_point is not None else ir.DataType.UINT8
    first = _input(node, _FROM_INPUT.get(op, 0))
    return ev.dtype(first)
