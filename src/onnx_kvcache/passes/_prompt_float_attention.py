"""Experimental, not used by ``convert`` or ``optimize_model`` (issue 43): a quantized cache whose
multi-token calls (the prompt) attend through onnxruntime's float GroupQueryAttention kernel.
Before it can be: the attention sites inside the ``If`` branches (inspect, the runner and
calibration would see two nodes a layer), evaluate's call pattern (a chunk attends in float),
the emulation and the rule line. Measured in ``benchmarks/cpu_prefill.md``.

Why: onnxruntime's CPU GroupQueryAttention with a quantized cache (``k_quant_type`` /
``v_quant_type`` PER_TENSOR or PER_CHANNEL, ``kv_cache_bit_width`` 8 or 4; 1.32) quantizes the
new tokens into the present cache first and then attends over the whole present cache through
MLAS's fused dequantize-and-dot kernels (``MlasQKGemm``, ``MlasSVGemm``, inside a tiled
online-softmax loop): every key and value row is dequantized again for every block of queries
(``MlasSVGemm``'s portable path: for every query row), and the dot products are not a blocked
SGEMM. The float kernel attends with MLAS's SGEMM (or its float flash kernel). For a prompt
of S tokens both do O(S^2) work, but the quantized kernel's is several times slower: 2.7x the
prefill time of the float folder at 4,000 tokens on SmolLM2-135M (issue 43).

What this pass writes, per quantized GroupQueryAttention node::

    cond = Squeeze(Greater(Shape(query)[1:2], 1))          # more than one new token
    out, present_key, present_value = If(cond,
        then: past_f = dequantize(past)                      # the cache's own rule: q * scale
              out, present_f = GroupQueryAttention(query, ..., past_f, ...)   # no quant attrs
              present = quantize(present_f)                  # rint(x * (1/scale)), clamped;
                                                             # int4: (q + 8) nibbles, even
                                                             # channel in the low nibble
        else: the quantized node as it was)

Numerical rule. A call of one token (decode) is unchanged: the new token is quantized before
it is attended, every earlier position is attended as stored. In a call of S > 1 tokens the
earlier positions are attended as stored (dequantized) and the S new tokens attend to each
other **unquantized**; the cache then stores them quantized by the kernel's rule. Stored
positions are not changed: ``quantize(dequantize(q)) == q`` for every code (``q * s * (1/s)``
is within float32 rounding of ``q``, far inside rint's half step), so the past passes through
the float branch exactly. A model scored one token a step (the real-model perplexity) computes
exactly what the quantized node computes; teacher-forced chunks and the prompt's own logits get
the float kernel's attention within the chunk (closer to the float model, not further).

Shared buffer (onnxruntime-genai ``search.past_present_share_buffer: true``: past and present
bound to one buffer of ``max_length`` rows): the float branch dequantizes and requantizes the
whole buffer (linear in ``max_length``, once per multi-token call); the else branch's node gets
the bound buffer as both past and present when onnxruntime places the If's outputs in the
caller's buffers, as the quantized node did. Measured in ``notes43.md``.

Restrictions of the draft: CPU int8/int4 (no fp8: no CPU kernel), ``k_quant_type`` equal to
``v_quant_type`` (the kernel's own rule), float32 queries; opset 18 or newer for int4
(``BitShift``/``BitwiseAnd`` unpacking). Nodes that are not quantized are left alone.
"""

from __future__ import annotations

__all__ = ["PromptFloatAttentionPass"]

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.passes._base import InPlacePass
from onnx_kvcache.passes._graph import Builder, Codec

_QUANT_ATTRS = ("k_quant_type", "v_quant_type", "kv_cache_bit_width")
_F32 = ir.DataType.FLOAT


def _attr(node: ir.Node, name: str, default=None):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _is_quantized(node: ir.Node) -> bool:
    return (
        node.op_type == "GroupQueryAttention"
        and node.domain == "com.microsoft"
        and _attr(node, "k_quant_type", "NONE") != "NONE"
        and _attr(node, "kv_cache_bit_width", 0) in (4, 8)
    )


def _head_size(node: ir.Node) -> int:
    heads, kv_heads = _attr(node, "num_heads"), _attr(node, "kv_num_heads")
    query = node.inputs[0]
    width = query.shape[-1] if query is not None and query.shape is not None else None
    if not isinstance(width, int):
        raise ValueError(f"{node.name}: the query's last dimension is not known")
    packed = len(node.inputs) < 2 or node.inputs[1] is None
    return width // (heads + 2 * kv_heads) if packed else width // heads


def _codec(b: Builder, fmt, scale: ir.Value, kv_heads: int, head: int, per_channel: bool) -> Codec:
    return Codec.reshaped(b, fmt, scale, [kv_heads, 1, head] if per_channel else [])


class PromptFloatAttentionPass(InPlacePass):
    """Route every multi-token call of a quantized GroupQueryAttention node through the float
    kernel (see the module docstring for the graph and its numerical rule)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        nodes = [n for n in graph if _is_quantized(n)]
        for index, node in enumerate(nodes):
            self._rewrite(graph, node, index)
        if nodes and model.opset_imports.get("", 0) < 18:
            raise ValueError("the float branch needs opset 18 (BitShift/BitwiseAnd for int4)")
        return ir.passes.PassResult(model, modified=bool(nodes))

    def _rewrite(self, graph: ir.Graph, node: ir.Node, index: int) -> None:
        bits = _attr(node, "kv_cache_bit_width")
        fmt = get_format("int8" if bits == 8 else "int4")
        if _attr(node, "k_quant_type") != _attr(node, "v_quant_type"):
            raise ValueError(f"{node.name}: k_quant_type and v_quant_type differ")
        per_channel = _attr(node, "k_quant_type") == "PER_CHANNEL"
        kv_heads, head = _attr(node, "kv_num_heads"), _head_size(node)
        inputs = list(node.inputs)
        past_k, past_v, k_scale, v_scale = inputs[3], inputs[4], inputs[12], inputs[13]
        if past_k is None or past_v is None or k_scale is None or v_scale is None:
            raise ValueError(f"{node.name}: a quantized GroupQueryAttention needs its pasts and scales")
        prefix = node.name or f"gqa_{index}"

        # the condition, in the outer graph
        outer = Builder(f"{prefix}/prompt_float")
        q_len = outer.op("Shape", [inputs[0]], start=1, end=2)
        one = outer.const(np.array([1], np.int64))
        cond = outer.op("Squeeze", [outer.op("Greater", [q_len, one])], dtype=ir.DataType.BOOL)

        # then: dequantize the past, float attention, quantize the present
        b = Builder(f"{prefix}/prompt_float/then")
        k_codec = _codec(b, fmt, k_scale, kv_heads, head, per_channel)
        v_codec = _codec(b, fmt, v_scale, kv_heads, head, per_channel)
        float_inputs = inputs[:12]
        float_inputs[3] = k_codec.load(past_k, head, _F32)
        float_inputs[4] = v_codec.load(past_v, head, _F32)
        while float_inputs and float_inputs[-1] is None:
            float_inputs.pop()
        attrs = {k: a.value for k, a in node.attributes.items() if k not in _QUANT_ATTRS}
        out, present_kf, present_vf = b.ops(
            "GroupQueryAttention", float_inputs, 3, domain="com.microsoft", **attrs
        )
        present_k = k_codec.store(present_kf, head)
        present_v = v_codec.store(present_vf, head)
        then_graph = ir.Graph([], [out, present_k, present_v], nodes=b.nodes, name=f"{prefix}/then")

        # the If replaces the node's outputs (graph outputs included) by its own
        if_node = ir.node(
            "If",
            [cond],
            {"then_branch": then_graph},
            num_outputs=3,
            name=f"{prefix}/prompt_float/If",
        )
        for old, new in zip(node.outputs, if_node.outputs, strict=True):
            new.shape, new.type = old.shape, old.type  # the type carries the dtype
        ir.convenience.replace_all_uses_with(
            list(node.outputs), list(if_node.outputs), replace_graph_outputs=True
        )
        for old, new in zip(node.outputs, if_node.outputs, strict=True):
            name = old.name
            old.name = f"{name}/quantized"
            new.name = name
        for n in outer.nodes:
            graph.insert_before(node, n)
        graph.insert_before(node, if_node)
        graph.remove(node, safe=False)
        else_graph = ir.Graph([], list(node.outputs), nodes=[node], name=f"{prefix}/else")
        if_node.attributes["else_branch"] = ir.AttrGraph("else_branch", else_graph)
