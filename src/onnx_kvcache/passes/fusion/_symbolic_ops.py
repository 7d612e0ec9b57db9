"""The evaluator's rules for float data's shapes and for graphs that carry no shape annotations.

TorchScript exports (``optimum-cli export onnx``, the onnx-community models) write no
``value_info``: only graph inputs, outputs and initializers have shapes. These rules let
the evaluator follow such a graph from its inputs, every rule exact:

- **Float data** (activations, weights) is followed by shape: elementwise ops broadcast,
  ``MatMul`` (and ``MatMulInteger``, ``com.microsoft::MatMulNBits``), reductions,
  ``Flatten``, ``Gather`` of an embedding, ``Dropout``, ``DynamicQuantizeLinear``, the
  normalizations; ``Concat`` where its value rule declines (an axis whose parts' lengths are
  not proven equal is a fresh length: onnxruntime skips an empty part). A value annotated
  with a shape keeps it.
- **Shape idioms** of torch's exporter: ``ConstantOfShape``, integer ``Div`` of known
  vectors by a constant, comparisons of known vectors and ``Where`` between them (the
  ``Expand`` target ``Where(shape == -1, 1, shape)``), ``Reshape`` of a known vector.
- **CastLike** to an integer type of an integer tensor of that type, or of integer (or
  integral float) constants the target type holds: the values unchanged.
- **Split** of any tensor by constant sizes or into equal parts of a constant axis (phi3's
  fused projections): each output's shape.
- **Slices** of any tensor along an axis, from a constant start to the end of the axis,
  a constant end or an end proven equal to the axis length (the mask sliced to the key
  length).
- **The padding lookup** ``Gather(Flatten(mask), batch * width + key)``: the element of
  the 2-D mask at ``[batch, key]`` when ``width`` is the mask's width and both indices are
  proven in range; a ``Reshape`` that only inserts or removes unit axes (after a
  flattening one) keeps the elements.

The table of which rule serves which operator is
:data:`~onnx_kvcache.passes.fusion._symbolic_rules.RULES` (running sums, gathers and the
other lookups are :mod:`~onnx_kvcache.passes.fusion._symbolic_lookup`'s).
"""

from __future__ import annotations

__all__: list[str] = []  # the rules; their table is _symbolic_rules.RULES

import math
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes._graph import op_of
from onnx_kvcache.passes.fusion import _opsets as opsets
from onnx_kvcache.passes.fusion._piecewise import equal
from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode
from onnx_kvcache.passes.fusion._symbolic_index import (
    _COMPARE,
    _attr_int,
    _input,
    reshape_dims,
)
from onnx_kvcache.passes.fusion._symbolic_values import (
    _FLOAT_TYPES,
    _INT_TYPES,
    FALSE,
    ONE,
    TRUE,
    Affine,
    Conj,
    FloatConst,
    Le,
    SymbolKind,
    SymTensor,
    Unprovable,
    _kind_of,
    aligned_elem,
    axis,
    broadcast_shapes,
    check_declared,
)

if TYPE_CHECKING:
    from onnx_kvcache.passes.fusion._symbolic_values import Evaluator

_BIG = 2**62


def _data(ev: Evaluator, value: ir.Value, shape) -> SymTensor:
    """An opaque tensor of ``shape`` (its annotated shape, if it has one; an axis annotated
    without a name or size is ``shape``'s)."""
    kind = _kind_of(ev.dtype(value))
    if value.shape is None:
        return SymTensor(tuple(shape), kind)
    declared = ev.declared_shape(value)
    computed = tuple(shape)
    check_declared(value, declared, computed, value.producer())
    if len(computed) == len(declared):
        declared = tuple(
            c if not isinstance(d, int) and d.value is None else k
            for d, k, c in zip(value.shape, declared, computed)
        )
    return SymTensor(declared, kind)


def _opaque(t: SymTensor) -> bool:
    return t.kind == "data" or (
        t.elem is None and t.values is None and t.stack is None and t.conds is None and t.source is None
    )


# ---- data rules: the shape of an output from its inputs' shapes ----


def _elementwise(ev: Evaluator, node: ir.Node) -> SymTensor:
    shapes = [ev.shape(v) for v in node.inputs if v is not None]
    return _data(ev, node.outputs[0], broadcast_shapes(*shapes))


def _same(ev: Evaluator, node: ir.Node) -> SymTensor:
    return _data(ev, node.outputs[0], ev.shape(node.inputs[0]))


def _matmul_shape(a: tuple[Affine, ...], b: tuple[Affine, ...]) -> tuple[Affine, ...]:
    if len(a) < 1 or len(b) < 1:
        raise Unprovable("a MatMul of a scalar")
    if len(b) == 1:
        return a[:-1]
    if len(a) == 1:
        return b[:-2] + b[-1:]
    return (*broadcast_shapes(a[:-2], b[:-2]), a[-2], b[-1])


def _matmul(ev: Evaluator, node: ir.Node) -> SymTensor:
    return _data(ev, node.outputs[0], _matmul_shape(ev.shape(node.inputs[0]), ev.shape(node.inputs[1])))


def _matmul_nbits(ev: Evaluator, node: ir.Node, index: int) -> SymTensor:
    a = ev.shape(node.inputs[0])
    return _data(ev, node.outputs[index], (*a[:-1], Affine(const=_attr_int(node, "N", 0))))


def _reduce(ev: Evaluator, node: ir.Node) -> SymTensor:
    x = ev.shape(node.inputs[0])
    axes = opsets.moved(ev, node)
    if not axes:
        if opsets.attribute(node, "noop_with_empty_axes", 0):
            return _data(ev, node.outputs[0], x)
        axes = list(range(len(x)))
    picked = {a + len(x) if a < 0 else a for a in axes}
    keep = bool(_attr_int(node, "keepdims", 1))
    shape = [ONE if k in picked else d for k, d in enumerate(x) if keep or k not in picked]
    return _data(ev, node.outputs[0], shape)


def _concat(ev: Evaluator, node: ir.Node) -> SymTensor:
    """Concat's shape where its value rule declines: each axis whose parts' lengths are proven
    equal keeps that length; any other axis, and the joined one then, is a fresh length
    (onnxruntime skips an empty part, whatever its other lengths)."""
    shapes = [ev.shape(v) for v in node.inputs if v is not None]
    rank = len(shapes[0])
    along = _attr_int(node, "axis", 0)
    along = along + rank if along < 0 else along
    if any(len(s) != rank for s in shapes) or not 0 <= along < rank:
        raise Unprovable(
            f"Concat node {node.name!r} joins tensors of ranks {[len(s) for s in shapes]} along axis {along}",
            kind=FusionRefusalCode.MALFORMED,
        )
    same = [all(equal(s[k], shapes[0][k]) for s in shapes) for k in range(rank)]
    out = [d if same[k] else Affine.of(ev.fresh()) for k, d in enumerate(shapes[0])]
    if all(same[k] for k in range(rank) if k != along):
        out[along] = sum((s[along] for s in shapes[1:]), shapes[0][along])
    else:
        out[along] = Affine.of(ev.fresh())
    return _data(ev, node.outputs[0], out)


def _flatten(ev: Evaluator, node: ir.Node) -> SymTensor:
    x = ev.shape(node.inputs[0])
    at = _attr_int(node, "axis", 1)
    at = at + len(x) if at < 0 else at

    def product(dims) -> Affine:
        symbolic = [d for d in dims if not d.is_const]
        const = math.prod(d.const for d in dims if d.is_const)
        if not symbolic:
            return Affine(const=const)
        if len(symbolic) == 1:
            return symbolic[0].scale(const)
        return Affine.of(ev.fresh())  # a product of lengths is not affine: a fresh length

    return _data(ev, node.outputs[0], (product(x[:at]), product(x[at:])))


def _gather_data(ev: Evaluator, node: ir.Node) -> SymTensor:
    data, indices = ev.shape(node.inputs[0]), ev.shape(node.inputs[1])
    at = _attr_int(node, "axis", 0)
    at = at + len(data) if at < 0 else at
    return _data(ev, node.outputs[0], data[:at] + indices + data[at + 1 :])


def _first_output_same(ev: Evaluator, node: ir.Node, index: int) -> SymTensor:
    """Dropout: output 0 is its input, output 1 a mask of its shape."""
    return _data(ev, node.outputs[index], ev.shape(node.inputs[0]))


def _dynamic_quantize(ev: Evaluator, node: ir.Node, index: int) -> SymTensor:
    shape = ev.shape(node.inputs[0]) if index == 0 else ()
    return _data(ev, node.outputs[index], shape)


# ---- index rules ----


def _decide(cond: Conj) -> bool | None:
    """True/False when ``cond`` holds for all / no values of its (non-negative) symbols."""
    if cond == TRUE:
        return True
    if cond.is_false:
        return False
    atoms = list(cond.atoms)
    for atom in atoms:
        if isinstance(atom, Le) and atom.lhs.const > 0 and all(c >= 0 for _, c in atom.lhs.terms):
            return False
    if all(isinstance(a, Le) and a.lhs.const <= 0 and all(c <= 0 for _, c in a.lhs.terms) for a in atoms):
        return True
    return None


def _vector(t: SymTensor) -> tuple[Affine, ...] | None:
    return t.values if t.values is not None and t.rank <= 1 else None


def _pairs(a: tuple, b: tuple) -> list[tuple] | None:
    if len(a) == len(b):
        return list(zip(a, b))
    if len(a) == 1:
        return [(a[0], y) for y in b]
    if len(b) == 1:
        return [(x, b[0]) for x in a]
    return None


def _compare_vectors(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    a, b = (_vector(ev.eval(v)) for v in node.inputs[:2])
    if a is None or b is None or (len(a) == 1 and len(b) == 1):
        return None
    pairs = _pairs(a, b)
    if pairs is None:
        return None
    conds = tuple(_COMPARE[node.op_type](x, y) for x, y in pairs)
    return SymTensor((Affine(const=len(conds)),), "bool", conds=conds)


def _where_vectors(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    c = ev.eval(node.inputs[0])
    if c.conds is None:
        return None
    x, y = (_vector(ev.eval(v)) for v in node.inputs[1:3])
    if x is None or y is None:
        raise Unprovable("Where over a known condition vector between unknown vectors")
    n = max(len(c.conds), len(x), len(y))
    picked = []
    for k in range(n):
        cond = c.conds[k if len(c.conds) > 1 else 0]
        decided = _decide(cond)
        if decided is None:
            raise Unprovable("a shape vector's Where condition is not decided")
        picked.append((x if decided else y)[k if len(x if decided else y) > 1 else 0])
    return SymTensor((Affine(const=n),), "int", values=tuple(picked))


def _constant_of_shape(ev: Evaluator, node: ir.Node) -> SymTensor:
    dims = ev.values(node.inputs[0], "ConstantOfShape shape")
    attr = node.attributes.get("value")
    array = np.asarray(attr.value.numpy()) if attr is not None else np.zeros(1, np.float32)
    if array.size != 1:
        raise Unprovable("ConstantOfShape with a non-scalar value")
    fill = array.reshape(-1)[0]
    dtype = ir.DataType.from_numpy(array.dtype)
    if dtype in _INT_TYPES:
        const = Affine(const=int(fill))
        values = tuple(const for _ in range(dims[0].const)) if len(dims) == 1 and dims[0].is_const else None
        if values is not None and len(values) > 64:
            values = None
        return SymTensor(dims, "int", const, values)
    if dtype == ir.DataType.BOOL:
        return SymTensor(dims, "bool", TRUE if bool(fill) else FALSE)
    if dtype in _FLOAT_TYPES:
        return SymTensor(dims, "float", FloatConst(float(fill)))
    raise Unprovable(f"ConstantOfShape of {dtype}")


def _divide(x: Affine, y: Affine) -> Affine:
    if not y.is_const or y.const <= 0:
        raise Unprovable(f"the quotient {x} / {y} is not by a positive constant")
    if x.is_const and x.const >= 0:  # ONNX's integer Div truncates: floor, for x >= 0 (torch's
        return Affine(const=x.const // y.const)  # ceil-division chunk sizes: (128 + 1) / 2)
    if x.const % y.const or any(c % y.const for _, c in x.terms):
        raise Unprovable(f"{x} is not proven divisible by {y.const}")
    return Affine(tuple((k, c // y.const) for k, c in x.terms), x.const // y.const)


def _int_div(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    a, b = ev.eval(node.inputs[0]), ev.eval(node.inputs[1])
    if a.kind != "int" or b.kind != "int":
        return None
    av, bv = _vector(a), _vector(b)
    pairs = _pairs(av, bv) if av is not None and bv is not None else None
    if pairs is None:
        return None
    values = tuple(_divide(x, y) for x, y in pairs)
    shape = broadcast_shapes(a.shape, b.shape)
    return SymTensor(shape, "int", values[0] if len(values) == 1 else None, values)


def _reshape_vector(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """A known vector reshaped to a vector (``[-1]`` or its length) keeps its values."""
    x = ev.eval(node.inputs[0])
    if x.values is None or x.rank != 1:
        return None
    target = ev.values(node.inputs[1], "Reshape shape")
    if len(target) != 1 or target[0] not in (Affine(const=-1), Affine(const=len(x.values))):
        return None
    return SymTensor(x.shape, x.kind, x.elem, x.values)


def _unit_reshape(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """A Reshape that only inserts/removes unit axes (maybe after a flattening Reshape)."""
    source = node.inputs[0]
    inner = op_of(source, "Reshape")
    if inner is not None:
        flat = ev.eval(inner.inputs[1]) if inner.inputs[1] is not None else None
        if flat is not None and flat.values == (Affine(const=-1),):
            source = inner.inputs[0]
    x = ev.eval(source)
    if x.elem is None:
        return None
    target = ev.values(node.inputs[1], "Reshape shape")
    try:  # ``0`` and ``-1`` resolved (transformers 4.57's ``view(-1, 1)``), exactly as Reshape does
        target = reshape_dims(x.shape, target, allowzero=bool(_attr_int(node, "allowzero", 0)))
    except Unprovable:
        return None
    if any(d.is_const and d.const <= 0 for d in target):
        return None
    kept_in = [k for k, d in enumerate(x.shape) if d != ONE]
    kept_out = [k for k, d in enumerate(target) if d != ONE]
    if [x.shape[k] for k in kept_in] != [target[k] for k in kept_out]:
        return None
    mapping = {axis(k): Affine(const=0) for k in range(x.rank)}
    mapping.update({axis(i): Affine.of(axis(o)) for i, o in zip(kept_in, kept_out)})
    values = x.values if x.values is not None and len(x.values) == 1 and len(target) <= 1 else None
    return SymTensor(tuple(target), x.kind, x.elem.subs(mapping), values)


def _flat_lookup(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """``Gather(Flatten(m), b * width + j)`` of a 2-D ``m``: ``m[b, j]``, ``b`` over exactly
    ``m``'s rows, ``j`` over an axis of any length ``L``: every pair ``(b, j)`` is gathered, so
    with ``L > width`` the last row's ``(rows - 1) * width + L - 1`` is past the tensor and
    onnxruntime refuses the run; whenever it runs, ``j < width`` and the lookup is ``m[b, j]``
    (TorchScript's mask reads the key range ``past + seq`` of a mask declared ``[batch, total]``)."""
    flatten = op_of(node.inputs[0], "Flatten")
    add = op_of(node.inputs[1], "Add")
    if flatten is None or add is None or _attr_int(node, "axis", 0) != 0:
        return None
    data = ev.eval(flatten.inputs[0])
    if data.rank != 2 or _attr_int(flatten, "axis", 1) != 2 or data.elem is None:
        return None
    rows, width = data.shape
    for col_value, product in (add.inputs, tuple(reversed(add.inputs))):
        mul = op_of(product, "Mul")
        if mul is None:
            continue
        for row_value, factor in (mul.inputs, tuple(reversed(mul.inputs))):
            w = ev.eval(factor)
            if _vector(w) != (width,):
                continue
            col, row = ev.eval(col_value), ev.eval(row_value)
            shape = broadcast_shapes(col.shape, row.shape)
            ec, er = aligned_elem(col, shape), aligned_elem(row, shape)
            if (
                isinstance(ec, Affine)
                and isinstance(er, Affine)
                and _ranges_over(ec, shape, None)
                and _ranges_over(er, shape, rows)
            ):
                elem = data.elem.subs({axis(0): er, axis(1): ec})
                return SymTensor((*shape, ONE), data.kind, elem)
    return None


def _ranges_over(elem: object, shape: tuple[Affine, ...], length: Affine | None) -> bool:
    """``elem`` is an axis index over an axis of ``length`` (so within ``[0, length)``; None:
    of any length)."""
    if not isinstance(elem, Affine) or elem.const or len(elem.terms) != 1:
        return False
    ((symbol, coefficient),) = elem.terms
    if coefficient != 1 or symbol.kind is not SymbolKind.AXIS:
        return False
    return length is None or shape[int(symbol.name)] == length


def _slice_any(ev: Evaluator, node: ir.Node) -> SymTensor:
    """A slice from a constant start to the axis end, a constant, or the axis length."""
    x = ev.eval(node.inputs[0])
    starts = ev.values(node.inputs[1], "Slice starts")
    ends = ev.values(node.inputs[2], "Slice ends")
    axes = ev.const_ints(_input(node, 3), "Slice axes") or list(range(len(starts)))
    steps = ev.const_ints(_input(node, 4), "Slice steps") or [1] * len(starts)
    if len(starts) != len(ends) or len(axes) != len(starts) or any(s != 1 for s in steps):
        raise Unprovable("a Slice with steps or unmatched bounds")
    shape, mapping = list(x.shape), {}
    for start, end, at in zip(starts, ends, axes):
        at = at + x.rank if at < 0 else at
        if not 0 <= at < x.rank:
            raise Unprovable(
                f"Slice node {node.name!r} slices axis {at} of a {x.rank}-D tensor",
                kind=FusionRefusalCode.MALFORMED,
            )
        dim = shape[at]
        if not start.is_const or (start.const < 0 and not dim.is_const):
            raise Unprovable("a Slice start that is not a constant")
        first = start.const + dim.const if start.const < 0 else start.const
        if dim.is_const:
            first = max(0, min(first, dim.const))
        if (end.is_const and end.const >= _BIG) or end == dim:
            last = dim
        elif end.is_const and dim.is_const:
            stop = end.const + dim.const if end.const < 0 else end.const
            last = Affine(const=max(first, min(stop, dim.const)))
        else:
            raise Unprovable(f"a Slice end {end} not proven within its axis of {dim}")
        if dim.is_const or first == 0:  # a symbolic axis may be shorter than a constant start
            shape[at] = last - first
        else:
            raise Unprovable("a Slice start not proven within its axis")
        mapping[axis(at)] = Affine.of(axis(at)) + first
    elem = None if x.elem is None else x.elem.subs(mapping)
    values = None
    if x.values is not None and x.rank == 1 and all(d.is_const for d in shape):
        first = mapping[axis(0)].const if axis(0) in mapping else 0
        values = x.values[first : first + shape[0].const]
    return SymTensor(tuple(shape), x.kind, elem, values)


def _split(ev: Evaluator, node: ir.Node, index: int) -> SymTensor:
    """One output of a Split (phi3's fused gate/up and qkv projections, ``chunk`` in torch): its
    shape along the axis from the ``split`` sizes, else ``num_outputs`` parts of a constant axis
    (the last one shorter, as the operator divides); a known vector's values are sliced."""
    x = ev.eval(node.inputs[0])
    at = _attr_int(node, "axis", 0)
    at = at + x.rank if at < 0 else at
    if not 0 <= at < x.rank:
        raise Unprovable(
            f"Split node {node.name!r} splits axis {at} of a {x.rank}-D tensor",
            kind=FusionRefusalCode.MALFORMED,
        )
    dim = x.shape[at]
    sizes = opsets.moved(ev, node)
    if sizes is None:
        parts = opsets.attribute(node, "num_outputs", len(node.outputs))
        if not dim.is_const or parts <= 0:
            raise Unprovable(f"a Split of an axis of {dim} into {parts} parts")
        size = -(-dim.const // parts)
        sizes = [min(size, max(0, dim.const - size * k)) for k in range(parts)]
    if index >= len(sizes) or (dim.is_const and sum(sizes) != dim.const):
        raise Unprovable("Split sizes that do not add up to the axis")
    shape = list(x.shape)
    shape[at] = Affine(const=sizes[index])
    first = sum(sizes[:index])
    values = None
    if x.values is not None and x.rank == 1:
        values = x.values[first : first + sizes[index]]
    kind = "data" if x.kind in ("data", "float") else x.kind
    return SymTensor(tuple(shape), kind, None, values)


def _cast_to_float(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """A Cast to a float type of integer data (positions for rotary angles): followed by shape."""
    to = ir.DataType(_attr_int(node, "to", 0))
    x = ev.eval(node.inputs[0])
    if to in _FLOAT_TYPES and x.kind == "int":
        return _data(ev, node.outputs[0], x.shape)
    return None


def _cast_like_int(ev: Evaluator, node: ir.Node) -> SymTensor | None:
    """``CastLike`` of an integer tensor to its own integer type (torch's dynamo export casts a
    Range step or bound like the other bound), or of known constants the target type holds:
    the values unchanged; a float constant of an integral value (the Range ``0.0`` and ``1.0``
    of torch's unoptimized dynamo export) cast like an integer is that integer."""
    x = ev.eval(node.inputs[0])
    source, target = ev.dtype(node.inputs[0]), ev.dtype(_input(node, 1))
    if target not in _INT_TYPES or source is None:
        return None
    info = np.iinfo(target.numpy())
    if x.kind == "float" and isinstance(x.elem, FloatConst) and x.rank <= 1:
        value = x.elem.value
        if not (math.isfinite(value) and value == int(value) and info.min <= value <= info.max):
            return None
        const = Affine(const=int(value))
        count = 1 if x.rank == 0 else (x.shape[0].const if x.shape[0].is_const else None)
        if count is None or count > 64:
            return None
        return SymTensor(x.shape, "int", const, (const,) * count)
    if x.kind != "int":
        return None
    if source == target:
        return x
    if x.values is not None and all(v.is_const and info.min <= v.const <= info.max for v in x.values):
        return SymTensor(x.shape, "int", x.elem, x.values)
    return None


def _skip_norm(ev: Evaluator, node: ir.Node, index: int) -> SymTensor | None:
    """SkipSimplifiedLayerNormalization: its output and its residual sum (3) are shaped as its
    input; its statistics are not this rule's."""
    if index not in (0, 3):
        return None
    return _data(ev, node.outputs[index], ev.shape(node.inputs[0]))
