"""Attention sinks (gpt-oss): one learned logit per head beside the scores, in the softmax only.

transformers' gpt-oss attention (``eager_attention_forward``), as torch.onnx.export (dynamo or
TorchScript, optimum-cli) writes it::

    sinks    = Expand(Reshape(s, [1, N, 1, 1]), [B, N, S, 1])        s: N constants
    combined = Concat(scores + mask, sinks, axis=-1)                   [B, N, S, K + 1]
    probs    = Softmax(combined - ReduceMax(combined, -1, keepdims))   (the shift is optional)
    Y        = MatMul(probs[..., :K], V)                               the sink column dropped

which is GroupQueryAttention's ``head_sink`` (input 11): ``p_j = exp(x_j) / (exp(s_h) +
sum_k exp(x_k))`` over the scaled (and soft-capped) scores ``x`` of head ``h``, the sink
joining the softmax as it is (onnxruntime's kernels neither scale nor cap it). The rules:

- the attention reads a ``Slice`` of the softmax's last axis from 0 that keeps exactly the
  scores' ``K`` columns (through the Casts, Dropout and NaN guard the probabilities may take);
- the softmax's input is ``Concat(x, c)`` on the last axis, or that minus its own
  ``ReduceMax`` over the last axis with ``keepdims`` (a shift of every logit of a row by one
  value, which softmax cancels);
- ``c`` is ``[B, N, S, 1]`` (its other axes those of ``x``), and its element at head ``h`` is
  the constant ``s[h]``: an ``Expand`` of a constant (a 1-D initializer of ``N`` values or one,
  through ``Reshape``/``Unsqueeze``/``Cast``/``Identity``) whose only non-1 axis is the head axis.

What does not hold is refused (:class:`~onnx_kvcache.passes.fusion._symbolic.Unprovable`) with
the rule's reason; a softmax without a Concat is no sink and left to the other rules.
"""

from __future__ import annotations

__all__ = ["Sink", "sink_of", "sink_site"]

import dataclasses

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes._graph import op_of
from onnx_kvcache.passes.fusion import _opsets as opsets
from onnx_kvcache.passes.fusion._piecewise import equal
from onnx_kvcache.passes.fusion._scores import unwrap_probs
from onnx_kvcache.passes.fusion._symbolic import ONE, ZERO, Affine, SymbolicEvaluator, Unprovable

_MAX_SINKS = 4096
"""Constants read at most (one per query head)."""


@dataclasses.dataclass(frozen=True)
class Sink:
    """A softmax with a sink column: the softmax node, the scores beside the sink, the values."""

    softmax: ir.Node
    scores: ir.Value
    """The softmax's logits without the sink column (``scores + mask``)."""
    values: np.ndarray
    """``s[h]`` per query head (float32), or one value for every head."""


def sink_site(ev: SymbolicEvaluator, probs: ir.Value | None, nodes: list[ir.Node]) -> Sink | None:
    """The sink around the softmax whose probabilities ``probs`` are (a Slice of), or None
    when they are not a Slice of a softmax's last axis (no sink: the other rules decide)."""
    cut = op_of(probs, "Slice")
    if cut is None:
        return None
    before: list[ir.Node] = []
    softmax = op_of(unwrap_probs(ev, cut.inputs[0], before), "Softmax")
    if softmax is None:
        return None
    found = sink_of(ev, softmax)
    if found is None:
        raise Unprovable("the attention reads a Slice of softmax probabilities that hold no sink column")
    _check_cut(ev, cut, found.scores)
    nodes += [cut, *before]
    return found


def _check_cut(ev: SymbolicEvaluator, cut: ir.Node, scores: ir.Value) -> None:
    """``cut`` keeps columns ``[0, K)`` of the last axis, ``K`` the scores' key columns."""
    starts = ev.values(cut.inputs[1], "the sink Slice's starts")
    axes = ev.const_ints(cut.inputs[3] if len(cut.inputs) > 3 else None, "the sink Slice's axes")
    steps = ev.const_ints(cut.inputs[4] if len(cut.inputs) > 4 else None, "the sink Slice's steps")
    rank = len(ev.shape(scores))
    kept, wanted = ev.shape(cut.outputs[0]), ev.shape(scores)
    if (
        len(starts) != 1
        or starts[0] != ZERO
        or axes not in ([rank - 1], [-1])
        or steps not in (None, [1])
        or len(kept) != rank
        or not all(equal(a, b) for a, b in zip(kept, wanted))
    ):
        raise Unprovable(
            "the attention reads a Slice of the softmax that is not its first K columns (the "
            "scores without the sink column)"
        )


def sink_of(ev: SymbolicEvaluator, softmax: ir.Node) -> Sink | None:
    """The sink of ``softmax`` (see the module), None when its input is no Concat; raise
    :class:`Unprovable` when a Concat is there but the rules do not hold."""
    logits = softmax.inputs[0]
    shift = op_of(logits, "Sub")
    if shift is not None:
        peak = op_of(shift.inputs[1], "ReduceMax")
        if peak is None or peak.inputs[0] is not shift.inputs[0] or not _last_axis_max(ev, peak):
            return None
        logits = shift.inputs[0]
    concat = op_of(logits, "Concat")
    if concat is None or len(concat.inputs) != 2:
        return None
    rank = len(ev.shape(concat.outputs[0]))
    axis = concat.attributes["axis"].as_int()
    if axis not in (-1, rank - 1):
        raise Unprovable("the softmax reads a Concat that is not on the scores' last axis")
    scores, column = concat.inputs
    assert scores is not None and column is not None
    dims, sink_dims = ev.shape(scores), ev.shape(column)
    if len(dims) != 4 or len(sink_dims) != 4 or sink_dims[3] != ONE:
        raise Unprovable("the Concat beside the scores is not one column per query row (a sink)")
    if not all(equal(a, b) for a, b in zip(dims[:3], sink_dims[:3])):
        raise Unprovable("the sink column's batch, head and query axes are not the scores'")
    values = _per_head(ev, column, dims[1])
    return Sink(softmax, scores, values)


def _last_axis_max(ev: SymbolicEvaluator, node: ir.Node) -> bool:
    keep = node.attributes.get("keepdims")
    if keep is not None and keep.as_int() != 1:
        return False
    axes = opsets.moved(ev, node)
    rank = len(ev.shape(node.inputs[0]))
    return axes in ([-1], [rank - 1])


def _per_head(ev: SymbolicEvaluator, column: ir.Value, heads: Affine) -> np.ndarray:
    """``s[h]``: the constant the sink column holds at head ``h`` (see the module)."""
    expand = op_of(column, "Expand")
    base = expand.inputs[0] if expand is not None else column
    array = _constant(ev, base)
    if array is None:
        producer = base.producer() if base is not None else None
        what = producer.op_type if producer is not None else "a graph input"
        raise Unprovable(f"the sink column is not a constant per head (it is computed by {what})")
    if array.ndim > 4:
        raise Unprovable("the sink constant has more than 4 axes")
    dims: tuple[int, ...] = (1,) * (4 - array.ndim) + tuple(array.shape)
    if dims[0] != 1 or dims[2] != 1 or dims[3] != 1:
        raise Unprovable(f"the sink constant {list(array.shape)} varies along an axis other than the heads")
    if dims[1] != 1 and heads != Affine(const=dims[1]):
        raise Unprovable(f"the sink constant has {dims[1]} heads, the scores {heads}")
    full = array.reshape(dims)
    return full.reshape(-1).astype(np.float32)


def _constant(ev: SymbolicEvaluator, value: ir.Value | None) -> np.ndarray | None:
    """A small constant through Reshape, Unsqueeze, Squeeze, Cast, Identity; else None."""
    if value is None:
        return None
    tensor = value.const_value
    node = value.producer()
    if tensor is None and node is not None and node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        attr = node.attributes.get("value")
        tensor = attr.value if attr is not None and attr.type == ir.AttributeType.TENSOR else None
    if tensor is not None:
        return np.asarray(tensor.numpy()) if tensor.size <= _MAX_SINKS else None
    if node is None or node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    inner = _constant(ev, node.inputs[0])
    if inner is None:
        return None
    if node.op_type == "Identity":
        return inner
    if node.op_type == "Cast":
        to = ir.DataType(node.attributes["to"].as_int())
        return inner.astype(to.numpy()) if to.is_floating_point() else None
    if node.op_type in ("Unsqueeze", "Squeeze"):
        axes = opsets.moved(ev, node)
        if node.op_type == "Squeeze":
            return np.squeeze(inner, axis=tuple(axes)) if axes is not None else np.squeeze(inner)
        if axes is None:
            return None
        out = inner
        for k in sorted(a + inner.ndim + len(axes) if a < 0 else a for a in axes):
            out = np.expand_dims(out, k)
        return out
    if node.op_type == "Reshape":
        shape = ev.const_ints(node.inputs[1] if len(node.inputs) > 1 else None, "Reshape shape")
        if shape is None:
            return None
        allowzero = node.attributes.get("allowzero")
        dims = [
            inner.shape[k] if d == 0 and not (allowzero and allowzero.as_int()) else d
            for k, d in enumerate(shape)
        ]
        return inner.reshape(dims)
    return None
