"""The attention scores chain of decomposed attention, as exporters write it.

Between the softmax and the ``Q @ K^T`` MatMul, :func:`scores_chain` follows:

- a widening ``Cast`` to float32 before the softmax (transformers' eager attention
  computes the softmax in float32; fp16 scores widen exactly);
- an optional soft-cap ``Mul(Tanh(Div(s, cap)), cap)`` (Gemma-2; GQA ``softcap``);
- constant scalar ``Mul``/``Div`` of the scores (eager attention's ``* scaling``);
- the MatMul, each operand optionally scaled by a scalar constant (sdpa's
  decomposition scales Q and K^T by ``sqrt(scale)`` each; both factors must then be
  equal). A constant is a scalar constant, or ``Sqrt`` and float ``Cast``/``CastLike`` of
  one (torch's unoptimized export writes ``Sqrt(CastLike(scale, q))``), evaluated in the
  float type each computes in (a ``CastLike`` to a type not known: only values every float
  type holds exactly).

GQA computes ``softcap * tanh(scale * QK^T / softcap)`` when ``softcap > 0``, else
``scale * QK^T``: the factors must all come before the soft-cap.
"""

from __future__ import annotations

__all__ = ["ScoresChain", "scores_chain", "softmax_input", "unwrap_probs"]

import dataclasses

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes._graph import op_of
from onnx_kvcache.passes.fusion._symbolic import SymbolicEvaluator, Unprovable, constant_array

_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _scalar(value: ir.Value | None, ev: SymbolicEvaluator | None = None) -> float | None:
    """A scalar constant's value, or of ``Sqrt`` and float ``Cast``/``CastLike`` of one (torch's
    unoptimized export scales Q and K^T by ``Sqrt(CastLike(scale, q))``), computed in the
    float type each node computes in; None for anything else."""
    typed = _typed_scalar(value, ev)
    return None if typed is None else typed[0]


def _typed_scalar(
    value: ir.Value | None, ev: SymbolicEvaluator | None
) -> tuple[float, ir.DataType | None] | None:
    """``(value, its float type or None where not known)`` of :func:`_scalar`."""
    array = constant_array(value) if value is not None else None
    if array is not None:
        if array.size != 1:
            return None
        dtype = {np.dtype(t.numpy()): t for t in _FLOATS}.get(array.dtype)
        return float(array.reshape(-1)[0]), dtype
    known = _known_integer(value, ev)
    if known is not None:
        return float(known), None
    node = op_of(value, "Sqrt", "Cast", "CastLike", "Div", "Mul")
    if node is not None and node.op_type in ("Div", "Mul"):
        return _arithmetic(node, ev)
    inner = _typed_scalar(node.inputs[0], ev) if node is not None else None
    if node is None or inner is None:
        return None
    x, dtype = inner
    if node.op_type == "Sqrt":
        root = _rounded(float(np.sqrt(x)), dtype) if x >= 0 else None
        return None if root is None else (root, dtype)
    if node.op_type == "Cast":
        dtype = ir.DataType(node.attributes["to"].as_int())
    else:  # CastLike: to its second input's type (Q's, which the Mul it scales shares)
        like = node.inputs[1] if len(node.inputs) > 1 else None
        dtype = (ev.dtype(like) if ev is not None else like.dtype) if like is not None else None
    if dtype is not None and dtype not in _FLOATS:
        return None
    cast = _rounded(x, dtype)
    return (cast, dtype) if cast is not None else None


def _known_integer(value: ir.Value | None, ev: SymbolicEvaluator | None) -> int | None:
    """An integer scalar the evaluator knows (a head size read from a shape: stablelm scales
    Q and K by ``sqrt(1 / sqrt(q.shape[-1]))``), or None."""
    if value is None or ev is None or value.producer() is None:
        return None
    try:
        tensor = ev.eval(value)
    except Unprovable:
        return None
    if tensor.kind != "int" or tensor.values is None or len(tensor.values) != 1:
        return None
    if not tensor.values[0].is_const:
        return None
    return tensor.values[0].const


def _arithmetic(node: ir.Node, ev: SymbolicEvaluator | None) -> tuple[float, ir.DataType | None] | None:
    """``Div`` or ``Mul`` of two scalars of :func:`_typed_scalar`, computed in their float type."""
    a, b = (_typed_scalar(v, ev) for v in node.inputs[:2])
    if a is None or b is None:
        return None
    dtype = a[1] or b[1]
    if dtype is None:
        return None
    x, y = np.asarray(a[0], dtype.numpy()), np.asarray(b[0], dtype.numpy())
    if node.op_type == "Div" and y == 0:
        return None
    return float(x / y if node.op_type == "Div" else x * y), dtype


def _rounded(x: float, dtype: ir.DataType | None) -> float | None:
    """``x`` in ``dtype`` (float32, float16, bfloat16); with the type unknown, ``x`` when every
    one of them holds it exactly, else None."""
    if dtype is not None:
        return float(np.asarray(x, dtype.numpy()))
    held = {float(np.asarray(x, t.numpy())) for t in _FLOATS}
    return x if held == {x} else None


def _cast_to(node: ir.Node) -> ir.DataType:
    return ir.DataType(node.attributes["to"].as_int())


def unwrap_probs(ev: SymbolicEvaluator, value: ir.Value | None, nodes: list[ir.Node]) -> ir.Value | None:
    """Step back from the probabilities MatMul's input over a Cast to a float type, an
    inference Dropout and a NaN guard ``Where(IsNaN(p), 0, p)``, in any order."""
    while True:
        cast = op_of(value, "Cast")
        if cast is not None and _cast_to(cast) in _FLOATS and ev.dtype(cast.inputs[0]) in _FLOATS:
            nodes.append(cast)
            value = cast.inputs[0]
            continue
        dropout = op_of(value, "Dropout")
        if dropout is not None:  # the identity unless training_mode is given and true
            training = dropout.inputs[2] if len(dropout.inputs) > 2 else None
            if training is not None and _scalar(training) != 0.0:
                raise Unprovable("the attention probabilities go through a Dropout in training mode")
            nodes.append(dropout)
            value = dropout.inputs[0]
            continue
        guard = op_of(value, "Where")
        isnan = op_of(guard.inputs[0], "IsNaN") if guard is not None else None
        if guard is not None and isnan is not None:
            if _scalar(guard.inputs[1]) != 0.0 or isnan.inputs[0] is not guard.inputs[2]:
                raise Unprovable("the attention probabilities go through a Where that is not a NaN guard")
            nodes += [guard, isnan]
            value = guard.inputs[2]
            continue
        if guard is not None:
            raise Unprovable("the attention probabilities go through a Where that is not a NaN guard")
        return value


def softmax_input(ev: SymbolicEvaluator, value: ir.Value | None, nodes: list[ir.Node]) -> ir.Value | None:
    """The softmax's input, before a Cast that widens fp16/bf16 scores to float32."""
    cast = op_of(value, "Cast")
    if cast is not None and _cast_to(cast) == ir.DataType.FLOAT and ev.dtype(cast.inputs[0]) in _FLOATS:
        nodes.append(cast)
        return cast.inputs[0]
    return value


@dataclasses.dataclass(frozen=True)
class ScoresChain:
    query: ir.Value
    key_t: ir.Value
    scale: float
    softcap: float


def _constant_step(node: ir.Node, ev: SymbolicEvaluator | None = None) -> tuple[ir.Value, float] | None:
    """``(x, factor)`` for ``Mul(x, c)``, ``Mul(c, x)`` or ``Div(x, c)`` with a scalar ``c``."""
    a, b = node.inputs[0], node.inputs[1]
    if node.op_type == "Div":
        c = _scalar(b, ev)
        return (a, 1.0 / c) if a is not None and c else None
    for x, factor in ((a, b), (b, a)):
        c = _scalar(factor, ev)
        if c is not None and x is not None:
            return x, c
    return None


def scores_chain(
    value: ir.Value | None, nodes: list[ir.Node], ev: SymbolicEvaluator | None = None
) -> ScoresChain:
    """Prove ``value`` is ``[softcap o] scale * (Q @ K^T)``; raise otherwise (``ev``: the
    element types of values without one declared)."""
    softcap = 0.0
    outer = op_of(value, "Mul")
    tanh, cap = None, None
    if outer is not None:
        for x, cap_value in ((outer.inputs[0], outer.inputs[1]), (outer.inputs[1], outer.inputs[0])):
            tanh, cap = op_of(x, "Tanh"), cap_value
            if tanh is not None:
                break
    if outer is not None and tanh is not None:
        inner = op_of(tanh.inputs[0], "Mul", "Div")
        step = _constant_step(inner, ev) if inner is not None else None
        c = _scalar(cap, ev)
        if step is None or c is None or c <= 0 or not np.isclose(step[1], 1.0 / c, rtol=1e-6):
            raise Unprovable("the scores go through a Tanh that is not a soft-cap c * tanh(s / c)")
        nodes += [outer, tanh, inner]  # type: ignore[list-item]
        softcap, value = c, step[0]
    scale = 1.0
    while (node := op_of(value, "Mul", "Div")) is not None:
        step = _constant_step(node, ev)
        if step is None:
            break
        nodes.append(node)
        value, factor = step
        scale *= factor
    matmul = op_of(value, "MatMul")
    if matmul is None:
        raise Unprovable("the softmax input is not scores + mask")
    nodes.append(matmul)
    operands, factors = [], []
    for operand in matmul.inputs:
        mul = op_of(operand, "Mul")
        step = _constant_step(mul, ev) if mul is not None else None
        if step is not None:
            nodes.append(mul)  # type: ignore[arg-type]
            operand, factor = step
            factors.append(factor)
        assert operand is not None
        operands.append(operand)
    if len(factors) == 2 and (not np.isclose(factors[0], factors[1], rtol=1e-6) or factors[0] <= 0):
        raise Unprovable(
            f"the scores MatMul {matmul.name!r} scales Q and K by different factors "
            f"({factors[0]}, {factors[1]})"
        )
    scale *= float(np.prod(factors)) if factors else 1.0
    if scale <= 0:
        raise Unprovable(f"the scores are scaled by {scale}, not a positive factor")
    return ScoresChain(operands[0], operands[1], scale, softcap)
