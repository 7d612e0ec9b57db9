"""Model files and folders: what a model is made of, path checks, and conversion.

A conversion changes a few graph inputs and outputs and no weight, so weights are never
read. Where the output's weights live:

* **beside** the input (same folder): the new graph names the same data files; nothing
  is copied or linked.
* **in place**: the graph (and genai_config.json) is replaced in one atomic commit,
  keeping the files' mode and owner.
* **another folder**: the data files are cloned where the filesystem can, else copied
  (holes kept); hard links only when asked (``weights="link"``), because onnx and
  onnx-ir refuse a data file with more than one link: both models would stop loading
  there. Never a symbolic link.

Every path relationship is checked before anything is written: the output is never the
input, inside it or containing it, never a file the model uses, and replaces nothing but
a previous output of onnx-kvcache (with ``overwrite``; every model written here carries
a marker, see :mod:`onnx_kvcache.model_io._marker`), never a mount point, and takes the
replaced output's mode (owner and group where we may). An existing empty output folder is
filled, not replaced. See :mod:`onnx_kvcache.model_io._atomic` for how writes stay atomic and
what a killed run leaves behind.

The parts: :mod:`onnx_kvcache.files._conversion_terms` (the weights' modes, the placements,
:class:`ConvertResult`, re-exported here), :mod:`onnx_kvcache.files._conversion_plan` (the
output's place, checked before anything is written) and
:mod:`onnx_kvcache.files._conversion_write` (the graph's bytes, the weights' placement, the
atomic writes); this module decides and orchestrates (:func:`convert_model`).
"""

from __future__ import annotations

__all__ = ["ConvertResult", "Placement", "Weights", "WeightsMode", "convert_model"]

import dataclasses
import json
import logging
import os
from typing import Any

import onnx_ir as ir

from onnx_kvcache import model_io
from onnx_kvcache._gc import gc_paused
from onnx_kvcache.cache.formats import (
    get_format,
)
from onnx_kvcache.cache.rotation import get_rotation
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.cache.storage import find_qdq_caches
from onnx_kvcache.capabilities.gating import infer_target
from onnx_kvcache.capabilities.rows import get_capabilities
from onnx_kvcache.errors import (
    GenaiConfigWarning,
    KvCacheError,
    Message,
    Param,
    SharedWeightsWarning,
    require_flags,
    require_optional_flags,
    require_type,
    warn,
)
from onnx_kvcache.files._context import warn_short_scales
from onnx_kvcache.files._conversion_plan import _Plan, _plan
from onnx_kvcache.files._conversion_terms import ASKED_WEIGHTS, ConvertResult, Placement, Weights, WeightsMode
from onnx_kvcache.files._conversion_write import _serialize, _write_file, _write_folder, _write_in_place
from onnx_kvcache.files._export_folder import read_export_config, written_genai_config
from onnx_kvcache.model_io.genai_folder import (
    GENAI_CONFIG,
    resolve_model_path,
    with_share_buffer,
)
from onnx_kvcache.model_io.reading import ModelSource, open_model_source
from onnx_kvcache.passes.kv_cache_quantization import format_for
from onnx_kvcache.pipeline.decision import AUTO, Decision, Entry, Request, carry_out, decide
from onnx_kvcache.pipeline.storage_decision import check_storage
from onnx_kvcache.scales.files import KvCacheScales, as_kv_cache_scales, resolve_granularity

ConvertResult.__module__ = __name__  # its public home: what pickles and docs name

logger = logging.getLogger(__name__)

LINK_WARNING = (
    "the output's data files are hard links to the input's, and a data file with more than one "
    "link is refused by onnx.load (with its data) and onnx.checker.check_model, and by onnx-ir "
    "when a weight is read (unless the model was loaded by a bare file name, from its folder), so "
    "NEITHER model loads in them until one is deleted; the graph alone (onnx.load(..., "
    "load_external_data=False)), onnxruntime and onnxruntime-genai load both."
)


def _requantized_note(model: ir.Model, fmt: str, granularity: str, given: bool) -> str | None:
    """What a conversion of already-quantized caches does with their scales, for the summary."""
    own = sorted(
        {(s.cache_format, s.granularity) for s in find_attention_sites(model) if s.cache_format}, key=str
    )
    if not own:
        return None
    target = get_format(fmt)
    was = ", ".join(f"{f.name} {g}" for f, g in own)
    if given:
        return f"requantized from {was} with the scales given."
    ratios = ", ".join(f"x {f.qmax:g}/{target.qmax:g}" for f in dict.fromkeys(f for f, _ in own))
    moved = {g for _, g in own if g is not None} - {granularity}
    how = f"; {', '.join(sorted(moved))} -> {granularity}" if moved else ""
    return f"requantized from {was} with its own scales ({ratios}: the same thresholds{how})."


# -- conversion ----------------------------------------------------------------------


def convert_model(
    in_path: str | os.PathLike,
    out_path: str | os.PathLike | None = None,
    *,
    format: str | None = None,
    granularity: str | None = None,
    scales: Any = None,
    shared_kv_scale: bool = False,
    weights: WeightsMode | None = None,
    in_place: bool = False,
    overwrite: bool = False,
    ep: str | None = "auto",
    strict: bool = False,
    check_device: bool = False,
    follow_symlinks: bool = False,
    progress: bool | None = None,
    allow_partial: bool = False,
    rotation: str | None = None,
    verify: bool | None = None,
    storage: str = "auto",
) -> ConvertResult:
    """Convert a model file or onnxruntime-genai folder to a quantized KV cache.

    Weights are never read. Output placement (see the module docstring): beside the
    input the weights are shared; in another folder they are cloned or copied
    (``weights="copy"``, the default there; ``"copy"`` beside the input gives the output
    its own copy) or hard-linked (``"link"``: onnx.load, onnx.checker and onnx-ir then
    refuse the weights of both models, see :data:`LINK_WARNING`).

    ``ep`` is where the model will run. ``"auto"`` (default) infers it
    (:func:`~onnx_kvcache.capabilities.table.infer_target`: a genai folder's provider, ``cpu``
    when its config names none; a model file's dtype, float32 -> ``cpu``, fp16/bf16 -> ``cuda``).
    When the target cannot run the result nothing is written: a :class:`NotConvertedWarning`
    and the result's ``converted``/``reasons`` say why (``strict`` raises instead). ``None``
    skips gating (e.g. to evaluate fp8 numerics of a float32 model through emulation). A
    model without GroupQueryAttention is first fused (GqaFusionPass); without any after fusion
    it is not converted, nor is a model already in the format and granularity asked (without
    scales: nothing to convert). A genai folder's ``search.past_present_share_buffer`` follows
    the target, its ``provider_options`` the ``ep`` given when it names another provider. A
    scale file of one section per model file gives the section of the model file's stem.
    ``granularity`` defaults to the one the scales record (calibration and our scale
    files record it), else the first of :data:`~onnx_kvcache.cache.formats.SCALE_GRANULARITIES` whose
    size fits the model's caches (an onnxruntime-genai file: one element per tensor, or
    ``kv_num_heads * head_size`` per channel), else an already-quantized model's own, else per
    tensor; ``format`` to the format the scales were made for (their ``format``, else their
    ``qmax``), else an already-quantized model's own (it is requantized: its own scales
    retargeted when none are given), else the first the target runs
    (:func:`~onnx_kvcache.capabilities.table.default_format`: fp8 on CUDA, int8 on CPU; fp8 when
    gating is skipped). ``follow_symlinks`` accepts input files that link out
    of the model's folder (Hugging Face cache snapshots); their content is copied.
    ``progress``: a progress bar for copies (default: on a terminal). A model some of whose
    caches would keep their type (a layer left unfused, a cache also read by another node) is
    not converted, the layers named, unless ``allow_partial``: then the others are.
    ``rotation`` (``none``, ``keys``, ``keys_and_values``; docs/rotation.md) turns the cache by an
    orthonormal matrix before it is quantized; by default the one the scales record (calibration
    records it: int4 rotates), none for scales without a record; an already-rotated model keeps its
    own. Scales calibrated for another rotation are refused. An export's fusion is ``verify``-ed:
    the export and the fused model run side by side on onnxruntime's CPU before anything is
    written, and a difference in their logits refuses the conversion
    (:func:`~onnx_kvcache.pipeline.verification.verify_fusion`; None: for weights up to
    :data:`~onnx_kvcache.pipeline.verification.MAX_BYTES`, True: whatever their size).
    ``storage``: ``"auto"`` keeps the quantized cache in the attention kernel (GroupQueryAttention,
    PagedAttention; a model whose attention fuses into neither is refused, the refusal naming
    ``storage="qdq"`` where it applies); ``"qdq"`` fuses nothing and stores each cache in the format
    (default int8) through QuantizeLinear/DequantizeLinear around the model's own attention
    (:class:`~onnx_kvcache.passes.QdqKvCachePass`: multi-head latent attention, static buffers).

    An existing output is replaced only with ``overwrite`` and only when it is a previous
    output of onnx-kvcache (the rules: :mod:`onnx_kvcache.model_io._marker`); an existing
    empty output folder is filled, with or without it.
    """
    scales, named, granularity = _arguments(locals())  # before any work
    with gc_paused():  # the graph's objects: a 70B export's fusion spent a quarter in the collector
        source = open_model_source(in_path, follow_symlinks=follow_symlinks)
        named = named or format_for(source.model)  # an already-quantized model keeps its own
        plan = _plan(
            source, out_path, fmt=named or "kv", in_place=in_place, overwrite=overwrite, weights=weights
        )
        _check_writable(source, plan)
        request = _request(source, named, granularity, scales, ep, check_device, strict, shared_kv_scale)
        decision = decide(_asked(request, source, plan, allow_partial, rotation, verify, storage))
        result = _result(source, plan, decision)
        if carry_out(decision):
            _finish(source, plan, decision, result, progress)
    return result


def _genai_export(source: ModelSource, plan: _Plan) -> bool:
    """The output is an onnxruntime-genai folder made from an export folder (its config.json read):
    fused rolling window caches become window-sized there, as onnxruntime-genai allocates them
    (:func:`~onnx_kvcache.passes.fusion.window_sized.make_window_sized`); a model file keeps the
    export's inputs."""
    return (
        plan.placement is Placement.FOLDER
        and source.folder is not None
        and source.config is None
        and read_export_config(source.folder) is not None
    )


def _asked(
    request: Request,
    source: ModelSource,
    plan: _Plan,
    allow_partial: bool,
    rotation: str | None,
    verify: bool | None,
    storage: str,
) -> Request:
    """``request`` with the fields ``convert_model`` takes as they are, and the window-sized
    caches of an onnxruntime-genai folder made from an export (:func:`_genai_export`)."""
    window_sized = _genai_export(source, plan)
    return dataclasses.replace(
        request,
        allow_partial=allow_partial,
        rotation=rotation,
        verify=verify,
        storage=storage,
        window_sized=window_sized,
    )


#: ``convert_model``'s yes/no arguments (``progress`` also takes None: on a terminal).
_FLAGS = (
    "shared_kv_scale",
    "in_place",
    "overwrite",
    "strict",
    "check_device",
    "follow_symlinks",
    "allow_partial",
)


def _arguments(arguments: dict[str, Any]) -> tuple[KvCacheScales | None, str | None, str | None]:
    """``convert_model``'s arguments (its ``locals()`` at the start) that need no model, checked
    before any work: every yes/no argument a bool (:data:`_FLAGS`), the scales read, the format
    they or ``format`` name, the granularity asked (checked against the scales)."""
    require_flags(**{name: arguments[name] for name in _FLAGS})
    require_optional_flags(progress=arguments["progress"], verify=arguments["verify"])
    in_path, out_path, format, granularity = (
        arguments[k] for k in ("in_path", "out_path", "format", "granularity")
    )
    scales, weights, ep, rotation = (arguments[k] for k in ("scales", "weights", "ep", "rotation"))
    require_type(ep, (str, type(None)), "ep", "a provider name, 'auto' or None")
    require_type(out_path, (str, os.PathLike, type(None)), "out_path", "a path or None")
    read = as_kv_cache_scales(scales, stem=_model_stem(in_path))
    named = format or (read.implied_format if read is not None else None)  # None: the target's
    if named is not None:
        get_format(named)  # an unknown name fails before any work
    if granularity is not None:
        granularity = resolve_granularity(granularity, read)  # a contradiction fails before any work
    if rotation is not None:
        get_rotation(rotation)  # an unknown name fails before any work
    check_storage(arguments["storage"])
    if weights is not None and weights not in ASKED_WEIGHTS:
        raise KvCacheError(f"weights must be 'copy' or 'link' (or None), got {weights!r}.")
    return read, named, granularity


def _check_writable(source: ModelSource, plan: _Plan) -> None:
    """The folders the output is written in take new files (checked before any work)."""
    in_place = plan.placement is Placement.IN_PLACE
    model_io.check_writable_folder(
        source.graph.parent if in_place else plan.out if plan.fill else plan.out.parent
    )
    if in_place and source.config_path is not None:
        model_io.check_writable_folder(source.config_path.parent)


def _request(
    source: ModelSource,
    named: str | None,
    granularity: str | None,
    scales: KvCacheScales | None,
    ep: str | None,
    check_device: bool,
    strict: bool,
    shared_kv_scale: bool,
) -> Request:
    """The pipeline's request for a conversion of ``source``."""
    return Request(
        source.model,
        Entry.CONVERT,
        named,
        granularity,
        scales,
        ep.lower() if ep not in (None, AUTO) else ep,
        source.config,
        check_device=check_device,
        strict=strict,
        shared_kv_scale=shared_kv_scale,
        name=source.graph.name,
    )


def _result(source: ModelSource, plan: _Plan, decision: Decision) -> ConvertResult:
    """What the conversion will have done, as decided (the writing fills in the rest)."""
    fmt, granularity = decision.format, decision.granularity
    result = ConvertResult(
        plan.out,
        source.graph,
        0,
        granularity.name if granularity is not None else "per_tensor",
        fmt.name if fmt is not None else "",
        placement=plan.placement,
        fused=decision.fusion.fused,
        converted=decision.converted,
        refusals=list(decision.refusals),
        target=decision.target,
        rotation=decision.rotation.name,
    )
    if decision.target is not None:
        result.target_source = f"assumed: {decision.why}" if decision.why else "given"
    if decision.fusion.verification is not None:
        result.verified = decision.fusion.verification.verified
        result.notes.append(decision.fusion.verification.line)
    if decision.converted and fmt is not None and granularity is not None:
        requantized = _requantized_note(
            decision.model, fmt.name, granularity.name, decision.scales is not None
        )
        if requantized:
            result.notes.append(requantized)
    return result


def _prompt_note(sites: list[CacheSite]) -> list[str]:
    """The line saying how many layers' prompts attend through the float kernel (cache.prompt_path)."""
    wrapped = sum(1 for s in sites if s.wrapper is not None)
    if not wrapped:
        return []
    return [
        f"prompt in float: in {wrapped} layer(s) a prompt attends through the CPU's float kernel and "
        "is stored quantized, each new token through the quantized kernel (a long prompt at float "
        "speed: docs/choosing-a-format.md#speed-on-the-cpu)."
    ]


def _count_ops(result: ConvertResult, sites: list[CacheSite], model: ir.Model) -> None:
    """The quantized attention nodes by operator; for a cache stored through QuantizeLinear/
    DequantizeLinear, the nodes that write its present (TensorScatter, Concat, Attention)."""
    for site in sites:
        if site.cache_format is not None:
            result.ops[site.op.op_type] = result.ops.get(site.op.op_type, 0) + 1
    writers = {
        id(c.writer): c.writer for c in find_qdq_caches(model.graph) if c.stored
    }  # one node, two caches
    for writer in writers.values():
        result.ops[writer.op_type] = result.ops.get(writer.op_type, 0) + 1
    result.nodes = sum(result.ops.values())


def _share_target(decision: Decision, result: ConvertResult) -> str:
    """The provider whose rule sets ``search.past_present_share_buffer``: the target, else
    the CPU where it runs the format, else CUDA."""
    fmt = get_format(result.format)
    sites = find_attention_sites(decision.model)
    cpu_runs_it = all(fmt.name in get_capabilities("cpu", s.op).formats for s in sites)
    return result.target or ("cpu" if cpu_runs_it else "cuda")


def _shares_buffer(decision: Decision, result: ConvertResult) -> bool:
    """``search.past_present_share_buffer`` of the output: the target's rule, except that a
    window-sized cache (``sliding_window_cache=1``, what genai's builder writes for Gemma-2's
    window layers) always shares: onnxruntime-genai allocates such a cache window-sized only
    in one shared buffer, and without it feeds an empty past that GroupQueryAttention refuses
    ("KV cache capacity (0) must be at least local_window_size"), float or quantized; and a graph
    that reads a past cache's length (:func:`_reads_past_length`) never shares."""
    if any(
        s.int_attr("sliding_window_cache", 0) and s.int_attr("local_window_size", -1) > 0
        for s in find_attention_sites(decision.model)
    ):
        return True
    return get_capabilities(_share_target(decision, result)).share_buffer and not _reads_past_length(
        decision.model
    )


def _reads_past_length(model: ir.Model) -> bool:
    """Whether the graph reads a past cache's length (``Shape`` or ``Size`` of it: an export without
    ``position_ids`` counts its positions from the cache). In a shared buffer that length is the
    context's, not the tokens held, so such a graph computes wrong positions there."""
    pasts = [s.past(side) for s in find_attention_sites(model) for side in s.sides]
    return any(
        user.op_type in ("Shape", "Size") and user.graph is model.graph  # not a prompt wrap's own
        for past in pasts
        if past is not None
        for user, _ in past.uses()
    )


def _new_config(
    source: ModelSource, plan: _Plan, decision: Decision, result: ConvertResult
) -> dict[str, Any] | None:
    """The genai config the output gets (None: the input's, unchanged): past and present share
    one buffer where the target does (:func:`_shares_buffer`); ``provider_options`` name the
    provider given. An export folder converted to a folder gets one made from its
    ``config.json`` (:func:`_export_config`)."""
    if source.config is None:
        return _export_config(source, plan, decision, result)
    config = with_share_buffer(source.config, _shares_buffer(decision, result))
    if decision.request.target not in (None, AUTO):
        config = _with_provider(config, str(decision.target), result)
    return None if config == source.config else config


def _export_config(
    source: ModelSource, plan: _Plan, decision: Decision, result: ConvertResult
) -> dict[str, Any] | None:
    """An export folder's ``genai_config.json``, for a folder output (see
    :func:`~onnx_kvcache.files._export_folder.written_genai_config`)."""
    if plan.placement is not Placement.FOLDER or source.folder is None:
        return None
    target = get_capabilities(_share_target(decision, result))
    config, note = written_genai_config(
        source.folder,
        source.graph,
        decision.model,
        plan.out.name,
        target=target.name,
        share_buffer=_shares_buffer(decision, result),
        provider_options=_GENAI_PROVIDER_OPTIONS.get(target.name),
    )
    result.notes += [note] if note else []
    return config


def _finish(
    source: ModelSource, plan: _Plan, decision: Decision, result: ConvertResult, progress: bool | None
) -> None:
    """Mark, serialize and write the converted model (the cache is quantized)."""
    warn_short_scales(decision.scales, decision.model, source.graph.parent, source.config)
    model = decision.model
    sites = find_attention_sites(model)  # what was written: the decision's model, converted
    _count_ops(result, sites, model)
    result.notes += _prompt_note(sites)
    new_config = _new_config(source, plan, decision, result)
    entries = [e.rel.as_posix() for e in source.entries] if plan.placement is Placement.FOLDER else []
    if new_config is not None and source.config is None:
        entries.append(GENAI_CONFIG)  # an export folder's new config
    scales = decision.scales
    own = model_io.calibrated_by(model.metadata_props) if scales is None else None  # requantized
    method = scales.metadata.get("method") if scales is not None else own
    result.method = method
    model.metadata_props[model_io.MARKER_KEY] = model_io.marker(
        result.format,
        result.granularity,
        plan.placement,
        plan.data_names.values(),
        entries,
        result.target,
        method,
    )
    data = _serialize(model, plan.data_names)
    result.weight_bytes = sum(d.size for d in source.data.values())
    _warn_links(source, plan)
    _write(source, plan, data, new_config, result, progress)


def _warn_links(source: ModelSource, plan: _Plan) -> None:
    """Hard-linked data files (the output's, or the input's from an earlier link) load nowhere in onnx."""
    if plan.weights is WeightsMode.LINK:
        warn(LINK_WARNING, SharedWeightsWarning)
    linked = [d.path.name for d in source.data.values() if d.real.stat().st_nlink > 1]
    if linked and plan.weights is not WeightsMode.LINK:
        warn(
            Message(
                f"the input's data file(s) {', '.join(linked)} have more than one hard link (an earlier ",
                Param("weights", "link"),
                "?): onnx.load, onnx.checker and onnx-ir (reading a weight) refuse them until the other "
                "link is deleted.",
            ),
            SharedWeightsWarning,
        )


def _write(
    source: ModelSource,
    plan: _Plan,
    data: bytes,
    config: dict[str, Any] | None,
    result: ConvertResult,
    progress: bool | None,
) -> None:
    """Write the output where the plan places it; a lost race for its name is said plainly."""
    try:
        if plan.placement is Placement.IN_PLACE:
            _write_in_place(source, data, config, result.format, result)
        elif plan.placement is Placement.FOLDER:
            _write_folder(source, plan, data, config, result, progress)
        else:
            _write_file(source, plan, data, result, progress)
    except FileExistsError as e:  # a rename lost a race: someone created the output meanwhile
        named = {os.path.abspath(f) for f in (e.filename, e.filename2) if isinstance(f, (str, os.PathLike))}
        own = {plan.out, *(plan.out.parent / name for name in plan.data_names.values())}
        found = [p for p in own if os.path.abspath(p) in named]
        if not found or plan.placement is Placement.IN_PLACE:
            raise
        also = "" if found[0] == plan.out else f" (its data file {found[0].name} appeared)"
        raise KvCacheError(
            f"Output {plan.out} was created by someone else (another conversion?) while this one ran"
            f"{also}; nothing was written and what is there is left as it is. Check it, or choose "
            "another output path."
        ) from None


#: The ``provider_options`` onnxruntime-genai reads for a provider row (cpu: none), named as
#: its model builder names them (``builders/base.py``); it writes none for OpenVINO.
_GENAI_PROVIDER_OPTIONS: dict[str, list[dict[str, Any]]] = {
    "cpu": [],
    "cuda": [{"cuda": {}}],
    "dml": [{"dml": {}}],
    "webgpu": [{"webgpu": {}}],
}


def _with_provider(config: dict[str, Any], target: str, result: ConvertResult) -> dict[str, Any]:
    """``config`` naming the provider the user gave (``ep``) where it named another: genai
    runs the model on what ``provider_options`` names ([] is the CPU), so a conversion for
    another provider left as it was fails there (an fp8 cache on the CPU) or runs elsewhere
    than asked. A provider genai's config cannot be written for here warns instead."""
    wanted = get_capabilities(target).name
    folder, _ = infer_target(None, config)
    if folder == wanted:
        return config
    options = _GENAI_PROVIDER_OPTIONS.get(wanted)
    if options is None:
        warn(
            f"{GENAI_CONFIG}'s provider_options name {folder}, not {target}: onnxruntime-genai will "
            f"run the model on {folder}. Edit model.decoder.session_options.provider_options to "
            f"name {target}.",
            GenaiConfigWarning,
        )
        return config
    config = json.loads(json.dumps(config))
    session = config["model"]["decoder"].setdefault("session_options", {})
    named = folder if session.get("provider_options") else "none: onnxruntime-genai's default, the CPU"
    session["provider_options"] = json.loads(json.dumps(options))
    result.notes.append(
        f"{GENAI_CONFIG}'s provider_options now name {wanted}, the provider given (they named {named})."
    )
    return config


def _model_stem(in_path: Any) -> str | None:
    """The stem of the model file ``in_path`` names (a genai folder's decoder): the section of a
    scale file of several that onnxruntime-genai reads for it. None when it cannot tell (the
    reading that follows says why)."""
    try:
        return resolve_model_path(in_path)[0].stem
    except (KvCacheError, OSError, ValueError):
        return None
