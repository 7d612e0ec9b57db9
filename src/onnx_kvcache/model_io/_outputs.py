"""Every file onnx-kvcache writes besides a converted model: one rule, one writer.

Scale files (``calibrate --out``, :meth:`KvCacheScales.save`), reports (``evaluate
--json``), plots (``evaluate --plot``) and the demo's record (``demo --keep``) are written
by :func:`write_output` only (converted models follow the same rules in
:mod:`onnx_kvcache.files.conversion`, with their own marker, :mod:`onnx_kvcache.model_io._marker`):

* A **regular file**, written under a temporary name, fsynced and published by one
  rename (:mod:`onnx_kvcache.model_io._atomic`); never through a symbolic link, never over a
  folder, a link, a device, a FIFO or a socket, an ONNX model or one of the run's inputs.
* An existing file is replaced only when it is **one onnx-kvcache wrote**, as the file
  itself proves: a JSON file carries :data:`WRITTEN_KEY`, the SHA-256 of the rest of its
  content (a file edited since, e.g. a ``"note"`` added by hand, is the user's); a PNG
  carries a ``tEXt`` chunk of that name with the SHA-256 of its other chunks. Anything
  else needs ``overwrite=True`` (``--overwrite``), and the refusal says so.
* Before any long work, :func:`check_output` runs the same checks (and that the folder
  is writable, and the name's suffix is one the kind can be written as); the writer
  checks again, then holds a lock on a file it replaces while it publishes.

A demo folder (``demo --keep DIR``) holds :data:`DEMO_RECORD`, a JSON file of this kind
listing the SHA-256 of every file the demo wrote there: :func:`check_demo_folder`
accepts a new or empty folder, or one whose every entry the record lists unchanged.
"""

from __future__ import annotations

__all__ = [
    "CONVERTED",
    "DEMO_RECORD",
    "OUTPUT_KINDS",
    "WRITTEN_KEY",
    "OutputKind",
    "check_demo_folder",
    "check_output",
    "record_demo_folder",
    "same_output",
    "stamp_json",
    "stamp_png",
    "write_output",
    "write_outputs",
]

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import stat
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from onnx_kvcache._version import __version__
from onnx_kvcache.errors import KvCacheError, Param, require_type
from onnx_kvcache.model_io import _atomic as file_io
from onnx_kvcache.model_io._marker import check_replaceable_file, is_model_file, possible_users

WRITTEN_KEY = "onnx_kvcache.written"
"""The JSON key (and PNG ``tEXt`` keyword) proving onnx-kvcache wrote a file."""
DEMO_RECORD = "onnx-kvcache-demo.json"
"""The file in a ``demo --keep`` folder that lists what the demo wrote there."""
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_MAX_OWN_SIZE = 64 * 2**20
"""A larger file is no output of ours (none is this large), so it is never read whole."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _record(kind: str, digest: str) -> dict[str, str]:
    return {"kind": kind, "version": __version__, "sha256": digest}


def stamp_json(doc: dict[str, Any], kind: str) -> bytes:
    """``doc`` as indented JSON text carrying :data:`WRITTEN_KEY`: ``kind`` (a key of
    :data:`OUTPUT_KINDS`), our version and the digest of the rest."""
    rest = {k: v for k, v in doc.items() if k != WRITTEN_KEY}
    stamped = {**rest, WRITTEN_KEY: _record(kind, _digest(_canonical(rest)))}
    return (json.dumps(stamped, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _small_file(path: pathlib.Path) -> bytes | None:
    """The bytes of a regular file (never a link) of at most :data:`_MAX_OWN_SIZE`; else None."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_OWN_SIZE:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(_MAX_OWN_SIZE + 1)
    finally:
        os.close(fd)


def _json_written_by_us(path: pathlib.Path, kind: str) -> str | None:
    """None when ``path`` is a JSON file of ``kind`` onnx-kvcache wrote, unchanged; else why not."""
    data = _small_file(path)
    if data is None or data[:1].lstrip() not in (b"{", b""):
        return "it is not a JSON object"
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return "it is not valid JSON"
    if not isinstance(doc, dict):
        return "it is not a JSON object"
    mark = doc.pop(WRITTEN_KEY, None)
    if not isinstance(mark, dict):
        return f"it has no {WRITTEN_KEY!r} record"
    return _check_record(mark, kind, _digest(_canonical(doc)))


def _check_record(mark: Any, kind: str, digest: str) -> str | None:
    if not isinstance(mark, dict) or mark.get("sha256") != digest:
        return "it was edited since onnx-kvcache wrote it"
    if mark.get("kind") != kind:
        other = OUTPUT_KINDS.get(str(mark.get("kind")))
        return f"onnx-kvcache wrote it as a {other.what if other else 'file of another kind'}"
    return None


def _png_chunks(data: bytes) -> Iterator[tuple[bytes, bytes, bytes]]:
    """(type, data, whole chunk) of every chunk; ValueError when ``data`` is no PNG."""
    if not data.startswith(_PNG_SIGNATURE):
        raise ValueError("not a PNG")
    pos = len(_PNG_SIGNATURE)
    while pos < len(data):
        if pos + 12 > len(data):
            raise ValueError("truncated PNG")
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        end = pos + 12 + length
        if end > len(data):
            raise ValueError("truncated PNG")
        yield data[pos + 4 : pos + 8], data[pos + 8 : end - 4], data[pos:end]
        pos = end


def _our_text(kind: bytes, body: bytes) -> bool:
    return kind == b"tEXt" and body.startswith(WRITTEN_KEY.encode("latin-1") + b"\0")


def _png_rest(data: bytes) -> tuple[bytes, list[bytes]]:
    """The PNG without our ``tEXt`` chunk, and that chunk's texts."""
    kept, ours = [_PNG_SIGNATURE], []
    for kind, body, whole in _png_chunks(data):
        if _our_text(kind, body):
            ours.append(body.split(b"\0", 1)[1])
        else:
            kept.append(whole)
    return b"".join(kept), ours


def stamp_png(data: bytes) -> bytes:
    """``data`` (a PNG) with a ``tEXt`` chunk :data:`WRITTEN_KEY` before ``IEND``."""
    rest, _ = _png_rest(data)
    text = json.dumps(_record("plot", _digest(rest)), separators=(",", ":"))
    body = WRITTEN_KEY.encode("latin-1") + b"\0" + text.encode("latin-1")
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    end = rest.rindex(b"IEND") - 4  # the IEND chunk's length field
    return rest[:end] + chunk + rest[end:]


def _png_written_by_us(path: pathlib.Path, kind: str) -> str | None:
    data = _small_file(path)
    try:
        rest, texts = _png_rest(data or b"")
    except ValueError:
        return "it is not a PNG file"
    if not texts:
        return f"it has no {WRITTEN_KEY!r} text chunk"
    try:
        mark = json.loads(texts[0].decode("latin-1"))
    except ValueError:
        mark = None
    return _check_record(mark, kind, _digest(rest))


@dataclasses.dataclass(frozen=True)
class OutputKind:
    """A kind of output file: what to call it, the names it may have, how to tell ours."""

    what: str
    example: str
    suffixes: tuple[str, ...]
    """Suffixes (lower case) the name must end with; empty: any."""
    written_by_us: Callable[[pathlib.Path, str], str | None]
    """None for a file of this kind onnx-kvcache wrote (unchanged since); else why it is not one."""


OUTPUT_KINDS = {
    "scales": OutputKind("scale file", "scales.json", (), _json_written_by_us),
    "report": OutputKind("JSON report", "report.json", (), _json_written_by_us),
    "plot": OutputKind("PNG plot", "plot.png", (".png",), _png_written_by_us),
    "demo record": OutputKind("demo record", DEMO_RECORD, (), _json_written_by_us),
}


def _same(a: pathlib.Path, b: pathlib.Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return pathlib.Path(os.path.realpath(a)) == pathlib.Path(os.path.realpath(b))


def check_output(
    path: os.PathLike | str,
    kind: str,
    *,
    overwrite: bool = False,
    inputs: Iterable[os.PathLike | str] = (),
) -> file_io.Identity | None:
    """Refuse, before any work, an output ``path`` of ``kind`` (a key of :data:`OUTPUT_KINDS`)
    that must not be written; the identity of the file it would replace (None: a new file).

    ``inputs`` are files the run reads (an input model's every file): never replaced, even
    with ``overwrite``; nor is a file some graph in the output's folder names as its external
    data (:func:`onnx_kvcache.model_io._marker.possible_users`, the check ``convert`` makes)."""
    row = OUTPUT_KINDS[kind]
    require_type(path, (str, os.PathLike), f"The {row.what}'s path", "a path (str or os.PathLike)")
    require_type(overwrite, bool, "overwrite", "True or False")
    named = os.fspath(path)
    path = pathlib.Path(path)
    if isinstance(named, str) and named.endswith(("/", os.sep)):
        raise KvCacheError(
            f"{named} names a folder (it ends in {os.sep}); name the {row.what} to write "
            f"(e.g. {path / row.example})."
        )
    if row.suffixes and path.suffix.lower() not in row.suffixes:
        raise KvCacheError(
            f"{path}: a {row.what} is written as {' or '.join(row.suffixes)}; name one (e.g. {row.example})."
        )
    for p in inputs:
        if os.path.lexists(path) and _same(path, pathlib.Path(p)):
            raise KvCacheError(
                f"{path} is one of the input's files; write the {row.what} elsewhere (",
                Param("overwrite", True),
                " never replaces an input).",
            )
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # a missing or non-folder parent: said below
        st = None
    except OSError as e:
        raise KvCacheError(f"Cannot write the {row.what} {path}: {e.strerror}.") from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise KvCacheError(
                f"{path} is a symbolic link; a {row.what} is never written through one. Name another file."
            )
        if stat.S_ISDIR(st.st_mode):
            raise KvCacheError(
                f"{path} is a folder; name the {row.what} to write (e.g. {path}/{row.example})."
            )
        if not stat.S_ISREG(st.st_mode):
            raise KvCacheError(
                f"{path} is not a regular file (a device, FIFO or socket); refusing to replace it. "
                "Name another file."
            )
        if is_model_file(path):
            raise KvCacheError(f"{path} is an ONNX model; refusing to replace it. Name another file.")
        why = row.written_by_us(path, kind)
        if why is not None:
            users = possible_users(path.parent, {path.name}, skip={pathlib.Path(os.path.realpath(path))})
            if users:
                graphs = users[path.name]
                shown = ", ".join(graphs[:3]) + (f" and {len(graphs) - 3} more" if len(graphs) > 3 else "")
                raise KvCacheError(
                    f"{path} may be a model's external data ({shown} in its folder names it); "
                    f"refusing to replace it, even with overwrite. Write the {row.what} elsewhere."
                )
        if why is not None and not overwrite:
            raise KvCacheError(
                f"{path} exists and is not a {row.what} onnx-kvcache wrote ({why}); refusing to "
                "replace it. Name another file, or pass ",
                Param("overwrite", True),
                " to replace it.",
            )
    file_io.check_writable_folder(path.parent)  # a missing one: the ancestor that will hold it
    return None if st is None else file_io.file_identity(path)


def same_output(a: os.PathLike | str, b: os.PathLike | str) -> bool:
    """Whether two output paths name one file (through links to folders, ``.``, hard links)."""
    if os.path.lexists(a) and os.path.lexists(b) and _same(pathlib.Path(a), pathlib.Path(b)):
        return True
    return os.path.realpath(a) == os.path.realpath(b)


def write_output(
    path: os.PathLike | str,
    data: bytes,
    kind: str,
    *,
    overwrite: bool = False,
    inputs: Iterable[os.PathLike | str] = (),
) -> None:
    """Write ``data`` to ``path`` by the rules above (missing folders created)."""
    write_outputs([(path, data, kind)], overwrite=overwrite, inputs=inputs)


def write_outputs(
    files: Iterable[tuple[os.PathLike | str, bytes, str]],
    *,
    overwrite: bool = False,
    inputs: Iterable[os.PathLike | str] = (),
    seen: Sequence[file_io.Identity | None] | None = None,
) -> list[pathlib.Path]:
    """Write every ``(path, data, kind)`` by the rules above, as one unit: each is written
    to a temporary file first (where a full disk or a signal stops the run with nothing
    published), then all are published together, signals held; should a later publication
    fail, the new files published before it are removed again. The paths that replaced a
    file (as given).

    ``seen``: each output's identity when the run checked it before its work
    (:func:`check_output`); an output that appeared or changed since (another run to the same
    path finished first) is left as it is and the run refused, never replaced silently."""
    files = list(files)
    inputs = list(inputs)
    for i, (path, _, _) in enumerate(files):
        for other, _, _ in files[:i]:
            if same_output(path, other):
                raise KvCacheError(f"{other} and {path} name one file; name two files.")
    plans = []
    for i, (path, data, kind) in enumerate(files):
        identity = check_output(path, kind, overwrite=overwrite, inputs=inputs)
        if seen is not None and identity != seen[i]:
            raise KvCacheError(
                f"{path} was written by another run (to the same output?) while this one worked; it is "
                "left as it is and this run wrote nothing. Run again, or name another file."
            )
        plans.append((pathlib.Path(path), data, identity))
    created: list[pathlib.Path] = []
    try:
        return _write_planned(plans, created)
    except BaseException:
        file_io.remove_empty_dirs(created)  # what was created for a run that wrote nothing
        raise


def _write_planned(
    plans: list[tuple[pathlib.Path, bytes, file_io.Identity | None]], created: list[pathlib.Path]
) -> list[pathlib.Path]:
    """:func:`write_outputs` once checked: missing folders created (into ``created``), every file
    written to a temporary name, then all published together."""
    with contextlib.ExitStack() as stack:
        temps = []
        for path, data, identity in plans:
            created += file_io.make_dirs(path.parent)
            file_io.sweep_stale(path.parent)
            tmp = stack.enter_context(file_io.TempFile(path.parent))
            try:
                tmp.write(data)
                os.fsync(tmp.fd)
            except OSError as e:
                raise KvCacheError(f"Cannot write {path}: {e.strerror or e}; nothing was written.") from None
            if identity is not None:
                file_io.keep_mode_and_owner(tmp.path, os.lstat(path))
            temps.append(tmp)
        published: list[pathlib.Path] = []
        with file_io.uninterrupted(completes=True):
            try:
                for (path, _, identity), tmp in zip(plans, temps, strict=True):
                    _publish(tmp, path, identity)
                    if identity is None:
                        published.append(path)
            except BaseException:
                for done in published:
                    with contextlib.suppress(OSError):
                        os.unlink(done)
                raise
    return [path for path, _, identity in plans if identity is not None]


def _publish(tmp: file_io.TempFile, path: pathlib.Path, identity: file_io.Identity | None) -> None:
    if identity is None:
        try:
            tmp.publish(path)
        except FileExistsError:
            raise KvCacheError(
                f"{path} was created by something else while this run wrote it; nothing was "
                "replaced. Run again to decide about what is there now."
            ) from None
        return
    with file_io.locked_output(path, identity):
        tmp.publish(path, replace=True)


# -- demo folders -------------------------------------------------------------------


def _entries(folder: pathlib.Path) -> list[str]:
    return sorted(e for e in os.listdir(folder) if not e.startswith(file_io.TEMP_PREFIX))


CONVERTED = "converted"
"""A demo record's value for a model the demo is converting: any model a conversion to a new
file wrote (its ``onnx_kvcache.converted`` marker) is accepted under that name."""


def _listed_and_unchanged(path: pathlib.Path, value: Any) -> bool:
    if not path.is_file() or path.is_symlink():
        return False
    if value == CONVERTED:
        try:
            check_replaceable_file(path)
        except KvCacheError:
            return False
        return True
    return isinstance(value, str) and _digest(path.read_bytes()) == value


def check_demo_folder(folder: os.PathLike | str) -> None:
    """Refuse a ``keep`` folder that is neither new, nor empty, nor wholly a previous demo's."""
    folder = pathlib.Path(folder)
    if os.path.islink(folder):
        raise KvCacheError(f"{folder} is a symbolic link; the demo never writes through one. Name a folder.")
    if os.path.lexists(folder) and not folder.is_dir():
        raise KvCacheError(f"{folder} is not a folder; name a new or empty folder for the demo's models.")
    file_io.check_writable_folder(folder)
    if not folder.is_dir() or not (entries := _entries(folder)):
        return
    listed: dict[str, Any] = {}
    record = folder / DEMO_RECORD
    if DEMO_RECORD in entries and _json_written_by_us(record, "demo record") is None:
        listed = json.loads(record.read_text(encoding="utf-8")).get("entries", {})
    foreign = [
        e for e in entries if e != DEMO_RECORD and not _listed_and_unchanged(folder / e, listed.get(e))
    ]
    if DEMO_RECORD in entries and not listed:
        foreign.insert(0, DEMO_RECORD)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise KvCacheError(
            f"{folder} holds {shown}, which no earlier demo wrote (or changed since); the demo writes "
            "only into a new or empty folder, or one an earlier demo filled. Name another folder."
        )


def record_demo_folder(folder: os.PathLike | str, pending: Mapping[str, str] | None = None) -> None:
    """Write (or update) the folder's :data:`DEMO_RECORD`: the digest of every file in it, and
    ``pending``: files about to be written (their digest, or :data:`CONVERTED`), so that a
    demo stopped before its next record leaves a folder the next demo accepts."""
    folder = pathlib.Path(folder)
    entries = {
        e: _digest((folder / e).read_bytes())
        for e in _entries(folder)
        if e != DEMO_RECORD and (folder / e).is_file() and not (folder / e).is_symlink()
    }
    entries.update(pending or {})
    doc = {"written_by": "onnx-kvcache demo", "entries": entries}
    write_output(folder / DEMO_RECORD, stamp_json(doc, "demo record"), "demo record")
