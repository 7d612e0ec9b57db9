"""Readers of a cache that do not care about its element type: ``Shape`` and ``Size``.

Rules, for a node of the default domain reading a cache (past or present) of rank 4
``[batch, kv_heads, length, head]``:

1. A ``Shape`` or ``Size`` reads only the cache's dimensions, which every format keeps but
   the last one: such a reader never keeps a cache from being converted (exports read the
   batch and the past length this way; optimum's gemma2 reads a whole past's shape).
2. int4 packs the head dimension into ``(head_size + 1) // 2`` bytes. A reader that would see
   it is rewritten so that its output is the value it was:

   - ``Shape`` whose ``[start, end)`` covers axis 3 becomes
     ``Concat(Shape(cache, start, 3), Constant([head_size]))`` (the constant alone when it
     starts at axis 3);
   - ``Size`` becomes ``Mul(ReduceProd(Shape(cache, 0, 3), keepdims=0), head_size)``.

   A ``Shape`` of the leading dimensions only (``end <= 3``, or an empty range) is left as it
   is. The rewritten readers read no last dimension, so they stay right whatever format the
   cache is converted to later (requantizing int4 to int8).
3. The attention node itself must still tell its head size once its cache is packed (the
   runner, ``evaluate``, ``inspect`` and a later requantization read it from a static last
   dimension of the query, key or unpacked cache). A graph without ``value_info`` (mobius
   writes none) had it only on the cache: the query gets its width as a static last dimension
   (:func:`keep_query_width`), what it computes anyway.
"""

from __future__ import annotations

__all__ = ["keep_head_size", "keep_query_width", "reads_dimensions_only", "sees_head_dimension"]

import numpy as np
import onnx_ir as ir

_RANK = 4
_HEAD_AXIS = 3


def reads_dimensions_only(node: ir.Node) -> bool:
    """Whether ``node`` reads only its input's dimensions (rule 1)."""
    return node.domain == "" and node.op_type in ("Shape", "Size")


def _range(node: ir.Node) -> tuple[int, int]:
    """A Shape's ``[start, end)`` over a rank-4 input, normalized as the operator does."""

    def clamp(name: str, default: int) -> int:
        attr = node.attributes.get(name)
        value = default if attr is None else attr.as_int()
        return min(max(value + _RANK if value < 0 else value, 0), _RANK)

    return clamp("start", 0), clamp("end", _RANK)


def sees_head_dimension(node: ir.Node) -> bool:
    """Whether a dimensions-only reader's output depends on the head dimension (rule 2)."""
    if node.op_type == "Size":
        return True
    start, end = _range(node)
    return start < end and end > _HEAD_AXIS


def _constant(value: np.ndarray, name: str) -> ir.Node:
    return ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(value, name=name))], name=name)


def keep_head_size(node: ir.Node, head_size: int) -> bool:
    """Rewrite ``node`` (a Shape or Size of a cache whose head dimension is packed) so its
    output keeps the value it had with ``head_size`` there (rule 2); whether it changed."""
    graph = node.graph
    if graph is None or not sees_head_dimension(node):
        return False
    cache, old = node.inputs[0], node.outputs[0]
    assert cache is not None
    base = node.name or old.name or "cache_shape"
    head = _constant(
        np.array([head_size] if node.op_type == "Shape" else head_size, np.int64), f"{base}_head_size"
    )
    nodes: list[ir.Node] = [head]
    if node.op_type == "Shape":
        start, _ = _range(node)
        if start < _HEAD_AXIS:
            leading = ir.Node(
                "",
                "Shape",
                [cache],
                [ir.AttrInt64("start", start), ir.AttrInt64("end", _HEAD_AXIS)],
                name=f"{base}_leading",
            )
            joined = ir.Node("", "Concat", [leading.outputs[0], head.outputs[0]], [ir.AttrInt64("axis", 0)])
            nodes += [leading, joined]
    else:
        leading = ir.Node("", "Shape", [cache], [ir.AttrInt64("end", _HEAD_AXIS)], name=f"{base}_leading")
        product = ir.Node(
            "", "ReduceProd", [leading.outputs[0]], [ir.AttrInt64("keepdims", 0)], name=f"{base}_product"
        )
        joined = ir.Node("", "Mul", [product.outputs[0], head.outputs[0]])
        nodes += [leading, product, joined]
    result = nodes[-1].outputs[0]
    nodes[-1].name = base
    result.dtype, result.shape = ir.DataType.INT64, old.shape
    graph.insert_after(node, nodes)
    ir.convenience.replace_all_uses_with(old, result, replace_graph_outputs=True)
    name = old.name
    graph.remove(node, safe=True)
    result.name = name
    return True


def keep_query_width(query: ir.Value | None, width: int, rank: int, dtype: ir.DataType | None) -> bool:
    """Give ``query`` (an attention node's query, not a graph input) the static last dimension
    ``width`` when its shape leaves it unknown (rule 3), and its element type ``dtype`` when it
    has none (a shape is saved only with a type); whether it changed."""
    if query is None or query.is_graph_input() or query.const_value is not None:
        return False
    shape = query.shape
    if (shape is not None and len(shape) and isinstance(shape[-1], int)) or (query.dtype or dtype) is None:
        return False
    dims = list(shape) if shape is not None and len(shape) else [None] * rank
    if query.dtype is None and dtype is not None:
        query.dtype = dtype
    query.shape = ir.Shape([*dims[:-1], width])
    return True
