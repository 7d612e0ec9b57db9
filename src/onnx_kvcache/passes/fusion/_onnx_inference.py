"""ONNX's own shape inference of one node, for the shapes no value_info and no rule gives.

:func:`infer_output` runs ``onnx.shape_inference.infer_node_outputs`` on one node: its inputs'
element types and shapes as the evaluator knows them (a symbolic dimension passed as a name
that reads back as the same form; a dimension ONNX makes up is a fresh symbol), its inputs'
small constants (and integer vectors the evaluator knows exactly) as data. Nothing else of
the graph is serialized or read: no weight, no other node. An operator ONNX has no schema for
(another domain's), or whose inference fails or gives no shape, raises
:class:`~onnx_kvcache.passes.fusion._symbolic_values.Unprovable` naming it
(:attr:`~onnx_kvcache.passes.fusion._refusals.FusionRefusalCode.UNKNOWN_SHAPE`).
"""

from __future__ import annotations

__all__ = ["infer_output"]

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode
from onnx_kvcache.passes.fusion._symbolic_values import Affine, Unprovable, constant_array

if TYPE_CHECKING:
    from onnx_kvcache.passes.fusion._symbolic_values import Evaluator

_UNKNOWN = FusionRefusalCode.UNKNOWN_SHAPE
_FIRST = frozenset({_UNKNOWN, FusionRefusalCode.MALFORMED})
"""An input's reasons that stand for the node's shape: no inference without that input's shape."""


def _unknown(node: ir.Node, output: int, why: str) -> Unprovable:
    value = node.outputs[output].name if output < len(node.outputs) else "?"
    domain = f" ({node.domain})" if node.domain not in ("", "ai.onnx") else ""
    return Unprovable(
        f"the shape of {value!r} is not known: {node.op_type}{domain} node {node.name!r} has no "
        f"value_info and no shape rule, and {why}",
        kind=_UNKNOWN,
        rule=f"shape:{node.domain}:{node.op_type}",
    )


def infer_output(ev: Evaluator, node: ir.Node, output: int) -> tuple[tuple[Affine, ...], ir.DataType | None]:
    """The shape (and element type) ONNX infers for output ``output`` of ``node``."""
    import onnx

    domain = "" if node.domain == "ai.onnx" else node.domain
    graph = node.graph
    opsets = dict(graph.opset_imports) if graph is not None else {}
    version = opsets.get(domain, opsets.get("ai.onnx") if domain == "" else None)
    try:
        schema = onnx.defs.get_schema(node.op_type, version or onnx.defs.onnx_opset_version(), domain)
    except onnx.defs.SchemaError:
        raise _unknown(node, output, "ONNX has no schema for it to infer one") from None
    proto = ir.serde.serialize_node(node)
    del proto.input[:]
    del proto.output[:]
    proto.input.extend(f"i{k}" if v is not None else "" for k, v in enumerate(node.inputs))
    proto.output.extend(f"o{k}" for k in range(len(node.outputs)))
    types: dict[str, onnx.TypeProto] = {}
    data: dict[str, onnx.TensorProto] = {}
    names: dict[str, Affine] = {}  # the dimension names given: any other is ONNX's own, fresh
    for k, value in enumerate(node.inputs):
        if value is None:
            continue
        kind = onnx.TypeProto()
        tensor = kind.tensor_type
        dtype = ev.dtype(value)
        tensor.elem_type = dtype.value if dtype is not None else 0
        try:
            dims = ev.shape(value)
        except Unprovable as reason:
            if reason.kind in _FIRST:  # where the shape was lost first (or a malformed node): the reason
                raise reason.again() from None
            dims = None
        if dims is not None:
            tensor.shape.SetInParent()
            for dim in dims:
                entry = tensor.shape.dim.add()
                if dim.is_const:
                    entry.dim_value = dim.const
                else:
                    entry.dim_param = str(dim)
                    names[entry.dim_param] = dim
        types[f"i{k}"] = kind
        array = _known_array(ev, value, dtype)
        if array is not None:
            data[f"i{k}"] = onnx.numpy_helper.from_array(array, f"i{k}")
    imports = [onnx.helper.make_opsetid(d or "", v) for d, v in opsets.items()]
    try:
        inferred = onnx.shape_inference.infer_node_outputs(schema, proto, types, data, opset_imports=imports)
    except Exception as error:  # ONNX's inference refuses the node as it is: say so
        raise _unknown(
            node, output, f"ONNX's shape inference of it fails ({type(error).__name__}: {error})"
        ) from None
    found = inferred.get(f"o{output}")
    if found is None or not found.tensor_type.HasField("shape"):
        raise _unknown(node, output, "ONNX's shape inference of it gives no shape")
    out: list[Affine] = []
    for entry in found.tensor_type.shape.dim:
        if entry.HasField("dim_value"):
            out.append(Affine(const=int(entry.dim_value)))
        elif entry.HasField("dim_param") and entry.dim_param in names:
            out.append(names[entry.dim_param])
        else:  # unknown, or a name ONNX made up for this node: equal to nothing else
            out.append(Affine.of(ev.fresh()))
    elem_type = found.tensor_type.elem_type
    return tuple(out), ir.DataType(elem_type) if elem_type else None


def _known_array(ev: Evaluator, value: ir.Value, dtype: ir.DataType | None) -> np.ndarray | None:
    """A small constant input, or an integer vector whose values the evaluator knows exactly."""
    array = constant_array(value)
    if array is not None:
        return array
    try:
        tensor = ev.eval(value)
    except Unprovable:
        return None
    if tensor.values is None or dtype is None or not all(v.is_const for v in (*tensor.values, *tensor.shape)):
        return None
    return np.array([v.const for v in tensor.values], dtype=dtype.numpy()).reshape(
        [d.const for d in tensor.shape]
    )
