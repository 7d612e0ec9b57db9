"""What the evaluator's rules read of the model's opset: the forms an operator takes in each version.

The same operator reads its parameters differently across the default domain's opsets 12..24:
``axes`` of ``Squeeze``, ``Unsqueeze`` and ``ReduceSum`` became an input at opset 13 (the other
reductions' at 18), ``Split``'s sizes an input at 13 (and ``num_outputs`` came at 18),
``Shape``'s ``start``/``end`` came at 15, and ``Softmax`` (``LogSoftmax``, ``Hardmax``) before
opset 13 flattens its input to 2-D at ``axis`` (default 1: one softmax over every axis but the
first) where from 13 it normalizes along ``axis`` alone (default -1). A rule reads such a
parameter through this module, from the opset of the node's own graph (a function's, in a
function): the form the version defines, or a refusal (a parameter given in the form the
version does not define: the model is malformed for that opset; no opset imported: nothing to
read). The tables are the facts; :func:`moved`, :func:`attribute` and :func:`softmax_axis` read
them.
"""

from __future__ import annotations

__all__ = [
    "ADDED",
    "MOVED",
    "PER_AXIS_SINCE",
    "Moved",
    "attribute",
    "moved",
    "opset",
    "softmax_axis",
]

import dataclasses
from typing import TYPE_CHECKING

import onnx_ir as ir

from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode
from onnx_kvcache.passes.fusion._symbolic_values import Unprovable

if TYPE_CHECKING:
    from onnx_kvcache.passes.fusion._symbolic_values import Evaluator


@dataclasses.dataclass(frozen=True)
class Moved:
    """A parameter that was an attribute before opset ``since`` and is input ``input`` from it."""

    name: str
    input: int
    since: int


#: Operator -> its parameter that moved from an attribute to an input (the default domain).
MOVED: dict[str, Moved] = {
    "Squeeze": Moved("axes", 1, 13),
    "Unsqueeze": Moved("axes", 1, 13),
    "ReduceSum": Moved("axes", 1, 13),
    "Split": Moved("split", 1, 13),
}
_REDUCE_18 = (
    "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare",
)  # fmt: skip
MOVED |= {op: Moved("axes", 1, 18) for op in _REDUCE_18}

#: (operator, attribute) -> the opset that added it (before it, the attribute is not the operator's).
ADDED: dict[tuple[str, str], int] = {
    ("Shape", "start"): 15,
    ("Shape", "end"): 15,
    ("Split", "num_outputs"): 18,
    ("ReduceSum", "noop_with_empty_axes"): 13,
    **{(op, "noop_with_empty_axes"): 18 for op in _REDUCE_18},
}

#: Operator -> the opset from which it normalizes along ``axis`` alone (default -1); before it,
#: over the input flattened to 2-D at ``axis`` (default 1).
PER_AXIS_SINCE: dict[str, int] = {"Softmax": 13, "LogSoftmax": 13, "Hardmax": 13}

_BEFORE_DEFAULT_AXIS = 1
"""``axis`` of a coerced (2-D) softmax when not given."""

_MALFORMED = FusionRefusalCode.MALFORMED


def opset(node: ir.Node) -> int | None:
    """The default domain's opset of the graph (or function) holding ``node``; None: not imported."""
    graph = node.graph
    if graph is None:
        return None
    imports = graph.opset_imports
    version = imports.get("", imports.get("ai.onnx"))
    return None if version is None else int(version)


def _version(node: ir.Node, why: str) -> int:
    version = opset(node)
    if version is None:
        raise Unprovable(
            f"{node.op_type} node {node.name!r}: the model imports no opset for the default domain, so "
            f"{why} is not defined",
            kind=_MALFORMED,
        )
    return version


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


def moved(ev: Evaluator, node: ir.Node) -> list[int] | None:
    """The constant integers of ``node``'s moved parameter (:data:`MOVED`: ``axes``, ``split``) in
    the form the model's opset defines; None where it is not given. A parameter given in the
    other form (an ``axes`` attribute at opset 13, an axes input at 12) is refused as malformed:
    onnxruntime does not load such a node."""
    row = MOVED[node.op_type]
    version = _version(node, f"where its {row.name} are")
    attr = node.attributes.get(row.name)
    given = _input(node, row.input)
    if version >= row.since:
        if attr is not None:
            raise Unprovable(
                f"{node.op_type} node {node.name!r} has an attribute {row.name!r}, which opset {version} "
                f"reads as input {row.input} (an attribute before opset {row.since})",
                kind=_MALFORMED,
            )
        return ev.const_ints(given, f"{row.name} of {node.name}")
    if given is not None:
        raise Unprovable(
            f"{node.op_type} node {node.name!r} has its {row.name} as an input, which opset {version} "
            f"reads as an attribute (an input from opset {row.since})",
            kind=_MALFORMED,
        )
    return None if attr is None else [int(x) for x in attr.as_ints()]


def attribute(node: ir.Node, name: str, default: int) -> int:
    """``node``'s integer attribute ``name`` (``default`` when not given), refused as malformed
    where the model's opset predates it (:data:`ADDED`)."""
    attr = node.attributes.get(name)
    if attr is None:
        return default
    since = ADDED.get((node.op_type, name))
    if since is not None:
        version = _version(node, f"its {name!r} attribute")
        if version < since:
            raise Unprovable(
                f"{node.op_type} node {node.name!r} has an attribute {name!r}, which opset {version} does "
                f"not define (from opset {since})",
                kind=_MALFORMED,
            )
    return int(attr.as_int())


def softmax_axis(node: ir.Node, rank: int) -> int | None:
    """The one axis along which ``node`` (a Softmax, LogSoftmax or Hardmax of a ``rank``-D input)
    normalizes each slice alone, as the model's opset computes it; None where it normalizes over
    several axes at once (before opset 13: flattened at ``axis``, default 1)."""
    version = _version(node, "its default axis")
    attr = node.attributes.get("axis")
    since = PER_AXIS_SINCE[node.op_type]
    at = int(attr.as_int()) if attr is not None else (-1 if version >= since else _BEFORE_DEFAULT_AXIS)
    at = at + rank if at < 0 else at
    if not 0 <= at < rank:
        raise Unprovable(
            f"{node.op_type} node {node.name!r} normalizes axis {at} of a {rank}-D tensor", kind=_MALFORMED
        )
    if version >= since or at == rank - 1:  # flattened at the last axis: each row alone
        return at
    return None
