"""A quantized cache whose multi-token calls (the prompt) attend through the float kernel.

``convert`` and ``optimize_model`` run it after quantizing where the target's capability row
says so (``FormatSupport.prompt_in_float``: onnxruntime's CPU int8 and int4 caches); measured
in ``benchmarks/cpu_prefill.md``. :mod:`onnx_kvcache.cache.prompt_path` recognizes the form
it writes (the wrapped node is the attention site) and undoes it for the passes that rewrite
attention nodes.

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
caller's buffers, as the quantized node did.

Which nodes it wraps: GroupQueryAttention nodes of the main graph with an int8 or int4 cache
(no fp8: no CPU kernel holds one), ``k_quant_type`` equal to ``v_quant_type``, float32 or
float16 queries, no attention-probability output (``qk_output``), not window-sized
(``sliding_window_cache=1``, an onnxruntime-genai folder's: onnxruntime 1.32's float kernel refuses
an empty first past there, which its quantized kernel takes), whose pasts are graph inputs and
presents graph outputs (a rolling window cache's through its row gather,
:func:`~onnx_kvcache.cache.rolling.present_output`; a node reading another's present, KV sharing,
keeps the quantized kernel), and for int4 an opset
of 18 or newer (``BitwiseAnd`` unpacks the nibbles). Every other node is left as it is and
listed in :attr:`PromptFloatAttentionPass.skipped` with the reason. A wrapped node is not
wrapped again.
"""

from __future__ import annotations

__all__ = ["PromptFloatAttentionPass"]

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat
from onnx_kvcache.cache.operators import GQA
from onnx_kvcache.cache.prompt_path import WRAPPED_SUFFIX
from onnx_kvcache.cache.rolling import present_output
from onnx_kvcache.cache.sites import CacheSite, find_gqa_sites
from onnx_kvcache.passes._base import InPlacePass
from onnx_kvcache.passes._graph import Builder, Codec

#: Query dtypes the float branch computes in (onnxruntime's CPU GQA: float32 and float16).
_QUERY_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
#: The scale inputs the float node goes without.
_SCALE_SLOTS = ("k_scale", "v_scale")


def _opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


def _why_not(site: CacheSite, opset: int, main: ir.Graph) -> str | None:
    """Why ``site`` keeps the quantized kernel for every call, or None: it is wrapped."""
    fmt = site.cache_format
    checks = (
        (site.wrapper is not None, "already wrapped"),
        (site.node.graph is not main, "not in the main graph"),
        (
            site.int_attr("sliding_window_cache") == 1,
            "a window-sized cache: onnxruntime 1.32's float kernel refuses the empty first past its "
            "quantized kernel takes",
        ),
        (fmt is None or fmt.is_float, "not an int8 or int4 cache"),
        (len(site.node.outputs) > 3, "it outputs its attention scores or probabilities (qk_output)"),
        (
            site.str_attr("k_quant_type") != site.str_attr("v_quant_type"),
            "k_quant_type and v_quant_type differ",
        ),
        (site.query_dtype not in _QUERY_DTYPES, "its query is neither float32 nor float16"),
        (
            any(not (p := site.past(s)) or not p.is_graph_input() for s in site.sides),
            "its past is not a graph input",
        ),
        (
            any(not (p := present_output(site.present(s))) or not p.is_graph_output() for s in site.sides),
            "its present is not a graph output",
        ),
        (
            fmt is not None and fmt.packed and opset < 18,
            f"a packed cache needs opset 18 (the model's: {opset})",
        ),
    )
    return next((why for failed, why in checks if failed), None)


class PromptFloatAttentionPass(InPlacePass):
    """Route every multi-token call of a quantized GroupQueryAttention node through the float
    kernel (see the module docstring for the graph, its numerical rule and which nodes)."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: dict[str, str] = {}
        """Each node left as it is, by name, and why (the last call's)."""
        self.wrapped = 0
        """Nodes the last call wrapped."""

    @staticmethod
    def wrappable(model: ir.Model) -> int:
        """How many of ``model``'s nodes the pass would wrap (nothing changes)."""
        opset = _opset(model)
        return sum(1 for site in find_gqa_sites(model) if _why_not(site, opset, model.graph) is None)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = _opset(model)
        self.skipped, self.wrapped = {}, 0
        for site in find_gqa_sites(model):
            why = _why_not(site, opset, model.graph)
            if why is None:
                _wrap(model.graph, site, self.wrapped)
                self.wrapped += 1
            elif site.wrapper is None:
                self.skipped[site.name] = why
        return ir.passes.PassResult(model, modified=bool(self.wrapped))


def _codec(b: Builder, fmt: CacheFormat, scale: ir.Value, site: CacheSite, head: int) -> Codec:
    per_channel = site.granularity == "per_channel"
    return Codec.reshaped(b, fmt, scale, [site.kv_num_heads, 1, head] if per_channel else [])


def _wrap(graph: ir.Graph, site: CacheSite, index: int) -> None:
    node, fmt = site.node, site.cache_format
    assert fmt is not None
    head, dtype = site.head_size(), site.query_dtype or ir.DataType.FLOAT
    past_k, past_v = site.past_key, site.past_value
    k_scale, v_scale = (site.input(slot) for slot in _SCALE_SLOTS)
    assert past_k is not None and past_v is not None and k_scale is not None and v_scale is not None
    prefix = node.name or f"gqa_{index}"

    # the condition, in the outer graph: more than one new token
    outer = Builder(f"{prefix}/prompt_float")
    q_len = outer.op("Shape", [site.input("query")], start=1, end=2)
    one = outer.const(np.array([1], np.int64))
    cond = outer.op("Squeeze", [outer.op("Greater", [q_len, one])], dtype=ir.DataType.BOOL)

    # then: dequantize the past, float attention, quantize the present
    b = Builder(f"{prefix}/prompt_float/then")
    k_codec, v_codec = _codec(b, fmt, k_scale, site, head), _codec(b, fmt, v_scale, site, head)
    float_inputs = list(node.inputs)
    float_inputs[GQA.slot("past_key")] = k_codec.load(past_k, head, dtype)
    float_inputs[GQA.slot("past_value")] = v_codec.load(past_v, head, dtype)
    for slot in _SCALE_SLOTS:
        float_inputs[GQA.slot(slot)] = None
    while float_inputs and float_inputs[-1] is None:
        float_inputs.pop()
    quant = set(GQA.quant_attribute_names)
    attrs = {k: a.value for k, a in node.attributes.items() if k not in quant}
    out, present_kf, present_vf = b.ops("GroupQueryAttention", float_inputs, 3, domain=GQA.domain, **attrs)
    out.type = ir.TensorType(dtype)  # both branches declare their outputs' types (onnx's If inference)
    present_k = k_codec.store(present_kf, head)
    present_v = v_codec.store(present_vf, head)
    then_graph = ir.Graph([], [out, present_k, present_v], nodes=b.nodes, name=f"{prefix}/then")

    # the If takes the node's outputs (graph outputs included) and their names
    olds = list(node.outputs)[:3]
    if_node = ir.node(
        "If", [cond], {"then_branch": then_graph}, num_outputs=3, name=f"{prefix}/prompt_float/If"
    )
    types = (dtype, past_k.dtype or fmt.dtype, past_v.dtype or fmt.dtype)  # an export's may declare none
    for old, new, kind in zip(olds, if_node.outputs, types, strict=True):
        if old.dtype is None:  # both branches and the If declare every output's type (onnx's check)
            old.type, old.shape = ir.TensorType(kind), None
        new.type, new.shape = ir.TensorType(old.dtype or kind), old.shape
    ir.convenience.replace_all_uses_with(olds, list(if_node.outputs), replace_graph_outputs=True)
    for old, new in zip(olds, if_node.outputs, strict=True):
        name = old.name
        old.name = f"{name}{WRAPPED_SUFFIX}"
        new.name = name
    for n in outer.nodes:
        graph.insert_before(node, n)
    graph.insert_before(node, if_node)
    graph.remove(node, safe=False)
    else_graph = ir.Graph([], olds, nodes=[node], name=f"{prefix}/else")
    if_node.attributes["else_branch"] = ir.AttrGraph("else_branch", else_graph)
