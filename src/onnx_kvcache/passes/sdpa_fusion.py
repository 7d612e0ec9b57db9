"""Fuse decomposed scaled-dot-product attention (opset < 23 exports) into GroupQueryAttention.

Below opset 23, ``torch.onnx.export(..., dynamo=True)`` writes
``torch.nn.functional.scaled_dot_product_attention`` as its op library decomposes it:

    Kt     = K with its last two axes swapped (Transpose, or Reshape/Transpose/Reshape)
    scores = MatMul(Mul(Q, sqrt(scale)), Mul(Kt, sqrt(scale)))
    probs  = Softmax(Add(scores, Where(mask, 0, -inf)), axis=-1)
             [Dropout (inference)] [Where(IsNaN(probs), 0, probs)]
    Y      = MatMul(probs, V)

A chain becomes one ``com.microsoft::GroupQueryAttention`` when it is exactly that, the
two factors being the same scalar constant (``scale`` = their product), and every rule
of :mod:`onnx_kvcache._attention_site` holds (cache, repeat, mask, shapes). So does
transformers' ``eager_attention_forward`` (Gemma2's, at any opset):
``MatMul(Softmax([Cast] capped + mask), V)`` with ``capped`` the scores
``MatMul(Q, K^T) * scale``, or ``Tanh(scores / cap) * cap`` (GQA ``softcap``). Anything
else is left alone; the refusals are kept in :attr:`refused` (and logged) so that a
caller that tries other fusions afterwards can report the chains nobody fused.
Fuses in the main graph only.
"""

from __future__ import annotations

__all__ = ["DecomposedAttentionFusionPass"]

import logging

import numpy as np
import onnx_ir as ir

from onnx_kvcache._attention_site import (
    AttentionSite,
    GqaWriter,
    cache_link,
    cache_mask_facts,
    check_shapes,
    mask_condition,
)
from onnx_kvcache._symbolic import Affine, SymbolicEvaluator, Unprovable, constant_array
from onnx_kvcache.gqa import GQA_DOMAIN
from onnx_kvcache.passes._base import InPlacePass

logger = logging.getLogger(__name__)


def _op(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in op_types:
        return None
    return node


def _scalar(value: ir.Value | None) -> float | None:
    array = constant_array(value) if value is not None else None
    return None if array is None or array.size != 1 else float(array.reshape(-1)[0])


def _unwrap_probs(value: ir.Value | None, nodes: list[ir.Node]) -> ir.Value | None:
    """Step back over an inference Dropout and a NaN guard after the softmax."""
    dropout = _op(value, "Dropout")
    if dropout is not None:  # the identity unless training_mode is given and true
        training = dropout.inputs[2] if len(dropout.inputs) > 2 else None
        if training is not None and _scalar(training) != 0.0:
            raise Unprovable("the attention probabilities go through a Dropout in training mode")
        nodes.append(dropout)
        value = dropout.inputs[0]
    guard = _op(value, "Where")
    if guard is not None:
        isnan = _op(guard.inputs[0], "IsNaN")
        if isnan is None or _scalar(guard.inputs[1]) != 0.0 or isnan.inputs[0] is not guard.inputs[2]:
            raise Unprovable("the attention probabilities go through a Where that is not a NaN guard")
        nodes += [guard, isnan]
        value = guard.inputs[2]
    return value


def _untransposed(ev: SymbolicEvaluator, value: ir.Value, nodes: list[ir.Node]) -> ir.Value:
    """K, given K with its last two axes swapped (as exporters write it)."""
    transpose = _op(value, "Transpose")
    if transpose is not None and list(transpose.attributes["perm"].as_ints()) == [0, 1, 3, 2]:
        nodes.append(transpose)
        assert transpose.inputs[0] is not None
        return transpose.inputs[0]
    # Reshape(Transpose(Reshape(K, [-1, t, d]), [0, 2, 1]), [a, b, d, t]) for K [a, b, t, d]
    outer = _op(value, "Reshape")
    middle = _op(outer.inputs[0], "Transpose") if outer is not None else None
    inner = _op(middle.inputs[0], "Reshape") if middle is not None else None
    if outer is None or middle is None or inner is None or inner.inputs[0] is None:
        raise Unprovable("K reaches the scores MatMul without a transpose of its last two axes")
    key = inner.inputs[0]
    dims = ev.shape(key)
    if len(dims) != 4:
        raise Unprovable(
            f"the key transpose's first Reshape reads a {len(dims)}-D tensor, not K [batch, heads, "
            "seq, head_size] (a static-shape export folds repeat_kv's Reshape into it)"
        )
    a, b, t, d = dims
    minus_one = ev.values(inner.inputs[1], "the key transpose's first shape")
    split = ev.values(outer.inputs[1], "the key transpose's second shape")
    if (
        list(middle.attributes["perm"].as_ints()) != [0, 2, 1]
        or tuple(minus_one) != (Affine(const=-1), t, d)
        or tuple(split) != (a, b, d, t)
    ):
        raise Unprovable("the key Reshape/Transpose/Reshape is not a transpose of the last two axes")
    nodes += [outer, middle, inner]
    return key


def _scaled(value: ir.Value | None, nodes: list[ir.Node]) -> tuple[ir.Value, float]:
    mul = _op(value, "Mul")
    if mul is None:
        raise Unprovable("a scores MatMul operand is not scaled by a constant")
    for x, factor in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        constant = _scalar(factor)
        if constant is not None and x is not None:
            nodes.append(mul)
            return x, constant
    raise Unprovable("a scores MatMul operand is not scaled by a scalar constant")


def match_decomposed(ev: SymbolicEvaluator, graph: ir.Graph, out: ir.Node) -> AttentionSite:
    """Prove that ``out`` = MatMul(softmax(...), V) is GQA with a KV cache; raise otherwise."""
    nodes: list[ir.Node] = [out]
    probs, value = out.inputs
    assert probs is not None and value is not None
    softmax = _op(_unwrap_probs(probs, nodes), "Softmax")
    if softmax is None:
        raise Unprovable("the MatMul does not read softmax probabilities")
    rank = len(ev.shape(softmax.outputs[0]))
    axis = softmax.attributes.get("axis")
    if rank != 4 or (axis is not None and axis.as_int() not in (-1, 3)):
        raise Unprovable("the softmax is not over the last axis of 4-D scores")
    add = _op(softmax.inputs[0], "Add")
    if add is None:
        raise Unprovable("the softmax reads scores without an additive mask")
    matmul, mask = add.inputs
    if _op(matmul, "MatMul") is None:
        matmul, mask = mask, matmul
    scores = _op(matmul, "MatMul")
    if scores is None or mask is None:
        raise Unprovable("the softmax input is not scores + mask")
    nodes += [softmax, add, scores]
    query, q_factor = _scaled(scores.inputs[0], nodes)
    key_t, k_factor = _scaled(scores.inputs[1], nodes)
    if not np.isclose(q_factor, k_factor, rtol=1e-6) or q_factor <= 0:
        raise Unprovable(f"Q and K are scaled by different factors ({q_factor}, {k_factor})")
    key = _untransposed(ev, key_t, nodes)
    return _site(ev, graph, out, nodes, query, key, value, mask, scale=q_factor * k_factor)


def _site(
    ev: SymbolicEvaluator,
    graph: ir.Graph,
    out: ir.Node,
    nodes: list[ir.Node],
    query: ir.Value,
    key: ir.Value,
    value: ir.Value,
    mask: ir.Value,
    *,
    scale: float,
    softcap: float = 0.0,
) -> AttentionSite:
    """The site of a matched chain: its caches, shapes and mask proven (else Unprovable)."""
    k_link = cache_link(ev, graph, key, nodes)
    v_link = cache_link(ev, graph, value, nodes)
    heads, kv_heads, head = check_shapes(ev, query, k_link, v_link)
    past = ev.shape(k_link.past)[2]
    cond = mask_condition(ev, mask, query_len=ev.shape(query)[2], kv_len=ev.shape(k_link.present)[2])
    facts = cache_mask_facts(cond, k_link, v_link, past=past, batch=ev.shape(query)[0])
    if not facts.causal:
        raise Unprovable("the mask is not causal (a query would see later keys)")
    return AttentionSite(
        node=out,
        output=out.outputs[0],
        query=query,
        key=k_link,
        value=v_link,
        num_heads=heads,
        kv_num_heads=kv_heads,
        head_size=head,
        scale=scale,
        mask=facts,
        softcap=softcap,
    )


# -- transformers' eager_attention_forward (Gemma2 at any opset) ------------------------


def _float_cast(
    value: ir.Value | None, nodes: list[ir.Node], *, widening: bool, model_dtype: ir.DataType | None = None
) -> ir.Value | None:
    """Step back over a Cast between float types (the eager path's fp32 softmax).

    ``widening``: the Cast must be to float32 (before the softmax, which GQA computes in
    float32); after it, back to the model's type (``model_dtype``).
    """
    cast = _op(value, "Cast")
    if cast is None or not cast.inputs or cast.inputs[0] is None:
        return value
    to = cast.attributes.get("to")
    source = cast.inputs[0].dtype
    if to is None or source not in _FLOATS or to.type != ir.AttributeType.INT:
        return value
    target = ir.DataType(to.as_int())
    if target not in _FLOATS:
        return value
    if widening and target != ir.DataType.FLOAT:
        raise Unprovable(f"the scores are cast to {target.name} before the softmax, not to float32")
    if not widening and target != model_dtype:
        raise Unprovable(f"the probabilities are cast to {target.name}, not to the model's type")
    nodes.append(cast)
    return cast.inputs[0]


_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def _soft_capped(value: ir.Value | None, nodes: list[ir.Node]) -> tuple[ir.Value | None, float]:
    """``(x, cap)`` for ``Tanh(x / cap) * cap`` (or ``cap * Tanh(x * (1 / cap))``), else ``(value, 0)``."""
    mul = _op(value, "Mul")
    if mul is None:
        return value, 0.0
    for tanh_value, outer in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        tanh = _op(tanh_value, "Tanh")
        cap = _scalar(outer)
        if tanh is None or cap is None:
            continue
        inner = _op(tanh.inputs[0], "Div", "Mul")
        divisor = _scalar(inner.inputs[1]) if inner is not None else None
        if inner is None or divisor is None or divisor == 0:
            raise Unprovable("the soft-cap's Tanh does not read the scores divided by a constant")
        divisor = divisor if inner.op_type == "Div" else 1.0 / divisor
        if not np.isclose(divisor, cap, rtol=1e-6) or cap <= 0:
            raise Unprovable(f"the soft-cap divides by {divisor} and multiplies by {cap}, not one cap")
        nodes += [mul, tanh, inner]
        return inner.inputs[0], cap
    return value, 0.0


def _scaled_scores(value: ir.Value | None, nodes: list[ir.Node]) -> tuple[ir.Node, float]:
    """``(MatMul(Q, K^T), scale)`` for the MatMul times (or divided by) a constant."""
    step = _op(value, "Mul", "Div")
    if step is None:
        matmul = _op(value, "MatMul")
        if matmul is None:
            raise Unprovable("the softmax input is not scores + mask")
        nodes.append(matmul)
        return matmul, 1.0
    for x, factor in ((step.inputs[0], step.inputs[1]), (step.inputs[1], step.inputs[0])):
        if step.op_type == "Div" and x is not step.inputs[0]:
            break
        constant = _scalar(factor)
        matmul = _op(x, "MatMul")
        if constant is not None and matmul is not None:
            if step.op_type == "Div" and constant == 0:
                break
            nodes += [step, matmul]
            return matmul, constant if step.op_type == "Mul" else 1.0 / constant
    raise Unprovable("the scores MatMul is not scaled by a scalar constant")


def match_eager(ev: SymbolicEvaluator, graph: ir.Graph, out: ir.Node) -> AttentionSite:
    """Prove that ``out`` is transformers' eager attention with a KV cache; raise otherwise.

    ``MatMul(Softmax([Cast](capped + mask)), V)`` where ``capped`` is ``s`` or
    ``Tanh(s / cap) * cap`` and ``s = MatMul(Q, K^T) * scale``: GQA with ``scale``, ``softcap``.
    """
    nodes: list[ir.Node] = [out]
    probs, value = out.inputs
    if probs is None or value is None:
        raise Unprovable("the attention MatMul lacks an input")
    softmax = _op(
        _float_cast(_unwrap_probs(probs, nodes), nodes, widening=False, model_dtype=value.dtype), "Softmax"
    )
    if softmax is None:
        raise Unprovable("the MatMul does not read softmax probabilities")
    nodes.append(softmax)
    rank = len(ev.shape(softmax.outputs[0]))
    axis = softmax.attributes.get("axis")
    if rank != 4 or (axis is not None and axis.as_int() not in (-1, 3)):
        raise Unprovable("the softmax is not over the last axis of 4-D scores")
    add = _op(_float_cast(softmax.inputs[0], nodes, widening=True), "Add")
    if add is None:
        raise Unprovable("the softmax reads scores without an additive mask")
    nodes.append(add)
    scores, mask = add.inputs
    if _op(scores, "Mul", "MatMul", "Div") is None:
        scores, mask = mask, scores
    if mask is None:
        raise Unprovable("the softmax input is not scores + mask")
    uncapped, softcap = _soft_capped(scores, nodes)
    matmul, scale = _scaled_scores(uncapped, nodes)
    if not (np.isfinite(scale) and scale > 0):
        raise Unprovable(f"the scores are scaled by {scale}")
    query, key_t = matmul.inputs
    if query is None or key_t is None:
        raise Unprovable("the scores MatMul lacks an input")
    key = _untransposed(ev, key_t, nodes)
    return _site(ev, graph, out, nodes, query, key, value, mask, scale=scale, softcap=softcap)


def _is_eager(node: ir.Node) -> bool:
    """The scores MatMul's operands are not both scaled (the eager form scales its output)."""
    value: ir.Value | None = node.inputs[0]
    for op_type in ("Dropout", "Where", "Cast", "Softmax", "Cast", "Add"):
        step = _op(value, op_type)
        if step is not None:
            value = step.inputs[2] if op_type == "Where" else step.inputs[0]
            if op_type == "Add" and _op(value, "Mul", "MatMul", "Div") is None:
                value = step.inputs[1]
    step = _op(value, "Mul", "MatMul", "Div")
    if step is None or step.op_type != "MatMul":
        return step is not None
    return not all(_op(v, "Mul") is not None for v in step.inputs)


def _is_candidate(node: ir.Node) -> bool:
    """A MatMul reading softmax probabilities (maybe through Dropout / a NaN guard)."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return False
    value: ir.Value | None = node.inputs[0] if node.inputs else None
    for op_type in ("Dropout", "Where", "Cast"):
        step = _op(value, op_type)
        if step is not None and len(step.inputs) > (2 if op_type == "Where" else 0):
            value = step.inputs[2] if op_type == "Where" else step.inputs[0]
    return _op(value, "Softmax") is not None and len(node.inputs) == 2


class DecomposedAttentionFusionPass(InPlacePass):
    """Replace each provably equivalent decomposed attention with GroupQueryAttention."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[tuple[ir.Node, str]] = []
        """(output MatMul, reason) of each attention-like chain left alone."""
        self.fused = 0
        """Attention chains fused by the last call."""
        self.padded = 0
        """Of those, how many read a padding mask (see ``gqa_fusion.PADDING_WARNING``)."""
        self.padded_windows = 0
        """Of those, how many also have a sliding window."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.refused = []
        self.padded = self.padded_windows = 0
        fused = 0
        ev = SymbolicEvaluator()
        writer = GqaWriter(model.graph, ev)
        for node in list(model.graph):
            if node.graph is None or not _is_candidate(node):
                continue
            try:
                match = match_eager if _is_eager(node) else match_decomposed
                site = match(ev, model.graph, node)
            except Unprovable as reason:
                self.refused.append((node, str(reason)))
                continue
            writer.write(site)
            fused += 1
            self.padded += site.mask.padding is not None
            self.padded_windows += site.mask.padding is not None and site.mask.window is not None
        self.fused = fused
        if fused:
            model.opset_imports.setdefault(GQA_DOMAIN, 1)
        logger.info(
            "Decomposed attention -> GroupQueryAttention: %d fused, %d left.", fused, len(self.refused)
        )
        for node, why in self.refused:
            logger.info("Left %s: %s", node.name, why)
        return ir.passes.PassResult(model, modified=bool(fused))
