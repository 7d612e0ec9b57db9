"""Graph surgery on the producers' files for the fusion tests: an operator inserted after a value,
a constant changed, an attribute set, a node moved into a function or a subgraph.

Each helper changes a loaded :class:`ir.Model` in place and returns what it made, so a test
states the one thing it changed in a real producer's file.
"""

from __future__ import annotations

import pathlib

import numpy as np
import onnx_ir as ir

PRODUCERS = pathlib.Path(__file__).parents[2] / "data" / "producers"


def load(path: str) -> ir.Model:
    """A producer's file by its manifest path (``optimum/optimum-cli/llama``)."""
    return ir.load(PRODUCERS / path / "model.onnx")


def value(model: ir.Model, name: str) -> ir.Value:
    for v in model.graph.inputs:
        if v.name == name:
            return v
    for node in model.graph:
        for out in node.outputs:
            if out.name == name:
                return out
    raise KeyError(name)


def node(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if n.name == name)


def first(model: ir.Model, op_type: str, contains: str = "") -> ir.Node:
    return next(n for n in model.graph if n.op_type == op_type and contains in (n.name or ""))


def constant(model: ir.Model, array: np.ndarray, name: str) -> ir.Value:
    """A new initializer."""
    out = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    model.graph.register_initializer(out)
    return out


def insert_after(
    model: ir.Model,
    target: ir.Value,
    op_type: str,
    extra: tuple[ir.Value, ...] = (),
    *,
    domain: str = "",
    name: str | None = None,
    outputs: int = 1,
    **attributes,
) -> ir.Node:
    """``op_type(target, *extra)`` inserted after ``target``'s producer; every reader of ``target``
    (but the new node) reads its first output instead."""
    readers = list(target.uses())
    made = ir.node(
        op_type,
        [target, *extra],
        attributes or None,
        domain=domain,
        name=name or f"/inserted/{op_type}",
        num_outputs=outputs,
    )
    for k, out in enumerate(made.outputs):
        out.name = f"{made.name}_output_{k}"
    producer = target.producer()
    if producer is not None:
        model.graph.insert_after(producer, made)
    else:
        model.graph.insert_before(next(iter(model.graph)), made)
    for user, slot in readers:
        user.replace_input_with(slot, made.outputs[0])
    if target.is_graph_output():
        index = list(model.graph.outputs).index(target)
        model.graph.outputs[index] = made.outputs[0]
    if domain and domain not in model.opset_imports:
        model.opset_imports[domain] = 1
    return made


def set_constant(model: ir.Model, value: ir.Value, array: np.ndarray) -> None:
    """The constant ``value`` (an initializer or a Constant node's output) now holds ``array``."""
    producer = value.producer()
    tensor = ir.tensor(array, name=value.name)
    if producer is not None and producer.op_type == "Constant":
        producer.attributes["value"] = ir.Attr("value", ir.AttributeType.TENSOR, tensor)
    else:
        value.const_value = tensor


def into_function(model: ir.Model, target: ir.Node) -> ir.Node:
    """``target`` moved into a model-local function, called in its place."""
    inputs = [ir.Value(name=f"in_{k}", type=v.type, shape=v.shape) for k, v in enumerate(target.inputs) if v]
    moved = ir.node(
        target.op_type,
        inputs,
        {k: a.value for k, a in target.attributes.items()},
        domain=target.domain,
        num_outputs=len(target.outputs),
        name=target.name,
    )
    graph = ir.Graph(inputs, list(moved.outputs), nodes=[moved], opset_imports=dict(model.opset_imports))
    function = ir.Function("local", "moved_attention", graph=graph, attributes=[])
    model.functions[function.identifier()] = function
    call = ir.node(
        "moved_attention",
        [v for v in target.inputs if v is not None],
        domain="local",
        num_outputs=len(target.outputs),
        name=f"{target.name}/call",
    )
    model.graph.insert_before(target, call)
    for old, new in zip(target.outputs, call.outputs):
        new.name, new.type, new.shape = old.name, old.type, old.shape
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    model.graph.remove(target, safe=True)
    model.opset_imports["local"] = 1
    return call


def into_subgraph(model: ir.Model, target: ir.Node, condition: ir.Value) -> ir.Node:
    """``target`` moved into both branches of an ``If(condition)`` (reading the outer values)."""

    def branch(tag: str) -> ir.Graph:
        copy = ir.node(
            target.op_type,
            list(target.inputs),
            {k: a.value for k, a in target.attributes.items()},
            domain=target.domain,
            num_outputs=len(target.outputs),
            name=f"{target.name}/{tag}",
        )
        for k, out in enumerate(copy.outputs):
            out.name = f"{copy.name}_output_{k}"
            out.type, out.shape = target.outputs[k].type, target.outputs[k].shape
        return ir.Graph([], list(copy.outputs), nodes=[copy], name=tag)

    made = ir.node(
        "If",
        [condition],
        {"then_branch": branch("then"), "else_branch": branch("else")},
        num_outputs=len(target.outputs),
        name=f"{target.name}/If",
    )
    model.graph.insert_before(target, made)
    for old, new in zip(target.outputs, made.outputs):
        new.name, new.type, new.shape = f"{old.name}/if", old.type, old.shape
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    model.graph.remove(target, safe=True)
    return made
