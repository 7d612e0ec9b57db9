"""Compute a bfloat16 model in float32, so that it runs on onnxruntime's CPU provider.

The CPU provider has no bfloat16 MatMul or GroupQueryAttention, while FP8 caches are mostly
used with bf16 models: calibrating and evaluating them on a CPU needs this pass. Rules, in
the main graph, its subgraphs and the model's functions:

1. Every value declared bfloat16 (graph inputs and outputs included) is declared float32;
   shapes are kept.
2. A bfloat16 initializer keeps its stored tensor (weights are not read here); its readers
   get ``Cast(to=FLOAT)`` of it instead, which onnxruntime folds once at session creation;
   one read only through such Casts is left as it is (a second run changes nothing).
3. ``Cast``/``CastLike`` and any ``to``/``dtype`` attribute naming bfloat16 name float32;
   bfloat16 tensor attributes (``Constant``, ``ConstantOfShape``) are converted.

Results differ from a bf16 run by bf16 rounding of activations (float32 is more precise).
"""

from __future__ import annotations

__all__ = ["Bfloat16ToFloatPass"]

import numpy as np
import onnx_ir as ir

from onnx_kvcache.model_io.reading import tensor_values
from onnx_kvcache.passes._base import InPlacePass
from onnx_kvcache.passes._graph import prepend

_BF16 = ir.DataType.BFLOAT16
_F32 = ir.DataType.FLOAT
_DTYPE_ATTRS = ("to", "dtype")


def _graphs(model: ir.Model) -> list[ir.Graph | ir.Function]:
    graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
    for graph in list(graphs):
        for node in ir.traversal.RecursiveGraphIterator(graph):
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    graphs.append(attr.value)
                elif attr.type == ir.AttributeType.GRAPHS:
                    graphs.extend(attr.value)
    return list({id(g): g for g in graphs}.values())


def _retype(value: ir.Value | None) -> bool:
    if value is None or value.dtype != _BF16:
        return False
    value.type = ir.TensorType(_F32)
    return True


def _float_tensor(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    return ir.tensor(np.asarray(tensor_values(tensor), np.float32), name=tensor.name)


def _fix_attributes(node: ir.Node) -> bool:
    modified = False
    for name, attr in list(node.attributes.items()):
        if name in _DTYPE_ATTRS and attr.type == ir.AttributeType.INT and attr.value == _BF16:
            node.attributes[name] = ir.AttrInt64(name, _F32)
            modified = True
        elif attr.type == ir.AttributeType.TENSOR and attr.value.dtype == _BF16:
            node.attributes[name] = ir.AttrTensor(name, _float_tensor(attr.value))
            modified = True
    return modified


def _reads_as_float(node: ir.Node) -> bool:
    to = node.attributes.get("to")
    return node.op_type == "Cast" and node.domain in ("", "ai.onnx") and to is not None and to.value == _F32


def _cast_initializer(graph: ir.Graph, value: ir.Value) -> bool:
    """Readers of a bf16 initializer read ``Cast(to=FLOAT)`` of it; the tensor stays. An
    initializer read only through such Casts already is left alone (the pass ran before)."""
    uses = list(value.uses())
    if not uses or value.is_graph_output() or all(_reads_as_float(user) for user, _ in uses):
        return False
    cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", _F32)], name=f"{value.name}/to_float32")
    cast.outputs[0].name = f"{value.name}/float32"
    cast.outputs[0].type = ir.TensorType(_F32)
    cast.outputs[0].shape = value.shape
    prepend(graph, cast)
    for user, slot in uses:
        user.replace_input_with(slot, cast.outputs[0])
    return True


class Bfloat16ToFloatPass(InPlacePass):
    """Declare and compute every bfloat16 tensor as float32; see the module docstring."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for graph in _graphs(model):
            if isinstance(graph, ir.Graph):
                for value in list(graph.initializers.values()):
                    if value.dtype == _BF16:
                        modified |= _cast_initializer(graph, value)
            for value in graph.inputs:
                modified |= _retype(value)
            for node in graph:
                modified |= _fix_attributes(node)
                for output in node.outputs:
                    modified |= _retype(output)
                    if output.const_value is not None and output.const_value.dtype == _BF16:
                        output.const_value = _float_tensor(output.const_value)
            for value in graph.outputs:
                if not value.is_initializer():
                    modified |= _retype(value)
        return ir.passes.PassResult(model, modified=modified)
