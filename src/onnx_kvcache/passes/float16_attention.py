"""Compute GroupQueryAttention in float16 inside a float32 model, around a quantized cache.

CUDA has no float32 GroupQueryAttention: its kernel takes float16 or bfloat16 queries, fp8
caches included. A float32 model (an export, a float32 build) gets an fp8 (or int8/int4) cache
on CUDA with this pass: only the attention computes in float16, every weight and every other
node stays as it was. Rules, for each GroupQueryAttention node (main graph, subgraphs, the
model's functions) whose query is float32:

1. Each input of the node's T type (its row's ``t_inputs``: query, key, value, cos_cache,
   sin_cache, attention_bias, head_sink, q_norm_weight, k_norm_weight) is read through a
   ``Cast(to=FLOAT16)`` inserted before the node; one Cast per value and graph, shared by every
   node that reads it (the rotary tables every layer reads are cast once). An input whose type
   the graph leaves unstated is float32 too (T is one type), and is cast the same way.
2. Each T output (``output``, ``output_qk``) is written in float16 under a new name and cast
   back to float32 by a ``Cast(to=FLOAT)`` that takes its old name and its place everywhere
   (graph outputs included): what reads it sees float32 as before.
3. The caches are not touched: their type is the cache format's (the kernel quantizes the
   float16 K/V into it). A float32 or bfloat16 cache would mismatch float16 attention, so a
   node with one is refused (:class:`~onnx_kvcache.errors.KvCachePreconditionError`, before anything
   changes): quantize the cache first (``KvCacheQuantizationPass``), then run this pass.
   A float16 cache is kept.
4. Nodes whose query is float16 or bfloat16 already, and PagedAttention nodes, are left alone.

The attention's inputs are rounded to float16 (10-bit mantissa) and its output comes back
with float16 precision: what a float16 model computes in its attention, nothing else.
``optimize_model`` and ``convert_model`` run it after quantizing when the target takes no
float32 query (``pipeline/decision.py``'s :data:`~onnx_kvcache.pipeline.decision.ADAPTATIONS`).
"""

from __future__ import annotations

__all__ = ["FLOAT16_ATTENTION_NOTE", "Float16AttentionPass", "float32_attention_sites"]

import logging

import onnx_ir as ir

from onnx_kvcache.cache.formats import CACHE_FORMATS
from onnx_kvcache.cache.operators import GQA
from onnx_kvcache.cache.prompt_path import unwrap
from onnx_kvcache.cache.sites import CacheSite, find_gqa_sites
from onnx_kvcache.errors import KvCachePreconditionError
from onnx_kvcache.passes._base import InPlacePass, preconditions

logger = logging.getLogger(__name__)

_F16 = ir.DataType.FLOAT16
_F32 = ir.DataType.FLOAT
#: GroupQueryAttention's outputs typed T (the query's type).
_T_OUTPUTS = ("output", "output_qk")
#: Cache types float16 attention can read and write: the quantized formats', and float16.
_CACHE_TYPES = frozenset({fmt.dtype for fmt in CACHE_FORMATS.values()} | {_F16})

#: The one line said when a conversion computes attention in float16 (``{layers}``: a count).
FLOAT16_ATTENTION_NOTE = (
    "{target} has no float32 GroupQueryAttention: the {layers} attention layer(s) compute in float16 "
    "(Casts of their inputs to float16 and of their outputs back to float32; the cache stores "
    "the float16 K/V in {format}); weights and every other node stay float32."
)


def float32_attention_sites(model: ir.Model) -> list[CacheSite]:
    """The GroupQueryAttention nodes whose query (T) is float32: what the pass rewrites."""
    return [site for site in find_gqa_sites(model, with_cache_only=False) if site.query_dtype == _F32]


def _check_caches(site: CacheSite) -> None:
    """Rule 3: the node's caches must be of a type float16 attention reads."""
    for side in site.sides:
        for value in (site.past(side), site.present(side)):
            if value is not None and value.dtype is not None and value.dtype not in _CACHE_TYPES:
                raise KvCachePreconditionError(
                    f"{site.label}: its {side.kind} cache {value.name!r} is {value.dtype.name}, which "
                    "float16 attention cannot read or write; quantize the cache first "
                    "(KvCacheQuantizationPass, or optimize_model / convert with a format), then compute "
                    "the attention in float16."
                )


class Float16AttentionPass(InPlacePass):
    """Cast a float32 GroupQueryAttention's T inputs to float16 and its outputs back; see the
    module docstring."""

    def requires(self, model: ir.Model) -> None:
        """A node with a float32 or bfloat16 cache is refused here, before anything changes."""
        with preconditions():
            for site in float32_attention_sites(model):
                _check_caches(site)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        unwrap(model)  # a wrapped node is rewritten as itself (cache.prompt_path)
        sites = float32_attention_sites(model)
        casts: dict[tuple[int, int], ir.Value] = {}  # (graph, value) -> its float16 Cast
        for site in sites:
            self._rewrite(site, casts)
        logger.info("Attention in float16: %d GroupQueryAttention node(s).", len(sites))
        return ir.passes.PassResult(model, modified=bool(sites))

    def _rewrite(self, site: CacheSite, casts: dict[tuple[int, int], ir.Value]) -> None:
        node, graph = site.node, site.node.graph
        assert graph is not None
        for name in GQA.t_inputs:
            slot = GQA.slot(name)
            value = site.input(slot)
            # T is one type: an input whose type the graph does not state (mobius writes no
            # value_info) is float32 as the node's other T inputs are
            if value is None or value.dtype not in (_F32, None):
                continue
            key = (id(graph), id(value))
            if key not in casts:
                cast = ir.node("Cast", [value], {"to": _F16}, name=f"{value.name}/to_float16")
                cast.outputs[0].name = f"{value.name}/float16"
                cast.outputs[0].type = ir.TensorType(_F16)
                cast.outputs[0].shape = value.shape
                graph.insert_before(node, cast)
                casts[key] = cast.outputs[0]
            node.replace_input_with(slot, casts[key])
        for name in _T_OUTPUTS:
            out = site.output(GQA.out_slot(name))
            if out is None:
                continue
            _cast_back(graph, node, out)


def _cast_back(graph: ir.Graph, node: ir.Node, out: ir.Value) -> None:
    """Rule 2: ``out`` becomes float16; a Cast after ``node`` gives its readers float32 under its name."""
    name, shape = out.name, out.shape
    out.name = f"{name}/float16"
    out.type = ir.TensorType(_F16)
    cast = ir.node("Cast", [out], {"to": _F32}, name=f"{name}/to_float32")
    back = cast.outputs[0]
    back.type, back.shape = ir.TensorType(_F32), shape
    readers = [(user, slot) for user, slot in out.uses() if user is not cast]
    graph.insert_after(node, cast)
    for user, slot in readers:
        user.replace_input_with(slot, back)
    outputs = graph.outputs
    for index, value in enumerate(outputs):
        if value is out:
            outputs[index] = back
    back.name = name
