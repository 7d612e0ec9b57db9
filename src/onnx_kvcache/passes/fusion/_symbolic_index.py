"""The evaluator's rules for index, mask and shape-vector values: what each operator computes.

Each rule takes the :class:`~onnx_kvcache.passes.fusion._symbolic.SymbolicEvaluator` and a node
and returns the node's output as a :class:`SymTensor` (its shape and what is known of its
elements), or None when the rule does not apply; :class:`Unprovable` says why a rule that
applies cannot follow the values. The table of which rule serves which operator is
:data:`~onnx_kvcache.passes.fusion._symbolic_rules.RULES`; the rules for float data's shapes
and for graphs without value_info are :mod:`~onnx_kvcache.passes.fusion._symbolic_ops`.

Every rule is exact for every input (tests/passes/fusion/test_symbolic_rules.py checks each
against onnxruntime on random inputs, benchmarks/symbolic_fuzz.py on random graphs of them).
An index a rule reads is proven non-negative (an onnxruntime run refuses one out of range, but
a negative one counts from the end).
"""

from __future__ import annotations

__all__ = ["reshape_dims"]

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes.fusion import _opsets as opsets
from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode
from onnx_kvcache.passes.fusion._symbolic_values import (
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
    MaskAt,
    Symbol,
    SymbolKind,
    SymTensor,
    Unprovable,
    _equal,
    _kind,
    _shift,
    aligned_elem,
    axis,
    broadcast_shapes,
    max_of,
    min_of,
    nonnegative,
)

if TYPE_CHECKING:
    from onnx_kvcache.passes.fusion._symbolic_values import Evaluator

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
    """A constant's SymTensor: an integer one's values and, when affine in its indices, element
    (:class:`~onnx_kvcache.passes.fusion._symbolic.SymbolicEvaluator` keeps those of one graph)."""
    return _read_constant(array, dtype)


def _small_vector(array: np.ndarray) -> SymTensor:
    """A 0-D or 1-D integer constant of at most 64 elements, read without numpy's grid."""
    items = [int(x) for x in array.reshape(-1).tolist()]
    values = tuple(Affine(const=x) for x in items)
    shape = tuple(Affine(const=int(d)) for d in array.shape)
    if array.ndim == 0:
        return SymTensor(shape, "int", values[0], values)
    delta = items[1] - items[0] if len(items) > 1 else 0
    affine = all(x == items[0] + delta * k for k, x in enumerate(items)) and bool(items)
    elem = Affine._make({axis(0): delta}, items[0]) if affine else None
    return SymTensor(shape, "int", elem, values)


def _read_constant(array: np.ndarray, dtype: ir.DataType | None) -> SymTensor:
    if array.ndim <= 1 and array.size <= _MAX_CONST_ELEMENTS and _kind(dtype) == "int":
        return _small_vector(array)
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
    return SymTensor(shape, kind, _triangle(array) if kind == "bool" else None)


def _triangle(array: np.ndarray) -> Conj | None:
    """A 2-D bool constant that is ``col - row <= k`` or ``col - row >= k`` (a causal mask
    folded for static shapes) as that condition; None for any other."""
    if array.ndim != 2 or not array.size or array.size > _MAX_FIT_ELEMENTS:
        return None
    rows, cols = np.indices(array.shape)
    offsets = cols - rows
    for k in range(-array.shape[0], array.shape[1] + 1):
        if np.array_equal(array, offsets <= k):
            return Conj.of(Le(Affine.of(axis(1)) - Affine.of(axis(0)) - k))
        if np.array_equal(array, offsets >= k):
            return Conj.of(Le(Affine.of(axis(0)) - Affine.of(axis(1)) + k))
    return None


def _attr_int(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.as_int())


def _attr_ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else [int(x) for x in attr.as_ints()]


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


def _axes(ev: Evaluator, node: ir.Node) -> list[int] | None:
    """The axes of a Squeeze or Unsqueeze in the form its opset defines (None: not given)."""
    return opsets.moved(ev, node)


def _identity(ev: Evaluator, node: ir.Node) -> SymTensor:
    return ev.eval(node.inputs[0])


def _shape(ev: Evaluator, node: ir.Node) -> SymTensor:
    dims = ev.shape(node.inputs[0])
    rank = len(dims)
    start = opsets.attribute(node, "start", 0)
    end = opsets.attribute(node, "end", rank)
    start, end = (max(0, min(rank, x + rank if x < 0 else x)) for x in (start, end))
    picked = dims[start:end]
    return SymTensor((Affine(const=len(picked)),), "int", values=picked)


def _squeeze(ev: Evaluator, node: ir.Node) -> SymTensor:
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
        if not axes and not all(d.is_const for d in x.shape):
            shown = ", ".join(map(str, x.shape))
            raise Unprovable(
                f"Squeeze node {node.name!r} without axes of a [{shown}] tensor: the axes it removes "
                "are those of length 1 when it runs"
            )
        axes = sorted(
            a + x.rank if a < 0 else a for a in (axes or [k for k, d in enumerate(x.shape) if d == ONE])
        )
        if any(not 0 <= a < x.rank for a in axes):
            raise Unprovable(
                f"Squeeze node {node.name!r} removes axes {axes} of a {x.rank}-D tensor",
                kind=FusionRefusalCode.MALFORMED,
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


def _arith(ev: Evaluator, node: ir.Node) -> SymTensor:
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


def _neg(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """``-x`` of an integer tensor: its element and values negated."""
    x = ev.eval(node.inputs[0])
    if x.kind != "int":
        return None
    elem = -x.elem if isinstance(x.elem, Affine) else None
    values = tuple(-v for v in x.values) if x.values is not None else None
    return SymTensor(x.shape, "int", elem, values)


def _range(ev: Evaluator, node: ir.Node) -> SymTensor:
    """``start + delta * @0`` over ``ceil((limit - start) / delta)`` elements (none when that is
    negative): a constant step; a symbolic span with a step of 1 or -1."""
    start = ev.scalar(node.inputs[0], "Range start")
    limit = ev.scalar(node.inputs[1], "Range limit")
    delta = ev.scalar(node.inputs[2], "Range delta")
    if not delta.is_const or delta.const == 0:
        raise Unprovable(f"Range with step {delta}")
    step, span = delta.const, limit - start
    if span.is_const:
        length = Affine(const=max(0, -(-span.const // step)))
    elif abs(step) == 1:
        span = span.scale(step)  # the count of elements, when not negative
        length = span if at_least_zero(span) else max_of(span, ZERO)
    else:
        raise Unprovable(f"Range over {span} by {step}: its length is not affine")
    values = None
    if length.is_const and length.const <= _MAX_CONST_ELEMENTS:
        values = tuple(start + k * step for k in range(length.const))
    return SymTensor((length,), "int", start + Affine.of(axis(0)).scale(step), values)


def at_least_zero(form: Affine) -> bool:
    """``form >= 0`` for every value of its symbols, each ``-max(0, e)`` bounded by ``-e'`` where
    ``e'`` is ``e`` without its negative parts and itself never negative (``max(0, e) <= e'``):
    ``seq + past - max(0, past - 5) >= seq``."""
    bounded = Affine(const=form.const)
    for symbol, c in form.terms:
        if c < 0 and symbol.kind is SymbolKind.MAX and symbol.form is not None:
            upper = Affine._make({s: k for s, k in symbol.form.terms if k > 0}, max(0, symbol.form.const))
            if not nonnegative(upper):
                return False
            bounded = bounded + upper.scale(c)
        else:
            bounded = bounded + Affine(((symbol, c),))
    return nonnegative(bounded)


_COMPARE: dict[str, Callable[[Affine, Affine], Conj]] = {
    "LessOrEqual": lambda x, y: Conj.of(Le(x - y)),
    "Less": lambda x, y: Conj.of(Le(x - y + 1)),
    "GreaterOrEqual": lambda x, y: Conj.of(Le(y - x)),
    "Greater": lambda x, y: Conj.of(Le(y - x + 1)),
    "Equal": lambda x, y: Conj.of(Le(x - y), Le(y - x)),
}


def _compare(ev: Evaluator, node: ir.Node) -> SymTensor:
    a, b = ev.eval(node.inputs[0]), ev.eval(node.inputs[1])
    shape = broadcast_shapes(a.shape, b.shape)
    if a.kind != "int" or b.kind != "int":
        raise Unprovable(f"{node.op_type} of {a.kind} tensors is not followed")
    ea, eb = aligned_elem(a, shape), aligned_elem(b, shape)
    assert isinstance(ea, Affine) and isinstance(eb, Affine)
    return SymTensor(shape, "bool", _COMPARE[node.op_type](ea, eb))


def _logic(ev: Evaluator, node: ir.Node) -> SymTensor:
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


def _not(ev: Evaluator, node: ir.Node) -> SymTensor:
    x = ev.eval(node.inputs[0])
    elem = x.element()
    if not isinstance(elem, Conj):
        raise Unprovable("Not of a non-boolean tensor")
    return SymTensor(x.shape, "bool", elem.negate())


def _cast(ev: Evaluator, node: ir.Node) -> SymTensor:
    x = ev.eval(node.inputs[0])
    to = ir.DataType(_attr_int(node, "to", 0))
    kind = _kind(to)
    if kind == x.kind or (kind == "float" and x.kind == "data"):
        if _widens(ev.dtype(node.inputs[0]), to):
            return x
        if kind == "int":  # a narrowing or sign-changing integer Cast wraps what the type does not hold
            return _narrowed(x, to)
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


def _widens(dtype: ir.DataType | None, to: ir.DataType) -> bool:
    """An integer Cast that keeps every value (so a 0/1 mask stays one): to a type as wide of the
    same signedness, or unsigned to a wider signed type."""
    if dtype is None:
        return False
    if to.is_signed() == dtype.is_signed():
        return to.itemsize >= dtype.itemsize
    return to.is_signed() and to.itemsize > dtype.itemsize


def _narrowed(x: SymTensor, to: ir.DataType) -> SymTensor:
    """An integer tensor cast to an integer type that may not hold its values (``to`` narrower, or
    of other signedness): the values wrap modulo the type's range, so only constants the type
    holds are kept; any other element is unknown (a form over lengths and indices is bounded by
    nothing the evaluator knows)."""
    info = np.iinfo(to.numpy())

    def holds(form: Affine) -> bool:
        return form.is_const and info.min <= form.const <= info.max

    values = x.values if x.values is not None and all(holds(v) for v in x.values) else None
    elem = x.elem if isinstance(x.elem, Affine) and holds(x.elem) else None
    return SymTensor(x.shape, "int", elem, values)


def kept(elem: Elem) -> Conj | None:
    """Where a float mask element keeps the score (0 there, a softmax-zeroing value elsewhere);
    None for an element that is no mask."""
    if isinstance(elem, Additive):
        return elem.cond
    if isinstance(elem, FloatConst):
        if elem.value == 0.0:
            return TRUE
        if elem.value <= MASKED_BELOW:
            return FALSE
    return None


_NONNEGATIVE = frozenset(
    {SymbolKind.AXIS, SymbolKind.INDEX, SymbolKind.DIM, SymbolKind.FRESH, SymbolKind.MAX, SymbolKind.PRODUCT}
)


def never_positive(form: Affine) -> bool:
    """``form <= 0`` for every value of its symbols (indices and lengths are never negative)."""
    return form.const <= 0 and all(c < 0 and s.kind in _NONNEGATIVE for s, c in form.terms)


def nonnegative_index(form: Affine) -> bool:
    """``form >= 0`` for every value of its symbols (an index that never counts from the end)."""
    return never_positive(-form)


def implies(a: Conj, b: Conj) -> bool:
    """``a => b`` for every value of the symbols (each atom of ``b`` follows from one of ``a``)."""
    if a.is_false or b == TRUE:
        return True
    for atom in b.atoms:
        if atom in a.atoms:
            continue
        if isinstance(atom, Le) and any(
            isinstance(x, Le) and never_positive(atom.lhs - x.lhs) for x in a.atoms
        ):  # x <= 0 and atom - x <= 0
            continue
        return False
    return True


def either(a: Conj, b: Conj) -> Conj | None:
    """``a or b`` as a conjunction where one implies the other; None otherwise."""
    if implies(a, b):
        return b
    if implies(b, a):
        return a
    return None


def select(c: Conj, a: Conj, b: Conj) -> Conj:
    """``(c and a) or (not c and b)``: what ``Where(c, a, b)`` keeps, as a conjunction."""
    if a == b or c == TRUE:
        return a
    if c.is_false:
        return b
    if b.is_false:
        return c & a
    if a.is_false:
        if b.atoms <= c.atoms and b != c:  # not (b and rest) and b  <=>  not rest and b
            return Conj(c.atoms - b.atoms).negate() & b
        return c.negate() & b
    joined = either(c, b) if a == TRUE else either(c.negate(), a) if b == TRUE else None
    if joined is None:
        raise Unprovable("a Where whose choice is a disjunction of conditions is not followed")
    return joined


def _fill(elem: Elem) -> float | None:
    """The value a float mask element masks with, where one value (None: not known)."""
    if isinstance(elem, FloatConst):
        return elem.value
    return elem.fill if isinstance(elem, Additive) else None


def _where(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """``Where(c, x, y)``: between two float masks (0 or a masking value, or masks) a mask;
    between two conditions a condition; between integers when ``c`` is decided or both agree."""
    c, x, y = (ev.eval(v) for v in node.inputs)
    shape = broadcast_shapes(c.shape, x.shape, y.shape)
    ec = aligned_elem(c, shape)
    if not isinstance(ec, Conj):
        raise Unprovable("Where of a condition that is not boolean")
    if "data" in (x.kind, y.kind):
        return None
    ex, ey = aligned_elem(x, shape), aligned_elem(y, shape)
    if x.kind == "float" and y.kind == "float":
        cx, cy = kept(ex), kept(ey)
        if cx is None or cy is None:
            shown = [e.value if isinstance(e, FloatConst) else "a mask" for e in (ex, ey)]
            raise Unprovable(f"Where selects {shown[0]} and {shown[1]}, not 0 and a masking value")
        if cx == cy and isinstance(ex, FloatConst):
            return SymTensor(shape, "float", ex)
        fills = {_fill(e) for e in (ex, ey) if kept(e) != TRUE}
        fill = fills.pop() if len(fills) == 1 else None
        return SymTensor(shape, "float", Additive(select(ec, cx, cy), fill))
    if isinstance(ex, Conj) and isinstance(ey, Conj):
        return SymTensor(shape, "bool", select(ec, ex, ey))
    if x.kind == "int" and y.kind == "int" and (ex == ey or ec == TRUE or ec.is_false):
        return SymTensor(shape, "int", ey if ec.is_false else ex)
    return None


def _expand(ev: Evaluator, node: ir.Node) -> SymTensor:
    x = ev.eval(node.inputs[0])
    target = ev.values(node.inputs[1], "Expand shape")
    shape = broadcast_shapes(x.shape, target)
    elem = None if x.elem is None and x.values is None else aligned_elem(x, shape)
    if x.kind == "data":
        elem = None
    return SymTensor(shape, x.kind, elem)


def _extremum(ev: Evaluator, node: ir.Node) -> SymTensor:
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


def _concat(ev: Evaluator, node: ir.Node) -> SymTensor:
    parts = [ev.eval(v) for v in node.inputs]
    rank = parts[0].rank
    along = _attr_int(node, "axis", 0)
    along = along + rank if along < 0 else along
    shape = list(parts[0].shape)
    if any(p.rank != rank for p in parts) or not 0 <= along < rank:
        raise Unprovable(
            f"Concat node {node.name!r} joins tensors of ranks {[p.rank for p in parts]} along axis {along}",
            kind=FusionRefusalCode.MALFORMED,
        )
    for p in parts[1:]:  # onnxruntime skips an empty part whatever its other lengths
        if any(k != along and not _equal(d, shape[k]) for k, d in enumerate(p.shape)):
            raise Unprovable(
                f"Concat node {node.name!r} joins [{', '.join(map(str, shape))}] and "
                f"[{', '.join(map(str, p.shape))}]: lengths other than along axis {along} not proven equal"
            )
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


def _transpose(ev: Evaluator, node: ir.Node) -> SymTensor:
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
        numerator, have = _factors(in_shape)
        denominator, want = _factors([d for d in out if d is not None])
        if want - have:
            raise Unprovable("Reshape target dimensions do not divide the input's")
        rest = list((have - want).elements())
        if denominator == 0 or numerator % denominator:
            raise Unprovable("cannot infer the -1 of a Reshape")
        ratio = numerator // denominator
        if len(rest) > 1 and not all(_symbol_of(d) is not None for d in rest):
            raise Unprovable("cannot infer the -1 of a Reshape")
        if len(rest) > 1:  # flattened lengths: their product, split again exactly by a later Reshape
            rest = [Affine.of(Symbol.product([s for d in rest if (s := _symbol_of(d)) is not None]))]
        out[unknown[0]] = rest[0].scale(ratio) if rest else Affine(const=ratio)
    return tuple(d for d in out if d is not None)


def _symbol_of(dim: Affine) -> Symbol | None:
    """The symbol ``dim`` is (coefficient 1, no constant), else None."""
    if dim.const or len(dim.terms) != 1 or dim.terms[0][1] != 1:
        return None
    return dim.terms[0][0]


def _factors(dims: Sequence[Affine]) -> tuple[int, Counter[Affine]]:
    """The product of ``dims`` as (its constant, its other factors): ``c * x`` is ``c`` and
    ``x``, a :attr:`SymbolKind.PRODUCT` its factors, any other form one factor."""
    const, factors = 1, Counter[Affine]()
    for dim in dims:
        if dim.is_const:
            const *= dim.const
            continue
        symbol, scale = dim.terms[0] if not dim.const and len(dim.terms) == 1 else (None, 1)
        const *= scale
        if symbol is None:
            factors[dim] += 1
        elif symbol.kind is SymbolKind.PRODUCT and symbol.form is not None:
            factors.update({Affine.of(f): k for f, k in symbol.form.terms})
        else:
            factors[Affine.of(symbol)] += 1
    return const, factors


def _reshape(ev: Evaluator, node: ir.Node) -> SymTensor:
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
        if nonnegative(bound):
            return bound if bound == n else min_of(bound, n)
        if never_positive(bound + 1):  # below 0 for every value: counted from the end
            return max_of(n + bound, ZERO)
        raise Unprovable(  # -S is the whole axis at S = 0 and its last S elements otherwise
            f"a Slice bound {bound} that may be negative (counted from the end of the axis) or not"
        )

    lo, hi = clamp(start), clamp(end)
    if hi == n or lo == ZERO:  # both clamped into [0, n]: no negative length to cut
        return hi - lo
    return max_of(hi - lo, ZERO)


def _slice_tensor(ev: Evaluator, node: ir.Node, x: SymTensor) -> SymTensor:
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
            raise Unprovable(
                f"Slice node {node.name!r} slices axis {axis_} of a {x.rank}-D tensor",
                kind=FusionRefusalCode.MALFORMED,
            )
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


def _slice(ev: Evaluator, node: ir.Node) -> SymTensor:
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
