"""``optimize_model``: fuse attention, gate on the target, quantize the KV cache.

It never returns a model that cannot load where the user said it will run: when the
request cannot be honoured it warns once with every reason and returns the model as it was,
unfused and unconverted (``strict=True`` raises instead); an error leaves it as it was too.
It returns the model, always: ask :func:`~onnx_kvcache.capabilities.table.check_kv_cache_support`
or :func:`~onnx_kvcache.cache.layout.inspect_kv_cache` what became of it.
"""

from __future__ import annotations

__all__ = ["optimize_model"]

import contextlib
import dataclasses
import logging
import re
import warnings
from collections.abc import Iterator
from typing import Literal

import onnx_ir as ir

from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.capabilities.device import cuda_compute_capability
from onnx_kvcache.capabilities.table import check_kv_cache_support, conversion_warnings, infer_target
from onnx_kvcache.errors import KvCacheError, NotConvertedWarning, RuntimeSupportWarning, warn
from onnx_kvcache.files.reading import ModelLike, as_model, check_defined
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass, unfused_refusal
from onnx_kvcache.passes.kv_cache_quantization import KvCacheQuantizationPass, format_for, granularity_for
from onnx_kvcache.scales.files import ScalesLike, as_kv_cache_scales, resolve_granularity

AUTO = "auto"
logger = logging.getLogger(__name__)


def _target(model: ir.Model, ep: str | None, fmt: str | None) -> tuple[str | None, str]:
    """``(provider, how it was chosen)``: ``ep`` as given, or for ``"auto"`` where the model
    will run (:func:`~onnx_kvcache.capabilities.table.infer_target`; an fp8 cache means CUDA)."""
    if ep != AUTO:
        return ep, ""
    return infer_target(model, format=fmt)


def _fused(model: ir.Model) -> tuple[ir.Model, list[warnings.WarningMessage], str | None]:
    """A fused copy of ``model``, the warnings the fusion gave (said only if it is kept) and
    why converting it must not go on (:func:`unfused_refusal`: attention left unfused)."""
    check_defined(model.graph)
    fused = model.clone()
    fusion = GqaFusionPass()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fusion(fused)
    return fused, said, unfused_refusal(fusion.fused, fusion.refused)


def _commit(model: ir.Model, work: ir.Model) -> None:
    """Make ``model`` what ``work`` (its converted copy) is."""
    if work is not model:
        model.graph = work.graph  # opset imports live on the graph
        model.ir_version = work.ir_version  # float8 caches raise it
        model.functions.clear()
        model.functions.update(work.functions)


def optimize_model(
    model: ModelLike,
    *,
    execution_provider: str | None = "auto",
    fp8_kv_cache: bool = False,
    kv_cache_format: str | None = None,
    kv_cache_granularity: str | None = None,
    kv_cache_scales: ScalesLike = None,
    fuse_attention: bool | Literal["auto"] = "auto",
    check_device: bool = False,
    strict: bool = False,
    shared_kv_scale: bool = False,
) -> ir.Model:
    """Optimize a decoder for onnxruntime and store its KV cache quantized.

    Args:
        model: ``ir.Model`` (changed in place), ``onnx.ModelProto`` or a path.
        execution_provider: Where the model will run (``cuda``, ``cpu``, ...). ``"auto"``
            infers it as ``convert`` does (an fp8 cache: CUDA; a model converted before:
            what it was converted for; fp16/bf16 attention: CUDA; float32: CPU), looking at
            the model after fusion. ``None`` skips gating (the caller takes responsibility).
        fp8_kv_cache: Shorthand for ``kv_cache_format="fp8"``.
        kv_cache_format: ``fp8``, ``int8`` or ``int4``; ``None``: the format the scales were
            made for (calibration and our scale files record it), else nothing is quantized;
            an already-quantized model given scales, a granularity or ``shared_kv_scale``
            keeps its own format (it is requantized).
        kv_cache_granularity: ``per_tensor`` or ``per_channel``; None takes the one the
            scales record (calibration and our scale files do), else ``per_tensor``.
        kv_cache_scales: What the pass accepts, or a scale-file path.
        fuse_attention: ``"auto"`` fuses (:class:`GqaFusionPass`: PyTorch exports'
            attention, proven equivalent, then onnxscript's ORT fusions) only when the
            model has no attention node (GroupQueryAttention, PagedAttention); ``True``
            always; ``False`` never. A fusion whose result ``execution_provider`` cannot
            run (e.g. a float32 model for CUDA, which has no float32 GQA) is not applied.
        check_device: Also check the local GPU's compute capability.
        strict: Raise instead of warning when the request cannot be honoured.
        shared_kv_scale: One tensor for k_scale and v_scale (older CUDA fast path).

    Returns:
        The model (the same object when ``model`` is an ``ir.Model``), converted or, with a
        warning, as it was.
    """
    with _in_optimize_words():
        if fuse_attention not in (True, False, "auto"):
            raise KvCacheError(f"fuse_attention must be True, False or 'auto', got {fuse_attention!r}.")
        model = as_model(model)
        if fp8_kv_cache:
            if kv_cache_format not in (None, "fp8"):
                raise KvCacheError(f"fp8_kv_cache=True conflicts with kv_cache_format={kv_cache_format!r}.")
            kv_cache_format = "fp8"
        if execution_provider is not None and (
            not isinstance(execution_provider, str) or not execution_provider
        ):
            raise KvCacheError(
                f"execution_provider must name a provider (cpu, cuda, ...), 'auto' or None; got "
                f"{execution_provider!r}."
            )
        own = format_for(model)  # an already-quantized model's: requantized in it unless named
        if kv_cache_format is None and kv_cache_scales is not None:  # as convert: the scales' format
            kv_cache_scales = as_kv_cache_scales(kv_cache_scales)  # a file is read once
            implied = kv_cache_scales.implied_format if kv_cache_scales is not None else None
            kv_cache_format = implied or own
            if kv_cache_format is None:
                raise KvCacheError(
                    "kv_cache_scales were given without kv_cache_format, and they record no format: "
                    "name it (kv_cache_format='int8', ...)."
                )
        if kv_cache_format is None and (kv_cache_granularity is not None or shared_kv_scale):
            if own is None:
                raise KvCacheError(
                    "kv_cache_granularity and shared_kv_scale apply to a quantized cache: name its "
                    "format (kv_cache_format='int8', ...) or drop them."
                )
            kv_cache_format = own
        scales = (
            as_kv_cache_scales(kv_cache_scales, format=get_format(kv_cache_format).name)
            if kv_cache_format
            else None
        )
        resolve_granularity(kv_cache_granularity, scales)  # a contradiction fails before any work
        had_attention = bool(find_attention_sites(model, with_cache_only=False))
        work = model  # converted in a copy when fusing: a refusal or error leaves model as it was
        said: list[warnings.WarningMessage] = []
        unfused = None
        if fuse_attention is True or (fuse_attention == "auto" and not had_attention):
            work, said, unfused = _fused(model)
        if kv_cache_format is not None and unfused is not None:  # all or nothing, as convert
            return _refuse(model, "KV cache not converted", unfused, strict)
        target, why = _target(work, execution_provider, kv_cache_format)
        logger.info("optimize_model: target %s (%s).", target, why or "given")
        if target is not None and not had_attention and find_attention_sites(work):
            fusion = check_kv_cache_support(work, target, None, "per_tensor")  # the float attention
            if not fusion.supported:
                where = f"Attention not fused for {_named(target, why)}"
                return _refuse(model, where, " ".join(fusion.reasons), strict)
        if kv_cache_format is None:
            _commit(model, work)
            _say(said)
            return model
        fmt = get_format(kv_cache_format)
        quantize = KvCacheQuantizationPass(
            fmt.name, kv_cache_granularity, scales, shared_kv_scale=shared_kv_scale
        )
        if target is None:
            quantize(work)
            _commit(model, work)
            _say(said)
            for warning in conversion_warnings(model, fmt.name):
                warn(warning, RuntimeSupportWarning)
            return model
        capability = cuda_compute_capability() if check_device else None
        granularity = quantize.granularity or granularity_for(work, scales)
        report = check_kv_cache_support(work, target, fmt.name, granularity, compute_capability=capability)
        if check_device and capability is None and report.ep == "cuda":
            no_gpu = (
                "check_device=True: no CUDA GPU found on this machine (without it, the check is "
                "left to the GPU that runs the model)."
            )
            report = dataclasses.replace(report, supported=False, reasons=(*report.reasons, no_gpu))
        if not report.supported:
            where = f"KV cache not converted to {fmt.name} {granularity} for {_named(target, why)}"
            return _refuse(model, where, " ".join(report.reasons), strict)
        quantize(work)
        _commit(model, work)
        _say(said)
        for warning in report.warnings:
            warn(warning, RuntimeSupportWarning)
        return model


@contextlib.contextmanager
def _in_optimize_words() -> Iterator[None]:
    """Errors of the passes name their parameters (``scales=``); say optimize_model's."""
    try:
        yield
    except KvCacheError as error:
        worded = re.sub(r"(?<![\w.-])(scales|granularity)=", r"kv_cache_\1=", str(error))
        if worded == str(error):
            raise
        raise type(error)(worded) from error


def _refuse(model: ir.Model, where: str, reasons: str, strict: bool) -> ir.Model:
    """The model as it was, with one warning (``strict``: an error) saying why."""
    message = f"{where}: {reasons}"
    if strict:
        raise KvCacheError(message)
    warn(message, NotConvertedWarning)
    return model


def _say(said: list[warnings.WarningMessage]) -> None:
    for warning in said:
        warn(str(warning.message), warning.category)


def _named(target: str | None, why: str) -> str:
    """The target as a message names it: with how it was inferred and how to name another."""
    if not why:
        return str(target)
    return f"{target} (inferred: {why}; name the target with execution_provider=...)"
