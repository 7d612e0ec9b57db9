"""``optimize_model``: fuse attention, gate on the target, quantize the KV cache.

It never returns a model that cannot load where the user said it will run: when the
request cannot be honoured it warns once with every reason and returns the model as it was,
unfused and unconverted (``strict=True`` raises instead); an error leaves it as it was too.
It returns the model, always: ask :func:`~onnx_kvcache.capabilities.table.check_kv_cache_support`
or :func:`~onnx_kvcache.cache.layout.inspect_kv_cache` what became of it. The decision is
:mod:`onnx_kvcache.pipeline.decision`'s, as ``convert_model``'s.
"""

from __future__ import annotations

__all__ = ["optimize_model"]

import dataclasses
from typing import Literal

import onnx_ir as ir

from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.errors import (
    KvCacheError,
    KvCacheTypeError,
    Param,
    require_flags,
    require_optional_flags,
    require_type,
)
from onnx_kvcache.model_io.reading import ModelLike, as_model
from onnx_kvcache.passes.kv_cache_quantization import format_for
from onnx_kvcache.pipeline.decision import Entry, Request, carry_out, decide
from onnx_kvcache.pipeline.storage_decision import check_storage
from onnx_kvcache.scales.files import KvCacheScales, ScalesLike, as_kv_cache_scales, resolve_granularity


def _commit(model: ir.Model, work: ir.Model) -> None:
    """Make ``model`` what ``work`` (its converted copy) is."""
    if work is not model:
        model.graph = work.graph  # opset imports live on the graph
        model.ir_version = work.ir_version  # float8 caches raise it
        model.functions.clear()
        model.functions.update(work.functions)


def _check_options(
    ep: str | None, fp8_kv_cache: bool, format: str | None, fuse_attention: object
) -> str | None:
    """The options that need no model, checked; the format ``fp8_kv_cache`` names."""
    require_type(fuse_attention, (bool, str), "fuse_attention", "True, False or 'auto'")
    if fuse_attention not in (True, False, "auto"):  # "false", "no": a yes/no of the wrong type
        raise KvCacheTypeError(
            Param("fuse_attention"), f" must be True, False or 'auto', got {fuse_attention!r}."
        )
    if fp8_kv_cache:
        if format not in (None, "fp8"):
            raise KvCacheError(Param("fp8_kv_cache", True), " conflicts with ", Param("format", format), ".")
        format = "fp8"
    require_type(ep, (str, type(None)), "ep", "a provider name, 'auto' or None")  # as convert_model
    if ep == "":
        raise KvCacheError(Param("ep"), " must name a provider (cpu, cuda, ...), 'auto' or None; got ''.")
    return format


def _format_and_scales(
    model: ir.Model, format: str | None, scales: ScalesLike, granularity: str | None, shared: bool
) -> tuple[str | None, KvCacheScales | None]:
    """The format to convert to (None: fuse only) and the scales read for it.

    An already-quantized model's own format is requantized unless another is named; scales
    without a format give the one they were made for."""
    own = format_for(model)
    if format is None and scales is not None:  # as convert: the scales' format
        scales = as_kv_cache_scales(scales)  # a file is read once
        implied = scales.implied_format if scales is not None else None
        format = implied or own
        if format is None:
            raise KvCacheError(
                Param("scales"),
                " were given without ",
                Param("format"),
                ", and they record no format: name it (",
                Param("format", "int8"),
                ", ...).",
            )
    if format is None and (granularity is not None or shared):
        if own is None:  # the message names what was given
            given = [Param("granularity", granularity)] if granularity is not None else []
            given += [Param("shared_kv_scale", True)] if shared else []
            joined = [part for i, p in enumerate(given) for part in ((" and ", p) if i else (p,))]
            verb, them = (" apply", "them") if len(given) > 1 else (" applies", "it")
            raise KvCacheError(
                *joined,
                f"{verb} to a quantized cache: name its format (",
                Param("format", "int8"),
                f", ...) or drop {them}.",
            )
        format = own
    if not format:
        return None, None
    fmt = get_format(format).name
    read = as_kv_cache_scales(scales, format=fmt)
    resolve_granularity(granularity, read)  # a contradiction fails before any work
    return fmt, read


@dataclasses.dataclass(frozen=True)
class _Options:
    """``optimize_model``'s keyword arguments, in its signature's order."""

    ep: str | None
    fp8_kv_cache: bool
    format: str | None
    granularity: str | None
    scales: ScalesLike
    fuse_attention: bool | Literal["auto"]
    check_device: bool
    strict: bool
    shared_kv_scale: bool
    allow_partial: bool = False
    rotation: str | None = None
    verify: bool | None = None
    storage: str = "auto"

    def __post_init__(self) -> None:
        """A yes/no option that is not ``True`` or ``False`` is refused before any work."""
        require_flags(
            fp8_kv_cache=self.fp8_kv_cache,
            check_device=self.check_device,
            strict=self.strict,
            shared_kv_scale=self.shared_kv_scale,
            allow_partial=self.allow_partial,
        )
        require_optional_flags(verify=self.verify)
        check_storage(self.storage)


def _request(model: ModelLike, options: _Options, fmt: str | None) -> Request:
    """The decision's request for ``optimize_model``'s arguments (``options``: the rest)."""
    model = as_model(model)
    shared = options.shared_kv_scale
    granularity = options.granularity
    fmt, scales = _format_and_scales(model, fmt, options.scales, granularity, shared)
    return Request(
        model,
        Entry.OPTIMIZE,
        fmt,
        resolve_granularity(granularity, scales) if granularity is not None else None,
        scales,
        options.ep,
        fuse=options.fuse_attention,
        check_device=options.check_device,
        strict=options.strict,
        shared_kv_scale=shared,
        allow_partial=options.allow_partial,
        rotation=options.rotation,
        verify=options.verify,
        storage=options.storage,
    )


def _optimize(model: ModelLike, options: _Options) -> ir.Model:
    """Check, decide and carry out ``optimize_model``'s request; the model it returns."""
    fmt = _check_options(options.ep, options.fp8_kv_cache, options.format, options.fuse_attention)
    request = _request(model, options, fmt)
    decision = decide(request)
    if carry_out(decision):
        _commit(request.model, decision.model)
    return request.model


def optimize_model(
    model: ModelLike,
    *,
    ep: str | None = "auto",
    fp8_kv_cache: bool = False,
    format: str | None = None,
    granularity: str | None = None,
    scales: ScalesLike = None,
    fuse_attention: bool | Literal["auto"] = "auto",
    check_device: bool = False,
    strict: bool = False,
    shared_kv_scale: bool = False,
    allow_partial: bool = False,
    rotation: str | None = None,
    verify: bool | None = None,
    storage: str = "auto",
) -> ir.Model:
    """Optimize a decoder for onnxruntime and store its KV cache quantized.

    Args:
        model: ``ir.Model`` (changed in place), ``onnx.ModelProto`` or a path.
        ep: Where the model will run (``cuda``, ``cpu``, ...). ``"auto"``
            infers it as ``convert`` does (an fp8 cache: CUDA; a model converted before:
            what it was converted for; fp16/bf16 attention: CUDA; float32: CPU), looking at
            the model after fusion. ``None`` skips gating (the caller takes responsibility).
        fp8_kv_cache: Shorthand for ``format="fp8"``.
        format: ``fp8``, ``int8`` or ``int4``; ``None``: the format the scales were
            made for (calibration and our scale files record it), else nothing is quantized;
            an already-quantized model given scales, a granularity or ``shared_kv_scale``
            keeps its own format (it is requantized).
        granularity: ``per_tensor`` or ``per_channel``; None takes the one the
            scales record (calibration and our scale files do), else ``per_tensor``.
        scales: What the pass accepts, or a scale-file path.
        fuse_attention: ``"auto"`` fuses (:class:`GqaFusionPass`: exported attention,
            proven equivalent for unpadded and left-padded rows) only when the
            model has no attention node (GroupQueryAttention, PagedAttention); ``True``
            always; ``False`` never. A fusion whose result ``ep`` cannot
            run (e.g. a float32 model for CUDA, which has no float32 GQA) is not applied.
        check_device: Also check the local GPU's compute capability.
        strict: Raise instead of warning when the request cannot be honoured.
        shared_kv_scale: One tensor for k_scale and v_scale (older CUDA fast path).
        allow_partial: Convert the caches that can be when others would keep their type (a
            layer left unfused, a cache also read by another node); without it such a model
            is left as it was, with a warning naming the layers (``strict``: raises).
        rotation: ``none``, ``keys`` or ``keys_and_values``: the cache turned by an orthonormal
            matrix before it is quantized (docs/rotation.md); None: the one the scales record
            (none without a record), an already-rotated model's own.
        verify: Run the export and its fused model side by side on onnxruntime's CPU once its
            attention is fused, and raise when their logits differ
            (:func:`~onnx_kvcache.pipeline.verification.verify_fusion`); None: for weights up to
            :data:`~onnx_kvcache.pipeline.verification.MAX_BYTES`, True: whatever their size.
        storage: ``"auto"``: the attention kernel holds the quantized cache; ``"qdq"``: nothing is
            fused, and each cache the model's own attention reads (multi-head latent attention,
            static buffers) is stored in ``format`` (default int8) through
            QuantizeLinear/DequantizeLinear (:class:`~onnx_kvcache.passes.QdqKvCachePass`).

    A function, not a pass: call it, or compose the passes it runs (``ir.passes.PassManager(
    [GqaFusionPass(), Fp8KvCachePass(scales)])``). A float32 model for a target without float32
    GroupQueryAttention (CUDA) gets its attention computed in float16 around the converted cache
    (:class:`~onnx_kvcache.passes.float16_attention.Float16AttentionPass`, one
    ``Float16AttentionWarning``), weights untouched. An int8 or int4 cache for the CPU has its
    prompt (a call of several tokens) attend through the float kernel, each new token through the
    quantized one (:class:`~onnx_kvcache.passes.PromptFloatAttentionPass`, run last; docs/converting.md,
    "The prompt on the CPU"): compose it after the quantization pass to get the same.

    Returns:
        The model (the same object when ``model`` is an ``ir.Model``), converted or, with a
        warning, as it was. A request that converts nothing is easy to miss in a script: it
        returns the model unchanged with one ``NotConvertedWarning`` (the reasons), so pass
        ``strict=True`` to raise :class:`~onnx_kvcache.KvCacheError` instead, or check the result
        (``inspect_kv_cache(model)``: every layer's cache dtype).
    """
    options = _Options(**{name: value for name, value in locals().items() if name != "model"})
    return _optimize(model, options)
