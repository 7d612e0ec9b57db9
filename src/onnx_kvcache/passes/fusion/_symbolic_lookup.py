"""The evaluator's rules for operators that pick, move or count elements by index.

``Gather``, ``GatherND``, ``ScatterND``, ``Tile``, ``Trilu``, ``NonZero``, ``CumSum`` and ``Size``,
as :mod:`~onnx_kvcache.passes.fusion._symbolic_index` states rules: each takes the evaluator and
a node and returns its output (a :class:`SymTensor`), or None where the rule does not apply.
An index a rule reads is proven never negative (an onnxruntime run refuses one past the end of
its axis, but a negative one counts from the end). The table is
:data:`~onnx_kvcache.passes.fusion._symbolic_rules.RULES`.
"""

from __future__ import annotations

__all__: list[str] = []

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes.fusion import _opsets as opsets
from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode
from onnx_kvcache.passes.fusion._symbolic_index import (
    _attr_int,
    _entry,
    _fill,
    _from_constant,
    _input,
    either,
    kept,
    nonnegative_index,
)
from onnx_kvcache.passes.fusion._symbolic_values import (
    _FLOAT_TYPES,
    ONE,
    TRUE,
    ZERO,
    Additive,
    Affine,
    Conj,
    Elem,
    FloatConst,
    Le,
    Symbol,
    SymbolKind,
    SymTensor,
    Unprovable,
    _shift,
    aligned_elem,
    axis,
    broadcast_shapes,
)

if TYPE_CHECKING:
    from onnx_kvcache.passes.fusion._symbolic_values import Evaluator


def _gather_nd(ev: Evaluator, node: ir.Node) -> SymTensor:
    """``GatherND(data, indices)`` (``batch_dims=0``) of indices that stack ``m`` index forms:
    ``data[i_0, ..., i_{m-1}, rest]`` over ``indices``' leading axes, then data's last axes."""
    data, indices = ev.eval(node.inputs[0]), ev.eval(node.inputs[1])
    if _attr_int(node, "batch_dims", 0) != 0:
        raise Unprovable("GatherND with batch_dims")
    if indices.stack is None or not 0 < len(indices.stack) <= data.rank:
        raise Unprovable("GatherND indices are not a stack of index forms, one per leading data axis")
    _check_indices(indices.stack, "GatherND")
    elem = data.element()
    m, lead = len(indices.stack), indices.rank - 1
    mapping = {axis(k): e for k, e in enumerate(indices.stack)}
    mapping.update({axis(k): Affine.of(axis(lead + k - m)) for k in range(m, data.rank)})
    return SymTensor(indices.shape[:-1] + data.shape[m:], data.kind, _shift(elem, mapping))


def _check_indices(forms: Sequence[Affine], what: str) -> None:
    """Indices proven never negative (a negative one counts from the end of its axis)."""
    for form in forms:
        if not nonnegative_index(form):
            raise Unprovable(f"the {what} index {form} is not proven non-negative")


def _gather(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """A known vector by constant indices: the picked values."""
    data = ev.eval(node.inputs[0])
    index = ev.const_ints(node.inputs[1], "Gather indices") if data.values is not None else None
    if data.values is None or data.rank != 1 or index is None or _attr_int(node, "axis", 0) != 0:
        return None
    n = len(data.values)
    if any(not -n <= i < n for i in index):
        raise Unprovable(
            f"Gather node {node.name!r} reads past a vector of {n}", kind=FusionRefusalCode.MALFORMED
        )
    picked = tuple(data.values[i] for i in index)
    indices = ev.eval(node.inputs[1])
    if not indices.rank:
        return SymTensor((), "int", picked[0], picked)
    return SymTensor(indices.shape, "int", values=picked) if indices.rank == 1 else None


def _gather_elements(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """``Gather(data, indices, axis)`` of indices whose element is a non-negative index form:
    ``data[..., i(j...), ...]``, indices' axes in place of data's ``axis``."""
    data, indices = ev.eval(node.inputs[0]), ev.eval(node.inputs[1])
    if data.elem is None or indices.kind != "int":
        return None
    at = _attr_int(node, "axis", 0)
    at = at + data.rank if at < 0 else at
    index = indices.element()
    if not isinstance(index, Affine) or not 0 <= at < data.rank:
        return None
    _check_indices([index], "Gather")
    r = indices.rank
    mapping = {axis(k): Affine.of(axis(k)) for k in range(at)}
    mapping[axis(at)] = index.subs({axis(j): Affine.of(axis(at + j)) for j in range(r)})
    mapping.update({axis(k): Affine.of(axis(k + r - 1)) for k in range(at + 1, data.rank)})
    shape = data.shape[:at] + indices.shape + data.shape[at + 1 :]
    return SymTensor(shape, data.kind, _shift(data.elem, mapping))


def _trilu(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """``Trilu(x, k)``: ``x`` where ``col - row >= k`` (``upper``) or ``col - row <= k`` (lower),
    zero elsewhere, over the last two axes: a condition ANDed with that; a float mask kept
    (zero) outside it."""
    x = ev.eval(node.inputs[0])
    k = ev.scalar(_input(node, 1), "Trilu k") if _input(node, 1) is not None else ZERO
    if x.rank < 2:
        raise Unprovable(f"Trilu node {node.name!r} of a {x.rank}-D tensor", kind=FusionRefusalCode.MALFORMED)
    row, col = Affine.of(axis(x.rank - 2)), Affine.of(axis(x.rank - 1))
    inside = Conj.of(Le(row - col + k)) if _attr_int(node, "upper", 1) else Conj.of(Le(col - row - k))
    if x.kind == "data" or not x.known:
        return None
    elem = x.element()
    if isinstance(elem, Conj):
        return SymTensor(x.shape, "bool", elem & inside)
    if isinstance(elem, (FloatConst, Additive)):
        cond = kept(elem)
        if cond is None:
            raise Unprovable(
                f"Trilu of the constant {elem.value if isinstance(elem, FloatConst) else elem}: a float "  # type: ignore[union-attr]
                "tensor's elements are followed as a mask (0, or a value that zeroes softmax)"
            )
        if cond == TRUE:
            return x
        joined = either(cond, inside.negate())
        if joined is None:
            raise Unprovable("Trilu of a mask keeps a disjunction of conditions")
        fill = elem.value if isinstance(elem, FloatConst) else elem.fill  # type: ignore[union-attr]
        return SymTensor(x.shape, "float", Additive(joined, fill))
    if elem == ZERO:
        return x
    return None


def _tile(ev: Evaluator, node: ir.Node) -> SymTensor:
    """``Tile(x, repeats)``: each axis ``repeats[k]`` times as long; the element kept where an
    axis is not repeated, is of length 1, or is one the element does not depend on."""
    x = ev.eval(node.inputs[0])
    repeats = ev.values(node.inputs[1], "Tile repeats")
    if len(repeats) != x.rank:
        raise Unprovable(
            f"Tile node {node.name!r} repeats {len(repeats)} axes of a {x.rank}-D tensor",
            kind=FusionRefusalCode.MALFORMED,
        )
    shape = tuple(_product(d, r) for d, r in zip(x.shape, repeats))
    elem, values = None, None
    if x.elem is not None and x.kind != "data":
        mapping = {axis(k): ZERO for k, d in enumerate(x.shape) if d == ONE}
        changing = [k for k, r in enumerate(repeats) if r != ONE and x.shape[k] != ONE]
        elem = _shift(x.elem, mapping)
        if any(axis(k) in _symbols(elem) for k in changing):
            elem = None  # the element repeats with a period: not affine
    if (
        x.values is not None
        and x.rank == 1
        and repeats[0].is_const
        and repeats[0].const * len(x.values) <= 64
    ):
        values = x.values * repeats[0].const
    if elem is None and values is None:
        return SymTensor(shape, x.kind if x.kind != "float" else "data")
    return SymTensor(shape, x.kind, elem, values)


def _symbols(elem: Elem) -> frozenset[Symbol]:
    """The symbols an element expression reads (its lookups' indices too)."""
    if isinstance(elem, Affine):
        found = set(elem.symbols)
        for symbol in elem.lookups:
            assert symbol.at is not None
            found |= symbol.at.row.symbols | symbol.at.col.symbols
        return frozenset(found)
    if isinstance(elem, Additive):
        return _symbols(elem.cond)
    if isinstance(elem, Conj):
        found = set()
        for atom in elem.atoms:
            if isinstance(atom, Le):
                found |= _symbols(atom.lhs)
            else:
                found |= atom.row.symbols | atom.col.symbols
        return frozenset(found)
    return frozenset()


def _product(a: Affine, b: Affine) -> Affine:
    if a.is_const:
        return b.scale(a.const)
    if b.is_const:
        return a.scale(b.const)
    raise Unprovable(f"the product {a} * {b} is not affine")


def _size(ev: Evaluator, node: ir.Node) -> SymTensor:
    """``Size(x)``: the product of its dimensions (affine: at most one symbolic)."""
    total = ONE
    for dim in ev.shape(node.inputs[0]):
        total = _product(total, dim)
    return SymTensor((), "int", total, (total,))


def _nonzero(ev: Evaluator, node: ir.Node) -> SymTensor:
    """``NonZero(x)`` of a tensor of constant shape whose every element is decided: the indices
    as a constant; of anything else, ``[rank, n]`` with ``n`` unknown (a scalar's indices are
    onnxruntime's ``[1, n]``, as of a 1-element vector)."""
    x = ev.eval(node.inputs[0])
    array = _decided(x)
    if array is None:
        return SymTensor((Affine(const=max(x.rank, 1)), Affine.of(ev.fresh())), "int")
    return _from_constant(
        np.array(np.nonzero(array.reshape(-1) if not array.ndim else array), np.int64), ir.DataType.INT64
    )


def _decided(x: SymTensor) -> np.ndarray | None:
    """The elements of a tensor of constant shape whose element reads only its indices."""
    if x.kind == "data" or not all(d.is_const for d in x.shape) or math.prod(d.const for d in x.shape) > 4096:
        return None
    if x.values is not None and x.rank <= 1:
        if not all(v.is_const for v in x.values):
            return None
        return np.array([v.const for v in x.values], np.int64).reshape([d.const for d in x.shape])
    if x.elem is None:
        return None
    grid = np.indices([d.const for d in x.shape], dtype=np.int64)
    env = {axis(k): grid[k] for k in range(x.rank)}
    return _numeric(x.elem, env, grid.shape[1:])


def _numeric(elem: Elem, env: dict[Symbol, np.ndarray], shape: tuple[int, ...]) -> np.ndarray | None:
    """``elem`` at every index, where it reads only the indices in ``env``."""

    def form(f: Affine) -> np.ndarray | None:
        out = np.full(shape, f.const, np.int64)
        for symbol, c in f.terms:
            if symbol not in env:
                return None
            out = out + c * env[symbol]
        return out

    if isinstance(elem, Affine):
        return form(elem)
    if isinstance(elem, FloatConst):
        return np.full(shape, elem.value)
    cond = elem.cond if isinstance(elem, Additive) else elem
    truth = np.ones(shape, bool)
    for atom in cond.atoms:
        if not isinstance(atom, Le):
            return None
        lhs = form(atom.lhs)
        if lhs is None:
            return None
        truth &= lhs <= 0
    if isinstance(elem, Additive):
        return np.where(truth, 0.0, -np.inf)
    return truth


def _scatter_nd(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """``ScatterND(data, indices, updates)`` whose indices are every position of data's first
    axes in order (a slice assignment that covers the tensor): ``updates``."""
    data, indices, updates = (ev.eval(v) for v in node.inputs[:3])
    if node.attributes.get("reduction") is not None and node.attributes["reduction"].as_string() != "none":
        return None
    stack = indices.stack
    if stack is None or not 0 < len(stack) <= data.rank:
        return None
    m = len(stack)
    covers = indices.shape[:-1] == data.shape[:m] and all(
        f == Affine.of(axis(k)) or (f == ZERO and data.shape[k] == ONE) for k, f in enumerate(stack)
    )
    if not covers or updates.shape != data.shape:
        return None
    return dataclasses.replace(updates, source=None)


def _cumsum(ev: Evaluator, node: ir.Node) -> SymTensor:
    """``CumSum(x, axis)``: of a 2-D integer input's entries along its columns the running count
    ``cumsum(m)[r, c]`` (``exclusive``: at ``c - 1``); of a constant ``v`` along an axis of
    length ``n``, ``v * (@k + 1)`` (``exclusive``: ``v * @k``; ``reverse``: counted from the end).
    int64 only, its sums read as exact as every int64 form is: a narrower type's running sum
    wraps (an int32 mask of large entries), so it is declined, as is a reverse count of entries
    and an axis that is not a constant within the rank (the axis is an input, 0-D or 1-D)."""
    x = ev.eval(node.inputs[0])
    along = ev.const_ints(_input(node, 1), "CumSum axis")
    if along is None or len(along) != 1:
        raise Unprovable("a CumSum along an axis that is not constant")
    k = along[0] + x.rank if along[0] < 0 else along[0]
    exclusive, reverse = bool(_attr_int(node, "exclusive", 0)), bool(_attr_int(node, "reverse", 0))
    if x.kind != "int" or ev.dtype(node.inputs[0]) != ir.DataType.INT64:
        raise Unprovable("a CumSum of other than int64 is not followed (a narrower running sum may wrap)")
    if not 0 <= k < x.rank:
        raise Unprovable(
            f"a CumSum along axis {along[0]} of a rank-{x.rank} tensor", kind=FusionRefusalCode.MALFORMED
        )
    elem = x.element()
    if isinstance(elem, Affine) and elem.is_const:
        index = Affine.of(axis(k))
        count = (x.shape[k] - index - 1 if reverse else index) + (0 if exclusive else 1)
        return SymTensor(x.shape, "int", count.scale(elem.const))
    entry = _entry(elem)
    if reverse:
        raise Unprovable("a reverse CumSum of an input's entries is not followed")
    if entry is None or entry.kind is not SymbolKind.ENTRY or entry.at is None:
        raise Unprovable("a CumSum of other than a 2-D integer input's entries or a constant is not followed")
    col = Affine.of(axis(k))
    if entry.at.col != col or axis(k) in entry.at.row.symbols:
        raise Unprovable("a CumSum along other than the input's columns is not followed")
    col = col - 1 if exclusive else col
    return SymTensor(x.shape, "int", Affine.of(Symbol.count(entry.at.source, entry.at.row, col)))


def _reduce_values(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """``ReduceMax``/``ReduceMin``/``ReduceSum`` of integers: of a constant vector, its value;
    along axes the element does not depend on, the element (max, min; over non-empty axes) or
    the element times their lengths (sum)."""
    x = ev.eval(node.inputs[0])
    if x.kind != "int":
        return None
    axes = opsets.moved(ev, node)
    if not axes:
        if opsets.attribute(node, "noop_with_empty_axes", 0):
            return x
        axes = list(range(x.rank))
    picked = sorted({a + x.rank if a < 0 else a for a in axes})
    keep = bool(_attr_int(node, "keepdims", 1))
    shape = tuple(ONE if k in picked else d for k, d in enumerate(x.shape) if keep or k not in picked)
    op = node.op_type
    if x.values is not None and x.rank == 1 and all(v.is_const for v in x.values) and x.values:
        consts = [v.const for v in x.values]
        if op == "ReduceSum" and sum(abs(c) for c in consts) > _EXACT_SUM:
            return None
        total = max(consts) if op == "ReduceMax" else min(consts) if op == "ReduceMin" else sum(consts)
        return SymTensor(shape, "int", Affine(const=total), (Affine(const=total),))
    elem = x.elem if isinstance(x.elem, Affine) else None
    if elem is None or any(axis(k) in _symbols(elem) for k in picked):
        return None
    lengths = [x.shape[k] for k in picked]
    if op == "ReduceSum":
        count = ONE
        for length in lengths:
            count = _product(count, length)
        if not _sum_is_exact(elem, count):
            return None
        elem = _product(elem, count)
    elif not all(d.is_const and d.const >= 1 for d in lengths):
        return None  # an empty reduction gives the operator's identity, not the element
    if not keep:
        kept = [k for k in range(x.rank) if k not in picked]
        elem = elem.subs({axis(k): Affine.of(axis(n)) for n, k in enumerate(kept)})
    values = (elem,) if not shape or (len(shape) == 1 and shape[0] == ONE) else None
    return SymTensor(shape, "int", elem, values)


_EXACT_SUM = 2**53
"""onnxruntime sums int64 through doubles: a ReduceSum is exact while its partial sums are within this."""
_MAX_ELEMENTS = 2**40
"""More elements than any int64 tensor onnxruntime holds (8 TiB): a bound on a reduced count."""


def _sum_is_exact(elem: Affine, count: Affine) -> bool:
    """A ReduceSum of ``count`` copies of ``elem`` whose partial sums stay within :data:`_EXACT_SUM`:
    a constant ``elem`` over a constant count, or small enough for any count an input holds."""
    if not elem.is_const:
        return False
    bound = count.const if count.is_const else _MAX_ELEMENTS
    return abs(elem.const) * bound <= _EXACT_SUM


def _gather_nd_shape(ev: Evaluator, node: ir.Node, output: int) -> SymTensor | None:
    """GatherND's shape: the indices' leading axes, then data's axes after the ones indexed."""
    data, indices = ev.shape(node.inputs[0]), ev.shape(node.inputs[1])
    batch = _attr_int(node, "batch_dims", 0)
    if output or not indices or not indices[-1].is_const or batch:
        return None
    return SymTensor(indices[:-1] + data[indices[-1].const :], "data")


def _cast_condition(ev: Evaluator, value: ir.Value | None) -> SymTensor | None:
    """The condition ``value`` is a float Cast of (1.0 where it holds, 0.0 elsewhere), or None."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return None
    if ir.DataType(_attr_int(node, "to", 0)) not in _FLOAT_TYPES:
        return None
    cond = ev.eval(node.inputs[0])
    return cond if cond.kind == "bool" and isinstance(cond.elem, Conj) else None


def _mask_product(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """``Mul(mask, Cast(c))`` (transformers' ``causal_mask *= c``): a finite fill where the mask
    masks and ``c`` holds, 0 elsewhere: kept where the mask keeps or ``c`` does not hold."""
    for mask_input, other in (tuple(node.inputs), tuple(reversed(node.inputs))):
        cond = _cast_condition(ev, other)
        mask = ev.eval(mask_input) if cond is not None else None
        if cond is None or mask is None or mask.kind != "float":
            continue
        shape = broadcast_shapes(mask.shape, cond.shape)
        elem, holds = aligned_elem(mask, shape), aligned_elem(cond, shape)
        keeps = kept(elem)
        fill = _fill(elem)
        if keeps is None or not isinstance(holds, Conj):
            return None
        if keeps == TRUE:
            return SymTensor(shape, "float", FloatConst(0.0))
        if fill is None or not math.isfinite(fill):
            raise Unprovable("a mask of -inf times a condition gives NaN where the condition does not hold")
        joined = either(keeps, holds.negate())
        if joined is None:
            raise Unprovable("a mask times a condition keeps a disjunction of conditions")
        return SymTensor(shape, "float", Additive(joined, fill))
    return None


def _masked_sum_is_zero(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """``Equal(Add(mask, Cast(e)), 0.0)`` with integers ``e`` (transformers' padding test
    ``causal_mask + attention_mask[:, None, None, :] == 0``): where the mask keeps (adds 0),
    ``e == 0``; where it masks with a fill beyond every integer's magnitude, never."""
    zero = ev.eval(node.inputs[1])
    add = node.inputs[0].producer() if node.inputs[0] is not None else None
    if not (isinstance(zero.elem, FloatConst) and zero.elem.value == 0.0) or add is None:
        return None
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
        return None
    for mask_input, other in (tuple(add.inputs), tuple(reversed(add.inputs))):
        cast = other.producer() if other is not None else None
        if cast is None or cast.op_type != "Cast":
            continue
        if ir.DataType(_attr_int(cast, "to", 0)) not in _FLOAT_TYPES:
            continue
        counted, mask = ev.eval(cast.inputs[0]), ev.eval(mask_input)
        if counted.kind != "int" or mask.kind != "float":
            continue
        shape = broadcast_shapes(mask.shape, counted.shape, zero.shape)
        elem, value = aligned_elem(mask, shape), aligned_elem(counted, shape)
        keeps = kept(elem)
        fill = _fill(elem)
        if keeps is None or not isinstance(value, Affine) or fill is None:
            return None
        if keeps != TRUE and math.isfinite(fill) and abs(fill) < 2.0**63:
            raise Unprovable(f"a mask filled with {fill} plus integers can be 0 where it masks")
        return SymTensor(shape, "bool", keeps & Conj.of(Le(value), Le(-value)))
    return None
