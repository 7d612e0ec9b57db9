"""A quantized attention node wrapped so that its multi-token calls run through the float kernel.

:class:`~onnx_kvcache.passes.PromptFloatAttentionPass` writes, per
quantized GroupQueryAttention node, an ``If`` on the query's length: its ``then_branch``
attends through the float kernel (past dequantized, present requantized), its
``else_branch`` is the quantized node itself, reading the outer graph's values. This module
recognizes that form and undoes it.

Rules:

* A *wrapper* is an ``If`` whose ``else_branch`` holds exactly one node, an attention node
  with a quantized cache whose outputs are the branch's outputs in order, and whose
  ``then_branch`` holds exactly one node of the same operator. Nothing else is a wrapper
  (an export's own ``If`` is left alone).
* The wrapped node is the attention site (:func:`~onnx_kvcache.cache.sites.find_attention_sites`
  reports it, with the wrapper's outputs as its presents); the ``then_branch`` node is never a site.
* :func:`unwrap` puts each wrapped node back in the wrapper's place, under the wrapper's
  output names, and removes the wrapper and the nodes that only computed its condition: what
  the passes that rewrite attention nodes start from (quantizing again, rotating, emulating).
"""

from __future__ import annotations

__all__ = ["WRAPPED_SUFFIX", "float_branch", "unwrap", "wrapped_node", "wrappers"]

import onnx_ir as ir

from onnx_kvcache.cache.operators import op_of

#: The suffix a wrapped node's outputs carry inside the ``else_branch`` (the wrapper's outputs
#: keep the names the model's caller sees).
WRAPPED_SUFFIX = "/quantized"


def _branch(node: ir.Node, name: str) -> ir.Graph | None:
    attr = node.attributes.get(name)
    return attr.value if attr is not None and attr.type == ir.AttributeType.GRAPH else None


def wrapped_node(node: ir.Node) -> ir.Node | None:
    """The quantized attention node ``node`` wraps, when ``node`` is a wrapper (module rules)."""
    if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
        return None
    then, other = _branch(node, "then_branch"), _branch(node, "else_branch")
    if then is None or other is None or len(other) != 1 or len(then) < 1:
        return None
    inner = other.node(0)
    row = op_of(inner)
    if row is None or list(other.outputs) != list(inner.outputs)[: len(other.outputs)]:
        return None
    quant = inner.attributes.get(row.key.quant_attr)
    if quant is None or quant.as_string() == "NONE" or len(node.outputs) != len(other.outputs):
        return None
    if sum(1 for n in then if op_of(n) is row) != 1:
        return None
    return inner


def float_branch(wrapper: ir.Node) -> list[ir.Node]:
    """The nodes of a wrapper's ``then_branch`` (they read the wrapped node's pasts; unwrapping
    removes them)."""
    then = _branch(wrapper, "then_branch")
    return list(then) if then is not None else []


def wrappers(graph: ir.Graph | ir.Function) -> list[tuple[ir.Node, ir.Node]]:
    """``(wrapper, wrapped node)`` for every wrapper directly in ``graph``."""
    found = []
    for node in graph:
        inner = wrapped_node(node)
        if inner is not None:
            found.append((node, inner))
    return found


def _condition_nodes(wrapper: ir.Node) -> list[ir.Node]:
    """The nodes upstream of the wrapper's condition used by nothing else, nearest first."""
    dead: list[ir.Node] = []
    seen: set[int] = {id(wrapper)}
    frontier = [wrapper.inputs[0]] if wrapper.inputs and wrapper.inputs[0] is not None else []
    while frontier:
        value = frontier.pop()
        producer = value.producer() if value is not None else None
        if producer is None or id(producer) in seen or value.is_graph_output():
            continue
        if any(id(user) not in seen for user, _ in value.uses()):
            continue
        if any(
            any(id(u) not in seen for u, _ in out.uses()) or out.is_graph_output() for out in producer.outputs
        ):
            continue
        seen.add(id(producer))
        dead.append(producer)
        frontier.extend(v for v in producer.inputs if v is not None)
    return dead


def unwrap(model: ir.Model) -> int:
    """Put every wrapped node of ``model`` (main graph and functions) back in its wrapper's
    place (module rules); how many. ``model`` is changed in place."""
    count = 0
    graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
    for graph in graphs:
        for wrapper, inner in wrappers(graph):
            _unwrap_one(graph, wrapper, inner)
            count += 1
    return count


def _unwrap_one(graph: ir.Graph | ir.Function, wrapper: ir.Node, inner: ir.Node) -> None:
    other, then = _branch(wrapper, "else_branch"), _branch(wrapper, "then_branch")
    assert other is not None and then is not None
    dead = _condition_nodes(wrapper)
    then.outputs.clear()
    for node in then:  # no longer a reader of the pasts and scales
        for index in range(len(node.inputs)):
            node.replace_input_with(index, None)
    then.remove(list(then), safe=False)
    other.outputs.clear()
    other.remove(inner, safe=False)
    graph.insert_before(wrapper, inner)
    names = [out.name for out in wrapper.outputs]
    ir.convenience.replace_all_uses_with(
        list(wrapper.outputs), list(inner.outputs)[: len(names)], replace_graph_outputs=True
    )
    for out, name in zip(inner.outputs, names):
        out.name = name
    graph.remove([wrapper, *dead], safe=True)
