"""Attention that no fusion takes for one: softmaxes over scores read from a KV cache input.

A fusion refuses only its own candidates; an attention written in a form none of them
recognizes as a candidate (an operator between the softmax and its MatMul with V) would
otherwise leave no refusal at all, and a conversion would say it found no attention.
:func:`unknown_attentions` finds them: each main-graph ``Softmax`` whose scores come, through
at most one ``MatMul`` (the scores' ``Q @ K^T``) and at most :data:`_REACH` values, from a KV
cache input (a 4-D graph input that a ``Concat`` appends to), and that no refusal already
covers, is refused as :attr:`~onnx_kvcache.passes.fusion._refusals.FusionRefusalCode.UNKNOWN_ATTENTION`
naming the softmax, the cache and what reads its probabilities. An MoE router's softmax reads
hidden states, which reach a cache only through a second ``MatMul`` (attention's output
projection): it is not one.
"""

from __future__ import annotations

__all__ = ["unknown_attentions"]

from collections.abc import Iterable

import onnx_ir as ir

from onnx_kvcache.passes.fusion._base import FusionRefusal
from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode

_REACH = 400
"""Values looked at above a softmax for its cache."""
_MATMULS = frozenset({"MatMul", "Gemm", "MatMulInteger", "MatMulNBits", "Einsum"})
_PASS = frozenset({"Cast", "Dropout", "Where", "Identity", "IsNaN", "Slice"})
"""What may stand between a softmax and what reads its probabilities (named past them; a Slice:
an attention sink's column cut off, which the decomposed fusion refuses itself)."""


def _caches(graph: ir.Graph) -> set[ir.Value]:
    """The graph's 4-D inputs that a Concat appends to (maybe through Identity or Slice)."""
    found = set()
    for value in graph.inputs:
        if value.shape is not None and len(value.shape) != 4:
            continue
        work, seen = [value], 0
        while work and seen < 8:
            seen += 1
            for user, _ in work.pop().uses():
                if user.op_type == "Concat":
                    found.add(value)
                elif user.op_type in ("Identity", "Slice"):
                    work.extend(user.outputs)
    return found


def _cache_read(softmax: ir.Node, caches: set[ir.Value]) -> ir.Value | None:
    """The cache input the softmax's scores are read from, through at most one MatMul."""
    work: list[tuple[ir.Value | None, int]] = [(softmax.inputs[0] if softmax.inputs else None, 0)]
    seen: set[ir.Value] = set()
    while work and len(seen) < _REACH:
        value, matmuls = work.pop(0)
        if value is None or value in seen:
            continue
        seen.add(value)
        if value in caches:
            return value
        node = value.producer()
        if node is None or node.op_type in ("Constant", "Shape", "ConstantOfShape"):
            continue
        passed = matmuls + (node.op_type in _MATMULS)
        if passed > 1:
            continue
        work.extend((v, passed) for v in node.inputs)
    return None


def _readers(value: ir.Value) -> list[ir.Node]:
    """What reads ``value``, past casts, dropouts and NaN guards."""
    out: list[ir.Node] = []
    work = [value]
    for _ in range(4):
        nxt: list[ir.Value] = []
        for v in work:
            for user, _ in v.uses():
                if user.op_type in _PASS:
                    nxt.extend(user.outputs)
                else:
                    out.append(user)
        work = nxt
    return out


def unknown_attentions(model: ir.Model, refusals: Iterable[FusionRefusal]) -> list[FusionRefusal]:
    """A refusal for each attention no fusion took for one (see the module docstring)."""
    graph = model.graph
    softmaxes = [n for n in graph if n.op_type == "Softmax" and n.domain in ("", "ai.onnx")]
    if not softmaxes:
        return []
    caches = _caches(graph)
    if not caches:
        return []
    refused = {id(r.node) for r in refusals}
    found = []
    for softmax in softmaxes:
        readers = _readers(softmax.outputs[0])
        if any(id(r) in refused for r in readers):
            continue
        cache = _cache_read(softmax, caches)
        if cache is None:
            continue
        read = ", ".join(f"{r.op_type} node {r.name!r}" for r in readers[:2]) or "no node (unread)"
        found.append(
            FusionRefusal(
                FusionRefusalCode.UNKNOWN_ATTENTION,
                softmax,
                f"Softmax node {softmax.name!r} is an attention over the cache {cache.name!r} that no "
                f"fusion takes: its probabilities are read by {read}, not by the MatMul with V of "
                "MatMul(softmax(scale * Q @ K^T + mask), V)",
                rule="unknown_attention",
            )
        )
    return found
