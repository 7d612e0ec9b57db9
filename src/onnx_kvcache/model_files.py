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
a previous output (with ``overwrite``). See :mod:`onnx_kvcache.file_io` for how writes
stay atomic and what a killed run leaves behind.
"""

from __future__ import annotations

__all__ = [
    "GENAI_CONFIG",
    "ConvertResult",
    "ModelSource",
    "atomic_write_bytes",
    "atomic_write_text",
    "convert_model",
    "external_data_files",
    "load_model",
    "open_model_source",
    "resolve_model_path",
]

import dataclasses
import json
import logging
import os
import pathlib
import re
import stat
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import onnx_ir as ir

from onnx_kvcache import file_io
from onnx_kvcache.capabilities import (
    check_kv_cache_support,
    conversion_warnings,
    get_capabilities,
    infer_target,
)
from onnx_kvcache.errors import KvCacheError, KvCacheWarning
from onnx_kvcache.file_io import atomic_write_bytes, atomic_write_text, format_bytes
from onnx_kvcache.formats import CACHE_FORMATS, get_format
from onnx_kvcache.gqa import find_attention_sites
from onnx_kvcache.optimize import optimize_model
from onnx_kvcache.passes.gqa_fusion import GqaFusionPass
from onnx_kvcache.scales import as_kv_cache_scales

logger = logging.getLogger(__name__)

GENAI_CONFIG = "genai_config.json"
_NOT_CARRIED = (".git",)
"""Top-level entries of an input folder that are not part of the model."""

LINK_WARNING = (
    "the output's data files are hard links to the input's: onnx (onnx.load, onnx.checker) and "
    "onnx-ir refuse a data file with more than one link, so NEITHER model loads in them until one "
    "is deleted (onnxruntime and onnxruntime-genai load both)."
)


# -- reading --------------------------------------------------------------------------


def _check_relative(location: Any, what: str, folder: pathlib.Path) -> str:
    """A path a model file names: relative, no ``..``, so inside its folder (lexically)."""
    if not isinstance(location, str) or not location:
        raise KvCacheError(f"{what} is {location!r}; it must name a file inside {folder}.")
    parts = pathlib.PurePosixPath(location.replace("\\", "/")).parts
    if (
        os.path.isabs(location)
        or pathlib.PureWindowsPath(location).is_absolute()
        or location.startswith(("/", "\\"))
        or ".." in parts
    ):
        raise KvCacheError(
            f"{what} is {location!r}, outside the model's folder {folder} (an absolute path or '..'). "
            "Refusing to read or write it: it must be a relative path inside the folder."
        )
    return location


def _looks_like_hf_snapshot(folder: pathlib.Path) -> bool:
    folder = pathlib.Path(os.path.abspath(folder))
    return folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir()


def _first_escaping_link(path: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    p = root
    for part in path.relative_to(root).parts:
        p = p / part
        if p.is_symlink():
            return p
    return path


def _check_inside(path: pathlib.Path, root: pathlib.Path, follow_symlinks: bool) -> pathlib.Path:
    """Where ``path``'s bytes are; a symbolic link out of ``root`` needs ``follow_symlinks``."""
    real = pathlib.Path(os.path.realpath(path))
    root_real = pathlib.Path(os.path.realpath(root))
    if real == root_real or root_real in real.parents or follow_symlinks:
        return real
    link = _first_escaping_link(pathlib.Path(os.path.abspath(path)), pathlib.Path(os.path.abspath(root)))
    hint = (
        "This looks like a Hugging Face cache snapshot (files linking into ../../blobs/): pass "
        "follow_symlinks=True to accept the links; a conversion elsewhere then "
        "copies their content."
        if _looks_like_hf_snapshot(root)
        else "Copy the file into the folder, or pass follow_symlinks=True to "
        "accept links (a conversion elsewhere copies their content)."
    )
    raise KvCacheError(f"{link} is a symbolic link to {real}, outside the model's folder {root}. {hint}")


def _read_genai_config(path: pathlib.Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise KvCacheError(f"{path} is a folder, not onnxruntime-genai's JSON config.") from None
    try:
        config = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise KvCacheError(
            f"{path} is not UTF-8 text (byte {e.start}); onnxruntime-genai reads UTF-8 JSON."
        ) from None
    except json.JSONDecodeError as e:
        raise KvCacheError(f"{path} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise KvCacheError(f"{path} is not a JSON object.")
    return config


def _decoder_filename(config: dict[str, Any], config_path: pathlib.Path) -> str:
    """``model.decoder.filename``, after checking the parts of the config we read or write."""
    try:
        filename = config["model"]["decoder"]["filename"]
    except (KeyError, TypeError):
        raise KvCacheError(f"{config_path}: cannot read model.decoder.filename.") from None
    for key, value in [
        ("model.decoder", config["model"]["decoder"]),
        ("model.decoder.session_options", config["model"]["decoder"].get("session_options", {})),
        ("search", config.get("search", {})),
    ]:
        if not isinstance(value, dict):
            raise KvCacheError(f"{config_path}: {key} is not a JSON object, as onnxruntime-genai needs.")
    folder = config_path.parent
    _check_relative(filename, f"{config_path}'s model.decoder.filename", folder)
    for key, section in config["model"].items():  # vision, speech, embedding models
        if isinstance(section, dict) and "filename" in section:
            _check_relative(section["filename"], f"{config_path}'s model.{key}.filename", folder)
    return str(filename)


def resolve_model_path(path: str | os.PathLike) -> tuple[pathlib.Path, dict[str, Any] | None]:
    """The ``.onnx`` file for a file or onnxruntime-genai folder, and the genai config."""
    p = pathlib.Path(path)
    if not os.path.lexists(p):
        raise KvCacheError(f"Model {p} does not exist.")
    if p.is_dir():
        config_path = p / GENAI_CONFIG
        if not os.path.lexists(config_path):
            onnx_files = sorted(f for f in p.glob("*.onnx") if f.is_file())
            if len(onnx_files) == 1:
                return onnx_files[0], None
            raise KvCacheError(
                f"{p} is a folder without {GENAI_CONFIG} and with {len(onnx_files)} .onnx "
                "files; pass the .onnx file itself."
            )
        config = _read_genai_config(config_path)
        filename = _decoder_filename(config, config_path)
        model_file = p / filename
        if not model_file.is_file():
            what = "a folder" if model_file.is_dir() else "missing"
            raise KvCacheError(f"{config_path} names {filename!r} as the decoder, which is {what} in {p}.")
        return model_file, config
    if not p.exists():
        raise KvCacheError(f"Model {p} is a broken symbolic link.")
    if not p.is_file():
        raise KvCacheError(f"Model {p} is not a regular file.")
    return p, None


def _load_graph(model_file: pathlib.Path) -> ir.Model:
    if model_file.stat().st_size == 0:
        raise KvCacheError(f"{model_file} is empty (0 bytes), not an ONNX model.")
    try:
        model = ir.load(model_file)
    except Exception as e:  # protobuf raises several unrelated types
        raise KvCacheError(f"{model_file} is not a readable ONNX model ({e}).") from None
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


def _external_data(
    model: ir.Model,
    graph_dir: pathlib.Path,
    root: pathlib.Path,
    follow_symlinks: bool,
    forbidden: frozenset[pathlib.Path] = frozenset(),
) -> dict[str, DataFile]:
    """Every external data file: inside ``root``, present, a regular file, long enough.

    ``forbidden``: files that cannot hold weights (the model file, its config).
    """
    needed: dict[str, tuple[int, str]] = {}
    for tensor in _iter_tensors(model):
        if not isinstance(tensor, ir.ExternalTensor):
            continue
        location = _check_relative(str(tensor.location), f"Tensor {tensor.name!r}'s data location", graph_dir)
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
                f"Data file {path} is missing: tensor {name!r} (and maybe others) keeps its weights "
                "there. Copy the complete model (every data file) and try again."
            )
        real = _check_inside(path, root, follow_symlinks)
        if real in forbidden:
            raise KvCacheError(
                f"Tensor {name!r} keeps its weights in {path}, which is the model file or its config."
            )
        if not real.is_file():
            what = "a folder" if real.is_dir() else ("a broken link" if not real.exists() else "not a file")
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
    model_file, _ = resolve_model_path(path)
    model = _load_graph(model_file)
    folder = pathlib.Path(os.path.abspath(model_file.parent))
    _external_data(model, folder, folder, follow_symlinks)
    return model


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
                if not path.exists():
                    raise KvCacheError(f"{path} is a broken symbolic link ({os.readlink(path)}).")
                real = _check_inside(path, folder, follow_symlinks)
                if not real.is_file():
                    raise KvCacheError(f"{path} links to {real}, which is not a regular file.")
            elif stat.S_ISREG(mode):
                real = path
            else:
                raise KvCacheError(f"{path} is not a regular file (a pipe, socket or device); remove it.")
            entries.append(_Entry(rel_dir / name, real))
    return entries


def open_model_source(path: str | os.PathLike, *, follow_symlinks: bool = False) -> ModelSource:
    """Find and check every file of a model file or folder; read its graph, not its weights."""
    p = pathlib.Path(os.path.abspath(path))
    graph, config = resolve_model_path(p)
    folder = p if p.is_dir() else None
    root = folder or graph.parent
    _check_inside(graph, root, follow_symlinks)
    if folder is not None and config is not None:
        _check_inside(folder / GENAI_CONFIG, root, follow_symlinks)
    model = _load_graph(graph)
    forbidden = {pathlib.Path(os.path.realpath(graph))}
    if folder is not None and config is not None:
        forbidden.add(pathlib.Path(os.path.realpath(folder / GENAI_CONFIG)))
    data = _external_data(model, graph.parent, root, follow_symlinks, frozenset(forbidden))
    entries = _walk(folder, follow_symlinks) if folder is not None else []
    return ModelSource(graph, folder, config, model, data, entries)


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
    obsolete: list[pathlib.Path] = dataclasses.field(default_factory=list)
    """The replaced output's own data files, removed once the new one is in place."""


def _real(path: pathlib.Path) -> pathlib.Path:
    """``path`` with its folder resolved but not its last component."""
    return pathlib.Path(os.path.realpath(path.parent)) / path.name


def _is_within(path: pathlib.Path, folder: pathlib.Path) -> bool:
    return path == folder or folder in path.parents


def _data_names(out: pathlib.Path, locations: list[str]) -> dict[str, str]:
    """Free names for an output's own data files: ``OUT.data``, else ``OUT.2.data``, ...

    Several files become ``OUT-00001-of-00003.data`` style shards. Existing files are
    never reused, so a replaced output keeps working until the new one is committed.
    """
    if not locations:
        return {}
    for generation in range(1, 1000):
        base = out.name if generation == 1 else f"{out.name}.{generation}"
        if len(locations) == 1:
            names = [f"{base}.data"]
        else:
            n = len(locations)
            names = [f"{base}-{i:05d}-of-{n:05d}.data" for i in range(1, n + 1)]
        if not any(os.path.lexists(out.parent / name) for name in names):
            return dict(zip(locations, names))
    raise KvCacheError(f"No free name for the data files of {out}; clean up {out.parent}.")


def _locations(model_file: pathlib.Path) -> set[str] | None:
    """The data locations a model file names (graph only); None when it cannot be read."""
    import onnx

    try:
        proto = onnx.load(model_file, load_external_data=False)
    except Exception:  # protobuf raises several unrelated types
        return None
    return {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}


def _previous_own_data(out: pathlib.Path, inputs: set[pathlib.Path]) -> list[pathlib.Path]:
    """Data files of an output being replaced that no other model in its folder uses.

    Only files named as :func:`_data_names` names them count, and only when every
    other ``.onnx`` file there can be read and names none of them.
    """
    names = _locations(out) or set()
    family = re.compile(rf"{re.escape(out.name)}(\.\d+)?(-\d{{5}}-of-\d{{5}})?\.data")  # as _data_names
    own = {
        name
        for name in names
        if family.fullmatch(name)
        and (out.parent / name).is_file()
        and not (out.parent / name).is_symlink()
        and _real(out.parent / name) not in inputs
    }
    for other in out.parent.glob("*.onnx"):
        if not own or other.name == out.name:
            continue
        used = _locations(other)
        own = set() if used is None else own - used
    return [out.parent / name for name in sorted(own)]


def _plan(
    source: ModelSource,
    out_path: str | os.PathLike | None,
    *,
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
            raise KvCacheError(
                f"Output {out} is inside the input folder {source.folder}; choose another path."
            )
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
            if not overwrite:
                raise KvCacheError(f"Output {out} exists; pass overwrite=True to replace it.")
            if not ((out / GENAI_CONFIG).is_file() or any(out.glob("*.onnx"))):
                raise KvCacheError(
                    f"Output {out} exists and is not a model folder (no {GENAI_CONFIG}, no .onnx file); "
                    "refusing to remove it. Name another output folder."
                )
            if _is_within(pathlib.Path(os.path.realpath(os.getcwd())), out_real):
                raise KvCacheError(f"Output {out} contains the current folder; refusing to replace it.")
            plan.replace = True
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
        raise KvCacheError(
            f"Output {out_path} is a folder; the input is one model file, so name the output file "
            f"(e.g. {out / source.graph.name})."
        )
    if out.suffix != ".onnx":
        raise KvCacheError(f"Output {out} must be a .onnx file name (e.g. {out.with_suffix('.onnx').name}).")
    beside = pathlib.Path(os.path.realpath(out.parent)) == pathlib.Path(os.path.realpath(source.graph.parent))
    mode: Literal["share", "copy", "link"] = weights or ("share" if beside else "copy")
    plan = _Plan("beside" if beside else "elsewhere", out, mode)
    if os.path.lexists(out):
        if not overwrite:
            raise KvCacheError(f"Output {out} exists; pass overwrite=True to replace it.")
        if not out.is_file():
            raise KvCacheError(f"Output {out} is not a regular file; refusing to replace it.")
        plan.replace = True
        plan.obsolete = _previous_own_data(out, inputs)
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


def _genai_config_for(config: dict[str, Any], ep: str) -> dict[str, Any]:
    """A copy of ``config`` for a quantized cache on ``ep``: past/present share a buffer
    only where the capability table says so (CUDA)."""
    config = json.loads(json.dumps(config))
    config.setdefault("search", {})["past_present_share_buffer"] = get_capabilities(ep).share_buffer
    return config


def _config_bytes(config: dict[str, Any]) -> bytes:
    return (json.dumps(config, indent=4, ensure_ascii=False) + "\n").encode("utf-8")


def _in_place_graph_name(graph: pathlib.Path, fmt: str) -> pathlib.Path:
    """A new, unused name for an in-place graph whose genai_config changes too."""
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
            return f"weights: shared with {name} (0 bytes)"
        if self.weights == "cloned":
            return f"weights: cloned {size} (0 bytes written)"
        if self.weights == "linked":
            return f"weights: hard-linked {size} (0 bytes written); onnx and onnx-ir refuse both models"
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
    its own copy) or hard-linked (``"link"``: onnx and onnx-ir then refuse both models).

    ``ep`` is where the model will run. ``"auto"`` (default) infers it
    (:func:`~onnx_kvcache.capabilities.infer_target`: a genai folder's provider, ``cpu``
    when its config names none; a model file's dtype, float32 -> ``cpu``, fp16/bf16 -> ``cuda``).
    When the target cannot run the result nothing is written and the result says why
    (``strict`` raises instead). ``None`` skips gating (e.g. to evaluate fp8 numerics of
    a float32 model through emulation). A model without GroupQueryAttention is first
    fused (onnxscript); without any after fusion it is not converted. A genai folder's
    ``search.past_present_share_buffer`` follows the target. ``granularity`` defaults
    to the scales' own, else per tensor; ``format`` to the format the scales were made for
    (their ``format``, else their ``qmax``), else fp8. ``follow_symlinks`` accepts input files that
    link out of the model's folder (Hugging Face cache snapshots); their content is
    copied. ``progress``: a progress bar for copies (default: on a terminal).
    """
    scales = as_kv_cache_scales(scales)
    fmt = get_format(format or (scales.implied_format if scales is not None else None) or "fp8")
    scales = as_kv_cache_scales(scales, format=fmt.name)
    if granularity is None:
        granularity = scales.granularity if scales is not None else "per_tensor"
    if weights not in (None, "copy", "link"):
        raise KvCacheError(f"weights must be 'copy' or 'link' (or None), got {weights!r}.")
    source = open_model_source(in_path, follow_symlinks=follow_symlinks)
    plan = _plan(source, out_path, in_place=in_place, overwrite=overwrite, weights=weights)
    file_io.check_writable_folder(plan.out.parent if plan.placement != "in-place" else source.graph.parent)
    if plan.placement == "in-place" and source.config_path is not None:
        file_io.check_writable_folder(source.config_path.parent)

    model = source.model
    result = ConvertResult(plan.out, source.graph, 0, granularity, fmt.name, placement=plan.placement)
    refusal = None
    if not find_attention_sites(model, with_cache_only=False):
        fusion = GqaFusionPass()  # ours read no weights; onnxscript's run only when ours fuse nothing
        fusion(model)
        result.fused = fusion.fused
        if fusion.refused:
            left = "; ".join(fusion.refused)
            refusal = (
                f"attention fusion fused {fusion.fused} layer(s) but left {len(fusion.refused)} "
                f"unfused ({left}); running, calibrating and evaluating need every cache in "
                "GroupQueryAttention, so nothing was converted."
                if fusion.fused
                else f"attention fusion found {len(fusion.refused)} attention(s) it cannot prove "
                f"equivalent to GroupQueryAttention ({left}): nothing to convert."
            )
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
        return result
    if ep == "auto":
        target, why = infer_target(model, source.config)
        result.target_source = f"assumed: {why}"
    elif ep is not None:
        target, result.target_source = ep.lower(), "given"
    result.target = target if ep is not None else None
    if ep is not None:
        reasons = _gate(model, target, fmt.name, granularity, check_device)
        if reasons:
            result.converted = False
            result.reasons = reasons
            if strict:
                raise KvCacheError(
                    f"KV cache not converted to {fmt.name} {granularity} for {target}: " + " ".join(reasons)
                )
            return result
    optimize_model(
        model,
        execution_provider=None,
        kv_cache_format=fmt.name,
        kv_cache_granularity=granularity,
        kv_cache_scales=scales,
        shared_kv_scale=shared_kv_scale,
        fuse_attention=False,
    )
    for site in find_attention_sites(model):
        if site.cache_format is not None:
            result.ops[site.op.op_type] = result.ops.get(site.op.op_type, 0) + 1
    result.nodes = sum(result.ops.values())
    for warning in conversion_warnings(model, fmt.name, result.target):
        warnings.warn(warning, KvCacheWarning, stacklevel=2)
    cpu_runs_it = all(get_capabilities("cpu", s.op).has_kernel for s in find_attention_sites(model))
    share_target = result.target or ("cuda" if fmt.name == "fp8" or not cpu_runs_it else "cpu")
    new_config = None
    if source.config is not None:
        new_config = _genai_config_for(source.config, share_target)
        if new_config == source.config:
            new_config = None
    data = _serialize(model, plan.data_names)
    result.weight_bytes = sum(d.size for d in source.data.values())
    if plan.weights == "link":
        warnings.warn(LINK_WARNING, KvCacheWarning, stacklevel=2)
    linked = [d.path.name for d in source.data.values() if d.real.stat().st_nlink > 1]
    if linked and plan.weights != "link":
        warnings.warn(
            f"the input's data file(s) {', '.join(linked)} have more than one hard link (an earlier "
            "weights='link'?): onnx and onnx-ir refuse them until the other link is deleted.",
            KvCacheWarning,
            stacklevel=2,
        )

    if plan.placement == "in-place":
        _write_in_place(source, data, new_config, fmt.name, result)
    elif plan.placement == "folder":
        _write_folder(source, plan, data, new_config, result, progress)
    else:
        _write_file(source, plan, data, result, progress)
    return result


def _gate(model: ir.Model, target: str, fmt: str, granularity: str, check_device: bool) -> list[str]:
    """Every reason ``target`` cannot run the converted model (the capability table)."""
    from onnx_kvcache.device import cuda_compute_capability

    capability = cuda_compute_capability() if check_device else None
    report = check_kv_cache_support(model, target, fmt, granularity, compute_capability=capability)
    reasons = list(report.reasons)
    if check_device and capability is None and report.ep == "cuda":
        reasons.append("check_device: no CUDA GPU found on this machine.")
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
    if config is None or source.config_path is None:
        file_io.atomic_write_bytes(graph, data, like=graph.stat())
        result.model_file, result.bytes_written = graph, len(data)
        return
    # Both files change: the new graph takes a new name, and replacing genai_config.json
    # (which names it) is the one commit. Only then is the old graph removed.
    new_graph = _in_place_graph_name(graph, fmt)
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
        f"search.past_present_share_buffer is {str(config['search']['past_present_share_buffer']).lower()}."
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


def _write_file(
    source: ModelSource, plan: _Plan, data: bytes, result: ConvertResult, progress: bool | None
) -> None:
    """A model file beside the input or in another folder, with its own data if asked."""
    out = plan.out
    result.model_file = out
    created = file_io.make_dirs(out.parent)
    try:
        file_io.sweep_stale(out.parent)
        with file_io.TempDir(out.parent) as tmp:
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
                        staged.append((tmp.path / str(i), out.parent / name, False))
                finally:
                    copier.close()
                result.weights = "cloned" if copier.cloned else "copied"
                result.weight_bytes_written = copier.written
            file_io.write_new_file(tmp.path / "graph", data)
            file_io.publish_as_one(
                out.parent, staged, tmp.path / "graph", out, replace=plan.replace, remove_after=plan.obsolete
            )
        if plan.obsolete:
            names = ", ".join(p.name for p in plan.obsolete)
            result.notes.append(
                f"replaced the previous {out.name} and removed its own data file(s): {names}."
            )
        result.data_files = sorted(plan.data_names.values()) if plan.data_names else sorted(source.data)
        result.bytes_written = len(data) + result.weight_bytes_written
    except BaseException:
        if not os.path.lexists(out):
            file_io.remove_empty_dirs(created)
        raise


def _write_folder(
    source: ModelSource,
    plan: _Plan,
    data: bytes,
    config: dict[str, Any] | None,
    result: ConvertResult,
    progress: bool | None,
) -> None:
    """Build the whole output folder under a temporary name, then rename it into place."""
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
    try:
        file_io.sweep_stale(out.parent)
        to_copy = [
            e
            for e in source.entries
            if e.real is not None
            and e.rel not in (rel_graph, rel_config)
            and not (plan.weights == "link" and e.rel in data_rel)
        ]
        copier = _Copier([e.real for e in to_copy if e.real is not None], out.parent, progress)
        written = len(data)
        with file_io.TempDir(out.parent) as tmp:
            try:
                for entry in source.entries:
                    dst = tmp.path / entry.rel
                    if entry.real is None:
                        os.mkdir(dst, 0o777)
                    elif entry.rel == rel_graph:
                        file_io.write_new_file(dst, data)
                    elif entry.rel == rel_config and config is not None:
                        config_data = _config_bytes(config)
                        file_io.write_new_file(dst, config_data)
                        written += len(config_data)
                    elif plan.weights == "link" and entry.rel in data_rel:
                        os.link(entry.real, dst, follow_symlinks=True)
                    else:
                        n = copier.copy(entry.real, dst)
                        written += n
                        if entry.rel in data_rel:
                            result.weight_bytes_written += n
            finally:
                copier.close()
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
    if plan.replace:
        result.notes.append(f"replaced the previous folder {out}.")
    if config is not None:
        result.notes.append(
            f"{GENAI_CONFIG}: search.past_present_share_buffer is "
            f"{str(config['search']['past_present_share_buffer']).lower()}."
        )
