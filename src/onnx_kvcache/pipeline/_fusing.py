"""Fusing a model's attention for every entry point: :func:`fuse_unless_attention`.

A model without attention nodes (an export) is fused into GroupQueryAttention
(:class:`~onnx_kvcache.passes.fusion.gqa_fusion.GqaFusionPass`); the fusion's warnings are
recorded, said only if the result is kept; the export and its fused model run side by side
(:mod:`~onnx_kvcache.pipeline.verification`), a difference refuses.
:mod:`onnx_kvcache.pipeline.decision` re-exports it.
"""

from __future__ import annotations

__all__ = ["fuse_unless_attention"]

import warnings
from typing import Literal

import onnx_ir as ir

from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.capabilities.refusals import Refusal, RefusalCode
from onnx_kvcache.errors import FusionSkippedWarning, Message, Param, warn
from onnx_kvcache.model_io.reading import check_defined
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass, unfused_refusal
from onnx_kvcache.pipeline._decision_terms import AUTO, Fusion
from onnx_kvcache.pipeline.verification import too_large, verify_fusion


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
