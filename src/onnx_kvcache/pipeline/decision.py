"""One decision for ``convert_model`` and ``optimize_model``: a :class:`Request` in, a :class:`Decision` out.

Rules, in order, each a function:

1. :func:`fuse_unless_attention`: a model without attention nodes (an export) is fused first;
   the fusion's warnings are recorded, said only if the result is kept; the export and its fused
   model run side by side (:mod:`~onnx_kvcache.pipeline.verification`), a difference refuses.
2. A layer left unfused refuses a conversion (all or nothing) unless ``allow_partial`` and
   some fused; ``convert_model`` also refuses a model with nothing to convert (no attention
   after fusion, or already as asked).
3. :func:`target_of`: the provider given, or the one the model will run on
   (:func:`~onnx_kvcache.capabilities.gating.infer_target`).
4. ``optimize_model``: a fused float attention the target cannot run is refused.
5. :func:`plan`: the granularity (given, else the scales' or the model's) and the format
   (named, else for ``convert_model`` the first the target runs); :func:`rotation_for`: the
   cache's rotation (a rotated model's own, else the one named, else the one its scales record;
   named and recorded must agree); :func:`matrix_for`: its ``H`` (a rotated model's own, else
   the one its scales record, else the default; the two must agree).
6. :func:`gate`: every :class:`~onnx_kvcache.capabilities.refusals.Refusal` of the capability rows
   (``check_device``: no CUDA GPU here is one).
7. :func:`adaptation_for`: refusals a row of :data:`ADAPTATIONS` cures are lifted, and its pass
   runs after quantizing (a float32 model for CUDA, which has no float32 GroupQueryAttention:
   the attention computes in float16, :class:`~onnx_kvcache.passes.float16_attention.Float16AttentionPass`).
8. :func:`partial_refusal`: a cache the quantization pass would leave in its type (a node it
   skips) refuses the conversion: no model mixes cache types unless ``allow_partial``.
9. :func:`float_prompt`: where the target's row for the format says ``prompt_in_float`` (the
   CPU's int8 and int4), the quantized nodes' multi-token calls attend through the float
   kernel (:class:`~onnx_kvcache.passes.PromptFloatAttentionPass`),
   run last.

``storage="qdq"`` replaces rules 1 to 9: :mod:`~onnx_kvcache.pipeline.storage_decision`; a model
whose caches it stored already is not fused under ``auto`` either
(:func:`~onnx_kvcache.pipeline.storage_decision.storage_first`).

:func:`decide` runs them (``strict`` raises on a refusal); :func:`carry_out` quantizes what was
decided and replays the warnings, or warns why nothing was done. How the two entry points
differ is a row of :data:`ENTRIES`. The types and :func:`fuse_unless_attention` are
``pipeline/_decision_terms.py``'s and ``pipeline/_fusing.py``'s, re-exported here.
"""

from __future__ import annotations

__all__ = [
    "ADAPTATIONS",
    "AUTO",
    "ENTRIES",
    "Adaptation",
    "Decision",
    "Entry",
    "EntryRules",
    "Fusion",
    "Request",
    "adaptation_for",
    "carry_out",
    "decide",
    "float_prompt",
    "fuse_unless_attention",
    "gate",
    "plan",
    "inferred_format",
    "matrix_for",
    "rotation_for",
    "partial_refusal",
    "target_of",
]

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat, ScaleGranularity, get_format, scale_granularity
from onnx_kvcache.cache.rotation import (
    DEFAULT_MATRIX,
    MATRICES,
    Rotation,
    RotationMatrix,
    get_rotation,
    matrix_name,
    site_matrix,
    site_rotation,
)
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.cache.validation import validate_model
from onnx_kvcache.capabilities.device import NO_GPU, cuda_compute_capability
from onnx_kvcache.capabilities.gating import (
    NO_ATTENTION,
    check_kv_cache_support,
    conversion_warnings,
    default_format,
    infer_target,
)
from onnx_kvcache.capabilities.refusals import Parameter, Refusal, RefusalCode
from onnx_kvcache.capabilities.rows import get_capabilities
from onnx_kvcache.errors import (
    Float16AttentionWarning,
    KvCacheError,
    Message,
    NotConvertedWarning,
    Param,
    RuntimeSupportWarning,
    warn,
)
from onnx_kvcache.passes import PromptFloatAttentionPass
from onnx_kvcache.passes.float16_attention import (
    FLOAT16_ATTENTION_NOTE,
    Float16AttentionPass,
    float32_attention_sites,
)
from onnx_kvcache.passes.fusion.window_sized import make_window_sized
from onnx_kvcache.passes.kv_cache_quantization import KvCacheQuantizationPass, granularity_for
from onnx_kvcache.passes.kv_cache_rotation import KvCacheRotationPass
from onnx_kvcache.pipeline._decision_terms import (
    AUTO,
    ENTRIES,
    QDQ,
    Adaptation,
    Decision,
    Entry,
    EntryRules,
    Fusion,
    Request,
    agreed_rotation,
    refuse,
    target_named,
    target_of,
)
from onnx_kvcache.pipeline._fusing import fuse_unless_attention
from onnx_kvcache.pipeline.storage_decision import storage_first, storage_hint, store
from onnx_kvcache.scales.files import KvCacheScales, as_kv_cache_scales

logger = logging.getLogger(__name__)

NO_CUDA_DEVICE = Refusal(RefusalCode.NO_CUDA_DEVICE, Parameter.CHECK_DEVICE, NO_GPU)


#: The refusals a pass run after quantizing cures, one row each (rule 7).
ADAPTATIONS: tuple[Adaptation, ...] = (
    Adaptation(
        RefusalCode.QUERY_DTYPE_UNSUPPORTED,
        ir.DataType.FLOAT16,
        float32_attention_sites,
        Float16AttentionPass,
        FLOAT16_ATTENTION_NOTE,
        Float16AttentionWarning,
    ),
)


def _nothing_to_do(request: Request, model: ir.Model) -> Refusal | None:
    """``convert_model``'s refusal of a model already as asked, or without attention to convert."""
    if request.scales is None and not request.shared_kv_scale and request.format is not None:
        sites = find_attention_sites(model)
        states = {(s.cache_format.name if s.cache_format else None, s.granularity) for s in sites}
        wanted = (get_format(request.format).name, request.granularity or granularity_for(model, None))
        turned = {site_rotation(s).name for s in sites}
        other_rotation = request.rotation is not None and turned != {get_rotation(request.rotation).name}
        unwrapped = _prompt_to_wrap(request, model, wanted[0])  # rule 9 alone still has work
        if states == {wanted} and not other_rotation and not unwrapped:  # another rotation: rule 5
            text = f"{request.name} is already {wanted[0]} {wanted[1]}: nothing to convert."
            return Refusal(RefusalCode.ALREADY_CONVERTED, Parameter.FORMAT, text)
    if not find_attention_sites(model):
        text = (
            f"{request.name} has no GroupQueryAttention or PagedAttention node with a KV cache, "
            "and attention fusion found no attention to fuse: nothing to convert. Export the decoder "
            "with GroupQueryAttention (e.g. onnxruntime-genai's model builder) or see docs/exporting.md."
        )
        return dataclasses.replace(NO_ATTENTION, text=text)
    return None


def _prompt_to_wrap(request: Request, model: ir.Model, fmt: str) -> bool:
    """A model in the format asked whose prompt rule 9 would still route through the float kernel
    (converted before ``convert`` did, or by another tool)."""
    target = target_of(request, model)[0] if request.target is not None else None
    support = get_capabilities(target).formats.get(fmt) if target is not None else None
    return support is not None and support.prompt_in_float and PromptFloatAttentionPass.wrappable(model) > 0


def _early_refusal(request: Request, fusion: Fusion) -> Refusal | None:
    """Rule 2: a layer left unfused (when the cache is to be converted), nothing to convert."""
    rules = request.rules
    if fusion.refusal is not None and fusion.refusal.code is RefusalCode.FUSION_DIFFERS:
        return fusion.refusal  # allow_partial converts no wrong fusion
    partial = request.allow_partial and fusion.fused > 0
    if fusion.refusal is not None and (request.format is not None or rules.choose_format) and not partial:
        text = fusion.refusal.text + _mixing(fusion.fused)
        return dataclasses.replace(fusion.refusal, text=text + storage_hint(fusion))
    refusal = _nothing_to_do(request, fusion.model) if rules.refuse_nothing_to_do else None
    if refusal is not None and refusal.code is RefusalCode.NO_ATTENTION:
        return dataclasses.replace(refusal, text=refusal.text + storage_hint(fusion))
    return refusal


def _mixing(fused: int) -> Message | str:
    """How to convert a model whose layers would keep different cache types anyway."""
    if not fused:
        return ""
    return Message(
        " ", Param("allow_partial", True), " converts the fused layers alone, leaving the others as they are."
    )


def partial_refusal(
    request: Request,
    model: ir.Model,
    fmt: CacheFormat,
    granularity: ScaleGranularity,
    scales: KvCacheScales | None,
) -> Refusal | None:
    """Rule 7: the layers whose caches the quantization pass would leave in their type (a
    node it skips: a cache read by another node, one that is no graph input), unless
    ``allow_partial``. ``scales``: the request's, already retargeted to ``fmt`` (so nothing
    about them is said twice). An error the pass raises is left for it to raise."""
    if request.allow_partial:
        return None
    quantize = KvCacheQuantizationPass(
        fmt.name, granularity.name, scales, shared_kv_scale=request.shared_kv_scale
    )
    try:
        left = quantize.unconverted(model)
    except KvCacheError:
        return None
    if not left:
        return None
    layers = sorted({layer for group in left for layer in group.layers})
    dtypes = "/".join(sorted({group.dtype for group in left}))
    why = "; ".join(f"{', '.join(group.nodes)}: {group.reason}" for group in left)
    skipped = sum(len(group.nodes) for group in left)
    others = "" if skipped >= len(find_attention_sites(model)) else f" while the others become {fmt.name}"
    text = Message(
        f"layer(s) {', '.join(map(str, layers))} would keep {dtypes} caches{others} ({why}). A model "
        "whose caches mix types is converted only with ",
        Param("allow_partial", True),
        ".",
    )
    return Refusal(RefusalCode.PARTIAL_CONVERSION, Parameter.ALLOW_PARTIAL, text)


def inferred_format(
    model: ir.Model, genai_config: Mapping[str, Any] | None, granularity: str
) -> tuple[str, str, str | None]:
    """``(target, how it was inferred, the first cache format it runs)`` for a model whose
    caller named no format (the format None: the target runs no quantized cache)."""
    target, why = infer_target(model, genai_config)
    return target, why, default_format(model, target, granularity)


def _fusion_refusals(request: Request, fusion: Fusion, target: str | None) -> tuple[Refusal, ...]:
    """Rule 4: the fused float attention on the target (``optimize_model``)."""
    if not request.rules.gate_fusion or target is None or fusion.had_attention:
        return ()
    if not find_attention_sites(fusion.model):
        return ()
    refusals = check_kv_cache_support(fusion.model, target, None, "per_tensor").refusals
    if request.format is not None:  # the cache is converted too: rule 7 may cure them
        refusals = _lifted(refusals, adaptation_for(fusion.model, target, refusals))
    return refusals


def adaptation_for(model: ir.Model, target: str, refusals: tuple[Refusal, ...]) -> Adaptation | None:
    """Rule 7: the row of :data:`ADAPTATIONS` that cures ``refusals`` of ``model`` on ``target``
    (None: none does). A row applies when a refusal has its code, its pass rewrites every
    attention node of the model, and every row of ``target`` for them takes its dtype."""
    for row in ADAPTATIONS:
        if not any(r.code == row.cures for r in refusals):
            continue
        sites = find_attention_sites(model, with_cache_only=False)
        rewritten = {id(s.node) for s in row.sites(model)}
        takes = all(row.computes_in in get_capabilities(target, s.op).query_dtypes for s in sites)
        if sites and rewritten == {id(s.node) for s in sites} and takes:
            return row
    return None


def _lifted(refusals: tuple[Refusal, ...], row: Adaptation | None) -> tuple[Refusal, ...]:
    """``refusals`` without those ``row`` cures."""
    return refusals if row is None else tuple(r for r in refusals if r.code != row.cures)


def plan(
    request: Request, model: ir.Model, target: str | None
) -> tuple[CacheFormat | None, ScaleGranularity]:
    """Rule 5: the format (None: fuse only) and the granularity to convert with."""
    granularity = request.granularity
    name = request.format
    if name is None and not request.rules.choose_format:
        return None, scale_granularity(granularity or "per_tensor")
    granularity = granularity or granularity_for(model, request.scales)
    if name is None:
        name = (target is not None and default_format(model, target, granularity)) or "fp8"
    return get_format(name), scale_granularity(granularity)


def rotation_for(request: Request, model: ir.Model, scales: KvCacheScales | None) -> Rotation:
    """Rule 5: the converted cache's rotation. A rotated model keeps its own (requantizing keeps
    it); else the one named, else the one ``scales`` record (``none`` without a record: scales
    of other tools are for unrotated caches). Named, recorded and a rotated model's own must
    agree: scales measured on one kind of cache are wrong for another."""
    sites = find_attention_sites(model)
    own = next((r for r in map(site_rotation, sites) if r.rotates), None)
    asked = get_rotation(request.rotation) if request.rotation is not None else None
    recorded = None if scales is None else get_rotation(scales.metadata.get("rotation", "none"))
    paged = any(s.op.op_type != "GroupQueryAttention" for s in sites)
    if own is None and asked is not None and asked.rotates and paged:  # before the scales: none can cure it
        raise _paged_refusal(request)
    rotation = agreed_rotation(request, own, asked, recorded, offer_recorded=not paged)
    if rotation.rotates and own is None:
        if paged:
            raise _paged_refusal(request)
        quantized = next((s for s in sites if s.cache_format is not None), None)
        if quantized is not None:
            raise KvCacheError(
                f"{request.name}'s cache is already {quantized.cache_format.name}, unrotated: rotating it "  # type: ignore[union-attr]
                f"needs scales measured on the float model. Convert the original model for rotation "
                f"{rotation.name}."
            )
    return rotation


def matrix_for(request: Request, model: ir.Model, scales: KvCacheScales | None) -> RotationMatrix:
    """Rule 5: the ``H`` of the converted cache (a row of
    :data:`~onnx_kvcache.cache.rotation.MATRICES`). A rotated model keeps its own; else the one
    ``scales`` record (:attr:`~onnx_kvcache.scales.files.KvCacheScales.rotation_matrix`: scales
    measured with the old ``H`` rotate by it), else the default. A rotated model's own and the
    recorded must build the same matrix at its head sizes: scales measured on caches turned by
    one are wrong for the other."""
    turned = [(s, m) for s in find_attention_sites(model) if (m := site_matrix(s)) is not None]
    recorded = scales.rotation_matrix if scales is not None else None
    for site, own in turned:
        size = site.head_size()
        if recorded is not None and not own.same(recorded, size):
            raise KvCacheError(
                f"The scales were measured on caches turned by H = {recorded.name} "
                f"({matrix_name(size, recorded)}); {request.name}'s cache is turned by {own.name} "
                f"({matrix_name(size, own)}). Convert the original model with these scales (it is rotated "
                "as they record), or calibrate it again."
            )
    return turned[0][1] if turned else recorded or MATRICES[DEFAULT_MATRIX]


def _paged_refusal(request: Request) -> KvCacheError:
    return KvCacheError(
        f"A rotated cache is for GroupQueryAttention; {request.name} has PagedAttention caches: "
        "calibrate and convert it with ",
        Param("rotation", "none"),
        ".",
    )


def gate(
    model: ir.Model,
    target: str,
    fmt: str,
    granularity: str,
    *,
    check_device: bool = False,
    name_unknown: bool = False,
    rotation: str = "none",
) -> tuple[Refusal, ...]:
    """Rule 6: every refusal of ``target``'s capability rows for the converted model."""
    capability = cuda_compute_capability() if check_device else None
    report = check_kv_cache_support(
        model, target, fmt, granularity, compute_capability=capability, rotation=rotation
    )
    refusals = list(report.refusals)
    if check_device and capability is None and report.ep == "cuda":
        refusals.append(NO_CUDA_DEVICE)
    if refusals and name_unknown and get_capabilities(target).name == "default":
        text = f"{target!r} is not a provider onnx-kvcache knows."
        refusals.insert(0, Refusal(RefusalCode.UNKNOWN_PROVIDER, Parameter.EP, text))
    return tuple(refusals)


def decide(request: Request) -> Decision:
    """Run the rules on ``request`` (fusing its model, or a copy); nothing is quantized yet."""
    rules = request.rules
    validate_model(request.model)  # a malformed model is refused before any work; unsorted nodes sorted
    if (stored := storage_first(request)) is not None:
        return stored
    fusion = fuse_unless_attention(
        request.model, request.fuse, in_copy=rules.fuse_in_copy, verify=request.verify
    )
    if request.window_sized and fusion.fused:
        make_window_sized(fusion.model)  # verified as the export's form, before this
    asked = scale_granularity(_asked_granularity(request))  # until the model decides
    decision = Decision(request, fusion, format=_named_format(request), granularity=asked)
    early = _early_refusal(request, fusion)
    if early is not None:
        decision = (
            _as_it_is(decision, fusion.model) if early.code is RefusalCode.ALREADY_CONVERTED else decision
        )
        return refuse(decision, rules.refused_head, (early,), bare=rules.raise_bare)
    target, why = target_of(request, fusion.model)
    logger.info("%s: target %s (%s).", request.entry, target, why or "given")
    decision = dataclasses.replace(decision, target=target, why=why)
    named = target_named(target, why, rules.explain_target)
    if refusals := _fusion_refusals(request, fusion, target):
        return refuse(decision, Message("Attention not fused for ", named), refusals)
    fmt, granularity = plan(request, fusion.model, target)
    scales = as_kv_cache_scales(request.scales, format=fmt.name) if fmt is not None else request.scales
    decision = dataclasses.replace(decision, format=fmt, granularity=granularity, scales=scales)
    if fmt is None:
        return decision
    rotation, matrix = rotation_for(request, fusion.model, scales), matrix_for(request, fusion.model, scales)
    decision = dataclasses.replace(decision, rotation=rotation, matrix=matrix)
    if target is not None:
        decision, refused = _gated(decision, fmt, granularity, named)
        if refused:
            return decision
    partial = partial_refusal(request, fusion.model, fmt, granularity, scales)
    if partial is not None:
        decision = dataclasses.replace(decision, adaptation=None)
        return refuse(decision, rules.refused_head, (partial,), bare=rules.raise_bare)
    return dataclasses.replace(decision, warnings=tuple(conversion_warnings(fusion.model, fmt.name, target)))


def _gated(
    decision: Decision, fmt: CacheFormat, granularity: ScaleGranularity, named: str
) -> tuple[Decision, bool]:
    """The capability gate for the decision's target: ``(decision, True)`` refused where a row
    refuses what no adaptation lifts, else ``(decision with its adaptation, False)``."""
    request, model, target = decision.request, decision.model, decision.target
    assert target is not None
    refusals = gate(
        model,
        target,
        fmt.name,
        granularity.name,
        check_device=request.check_device,
        name_unknown=request.rules.name_unknown_provider,
        rotation=decision.rotation.name,
    )
    adaptation = adaptation_for(model, target, refusals)
    if refusals := _lifted(refusals, adaptation):
        head = Message(f"KV cache not converted to {fmt.name} {granularity.name} for ", named)
        return refuse(decision, head, refusals), True
    return dataclasses.replace(decision, adaptation=adaptation), False


def _adapt(decision: Decision) -> None:
    """Rule 7 carried out: the row's pass on the quantized model, and its one line."""
    row = decision.adaptation
    if row is None or decision.format is None:
        return
    layers = len(row.sites(decision.model))
    row.make_pass()(decision.model)
    warn(row.note.format(target=decision.target, layers=layers, format=decision.format.name), row.category)


def _as_it_is(decision: Decision, model: ir.Model) -> Decision:
    """``decision`` describing ``model``'s cache as it is (its format, granularity, rotation):
    what a model already as asked reports."""
    site = find_attention_sites(model)[0]
    granularity = scale_granularity(site.granularity) if site.granularity else decision.granularity
    return dataclasses.replace(
        decision, format=site.cache_format, granularity=granularity, rotation=site_rotation(site)
    )


def _named_format(request: Request) -> CacheFormat | None:
    return get_format(request.format) if request.format is not None else None


def _asked_granularity(request: Request) -> str:
    """The granularity before the model decides (given, the scales' or per tensor)."""
    recorded = request.scales.granularity if request.scales is not None else None
    return request.granularity or recorded or "per_tensor"


def carry_out(decision: Decision) -> bool:
    """Quantize the decided model's cache and say the fusion's and the rows' warnings; or, for
    a refused decision, warn why (:class:`~onnx_kvcache.errors.NotConvertedWarning`). Whether
    it was carried out."""
    if decision.refusals:
        warn(decision.message, NotConvertedWarning)
        return False
    request = decision.request
    if decision.format is not None and decision.granularity is not None and request.storage == QDQ:
        store(decision)
    elif decision.format is not None and decision.granularity is not None:
        KvCacheRotationPass(decision.rotation, decision.matrix)(
            decision.model
        )  # none, a rotated model: no-op
        KvCacheQuantizationPass(
            decision.format.name,
            decision.granularity.name,
            decision.scales,
            shared_kv_scale=request.shared_kv_scale,
        )(decision.model)
        validate_model(decision.model)  # what is returned or written loads: the same checks
    for recorded in decision.fusion.recorded:
        warn(recorded.message, recorded.category)
    _adapt(decision)
    float_prompt(decision)
    for warning in decision.warnings:
        warn(warning, RuntimeSupportWarning)
    return True


def float_prompt(decision: Decision) -> int:
    """Rule 9 carried out on the quantized model: the nodes wrapped (0 where the target's row
    does not ask for it); a node the pass cannot wrap is logged with the reason."""
    fmt, target = decision.format, decision.target
    if fmt is None or target is None or decision.request.storage == QDQ:
        return 0
    support = get_capabilities(target).formats.get(fmt.name)
    if support is None or not support.prompt_in_float:
        return 0
    wrap = PromptFloatAttentionPass()
    wrap(decision.model)
    for name, why in wrap.skipped.items():
        logger.info("%s: multi-token calls stay in the quantized kernel (%s).", name, why)
    logger.info("%d attention node(s): a prompt attends through the %s float kernel.", wrap.wrapped, target)
    return wrap.wrapped
