"""Planning a conversion: where its output goes, checked before anything is written.

:func:`_plan` reads the caller's output path (or ``in_place``) against the model's files and
returns a :class:`_Plan`: the :class:`~onnx_kvcache.files._conversion_terms.Placement`
(beside the input, in place, elsewhere, a genai folder), the weights' mode, the new names of
the data files the output gets, and what it replaces. Every path relationship is refused
here, one line each: the output is never the input, inside it or containing it, never a file
the model uses, never a mount point, and replaces nothing but a previous output of
onnx-kvcache (with ``overwrite``; :mod:`onnx_kvcache.model_io._marker`). Nothing is written
(:mod:`onnx_kvcache.files._conversion_write` writes what was planned).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

from onnx_kvcache import model_io
from onnx_kvcache.cache.formats import CACHE_FORMATS
from onnx_kvcache.errors import KvCacheError, Message, Param
from onnx_kvcache.files._conversion_terms import Placement, WeightsMode
from onnx_kvcache.model_io.genai_folder import GENAI_CONFIG
from onnx_kvcache.model_io.reading import ModelSource

IN_PLACE, OVERWRITE = Param("in_place", True), Param("overwrite", True)


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
    if model_io.is_mount_point(out):
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
    if any(name.startswith(model_io.TEMP_PREFIX) for name in os.listdir(out)):
        model_io.sweep_stale(out)  # a killed run's entries; a killed fill is undone
    if not os.listdir(out):
        plan.fill = True  # nothing there to replace: overwrite is not needed
        return plan
    model_io.check_replaceable_folder(out)
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
        fix = (
            Message("; use ", IN_PLACE, " to rewrite it")
            if what == "the input"
            else f" (its weights); name a .onnx file (e.g. {_free_graph_name(source.graph, fmt).name})"
        )
        raise KvCacheError(f"Output {out} is {what}", fix, ".")
    if (os.path.lexists(out) and out.is_dir()) or str(out_path).endswith(("/", os.sep)):
        if model_io.is_output_folder(out):  # a file of ours in it would block its replacement
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
        stem = out.name.lstrip(".").split(".")[0] or "model"  # x.onnx.data: x.onnx, not x.onnx.onnx
        named = _free_name(out.with_name(stem + ".onnx"), fmt).name
        raise KvCacheError(f"Output {out} must be a .onnx file name (e.g. {named}).")


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
    marker = model_io.check_replaceable_file(out)
    if not overwrite:
        raise KvCacheError(
            f"Output {out} exists (a previous output of onnx-kvcache); pass ", OVERWRITE, " to replace it."
        )
    _refuse_mount_point(out)
    plan.replace, plan.replaced, plan.named = True, os.lstat(out), os.fspath(out_path)
    plan.obsolete, plan.kept = model_io.own_data_files(out, marker, source.input_files())


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
