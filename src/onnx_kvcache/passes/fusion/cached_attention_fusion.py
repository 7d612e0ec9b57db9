"""Fuse the ONNX ``Attention`` operator holding its own KV cache into GroupQueryAttention.

The ONNX ``Attention`` operator (opset 23, 24) can hold the cache itself: ``past_key`` /
``past_value`` inputs (4, 5), ``[batch, kv_heads, past, head]``, concatenated with the new
K/V inside the operator into ``present_key`` / ``present_value`` (outputs 1, 2). mobius's
default build writes it so (3-D Q/K/V with ``q_num_heads`` / ``kv_num_heads``, a boolean mask
made from ``attention_mask``, ``is_causal=1``). By the operator's specification, query ``i``
(of the ``S`` new tokens) sees key ``j`` (of the ``P + S`` present ones) iff the mask allows
it and, with ``is_causal``, ``j <= i + P`` (bottom-right, offset the past length): with the
mask ``attention_mask[b, j]`` that is exactly what GroupQueryAttention computes with the
cache as its past/present, ``seqlens_k`` and ``total_sequence_length`` from the mask
(:mod:`onnx_kvcache.passes.fusion._match`: padding handled as for every fusion). Such a
node becomes one ``com.microsoft::GroupQueryAttention`` when, besides those rules:

- ``past_key``, ``past_value`` are 4-D inputs of the main graph (read otherwise only by
  Shape), ``present_key``, ``present_value`` its outputs (read otherwise only by Shape);
- Q/K/V are 4-D, or 3-D with ``q_num_heads`` and ``kv_num_heads``; V's head size is K's;
- no ``nonpad_kv_seqlen`` (the specification says not to combine it with ``past_key``);
- the mask input (boolean or 0/-inf additive) ANDed with ``is_causal`` is proven causal
  with optional padding. A mask whose key columns are not provably ``P + S`` but are the
  padding input's own (mobius names the two lengths differently) is read as the operator
  reads it: its missing columns padded with ``-inf``, so GQA reads the padding input cut or
  padded with zeros to ``P + S`` columns;
- a mask of positions counted by ``CumSum`` of the padding input (mobius's gemma3, granite,
  olmo2, smollm3: the query's position at the mask's column ``width - S + i``) is proven
  with its width tied to ``P + S``: onnxruntime's ``Attention`` runs only with that width,
  and only there is the query's column the causal diagonal ``P + i``
  (:mod:`onnx_kvcache.passes.fusion._match` states the proof and its assumption, entries 0/1);
- ``scale`` (default ``1/sqrt(head_size)``, finite and positive) and ``softcap`` carry
  over; ``softmax_precision`` unset or float; a read ``qk_matmul_output`` must be mode 3
  (softmax probabilities: GQA's ``qk_output=2``).

A static cache (mobius ``--features static-cache``: fixed ``[batch, max, kv_heads * head]``
buffers written by ``TensorScatter`` at ``write_indices``, attention reading the whole buffer
with each row's length in ``nonpad_kv_seqlen``) is refused with a reason saying so:
GroupQueryAttention keeps a BNSH cache with past and present as separate graph I/O, so
fusing it would change the model's interface. Anything else is refused with its rule; the
pass warns once (:class:`FusionSkippedWarning`, reasons grouped) and logs each node at INFO.
Fuses in the main graph; a candidate in a function or a subgraph is reported, not fused.
"""

from __future__ import annotations

__all__ = ["CachedAttentionFusionPass", "holds_own_cache", "match_cached_attention"]


import onnx_ir as ir

from onnx_kvcache.passes.fusion._attention_facts import (
    ATTENTION_DTYPES,
    KEY,
    QUERY,
    AttentionMatch,
    CacheLink,
    MaskFacts,
    check_shapes,
    counted_tie,
    mask_condition,
    mask_facts,
)
from onnx_kvcache.passes.fusion._attention_node import attribute, not_causal, probs_and_scale
from onnx_kvcache.passes.fusion._base import (
    FusionPass,
    FusionRefusal,
    FusionRefusalCode,
    Refused,
)
from onnx_kvcache.passes.fusion._refusals import proof_step
from onnx_kvcache.passes.fusion._symbolic import (
    ONE,
    Affine,
    Conj,
    Le,
    SymbolicEvaluator,
    Unprovable,
)

_PAST_KEY, _PAST_VALUE, _NONPAD = 4, 5, 6


def _inputs(node: ir.Node) -> list[ir.Value | None]:
    return list(node.inputs) + [None] * (7 - len(node.inputs))


def holds_own_cache(node: ir.Node) -> bool:
    """An ONNX ``Attention`` with ``past_key``, ``past_value`` or ``nonpad_kv_seqlen``."""
    return (
        node.op_type == "Attention"
        and node.domain in ("", "ai.onnx")
        and any(v is not None for v in _inputs(node)[_PAST_KEY:])
    )


def _tensor_scatter(value: ir.Value | None) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "TensorScatter" or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _dims(shape: ir.Shape) -> str:
    return "[" + ", ".join(str(d.value if isinstance(d, ir.SymbolicDim) else d) for d in shape) + "]"


def _static_cache_refusal(node: ir.Node) -> FusionRefusal | None:
    """The refusal of a static cache (K/V written by TensorScatter), or None."""
    inputs = _inputs(node)
    scatters = [_tensor_scatter(v) for v in inputs[1:3]]
    if not any(scatters):
        return None
    scatter = next(s for s in scatters if s is not None)
    buffer = scatter.inputs[0]
    at = scatter.inputs[2] if len(scatter.inputs) > 2 else None
    where = at.name if at is not None and at.name else "the sequence positions"
    shape = f" {_dims(buffer.shape)}" if buffer is not None and buffer.shape is not None else ""
    name = buffer.name if buffer is not None else "?"
    lengths = inputs[_NONPAD]
    told = f", each row's length in {lengths.name}" if lengths is not None else ""
    return FusionRefusal(
        FusionRefusalCode.STATIC_CACHE,
        node,
        f"static cache written by TensorScatter at {where}: attention reads the whole fixed buffer "
        f"{name}{shape}{told}; GroupQueryAttention keeps its cache as [batch, kv_heads, length, "
        "head_size] with past and present as separate inputs and outputs, so fusing would change the "
        "model's cache interface (export with a growing cache: mobius without --features static-cache)",
    )


def _own_cache_link(ev: SymbolicEvaluator, graph: ir.Graph, node: ir.Node, which: int) -> CacheLink:
    """The operator's own cache ``which`` (0: key, 1: value) as a :class:`CacheLink`."""
    what = ("past_key", "past_value")[which]
    past, new, present = node.inputs[_PAST_KEY + which], node.inputs[1 + which], None
    if len(node.outputs) > 1 + which:
        present = node.outputs[1 + which]
    if past is None or new is None:
        raise Unprovable(f"Attention has no {what} or no new {'KV'[which]}")
    if present is None or not present.is_graph_output() or present.graph is not graph:
        raise Unprovable(f"Attention's present of {what} {past.name!r} is not a graph output")
    if not past.is_graph_input() or past.graph is not graph:
        raise Unprovable(f"Attention's {what} {past.name!r} is not an input of the graph")
    for value in (past, present):
        for user, _ in value.uses():
            if user is not node and user.op_type != "Shape":
                raise Unprovable(f"the cache {value.name!r} is also read by {user.op_type} {user.name!r}")
    if len(ev.shape(past)) != 4:
        raise Unprovable(f"the {what} {past.name!r} is not 4-D (BNSH)")
    return CacheLink(past, new, present, group=1)


def _bsh_shapes(
    ev: SymbolicEvaluator, node: ir.Node, query: ir.Value, key: CacheLink, value: CacheLink
) -> tuple[int, int, int]:
    """(num_heads, kv_num_heads, head_size) of 3-D (BSH) Q/K/V, proven static and GQA-compatible."""
    heads, kv_heads = int(attribute(node, "q_num_heads", 0)), int(attribute(node, "kv_num_heads", 0))
    if heads <= 0 or kv_heads <= 0:
        raise Unprovable("3-D Attention without positive q_num_heads and kv_num_heads")
    q, k, v = ev.shape(query), ev.shape(key.new), ev.shape(value.new)
    pk, pv = ev.shape(key.past), ev.shape(value.past)
    if len(k) != 3 or len(v) != 3:
        raise Unprovable("Attention's Q is 3-D but K or V is not")
    if not q[2].is_const or q[2].const % heads:
        raise Unprovable(f"the query {query.name!r} of width {q[2]} is not q_num_heads={heads} heads")
    head = q[2].const // heads
    if pk != pv or pk[1] != Affine(const=kv_heads) or pk[3] != Affine(const=head):
        raise Unprovable(
            f"the past caches {pk[1]}x{pk[3]} are not kv_num_heads={kv_heads} heads "
            f"of the query's size {head}"
        )
    for width in (k[2], v[2]):
        if width != Affine(const=kv_heads * head):
            raise Unprovable(f"K/V width {width} is not kv_num_heads={kv_heads} heads of size {head}")
    if k[1] != q[1] or v[1] != q[1] or k[0] != q[0] or v[0] != q[0]:
        raise Unprovable("the new K/V tokens are not as many as the query tokens")
    if heads % kv_heads:
        raise Unprovable(f"{heads} query heads do not fit {kv_heads} KV heads")
    if head % 8:
        raise Unprovable(f"head size {head}: GroupQueryAttention needs a multiple of 8")
    dtypes = {ev.dtype(x) for x in (query, key.past, key.new, value.past, value.new)}
    if len(dtypes) != 1 or not dtypes <= ATTENTION_DTYPES:
        names = sorted(str(d) for d in dtypes)
        raise Unprovable(f"Q/K/V/cache element types {names} are not one fp32, fp16 or bf16 type")
    return heads, kv_heads, head


def _mask_facts(
    ev: SymbolicEvaluator, graph: ir.Graph, node: ir.Node, *, query_len: Affine, past: Affine, batch: Affine
) -> tuple[MaskFacts, bool]:
    """The proven mask (attn_mask AND is_causal, bottom-right) and whether its columns need fitting."""
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    total = past + query_len
    cond, fit, columns = Conj(), False, total
    if mask is not None:
        columns = ev.shape(mask)[-1] if ev.shape(mask) else ONE
        fit = columns != total
        try:
            try:
                cond = mask_condition(ev, mask, query_len=query_len, kv_len=columns)
            except Unprovable:
                tied = counted_tie(mask, columns, total)
                if tied is None:
                    raise
                cond = mask_condition(tied, mask, query_len=query_len, kv_len=total)
        except Unprovable as reason:
            raise reason.wrapped(f"attn_mask {mask.name!r} is not a provable causal/padding mask: ") from None
    if attribute(node, "is_causal", 0):  # bottom-right: offset = past_sequence_length
        cond = cond & Conj.of(Le(Affine.of(KEY) - Affine.of(QUERY) - past))
    facts = mask_facts(cond, past=past, batch=batch)
    if not facts.causal:
        raise Unprovable(not_causal(node, mask))
    if fit:
        padding = next((v for v in graph.inputs if v.name == facts.padding), None)
        declared = ev.declared_shape(padding) if padding is not None else ()
        if len(declared) != 2 or declared[1] != columns:
            raise Unprovable(f"the mask has {columns} key columns, the cache {total}")
    return facts, fit


def match_cached_attention(ev: SymbolicEvaluator, graph: ir.Graph, node: ir.Node) -> AttentionMatch:
    """Prove that an ONNX ``Attention`` holding its own cache is GQA with that cache; raise otherwise."""
    inputs = _inputs(node)
    static = _static_cache_refusal(node)
    if static is not None:
        raise Refused(static)
    with proof_step(FusionRefusalCode.ATTENTION_NODE):
        if inputs[_NONPAD] is not None:
            if inputs[_PAST_KEY] is None and inputs[_PAST_VALUE] is None:
                raise Unprovable(
                    "Attention reads an external cache sized by nonpad_kv_seqlen (no past_key/past_value): "
                    "GroupQueryAttention needs the cache as past/present inputs and outputs"
                )
            raise Unprovable(
                "Attention combines past_key/past_value with nonpad_kv_seqlen (the specification forbids it)"
            )
        if (inputs[_PAST_KEY] is None) != (inputs[_PAST_VALUE] is None):
            raise Unprovable("Attention has only one of past_key and past_value")
        query = inputs[0]
        if query is None:
            raise Unprovable("Attention lacks Q")
        precision = node.attributes.get("softmax_precision")
        if precision is not None and precision.as_int() != ir.DataType.FLOAT:
            raise Unprovable(f"softmax_precision={precision.as_int()} (GQA computes softmax in float32)")
    with proof_step(FusionRefusalCode.CACHE):
        key, value = _own_cache_link(ev, graph, node, 0), _own_cache_link(ev, graph, node, 1)
    with proof_step(FusionRefusalCode.SHAPES):
        rank = len(ev.shape(query))
        if rank == 3:
            heads, kv_heads, head = _bsh_shapes(ev, node, query, key, value)
        elif rank == 4:
            heads, kv_heads, head = check_shapes(ev, query, key, value)
        else:
            raise Unprovable(f"Attention's query is {rank}-D, not 3-D or 4-D")
    with proof_step(FusionRefusalCode.MASK):
        q_dims = ev.shape(query)
        query_len = q_dims[1] if rank == 3 else q_dims[2]
        facts, fit = _mask_facts(
            ev, graph, node, query_len=query_len, past=ev.shape(key.past)[2], batch=q_dims[0]
        )
    with proof_step(FusionRefusalCode.ATTENTION_NODE):
        probs, scale = probs_and_scale(node, head)
    return AttentionMatch(
        node=node,
        output=node.outputs[0],
        query=query,
        key=key,
        value=value,
        num_heads=heads,
        kv_num_heads=kv_heads,
        head_size=head,
        scale=scale,
        mask=facts,
        softcap=attribute(node, "softcap", 0.0),
        probs=probs,
        fit_mask=fit,
    )


class CachedAttentionFusionPass(FusionPass):
    """Replace each ONNX ``Attention`` holding its own cache with GroupQueryAttention where the two
    are proven equivalent for unpadded and left-padded rows (docs/exporting.md, "What is proven";
    the loop, the report: :class:`~onnx_kvcache.passes.fusion._base.FusionPass`)."""

    label = "Attention with its own cache"
    reports_elsewhere = True
    warns = "Attention node(s) left as they are"

    def is_candidate(self, node: ir.Node) -> bool:
        return holds_own_cache(node)

    def match(self, ev: SymbolicEvaluator, graph: ir.Graph, node: ir.Node) -> AttentionMatch:
        return match_cached_attention(ev, graph, node)
