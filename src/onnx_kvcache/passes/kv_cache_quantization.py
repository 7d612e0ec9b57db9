"""Store the KV cache of every attention node in a quantized format.

Rules, for each attention node of :data:`~onnx_kvcache.cache.operators.ATTENTION_OPS`
(``com.microsoft::GroupQueryAttention``, ``com.microsoft::PagedAttention``) in the main graph,
its subgraphs and the model's functions; every slot, shape and attribute comes from the
node's operator row:

1. A node without its caches (GQA inputs 3/4; PagedAttention ``key_cache``/``value_cache``,
   or ``key_cache`` alone with ``kv_cache_layout="LATENT"``) is left alone. A cache that is
   not a graph input (a non-empty initializer, or produced by another node) is skipped with
   a warning naming the node; an empty initializer is retyped along with its value. A
   function's cache input is retyped at every call site too. A node that reads another
   node's present as its past (KV sharing across layers) is converted with that writer,
   sharing its layer id and scales; the two convert together or not at all, and a present
   read by any other node is skipped.
2. The caches in and out take the format's element type and keep their shapes; int4 packs two
   values a byte, so the head dimension becomes the static ``(head_size + 1) // 2``, also where
   it was symbolic (runtimes allocate caches from the declared shape). A cache also read by a
   node other than a converted attention node skips the node's group with a warning, but for
   Shape and Size, which read only its dimensions: where int4 packs the head dimension they are
   rewritten to give the head size still (:mod:`._shape_readers`). Key and value caches of one
   node must agree in every static dimension but the last, and in their heads axis with
   ``kv_num_heads`` (else the model is malformed: error).
3. float32 scales go to the row's scale inputs (GQA 12/13, PagedAttention 14/15): ``[1]``
   per tensor; per channel ``kv_num_heads * head_size`` (GQA, flat) or
   ``(kv_num_heads, 1, head_size)`` (PagedAttention), as onnxruntime-genai writes them. They
   are named after the cache they scale: two nodes reading one cache share a scale, distinct
   caches never do. A single (LATENT) cache takes the layer's K scale and no V scale. With
   ``shared_kv_scale`` one tensor holding ``max(k, v)`` feeds both slots (CUDA's quantized
   GQA decode fast path needed one tensor before onnxruntime 1.29); a warning says when that
   makes a layer's K or V scale more than 2x coarser.
4. The row's quantization attributes are set: ``k_quant_type``/``v_quant_type``, and
   ``kv_cache_bit_width`` (GQA) or, for a packed format, ``k_cache_dtype``/``v_cache_dtype``
   = ``"int4"`` (PagedAttention; never ``"float4e2m1"``, which no kernel reads). A LATENT
   node gets the key side's only. Every other attribute and input is kept as it was.
5. A node already in the requested format and granularity is left alone, or gets the new
   scale values when scales are given (or its own made one tensor with ``shared_kv_scale``).
   A replaced constant scale read only by that side's scale slots keeps its name (genai's
   ``model.layers.{i}.attn.k_scale``); a scale graph input left unread is removed. A node
   in another (fp8/int8/int4, per tensor/per channel) is requantized: converted as its
   float model would be, with the scales given or, without them, its own scales (constants)
   retargeted: ``scale * old_qmax / new_qmax`` (the
   same threshold, as :meth:`~onnx_kvcache.scales.files.KvCacheScales.retarget` computes it), per
   channel to per tensor by their max, per tensor to per channel by broadcasting. A packed
   cache unpacked again takes the static head size. Leftover attributes of the old format
   (PagedAttention's ``k_cache_dtype``) are removed. Without scales, a granularity change and
   fp8 unit scales (1.0) given to an integer format warn: they are not what calibrating for
   the target would give (docs/scales.md, "Requantizing"); so do mse thresholds (a scale
   file's ``method``, or the marker of our conversion) moved to another format.

A model with no attention node at all but attention a fusion would try (an export: ONNX
``Attention``, holding its cache or not, or decomposed: the candidate rules of the fusions
``GqaFusionPass`` runs, ``FUSIONS``) is left as it is with an
:class:`~onnx_kvcache.errors.UnfusedAttentionWarning` naming ``GqaFusionPass`` and
``optimize_model``: the pass converts GroupQueryAttention and PagedAttention only.

Every refusal is a :class:`~onnx_kvcache.errors.KvCachePreconditionError` raised by ``requires()``,
before anything changes: an error leaves the model as it was. Warnings (a skipped node, unit
scales) are given once the checks have passed, attributed to the caller's line.
"""

from __future__ import annotations

__all__ = ["Fp8KvCachePass", "KvCacheQuantizationPass", "Unconverted", "format_for", "granularity_for"]

import logging

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat, ScaleGranularity, get_format
from onnx_kvcache.cache.prompt_path import unwrap
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.errors import KvCacheWarning, UnfusedAttentionWarning, require_flags, warn
from onnx_kvcache.passes._base import InPlacePass, preconditions
from onnx_kvcache.passes._kv_cache_endpoints import _head_readers, _retype
from onnx_kvcache.passes._kv_cache_plan import (
    Unconverted,
    _ModelPlan,
    _Plan,
    _Planner,
    format_for,
    granularity_for,
)
from onnx_kvcache.passes._kv_scale_store import _own_scale_name, _ScaleStore
from onnx_kvcache.passes._shape_readers import keep_head_size, keep_query_width
from onnx_kvcache.passes.fusion._window_present import cast_fp8_windows
from onnx_kvcache.scales.files import ScalesLike, as_kv_cache_scales, resolve_granularity

logger = logging.getLogger(__name__)

#: The IR version that introduced a cache element type (float8: IR 9, onnx 1.14).
_MIN_IR_VERSION = {
    ir.DataType.FLOAT8E4M3FN: 9,
    ir.DataType.FLOAT8E4M3FNUZ: 9,
    ir.DataType.FLOAT8E5M2: 9,
    ir.DataType.FLOAT8E5M2FNUZ: 9,
}


class KvCacheQuantizationPass(InPlacePass):
    """Quantize the KV cache of GroupQueryAttention and PagedAttention nodes.

    Args:
        format: ``fp8`` (FLOAT8E4M3FN), ``int8`` or ``int4`` (uint8, two values a byte).
        granularity: A :data:`~onnx_kvcache.cache.formats.SCALE_GRANULARITIES` name; None takes the
            one the scales record (calibration and our scale files do), else the one an
            already-quantized model's caches have, else ``per_tensor``.
        scales: ``None``, a :class:`KvCacheScales`, ``{layer_id: (k, v)}`` or a scale
            file path. ``None`` means unit scales for fp8 (with a warning) and is an
            error for int8/int4, but an already-quantized node keeps its own scales,
            retargeted to the format and granularity (rule 5).
        shared_kv_scale: Feed one tensor, ``max(k, v)``, to both scale inputs (CUDA's
            quantized decode fast path before onnxruntime 1.29 needs k_scale and v_scale to
            be one tensor). The smaller of the two gets coarser: warns beyond 2x.
    """

    def __init__(
        self,
        format: str = "fp8",
        granularity: str | None = None,
        scales: ScalesLike = None,
        *,
        shared_kv_scale: bool = False,
    ) -> None:
        super().__init__()
        require_flags(shared_kv_scale=shared_kv_scale)
        self.format: CacheFormat = get_format(format)
        self.scales = as_kv_cache_scales(scales, format=self.format.name)
        """Read once (a scale file is read here, not at every run)."""
        unrecorded = granularity is None and (self.scales is None or self.scales.granularity is None)
        self.granularity: str | None = None if unrecorded else resolve_granularity(granularity, self.scales)
        """None: each model decides (:func:`granularity_for`): scales that record none
        (onnxruntime-genai's files) fit its caches; without scales, its quantized caches'."""
        self.shared_kv_scale = shared_kv_scale

    def requires(self, model: ir.Model) -> None:
        """Every refusal (scales missing or of the wrong size, a cache in another format, a
        malformed node) is raised here, before the model changes."""
        with preconditions():
            self._plan_model(model)

    def unconverted(self, model: ir.Model) -> list[Unconverted]:
        """The nodes whose caches this pass would leave in their type (a skipped node, rule 1
        and 2), with why; nothing changes. Raises what :meth:`requires` raises."""
        with preconditions():
            return self._plan_model(model).skipped

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        unwrapped = unwrap(model)  # a wrapped node is rewritten as itself (cache.prompt_path)
        planned = self._plan_model(model)
        plans, notes = planned.sites, planned.notes
        if not plans and not find_attention_sites(model, with_cache_only=False):
            notes = [*_unfused_notes(model, type(self).__name__), *notes]
        for note in notes:
            warn(note)
        store = _ScaleStore(model)
        modified = bool(unwrapped)
        for plan in plans:
            modified |= self._apply(plan, store, planned.granularity)
        cast_fp8_windows(model.graph)  # a rolling window's rows gathered through float16
        modified |= store.modified | store.remove_unused()
        if plans and model.ir_version < _MIN_IR_VERSION.get(self.format.dtype, 0):
            model.ir_version = _MIN_IR_VERSION[self.format.dtype]  # the cache type is newer than it
            modified = True
        counts: dict[str, int] = {}
        for plan in plans:
            counts[plan.site.op.op_type] = counts.get(plan.site.op.op_type, 0) + 1
        moved = sorted(
            {f"{p.source.format.name} {p.source.granularity.name}" for p in plans if p.source and not p.done}
        )
        logger.info(
            "KV cache: %s in %s %s format%s%s.",
            ", ".join(f"{n} {op} node(s)" for op, n in counts.items()) or "no attention node",
            self.format.name,
            planned.granularity.name,
            f" (requantized from {', '.join(moved)}, "
            + ("the scales given)" if self.scales is not None else "its own scales retargeted by qmax)")
            if moved
            else "",
            "" if modified else " (already converted, nothing changed)",
        )
        return ir.passes.PassResult(model, modified=modified)

    def _plan_model(self, model: ir.Model) -> _ModelPlan:
        """What the pass will do to each site, and the warnings it will give; raises
        :class:`KvCachePreconditionError` when it cannot convert."""
        return _Planner(self.format, self.granularity, self.scales, self.shared_kv_scale).plan_model(model)

    def _apply(self, plan: _Plan, store: _ScaleStore, granularity: ScaleGranularity) -> bool:
        site = plan.site
        node, op = site.node, site.op
        modified = False
        unpack = plan.source is not None and plan.source.format.packed
        if self.format.packed and not plan.done and plan.head_size is not None:
            for reader in _head_readers(plan.sources + plan.sinks):  # they keep seeing the head size
                modified |= keep_head_size(reader, plan.head_size)
            heads = site.num_heads + 2 * site.kv_num_heads if site.packed_qkv else site.num_heads
            rank = 3 if op.op_type == "GroupQueryAttention" else 2  # PagedAttention: [tokens, hidden]
            modified |= keep_query_width(site.input("query"), heads * plan.head_size, rank, site.query_dtype)
        for value in plan.sources + plan.sinks:
            modified |= _retype(value, self.format, plan.head_size, unpack=unpack)
        if plan.k_scale is not None and plan.v_scale is not None:
            owner = site.owner  # scales are named after the owner's caches: one per cache
            shape = op.scale_shape(granularity.name, site.kv_num_heads, plan.head_size or 0)
            arrays = {"key": plan.k_scale, "value": plan.v_scale}
            values: dict[str, ir.Value] = {}
            if self.shared_kv_scale and len(site.sides) > 1:
                shared = np.maximum(plan.k_scale, plan.v_scale)
                name = f"{owner.past_key.name}_kv_scale"  # type: ignore[union-attr]
                values = dict.fromkeys(arrays, store.put(owner, name, shared, shape))
            else:
                for side in site.sides:
                    name = _own_scale_name(site, side) or f"{owner.past(side).name}_scale"  # type: ignore[union-attr]
                    values[side.kind] = store.put(owner, name, arrays[side.kind], shape)
            slots = [(op.slot(side.scale), values[side.kind]) for side in site.sides]
            last = max(slot for slot, _ in slots)
            if len(node.inputs) <= last:
                node.resize_inputs(last + 1)
            for slot, value in slots:
                if node.inputs[slot] is not value:
                    store.retire(node.inputs[slot])
                    node.replace_input_with(slot, value)
                    modified = True
        attributes = op.quant_attributes(self.format, granularity.name, site.sides)
        for name, wanted in attributes.items():
            attr = ir.AttrString(name, wanted) if isinstance(wanted, str) else ir.AttrInt64(name, wanted)
            old = node.attributes.get(name)
            if old is None or old.value != attr.value:
                node.attributes[name] = attr
                modified = True
        if plan.source is not None and not plan.done:  # another format's leftovers (k_cache_dtype)
            for name in set(op.quant_attribute_names) - set(attributes):
                modified |= node.attributes.pop(name, None) is not None
        return modified


class Fp8KvCachePass(KvCacheQuantizationPass):
    """FP8 E4M3 per-tensor KV cache (CUDA, SM 8.9+): the common case in one name."""

    def __init__(self, scales: ScalesLike = None, *, shared_kv_scale: bool = False) -> None:
        super().__init__("fp8", "per_tensor", scales, shared_kv_scale=shared_kv_scale)


def _unfused_notes(model: ir.Model, name: str) -> list[KvCacheWarning]:
    """The warning for a model whose attention this pass converts only once fused (an export)."""
    from onnx_kvcache.passes.fusion.gqa_fusion import fusion_candidates  # only when there is no GQA

    found = fusion_candidates(model)
    if not found:
        return []
    first = found[0].name or found[0].op_type
    return [
        UnfusedAttentionWarning(
            f"{name} converted nothing: the model has no GroupQueryAttention or PagedAttention node, "
            f"but {len(found)} attention node(s) (ONNX Attention, holding its cache or not, or decomposed; "
            f"first {first}) that "
            "become GroupQueryAttention only by fusion. Run GqaFusionPass first "
            f"(ir.passes.PassManager([GqaFusionPass(), {name}(...)])), or call optimize_model, which "
            "fuses, checks the target and quantizes (docs/exporting.md)."
        )
    ]
