"""Fuse the ONNX ``Attention`` operator (opset 23+) with its KV cache into GroupQueryAttention.

``torch.onnx.export(..., dynamo=True, opset_version=23)`` writes one ``Attention`` per
layer, with the cache concatenated and repeated to the query heads outside it and an
explicit boolean mask. An ``Attention`` node becomes one
``com.microsoft::GroupQueryAttention`` when every rule of
:mod:`onnx_kvcache.passes.fusion._match` holds, and here:

- inputs 0-3 only (Q, K, V, mask) with the cache outside, 4-D (an ``Attention`` with
  ``past_key``/``past_value``/``nonpad_kv_seqlen`` is not a candidate: see
  :mod:`onnx_kvcache.passes.fusion.cached_attention_fusion`);
- the mask input (if any) ANDed with ``is_causal`` and the window attributes (which
  without a ``past_key`` input count from offset 0, ignoring the cache) is proven causal,
  with optional padding and window;
- ``scale`` (default ``1/sqrt(head_size)``) and ``softcap`` carry over; a read
  ``qk_matmul_output`` must be mode 3 (softmax probabilities: GQA's ``qk_output=2``),
  as GQA zeroes masked scores in its other mode; ``softmax_precision`` unset or float.

Anything else is left as it was; the pass warns once (:class:`KvCacheWarning`) with
the reasons grouped, with counts (:func:`summarize_refusals`), and logs each node at INFO.
Fuses in the main graph; an ``Attention`` in a model-local function or a control-flow
subgraph is reported, not fused.
"""

from __future__ import annotations

__all__ = ["AttentionFusionPass"]


from collections.abc import Mapping

import onnx_ir as ir

from onnx_kvcache.passes.fusion._attention_facts import restrict
from onnx_kvcache.passes.fusion._attention_node import attribute, is_read, not_causal, probs_and_scale
from onnx_kvcache.passes.fusion._base import FusionPass
from onnx_kvcache.passes.fusion._match import (
    KEY,
    QUERY,
    AttentionMatch,
    MaskFacts,
    cache_link,
    cache_mask_facts,
    check_head_sizes,
    check_shapes,
    key_columns,
    mask_condition,
)
from onnx_kvcache.passes.fusion._piecewise import equal
from onnx_kvcache.passes.fusion._reads import read_through
from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode, proof_step
from onnx_kvcache.passes.fusion._symbolic import (
    Affine,
    Conj,
    Le,
    Symbol,
    SymbolicEvaluator,
    Unprovable,
    min_of,
)
from onnx_kvcache.passes.fusion._symbolic_values import _INT_TYPES as _INTEGERS
from onnx_kvcache.passes.fusion.cached_attention_fusion import holds_own_cache


def shorter_mask(
    ev: SymbolicEvaluator,
    graph: ir.Graph,
    mask: ir.Value,
    kv_len: Affine,
    domain: Mapping[Symbol, Affine] | None = None,
) -> str | None:
    """The 2-D integer input ``m`` when the mask has ``min(m.shape[1], P + S)`` key columns (the
    export's mask of ``m``'s width cut to the cache's: transformers 4.x's ``causal_mask[..., :kv]``),
    else None. ``Attention`` masks the keys past a shorter mask, as GQA does reading ``m`` fitted
    to ``P + S`` columns (cut, or zeros appended); ``domain`` as :func:`mask_condition`'s."""
    try:
        columns = restrict(ev.shape(mask)[-1], domain)
    except (Unprovable, IndexError):
        return None
    if equal(columns, kv_len):
        return None
    for value in graph.inputs:
        if value.dtype in _INTEGERS and value.shape is not None and len(value.shape) == 2:
            width = ev.declared_shape(value)[1]
            if equal(columns, min_of(width, kv_len)):
                return value.name
    return None


def match_attention(ev: SymbolicEvaluator, graph: ir.Graph, node: ir.Node) -> AttentionMatch:
    """Prove that an ONNX ``Attention`` node is GQA with a KV cache; raise otherwise."""
    with proof_step(FusionRefusalCode.ATTENTION_NODE):
        inputs = list(node.inputs) + [None] * (7 - len(node.inputs))
        query, key, value, mask = inputs[:4]
        if any(v is not None for v in inputs[4:]):
            raise Unprovable("Attention keeps its own past_key/past_value/nonpad_kv_seqlen")
        if any(is_read(v) for v in node.outputs[1:3]):
            raise Unprovable("Attention's present outputs are read")
        if query is None or key is None or value is None:
            raise Unprovable("Attention lacks Q, K or V")
        if len(ev.shape(query)) != 4:
            raise Unprovable("Attention takes 3-D Q/K/V (the cache is BNSH)")
        precision = node.attributes.get("softmax_precision")
        if precision is not None and precision.as_int() != ir.DataType.FLOAT:
            raise Unprovable(f"softmax_precision={precision.as_int()} (GQA computes softmax in float32)")
    check_head_sizes(ev, key, value)
    k_link = cache_link(ev, graph, key, [node])
    v_link = cache_link(ev, graph, value, [node])
    with proof_step(FusionRefusalCode.SHAPES):
        chain: list[ir.Node] = []
        query, widened = read_through(ev, query, chain, "Q")
    heads, kv_heads, head = check_shapes(ev, query, k_link, v_link, widened)

    with proof_step(FusionRefusalCode.MASK):
        q_len = ev.shape(query)[2]
        kv_len = key_columns(ev, k_link)
        past = ev.shape(k_link.past)[2]
        cond, fitted = Conj(), None
        if mask is not None:
            fitted = shorter_mask(ev, graph, mask, kv_len, k_link.domain)
            columns = kv_len if fitted is None else ev.shape(mask)[-1]
            cond = cond & mask_condition(ev, mask, query_len=q_len, kv_len=columns, domain=k_link.domain)
        # Without a past_key input, ONNX measures is_causal and the windows from offset 0 (top-left).
        query_index, key_index = Affine.of(QUERY), Affine.of(KEY)
        if attribute(node, "is_causal", 0):
            cond = cond & Conj.of(Le(key_index - query_index))
        left = int(attribute(node, "left_window_size", -1))
        right = int(attribute(node, "right_window_size", -1))
        if left >= 0:
            cond = cond & Conj.of(Le(query_index - key_index - left))
        if right >= 0:
            cond = cond & Conj.of(Le(key_index - query_index - right))
        facts: MaskFacts = cache_mask_facts(cond, k_link, v_link, past=past, batch=ev.shape(query)[0])
        if not facts.causal:
            raise Unprovable(not_causal(node, mask))
        if mask is not None and fitted is not None and facts.padding != fitted:
            raise Unprovable(
                f"the mask {mask.name!r} has {fitted}'s {ev.shape(mask)[-1]} key columns but does not "
                f"read {fitted}"
            )

    with proof_step(FusionRefusalCode.ATTENTION_NODE):
        probs, scale = probs_and_scale(node, head)
    return AttentionMatch(
        node=node,
        output=node.outputs[0],
        query=query,
        key=k_link,
        value=v_link,
        num_heads=heads,
        kv_num_heads=kv_heads,
        head_size=head,
        scale=scale,
        mask=facts,
        softcap=attribute(node, "softcap", 0.0),
        probs=probs,
        fit_mask=fitted is not None,
    )


class AttentionFusionPass(FusionPass):
    """Replace each ONNX ``Attention`` with GroupQueryAttention where the two are proven equivalent
    for unpadded and left-padded rows (docs/exporting.md, "What is proven"; the loop, the report:
    :class:`~onnx_kvcache.passes.fusion._base.FusionPass`)."""

    label = "Attention"
    reports_elsewhere = True
    warns = "Attention node(s) left as they are"

    @property
    def refused(self) -> list[str]:
        """``"node: reason"`` for each Attention node left as it was."""
        return self.report.refused

    def is_candidate(self, node: ir.Node) -> bool:
        # one holding its own cache is CachedAttentionFusionPass's
        return node.op_type == "Attention" and node.domain in ("", "ai.onnx") and not holds_own_cache(node)

    def match(self, ev: SymbolicEvaluator, graph: ir.Graph, node: ir.Node) -> AttentionMatch:
        return match_attention(ev, graph, node)
