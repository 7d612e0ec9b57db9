"""What a previous output of onnx-kvcache is, so that ``overwrite`` replaces nothing else.

Every model :func:`~onnx_kvcache.convert_model` writes carries a ``metadata_props`` entry
:data:`MARKER_KEY` whose value is a JSON object: the library ``version``, ``format``,
``granularity`` and ``placement`` (``beside``, ``elsewhere``, ``folder`` or ``in-place``),
the data files the conversion created for the output (``data``) and, for a folder, every
entry it wrote there (``entries``). The rules:

* A **file** may be replaced when it is a regular file whose graph carries the marker of a
  conversion to a new file (``beside`` or ``elsewhere``). Replacing it removes the data
  files its marker names that its graph names too, when they are regular files of its
  folder (not links), none of the input's, and no other file there could be a graph
  naming them (:func:`possible_users`: any name, links followed; a file protobuf cannot
  parse, or over 2 GiB, loads in no tool); the ones kept are reported.
* A **folder** may be replaced when its model (``genai_config.json``'s decoder, else its
  one ``.onnx`` file) carries the marker of a folder conversion and every entry in the
  folder is one that conversion wrote (no symbolic link, nothing added since).
* An **in-place** conversion's model is never replaced: it is the user's only copy.

Markers are read from the graph alone (``onnx.load`` without external data): no weight
is read.
"""

from __future__ import annotations

__all__ = [
    "MARKER_KEY",
    "check_replaceable_file",
    "check_replaceable_folder",
    "converted_for",
    "is_model_file",
    "is_output_folder",
    "marker",
    "own_data_files",
    "possible_users",
]

import json
import math
import os
import pathlib
import stat
from collections.abc import Iterable
from typing import Any

from onnx_kvcache._version import __version__
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.model_io._atomic import TEMP_PREFIX
from onnx_kvcache.model_io.genai_folder import resolve_model_path

MARKER_KEY = "onnx_kvcache.converted"
_FILE_PLACEMENTS = ("beside", "elsewhere")
_FIX = "remove it yourself or choose another output path."


def marker(
    fmt: str,
    granularity: str,
    placement: str,
    data: Iterable[str] = (),
    entries: Iterable[str] = (),
    target: str | None = None,
    method: str | None = None,
) -> str:
    """The marker's value for a model written by a conversion (``target``: the provider it
    was gated on, None when gating was skipped; ``method``: the calibration method of its
    scales, when known)."""
    doc: dict[str, Any] = {
        "version": __version__,
        "format": fmt,
        "granularity": granularity,
        "placement": placement,
        "target": target,
        "data": sorted(data),
    }
    if placement == "folder":
        doc["entries"] = sorted(entries)
    if method is not None:
        doc["method"] = method
    return json.dumps(doc, separators=(",", ":"))


def converted_for(metadata: dict[str, str]) -> str | None:
    """The provider a conversion gated the model on, from its marker (None: not recorded)."""
    return _recorded(metadata, "target")


def calibrated_by(metadata: dict[str, str]) -> str | None:
    """The calibration method of a converted model's scales, from its marker (None: unknown)."""
    return _recorded(metadata, "method")


def _recorded(metadata: dict[str, str], key: str) -> str | None:
    try:
        value = json.loads(metadata.get(MARKER_KEY, "{}")).get(key)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _graph(model_file: pathlib.Path) -> Any:
    """The file's ModelProto without external data; None when it is not one."""
    import onnx

    try:
        return onnx.load(model_file, format="protobuf", load_external_data=False)  # whatever its name
    except Exception:  # protobuf raises several unrelated types
        return None


_MODEL_SUFFIXES = (".onnx", ".ort")


def is_model_file(path: pathlib.Path) -> bool:
    """Whether a regular file is an ONNX model: named ``*.onnx``/``*.ort`` (any case), or a
    graph protobuf parses (checked from field headers first, so other files are not read)."""
    if path.suffix.lower() in _MODEL_SUFFIXES:
        return True
    try:
        if os.path.getsize(path) > GRAPH_SIZE_LIMIT:
            return False
        with open(path, "rb") as f:
            if _is_ort_format(f):
                return True
            if not _is_wire_format(f):
                return False
    except OSError:
        return False
    proto = _graph(path)
    return proto is not None and bool(proto.graph.node or proto.graph.initializer)


def _read(model_file: pathlib.Path) -> tuple[dict[str, Any] | None, str]:
    """The marker of a model file; else None and what the file is instead (``has no ...``)."""
    proto = _graph(model_file)
    if proto is None:
        return None, "is not a readable ONNX model"
    value = next((p.value for p in proto.metadata_props if p.key == MARKER_KEY), None)
    if value is None:
        return None, f"has no {MARKER_KEY} metadata"
    try:
        doc = json.loads(value)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("placement"), str):
        return None, f"has {MARKER_KEY} metadata that onnx-kvcache did not write"
    return doc, ""


def _refuse_in_place(out: pathlib.Path, doc: dict[str, Any]) -> None:
    if doc["placement"] == "in-place":
        raise KvCacheError(
            f"Output {out} was converted in place by onnx-kvcache: it is the only copy of that model, "
            f"so it is never replaced; {_FIX}"
        )


def check_replaceable_file(out: pathlib.Path) -> dict[str, Any]:
    """The marker of an existing output file that may be replaced; else one clear error."""
    doc, why = _read(out)
    if doc is None:
        raise KvCacheError(f"Output {out} exists and is not an output of onnx-kvcache (it {why}); {_FIX}")
    _refuse_in_place(out, doc)
    if doc["placement"] not in _FILE_PLACEMENTS:
        raise KvCacheError(
            f"Output {out} is the model of {out.parent}, a folder onnx-kvcache converted; replacing "
            "that file alone would leave the folder inconsistent. Choose another output path, or "
            f"replace the whole folder by converting a model folder into {out.parent}."
        )
    return doc


def check_replaceable_folder(out: pathlib.Path) -> None:
    """Refuse to replace an existing folder unless it is wholly a previous folder output."""
    try:
        model_file, _ = resolve_model_path(out)
    except KvCacheError:
        raise KvCacheError(
            f"Output {out} exists and is not an output of onnx-kvcache (no genai_config.json naming a "
            f"model, and not one .onnx file); {_FIX}"
        ) from None
    name = model_file.relative_to(out).as_posix()
    doc, why = _read(model_file)
    if doc is None:
        raise KvCacheError(
            f"Output {out} exists and is not an output of onnx-kvcache (its model {name} {why}); {_FIX}"
        )
    _refuse_in_place(out, doc)
    if doc["placement"] != "folder" or not isinstance(doc.get("entries"), list):
        raise KvCacheError(
            f"Output {out} holds a model onnx-kvcache converted ({name}) but was not converted as a "
            f"folder (placement {doc['placement']!r}), so it may hold files of yours; {_FIX}"
        )
    written = set(doc["entries"])
    foreign = []
    for dirpath, dirnames, filenames in os.walk(out):
        here = pathlib.Path(dirpath)
        for entry in sorted(dirnames) + sorted(filenames):
            rel = (here / entry).relative_to(out).as_posix()
            if rel not in written or (here / entry).is_symlink():
                foreign.append(rel)
        dirnames[:] = [d for d in dirnames if d in written and not (here / d).is_symlink()]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise KvCacheError(
            f"Output {out} holds {shown}, which the conversion that wrote it did not write; move "
            "that out of the folder, or choose another output path."
        )


def is_output_folder(folder: pathlib.Path) -> bool:
    """Whether ``folder``'s model carries the marker of a folder conversion (never raises)."""
    try:
        model_file, _ = resolve_model_path(folder)
    except (KvCacheError, OSError, ValueError):
        return False
    doc, _ = _read(model_file)
    return doc is not None and doc.get("placement") == "folder"


def own_data_files(
    out: pathlib.Path, doc: dict[str, Any], inputs: set[pathlib.Path]
) -> tuple[list[pathlib.Path], list[str]]:
    """The data files a replaced output file owns and nothing else in its folder may use,
    and a note for each one kept because something may (``kept NAME: FILE names it``)."""
    proto = _graph(out)
    extents = _extents(proto) if proto is not None else {}
    data = doc.get("data")
    own = {
        name
        for name in (data if isinstance(data, list) else [])
        if isinstance(name, str)
        and name in extents
        and "/" not in name
        and os.sep not in name
        and (out.parent / name).is_file()
        and not (out.parent / name).is_symlink()
        and pathlib.Path(os.path.realpath(out.parent / name)) not in inputs
    }
    notes = []
    for name in sorted(own):  # a marker names a file; the graph's own tensors must be what it holds
        size, end = (out.parent / name).stat().st_size, extents[name]
        if not end <= size <= end + _SLACK:
            own.discard(name)
            notes.append(f"kept {name}: {size} bytes, but the graph's tensors in it span {end}")
    users = possible_users(out.parent, own, skip={pathlib.Path(os.path.realpath(out))}) if own else {}
    for name, files in sorted(users.items()):
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        notes.append(f"kept {name}: {shown} {'names' if len(files) == 1 else 'name'} it")
    return [out.parent / name for name in sorted(own - set(users))], notes


GRAPH_SIZE_LIMIT = 2**31 - 1
"""The largest file protobuf parses: onnx and onnxruntime refuse a larger model file
(``Protobuf parsing failed``), so such a file is no graph and is never read."""
_MAX_FIELDS = 100_000
"""Top-level protobuf fields walked before a file is taken for a possible graph anyway."""
_CHUNK = 8 * 2**20


def possible_users(folder: pathlib.Path, names: set[str], skip: set[pathlib.Path]) -> dict[str, list[str]]:
    """For each of ``names`` (data files of ``folder``), the files there that could be a graph
    naming it: the files ``users[name]`` (absent: nothing there can use it).

    A graph names its data relative to its own folder, and onnx and onnxruntime refuse a
    location that leaves it, so only this folder is searched (a graph in a folder above
    naming ``sub/NAME`` is not), but all of it, whatever the
    names (``model.onnx.bak`` and ``backup.ONNX`` load like ``model.onnx``), links to
    files included, except ``skip`` (resolved paths) and our temporary entries. A file may
    be such a graph when it is at most :data:`GRAPH_SIZE_LIMIT` bytes, is protobuf's wire
    format at its top level (or onnxruntime's ORT format), and holds the name's bytes
    (ASCII letters in any case, as a case-insensitive file system resolves them):
    protobuf stores strings as they are. The wire-format check reads only field headers,
    so a weights file (which fails it within a few bytes) is not read through. A file that
    cannot be read may be such a graph.
    """
    wanted = {name: name.encode("utf-8").lower() for name in names}
    users: dict[str, list[str]] = {}
    for entry in sorted(os.listdir(folder)):
        path = folder / entry
        if entry.startswith(TEMP_PREFIX) or pathlib.Path(os.path.realpath(path)) in skip:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue  # a broken link: nothing to load
        if not stat.S_ISREG(st.st_mode) or st.st_size > GRAPH_SIZE_LIMIT:
            continue
        try:
            found, shown = _names_in(path, wanted), entry
        except OSError as e:  # it may be a graph naming any of them
            found, shown = set(wanted.values()), f"{entry} (unreadable: {e.strerror})"
        for name, needle in wanted.items():
            if needle in found:
                users.setdefault(name, []).append(shown)
    return users


def _names_in(path: pathlib.Path, wanted: dict[str, bytes]) -> set[bytes]:
    """Which of the (lowercase) byte strings ``wanted`` a possible graph at ``path`` holds."""
    needles = set(wanted.values())
    with open(path, "rb") as f:
        if not _is_wire_format(f) and not _is_ort_format(f):
            return set()
        f.seek(0)
        found: set[bytes] = set()
        overlap = max(map(len, needles)) - 1
        tail = b""
        while needles - found and (block := f.read(_CHUNK)):
            window = tail + block.lower()
            found |= {n for n in needles if n in window}
            tail = window[-overlap:] if overlap else b""
        return found


def _is_ort_format(f: Any) -> bool:
    f.seek(4)
    return bool(f.read(4) == b"ORTM")  # the flatbuffer file identifier of onnxruntime's format


def _varint(f: Any) -> int | None:
    value = 0
    for shift in range(0, 70, 7):
        byte = f.read(1)
        if not byte:
            return None
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
    return None


def _is_wire_format(f: Any) -> bool:
    """Whether the whole file is a sequence of well-formed protobuf fields (groups matched),
    reading only their headers: a necessary condition for any protobuf parser to accept it."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    groups: list[int] = []
    for _ in range(_MAX_FIELDS):
        if f.tell() == size:
            return not groups
        tag = _varint(f)
        if tag is None or tag >> 3 == 0:
            return False
        wire = tag & 7
        if wire == 0:
            if _varint(f) is None:
                return False
        elif wire in (1, 5):
            f.seek(8 if wire == 1 else 4, os.SEEK_CUR)
        elif wire == 2:
            length = _varint(f)
            if length is None:
                return False
            f.seek(length, os.SEEK_CUR)
        elif wire == 3:
            groups.append(tag >> 3)
        elif wire == 4:
            if not groups or groups.pop() != tag >> 3:
                return False
        else:
            return False
        if f.tell() > size:
            return False
    return True  # too many fields to walk: it may be one


_SLACK = 2**16
"""Bytes a data file may hold past its last tensor (a writer's alignment) and still be the
graph's own; anything else is not removed with the graph."""


def _extents(proto: Any) -> dict[str, int]:
    """Each external data location a ModelProto names, and the byte its tensors end at."""
    import onnx

    ends: dict[str, int] = {}
    for tensor in _external_tensors(proto):
        info = {e.key: e.value for e in tensor.external_data}
        try:
            offset = int(info.get("offset", 0))
            if "length" in info:
                length = int(info["length"])
            else:
                itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
                length = itemsize * math.prod(tensor.dims)
        except (ValueError, TypeError, KeyError):
            length, offset = 2**62, 0  # unreadable: spans more than any file, so kept
        location = info.get("location", "")
        ends[location] = max(ends.get(location, 0), offset + length)
    return ends


def _external_tensors(proto: Any) -> list[Any]:
    """Every tensor of a ModelProto with external data (graphs, nodes, functions)."""
    graphs = [proto.graph]
    tensors = []

    def of_node(node: Any) -> None:
        for attr in node.attribute:
            if attr.HasField("t"):
                tensors.append(attr.t)
            tensors.extend(attr.tensors)
            if attr.HasField("g"):
                graphs.append(attr.g)
            graphs.extend(attr.graphs)

    for function in proto.functions:
        for node in function.node:
            of_node(node)
    for graph in graphs:  # grows while walked
        tensors.extend(graph.initializer)
        for sparse in graph.sparse_initializer:
            tensors += [sparse.values, sparse.indices]
        for node in graph.node:
            of_node(node)
    return [t for t in tensors if t.external_data]
