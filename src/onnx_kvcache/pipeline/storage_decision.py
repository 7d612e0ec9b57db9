"""The ``storage="qdq"`` decision: :func:`storage_decision` in place of the ``auto`` one's rules.

``storage="qdq"`` (:func:`storage_decision`) replaces rules 1 to 9 of
:mod:`~onnx_kvcache.pipeline.decision`: nothing is fused; the caches
:func:`~onnx_kvcache.cache.storage.find_qdq_caches` finds are stored in the format named (else
int8) through QuantizeLinear/DequantizeLinear (:class:`~onnx_kvcache.passes.QdqKvCachePass`,
:func:`store`), gated by the target's storage row
(:func:`~onnx_kvcache.capabilities.gating.storage_refusals`). Under ``auto`` (the attention
kernel holds the cache) a model whose attention fused nothing but whose caches that storage
keeps (MLA, static buffers) is refused with a line naming it (:func:`storage_hint`).

The caches' rotation (:func:`stored_rotation_for`) is the model's own (what its graph turns),
else the one named, else the one the scales record (none without a record); the three must
agree, and a rotation is placed only where an ONNX Attention reads every cache it turns
(:func:`~onnx_kvcache.cache.storage.attention_read`; :class:`~onnx_kvcache.passes.StoredCacheRotationPass`
runs before the caches are stored).
:func:`check_storage` checks the name asked against :data:`STORAGES` before any work.
"""

from __future__ import annotations

__all__ = [
    "QDQ",
    "STORAGES",
    "check_storage",
    "storage_decision",
    "storage_hint",
    "store",
    "storage_first",
    "stored_rotation_for",
]

import dataclasses
import logging
from typing import Any

import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat, get_format, scale_granularity
from onnx_kvcache.cache.io_caches import find_io_caches
from onnx_kvcache.cache.rotation import (
    DEFAULT_MATRIX,
    MATRICES,
    Rotation,
    RotationMatrix,
    get_rotation,
    stored_rotation,
    turned_caches,
)
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.cache.storage import attention_read, find_qdq_caches
from onnx_kvcache.cache.validation import validate_model
from onnx_kvcache.capabilities.gating import NO_ATTENTION, storage_refusals
from onnx_kvcache.capabilities.refusals import Parameter, Refusal, RefusalCode
from onnx_kvcache.errors import FusionSkippedWarning, KvCacheError, Message, Param, warn
from onnx_kvcache.passes import QdqKvCachePass, StoredCacheRotationPass
from onnx_kvcache.pipeline._decision_terms import (
    AUTO,
    QDQ,
    STORAGES,
    Decision,
    Fusion,
    Request,
    agreed_rotation,
    refuse,
    target_named,
    target_of,
)
from onnx_kvcache.pipeline._fusing import fuse_unless_attention
from onnx_kvcache.pipeline.verification import Verification
from onnx_kvcache.scales.files import KvCacheScales, as_kv_cache_scales

logger = logging.getLogger(__name__)


def check_storage(storage: object) -> None:
    """``storage`` is a name of :data:`STORAGES` (checked before any work)."""
    if storage not in STORAGES:
        raise KvCacheError(Param("storage"), f" must be 'auto' or 'qdq', got {storage!r}.")


def storage_decision(request: Request) -> Decision:
    """``storage="qdq"``'s rules: no fusion; the format named (else int8) and the granularity asked
    (else the one the scales record or their sizes fit, else per tensor); nothing to store refuses
    ``convert_model``; the target's storage row gates it."""
    model, rules = request.model, request.rules
    if request.shared_kv_scale:
        raise KvCacheError(
            "A cache stored through QuantizeLinear/DequantizeLinear takes no ",
            Param("shared_kv_scale", True),
            ": drop it, or convert with ",
            Param("storage", AUTO),
            ".",
        )
    fusion = _storage_fusion(request)
    fmt = get_format(request.format or "int8")
    scales = as_kv_cache_scales(request.scales, format=fmt.name)
    granularity = scale_granularity(request.granularity or QdqKvCachePass.granularity_for(model, scales))
    decision = Decision(request, fusion, format=fmt, granularity=granularity, scales=scales)
    caches = find_qdq_caches(model.graph)
    if all(c.stored for c in caches):  # before the rotation: no scales can cure it
        if not rules.refuse_nothing_to_do:
            return dataclasses.replace(decision, format=None)
        refusal = _nothing_stored(request, caches)
        return refuse(decision, rules.refused_head, (refusal,), bare=rules.raise_bare)
    rotation, matrix = stored_rotation_for(request, model, scales)
    decision = dataclasses.replace(decision, rotation=rotation, matrix=matrix)
    if (kept := _kept_float(request, caches, fmt)) is not None:
        return refuse(decision, rules.refused_head, (kept,), bare=rules.raise_bare)
    target, why = target_of(dataclasses.replace(request, format=None), model)  # fp8 does not mean CUDA here
    decision = dataclasses.replace(decision, target=target, why=why)
    refusals = storage_refusals(target, fmt.name, granularity.name) if target is not None else ()
    if refusals:
        named = target_named(target, why, rules.explain_target)
        return refuse(decision, Message(f"KV cache not stored as {fmt.name} for ", named), refusals)
    return decision


def stored_rotation_for(
    request: Request, model: ir.Model, scales: KvCacheScales | None
) -> tuple[Rotation, RotationMatrix]:
    """The stored caches' rotation and ``H`` (the module's rules): the model's own, else the one
    named, else the one ``scales`` record; they must agree. A rotation no ONNX Attention can take
    (a cache it turns that none reads alone) is refused first, naming the caches: no other
    rotation of the scales' or the request's could cure it."""
    own, own_matrix = stored_rotation(model)
    asked = get_rotation(request.rotation) if request.rotation is not None else None
    recorded = get_rotation(scales.metadata.get("rotation", "none")) if scales is not None else None
    if not own.rotates:  # a rotation no Attention takes first: the scales' or the request's
        for wanted, from_scales in ((recorded, True), (asked, False)):
            if wanted is not None and wanted.rotates:
                _check_placed(model, wanted, from_scales)
    rotation = agreed_rotation(request, own if own.rotates else None, asked, recorded)
    recorded_matrix = scales.rotation_matrix if scales is not None else None
    return rotation, own_matrix or recorded_matrix or MATRICES[DEFAULT_MATRIX]


def _check_placed(model: ir.Model, rotation: Rotation, from_scales: bool) -> None:
    """``rotation`` (the scales' or the one asked) is refused where a cache it turns is read by no
    ONNX Attention alone: no query turns with it."""
    unread = [str(c.past.name) for c in turned_caches(model, rotation) if attention_read(c) is None]
    if not unread:
        return
    name = rotation.name
    head = (
        f"The scales were calibrated for rotation {name}, which turns"
        if from_scales
        else f"Rotation {name} turns"
    )
    raise KvCacheError(
        f"{head} the query with the keys, and no ONNX Attention reads {', '.join(unread)} alone (a "
        "latent an up-projection reads, or attention of plain operators): stored through "
        "QuantizeLinear/DequantizeLinear, these caches are unrotated. Calibrate and convert with ",
        Param("rotation", "none"),
        *(
            (
                ", or convert with ",
                Param("storage", AUTO),
                " where the attention fuses (its kernel's cache is rotated)",
            )
            if from_scales
            else ()
        ),
        ".",
    )


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


def storage_first(request: Request) -> Decision | None:
    """The decision storage makes before ``auto``'s rules: ``storage="qdq"``'s
    (:func:`storage_decision`); under ``auto``, a model with no attention node of ours whose
    caches are stored through QuantizeLinear/DequantizeLinear already: nothing to fuse or convert
    (``convert_model`` refuses it, as ``qdq`` does, naming the original export). None: ``auto``'s
    rules decide."""
    if request.storage == QDQ:
        return storage_decision(request)
    caches = find_qdq_caches(request.model.graph)
    if not caches or not all(c.stored for c in caches) or find_attention_sites(request.model):
        return None
    decision = Decision(request, Fusion(request.model, had_attention=False))
    if not request.rules.refuse_nothing_to_do:
        return decision
    refusal = _nothing_stored(request, caches)
    return refuse(decision, request.rules.refused_head, (refusal,), bare=request.rules.raise_bare)


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


def storage_hint(fusion: Fusion) -> Message | str:
    """The line naming ``storage="qdq"`` for a model fused nothing whose caches it keeps."""
    if fusion.fused or not any(not c.stored for c in find_qdq_caches(fusion.model.graph)):
        return ""
    return Message(
        " Its caches can be stored quantized around its own attention: ", Param("storage", QDQ), "."
    )


def store(decision: Decision) -> None:
    """The decided caches rotated, then stored through QuantizeLinear/DequantizeLinear, the model
    validated (what is returned or written loads)."""
    assert decision.format is not None and decision.granularity is not None
    StoredCacheRotationPass(decision.rotation, decision.matrix)(
        decision.model
    )  # none, a rotated model: no-op
    QdqKvCachePass(decision.format.name, decision.granularity.name, decision.scales)(decision.model)
    validate_model(decision.model)
