"""The scale tensors a KV-cache conversion writes: initializers of the main graph, Constants
of a function.

A new scale takes a name no value of the graph has; a constant scale read only by attention
scale slots is updated in place and keeps its name (onnxruntime-genai's
``model.layers.{i}.attn.k_scale``); a replaced scale nothing reads any more is removed
(:mod:`.kv_cache_quantization`, rules 3 and 5).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.operators import CacheSide, op_of
from onnx_kvcache.cache.sites import CacheSite
from onnx_kvcache.model_io.reading import tensor_values
from onnx_kvcache.passes._graph import prepend


class _ScaleStore:
    """Creates, updates and retires scale tensors (initializers or function Constants)."""

    def __init__(self, model: ir.Model) -> None:
        self.model = model
        self.modified = False
        self._retired: list[ir.Value] = []
        self._taken = {v.name for v in _graph_values(model.graph) if v.name}
        """Every value name of the main graph: a new scale takes none of them."""

    def put(self, site: CacheSite, name: str, array: np.ndarray, shape: tuple[int, ...]) -> ir.Value:
        array = np.asarray(array, np.float32).reshape(shape)
        if site.function is not None:
            return self._put_constant(site.function, name, array)
        graph = self.model.graph
        existing = graph.initializers.get(name)
        if existing is not None and existing.dtype == ir.DataType.FLOAT and _only_scale_uses(existing):
            old = existing.const_value
            if old is None or not np.array_equal(tensor_values(old), array):
                existing.const_value = ir.tensor(array, name=name)
                existing.shape = ir.Shape(array.shape)
                self.modified = True
            return existing
        if existing is not None or name in self._taken:
            name = _unique_name(self._taken, name)
        self._taken.add(name)
        value = ir.Value(
            name=name,
            shape=ir.Shape(array.shape),
            type=ir.TensorType(ir.DataType.FLOAT),
            const_value=ir.tensor(array, name=name),
        )
        graph.register_initializer(value)
        self.modified = True
        return value

    def _put_constant(self, function: ir.Function, name: str, array: np.ndarray) -> ir.Value:
        for node in function:
            if node.op_type == "Constant" and node.outputs[0].name == name:
                attr = node.attributes["value"]
                if not np.array_equal(attr.value.numpy(), array):
                    node.attributes["value"] = ir.AttrTensor("value", ir.tensor(array))
                    node.outputs[0].const_value = None
                    self.modified = True
                return node.outputs[0]
        output = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.FLOAT))
        constant = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(array))], outputs=[output])
        prepend(function, constant)
        self.modified = True
        return output

    def retire(self, value: ir.Value | None) -> None:
        if value is not None:
            self._retired.append(value)

    def remove_unused(self) -> bool:
        """Drop replaced scale tensors that nothing reads any more."""
        removed = False
        for value in self._retired:
            if value.uses():
                continue
            graph = value.graph
            if value.is_initializer() and graph is not None and not value.is_graph_output():
                graph.initializers.pop(value.name, None)  # type: ignore[arg-type]
                removed = True
            elif value.is_graph_input() and graph is self.model.graph and not value.is_graph_output():
                graph.inputs.remove(value)  # a scale fed at run time, replaced by a constant
                removed = True
            producer = value.producer()
            if producer is not None and producer.op_type == "Constant" and producer.graph:
                producer.graph.remove(producer, safe=True)
                removed = True
        self._retired.clear()
        return removed


def _own_scale_name(site: CacheSite, side: CacheSide) -> str | None:
    """The name of the main-graph initializer feeding ``side``'s scale when only that side's
    scale slots read it: replaced in place, it keeps its name (genai's builder and
    ``KVCacheVariant`` name them ``model.layers.{i}.attn.k_scale``)."""
    value = site.input(side.scale)
    if value is None or site.function is not None or not value.is_initializer() or not value.name:
        return None
    slot = site.op.slot(side.scale)
    if value.is_graph_output() or any(op_of(node) is not site.op or i != slot for node, i in value.uses()):
        return None
    return value.name


def _only_scale_uses(value: ir.Value) -> bool:
    """Whether ``value`` is read only as an attention node's k/v scale (ours to update)."""
    if value.is_graph_output():
        return False
    for node, slot in value.uses():
        op = op_of(node)
        if op is None or slot not in op.scale_slots:
            return False
    return True


def _unique_name(taken: set[str], name: str) -> str:
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"


def _graph_values(graph: ir.Graph) -> Iterator[ir.Value]:
    """Graph inputs, initializers and every node output of ``graph`` and its subgraphs."""
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in ir.traversal.RecursiveGraphIterator(graph):
        yield from node.outputs
