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

``storage="qdq"`` (:func:`storage_decision`) replaces rules 1 to 9: nothing is fused; the caches
:func:`~onnx_kvcache.cache.storage.find_qdq_caches` finds are stored in the format named (else
int8) through QuantizeLinear/DequantizeLinear (:class:`~onnx_kvcache.passes.QdqKvCachePass`),
gated by the target's storage row (:func:`~onnx_kvcache.capabilities.gating.storage_refusals`).
Under ``auto`` (the attention kernel holds the cache) a model whose attention fused nothing but
whose caches that storage keeps (MLA, static buffers) is refused with a line naming it.

:func:`decide` runs them (``strict`` raises on a refusal); :func:`carry_out` quantizes what was
decided and replays the warnings, or warns why nothing was done. How the two entry points
differ is a row of :data:`ENTRIES`.
"""

from __future__ import annotations

__all__ = [
    "ADAPTATIONS",
    "ENTRIES",
    "Adaptation",
    "Decision",
    "Entry",
    "EntryRules",
    "Fusion",
    "QDQ",
    "Request",
    "STORAGES",
    "adaptation_for",
    "carry_out",
    "check_storage",
    "decide",
    "float_prompt",
    "fuse_unless_attention",
    "gate",
    "plan",
    "inferred_format",
    "matrix_for",
    "rotation_for",
    "partial_refusal",
    "storage_decision",
    "target_of",
]

import dataclasses
import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import onnx_ir as ir

from onnx_kvcache._enums import StrEnum
from onnx_kvcache.cache.formats import CacheFormat, ScaleGranularity, get_format, scale_granularity
from onnx_kvcache.cache.io_caches import find_io_caches
from onnx_kvcache.cache.rotation import (
    DEFAULT_MATRIX,
    MATRICES,
    ROTATIONS,
    Rotation,
    RotationMatrix,
    get_rotation,
    matrix_name,
    site_matrix,
    site_rotation,
)
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.cache.storage import find_qdq_caches
from onnx_kvcache.cache.validation import validate_model
from onnx_kvcache.capabilities.device import NO_GPU, cuda_compute_capability
from onnx_kvcache.capabilities.gating import (
    NO_ATTENTION,
    check_kv_cache_support,
    conversion_warnings,
    default_format,
    infer_target,
    storage_refusals,
)
from onnx_kvcache.capabilities.refusals import Parameter, Refusal, RefusalCode, texts
from onnx_kvcache.capabilities.rows import get_capabilities
from onnx_kvcache.errors import (
    Float16AttentionWarning,
    FusionSkippedWarning,
    KvCacheError,
    KvCacheWarning,
    Message,
    NotConvertedWarning,
    Param,
    RuntimeSupportWarning,
    warn,
)
from onnx_kvcache.model_io.reading import check_defined
from onnx_kvcache.passes import PromptFloatAttentionPass, QdqKvCachePass
from onnx_kvcache.passes.float16_attention import (
    FLOAT16_ATTENTION_NOTE,
    Float16AttentionPass,
    float32_attention_sites,
)
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass, unfused_refusal
from onnx_kvcache.passes.fusion.window_sized import make_window_sized
from onnx_kvcache.passes.kv_cache_quantization import KvCacheQuantizationPass, granularity_for
from onnx_kvcache.passes.kv_cache_rotation import KvCacheRotationPass
from onnx_kvcache.pipeline.verification import Verification, too_large, verify_fusion
from onnx_kvcache.scales.files import KvCacheScales, as_kv_cache_scales

AUTO: Literal["auto"] = "auto"
QDQ: Literal["qdq"] = "qdq"
#: Where a quantized cache is kept: ``auto``, the attention kernel (GroupQueryAttention,
#: PagedAttention); ``qdq``, the graph's own QuantizeLinear/DequantizeLinear around the cache.
STORAGES = (AUTO, QDQ)
logger = logging.getLogger(__name__)

NO_CUDA_DEVICE = Refusal(RefusalCode.NO_CUDA_DEVICE, Parameter.CHECK_DEVICE, NO_GPU)


class Entry(StrEnum):
    """The public function a request comes from."""

    CONVERT = "convert_model"
    OPTIMIZE = "optimize_model"


@dataclasses.dataclass(frozen=True)
class EntryRules:
    """How one entry point's decision differs from the other's."""

    fuse_in_copy: bool
    """Fuse a copy, so that a refusal leaves the caller's model as it was."""
    choose_format: bool
    """No format named takes the target's first; else it means fusing only."""
    refuse_nothing_to_do: bool
    """Refuse a model with no attention after fusion, or already in the format asked."""
    gate_fusion: bool
    """Refuse a fused float attention the target cannot run (rule 4)."""
    explain_target: bool
    """Messages say how the target was inferred and how to name another."""
    name_unknown_provider: bool
    """A gate refusal for a provider the table does not know says so first."""
    refused_head: str
    """What a refusal before gating (rule 2) warns with."""
    raise_bare: bool
    """``strict`` raises rule 2's refusal without :attr:`refused_head`."""


ENTRIES: dict[Entry, EntryRules] = {
    Entry.CONVERT: EntryRules(
        fuse_in_copy=False,
        choose_format=True,
        refuse_nothing_to_do=True,
        gate_fusion=False,
        explain_target=False,
        name_unknown_provider=True,
        refused_head="Not converted",
        raise_bare=True,
    ),
    Entry.OPTIMIZE: EntryRules(
        fuse_in_copy=True,
        choose_format=False,
        refuse_nothing_to_do=False,
        gate_fusion=True,
        explain_target=True,
        name_unknown_provider=False,
        refused_head="KV cache not converted",
        raise_bare=False,
    ),
}


@dataclasses.dataclass(frozen=True)
class Adaptation:
    """A refusal a pass cures: the model converts, and the pass runs after quantizing."""

    cures: RefusalCode
    """The refusal it lifts (the target's rows refuse the model's query dtype)."""
    computes_in: ir.DataType
    """The dtype the attention computes in afterwards: the target's row must take it."""
    sites: Callable[[ir.Model], list[CacheSite]]
    """The attention nodes the pass rewrites: it applies only when they are all of the model's."""
    make_pass: Callable[[], ir.passes.PassBase]
    note: str
    """The line said once converted (``{target}``, ``{layers}``, ``{format}``)."""
    category: type[KvCacheWarning]


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


@dataclasses.dataclass(frozen=True)
class Request:
    """What a caller asks, validated by its entry point (names resolved, scales read)."""

    model: ir.Model
    entry: Entry
    format: str | None = None
    granularity: str | None = None
    """As given (checked against the scales); None: the scales' or the model's."""
    scales: KvCacheScales | None = None
    target: str | None = AUTO
    """A provider, ``"auto"`` (infer it) or None (no gating)."""
    genai_config: Mapping[str, Any] | None = None
    fuse: bool | Literal["auto"] = AUTO
    check_device: bool = False
    strict: bool = False
    shared_kv_scale: bool = False
    allow_partial: bool = False
    """Convert what can be, leaving other caches in their type (rules 2 and 7)."""
    rotation: str | None = None
    """The cache's rotation as given (None: a rotated model's own, else the scales')."""
    name: str = "The model"
    """The model as messages name it (its file name)."""
    verify: bool | None = None
    """Run the export and its fusion side by side before converting (None: up to
    :data:`~onnx_kvcache.pipeline.verification.MAX_BYTES` of weights; :func:`verify_fusion`)."""
    window_sized: bool = False
    """Fused rolling window caches become window-sized (:func:`~onnx_kvcache.passes.fusion.window_sized.
    make_window_sized`:
    an onnxruntime-genai folder, whose runtime allocates them); False: they keep the export's inputs."""
    storage: str = AUTO
    """A name of :data:`STORAGES`: ``qdq`` decides by :func:`storage_decision`."""

    @property
    def rules(self) -> EntryRules:
        return ENTRIES[self.entry]


@dataclasses.dataclass(frozen=True)
class Fusion:
    """What :func:`fuse_unless_attention` did."""

    model: ir.Model
    """The model to go on with: the one given, or its fused copy."""
    had_attention: bool
    ran: bool = False
    fused: int = 0
    """Layers fused."""
    modified: bool = False
    refusal: Refusal | None = None
    """A layer left unfused (:func:`~onnx_kvcache.passes.fusion.gqa_fusion.unfused_refusal`)."""
    recorded: tuple[warnings.WarningMessage, ...] = ()
    """The fusion's warnings, recorded (``record=True``) to say once the result is kept."""
    verification: Verification | None = None
    """The export and its fusion run side by side (None: no fusion ran, or not asked)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with a request: convert (no refusals) or say why not."""

    request: Request
    fusion: Fusion
    target: str | None = None
    why: str = ""
    """How the target was inferred (``""``: given, or none)."""
    format: CacheFormat | None = None
    granularity: ScaleGranularity | None = None
    scales: KvCacheScales | None = None
    """The request's scales, retargeted to :attr:`format`."""
    refusals: tuple[Refusal, ...] = ()
    message: str = ""
    """The :class:`~onnx_kvcache.errors.NotConvertedWarning` a refusal says."""
    warnings: tuple[str, ...] = ()
    """Said once converted (the capability rows' warnings for the format)."""
    adaptation: Adaptation | None = None
    """Rule 7's row: its pass runs after quantizing (None: none needed)."""
    rotation: Rotation = ROTATIONS["none"]
    """The converted cache's rotation (:func:`rotation_for`); applied before quantizing."""
    matrix: RotationMatrix = MATRICES[DEFAULT_MATRIX]
    """Its ``H`` (:func:`matrix_for`)."""

    @property
    def model(self) -> ir.Model:
        return self.fusion.model

    @property
    def converted(self) -> bool:
        return not self.refusals


def fuse_unless_attention(
    model: ir.Model,
    when: bool | Literal["auto"] = AUTO,
    *,
    in_copy: bool = False,
    record: bool = True,
    verify: bool | None = False,
) -> Fusion:
    """Fuse ``model``'s attention into GroupQueryAttention (:class:`GqaFusionPass`) when it has
    no attention node (``when="auto"``), always (``True``) or never (``False``).

    ``in_copy`` fuses a clone (the model given stays as it is); ``record`` keeps the fusion's
    warnings in :attr:`Fusion.recorded` instead of saying them (the caller's filters apply then);
    ``verify`` runs the export and the fused model side by side once fused (:func:`verify_fusion`:
    None up to its default size, True whatever the size, warned when it cannot run); a difference
    is the fusion's refusal (``FUSION_DIFFERS``, which ``allow_partial`` does not lift).
    """
    had = bool(find_attention_sites(model, with_cache_only=False))
    if when is False or (when == AUTO and had):
        return Fusion(model, had)
    skipped = too_large(model) if verify is None else None  # decided before a clone is made
    verify = False if skipped is not None else verify
    original = model
    if in_copy or verify is not False:
        check_defined(model.graph)
        model = model.clone()
    if not in_copy:
        model, original = original, model  # the caller's model is fused; the clone is the export
    fusion = GqaFusionPass()  # reads no weights
    with warnings.catch_warnings(record=record) as recorded:
        if record:
            warnings.simplefilter("always")
        modified = fusion(model).modified
    refused = unfused_refusal(fusion.fused, fusion.report.refusals)
    refusal = None if refused is None else Refusal(RefusalCode.ATTENTION_UNFUSED, None, refused)
    if verify is not False and fusion.fused:
        skipped = verify_fusion(original, model, forced=verify is True)
        if skipped.differs:
            refusal = Refusal(RefusalCode.FUSION_DIFFERS, None, skipped.line)
        elif verify is True and not skipped.verified:
            warn(Message(Param("verify", True), f", but {skipped.line}."), FusionSkippedWarning)
    checked = skipped if fusion.fused else None  # nothing fused: nothing to say of it
    return Fusion(model, had, True, fusion.fused, modified, refusal, tuple(recorded or ()), checked)


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
        return dataclasses.replace(fusion.refusal, text=text + _storage_hint(fusion))
    refusal = _nothing_to_do(request, fusion.model) if rules.refuse_nothing_to_do else None
    if refusal is not None and refusal.code is RefusalCode.NO_ATTENTION:
        return dataclasses.replace(refusal, text=refusal.text + _storage_hint(fusion))
    return refusal


def _storage_hint(fusion: Fusion) -> Message | str:
    """The line naming ``storage="qdq"`` for a model fused nothing whose caches it keeps."""
    if fusion.fused or not any(not c.stored for c in find_qdq_caches(fusion.model.graph)):
        return ""
    return Message(
        " Its caches can be stored quantized around its own attention: ", Param("storage", QDQ), "."
    )


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


def target_of(request: Request, model: ir.Model) -> tuple[str | None, str]:
    """``(provider, how it was inferred)``: the request's, or for ``"auto"`` where ``model`` will
    run (an fp8 cache: CUDA; a genai config's provider; the dtype)."""
    if request.target != AUTO:
        return request.target, ""
    return infer_target(model, request.genai_config, request.format)


def _named(target: str | None, why: str, explain: bool) -> str:
    """The target as a message names it (``explain``: with how it was inferred)."""
    if not why or not explain:
        return str(target)
    return Message(f"{target} (inferred: {why}; name the target with ", Param("ep", placeholder="..."), ")")


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
    have = own or asked
    paged = any(s.op.op_type != "GroupQueryAttention" for s in sites)
    if own is None and asked is not None and asked.rotates and paged:  # before the scales: none can cure it
        raise _paged_refusal(request)
    if own is not None and asked is not None and asked != own:
        raise KvCacheError(
            f"{request.name}'s cache is already rotated ({own.name}): requantizing keeps it. Convert the "
            "original model for ",
            Param("rotation", asked.name),
            ".",
        )
    if have is not None and recorded is not None and recorded != have:
        where = f"the model's cache is rotated ({have.name})" if own is not None else f"{have.name} was asked"
        raise KvCacheError(
            f"The scales were calibrated for rotation {recorded.name}; {where}. Calibrate "
            + ("the original model " if own is not None else "")
            + "with ",
            Param("rotation", have.name),
            *((" or convert with ", Param("rotation", recorded.name)) if own is None and not paged else ()),
            ".",
        )
    rotation = have or recorded or ROTATIONS["none"]
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


def _refused(decision: Decision, head: str, refusals: tuple[Refusal, ...], *, bare: bool = False) -> Decision:
    """``decision`` refused with ``refusals``: ``strict`` raises (``bare``: the texts alone)."""
    text = Message.joined(texts(refusals))
    message = Message(head, ": ", text)
    if decision.request.strict:
        raise KvCacheError(text if bare else message)
    return dataclasses.replace(decision, refusals=refusals, message=message)


def decide(request: Request) -> Decision:
    """Run the rules on ``request`` (fusing its model, or a copy); nothing is quantized yet."""
    rules = request.rules
    validate_model(request.model)  # a malformed model is refused before any work; unsorted nodes sorted
    if request.storage == QDQ:
        return storage_decision(request)
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
        return _refused(decision, rules.refused_head, (early,), bare=rules.raise_bare)
    target, why = target_of(request, fusion.model)
    logger.info("%s: target %s (%s).", request.entry, target, why or "given")
    decision = dataclasses.replace(decision, target=target, why=why)
    named = _named(target, why, rules.explain_target)
    if refusals := _fusion_refusals(request, fusion, target):
        return _refused(decision, Message("Attention not fused for ", named), refusals)
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
        return _refused(decision, rules.refused_head, (partial,), bare=rules.raise_bare)
    return dataclasses.replace(decision, warnings=tuple(conversion_warnings(fusion.model, fmt.name, target)))


def check_storage(storage: object) -> None:
    """``storage`` is a name of :data:`STORAGES` (checked before any work)."""
    if storage not in STORAGES:
        raise KvCacheError(Param("storage"), f" must be 'auto' or 'qdq', got {storage!r}.")


def storage_decision(request: Request) -> Decision:
    """``storage="qdq"``'s rules: no fusion; the format named (else int8) and the granularity asked
    (else the one the scales record or their sizes fit, else per tensor); nothing to store refuses
    ``convert_model``; the target's storage row gates it."""
    model, rules = request.model, request.rules
    if request.shared_kv_scale or (request.rotation is not None and get_rotation(request.rotation).rotates):
        raise KvCacheError(
            "A cache stored through QuantizeLinear/DequantizeLinear takes neither ",
            Param("shared_kv_scale", True),
            " nor a rotation: drop them, or convert with ",
            Param("storage", AUTO),
            ".",
        )
    fusion = _storage_fusion(request)
    fmt = get_format(request.format or "int8")
    scales = as_kv_cache_scales(request.scales, format=fmt.name)
    granularity = scale_granularity(request.granularity or QdqKvCachePass.granularity_for(model, scales))
    decision = Decision(request, fusion, format=fmt, granularity=granularity, scales=scales)
    caches = find_qdq_caches(model.graph)
    if all(c.stored for c in caches):
        if not rules.refuse_nothing_to_do:
            return dataclasses.replace(decision, format=None)
        refusal = _nothing_stored(request, caches)
        return _refused(decision, rules.refused_head, (refusal,), bare=rules.raise_bare)
    if (kept := _kept_float(request, caches, fmt)) is not None:
        return _refused(decision, rules.refused_head, (kept,), bare=rules.raise_bare)
    target, why = target_of(dataclasses.replace(request, format=None), model)  # fp8 does not mean CUDA here
    decision = dataclasses.replace(decision, target=target, why=why)
    refusals = storage_refusals(target, fmt.name, granularity.name) if target is not None else ()
    if refusals:
        named = _named(target, why, rules.explain_target)
        return _refused(decision, Message(f"KV cache not stored as {fmt.name} for ", named), refusals)
    return decision


def _storage_fusion(request: Request) -> Fusion:
    """``storage="qdq"`` fuses nothing: ``verify=True`` does not apply (a warning, and the
    conversion's note); an export whose attention would fuse is said to (INFO: ``auto`` holds
    its cache in the attention kernel, and the kernel reads it quantized)."""
    model = request.model
    had = bool(find_attention_sites(model, with_cache_only=False))
    checked = None
    if request.verify is True:
        checked = Verification(
            False, skipped="nothing is fused (the caches are stored around the model's attention)"
        )
        warn(Message(Param("verify", True), f" does not apply: {checked.line}."), FusionSkippedWarning)
    if not had and request.fuse is not False and fuse_unless_attention(model, in_copy=True).fused:
        logger.info(
            "%s",
            Message(
                f"{request.name}'s attention fuses: ",
                Param("storage", AUTO),
                " would hold its cache quantized in the attention kernel (the kernel reads it quantized; "
                "these caches are dequantized whole each step).",
            ),
        )
    return Fusion(model, had, verification=checked)


def _kept_float(request: Request, caches: list[Any], fmt: CacheFormat) -> Refusal | None:
    """Rule 8 under ``storage="qdq"``: the model's float caches (its I/O names) no writer of
    :func:`find_qdq_caches` holds would keep their type, refused unless ``allow_partial``."""
    if request.allow_partial:
        return None
    found = {c.past.name for c in caches}
    kept = [c.past for c in find_io_caches(request.model) if c.format is None and c.past not in found]
    if not kept:
        return None
    text = Message(
        f"{', '.join(kept)} would keep their float type (no Concat, TensorScatter or ONNX Attention writes "
        f"them into their present) while the others become {fmt.name}. A model whose caches mix types is "
        "converted only with ",
        Param("allow_partial", True),
        ".",
    )
    return Refusal(RefusalCode.PARTIAL_CONVERSION, Parameter.ALLOW_PARTIAL, text)


def _nothing_stored(request: Request, caches: list[Any]) -> Refusal:
    """``convert_model``'s refusal of a model with no float cache ``storage="qdq"`` keeps."""
    if caches:
        text = Message(
            f"{request.name}'s caches are stored quantized already: nothing to convert (a stored cache is "
            "not requantized): convert the original export to store them in another format or granularity."
        )
        return Refusal(RefusalCode.ALREADY_CONVERTED, Parameter.FORMAT, text)
    text = Message(
        f"{request.name} has no cache that QuantizeLinear/DequantizeLinear storage keeps (a past input "
        "written into its present output by Concat, TensorScatter or ONNX Attention): nothing to convert "
        "this way. Convert with ",
        Param("storage", AUTO),
        " (its attention kernel holds the cache).",
    )
    return dataclasses.replace(NO_ATTENTION, text=text)


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
        return _refused(decision, head, refusals), True
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
        QdqKvCachePass(decision.format.name, decision.granularity.name, decision.scales)(decision.model)
        validate_model(decision.model)
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
