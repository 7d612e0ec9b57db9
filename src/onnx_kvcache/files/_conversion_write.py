"""Writing a planned conversion: the graph's bytes, the weights' placement, the atomic publication.

A :class:`~onnx_kvcache.files._conversion_plan._Plan` is carried out here: the graph is
serialized with its data files renamed (:func:`_serialize`); weights are cloned where the
filesystem can, else copied with their holes (:class:`_Copier`, one progress bar, free space
checked before the first copy) or hard-linked when asked; a graph file, a folder
(:class:`_FolderCopy`) or the input itself (:func:`_write_in_place`) is then published in
one commit through :mod:`onnx_kvcache.model_io._atomic`, so nothing partial is ever left, and a
replaced output is locked and checked again before it goes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import stat
from collections.abc import Iterator
from typing import Any

import onnx_ir as ir

from onnx_kvcache import model_io
from onnx_kvcache._signals import uninterrupted
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.files._conversion_plan import _free_graph_name, _named_format, _Plan
from onnx_kvcache.files._conversion_terms import ConvertResult, Weights, WeightsMode
from onnx_kvcache.model_io import format_bytes
from onnx_kvcache.model_io.genai_folder import GENAI_CONFIG, share_buffer
from onnx_kvcache.model_io.reading import ModelSource


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


def _write_in_place(
    source: ModelSource, data: bytes, config: dict[str, Any] | None, fmt: str, result: ConvertResult
) -> None:
    """Replace the graph (and genai_config) in one commit, keeping mode and owner."""
    graph = source.graph
    result.weights = Weights.UNCHANGED if source.data else Weights.INLINE
    result.data_files = sorted(source.data)
    for folder in {graph.parent, source.root}:
        model_io.sweep_stale(folder)
    if config is None and source.config is not None and _named_format(graph) not in (None, fmt):
        config = source.config  # model.fp8.onnx requantized to int4: renamed (the config names it)
    if config is None or source.config_path is None:
        model_io.atomic_write_bytes(graph, data, like=graph.stat())
        result.model_file, result.bytes_written = graph, len(data)
        return
    # Both files change: the new graph takes a new name, and replacing genai_config.json
    # (which names it) is the one commit. Only then is the old graph removed.
    new_graph = _free_graph_name(graph, fmt)
    config = json.loads(json.dumps(config))
    config["model"]["decoder"]["filename"] = new_graph.relative_to(source.root).as_posix()
    config_path = source.config_path
    config_data = _config_bytes(config)
    with model_io.TempDir(source.root) as tmp:
        model_io.write_new_file(tmp.path / "graph", data, like=graph.stat())
        model_io.write_new_file(tmp.path / "config", config_data, like=config_path.stat())
        model_io.publish_as_one(
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
        f"{GENAI_CONFIG} now names {new_graph.name} (was {graph.name}); {_share_note(config)}"
    )


def _share_note(config: dict[str, Any]) -> str:
    """What ``search.past_present_share_buffer`` is in the written config, and what it means."""
    if share_buffer(config):
        return (
            "search.past_present_share_buffer is true: past and present share one buffer of the "
            "context's length, written in place (no cache copied a step)."
        )
    return (
        "search.past_present_share_buffer is false: each step's present is a new buffer (the "
        "target's kernel is not known to compute the same in one shared buffer, or the graph "
        "counts positions from a past cache's length)."
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
        self.remaining = sum(model_io.allocated_bytes(p) for p in sources)
        self.space_checked = False
        self.cloned = True
        self.written = 0

    def copy(self, src: pathlib.Path, dst: pathlib.Path) -> int:
        """Clone or copy ``src`` to the new file ``dst``; the bytes written."""
        allocated = model_io.allocated_bytes(src)
        if model_io.clone_file(src, dst):
            self.bar.update(src.stat().st_size)
            written = 0
        else:
            if not self.space_checked:
                self._check_space()
            written = model_io.copy_data(src, dst, progress=self.bar)
            self.cloned = False
        self.remaining -= allocated
        self.written += written
        return written

    def _check_space(self) -> None:
        self.space_checked = True
        free = model_io.free_bytes(self.folder)
        if free is not None and free < self.remaining:
            raise KvCacheError(
                f"Copying the weights needs {format_bytes(self.remaining)} and {self.folder} has "
                f"{format_bytes(free)} free (this filesystem cannot clone files). Free some space, or "
                "convert beside the input (weights shared, nothing copied)."
            )

    def close(self) -> None:
        self.bar.close()


def _identity(st: os.stat_result | None) -> model_io.Identity | None:
    return None if st is None else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _replacing(plan: _Plan) -> contextlib.AbstractContextManager[None]:
    """Hold the output to replace (checked unchanged since planned); nothing when new."""
    identity = _identity(plan.replaced)
    return contextlib.nullcontext() if identity is None else model_io.locked_output(plan.out, identity)


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
                model_io.keep_mode_and_owner(tmp / str(i), plan.replaced)
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
    created = model_io.make_dirs(out.parent)
    try:
        model_io.sweep_stale(out.parent)
        with _replacing(plan), model_io.TempDir(out.parent) as tmp:
            staged = _stage_data(source, plan, tmp.path, result, progress)
            model_io.write_new_file(tmp.path / "graph", data, like=like, owner_required=False)
            model_io.publish_as_one(
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
            model_io.remove_empty_dirs(created)
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
                model_io.keep_mode_and_owner(dst, like)

    def entry(
        self, rel: pathlib.PurePosixPath, real: pathlib.Path | None, dst: pathlib.Path, copier: _Copier
    ) -> None:
        if rel == self.rel_config and self.config is not None:
            config_data = _config_bytes(self.config)
            model_io.write_new_file(dst, config_data)
            self.written += len(config_data)
        elif real is None:
            os.mkdir(dst, 0o777)
        elif rel == self.rel_graph:
            model_io.write_new_file(dst, self.data)
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
    created = model_io.make_dirs(out.parent)
    work = out if plan.fill else out.parent  # where the temporary folder is built
    try:
        model_io.sweep_stale(work)
        copier = _Copier(job.to_copy(), work, progress)
        with _replacing(plan), model_io.TempDir(work, like=plan.replaced) as tmp:
            try:
                job.fill(tmp.path, copier)
            finally:
                copier.close()
            if plan.fill:
                model_io.publish_into_empty(tmp, out, job.rel_config or job.rel_graph)
            else:
                with uninterrupted(completes=True):
                    tmp.publish(out, replace=plan.replace)
    except BaseException:
        if not os.path.lexists(out):
            model_io.remove_empty_dirs(created)
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
        result.notes.append(f"{GENAI_CONFIG}: {_share_note(job.config)}")
