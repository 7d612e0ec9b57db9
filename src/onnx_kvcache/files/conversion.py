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
"""

from __future__ import annotations

__all__ = ["ConvertResult", "Placement", "Weights", "WeightsMode", "convert_model"]

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import stat
from collections.abc import Callable, Iterator
from typing import Any, Literal

import onnx_ir as ir

from onnx_kvcache._enums import StrEnum
from onnx_kvcache._gc import gc_paused
from onnx_kvcache.cache.formats import (
    CACHE_FORMATS,
    get_format,
)
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.capabilities.gating import infer_target
from onnx_kvcache.capabilities.refusals import Refusal, texts
from onnx_kvcache.capabilities.rows import get_capabilities
from onnx_kvcache.errors import (
    GenaiConfigWarning,
    KvCacheError,
    Message,
    Param,
    SharedWeightsWarning,
    require_type,
    warn,
)
from onnx_kvcache.files._context import warn_short_scales
from onnx_kvcache.files._export_folder import written_genai_config
from onnx_kvcache.model_io import _atomic as file_io
from onnx_kvcache.model_io import _marker as previous
from onnx_kvcache.model_io._atomic import format_bytes
from onnx_kvcache.model_io.genai_folder import (
    GENAI_CONFIG,
    resolve_model_path,
    share_buffer,
    with_share_buffer,
)
from onnx_kvcache.model_io.reading import ModelSource, open_model_source
from onnx_kvcache.passes.kv_cache_quantization import format_for
from onnx_kvcache.pipeline.decision import AUTO, Decision, Entry, Request, carry_out, decide
from onnx_kvcache.scales.files import KvCacheScales, as_kv_cache_scales, resolve_granularity

logger = logging.getLogger(__name__)

LINK_WARNING = (
    "the output's data files are hard links to the input's, and a data file with more than one "
    "link is refused by onnx.load (with its data) and onnx.checker.check_model, and by onnx-ir "
    "when a weight is read (unless the model was loaded by a bare file name, from its folder), so "
    "NEITHER model loads in them until one is deleted; the graph alone (onnx.load(..., "
    "load_external_data=False)), onnxruntime and onnxruntime-genai load both."
)


IN_PLACE, OVERWRITE = Param("in_place", True), Param("overwrite", True)

# -- planning a conversion --------------------------------------------------------------


class WeightsMode(StrEnum):
    """Where the output's weights come from: the input's files (``share``, beside it), its own
    copy (``copy``: cloned where the filesystem can) or hard links (``link``). A caller asks for
    ``copy`` or ``link``; ``share`` is what a model file beside its input gets."""

    SHARE = "share"
    COPY = "copy"
    LINK = "link"


#: What a caller may ask for (``convert_model(weights=...)``).
ASKED_WEIGHTS = (WeightsMode.COPY, WeightsMode.LINK)


class Placement(StrEnum):
    """Where the output goes relative to the input."""

    IN_PLACE = "in-place"
    BESIDE = "beside"
    ELSEWHERE = "elsewhere"
    FOLDER = "folder"


class Weights(StrEnum):
    """What a conversion did with the weights (:attr:`ConvertResult.weights`)."""

    SHARED = "shared"
    CLONED = "cloned"
    COPIED = "copied"
    LINKED = "linked"
    UNCHANGED = "unchanged"
    INLINE = "inline"

    @classmethod
    def copied(cls, cloned: bool) -> Weights:
        return cls.CLONED if cloned else cls.COPIED


@dataclasses.dataclass
class _Plan:
    placement: Placement
    out: pathlib.Path
    """The output file or folder (absolute, as named)."""
    weights: WeightsMode
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


def _inside_the_folder(source: ModelSource, out: pathlib.Path, out_real: pathlib.Path) -> Message:
    """Why a folder is not converted to a path inside itself, and what does what was meant.

    "Beside" is a placement of model files: a folder converts to another folder or in place.
    A graph beside the folder's own is its model file converted beside itself; the folder's
    config keeps naming the original, so onnxruntime-genai keeps running that one.
    """
    message = f"Output {out} is inside the input folder {source.folder}; a folder converts to another folder"
    if out.suffix != ".onnx":
        return Message(f"{message}. Choose another path.")
    if out_real == pathlib.Path(os.path.realpath(source.graph)):
        return Message(f"{message}. {out.name} is its model file: use ", IN_PLACE, " to rewrite the folder.")
    kept = f"; {GENAI_CONFIG} keeps naming {source.graph.name}" if source.config is not None else ""
    return (
        f"{message}. For a converted graph beside {source.graph.name} (sharing its weights), give the "
        f"model file {source.graph} as the input and an output in its folder{kept}. For the folder "
        "to run the converted graph, use "
    ) + Message(IN_PLACE, ".")


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
    if in_place:
        return _plan_in_place(source, out_path, weights)
    if out_path is None:
        raise KvCacheError("Give an output path, or ", IN_PLACE, " to rewrite the input.")
    out = pathlib.Path(os.path.abspath(out_path))
    if out.is_symlink():
        raise KvCacheError(f"Output {out} is a symbolic link; refusing to write through it.")
    if source.folder is not None:
        return _plan_folder(source, out, out_path, overwrite, weights)
    return _plan_file(source, out, out_path, fmt, overwrite, weights)


def _plan_in_place(
    source: ModelSource, out_path: str | os.PathLike | None, weights: WeightsMode | None
) -> _Plan:
    """Rewrite the input: its graph (and config) replaced, its data files kept."""
    if out_path is not None and _real(pathlib.Path(os.path.abspath(out_path))) != _real(
        source.folder or source.graph
    ):
        raise KvCacheError("Give either an output path or ", IN_PLACE, ", not both.")
    if weights is not None:
        raise KvCacheError(
            IN_PLACE,
            " keeps the data files where they are; ",
            Param("weights", placeholder="MODE"),
            " does not apply.",
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
    return _Plan(Placement.IN_PLACE, source.folder or source.graph, WeightsMode.SHARE)


def _check_folder_output(source: ModelSource, out: pathlib.Path) -> None:
    """A folder converts to a folder that is not the input, inside it, containing it or any
    file it uses, and not named like a model file."""
    assert source.folder is not None
    out_real = _real(out)
    root_real = pathlib.Path(os.path.realpath(source.root))
    if out_real == root_real:
        raise KvCacheError(f"Output {out} is the input; use ", IN_PLACE, " to rewrite it.")
    if _is_within(out_real, root_real):
        raise KvCacheError(_inside_the_folder(source, out, out_real))
    if _is_within(root_real, out_real):
        raise KvCacheError(f"Output {out} contains the input folder {source.folder}; choose another path.")
    for f in source.input_files():
        if _is_within(f, out_real):
            raise KvCacheError(f"Output {out} contains {f}, which the input uses; choose another path.")
    if out.suffix == ".onnx":
        raise KvCacheError(
            f"The input {source.folder} is a folder, so the output is a folder too; {out.name} looks "
            f"like a file name. To convert only the model file, give {source.graph} as the input."
        )


def _plan_folder(
    source: ModelSource,
    out: pathlib.Path,
    out_path: str | os.PathLike,
    overwrite: bool,
    weights: WeightsMode | None,
) -> _Plan:
    """A genai folder to another folder: a new one, an empty one filled, or ours replaced."""
    _check_folder_output(source, out)
    plan = _Plan(Placement.FOLDER, out, WeightsMode(weights or WeightsMode.COPY))
    if not os.path.lexists(out):
        return plan
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
            f"Output {out} exists (a previous output of onnx-kvcache); pass ", OVERWRITE, " to replace it."
        )
    if _is_within(pathlib.Path(os.path.realpath(os.getcwd())), _real(out)):
        raise KvCacheError(f"Output {out} contains the current folder; refusing to replace it.")
    _refuse_mount_point(out)
    plan.replace, plan.replaced, plan.named = True, os.lstat(out), os.fspath(out_path)
    return plan


def _check_file_output(source: ModelSource, out: pathlib.Path, out_path: str | os.PathLike, fmt: str) -> None:
    """A model file converts to a ``.onnx`` file that is neither the input nor a file it uses."""
    out_real = _real(out)
    if out_real in source.input_files():
        what = (
            "the input"
            if out_real == pathlib.Path(os.path.realpath(source.graph))
            else "a file the input uses"
        )
        fix = Message("; use ", IN_PLACE, " to rewrite it") if what == "the input" else ""
        raise KvCacheError(f"Output {out} is {what}", fix, ".")
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


def _plan_file(
    source: ModelSource,
    out: pathlib.Path,
    out_path: str | os.PathLike,
    fmt: str,
    overwrite: bool,
    weights: WeightsMode | None,
) -> _Plan:
    """A model file beside its input (weights shared) or elsewhere (its own data files)."""
    _check_file_output(source, out, out_path, fmt)
    beside = pathlib.Path(os.path.realpath(out.parent)) == pathlib.Path(os.path.realpath(source.graph.parent))
    mode = WeightsMode(weights or (WeightsMode.SHARE if beside else WeightsMode.COPY))
    linked = [d for d in source.data.values() if d.path.is_symlink()]
    if mode is WeightsMode.SHARE and linked:
        raise KvCacheError(
            f"The input's data file {linked[0].path.name} is a symbolic link (to {linked[0].real}); onnx "
            "refuses linked external data (onnxruntime too, when it leads out of the folder), so an "
            "output sharing it would not load. Convert into another folder (the linked content is "
            "copied), or pass ",
            Param("weights", "copy"),
            " for this output's own copy.",
        )
    plan = _Plan(Placement.BESIDE if beside else Placement.ELSEWHERE, out, mode)
    if os.path.lexists(out):
        _replace_file(source, plan, out_path, overwrite)
    if mode is not WeightsMode.SHARE:
        plan.data_names = _data_names(out, sorted(source.data))
    return plan


def _replace_file(source: ModelSource, plan: _Plan, out_path: str | os.PathLike, overwrite: bool) -> None:
    """The existing output file is replaced only when ours and with ``overwrite``."""
    out = plan.out
    if not out.is_file():
        raise KvCacheError(f"Output {out} is not a regular file; refusing to replace it.")
    marker = previous.check_replaceable_file(out)
    if not overwrite:
        raise KvCacheError(
            f"Output {out} exists (a previous output of onnx-kvcache); pass ", OVERWRITE, " to replace it."
        )
    _refuse_mount_point(out)
    plan.replace, plan.replaced, plan.named = True, os.lstat(out), os.fspath(out_path)
    plan.obsolete, plan.kept = previous.own_data_files(out, marker, source.input_files())


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
    refusals: list[Refusal] = dataclasses.field(default_factory=list)
    """Why nothing was written: each a code, the parameter it concerns and its text."""
    target: str | None = None
    """The provider gated on; ``None`` when gating was skipped (``ep=None``)."""
    target_source: str = ""
    """How the target was chosen: ``given`` (``ep=``), or ``assumed: ...`` what it was inferred from."""
    placement: Placement | Literal[""] = ""
    """``beside``, ``elsewhere``, ``folder`` or ``in-place`` (a :class:`Placement`)."""
    weights: Weights | Literal[""] = ""
    """``shared``, ``cloned``, ``copied``, ``linked``, ``unchanged`` or ``inline`` (a :class:`Weights`)."""
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
    method: str | None = None
    """The calibration method of the cache's scales, as they record it (None: not recorded,
    or no scales)."""

    @property
    def reasons(self) -> list[str]:
        """The refusals' texts (why nothing was written)."""
        return list(texts(self.refusals))

    def weights_summary(self) -> str:
        summary = _WEIGHTS_SUMMARIES.get(self.weights, _copied_summary) if self.weights else _copied_summary
        return summary(self)


def _shared_summary(result: ConvertResult) -> str:
    name = result.shared_with.name if result.shared_with else "the input"
    files = result.data_files
    which = ", ".join(files) if 0 < len(files) <= 3 else f"{len(files)} data files"
    return f"weights: {which}, shared with {name} (0 bytes)"  # the data, not the graph


def _copied_summary(result: ConvertResult) -> str:
    holes = (
        f", {format_bytes(result.weight_bytes_written)} of data (holes kept)"
        if result.weight_bytes_written < result.weight_bytes
        else ""
    )
    return f"weights: copied {format_bytes(result.weight_bytes)}{holes}"


#: ``ConvertResult.weights_summary`` per outcome.
_WEIGHTS_SUMMARIES: dict[Weights, Callable[[ConvertResult], str]] = {
    Weights.INLINE: lambda r: "weights: inline in the graph",
    Weights.UNCHANGED: lambda r: (
        f"weights: unchanged ({format_bytes(r.weight_bytes)} in place, 0 bytes written)"
    ),
    Weights.SHARED: _shared_summary,
    Weights.CLONED: lambda r: f"weights: cloned {format_bytes(r.weight_bytes)} (0 bytes written)",
    Weights.LINKED: lambda r: (
        f"weights: hard-linked {format_bytes(r.weight_bytes)} (0 bytes written); onnx.load and onnx-ir "
        "refuse both models' weights"
    ),
    Weights.COPIED: _copied_summary,
}


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
    ``progress``: a progress bar for copies (default: on a terminal). A model some of whose
    caches would keep their type (a layer left unfused, a cache also read by another node) is
    not converted, the layers named, unless ``allow_partial``: then the others are.

    An existing output is replaced only with ``overwrite`` and only when it is a previous
    output of onnx-kvcache (the rules: :mod:`onnx_kvcache.model_io._marker`); an existing
    empty output folder is filled, with or without it.
    """
    scales, named, granularity = _arguments(in_path, out_path, format, granularity, scales, weights, ep)
    with gc_paused():  # the graph's objects: a 70B export's fusion spent a quarter in the collector
        source = open_model_source(in_path, follow_symlinks=follow_symlinks)
        named = named or format_for(source.model)  # an already-quantized model keeps its own
        plan = _plan(
            source, out_path, fmt=named or "kv", in_place=in_place, overwrite=overwrite, weights=weights
        )
        _check_writable(source, plan)
        request = _request(source, named, granularity, scales, ep, check_device, strict, shared_kv_scale)
        decision = decide(dataclasses.replace(request, allow_partial=allow_partial))
        result = _result(source, plan, decision)
        if carry_out(decision):
            warn_short_scales(decision.scales, decision.model, source.graph.parent, source.config)
            _finish(source, plan, decision, result, progress)
    return result


def _arguments(
    in_path: str | os.PathLike,
    out_path: str | os.PathLike | None,
    format: str | None,
    granularity: str | None,
    scales: Any,
    weights: WeightsMode | str | None,
    ep: str | None,
) -> tuple[KvCacheScales | None, str | None, str | None]:
    """The arguments that need no model, checked before any work: the scales read, the
    format they or ``format`` name, the granularity asked (checked against the scales)."""
    require_type(ep, (str, type(None)), "ep", "a provider name, 'auto' or None")
    require_type(out_path, (str, os.PathLike, type(None)), "out_path", "a path or None")
    read = as_kv_cache_scales(scales, stem=_model_stem(in_path))
    named = format or (read.implied_format if read is not None else None)  # None: the target's
    if named is not None:
        get_format(named)  # an unknown name fails before any work
    if granularity is not None:
        granularity = resolve_granularity(granularity, read)  # a contradiction fails before any work
    if weights is not None and weights not in ASKED_WEIGHTS:
        raise KvCacheError(f"weights must be 'copy' or 'link' (or None), got {weights!r}.")
    return read, named, granularity


def _check_writable(source: ModelSource, plan: _Plan) -> None:
    """The folders the output is written in take new files (checked before any work)."""
    in_place = plan.placement is Placement.IN_PLACE
    file_io.check_writable_folder(
        source.graph.parent if in_place else plan.out if plan.fill else plan.out.parent
    )
    if in_place and source.config_path is not None:
        file_io.check_writable_folder(source.config_path.parent)


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
    )
    if decision.target is not None:
        result.target_source = f"assumed: {decision.why}" if decision.why else "given"
    if decision.converted and fmt is not None and granularity is not None:
        requantized = _requantized_note(
            decision.model, fmt.name, granularity.name, decision.scales is not None
        )
        if requantized:
            result.notes.append(requantized)
    return result


def _count_ops(result: ConvertResult, model: ir.Model) -> None:
    for site in find_attention_sites(model):
        if site.cache_format is not None:
            result.ops[site.op.op_type] = result.ops.get(site.op.op_type, 0) + 1
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
    ("KV cache capacity (0) must be at least local_window_size"), float or quantized."""
    if any(
        s.int_attr("sliding_window_cache", 0) and s.int_attr("local_window_size", -1) > 0
        for s in find_attention_sites(decision.model)
    ):
        return True
    return get_capabilities(_share_target(decision, result)).share_buffer


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
    model = decision.model
    _count_ops(result, model)
    new_config = _new_config(source, plan, decision, result)
    entries = [e.rel.as_posix() for e in source.entries] if plan.placement is Placement.FOLDER else []
    if new_config is not None and source.config is None:
        entries.append(GENAI_CONFIG)  # an export folder's new config
    scales = decision.scales
    own = previous.calibrated_by(model.metadata_props) if scales is None else None  # requantized
    method = scales.metadata.get("method") if scales is not None else own
    result.method = method
    model.metadata_props[previous.MARKER_KEY] = previous.marker(
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
    except FileExistsError as e:  # the last rename lost a race: someone created the output meanwhile
        named = {os.path.abspath(f) for f in (e.filename, e.filename2) if isinstance(f, (str, os.PathLike))}
        if os.path.abspath(plan.out) not in named or plan.placement is Placement.IN_PLACE:
            raise
        raise KvCacheError(
            f"Output {plan.out} was created by someone else (another conversion?) while this one ran; "
            "nothing was written and it is left as it is. Check it, or choose another output path."
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


def _write_in_place(
    source: ModelSource, data: bytes, config: dict[str, Any] | None, fmt: str, result: ConvertResult
) -> None:
    """Replace the graph (and genai_config) in one commit, keeping mode and owner."""
    graph = source.graph
    result.weights = Weights.UNCHANGED if source.data else Weights.INLINE
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


def _stage_data(
    source: ModelSource, plan: _Plan, tmp: pathlib.Path, result: ConvertResult, progress: bool | None
) -> list[tuple[pathlib.Path, pathlib.Path, bool]]:
    """The output file's own data files, copied into ``tmp`` (or hard links to make), as
    ``publish_as_one`` takes them; says in ``result`` what became of the weights."""
    out = plan.out
    files = [(source.data[loc], name) for loc, name in plan.data_names.items()]
    if not source.data:
        result.weights = Weights.INLINE
        return []
    if not files:
        result.weights, result.shared_with = Weights.SHARED, source.graph
        return []
    if plan.weights is WeightsMode.LINK:
        result.weights = Weights.LINKED
        return [(d.real, out.parent / name, True) for d, name in files]
    staged = []
    copier = _Copier([d.real for d, _ in files], out.parent, progress)
    try:
        for i, (d, name) in enumerate(files):
            copier.copy(d.real, tmp / str(i))
            if plan.replaced is not None:
                file_io.keep_mode_and_owner(tmp / str(i), plan.replaced)
            staged.append((tmp / str(i), out.parent / name, False))
    finally:
        copier.close()
    result.weights = Weights.copied(copier.cloned)
    result.weight_bytes_written = copier.written
    return staged


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
            staged = _stage_data(source, plan, tmp.path, result, progress)
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


@dataclasses.dataclass
class _FolderCopy:
    """Filling a temporary folder with a converted genai folder: each entry of the input
    written (the graph, the config), hard-linked (``weights="link"``) or copied."""

    source: ModelSource
    plan: _Plan
    data: bytes
    config: dict[str, Any] | None
    result: ConvertResult
    old: dict[str, os.stat_result]
    """The replaced output's entries: one of the same name and kind passes on its mode."""
    written: int = 0
    """Bytes written: the graph, the config, the copies."""

    def __post_init__(self) -> None:
        self.written = len(self.data)
        folder = self.source.folder
        assert folder is not None
        self.rel_graph = pathlib.PurePosixPath(self.source.graph.relative_to(folder).as_posix())
        has_config = self.source.config is not None or self.config is not None  # an export's new one too
        self.rel_config = pathlib.PurePosixPath(GENAI_CONFIG) if has_config else None
        self.data_rel = {
            pathlib.PurePosixPath(d.path.relative_to(folder).as_posix()): d for d in self.source.data.values()
        }

    def linked(self, rel: pathlib.PurePosixPath) -> bool:
        return self.plan.weights is WeightsMode.LINK and rel in self.data_rel

    def to_copy(self) -> list[pathlib.Path]:
        """The input files that are copied (cloned where the filesystem can)."""
        own = (self.rel_graph, self.rel_config)
        return [
            e.real
            for e in self.source.entries
            if e.real is not None and e.rel not in own and not self.linked(e.rel)
        ]

    def fill(self, tmp: pathlib.Path, copier: _Copier) -> None:
        if self.config is not None and self.source.config is None:  # an export's new config
            self.entry(pathlib.PurePosixPath(GENAI_CONFIG), None, tmp / GENAI_CONFIG, copier)
        for entry in self.source.entries:
            dst = tmp / entry.rel
            self.entry(entry.rel, entry.real, dst, copier)
            like = self.old.get(entry.rel.as_posix())
            same_kind = like is not None and stat.S_IFMT(like.st_mode) == stat.S_IFMT(os.lstat(dst).st_mode)
            if like is not None and same_kind and not self.linked(entry.rel):
                file_io.keep_mode_and_owner(dst, like)

    def entry(
        self, rel: pathlib.PurePosixPath, real: pathlib.Path | None, dst: pathlib.Path, copier: _Copier
    ) -> None:
        if rel == self.rel_config and self.config is not None:
            config_data = _config_bytes(self.config)
            file_io.write_new_file(dst, config_data)
            self.written += len(config_data)
        elif real is None:
            os.mkdir(dst, 0o777)
        elif rel == self.rel_graph:
            file_io.write_new_file(dst, self.data)
        elif self.linked(rel):
            os.link(real, dst, follow_symlinks=True)
        else:
            n = copier.copy(real, dst)
            self.written += n
            if rel in self.data_rel:
                self.result.weight_bytes_written += n


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
    out = plan.out
    job = _FolderCopy(source, plan, data, config, result, _old_entries(out) if plan.replace else {})
    result.model_file = out / job.rel_graph
    result.data_files = sorted(str(r) for r in job.data_rel)
    created = file_io.make_dirs(out.parent)
    work = out if plan.fill else out.parent  # where the temporary folder is built
    try:
        file_io.sweep_stale(work)
        copier = _Copier(job.to_copy(), work, progress)
        with _replacing(plan), file_io.TempDir(work, like=plan.replaced) as tmp:
            try:
                job.fill(tmp.path, copier)
            finally:
                copier.close()
            if plan.fill:
                file_io.publish_into_empty(tmp, out, job.rel_config or job.rel_graph)
            else:
                with file_io.uninterrupted(completes=True):
                    tmp.publish(out, replace=plan.replace)
    except BaseException:
        if not os.path.lexists(out):
            file_io.remove_empty_dirs(created)
        raise
    _folder_written(source, plan, job, copier.cloned)


def _folder_written(source: ModelSource, plan: _Plan, job: _FolderCopy, cloned: bool) -> None:
    """What the folder's result says once it is in place."""
    result = job.result
    if not source.data:
        result.weights = Weights.INLINE
    elif plan.weights is WeightsMode.LINK:
        result.weights = Weights.LINKED
    else:
        result.weights = Weights.copied(cloned)
    result.bytes_written = job.written
    _replaced_notes(plan, result)
    if job.config is not None:
        result.notes.append(
            f"{GENAI_CONFIG}: search.past_present_share_buffer is {str(share_buffer(job.config)).lower()}."
        )
