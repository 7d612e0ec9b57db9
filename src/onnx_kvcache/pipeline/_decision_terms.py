"""The terms of the pipeline's decision: what a caller asks (:class:`Request`), what was fused
(:class:`Fusion`) and what was decided (:class:`Decision`).

:data:`ENTRIES` holds how ``convert_model`` and ``optimize_model`` differ (one
:class:`EntryRules` row each); :data:`STORAGES` where a quantized cache is kept;
:func:`target_of` the provider a request runs on; :func:`refuse` a decision that says why
not; :func:`agreed_rotation` the rotation a model, a request and its scales agree on.
:mod:`onnx_kvcache.pipeline.decision` re-exports the types and takes the ``auto``
decision; :mod:`onnx_kvcache.pipeline.storage_decision` takes the ``qdq`` one.
"""

from __future__ import annotations

__all__ = [
    "AUTO",
    "ENTRIES",
    "QDQ",
    "STORAGES",
    "Adaptation",
    "Decision",
    "Entry",
    "EntryRules",
    "Fusion",
    "Request",
    "agreed_rotation",
    "refuse",
    "target_named",
    "target_of",
]

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import onnx_ir as ir

from onnx_kvcache._enums import StrEnum
from onnx_kvcache.cache.formats import CacheFormat, ScaleGranularity
from onnx_kvcache.cache.rotation import DEFAULT_MATRIX, MATRICES, ROTATIONS, Rotation, RotationMatrix
from onnx_kvcache.cache.sites import CacheSite
from onnx_kvcache.capabilities.gating import infer_target
from onnx_kvcache.capabilities.refusals import Refusal, RefusalCode, texts
from onnx_kvcache.errors import KvCacheError, KvCacheWarning, Message, Param
from onnx_kvcache.pipeline.verification import Verification
from onnx_kvcache.scales.files import KvCacheScales

AUTO: Literal["auto"] = "auto"
QDQ: Literal["qdq"] = "qdq"
#: Where a quantized cache is kept: ``auto``, the attention kernel (GroupQueryAttention,
#: PagedAttention); ``qdq``, the graph's own QuantizeLinear/DequantizeLinear around the cache.
STORAGES = (AUTO, QDQ)


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
    :data:`~onnx_kvcache.pipeline.verification.MAX_BYTES` of weights;
    :func:`~onnx_kvcache.pipeline.verification.verify_fusion`)."""
    window_sized: bool = False
    """Fused rolling window caches become window-sized (:func:`~onnx_kvcache.passes.fusion.window_sized.
    make_window_sized`:
    an onnxruntime-genai folder, whose runtime allocates them); False: they keep the export's inputs."""
    storage: str = AUTO
    """A name of :data:`STORAGES`: ``qdq`` decides by
    :func:`~onnx_kvcache.pipeline.storage_decision.storage_decision`."""

    @property
    def rules(self) -> EntryRules:
        return ENTRIES[self.entry]


@dataclasses.dataclass(frozen=True)
class Fusion:
    """What :func:`~onnx_kvcache.pipeline.decision.fuse_unless_attention` did."""

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
    """The converted cache's rotation (:func:`~onnx_kvcache.pipeline.decision.rotation_for`);
    applied before quantizing."""
    matrix: RotationMatrix = MATRICES[DEFAULT_MATRIX]
    """Its ``H`` (:func:`~onnx_kvcache.pipeline.decision.matrix_for`)."""

    @property
    def model(self) -> ir.Model:
        return self.fusion.model

    @property
    def converted(self) -> bool:
        return not self.refusals


def target_of(request: Request, model: ir.Model) -> tuple[str | None, str]:
    """``(provider, how it was inferred)``: the request's, or for ``"auto"`` where ``model`` will
    run (an fp8 cache: CUDA; a genai config's provider; the dtype)."""
    if request.target != AUTO:
        return request.target, ""
    return infer_target(model, request.genai_config, request.format)


def target_named(target: str | None, why: str, explain: bool) -> str:
    """The target as a message names it (``explain``: with how it was inferred)."""
    if not why or not explain:
        return str(target)
    return Message(f"{target} (inferred: {why}; name the target with ", Param("ep", placeholder="..."), ")")


def refuse(decision: Decision, head: str, refusals: tuple[Refusal, ...], *, bare: bool = False) -> Decision:
    """``decision`` refused with ``refusals``: ``strict`` raises (``bare``: the texts alone)."""
    text = Message.joined(texts(refusals))
    message = Message(head, ": ", text)
    if decision.request.strict:
        raise KvCacheError(text if bare else message)
    return dataclasses.replace(decision, refusals=refusals, message=message)


def agreed_rotation(
    request: Request,
    own: Rotation | None,
    asked: Rotation | None,
    recorded: Rotation | None,
    *,
    offer_recorded: bool = True,
) -> Rotation:
    """The cache's rotation as the model (``own``: None when unrotated), the request and its
    scales say it: a rotated model keeps its own, and another asked, or scales of another, are
    refused (scales are measured on the original model); else the one asked, else the one
    recorded, which must agree (``offer_recorded``: the refusal offers converting as recorded)."""
    if own is not None:
        if asked is not None and asked != own:
            raise KvCacheError(
                f"{request.name}'s cache is already rotated ({own.name}): requantizing keeps it. Convert the "
                "original model for ",
                Param("rotation", asked.name),
                ".",
            )
        if recorded is not None and recorded != own:
            raise KvCacheError(
                f"The scales were calibrated for rotation {recorded.name}; the model's cache is rotated "
                f"({own.name}). Calibrate the original model with ",
                Param("rotation", own.name),
                ".",
            )
        return own
    if asked is not None and recorded is not None and asked != recorded:
        raise KvCacheError(
            f"The scales were calibrated for rotation {recorded.name}; {asked.name} was asked. Calibrate "
            "with ",
            Param("rotation", asked.name),
            *((" or convert with ", Param("rotation", recorded.name)) if offer_recorded else ()),
            ".",
        )
    return asked or recorded or ROTATIONS["none"]
