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
a marker, see :mod:`onnx_kvcache.files._marker`), never a mount point, and takes the
replaced output's mode (owner and group where we may). An existing empty output folder is
filled, not replaced. See :mod:`onnx_kvcache.files._atomic` for how writes stay atomic and
what a killed run leaves behind.
"""

from __future__ import annotations

__all__ = ["ConvertResult", "convert_model"]

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import stat
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import onnx_ir as ir

from onnx_kvcache.cache.formats import (
    CACHE_FORMATS,
    get_format,
)
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.capabilities.device import cuda_compute_capability
from onnx_kvcache.capabilities.table import (
    check_kv_cache_support,
    conversion_warnings,
    default_format,
    get_capabilities,
    infer_target,
)
from onnx_kvcache.errors import (
    GenaiConfigWarning,
    KvCacheError,
    NotConvertedWarning,
    RuntimeSupportWarning,
    SharedWeightsWarning,
    require_type,
    warn,
)
from onnx_kvcache.files import _atomic as file_io
from onnx_kvcache.files import _marker as previous
from onnx_kvcache.files._atomic import format_bytes
from onnx_kvcache.files.genai_folder import GENAI_CONFIG, resolve_model_path, share_buffer, with_share_buffer
from onnx_kvcache.files.reading import ModelSource, open_model_source
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass, unfused_refusal
from onnx_kvcache.passes.kv_cache_quantization import KvCacheQuantizationPass, format_for, granularity_for
from onnx_kvcache.scales.files import as_kv_cache_scales, resolve_granularity

logger = logging.getLogger(__name__)

LINK_WARNING = (
    "the output's data files are hard links to the input's, and a data file with more than one "
    "link is refused by onnx.load (with its data) and onnx.checker.check_model, and by onnx-ir "
    "when a weight is read (unless the model was loaded by a bare file name, from its folder), so "
    "NEITHER model loads in them until one is deleted; the graph alone (onnx.load(..., "
    "load_external_data=False)), onnxruntime and onnxruntime-genai load both."
)


# -- planning a conversion --------------------------------------------------------------

WeightsMode = Literal["copy", "link"]
Placement = Literal["in-place", "beside", "elsewhere", "folder"]


@dataclasses.dataclass
class _Plan:
    placement: Placement
    out: pathlib.Path
    """The output file or folder (absolute, as named)."""
    weights: Literal["share", "copy", "link"]
    data_names: dict[str, str] = dataclasses.field(default_factory=dict)
    """Input location -> output location, when the output gets its own data files."""
    replace: bool = False
    """The output exists and is replaced (``overwrite``)."""
    fill: bool = False
    """The output folder exists and is empty: it is filled, not replaced."""
    obsolete: list[pathlib.Path] = dataclasses.field(default_factory=list)
    """The replaced output's own data files, removed once the new one is in place."""
    kept: list[str] = dataclasses.field(default_factory=list)
    """Why each of its other own data files stays (another file may name it)."""
    replaced: os.stat_result | None = None
    """The replaced output as planned: its identity is checked again (under a lock) before
    the write, and the new output takes its mode, owner and group."""
    named: str = ""
    """The replaced output as the caller named it (for messages)."""


def _real(path: pathlib.Path) -> pathlib.Path:
    """``path`` with its folder resolved but not its last component."""
    return pathlib.Path(os.path.realpath(path.parent)) / path.name


def _is_within(path: pathlib.Path, folder: pathlib.Path) -> bool:
    return path == folder or folder in path.parents


def _data_names(out: pathlib.Path, locations: list[str]) -> dict[str, str]:
    """Free names for an output's own data files: ``OUT.data``, else ``OUT.2.data``, ...

    Several files become ``OUT-00001-of-00003.data`` style shards. Existing files are
    never reused, so a replaced output keeps working until the new one is committed, and
    repeated ``overwrite`` runs alternate between ``OUT.data`` and ``OUT.2.data``. That is
    the price of never having a graph on disk name data that is not its own: keeping the
    name would mean replacing the old data under the old graph, or committing a graph that
    names data not yet there; no rename makes both files change at once.

    A graph names its data in UTF-8 (protobuf strings), so an output name that is not
    UTF-8 (bytes Python decodes as surrogates) gives its data U+FFFD in their place.
    """
    if not locations:
        return {}
    stem = os.fsencode(out.name).decode("utf-8", errors="replace")
    for generation in range(1, 1000):
        base = stem if generation == 1 else f"{stem}.{generation}"
        if len(locations) == 1:
            names = [f"{base}.data"]
        else:
            n = len(locations)
            names = [f"{base}-{i:05d}-of-{n:05d}.data" for i in range(1, n + 1)]
        if not any(os.path.lexists(out.parent / name) for name in names):
            return dict(zip(locations, names))
    raise KvCacheError(f"No free name for the data files of {out}; clean up {out.parent}.")


def _free_name(path: pathlib.Path, fmt: str) -> pathlib.Path:
    """``path`` when nothing has that name, else a free ``STEM.FMT[.N].onnx`` beside it.

    A name to suggest in a message: it never names the input or a file it uses (those exist).
    """
    return path if not os.path.lexists(path) else _free_graph_name(path, fmt)


def _refuse_mount_point(out: pathlib.Path) -> None:
    """A mount point cannot be renamed, so it cannot be replaced: refuse before any copy."""
    if file_io.is_mount_point(out):
        fix = (
            "To convert into it, empty it yourself (an empty folder is filled in place, keeping the "
            "mount), or choose another output path."
            if out.is_dir()
            else "Choose another output path."
        )
        raise KvCacheError(f"Output {out} is a mount point, which cannot be replaced. {fix}")


def _inside_the_folder(source: ModelSource, out: pathlib.Path, out_real: pathlib.Path) -> str:
    """Why a folder is not converted to a path inside itself, and what does what was meant.

    "Beside" is a placement of model files: a folder converts to another folder or in place.
    A graph beside the folder's own is its model file converted beside itself; the folder's
    config keeps naming the original, so onnxruntime-genai keeps running that one.
    """
    message = f"Output {out} is inside the input folder {source.folder}; a folder converts to another folder"
    if out.suffix != ".onnx":
        return f"{message}. Choose another path."
    if out_real == pathlib.Path(os.path.realpath(source.graph)):
        return f"{message}. {out.name} is its model file: use in_place=True to rewrite the folder."
    kept = f"; {GENAI_CONFIG} keeps naming {source.graph.name}" if source.config is not None else ""
    return (
        f"{message}. For a converted graph beside {source.graph.name} (sharing its weights), give the "
        f"model file {source.graph} as the input and an output in its folder{kept}. For the folder "
        "to run the converted graph, use in_place=True."
    )


def _plan(
    source: ModelSource,
    out_path: str | os.PathLike | None,
    *,
    fmt: str,
    in_place: bool,
    overwrite: bool,
    weights: WeightsMode | None,
) -> _Plan:
    """Decide where everything goes, and refuse every unsafe path before any write."""
    inputs = source.input_files()
    if in_place:
        if out_path is not None and _real(pathlib.Path(os.path.abspath(out_path))) != _real(
            source.folder or source.graph
        ):
            raise KvCacheError("Give either an output path or in_place=True, not both.")
        if weights is not None:
            raise KvCacheError(
                "in_place=True keeps the data files where they are; weights=MODE does not apply."
            )
        for path in (source.graph, source.config_path):
            if path is not None and path.is_symlink():
                raise KvCacheError(
                    f"{path} is a symbolic link; converting in place would replace the link. "
                    "Convert to another path instead."
                )
        st = source.graph.stat()
        if hasattr(os, "geteuid") and os.geteuid() != 0 and st.st_uid != os.geteuid():
            raise KvCacheError(
                f"{source.graph} belongs to user {st.st_uid}; converting in place would make it yours. "
                "Run as that user, or convert to another path."
            )
        return _Plan("in-place", source.folder or source.graph, "share")
    if out_path is None:
        raise KvCacheError("Give an output path, or in_place=True to rewrite the input.")
    out = pathlib.Path(os.path.abspath(out_path))
    out_real = _real(out)
    root_real = pathlib.Path(os.path.realpath(source.root))
    if out.is_symlink():
        raise KvCacheError(f"Output {out} is a symbolic link; refusing to write through it.")

    if source.folder is not None:
        if out_real == root_real:
            raise KvCacheError(f"Output {out} is the input; use in_place=True to rewrite it.")
        if _is_within(out_real, root_real):
            raise KvCacheError(_inside_the_folder(source, out, out_real))
        if _is_within(root_real, out_real):
            raise KvCacheError(
                f"Output {out} contains the input folder {source.folder}; choose another path."
            )
        for f in inputs:
            if _is_within(f, out_real):
                raise KvCacheError(f"Output {out} contains {f}, which the input uses; choose another path.")
        if out.suffix == ".onnx":
            raise KvCacheError(
                f"The input {source.folder} is a folder, so the output is a folder too; {out.name} looks "
                f"like a file name. To convert only the model file, give {source.graph} as the input."
            )
        plan = _Plan("folder", out, weights or "copy")
        if os.path.lexists(out):
            if not out.is_dir():
                raise KvCacheError(f"Output {out} exists and is not a folder; refusing to replace it.")
            if any(name.startswith(file_io.TEMP_PREFIX) for name in os.listdir(out)):
                file_io.sweep_stale(out)  # a killed run's entries; a killed fill is undone
            if not os.listdir(out):
                plan.fill = True  # nothing there to replace: overwrite is not needed
                return plan
            previous.check_replaceable_folder(out)
            if not overwrite:
                raise KvCacheError(
                    f"Output {out} exists (a previous output of onnx-kvcache); pass overwrite=True to "
                    "replace it."
                )
            if _is_within(pathlib.Path(os.path.realpath(os.getcwd())), out_real):
                raise KvCacheError(f"Output {out} contains the current folder; refusing to replace it.")
            _refuse_mount_point(out)
            plan.replace, plan.replaced, plan.named = True, os.lstat(out), os.fspath(out_path)
        return plan

    if out_real in inputs:
        what = (
            "the input"
            if out_real == pathlib.Path(os.path.realpath(source.graph))
            else "a file the input uses"
        )
        fix = "; use in_place=True to rewrite it" if what == "the input" else ""
        raise KvCacheError(f"Output {out} is {what}{fix}.")
    if (os.path.lexists(out) and out.is_dir()) or str(out_path).endswith(("/", os.sep)):
        if previous.is_output_folder(out):  # a file of ours in it would block its replacement
            raise KvCacheError(
                f"Output {out_path} is a folder onnx-kvcache converted; the input is one model file, so "
                f"name an output file outside it (e.g. {_free_graph_name(source.graph, fmt)}, beside "
                "the input)."
            )
        raise KvCacheError(
            f"Output {out_path} is a folder; the input is one model file, so name the output file "
            f"(e.g. {_free_name(out / source.graph.name, fmt)})."
        )
    if out.suffix != ".onnx":
        raise KvCacheError(
            f"Output {out} must be a .onnx file name (e.g. {_free_name(out.with_suffix('.onnx'), fmt).name})."
        )
    beside = pathlib.Path(os.path.realpath(out.parent)) == pathlib.Path(os.path.realpath(source.graph.parent))
    mode: Literal["share", "copy", "link"] = weights or ("share" if beside else "copy")
    linked = [d for d in source.data.values() if d.path.is_symlink()]
    if mode == "share" and linked:
        raise KvCacheError(
            f"The input's data file {linked[0].path.name} is a symbolic link (to {linked[0].real}); onnx "
            "refuses linked external data (onnxruntime too, when it leads out of the folder), so an "
            "output sharing it would not load. "
            "Convert into another folder (the linked content is copied), or pass weights='copy' for "
            "this output's own copy."
        )
    plan = _Plan("beside" if beside else "elsewhere", out, mode)
    if os.path.lexists(out):
        if not out.is_file():
            raise KvCacheError(f"Output {out} is not a regular file; refusing to replace it.")
        marker = previous.check_replaceable_file(out)
        if not overwrite:
            raise KvCacheError(
                f"Output {out} exists (a previous output of onnx-kvcache); pass overwrite=True to replace it."
            )
        _refuse_mount_point(out)
        plan.replace, plan.replaced, plan.named = True, os.lstat(out), os.fspath(out_path)
        plan.obsolete, plan.kept = previous.own_data_files(out, marker, inputs)
    if mode != "share":
        plan.data_names = _data_names(out, sorted(source.data))
    return plan


# -- graph and config -------------------------------------------------------------------


def _rename_locations(proto: Any, names: dict[str, str]) -> None:
    """Point every external tensor of ``proto`` (a ModelProto) at its new data file."""
    graphs = [proto.graph]

    def tensors_of_node(node: Any) -> Iterator[Any]:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                graphs.append(attr.g)
            graphs.extend(attr.graphs)

    def all_tensors() -> Iterator[Any]:
        for function in proto.functions:
            for node in function.node:
                yield from tensors_of_node(node)
        for graph in graphs:
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield sparse.values
                yield sparse.indices
            for node in graph.node:
                yield from tensors_of_node(node)

    for tensor in all_tensors():
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value in names:
                entry.value = names[entry.value]


def _serialize(model: ir.Model, names: dict[str, str] | None = None) -> bytes:
    proto = ir.to_proto(model)
    if names:
        _rename_locations(proto, names)
    try:
        return proto.SerializeToString()
    except ValueError as e:
        raise KvCacheError(
            f"The model is too large to write in one file ({e}); keep its weights in "
            "external data (onnx_ir.save(model, path, external_data=...))."
        ) from None


def _config_bytes(config: dict[str, Any]) -> bytes:
    return (json.dumps(config, indent=4, ensure_ascii=False) + "\n").encode("utf-8")


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


def _named_format(graph: pathlib.Path) -> str | None:
    """The format a graph's name says it has (``model.fp8.onnx``, ``model.fp8.2.onnx``: fp8)."""
    parts = graph.name.removesuffix(".onnx").split(".")
    if len(parts) > 2 and parts[-1].isdecimal():
        parts.pop()
    return parts[-1] if len(parts) > 1 and parts[-1] in CACHE_FORMATS else None


def _free_graph_name(graph: pathlib.Path, fmt: str) -> pathlib.Path:
    """A new, unused name for ``graph`` converted to ``fmt``: ``STEM.FMT.onnx``, ``STEM.FMT.2.onnx``, ..."""
    stem = graph.name.removesuffix(".onnx")
    for name in CACHE_FORMATS:
        stem = stem.removesuffix(f".{name}")
    for n in range(1, 1000):
        candidate = graph.with_name(f"{stem}.{fmt}.onnx" if n == 1 else f"{stem}.{fmt}.{n}.onnx")
        if candidate != graph and not os.path.lexists(candidate):
            return candidate
    raise KvCacheError(f"No free name for the converted graph in {graph.parent}.")


# -- the result -----------------------------------------------------------------------


@dataclasses.dataclass
class ConvertResult:
    """What a conversion did."""

    output: pathlib.Path
    model_file: pathlib.Path
    nodes: int
    granularity: str = "per_tensor"
    format: str = "fp8"
    bytes_written: int = 0
    """Everything written: graph, config, copied data and other files."""
    converted: bool = True
    reasons: list[str] = dataclasses.field(default_factory=list)
    target: str | None = None
    """The provider gated on; ``None`` when gating was skipped (``ep=None``)."""
    target_source: str = ""
    """How the target was chosen: ``given`` (``ep=``), or ``assumed: ...`` what it was inferred from."""
    placement: str = ""
    """``beside``, ``elsewhere``, ``folder`` or ``in-place``."""
    weights: str = ""
    """``shared``, ``cloned``, ``copied``, ``linked``, ``unchanged`` or ``inline``."""
    weight_bytes: int = 0
    """Size of the data files the output uses."""
    weight_bytes_written: int = 0
    """Data bytes actually written (0 for shared, cloned and linked weights)."""
    shared_with: pathlib.Path | None = None
    data_files: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    ops: dict[str, int] = dataclasses.field(default_factory=dict)
    """Converted nodes per operator (``{"PagedAttention": 32}``)."""
    fused: int = 0
    """Attention layers fused into GroupQueryAttention first (an export)."""

    def weights_summary(self) -> str:
        size = format_bytes(self.weight_bytes)
        if self.weights == "inline":
            return "weights: inline in the graph"
        if self.weights == "unchanged":
            return f"weights: unchanged ({size} in place, 0 bytes written)"
        if self.weights == "shared":
            name = self.shared_with.name if self.shared_with else "the input"
            files = self.data_files
            which = ", ".join(files) if 0 < len(files) <= 3 else f"{len(files)} data files"
            return f"weights: {which}, shared with {name} (0 bytes)"  # the data, not the graph
        if self.weights == "cloned":
            return f"weights: cloned {size} (0 bytes written)"
        if self.weights == "linked":
            return (
                f"weights: hard-linked {size} (0 bytes written); onnx.load and onnx-ir refuse both "
                "models' weights"
            )
        holes = (
            f", {format_bytes(self.weight_bytes_written)} of data (holes kept)"
            if self.weight_bytes_written < self.weight_bytes
            else ""
        )
        return f"weights: copied {size}{holes}"


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
    model without GroupQueryAttention is first fused (onnxscript); without any after fusion
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
    ``progress``: a progress bar for copies (default: on a terminal).

    An existing output is replaced only with ``overwrite`` and only when it is a previous
    output of onnx-kvcache (the rules: :mod:`onnx_kvcache.files._marker`); an existing
    empty output folder is filled, with or without it.
    """
    require_type(ep, (str, type(None)), "ep", "a provider name, 'auto' or None")
    require_type(out_path, (str, os.PathLike, type(None)), "out_path", "a path or None")
    scales = as_kv_cache_scales(scales, stem=_model_stem(in_path))
    named = format or (scales.implied_format if scales is not None else None)  # None: the target's
    if named is not None:
        get_format(named)  # an unknown name fails before any work
    recorded = scales.granularity if scales is not None else None
    if granularity is not None:
        granularity = resolve_granularity(granularity, scales)  # a contradiction fails before any work
    if weights not in (None, "copy", "link"):
        raise KvCacheError(f"weights must be 'copy' or 'link' (or None), got {weights!r}.")
    source = open_model_source(in_path, follow_symlinks=follow_symlinks)
    named = named or format_for(source.model)  # an already-quantized model keeps its own
    plan = _plan(source, out_path, fmt=named or "kv", in_place=in_place, overwrite=overwrite, weights=weights)
    file_io.check_writable_folder(
        source.graph.parent if plan.placement == "in-place" else plan.out if plan.fill else plan.out.parent
    )
    if plan.placement == "in-place" and source.config_path is not None:
        file_io.check_writable_folder(source.config_path.parent)

    model = source.model
    said = granularity or recorded or "per_tensor"
    result = ConvertResult(plan.out, source.graph, 0, said, named or "", placement=plan.placement)
    refusal = None
    fusion_said: list[warnings.WarningMessage] = []
    if not find_attention_sites(model, with_cache_only=False):
        fusion = GqaFusionPass()  # ours read no weights; onnxscript's run only when ours fuse nothing
        with warnings.catch_warnings(record=True) as fusion_said:  # said once it is converted
            warnings.simplefilter("always")
            fusion(model)
        result.fused = fusion.fused
        refusal = unfused_refusal(fusion.fused, fusion.refused)
    if refusal is None and scales is None and not shared_kv_scale and named is not None:
        states = {
            (s.cache_format.name if s.cache_format else None, s.granularity)
            for s in find_attention_sites(model)
        }
        wanted = (get_format(named).name, granularity or granularity_for(model, None))
        if states == {wanted}:
            refusal = f"{source.graph.name} is already {wanted[0]} {wanted[1]}: nothing to convert."
    if refusal is None and not find_attention_sites(model):
        refusal = (
            f"{source.graph.name} has no GroupQueryAttention or PagedAttention node with a KV cache, "
            "and attention fusion found no attention to fuse: nothing to convert. Export the decoder "
            "with GroupQueryAttention (e.g. onnxruntime-genai's model builder) or see docs/exporting.md."
        )
    if refusal is not None:
        result.converted = False
        result.reasons = [refusal]
        if strict:
            raise KvCacheError(refusal)
        warn(f"Not converted: {refusal}", NotConvertedWarning)
        return result
    if granularity is None:
        granularity = result.granularity = granularity_for(model, scales)
    if ep == "auto":
        target, why = infer_target(model, source.config, named)
        result.target_source = f"assumed: {why}"
    elif ep is not None:
        target, result.target_source = ep.lower(), "given"
    result.target = target if ep is not None else None
    fmt = get_format(named or (ep is not None and default_format(model, target, granularity)) or "fp8")
    scales = as_kv_cache_scales(scales, format=fmt.name)
    result.format = fmt.name
    if ep is not None:
        reasons = _gate(model, target, fmt.name, granularity, check_device)
        if reasons:
            result.converted = False
            result.reasons = reasons
            message = f"KV cache not converted to {fmt.name} {granularity} for {target}: " + " ".join(reasons)
            if strict:
                raise KvCacheError(message)
            warn(message, NotConvertedWarning)
            return result
    requantized = _requantized_note(model, fmt.name, granularity, scales is not None)
    KvCacheQuantizationPass(fmt.name, granularity, scales, shared_kv_scale=shared_kv_scale)(model)
    if requantized:
        result.notes.insert(0, requantized)
    for said in fusion_said:
        warn(str(said.message), said.category)
    for site in find_attention_sites(model):
        if site.cache_format is not None:
            result.ops[site.op.op_type] = result.ops.get(site.op.op_type, 0) + 1
    result.nodes = sum(result.ops.values())
    for warning in conversion_warnings(model, fmt.name, result.target):
        warn(warning, RuntimeSupportWarning)
    cpu_runs_it = all(fmt.name in get_capabilities("cpu", s.op).formats for s in find_attention_sites(model))
    share_target = result.target or ("cpu" if cpu_runs_it else "cuda")
    new_config = None
    if source.config is not None:
        new_config = with_share_buffer(source.config, get_capabilities(share_target).share_buffer)
        if ep not in (None, "auto"):
            new_config = _with_provider(new_config, target, result)
        if new_config == source.config:
            new_config = None
    entries = [e.rel.as_posix() for e in source.entries] if plan.placement == "folder" else []
    own = previous.calibrated_by(model.metadata_props) if scales is None else None  # requantized
    method = scales.metadata.get("method") if scales is not None else own
    model.metadata_props[previous.MARKER_KEY] = previous.marker(
        fmt.name, granularity, plan.placement, plan.data_names.values(), entries, result.target, method
    )
    data = _serialize(model, plan.data_names)
    result.weight_bytes = sum(d.size for d in source.data.values())
    if plan.weights == "link":
        warn(LINK_WARNING, SharedWeightsWarning)
    linked = [d.path.name for d in source.data.values() if d.real.stat().st_nlink > 1]
    if linked and plan.weights != "link":
        warn(
            f"the input's data file(s) {', '.join(linked)} have more than one hard link (an earlier "
            "weights='link'?): onnx.load, onnx.checker and onnx-ir (reading a weight) refuse them until "
            "the other link is deleted.",
            SharedWeightsWarning,
        )

    try:
        if plan.placement == "in-place":
            _write_in_place(source, data, new_config, fmt.name, result)
        elif plan.placement == "folder":
            _write_folder(source, plan, data, new_config, result, progress)
        else:
            _write_file(source, plan, data, result, progress)
    except FileExistsError as e:  # the last rename lost a race: someone created the output meanwhile
        named = {os.path.abspath(f) for f in (e.filename, e.filename2) if isinstance(f, (str, os.PathLike))}
        if os.path.abspath(plan.out) not in named or plan.placement == "in-place":
            raise
        raise KvCacheError(
            f"Output {plan.out} was created by someone else (another conversion?) while this one ran; "
            "nothing was written and it is left as it is. Check it, or choose another output path."
        ) from None
    return result


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
    session["provider_options"] = json.loads(json.dumps(options))
    result.notes.append(
        f"{GENAI_CONFIG}'s provider_options now name {wanted}, the provider given (they named {folder})."
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


def _gate(model: ir.Model, target: str, fmt: str, granularity: str, check_device: bool) -> list[str]:
    """Every reason ``target`` cannot run the converted model (the capability table)."""
    capability = cuda_compute_capability() if check_device else None
    report = check_kv_cache_support(model, target, fmt, granularity, compute_capability=capability)
    reasons = list(report.reasons)
    if check_device and capability is None and report.ep == "cuda":
        reasons.append(
            "check_device=True: no CUDA GPU found on this machine (without it, the check is "
            "left to the GPU that runs the model)."
        )
    if reasons and get_capabilities(target).name == "default":
        reasons.insert(0, f"{target!r} is not a provider onnx-kvcache knows.")
    return reasons


def _write_in_place(
    source: ModelSource, data: bytes, config: dict[str, Any] | None, fmt: str, result: ConvertResult
) -> None:
    """Replace the graph (and genai_config) in one commit, keeping mode and owner."""
    graph = source.graph
    result.weights = "unchanged" if source.data else "inline"
    result.data_files = sorted(source.data)
    for folder in {graph.parent, source.root}:
        file_io.sweep_stale(folder)
    if config is None and source.config is not None and _named_format(graph) not in (None, fmt):
        config = source.config  # model.fp8.onnx requantized to int4: renamed (the config names it)
    if config is None or source.config_path is None:
        file_io.atomic_write_bytes(graph, data, like=graph.stat())
        result.model_file, result.bytes_written = graph, len(data)
        return
    # Both files change: the new graph takes a new name, and replacing genai_config.json
    # (which names it) is the one commit. Only then is the old graph removed.
    new_graph = _free_graph_name(graph, fmt)
    config = json.loads(json.dumps(config))
    config["model"]["decoder"]["filename"] = new_graph.relative_to(source.root).as_posix()
    config_path = source.config_path
    config_data = _config_bytes(config)
    with file_io.TempDir(source.root) as tmp:
        file_io.write_new_file(tmp.path / "graph", data, like=graph.stat())
        file_io.write_new_file(tmp.path / "config", config_data, like=config_path.stat())
        file_io.publish_as_one(
            source.root,
            [(tmp.path / "graph", new_graph, False)],
            tmp.path / "config",
            config_path,
            replace=True,
            remove_after=[graph],
        )
    result.model_file = new_graph
    result.bytes_written = len(data) + len(config_data)
    result.notes.append(
        f"{GENAI_CONFIG} now names {new_graph.name} (was {graph.name}); "
        f"search.past_present_share_buffer is {str(share_buffer(config)).lower()}."
    )


class _Copier:
    """Clones or copies files with one progress bar; checks free space before the first copy."""

    def __init__(self, sources: list[pathlib.Path], folder: pathlib.Path, progress: bool | None) -> None:
        from tqdm.auto import tqdm

        self.folder = folder
        self.bar = tqdm(
            total=sum(p.stat().st_size for p in sources),
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="weights",
            disable=None if progress is None else not progress,
            leave=False,
        )
        self.remaining = sum(file_io.allocated_bytes(p) for p in sources)
        self.space_checked = False
        self.cloned = True
        self.written = 0

    def copy(self, src: pathlib.Path, dst: pathlib.Path) -> int:
        """Clone or copy ``src`` to the new file ``dst``; the bytes written."""
        allocated = file_io.allocated_bytes(src)
        if file_io.clone_file(src, dst):
            self.bar.update(src.stat().st_size)
            written = 0
        else:
            if not self.space_checked:
                self._check_space()
            written = file_io.copy_data(src, dst, progress=self.bar)
            self.cloned = False
        self.remaining -= allocated
        self.written += written
        return written

    def _check_space(self) -> None:
        self.space_checked = True
        free = file_io.free_bytes(self.folder)
        if free is not None and free < self.remaining:
            raise KvCacheError(
                f"Copying the weights needs {format_bytes(self.remaining)} and {self.folder} has "
                f"{format_bytes(free)} free (this filesystem cannot clone files). Free some space, or "
                "convert beside the input (weights shared, nothing copied)."
            )

    def close(self) -> None:
        self.bar.close()


def _identity(st: os.stat_result | None) -> file_io.Identity | None:
    return None if st is None else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _replacing(plan: _Plan) -> contextlib.AbstractContextManager[None]:
    """Hold the output to replace (checked unchanged since planned); nothing when new."""
    identity = _identity(plan.replaced)
    return contextlib.nullcontext() if identity is None else file_io.locked_output(plan.out, identity)


def _replaced_notes(plan: _Plan, result: ConvertResult) -> None:
    """One ``replaced PATH`` line for a replaced output, then why its data files that stay stay."""
    if not plan.replace:
        return
    names = ", ".join(p.name for p in plan.obsolete)
    result.notes.append(
        f"replaced {plan.named or plan.out}"
        + (f" and removed its own data file(s): {names}." if names else ".")
    )
    result.notes.extend(f"{note}." for note in plan.kept)


def _write_file(
    source: ModelSource, plan: _Plan, data: bytes, result: ConvertResult, progress: bool | None
) -> None:
    """A model file beside the input or in another folder, with its own data if asked.

    A replaced file's mode, owner and group (where we may set them) pass to the new file and
    to the data files it gets (never to hard links: those are the input's files).
    """
    out = plan.out
    result.model_file = out
    like = plan.replaced
    created = file_io.make_dirs(out.parent)
    try:
        file_io.sweep_stale(out.parent)
        with _replacing(plan), file_io.TempDir(out.parent) as tmp:
            staged = []
            files = [(source.data[loc], name) for loc, name in plan.data_names.items()]
            if not source.data:
                result.weights = "inline"
            elif not files:
                result.weights, result.shared_with = "shared", source.graph
            elif plan.weights == "link":
                staged = [(d.real, out.parent / name, True) for d, name in files]
                result.weights = "linked"
            else:
                copier = _Copier([d.real for d, _ in files], out.parent, progress)
                try:
                    for i, (d, name) in enumerate(files):
                        copier.copy(d.real, tmp.path / str(i))
                        if like is not None:
                            file_io.keep_mode_and_owner(tmp.path / str(i), like)
                        staged.append((tmp.path / str(i), out.parent / name, False))
                finally:
                    copier.close()
                result.weights = "cloned" if copier.cloned else "copied"
                result.weight_bytes_written = copier.written
            file_io.write_new_file(tmp.path / "graph", data, like=like, owner_required=False)
            file_io.publish_as_one(
                out.parent,
                staged,
                tmp.path / "graph",
                out,
                replace=plan.replace,
                remove_after=plan.obsolete,
                expect=_identity(like),
            )
        _replaced_notes(plan, result)
        result.data_files = sorted(plan.data_names.values()) if plan.data_names else sorted(source.data)
        result.bytes_written = len(data) + result.weight_bytes_written
    except BaseException:
        if not os.path.lexists(out):
            file_io.remove_empty_dirs(created)
        raise


def _old_entries(folder: pathlib.Path) -> dict[str, os.stat_result]:
    """Every entry of a folder output about to be replaced (relative POSIX path -> lstat)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        here = pathlib.Path(dirpath)
        for name in dirnames + filenames:
            found[(here / name).relative_to(folder).as_posix()] = os.lstat(here / name)
    return found


def _write_folder(
    source: ModelSource,
    plan: _Plan,
    data: bytes,
    config: dict[str, Any] | None,
    result: ConvertResult,
    progress: bool | None,
) -> None:
    """Build the whole output folder under a temporary name, then rename it into place
    (or, for an existing empty folder, move its content in: see ``publish_into_empty``).

    A replaced folder's mode, owner and group (where we may set them) pass to the new one
    before anything is created in it (so a set-group-ID folder's group passes on as it
    does there); each entry that replaces one of the same name and kind takes its mode.
    """
    assert source.folder is not None
    out = plan.out
    rel_graph = pathlib.PurePosixPath(source.graph.relative_to(source.folder).as_posix())
    rel_config = pathlib.PurePosixPath(GENAI_CONFIG) if source.config is not None else None
    data_rel = {
        pathlib.PurePosixPath(d.path.relative_to(source.folder).as_posix()): d for d in source.data.values()
    }
    result.model_file = out / rel_graph
    result.data_files = sorted(str(r) for r in data_rel)
    created = file_io.make_dirs(out.parent)
    work = out if plan.fill else out.parent  # where the temporary folder is built
    old = _old_entries(out) if plan.replace else {}
    try:
        file_io.sweep_stale(work)
        to_copy = [
            e
            for e in source.entries
            if e.real is not None
            and e.rel not in (rel_graph, rel_config)
            and not (plan.weights == "link" and e.rel in data_rel)
        ]
        copier = _Copier([e.real for e in to_copy if e.real is not None], work, progress)
        written = len(data)
        with _replacing(plan), file_io.TempDir(work, like=plan.replaced) as tmp:
            try:
                for entry in source.entries:
                    dst = tmp.path / entry.rel
                    linked = plan.weights == "link" and entry.rel in data_rel
                    if entry.real is None:
                        os.mkdir(dst, 0o777)
                    elif entry.rel == rel_graph:
                        file_io.write_new_file(dst, data)
                    elif entry.rel == rel_config and config is not None:
                        config_data = _config_bytes(config)
                        file_io.write_new_file(dst, config_data)
                        written += len(config_data)
                    elif linked:
                        os.link(entry.real, dst, follow_symlinks=True)
                    else:
                        n = copier.copy(entry.real, dst)
                        written += n
                        if entry.rel in data_rel:
                            result.weight_bytes_written += n
                    like = old.get(entry.rel.as_posix())
                    if (
                        like is not None
                        and not linked
                        and stat.S_IFMT(like.st_mode) == stat.S_IFMT(os.lstat(dst).st_mode)
                    ):
                        file_io.keep_mode_and_owner(dst, like)
            finally:
                copier.close()
            if plan.fill:
                file_io.publish_into_empty(tmp, out, rel_config or rel_graph)
            else:
                with file_io.uninterrupted(completes=True):
                    tmp.publish(out, replace=plan.replace)
    except BaseException:
        if not os.path.lexists(out):
            file_io.remove_empty_dirs(created)
        raise
    if not source.data:
        result.weights = "inline"
    elif plan.weights == "link":
        result.weights = "linked"
    else:
        result.weights = "cloned" if copier.cloned else "copied"
    result.bytes_written = written
    _replaced_notes(plan, result)
    if config is not None:
        result.notes.append(
            f"{GENAI_CONFIG}: search.past_present_share_buffer is {str(share_buffer(config)).lower()}."
        )
