"""What a previous output of onnx-kvcache is, so that ``overwrite`` replaces nothing else.

Every model :func:`~onnx_kvcache.convert_model` writes carries a ``metadata_props`` entry
:data:`MARKER_KEY` whose value is a JSON object: the library ``version``, ``format``,
``granularity`` and ``placement`` (``beside``, ``elsewhere``, ``folder`` or ``in-place``),
the data files the conversion created for the output (``data``) and, for a folder, every
entry it wrote there (``entries``). The rules:

* A **file** may be replaced when it is a regular file whose graph carries the marker of a
  conversion to a new file (``beside`` or ``elsewhere``). Replacing it removes the data
  files its marker names that its graph names too, when they are regular files of its
  folder (not links), none of the input's, and named by no other ``.onnx`` file there
  that can be read. A ``.onnx`` file that cannot be parsed loads in no tool, so it uses
  no data file.
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
    "marker",
    "own_data_files",
]

import json
import os
import pathlib
from collections.abc import Iterable
from typing import Any

from onnx_kvcache._version import __version__
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.genai_folder import resolve_model_path

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
) -> str:
    """The marker's value for a model written by a conversion (``target``: the provider it
    was gated on, None when gating was skipped)."""
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
    return json.dumps(doc, separators=(",", ":"))


def converted_for(metadata: dict[str, str]) -> str | None:
    """The provider a conversion gated the model on, from its marker (None: not recorded)."""
    try:
        target = json.loads(metadata.get(MARKER_KEY, "{}")).get("target")
    except (ValueError, AttributeError):
        return None
    return target if isinstance(target, str) else None


def _graph(model_file: pathlib.Path) -> Any:
    """The file's ModelProto without external data; None when it is not one."""
    import onnx

    try:
        return onnx.load(model_file, load_external_data=False)
    except Exception:  # protobuf raises several unrelated types
        return None


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
            f"Output {out} is part of the converted folder {out.parent}; replacing the model file alone "
            f"would leave that folder inconsistent. Convert into the folder instead, or {_FIX}"
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


def own_data_files(out: pathlib.Path, doc: dict[str, Any], inputs: set[pathlib.Path]) -> list[pathlib.Path]:
    """The data files a replaced output file owns and no other model in its folder uses."""
    proto = _graph(out)
    named = _locations(proto) if proto is not None else set()
    data = doc.get("data")
    own = {
        name
        for name in (data if isinstance(data, list) else [])
        if isinstance(name, str)
        and name in named
        and "/" not in name
        and os.sep not in name
        and (out.parent / name).is_file()
        and not (out.parent / name).is_symlink()
        and pathlib.Path(os.path.realpath(out.parent / name)) not in inputs
    }
    for other in sorted(out.parent.glob("*.onnx")):
        if not own:
            break
        if other.name == out.name or not other.is_file():
            continue
        proto = _graph(other)
        if proto is not None:  # a file no parser reads loads in no tool: it uses nothing
            own -= _locations(proto)
    return [out.parent / name for name in sorted(own)]


def _locations(proto: Any) -> set[str]:
    """Every external data location a ModelProto names (graphs, nodes, functions)."""
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
    return {e.value for t in tensors for e in t.external_data if e.key == "location"}
