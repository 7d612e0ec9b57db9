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
``Attention``, or decomposed) is left as it is with an
:class:`~onnx_kvcache.errors.UnfusedAttentionWarning` naming ``GqaFusionPass`` and
``optimize_model``: the pass converts GroupQueryAttention and PagedAttention only.

Every refusal is a :class:`~onnx_kvcache.KvCachePreconditionError` raised by ``requires()``,
before anything changes: an error leaves the model as it was. Warnings (a skipped node, unit
scales) are given once the checks have passed, attributed to the caller's line.
"""

from __future__ import annotations

__all__ = ["Fp8KvCachePass", "KvCacheQuantizationPass", "Unconverted", "format_for", "granularity_for"]

import dataclasses
import logging
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import (
    SCALE_GRANULARITIES,
    CacheFormat,
    ScaleGranularity,
    get_format,
    granularity_of,
    scale_granularity,
)
from onnx_kvcache.cache.operators import AttentionOp, CacheSide, op_of
from onnx_kvcache.cache.sites import CacheSite, constant_values, find_attention_sites, function_call_sites
from onnx_kvcache.errors import (
    Function,
    KvCacheError,
    KvCachePreconditionError,
    KvCacheWarning,
    Message,
    Param,
    ScalesAdjustedWarning,
    SkippedNodeWarning,
    UnfusedAttentionWarning,
    UnitScalesWarning,
    warn,
)
from onnx_kvcache.model_io._marker import calibrated_by
from onnx_kvcache.passes._base import InPlacePass, preconditions
from onnx_kvcache.passes._graph import prepend
from onnx_kvcache.passes._shape_readers import (
    keep_head_size,
    keep_query_width,
    reads_dimensions_only,
    sees_head_dimension,
)
from onnx_kvcache.passes.fusion._window_present import cast_fp8_windows, tail_slice
from onnx_kvcache.scales.files import (
    KvCacheScales,
    ScalesLike,
    as_kv_cache_scales,
    mse_moved,
    resolve_granularity,
)

logger = logging.getLogger(__name__)
#: What a message tells the user to give for scales: ``scales=PATH``, ``--scales PATH``.
SCALE_FILE = Param("scales", placeholder="PATH")


@dataclasses.dataclass
class _Plan:
    """What the pass will do to one site; built before anything changes."""

    site: CacheSite
    done: bool
    """Already in the requested format (only scale values may change)."""
    sources: list[ir.Value]
    sinks: list[ir.Value]
    k_scale: np.ndarray | None
    v_scale: np.ndarray | None
    head_size: int | None = None
    """Known when the cache is packed (its last dimension becomes static)."""
    source: _Quantized | None = None
    """The format and granularity the node's cache is in already (None: a float cache)."""


@dataclasses.dataclass(frozen=True)
class _Quantized:
    """A node's cache as it is: its format and the granularity its attribute states."""

    format: CacheFormat
    granularity: ScaleGranularity


@dataclasses.dataclass
class _ModelPlan:
    """What the pass will do to one model; the pass's settings stay as ``__init__`` set them."""

    granularity: ScaleGranularity
    """The granularity this model's caches are converted to (:func:`granularity_for`)."""
    sites: list[_Plan] = dataclasses.field(default_factory=list)
    notes: list[KvCacheWarning] = dataclasses.field(default_factory=list)
    """The warnings the conversion gives."""
    merged: set[int] = dataclasses.field(default_factory=set)
    """Layers whose given per-channel scales were merged for a per-tensor cache."""
    skipped: list[Unconverted] = dataclasses.field(default_factory=list)
    """The groups of nodes whose caches stay as they are (rule 1, 2), with why."""


@dataclasses.dataclass(frozen=True)
class Unconverted:
    """Nodes whose caches the pass leaves in their type (:meth:`KvCacheQuantizationPass.unconverted`)."""

    layers: tuple[int, ...]
    nodes: tuple[str, ...]
    dtype: str
    """The caches' element type as it stays (``float32``)."""
    reason: str


class _Skip(Exception):
    """A site that cannot be converted; the message says why."""


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
        planned = self._plan_model(model)
        plans, notes = planned.sites, planned.notes
        if not plans and not find_attention_sites(model, with_cache_only=False):
            notes = [*_unfused_notes(model, type(self).__name__), *notes]
        for note in notes:
            warn(note)
        store = _ScaleStore(model)
        modified = False
        for plan in plans:
            modified |= self._apply(plan, store, planned.granularity)
        cast_fp8_windows(model.graph)
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

    # -- planning: checks only, no changes ---------------------------------------------

    def _plan_model(self, model: ir.Model) -> _ModelPlan:
        """What the pass will do to each site, and the warnings it will give; raises
        :class:`KvCachePreconditionError` when it cannot convert."""
        scales = self.scales
        planned = _ModelPlan(scale_granularity(self.granularity or granularity_for(model, scales)))
        sites = find_attention_sites(model)
        cache_readers = {id(s.node): s.op for s in sites}
        groups: dict[int, list[CacheSite]] = {}
        for site in sites:
            groups.setdefault(id(site.owner.node), []).append(site)
        plans: list[_Plan] = []
        notes: list[KvCacheWarning] = []
        for group in groups.values():
            try:
                plans += [self._plan(model, site, group, cache_readers, planned) for site in group]
            except _Skip as e:
                names = ", ".join(s.name for s in group)
                layers = tuple(sorted({s.layer_id for s in group}))
                planned.skipped.append(
                    Unconverted(layers, tuple(s.name for s in group), _dtype_name(group[0]), str(e))
                )
                notes.append(
                    SkippedNodeWarning(
                        f"Skipped {group[0].op.op_type} node(s) {names}: {e}; only caches that are "
                        "graph inputs (or another converted node's present) are converted."
                    )
                )
        self._check_coverage(plans, scales, {s.layer_id for s in sites})
        unused = sorted(
            {
                p.site.layer_id
                for p in plans
                if p.site.single_cache
                and p.k_scale is not None
                and p.v_scale is not None
                and not np.array_equal(p.k_scale, p.v_scale)
            }
        )
        if scales is not None and unused:
            notes.append(
                ScalesAdjustedWarning(
                    f"Layer(s) {unused} keep one (LATENT) cache, read as K and V with the K scale; "
                    "the V scales given for them are not used."
                )
            )
        notes += _retarget_notes(plans, self.format, planned.granularity, scales is None)
        if planned.merged:
            notes.append(
                ScalesAdjustedWarning(
                    f"Layer(s) {sorted(planned.merged)}: the per-channel scales given merged into one per "
                    f"tensor, their max: {_MERGED}."
                )
            )
        moved = sorted({p.source.format.name for p in plans if p.source and p.source.format != self.format})
        if scales is None and moved and calibrated_by(model.metadata_props) == "mse":
            notes.append(
                ScalesAdjustedWarning(mse_moved(moved[0], self.format.name))
            )  # the marker of our conversion says so
        if scales is None and any(not p.done and p.source is None for p in plans):
            notes.append(
                UnitScalesWarning(
                    Message(
                        "No KV-cache scales given: using unit scales (1.0) for the fp8 cache. "
                        "Calibrated scales are more accurate (",
                        Function("calibrate_kv_cache"),
                        ").",
                    )
                )
            )
        if self.shared_kv_scale:
            notes += _shared_scale_coarsens(plans)
        planned.sites, planned.notes = plans, notes
        return planned

    def _source(self, site: CacheSite, target: ScaleGranularity) -> _Quantized | None:
        """The format and granularity the node's cache is in, None for a float cache;
        refuses a cache in a format this library does not know (``target``: the granularity
        converted to, for the message)."""
        quant = site.str_attr(site.op.key.quant_attr, "NONE")
        current, described = _current_format(site)
        if quant == "NONE" and current is None and site.cache_format is None:
            return None
        granularity = site.granularity
        if current is None or granularity is None:
            raise KvCachePreconditionError(
                f"{site.label} already has a quantized KV cache ({described}, {quant.lower()}) in a "
                f"format onnx-kvcache does not know; cannot convert it to {self.format.name} "
                f"{target.name}. Convert the original (unquantized) model instead."
            )
        return _Quantized(current, scale_granularity(granularity))

    def _plan(
        self,
        model: ir.Model,
        site: CacheSite,
        group: list[CacheSite],
        cache_readers: dict[int, AttentionOp],
        planned: _ModelPlan,
    ) -> _Plan:
        scales, granularity = self.scales, planned.granularity
        source = self._source(site, granularity)
        done = source == _Quantized(self.format, granularity)
        _check_cache_shapes(site)
        sources: list[ir.Value] = []
        sinks: list[ir.Value] = []
        if not done:
            readers = {id(s.node): s.op for s in group}
            if site is site.owner:  # readers of another node's present retype nothing upstream
                for side in site.sides:
                    cache = site.past(side)
                    assert cache is not None
                    found, reason = _cache_sources(model, site, cache)
                    if reason:
                        raise _Skip(f"cache {cache.name!r} {reason}")
                    for value in found:
                        _check_only_attention_reads(model, value, cache_readers, "past")
                    sources += found
            for side in site.sides:
                present = site.present(side)
                if present is None:
                    continue
                _check_only_attention_reads(model, present, readers, "present")
                sinks += _cache_sinks(model, site, present)
        if scales is None and source is None and not self.format.is_float:
            raise KvCachePreconditionError(
                f"The {self.format.name} KV cache needs calibrated scales: a unit scale is "
                "meaningless for integer formats. Pass ",
                SCALE_FILE,
                " (a scale file), or measure them with ",
                Function("calibrate_kv_cache"),
                ".",
            )
        symbolic = any(
            v.shape is not None and len(v.shape) == 4 and not isinstance(v.shape[3], int)
            for v in sources + sinks
        )
        head = None
        unpacks = source is not None and source.format.packed and not self.format.packed
        packs = self.format.packed and not done
        if (
            granularity.per_dim
            or (self.format.packed and symbolic)
            or unpacks
            or (packs and _head_readers(sources + sinks))
        ):
            head = self._head_size(site)
        elif packs:  # the node must still tell it once packed, where it can now (_shape_readers rule 3)
            head = _head_or_none(site)
        if scales is None:
            if done and not (self.shared_kv_scale and len(site.sides) > 1):
                return _Plan(site, done, sources, sinks, None, None, head, source)
            if done:  # only shared_kv_scale changes: the node's own scales, made one tensor
                k, v = self._retargeted(site, source, granularity)  # type: ignore[arg-type]
                return _Plan(site, done, sources, sinks, k, v, head, source)
            if source is not None:
                k, v = self._retargeted(site, source, granularity)
                return _Plan(site, done, sources, sinks, k, v, head, source)
            size = granularity.size(site.kv_num_heads, head) if head is not None else 1
            ones = np.ones(size, np.float32)
            return _Plan(site, done, sources, sinks, ones, ones.copy(), head)
        if site.layer_id not in scales.k:
            return _Plan(site, done, sources, sinks, None, None, head, source)  # see _check_coverage
        k, v = scales.for_layer(site.layer_id)
        per_tensor = not (granularity.per_head or granularity.per_dim)
        expected = granularity.size(site.kv_num_heads, head or 1)
        merged = (
            per_tensor and k.size > 1 and granularity_of([(k.size, site.kv_num_heads, _head_or_none(site))])
        )
        if merged:  # finer scales for one per tensor: their max, as a node's own (rule 5)
            k, v = np.array([k.max()], np.float32), np.array([v.max()], np.float32)
            planned.merged.add(site.layer_id)
        if k.size != expected:
            shape = "" if per_tensor else f" (kv_num_heads {site.kv_num_heads} x head_size {head})"
            fits = granularity_of([(k.size, site.kv_num_heads, head or site.head_size())])
            if fits is not None:
                hint = Message(
                    f"These scales are {fits.replace('_', ' ')}: convert with ",
                    Param("granularity", fits),
                    ".",
                )
            else:
                hint = Message(
                    "These scales were measured for a model of another shape: calibrate this model."
                )
            raise KvCachePreconditionError(
                f"Layer {site.layer_id} ({site.label}): {granularity.name} scales need "
                f"{expected} element(s) per cache{shape}, got {k.size}. ",
                hint,
            )
        return _Plan(site, done, sources, sinks, k, v, head, source)

    def _head_size(self, site: CacheSite) -> int:
        return site.head_size()

    def _retargeted(
        self, site: CacheSite, source: _Quantized, granularity: ScaleGranularity
    ) -> tuple[np.ndarray, np.ndarray]:
        """The node's own K and V scales as scales of the requested format and granularity
        (rule 5): the same threshold; per channel to per tensor by the max, per tensor to
        per channel broadcast."""
        kv, factor = site.kv_num_heads, source.format.qmax / self.format.qmax  # in float64, as retarget
        arrays = []
        for side in site.sides:
            value = site.input(side.scale)
            found = constant_values(value)
            # one scale staying one needs no head size (a function's node may know none)
            single = found is not None and len(found) == 1 and granularity.single
            head = 1 if single else self._head_size(site)
            what = f"{site.label}: its {side.kind} cache is {source.format.name} {source.granularity.name}"
            if found is None:
                reason = "has no scale input" if value is None else f"reads {value.name!r}, not a constant"
                raise KvCachePreconditionError(
                    f"{what}, but its {side.scale} {reason}; give ",
                    SCALE_FILE,
                    f" (a scale file) to convert it to {self.format.name} {granularity.name}.",
                )
            own = np.asarray(found, np.float32)
            fits = granularity_of([(own.size, kv, head)])
            if fits is None or not np.all(np.isfinite(own)) or not np.all(own > 0):
                raise KvCachePreconditionError(
                    f"{what}, but its {side.scale} {value.name!r} holds {own.size} value(s) "  # type: ignore[union-attr]
                    f"that are no finite positive scales of kv_num_heads {kv} x head_size {head}; give ",
                    SCALE_FILE,
                    " (a scale file) to convert it.",
                )
            heads, dims = scale_granularity(fits).grid(kv, head)
            grid = own.reshape(heads, dims)
            wanted = granularity.grid(kv, head)
            merged = tuple(axis for axis in range(2) if wanted[axis] < grid.shape[axis])
            grid = np.broadcast_to(grid.max(axis=merged, keepdims=True), wanted)
            arrays.append((grid.reshape(-1).astype(np.float64) * factor).astype(np.float32))
        return arrays[0], arrays[-1]  # a single (LATENT) cache: the key's twice

    def _check_coverage(self, plans: list[_Plan], scales: KvCacheScales | None, layers: set[int]) -> None:
        if scales is None:
            return
        extra = sorted(set(scales.layer_ids) - layers)
        if extra and layers:  # no cache at all: nothing to convert, said elsewhere
            raise KvCachePreconditionError(
                f"The scales cover layer(s) {extra} that this model does not have (its KV-cache layers "
                f"are {sorted(layers)}): they were measured for another model. Calibrate this one."
            )
        missing = sorted({p.site.layer_id for p in plans} - set(scales.layer_ids))
        if missing:
            raise KvCachePreconditionError(
                f"The scales have no entry for layer(s) {missing} (they cover "
                f"{list(scales.layer_ids)}). Give scales for every layer with a KV cache."
            )

    # -- applying -------------------------------------------------------------------

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
            f"but {len(found)} attention node(s) (ONNX Attention or decomposed; first {first}) that "
            "become GroupQueryAttention only by fusion. Run GqaFusionPass first "
            f"(ir.passes.PassManager([GqaFusionPass(), {name}(...)])), or call optimize_model, which "
            "fuses, checks the target and quantizes (docs/exporting.md)."
        )
    ]


_MERGED = "the range stays covered, channels of a smaller range get coarser steps"

#: ``shared_kv_scale`` warns when max(k, v) makes a scale coarser than this factor.
SHARED_SCALE_WARN_FACTOR = 2.0


def _shared_scale_coarsens(plans: list[_Plan]) -> list[KvCacheWarning]:
    """The warning for layers whose K or V scale ``max(k, v)`` makes much coarser, if any."""
    coarser: dict[int, tuple[float, str]] = {}  # layer -> (factor, "K"/"V"), its worst
    for plan in plans:
        if plan.k_scale is None or plan.v_scale is None:
            continue
        shared = np.maximum(plan.k_scale, plan.v_scale)
        for kind, own in (("K", plan.k_scale), ("V", plan.v_scale)):
            factor = float(np.max(shared / own))
            coarser[plan.site.layer_id] = max(coarser.get(plan.site.layer_id, (0.0, "")), (factor, kind))
    over = {layer: fk for layer, fk in sorted(coarser.items()) if fk[0] > SHARED_SCALE_WARN_FACTOR}
    if not over:
        return []
    worst_layer, (factor, kind) = max(over.items(), key=lambda item: item[1])
    return [
        ScalesAdjustedWarning(
            f"shared_kv_scale feeds max(k_scale, v_scale) to both inputs: in layer(s) "
            f"{', '.join(map(str, over))} a scale becomes more than {SHARED_SCALE_WARN_FACTOR:g}x "
            f"coarser (up to {factor:.1f}x for layer {worst_layer}'s {kind}), its cache that much less "
            "precise. Only CUDA's decode fast path before onnxruntime 1.29 needs one tensor; else drop "
            "the option."
        )
    ]


def _retarget_notes(
    plans: list[_Plan], fmt: CacheFormat, granularity: ScaleGranularity, own_scales: bool
) -> list[KvCacheWarning]:
    """Where a node's own scales, retargeted, differ from what calibrating the float model
    for the target gives (docs/scales.md, "Requantizing")."""
    if not own_scales:
        return []
    moved = [(p.site.layer_id, p.source, p.k_scale) for p in plans if p.source is not None and not p.done]
    notes: list[KvCacheWarning] = []
    changed = sorted(
        {
            p.site.layer_id
            for p in plans
            if p.source is not None and not p.done and _side_granularities(p.site) - {granularity.name}
        }
    )
    if changed:
        how = (
            f"their per-channel scales merged into one, their max: {_MERGED}"
            if granularity.single
            else "their one scale repeated for every channel: no channel gets finer steps "
            "(calibrate the float model per channel for that)"
        )
        notes.append(
            ScalesAdjustedWarning(
                f"Layer(s) {changed} requantized to {granularity.name} from their own scales, {how}."
            )
        )
    unit = [
        (layer, source)
        for layer, source, k in moved
        if source.format.is_float
        and not fmt.is_float
        and k is not None
        and np.all(k * fmt.qmax == source.format.qmax)
    ]
    if unit:
        source = unit[0][1].format
        notes.append(
            UnitScalesWarning(
                Message(
                    f"Layer(s) {sorted({layer for layer, _ in unit})} had unit {source.name} scales (1.0: "
                    f"never calibrated); as {fmt.name} scales they keep the threshold {source.qmax:g}, "
                    "far too coarse for an integer cache. Calibrate the model (",
                    Function("calibrate_kv_cache"),
                    ") and give ",
                    SCALE_FILE,
                    " (a scale file).",
                )
            )
        )
    return notes


def _head_or_none(site: CacheSite) -> int | None:
    try:
        return site.head_size()
    except KvCacheError:
        return None


def _side_granularities(site: CacheSite) -> set[str]:
    """The granularity each cache of ``site`` states (K per channel, V per tensor: both)."""
    states = {site.str_attr(side.quant_attr, "NONE") for side in site.sides}
    return {row.name for row in SCALE_GRANULARITIES.values() if row.quant_type in states}


# -- cache endpoints ------------------------------------------------------------------


def _current_format(site: CacheSite) -> tuple[CacheFormat | None, str]:
    """The format the node's cache is in (:attr:`CacheSite.cache_format`), or None,
    with a description for messages."""
    described = str(site.cache_dtype.name if site.cache_dtype is not None else "?").lower()
    if site.cache_bit_width is not None:
        described = f"{described} ({site.cache_bit_width}-bit)"
    if site.cache_logical_type:
        described = f"{described} ({site.op.key.dtype_attr}={site.cache_logical_type!r})"
    fmt = site.cache_format
    return (fmt, fmt.name) if fmt is not None else (None, described)


def _dtype_name(site: CacheSite) -> str:
    """A site's cache element type as numpy names it (``float32``), for messages."""
    past = site.past(site.sides[0])
    if past is None or past.dtype is None:
        return "float"
    try:
        return str(past.dtype.numpy().name)
    except TypeError:
        return past.dtype.name.lower()


def _check_cache_shapes(site: CacheSite) -> None:
    """Key and value caches agree in every static dimension but the last; heads match."""
    shapes = [site.past(side).shape for side in site.sides]  # type: ignore[union-attr]
    heads_axis = site.op.layout.heads_axis
    for side, shape in zip(site.sides, shapes):
        if shape is None or len(shape) != 4:
            continue
        if isinstance(shape[heads_axis], int) and shape[heads_axis] != site.kv_num_heads:
            raise KvCachePreconditionError(
                f"{site.label}: its {side.kind} cache has {shape[heads_axis]} heads on axis {heads_axis} "
                f"({site.op.layout.dims[heads_axis]}), but kv_num_heads is {site.kv_num_heads}; the model "
                "is malformed."
            )
    if len(shapes) == 2 and all(s is not None and len(s) == 4 for s in shapes):
        for axis, (a, b) in enumerate(zip(shapes[0][:3], shapes[1][:3])):  # type: ignore[index]
            if isinstance(a, int) and isinstance(b, int) and a != b:
                raise KvCachePreconditionError(
                    f"{site.label}: key and value caches differ in {site.op.layout.dims[axis]} "
                    f"({a} vs {b}); both caches of a node share one layout. Rebuild the model with "
                    "matching cache shapes."
                )


def _check_only_attention_reads(
    model: ir.Model, value: ir.Value, readers: dict[int, AttentionOp], what: str
) -> None:
    """A cache may be read only as the cache of converted attention nodes, or passed to a function."""
    for user, slot in value.uses():
        op = readers.get(id(user))
        if user.graph is None or (op is not None and slot in op.cache_slots):
            continue  # a removed node, or a converted reader
        if user is tail_slice(value):
            continue  # a cropped sliding-window present (its output is retyped too)
        if user.op_identifier() in model.functions:
            continue  # the function's own use of its input is checked where it is a source
        if reads_dimensions_only(user):
            continue  # Shape, Size: the dimensions, kept (int4's head: _shape_readers)
        raise _Skip(
            f"{what} cache {value.name!r} is also read by {user.op_type} node {user.name!r}, "
            "which would see the quantized type"
        )


def _head_readers(values: list[ir.Value]) -> list[ir.Node]:
    """The Shape and Size nodes reading ``values`` whose output depends on the head dimension."""
    return [
        user
        for value in values
        for user, _ in value.uses()
        if reads_dimensions_only(user) and sees_head_dimension(user)
    ]


def _owner_function(model: ir.Model, value: ir.Value) -> ir.Function | None:
    for function in model.functions.values():
        if value.graph is function.graph:
            return function
    return None


def _cache_sources(model: ir.Model, site: CacheSite, value: ir.Value) -> tuple[list[ir.Value], str | None]:
    """Values to retype for a cache input, or why it cannot be converted."""
    if value.is_graph_input():
        function = _owner_function(model, value)
        if function is None:
            if value.graph is model.graph:
                return [value], None
            return [], "is an input of a subgraph body (Loop/Scan)"
        index = list(function.inputs).index(value)
        found = [value]
        for caller in function_call_sites(model, function):
            argument = caller.inputs[index] if index < len(caller.inputs) else None
            if argument is not None:
                outer, reason = _cache_sources(model, site, argument)
                if reason:
                    return [], reason
                found += outer
        return found, None
    producer = value.producer()
    if producer is not None:
        return [], f"is produced by {producer.op_type} node {producer.name!r}"
    const = value.const_value
    if const is not None and const.size == 0:
        return [value], None
    if const is not None:
        return [], "is a non-empty initializer"
    return [], "is not a graph input"


def _subgraph_owner(model: ir.Model, graph: ir.Graph) -> ir.Node | None:
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH and attr.value is graph:
                return node
            if attr.type == ir.AttributeType.GRAPHS and any(g is graph for g in attr.value):
                return node
    return None


def _cache_sinks(model: ir.Model, site: CacheSite, value: ir.Value) -> list[ir.Value]:
    """Values to retype for a present output: the output and where it flows out."""
    window = tail_slice(value)
    if window is not None:  # a cropped sliding-window present: the Slice's output leaves
        return [value, window.outputs[0]]
    found = [value]
    if not value.is_graph_output() or value.graph is model.graph or value.graph is None:
        return found
    graph = value.graph
    index = list(graph.outputs).index(value)
    function = _owner_function(model, value)
    if function is not None:
        for caller in function_call_sites(model, function):
            if index < len(caller.outputs):
                found += _cache_sinks(model, site, caller.outputs[index])
        return found
    owner = _subgraph_owner(model, graph)
    if owner is not None and owner.op_type == "If" and index < len(owner.outputs):
        found += _cache_sinks(model, site, owner.outputs[index])
    elif owner is not None and owner.op_type == "Loop" and 0 < index <= len(owner.outputs):
        found += _cache_sinks(model, site, owner.outputs[index - 1])
    return found


def _retype(value: ir.Value, fmt: CacheFormat, head_size: int | None, *, unpack: bool = False) -> bool:
    """Give a cache value the format's type; a packed format gets a static last dimension.

    onnxruntime-genai allocates caches from the declared shape, so a packed cache keeps no
    symbolic head dimension (``kv_cache_dim``): it becomes ``(head_size + 1) // 2``. A packed
    cache converted to an unpacked format (``unpack``) takes ``head_size`` again.
    """
    if value.dtype == fmt.dtype:
        return False
    shape = value.shape
    if shape is not None and len(shape) == 4:
        last = shape[3]
        if (fmt.values_per_byte > 1 or unpack) and head_size is not None:
            last = fmt.packed_dim(head_size)
        elif isinstance(last, int):
            last = fmt.packed_dim(last)
        shape = ir.Shape([*shape[:3], last])
    value.type = ir.TensorType(fmt.dtype)
    value.shape = shape
    if value.const_value is not None and shape is not None:
        dims = [d if isinstance(d, int) else 0 for d in shape]
        empty = np.zeros(dims, fmt.numpy_dtype())
        value.const_value = ir.tensor(empty, dtype=fmt.dtype, name=value.name)
    return True


# -- scale tensors --------------------------------------------------------------------


class _ScaleStore:
    """Creates, updates and retires scale tensors (initializers or function Constants)."""

    def __init__(self, model: ir.Model) -> None:
        self.model = model
        self.modified = False
        self._retired: list[ir.Value] = []
        self._taken = {v.name for v in _graph_values(model.graph) if v.name}
        """Every value name of the main graph: a new scale takes none of them."""

    def put(self, site: CacheSite, name: str, array: np.ndarray, shape: tuple[int, ...]) -> ir.Value:
        array = np.asarray(array, np.float32).reshape(shape)
        if site.function is not None:
            return self._put_constant(site.function, name, array)
        graph = self.model.graph
        existing = graph.initializers.get(name)
        if existing is not None and existing.dtype == ir.DataType.FLOAT and _only_scale_uses(existing):
            old = existing.const_value
            if old is None or not np.array_equal(old.numpy(), array):
                existing.const_value = ir.tensor(array, name=name)
                existing.shape = ir.Shape(array.shape)
                self.modified = True
            return existing
        if existing is not None or name in self._taken:
            name = _unique_name(self._taken, name)
        self._taken.add(name)
        value = ir.Value(
            name=name,
            shape=ir.Shape(array.shape),
            type=ir.TensorType(ir.DataType.FLOAT),
            const_value=ir.tensor(array, name=name),
        )
        graph.register_initializer(value)
        self.modified = True
        return value

    def _put_constant(self, function: ir.Function, name: str, array: np.ndarray) -> ir.Value:
        for node in function:
            if node.op_type == "Constant" and node.outputs[0].name == name:
                attr = node.attributes["value"]
                if not np.array_equal(attr.value.numpy(), array):
                    node.attributes["value"] = ir.AttrTensor("value", ir.tensor(array))
                    node.outputs[0].const_value = None
                    self.modified = True
                return node.outputs[0]
        output = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.FLOAT))
        constant = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(array))], outputs=[output])
        prepend(function, constant)
        self.modified = True
        return output

    def retire(self, value: ir.Value | None) -> None:
        if value is not None:
            self._retired.append(value)

    def remove_unused(self) -> bool:
        """Drop replaced scale tensors that nothing reads any more."""
        removed = False
        for value in self._retired:
            if value.uses():
                continue
            graph = value.graph
            if value.is_initializer() and graph is not None and not value.is_graph_output():
                graph.initializers.pop(value.name, None)  # type: ignore[arg-type]
                removed = True
            elif value.is_graph_input() and graph is self.model.graph and not value.is_graph_output():
                graph.inputs.remove(value)  # a scale fed at run time, replaced by a constant
                removed = True
            producer = value.producer()
            if producer is not None and producer.op_type == "Constant" and producer.graph:
                producer.graph.remove(producer, safe=True)
                removed = True
        self._retired.clear()
        return removed


def _own_scale_name(site: CacheSite, side: CacheSide) -> str | None:
    """The name of the main-graph initializer feeding ``side``'s scale when only that side's
    scale slots read it: replaced in place, it keeps its name (genai's builder and
    ``KVCacheVariant`` name them ``model.layers.{i}.attn.k_scale``)."""
    value = site.input(side.scale)
    if value is None or site.function is not None or not value.is_initializer() or not value.name:
        return None
    slot = site.op.slot(side.scale)
    if value.is_graph_output() or any(op_of(node) is not site.op or i != slot for node, i in value.uses()):
        return None
    return value.name


def _only_scale_uses(value: ir.Value) -> bool:
    """Whether ``value`` is read only as an attention node's k/v scale (ours to update)."""
    if value.is_graph_output():
        return False
    for node, slot in value.uses():
        op = op_of(node)
        if op is None or slot not in op.scale_slots:
            return False
    return True


def _unique_name(taken: set[str], name: str) -> str:
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"


def _graph_values(graph: ir.Graph) -> Iterator[ir.Value]:
    """Graph inputs, initializers and every node output of ``graph`` and its subgraphs."""
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in ir.traversal.RecursiveGraphIterator(graph):
        yield from node.outputs


def format_for(model: ir.Model) -> str | None:
    """The format of an already-quantized model's caches when they share one, else None: what
    a conversion naming no format keeps (it requantizes in it, e.g. to another granularity)."""
    own = {site.cache_format for site in find_attention_sites(model)} - {None}
    return next(iter(own)).name if len(own) == 1 else None  # type: ignore[union-attr]


def granularity_for(model: ir.Model, scales: KvCacheScales | None) -> str:
    """The granularity ``scales`` record, else the first row whose size fits every cache of
    ``model`` they cover; without scales the one ``model``'s quantized caches state when they
    agree (an already-quantized model keeps it), else ``per_tensor``."""
    if scales is None:
        own = {site.granularity for site in find_attention_sites(model) if site.cache_format is not None}
        return next(iter(own)) or "per_tensor" if len(own) == 1 else "per_tensor"
    if scales.granularity is not None:
        return scales.granularity
    caches: dict[int, tuple[int, int, int | None]] = {}  # layer -> (size, kv heads, head size)
    for site in find_attention_sites(model):
        if site.layer_id in scales.k:
            try:
                head: int | None = site.head_size()
            except KvCacheError:  # a precondition error is one too
                head = None
            caches[site.layer_id] = (scales.k[site.layer_id].size, site.kv_num_heads, head)
    found = granularity_of(caches.values())
    if found is None:
        misfits = [(layer, c) for layer, c in caches.items() if granularity_of([c]) is None]
        if not misfits:
            fits = {layer: granularity_of([c]) for layer, c in caches.items()}
            raise KvCachePreconditionError(
                f"The scales of different layers fit different granularities ({fits}): give scales "
                "of one granularity for every layer (",
                Function("calibrate_kv_cache"),
                " measures them).",
            )
        layer, (size, kv, head) = misfits[0]
        sizes = ", ".join(
            f"{row.name} {row.size(kv, head or 0)}"
            for row in SCALE_GRANULARITIES.values()
            if head is not None or not row.per_dim
        )
        raise KvCachePreconditionError(
            f"The scales of layer {layer} have {size} element(s) per cache, which fits no scale "
            f"granularity of its cache of {kv} KV head(s) x head size "
            f"{head if head is not None else '?'} ({sizes}): they were measured for a model of "
            "another shape; calibrate this model."
        )
    return found
