"""Checks of the paths the writers and readers are given, before any work.

A path a model file names (relative, no ``..``), where a file's bytes really are (a symbolic
link out of the model's folder needs ``follow_symlinks``), a folder we can write in, and
whether a path is a mount point (never replaced by a rename).
"""

from __future__ import annotations

import errno
import os
import pathlib
import re
import tempfile
from typing import Any

from onnx_kvcache.errors import KvCacheError, Param


def _nearest_existing(path: pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(os.path.abspath(path))
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


def check_writable_folder(folder: os.PathLike | str) -> None:
    """Refuse, before any work, a folder (or the ancestor that would hold it) we cannot write."""
    base = _nearest_existing(pathlib.Path(folder))
    if not base.is_dir():
        raise KvCacheError(f"{base} is not a folder, so nothing can be written in {os.path.abspath(folder)}.")
    if not os.access(base, os.W_OK | os.X_OK):
        read_only = hasattr(os, "statvfs") and os.statvfs(base).f_flag & getattr(os, "ST_RDONLY", 1)
        why = "the file system is read-only" if read_only else "permission denied"
        raise KvCacheError(f"Cannot write in {base} ({why}).")
    _probe(base)


#: The name a probe file starts with (removed at once; see :func:`_probe`).
PROBE_PREFIX = ".onnx-kvcache-probe-"


def _probe(base: pathlib.Path) -> None:
    """Create and remove an empty file in ``base``: ``os.access`` says yes to root everywhere,
    and a pseudo file system (sysfs, procfs) or an immutable folder refuses only the write."""
    try:
        fd, name = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=base)
    except OSError as e:  # ENOENT from a folder that exists: procfs takes no new files
        why = "it takes no new files" if e.errno == errno.ENOENT else (e.strerror or type(e).__name__).lower()
        raise KvCacheError(f"Cannot write in {base} ({why}).") from None
    os.close(fd)
    os.unlink(name)


def is_mount_point(path: os.PathLike | str) -> bool:
    """Whether ``path`` (a file or folder, not followed if a link) is a mount point: on
    another device than its folder, or listed in ``/proc/self/mountinfo`` (bind mounts)."""
    path = pathlib.Path(os.path.abspath(path))
    try:
        if os.lstat(path).st_dev != os.stat(path.parent).st_dev or os.path.ismount(path):
            return True
    except OSError:
        return False
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            points = {line.split(" ")[4] for line in f if line.count(" ") >= 4}
    except OSError:
        return False
    real = os.path.join(os.path.realpath(path.parent), path.name)
    decoded = {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), p) for p in points}
    return real in decoded


def check_relative(location: Any, what: str, folder: pathlib.Path) -> str:
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


def check_inside(path: pathlib.Path, root: pathlib.Path, follow_symlinks: bool) -> pathlib.Path:
    """Where ``path``'s bytes are; a symbolic link out of ``root`` needs ``follow_symlinks``."""
    real = pathlib.Path(os.path.realpath(path))
    root_real = pathlib.Path(os.path.realpath(root))
    if real == root_real or root_real in real.parents or follow_symlinks:
        return real
    link = _first_escaping_link(pathlib.Path(os.path.abspath(path)), pathlib.Path(os.path.abspath(root)))
    follow = Param("follow_symlinks", True)
    hint = (
        (
            "This looks like a Hugging Face cache snapshot (files linking into ../../blobs/): pass ",
            follow,
            " to accept the links; a conversion elsewhere then copies their content.",
        )
        if _looks_like_hf_snapshot(root)
        else (
            "Copy the file into the folder, or pass ",
            follow,
            " to accept links (a conversion elsewhere copies their content).",
        )
    )
    raise KvCacheError(f"{link} is a symbolic link to {real}, outside the model's folder {root}. ", *hint)
