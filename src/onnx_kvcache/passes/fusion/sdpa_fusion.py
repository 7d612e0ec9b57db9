"""Fuse decomposed scaled-dot-product attention (opset < 23 exports) into GroupQueryAttention.

Below opset 23, ``torch.onnx.export(..., dynamo=True)`` writes
``torch.nn.functional.scaled_dot_product_attention`` as its op library decomposes it:

    Kt     = K with its last two axes swapped (Transpose, or Reshape/Transpose/Reshape)
    scores = MatMul(Mul(Q, sqrt(scale)), Mul(Kt, sqrt(scale)))
    probs  = Softmax(Add(scores, Where(mask, 0, -inf)), axis=-1)
             [Dropout (inference)] [Where(IsNaN(probs), 0, probs)]
    Y      = MatMul(probs, V)

and what TorchScript exports (optimum, onnx-community) write: the same with the mask
sliced to the key length, or transformers' ``eager_attention_forward`` (Gemma2's, at any
opset: ``Mul(Q @ K^T, scale)``, a ``Tanh(s / cap) * cap`` soft-cap, a ``Where(mask, 0,
min)`` mask, the softmax in float32 between Casts); :mod:`onnx_kvcache.passes.fusion._scores`
follows the scores chain (``scale`` is the product of its factors, ``softcap`` the cap),
:mod:`onnx_kvcache.passes.fusion._symbolic_ops` the shapes such graphs do not annotate.

A chain becomes one ``com.microsoft::GroupQueryAttention`` when it is exactly that (Q
and K^T, when both are scaled, by the same scalar constant) and every rule of
:mod:`onnx_kvcache.passes.fusion._match` holds (cache, repeat, mask, shapes). A mask of
positions counted by ``CumSum`` of the padding input whose width the export names apart from
the cache's (mobius's gpt-oss: ``past_seq_len + seq_len`` beside ``past_sequence_len``) is
proven with that width tied to the scores' ``P + S`` columns
(:func:`~onnx_kvcache.passes.fusion._attention_facts.counted_tie`). Anything
else is left alone; the refusals are kept in its report (and logged) so that a
caller that tries other fusions afterwards can report the chains nobody fused.
Fuses in the main graph only.
"""

from __future__ import annotations

__all__ = ["DecomposedAttentionFusionPass"]


import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes.fusion import _opsets as opsets
from onnx_kvcache.passes.fusion._base import FusionPass
from onnx_kvcache.passes.fusion._match import (
    AttentionMatch,
    cache_link,
    cache_mask_facts,
    check_head_sizes,
    check_shapes,
    counted_tie,
    key_columns,
    mask_condition,
)
from onnx_kvcache.passes.fusion._reads import read_through
from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode, proof_step
from onnx_kvcache.passes.fusion._scores import op_of as _op
from onnx_kvcache.passes.fusion._scores import scores_chain, softmax_input, unwrap_probs
from onnx_kvcache.passes.fusion._sinks import sink_site
from onnx_kvcache.passes.fusion._symbolic import Affine, Conj, Symbol, SymbolicEvaluator, Unprovable
from onnx_kvcache.passes.fusion.attention_fusion import shorter_mask


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


def match_decomposed(ev: SymbolicEvaluator, graph: ir.Graph, out: ir.Node) -> AttentionMatch:
    """Prove that ``out`` = MatMul(softmax(...), V) is GQA with a KV cache; raise otherwise."""
    with proof_step(FusionRefusalCode.SCORES):
        nodes: list[ir.Node] = [out]
        probs, value = out.inputs
        if probs is None or value is None:
            raise Unprovable("the attention MatMul lacks an input")
        read = unwrap_probs(ev, probs, nodes)
        sink = sink_site(ev, read, nodes)  # gpt-oss: a Slice of a softmax with a sink column
        softmax = sink.softmax if sink is not None else _op(read, "Softmax")
        if softmax is None:
            raise Unprovable("the MatMul does not read softmax probabilities")
        rank = len(ev.shape(softmax.outputs[0]))
        if rank != 4 or opsets.softmax_axis(softmax, rank) != rank - 1:
            given = softmax.attributes.get("axis")
            axis = f"axis={given.as_int()}" if given is not None else "no axis"
            raise Unprovable(
                f"the softmax {softmax.name!r} ({axis}, opset {opsets.opset(softmax)}) is not over the "
                f"last axis of 4-D scores alone (below opset 13 a softmax's default axis is 1 and it "
                "normalizes over every axis from it at once)"
            )
        add = _op(softmax_input(ev, sink.scores if sink is not None else softmax.inputs[0], nodes), "Add")
        if add is None:
            raise Unprovable(f"the softmax {softmax.name!r} reads scores without an additive mask")
        scores, mask = add.inputs
        if _op(softmax_input(ev, scores, []), "MatMul", "Mul", "Div") is None:
            scores, mask = mask, scores
        if scores is None or mask is None:
            raise Unprovable("the softmax input is not scores + mask")
        nodes += [softmax, add]
        # fp16 scores widened to float32 before the mask (TorchScript's fp16 sdpa): exact
        chain = scores_chain(softmax_input(ev, scores, nodes), nodes, ev)
        query, key_t = chain.query, chain.key_t
        key = _untransposed(ev, key_t, nodes)
    return _site(
        ev,
        graph,
        out,
        nodes,
        query,
        key,
        value,
        mask,
        scale=chain.scale,
        softcap=chain.softcap,
        head_sink=sink.values if sink is not None else None,
    )


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
    head_sink: np.ndarray | None = None,
) -> AttentionMatch:
    """The site of a matched chain: its caches, shapes and mask proven (else Unprovable)."""
    check_head_sizes(ev, key, value)
    k_link = cache_link(ev, graph, key, nodes)
    v_link = cache_link(ev, graph, value, nodes)
    with proof_step(FusionRefusalCode.SHAPES):
        query, widened = read_through(ev, query, nodes, "Q")
    heads, kv_heads, head = check_shapes(ev, query, k_link, v_link, widened)
    past = ev.shape(k_link.past)[2]
    with proof_step(FusionRefusalCode.MASK):
        query_len, kv_len = ev.shape(query)[2], key_columns(ev, k_link)
        # transformers 4.x's causal_mask[..., :kv] of an attention_mask m: min(m.shape[1], P + S)
        # columns, which the Add with the scores broadcasts only where they are P + S
        fitted = shorter_mask(ev, graph, mask, kv_len, k_link.domain)
        columns = kv_len if fitted is None else ev.shape(mask)[-1]
        cond = _condition(ev, mask, query_len=query_len, kv_len=columns, domain=k_link.domain)
        facts = cache_mask_facts(cond, k_link, v_link, past=past, batch=ev.shape(query)[0])
        if not facts.causal:
            raise Unprovable(f"the mask {mask.name!r} is not causal (a query would see later keys)")
        if fitted is not None and facts.padding != fitted:
            raise Unprovable(f"the mask {mask.name!r} has {fitted}'s key columns but does not read {fitted}")
    return AttentionMatch(
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
        head_sink=head_sink,
        fit_mask=fitted is not None,
    )


def _condition(
    ev: SymbolicEvaluator, mask: ir.Value, *, query_len: Affine, kv_len: Affine, domain: dict[Symbol, Affine]
) -> Conj:
    """The mask's condition; a mask of positions counted from its padding input, which names its
    width apart from the cache's (mobius's gpt-oss), with that width tied to ``P + S``
    (:func:`~onnx_kvcache.passes.fusion._attention_facts.counted_tie`)."""
    try:
        return mask_condition(ev, mask, query_len=query_len, kv_len=kv_len, domain=domain)
    except Unprovable as reason:
        try:
            shape = ev.shape(mask)
        except Unprovable:
            raise reason from None
        tied = counted_tie(mask, shape[-1], kv_len) if shape else None
        if tied is None:
            raise
        return mask_condition(tied, mask, query_len=query_len, kv_len=kv_len, domain=domain)


def _is_candidate(node: ir.Node) -> bool:
    """A MatMul reading softmax probabilities (maybe through Cast, Dropout, a NaN guard)."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return False
    if len(node.inputs) != 2:
        return False
    value: ir.Value | None = node.inputs[0]
    for _ in range(4):
        step = _op(value, "Cast", "Dropout", "Where", "Slice")  # Slice: a sink column cut off
        if step is None or len(step.inputs) < (3 if step.op_type == "Where" else 1):
            break
        value = step.inputs[2] if step.op_type == "Where" else step.inputs[0]
    return _op(value, "Softmax") is not None


class DecomposedAttentionFusionPass(FusionPass):
    """Replace each decomposed attention with GroupQueryAttention where the two are proven
    equivalent for unpadded and left-padded rows (docs/exporting.md, "What is proven"; the loop,
    the report: :class:`~onnx_kvcache.passes.fusion._base.FusionPass`)."""

    label = "Decomposed attention"

    @property
    def refused(self) -> list[tuple[ir.Node, str]]:
        """(output MatMul, reason) of each attention-like chain left alone."""
        return [(refusal.node, refusal.text) for refusal in self.report.refusals]

    def is_candidate(self, node: ir.Node) -> bool:
        return _is_candidate(node)

    def match(self, ev: SymbolicEvaluator, graph: ir.Graph, node: ir.Node) -> AttentionMatch:
        return match_decomposed(ev, graph, node)
