"""The per-model plan of a KV-cache conversion, built before anything changes.

For each attention node: whether it is converted, requantized, left alone or skipped (and
why), the values to retype, the scales it gets and the head size a packed cache needs; for the
model: the granularity its caches take (:func:`granularity_for`), the format an
already-quantized model keeps (:func:`format_for`), and every refusal and warning the conversion
gives. :class:`~.kv_cache_quantization.KvCacheQuantizationPass` plans with :class:`_Planner`
in ``requires()`` and applies the plan in ``call()``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import (
    SCALE_GRANULARITIES,
    CacheFormat,
    ScaleGranularity,
    granularity_of,
    scale_granularity,
)
from onnx_kvcache.cache.operators import AttentionOp
from onnx_kvcache.cache.prompt_path import float_branch
from onnx_kvcache.cache.rotation import site_rotation
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites, layer_id_from_name, unread_caches
from onnx_kvcache.errors import (
    Function,
    KvCacheError,
    KvCachePreconditionError,
    KvCacheWarning,
    Message,
    Param,
    ScalesAdjustedWarning,
    SkippedNodeWarning,
    UnitScalesWarning,
)
from onnx_kvcache.model_io import calibrated_by
from onnx_kvcache.passes._kv_cache_endpoints import (
    _cache_sinks,
    _cache_sources,
    _check_cache_shapes,
    _check_only_attention_reads,
    _head_readers,
    _Skip,
)
from onnx_kvcache.passes._kv_requantize import (
    _MERGED,
    SCALE_FILE,
    _Quantized,
    _side_granularities,
    quantized_source,
    retargeted,
)
from onnx_kvcache.scales.files import KvCacheScales, mse_moved


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


def _unattended_layers(model: ir.Model, sites: list[CacheSite]) -> set[int]:
    """Layer numbers of the past caches no attention node reads (``past_key_values.0.key`` of a
    layer left unfused: :func:`~onnx_kvcache.cache.sites.unread_caches`), by name."""
    layers = (layer_id_from_name(value.name) for value in unread_caches(model, sites))
    return {layer for layer in layers if layer is not None}


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


@dataclasses.dataclass
class _Planner:
    """Plans a conversion with the settings of a
    :class:`~.kv_cache_quantization.KvCacheQuantizationPass`."""

    format: CacheFormat
    granularity: str | None
    """None: each model decides (:func:`granularity_for`)."""
    scales: KvCacheScales | None
    shared_kv_scale: bool

    def plan_model(self, model: ir.Model) -> _ModelPlan:
        """What the pass will do to each site, and the warnings it will give; raises
        :class:`KvCachePreconditionError` when it cannot convert."""
        scales = self.scales
        planned = _ModelPlan(scale_granularity(self.granularity or granularity_for(model, scales)))
        sites = find_attention_sites(model)
        cache_readers: dict[int, AttentionOp | None] = {id(s.node): s.op for s in sites}
        for site in sites:  # a wrapper's float branch reads the pasts too; unwrapping removes it
            if site.wrapper is not None:
                cache_readers |= dict.fromkeys(map(id, float_branch(site.wrapper)))
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
        self._check_coverage(plans, scales, {s.layer_id for s in sites}, _unattended_layers(model, sites))
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
                ScalesAdjustedWarning(mse_moved(moved[0], self.format.name, _rotation_of(plans)))
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

    def _plan(
        self,
        model: ir.Model,
        site: CacheSite,
        group: list[CacheSite],
        cache_readers: dict[int, AttentionOp | None],
        planned: _ModelPlan,
    ) -> _Plan:
        scales, granularity = self.scales, planned.granularity
        source = quantized_source(site, self.format, granularity)
        done = source == _Quantized(self.format, granularity)
        _check_cache_shapes(site)
        sources: list[ir.Value] = []
        sinks: list[ir.Value] = []
        if not done:
            readers: dict[int, AttentionOp | None] = {id(s.node): s.op for s in group}
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
                k, v = retargeted(site, source, self.format, granularity)  # type: ignore[arg-type]
                return _Plan(site, done, sources, sinks, k, v, head, source)
            if source is not None:
                k, v = retargeted(site, source, self.format, granularity)
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

    def _check_coverage(
        self, plans: list[_Plan], scales: KvCacheScales | None, layers: set[int], unattended: set[int]
    ) -> None:
        """Scales for every converted layer, and for no layer the model lacks (``unattended``: layers
        whose past caches no attention node reads, an export's layer left unfused: theirs are unused)."""
        if scales is None:
            return
        check_known_layers(scales, layers, unattended)
        missing = sorted({p.site.layer_id for p in plans} - set(scales.layer_ids))
        if missing:
            raise KvCachePreconditionError(
                f"The scales have no entry for layer(s) {missing} (they cover "
                f"{list(scales.layer_ids)}). Give scales for every layer with a KV cache."
            )

    # -- applying -------------------------------------------------------------------


def check_known_layers(
    scales: KvCacheScales, layers: set[int], unattended: set[int] | frozenset[int] = frozenset()
) -> None:
    """Refuse scales for a layer the model lacks (``layers``: its KV-cache layers; ``unattended``:
    layers whose scales are unused but not foreign). A model with no cache is said elsewhere."""
    extra = sorted(set(scales.layer_ids) - layers - unattended)
    if extra and layers:
        raise KvCachePreconditionError(
            f"The scales cover layer(s) {extra} that this model does not have (its KV-cache layers "
            f"are {sorted(layers)}): they were measured for another model. Calibrate this one."
        )


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


def _dtype_name(site: CacheSite) -> str:
    """A site's cache element type as numpy names it (``float32``), for messages."""
    past = site.past(site.sides[0])
    if past is None or past.dtype is None:
        return "float"
    try:
        return str(past.dtype.numpy().name)
    except TypeError:
        return past.dtype.name.lower()


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


def _rotation_of(plans: list[_Plan]) -> str:
    """The rotation the planned caches' graph already applies (``none`` if none)."""
    return next((r.name for r in (site_rotation(p.site) for p in plans) if r.rotates), "none")
