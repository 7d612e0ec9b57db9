"""A model on disk: its graph, the data files it names, and an input folder's entries.

Reading checks every path relationship first: data locations are relative and inside the
model's folder, present, regular files long enough for their tensors; symbolic links out
of an input folder are refused unless asked for (Hugging Face cache snapshots). Weights
are never read: ``onnx_ir`` loads external tensors lazily.
"""

from __future__ import annotations

__all__ = [
    "DataFile",
    "ModelLike",
    "ModelSource",
    "as_model",
    "UNDEFINED_FIX",
    "check_defined",
    "external_data_files",
    "load_model",
    "logits_output",
    "open_model_source",
    "tensor_values",
    "undefined_value",
]

import dataclasses
import os
import pathlib
import stat
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from onnx_kvcache.errors import (
    KvCacheError,
    KvCacheTypeError,
    MalformedModelError,
    Param,
    require_flags,
    require_type,
)
from onnx_kvcache.model_io import _atomic as file_io
from onnx_kvcache.model_io._atomic import check_inside, check_relative
from onnx_kvcache.model_io._inputs import input_kind
from onnx_kvcache.model_io.genai_folder import GENAI_CONFIG, resolve_model_path

_NOT_CARRIED = (".git",)
"""Top-level entries of an input folder that are not part of the model."""


def _first_cause(error: BaseException) -> BaseException:
    """The error that started a chain: onnx-ir's deserializer wraps the one naming the problem
    (a negative external-data offset) in "Error calling _deserialize_graph with: main_graph"."""
    seen = {id(error)}
    while (cause := error.__cause__ or error.__context__) is not None and id(cause) not in seen:
        seen.add(id(cause))
        error = cause
    return error


def _load_graph(model_file: pathlib.Path) -> ir.Model:
    if model_file.stat().st_size == 0:
        raise KvCacheError(f"{model_file} is empty (0 bytes), not an ONNX model.")
    try:
        model = ir.load(model_file)
    except Exception as e:  # protobuf raises several unrelated types
        raise KvCacheError(f"{model_file} is not a readable ONNX model ({_first_cause(e)}).") from None
    if model.ir_version < 1 or (model.graph.num_nodes() == 0 and not model.graph.outputs):
        raise KvCacheError(f"{model_file} is not an ONNX model (no IR version or graph).")
    return model


def _iter_tensors(model: ir.Model) -> Iterator[ir.TensorProtocol]:
    graphs: list[ir.Graph] = [model.graph]
    for function in model.functions.values():
        for node in function:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR:
                    yield attr.value
                elif attr.type == ir.AttributeType.GRAPH:
                    graphs.append(attr.value)
                elif attr.type == ir.AttributeType.GRAPHS:
                    graphs.extend(attr.value)
    for graph in graphs:
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value.const_value
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    graphs.append(attr.value)
                elif attr.type == ir.AttributeType.GRAPHS:
                    graphs.extend(attr.value)
                elif attr.type == ir.AttributeType.TENSOR:
                    yield attr.value


@dataclasses.dataclass(frozen=True)
class DataFile:
    """An external data file a graph names."""

    location: str
    """As the graph names it, relative to the graph's folder."""
    path: pathlib.Path
    """Absolute, as named (may be a symbolic link)."""
    real: pathlib.Path
    """Where the bytes are."""
    size: int


def _beside_target(graph: pathlib.Path | None, location: str) -> str | None:
    """The advice for a model file that is a symbolic link whose data file lies beside the
    link's target, not beside the link (where it is looked for; onnxruntime 1.32 looks there
    too and refuses it: "External data path escapes model directory")."""
    if graph is None or not os.path.islink(graph):
        return None
    real = pathlib.Path(os.path.realpath(graph))
    if not os.path.lexists(real.parent / location):
        return None
    return (
        f"{graph} is a symbolic link to {real}: data files are looked for beside the link, not beside "
        f"its target, where {location} is (onnxruntime refuses such a link too). Give {real} itself, "
        "or copy the model file and its data files into one folder."
    )


def _external_data(
    model: ir.Model,
    graph_dir: pathlib.Path,
    root: pathlib.Path,
    follow_symlinks: bool,
    forbidden: frozenset[pathlib.Path] = frozenset(),
    graph: pathlib.Path | None = None,
) -> dict[str, DataFile]:
    """Every external data file: inside ``root``, present, a regular file, long enough.

    ``forbidden``: files that cannot hold weights (the model file, its config); ``graph``: the
    model file as named, for the advice when it is a link whose data lies beside its target.
    """
    needed: dict[str, tuple[int, str]] = {}
    for tensor in _iter_tensors(model):
        if not isinstance(tensor, ir.ExternalTensor):
            continue
        location = check_relative(str(tensor.location), f"Tensor {tensor.name!r}'s data location", graph_dir)
        end = (tensor.offset or 0) + (tensor.length if tensor.length is not None else tensor.nbytes)
        if end > needed.get(location, (-1, ""))[0]:
            needed[location] = (end, str(tensor.name))
    files = {}
    for location, (end, name) in sorted(needed.items()):
        path = pathlib.Path(os.path.abspath(graph_dir / location))
        if root != path and root not in path.parents:
            raise KvCacheError(f"Tensor {name!r} keeps its data at {location!r}, outside {root}.")
        if not os.path.lexists(path):
            raise KvCacheError(
                f"Data file {path} is missing: tensor {name!r} (and maybe others) keeps its weights there. ",
                _beside_target(graph, location) or "Copy the complete model (every data file) and try again.",
            )
        real = check_inside(path, root, follow_symlinks)
        if real in forbidden:
            raise KvCacheError(
                f"Tensor {name!r} keeps its weights in {path}, which is the model file or its config."
            )
        what = input_kind(path)
        if what is not None:
            raise KvCacheError(f"Data file {path} is {what}; the model needs its weights there.")
        size = real.stat().st_size
        if size < end:
            raise KvCacheError(
                f"Data file {path} is {size} bytes but tensor {name!r} ends at byte {end}: the file is "
                "truncated (an incomplete download?)."
            )
        files[location] = DataFile(location, path, real, size)
    return files


def external_data_files(model: ir.Model, base_dir: str | os.PathLike) -> list[str]:
    """Relative paths of the external data files; each checked to be inside ``base_dir``."""
    base = pathlib.Path(os.path.abspath(base_dir))
    return sorted(_external_data(model, base, base, follow_symlinks=False))


def load_model(path: str | os.PathLike, *, follow_symlinks: bool = False) -> ir.Model:
    """Load a model's graph from a file or genai folder; weights stay on disk (checked)."""
    require_flags(follow_symlinks=follow_symlinks)
    model_file, _ = resolve_model_path(path)
    model = _load_graph(model_file)
    folder = pathlib.Path(os.path.abspath(model_file.parent))
    _external_data(model, folder, folder, follow_symlinks, graph=model_file)
    return model


def tensor_values(tensor: ir.TensorProtocol) -> np.ndarray:
    """A tensor's values; an external tensor whose data file onnx-ir will not read (more than
    one hard link: its guard against hard-link attacks) is one :class:`KvCacheError` naming the
    file and the fix, not onnx-ir's ``ValueError``."""
    if isinstance(tensor, ir.ExternalTensor):
        path = pathlib.Path(tensor.path)
        links = path.stat().st_nlink if path.exists() else 1
        if links > 1:
            raise KvCacheError(
                f"Cannot read tensor {tensor.name!r}: its data file {path} has {links} hard links, and "
                "onnx-ir refuses to read such a file (a guard against hard-link attacks; a conversion "
                "with ",
                Param("weights", "link"),
                " makes them). Give the file one link: copy it (cp --reflink=auto keeps it cheap where "
                "the file system clones) over the link.",
            )
    return np.asarray(tensor.numpy())


#: What the library's functions take as a model: in memory, as a proto, or on disk.
ModelLike = ir.Model | onnx.ModelProto | str | os.PathLike


def as_model(model: ModelLike) -> ir.Model:
    """``model`` as an ``ir.Model``: the same object, converted from a proto, or loaded."""
    if isinstance(model, ir.Model):
        return model
    if isinstance(model, onnx.ModelProto):
        return ir.from_proto(model)
    if isinstance(model, (str, os.PathLike)):
        return load_model(model)
    raise KvCacheTypeError(
        f"Expected a model (onnx_ir.Model, onnx.ModelProto, or the path of a .onnx file or "
        f"onnxruntime-genai folder), got {type(model).__name__}."
    )


@dataclasses.dataclass(frozen=True)
class _Entry:
    rel: pathlib.PurePosixPath
    real: pathlib.Path | None
    """Where the bytes are; ``None`` for a folder."""


@dataclasses.dataclass
class ModelSource:
    """An input model as found on disk: what a conversion reads and must never touch."""

    graph: pathlib.Path
    """The ``.onnx`` file (absolute)."""
    folder: pathlib.Path | None
    """The input folder (absolute), when a folder was given."""
    config: dict[str, Any] | None
    model: ir.Model
    data: dict[str, DataFile]
    entries: list[_Entry]
    """Everything a folder conversion carries over (folder inputs only)."""

    @property
    def root(self) -> pathlib.Path:
        return self.folder or self.graph.parent

    @property
    def config_path(self) -> pathlib.Path | None:
        return self.folder / GENAI_CONFIG if self.folder and self.config is not None else None

    def input_files(self) -> set[pathlib.Path]:
        """Every file the model is made of, where its bytes are (symlinks resolved)."""
        files = {pathlib.Path(os.path.realpath(self.graph))}
        files |= {d.real for d in self.data.values()}
        files |= {e.real for e in self.entries if e.real is not None}
        if self.config_path is not None:
            files.add(pathlib.Path(os.path.realpath(self.config_path)))
        return files


def _walk(folder: pathlib.Path, follow_symlinks: bool) -> list[_Entry]:
    """Every entry of an input folder, checked: no special files, links out need the flag."""
    entries: list[_Entry] = []

    def unreadable(error: OSError) -> None:
        raise error  # a folder we cannot list would silently be missing from the output

    for dirpath, dirnames, filenames in os.walk(folder, onerror=unreadable):
        here = pathlib.Path(dirpath)
        rel_dir = pathlib.PurePosixPath(here.relative_to(folder).as_posix())
        keep = []
        for d in sorted(dirnames):
            if d.startswith(file_io.TEMP_PREFIX) or (here == folder and d in _NOT_CARRIED):
                continue
            if (here / d).is_symlink():
                raise KvCacheError(
                    f"{here / d} is a symbolic link to a folder; replace it with the folder itself."
                )
            keep.append(d)
            entries.append(_Entry(rel_dir / d, None))
        dirnames[:] = keep
        for name in sorted(filenames):
            if name.startswith(file_io.TEMP_PREFIX):
                continue  # a temporary entry of ours, never part of a model
            path = here / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                what = input_kind(path)
                if what is not None and not os.path.exists(path):  # broken, or a loop: it leads nowhere
                    raise KvCacheError(f"{path} is {what}; remove it or replace it with the file.")
                real = check_inside(path, folder, follow_symlinks)
                if what is not None:
                    raise KvCacheError(f"{path} links to {real}, which is {what}, not a regular file.")
            elif stat.S_ISREG(mode):
                real = path
            else:
                raise KvCacheError(f"{path} is not a regular file (a pipe, socket or device); remove it.")
            entries.append(_Entry(rel_dir / name, real))
    return entries


def open_model_source(path: str | os.PathLike, *, follow_symlinks: bool = False) -> ModelSource:
    """Find and check every file of a model file or folder; read its graph, not its weights."""
    require_type(path, (str, os.PathLike), "The model", "a path (str or os.PathLike) here")
    p = pathlib.Path(os.path.abspath(path))
    graph, config = resolve_model_path(p)
    folder = p if p.is_dir() else None
    root = folder or graph.parent
    check_inside(graph, root, follow_symlinks)
    if folder is not None and config is not None:
        check_inside(folder / GENAI_CONFIG, root, follow_symlinks)
    model = _load_graph(graph)
    forbidden = {pathlib.Path(os.path.realpath(graph))}
    if folder is not None and config is not None:
        forbidden.add(pathlib.Path(os.path.realpath(folder / GENAI_CONFIG)))
    data = _external_data(model, graph.parent, root, follow_symlinks, frozenset(forbidden), graph)
    entries = _walk(folder, follow_symlinks) if folder is not None else []
    return ModelSource(graph, folder, config, model, data, entries)


UNDEFINED_FIX = (
    "The model is malformed: export it again, or repair it (onnx.checker.check_model names the problem)."
)


def undefined_value(graph: ir.Graph | ir.Function, where: str = "") -> str | None:
    """A value of ``graph``'s own nodes or outputs that nothing defines (a node removed by hand, a
    broken export), said as ``node N reads V, which ...`` or ``the graph outputs V, which ...``
    (``where``: after the node or graph, e.g. `` in function f``); None when there is none.
    An outer graph's value counts as defined (a subgraph reads it)."""

    def defined(value: ir.Value) -> bool:
        producer = value.producer()
        if value.is_graph_input() or (producer is not None and producer.graph is not None):
            return True  # a producer removed since has no graph
        return value.is_initializer() or value.const_value is not None

    for node in graph:
        for value in node.inputs:
            if value is not None and not defined(value):
                return (
                    f"node {node.name or node.op_type!r}{where} reads {value.name!r}, which no node, graph "
                    "input or initializer defines"
                )
    for value in graph.outputs:
        if not defined(value):
            return (
                f"the graph{where} outputs {value.name!r}, which no node, graph input or initializer "
                'defines (onnxruntime refuses it: the output "does not exist in the graph")'
            )
    return None


def logits_output(model: ir.Model, caches: frozenset[str] = frozenset()) -> tuple[str, int | None] | None:
    """The logits output's name and vocabulary size (None when symbolic), read from the graph:
    the first output named like ``logits``, else the first output not named in ``caches`` (the
    presents); None when there is no such output."""
    outputs = [o for o in model.graph.outputs if o.name not in caches]
    if not outputs:
        return None
    logits = next((o for o in outputs if "logits" in (o.name or "")), outputs[0])
    last = logits.shape[-1] if logits.shape is not None and len(logits.shape) else None
    return logits.name or "", last if isinstance(last, int) else None


def check_defined(graph: ir.Graph) -> None:
    """Every value a main-graph node reads, and every graph output, is defined: an input, an
    initializer or a node's output (before a clone, which fails on anything else)."""
    problem = undefined_value(graph)
    if problem is not None:
        raise MalformedModelError(f"{problem[:1].upper()}{problem[1:]}. {UNDEFINED_FIX}")
