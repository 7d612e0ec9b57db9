"""Which values a KV-cache conversion retypes, and whether a cache can be converted at all.

The ends of a cache: the graph inputs a past cache comes from (through function calls), the
outputs a present flows out to (through If/Loop bodies and function calls), who else reads them
(only converted attention nodes, Shape and Size, or a rolling window's row gather), and retyping one
value to the target format. A cache that cannot be converted raises :class:`_Skip` with why;
:mod:`.kv_cache_quantization` (rules 1 and 2) turns that into a skipped node and a warning.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat
from onnx_kvcache.cache.operators import AttentionOp
from onnx_kvcache.cache.rolling import tail_rows
from onnx_kvcache.cache.sites import CacheSite, function_call_sites
from onnx_kvcache.errors import KvCachePreconditionError
from onnx_kvcache.passes._shape_readers import reads_dimensions_only, sees_head_dimension


class _Skip(Exception):
    """A site that cannot be converted; the message says why."""


def _check_cache_shapes(site: CacheSite) -> None:
    """Key and value caches agree in every static dimension but the last; heads match."""
    shapes = [site.past(side).shape for side in site.sides]  # type: ignore[union-attr]
    heads_axis = site.op.layout.heads_axis
    for side, shape in zip(site.sides, shapes):
        if shape is None or len(shape) != 4:
            continue
        if isinstance(shape[heads_axis], int) and shape[heads_axis] != site.kv_num_heads:
            raise KvCachePreconditionError(
                f"{site.label}: its {side.kind} cache has {shape[heads_axis]} heads on axis {heads_axis} "
                f"({site.op.layout.dims[heads_axis]}), but kv_num_heads is {site.kv_num_heads}; the model "
                "is malformed."
            )
    if len(shapes) == 2 and all(s is not None and len(s) == 4 for s in shapes):
        for axis, (a, b) in enumerate(zip(shapes[0][:3], shapes[1][:3])):  # type: ignore[index]
            if isinstance(a, int) and isinstance(b, int) and a != b:
                raise KvCachePreconditionError(
                    f"{site.label}: key and value caches differ in {site.op.layout.dims[axis]} "
                    f"({a} vs {b}); both caches of a node share one layout. Rebuild the model with "
                    "matching cache shapes."
                )


def _check_only_attention_reads(
    model: ir.Model, value: ir.Value, readers: dict[int, AttentionOp | None], what: str
) -> None:
    """A cache may be read only as the cache of converted attention nodes (or by the float
    branch of their wrapper, ``None`` in ``readers``), or passed to a function."""
    for user, slot in value.uses():
        op = readers.get(id(user))
        if user.graph is None or (id(user) in readers and (op is None or slot in op.cache_slots)):
            continue  # a removed node, or a converted reader
        if user is tail_rows(value):
            continue  # a rolling window cache's present (its output is retyped too)
        if user.op_identifier() in model.functions:
            continue  # the function's own use of its input is checked where it is a source
        if reads_dimensions_only(user):
            continue  # Shape, Size: the dimensions, kept (int4's head: _shape_readers)
        raise _Skip(
            f"{what} cache {value.name!r} is also read by {user.op_type} node {user.name!r}, "
            "which would see the quantized type"
        )


def _head_readers(values: list[ir.Value]) -> list[ir.Node]:
    """The Shape and Size nodes reading ``values`` whose output depends on the head dimension."""
    return [
        user
        for value in values
        for user, _ in value.uses()
        if reads_dimensions_only(user) and sees_head_dimension(user)
    ]


def _owner_function(model: ir.Model, value: ir.Value) -> ir.Function | None:
    for function in model.functions.values():
        if value.graph is function.graph:
            return function
    return None


def _cache_sources(model: ir.Model, site: CacheSite, value: ir.Value) -> tuple[list[ir.Value], str | None]:
    """Values to retype for a cache input, or why it cannot be converted."""
    if value.is_graph_input():
        function = _owner_function(model, value)
        if function is None:
            if value.graph is model.graph:
                return [value], None
            return [], "is an input of a subgraph body (Loop/Scan)"
        index = list(function.inputs).index(value)
        found = [value]
        for caller in function_call_sites(model, function):
            argument = caller.inputs[index] if index < len(caller.inputs) else None
            if argument is not None:
                outer, reason = _cache_sources(model, site, argument)
                if reason:
                    return [], reason
                found += outer
        return found, None
    producer = value.producer()
    if producer is not None:
        return [], f"is produced by {producer.op_type} node {producer.name!r}"
    const = value.const_value
    if const is not None and const.size == 0:
        return [value], None
    if const is not None:
        return [], "is a non-empty initializer"
    return [], "is not a graph input"


def _subgraph_owner(model: ir.Model, graph: ir.Graph) -> ir.Node | None:
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH and attr.value is graph:
                return node
            if attr.type == ir.AttributeType.GRAPHS and any(g is graph for g in attr.value):
                return node
    return None


def _cache_sinks(model: ir.Model, site: CacheSite, value: ir.Value) -> list[ir.Value]:
    """Values to retype for a present output: the output and where it flows out."""
    rows = tail_rows(value)
    if rows is not None:  # a rolling window cache's present: the gather's output leaves
        return [value, rows.outputs[0]]
    found = [value]
    if not value.is_graph_output() or value.graph is model.graph or value.graph is None:
        return found
    graph = value.graph
    index = list(graph.outputs).index(value)
    function = _owner_function(model, value)
    if function is not None:
        for caller in function_call_sites(model, function):
            if index < len(caller.outputs):
                found += _cache_sinks(model, site, caller.outputs[index])
        return found
    owner = _subgraph_owner(model, graph)
    if owner is not None and owner.op_type == "If" and index < len(owner.outputs):
        found += _cache_sinks(model, site, owner.outputs[index])
    elif owner is not None and owner.op_type == "Loop" and 0 < index <= len(owner.outputs):
        found += _cache_sinks(model, site, owner.outputs[index - 1])
    return found


def _retype(value: ir.Value, fmt: CacheFormat, head_size: int | None, *, unpack: bool = False) -> bool:
    """Give a cache value the format's type; a packed format gets a static last dimension.

    onnxruntime-genai allocates caches from the declared shape, so a packed cache keeps no
    symbolic head dimension (``kv_cache_dim``): it becomes ``(head_size + 1) // 2``. A packed
    cache converted to an unpacked format (``unpack``) takes ``head_size`` again.
    """
    if value.dtype == fmt.dtype:
        return False
    shape = value.shape
    if shape is not None and len(shape) == 4:
        last = shape[3]
        if (fmt.values_per_byte > 1 or unpack) and head_size is not None:
            last = fmt.packed_dim(head_size)
        elif isinstance(last, int):
            last = fmt.packed_dim(last)
        shape = ir.Shape([*shape[:3], last])
    value.type = ir.TensorType(fmt.dtype)
    value.shape = shape
    if value.const_value is not None and shape is not None:
        dims = [d if isinstance(d, int) else 0 for d in shape]
        empty = np.zeros(dims, fmt.numpy_dtype())
        value.const_value = ir.tensor(empty, dtype=fmt.dtype, name=value.name)
    return True
