"""Run an fp8-cache GroupQueryAttention on CPU by computing what the GPU kernel does.

FP8 GQA has no CPU kernel. The kernel's rule: new K (after RoPE) and V are quantized
on write, saturating at +-448, and attention reads every position dequantized, the
current step's own tokens included. Each fp8-cache GQA node becomes:

1. RoPE applied outside the node (``com.microsoft::RotaryEmbedding``, positions from
   ``position_ids``, or ``seqlens_k`` and ``query_seqlens``), after the per-head q/k RMS
   norm of inputs 14/15 if any (so Qwen3-style nodes, which the CPU kernel rejects, run);
2. new K/V round-tripped through fp8: ``Cast(x / s -> float8e4m3fn, saturate) * s``;
3. the past cache dequantized: ``Cast(past -> float) * s``;
4. a float-cache GQA without rotary on the dequantized tensors;
5. its present outputs quantized back to fp8, exactly (they lie on the fp8 grid).

Graph inputs and outputs keep their FLOAT8E4M3FN types, so feeds and caches are the
same as on the GPU. Other attributes (window, softcap, sinks) stay on the inner node.
"""

from __future__ import annotations

__all__ = ["Fp8KvCacheEmulationPass", "emulate_fp8_kv_cache"]

import logging

import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.gqa import (
    COS_CACHE,
    K_NORM,
    K_SCALE,
    KEY,
    PAST_KEY,
    PAST_VALUE,
    POSITION_IDS,
    Q_NORM,
    QUERY,
    QUERY_SEQLENS,
    SEQLENS_K,
    SIN_CACHE,
    V_SCALE,
    VALUE,
    GqaSite,
    find_gqa_sites,
)

logger = logging.getLogger(__name__)

_FP8 = ir.DataType.FLOAT8E4M3FN
_QUANT_ATTRS = (
    "k_quant_type",
    "v_quant_type",
    "kv_cache_bit_width",
    "do_rotary",
    "rotary_interleaved",
    "qk_norm_epsilon",
    "q_norm_epsilon",
    "k_norm_epsilon",
)


class _Emitter:
    """Creates nodes before an anchor node in its graph."""

    def __init__(self, site: GqaSite) -> None:
        self.node = site.node
        self.graph = site.node.graph
        self.prefix = (site.node.name or f"gqa{site.layer_id}") + "/fp8_emulation"
        self.count = 0

    def op(self, op_type: str, inputs: list, domain: str = "", num_outputs: int = 1, **attrs):
        self.count += 1
        node = ir.Node(
            domain,
            op_type,
            inputs,
            attributes=ir.convenience.convert_attributes(attrs) if attrs else (),
            num_outputs=num_outputs,
            name=f"{self.prefix}/{op_type}_{self.count}",
        )
        assert self.graph is not None
        self.graph.insert_before(self.node, node)
        return node.outputs[0] if num_outputs == 1 else node.outputs

    def const(self, array: np.ndarray) -> ir.Value:
        return self.op("Constant", [], value=ir.tensor(array))


def _scale_shape(e: _Emitter, scale: ir.Value, kv_heads: int, head: int, bnsh: bool) -> ir.Value:
    """Per-tensor scales stay ``[1]``; per-channel become ``[1, H, 1, D]`` (BNSH) or ``[H*D]``."""
    size = scale.shape[0] if scale.shape is not None and len(scale.shape) else None
    if size == 1 or (size is None and scale.const_value is not None and scale.const_value.size == 1):
        return e.op("Reshape", [scale, e.const(np.array([1], np.int64))])
    target = [1, kv_heads, 1, head] if bnsh else [kv_heads * head]
    return e.op("Reshape", [scale, e.const(np.array(target, np.int64))])


def _round_trip(e: _Emitter, x: ir.Value, scale: ir.Value, dtype: ir.DataType) -> ir.Value:
    x32 = e.op("Cast", [x], to=ir.DataType.FLOAT)
    q = e.op("Cast", [e.op("Div", [x32, scale])], to=_FP8, saturate=1)
    return e.op("Cast", [e.op("Mul", [e.op("Cast", [q], to=ir.DataType.FLOAT), scale])], to=dtype)


def _dequantize(e: _Emitter, q: ir.Value, scale: ir.Value, dtype: ir.DataType) -> ir.Value:
    return e.op("Cast", [e.op("Mul", [e.op("Cast", [q], to=ir.DataType.FLOAT), scale])], to=dtype)


def _rms_norm_heads(
    e: _Emitter, x: ir.Value, weight: ir.Value, heads: int, head: int, eps: float, dtype: ir.DataType
) -> ir.Value:
    shape = e.op("Shape", [x])
    split = e.op("Reshape", [x, e.const(np.array([0, 0, heads, head], np.int64))])
    x32 = e.op("Cast", [split], to=ir.DataType.FLOAT)
    mean = e.op("ReduceMean", [e.op("Mul", [x32, x32]), e.const(np.array([-1], np.int64))], keepdims=1)
    rms = e.op("Sqrt", [e.op("Add", [mean, e.const(np.array(eps, np.float32))])])
    normed = e.op("Cast", [e.op("Div", [x32, rms])], to=dtype)
    return e.op("Reshape", [e.op("Mul", [normed, weight]), shape])


def _float_attr(node: ir.Node, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return default if attr is None else attr.as_float()


def _positions(e: _Emitter, site: GqaSite, query: ir.Value) -> ir.Value:
    """Rotary positions of the new rows: ``seqlens_k + 1 - Q + s`` (Q: valid rows)."""
    given = site.input(POSITION_IDS)
    if given is not None:
        return given
    seqlens = e.op("Cast", [_required(site, SEQLENS_K, "seqlens_k")], to=ir.DataType.INT64)  # [B]
    seq = e.op("Gather", [e.op("Shape", [query]), e.const(np.array(1, np.int64))], axis=0)
    valid = seq
    query_seqlens = site.input(QUERY_SEQLENS)
    if query_seqlens is not None:  # right-padded chunks
        valid = e.op("Cast", [query_seqlens], to=ir.DataType.INT64)
    first = e.op("Sub", [e.op("Add", [seqlens, e.const(np.array(1, np.int64))]), valid])  # [B]
    steps = e.op("Range", [e.const(np.array(0, np.int64)), seq, e.const(np.array(1, np.int64))])
    return e.op("Add", [e.op("Unsqueeze", [first, e.const(np.array([1], np.int64))]), steps])


def _required(site: GqaSite, slot: int, what: str) -> ir.Value:
    value = site.input(slot)
    if value is None:
        raise KvCacheError(
            f"Cannot emulate GroupQueryAttention node {site.name}: it has no {what} (input {slot})."
        )
    return value


def _emulate(site: GqaSite) -> None:
    node = site.node
    inputs = list(node.inputs)
    query = _required(site, QUERY, "query")
    past_key = _required(site, PAST_KEY, "past_key")
    past_value = _required(site, PAST_VALUE, "past_value")
    k_scale = _required(site, K_SCALE, "k_scale")
    v_scale = _required(site, V_SCALE, "v_scale")
    dtype = site.query_dtype
    if dtype is None:
        raise KvCacheError(f"GroupQueryAttention node {site.name}: the query has no known dtype.")
    kv, heads = site.kv_num_heads, site.num_heads
    head = site.head_size(cache_is_packed=False)
    e = _Emitter(site)
    key, value = site.input(KEY), site.input(VALUE)
    if key is None or value is None:
        sizes = e.const(np.array([heads * head, kv * head, kv * head], np.int64))
        query, key, value = e.op("Split", [query, sizes], num_outputs=3, axis=-1)
    shared_eps = _float_attr(node, "qk_norm_epsilon", 1e-6)
    q_norm, k_norm = site.input(Q_NORM), site.input(K_NORM)
    if q_norm is not None:
        query = _rms_norm_heads(
            e, query, q_norm, heads, head, _float_attr(node, "q_norm_epsilon", shared_eps), dtype
        )
    if k_norm is not None:
        key = _rms_norm_heads(
            e, key, k_norm, kv, head, _float_attr(node, "k_norm_epsilon", shared_eps), dtype
        )
    if site.int_attr("do_rotary"):
        positions = _positions(e, site, query)
        cos, sin = site.input(COS_CACHE), site.input(SIN_CACHE)
        interleaved = site.int_attr("rotary_interleaved")
        rot = (
            cos.shape[-1] * 2
            if cos is not None and cos.shape is not None and isinstance(cos.shape[-1], int)
            else head
        )
        extra = {"rotary_embedding_dim": rot} if rot != head else {}
        query, key = (
            e.op(
                "RotaryEmbedding",
                [x, positions, cos, sin],
                domain="com.microsoft",
                interleaved=interleaved,
                num_heads=n,
                **extra,
            )
            for x, n in ((query, heads), (key, kv))
        )
    k_new = _round_trip(e, key, _scale_shape(e, k_scale, kv, head, bnsh=False), dtype)
    v_new = _round_trip(e, value, _scale_shape(e, v_scale, kv, head, bnsh=False), dtype)
    k_bnsh = _scale_shape(e, k_scale, kv, head, bnsh=True)
    v_bnsh = _scale_shape(e, v_scale, kv, head, bnsh=True)
    past_k = _dequantize(e, past_key, k_bnsh, dtype)
    past_v = _dequantize(e, past_value, v_bnsh, dtype)

    new_inputs = [query, k_new, v_new, past_k, past_v, *inputs[SEQLENS_K:]]
    new_inputs[COS_CACHE] = new_inputs[SIN_CACHE] = None  # rotary done outside
    new_inputs[POSITION_IDS] = None
    for slot in (K_SCALE, V_SCALE, Q_NORM, K_NORM):
        if slot < len(new_inputs):
            new_inputs[slot] = None
    while new_inputs and new_inputs[-1] is None:
        new_inputs.pop()
    attrs = [a for name, a in node.attributes.items() if name not in _QUANT_ATTRS]
    inner = ir.Node(
        node.domain,
        node.op_type,
        new_inputs,
        attributes=attrs,
        num_outputs=len(node.outputs),
        name=f"{e.prefix}/GroupQueryAttention",
    )
    node.graph.insert_before(node, inner)  # type: ignore[union-attr]
    replacements = list(inner.outputs)
    for index, scale in ((1, k_bnsh), (2, v_bnsh)):
        if index < len(node.outputs) and node.outputs[index] is not None:
            present = inner.outputs[index]
            q = e.op(
                "Cast",
                [e.op("Div", [e.op("Cast", [present], to=ir.DataType.FLOAT), scale])],
                to=_FP8,
                saturate=1,
            )
            replacements[index] = q
    for old, new in zip(node.outputs, replacements):
        new.name, new.type, new.shape = old.name, old.type, old.shape
        if old.is_graph_output():
            graph = node.graph
            assert graph is not None
            graph.outputs[list(graph.outputs).index(old)] = new
        old.replace_all_uses_with(new)
        old.name = None
    node.graph.remove(node, safe=True)  # type: ignore[union-attr]


class Fp8KvCacheEmulationPass(ir.passes.InPlacePass):
    """Rewrite every fp8-cache GQA node to run on CPU; see the module docstring."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        sites = [s for s in find_gqa_sites(model) if s.cache_dtype == _FP8]
        for site in sites:
            if site.function is not None:
                raise KvCacheError(f"Cannot emulate {site.name}: fp8 GQA inside a function is not supported.")
            _emulate(site)
        model.opset_imports.setdefault("com.microsoft", 1)
        if model.opset_imports.get("", 0) < 19:
            raise KvCacheError("fp8 emulation needs opset >= 19 (Cast to float8e4m3fn).")
        logger.info("fp8 emulation: rewrote %d GroupQueryAttention node(s) for CPU.", len(sites))
        return ir.passes.PassResult(model, modified=bool(sites))


def emulate_fp8_kv_cache(model: ir.Model) -> ir.Model:
    """A copy of ``model`` whose fp8-cache GQA nodes run on CPU (the input is unchanged)."""
    copy = model.clone()
    Fp8KvCacheEmulationPass()(copy)
    return copy
