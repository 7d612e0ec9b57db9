"""Safe output files: temporary names, one-rename publication, clone-or-copy, cleanup.

The module the writers use (``from onnx_kvcache.model_io import _atomic as file_io``): it also
keeps the names of :mod:`._paths` (path checks), :mod:`._copying` (clone-or-copy of data
files) and :mod:`._os` (open flags, ``fcntl``, libc), which hold those ideas.

Rules every writer in the package follows:

* Output is written under a temporary name that starts with :data:`TEMP_PREFIX`, in the
  folder of its final name, fsynced, then published by one rename. New files and folders
  are created with mode 0o666 / 0o777, so the umask decides (0644 / 0755 under 022); a
  file that replaces one in place takes the old file's mode and owner (``like=``), and an
  output that replaces a previous one takes its mode, and its owner and group where we may
  set them (:func:`keep_mode_and_owner`, ``TempDir(like=)``), while a ``flock`` on the old
  one (:func:`locked_output`) keeps a second run from replacing it at the same time.
* A temporary entry belongs to the process holding an exclusive ``flock`` on it.
  :func:`sweep_stale` removes entries of this kind only, and only when no live process
  holds their lock (PIDs get reused; locks die with their process).
* Renames that must look like one (data files, then the graph that names them; a new
  graph, then the genai_config naming it) go through :func:`publish_as_one`: a journal is
  written first, the last rename is the commit, and a later sweep finishes or undoes a
  run killed between. An existing empty folder is filled the same way
  (:func:`publish_into_empty`), never replaced.
* :func:`copy_file` clones where the filesystem can (``FICLONE`` on Linux btrfs/XFS,
  ``clonefile`` on macOS), else copies data extents only (``SEEK_DATA``/``SEEK_HOLE``), so
  sparse files stay sparse; ``copy_file_range`` moves the bytes inside the kernel.
* :func:`signal_handlers` turns SIGTERM and SIGHUP into :class:`Interrupted` (a
  ``KeyboardInterrupt``) so that cleanup runs as for Ctrl-C; :func:`uninterrupted`
  defers them over a commit (both live in :mod:`onnx_kvcache._signals`).

Setting the environment variable ``ONNX_KVCACHE_PLAIN_COPY=1`` disables cloning and
``copy_file_range`` (read/write only, holes still kept); it exists for tests of the
copy path on filesystems that clone.
"""

from __future__ import annotations

__all__ = [
    "PLAIN_COPY_ENV",
    "TEMP_PREFIX",
    "close_temporary_entries",
    "CopyStats",
    "Interrupted",
    "TempDir",
    "TempFile",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_inside",
    "check_relative",
    "check_writable_folder",
    "allocated_bytes",
    "clone_file",
    "copy_data",
    "copy_file",
    "file_identity",
    "format_bytes",
    "free_bytes",
    "fsync_dir",
    "is_mount_point",
    "keep_mode_and_owner",
    "locked_output",
    "make_dirs",
    "publish_as_one",
    "publish_into_empty",
    "remove_empty_dirs",
    "rename_exchange",
    "rename_noreplace",
    "signal_handlers",
    "sweep_stale",
    "uninterrupted",
    "write_new_file",
]

import contextlib
import ctypes
import errno
import json
import os
import pathlib
import secrets
import shutil
import stat
import sys
from collections.abc import Iterable, Iterator
from typing import Any, Literal, TypeVar

from onnx_kvcache._signals import Interrupted, signal_handlers, uninterrupted
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.model_io._copying import (
    PLAIN_COPY_ENV,
    CopyStats,
    allocated_bytes,
    clone_file,
    copy_data,
    free_bytes,
)
from onnx_kvcache.model_io._os import _LIBC, _O_CLOEXEC, _O_DIRECTORY, _O_NOFOLLOW, fcntl
from onnx_kvcache.model_io._paths import (
    check_inside,
    check_relative,
    check_writable_folder,
    is_mount_point,
)

TEMP_PREFIX = ".onnx-kvcache-tmp-"
"""Every temporary entry this package creates starts with this."""
_JOURNAL = ".journal"


_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def format_bytes(n: float, unit: Literal["KiB", "MiB", "GiB", "TiB"] | None = None) -> str:
    """``2.3 GiB``, ``512 KiB``, ``0 bytes``; in ``unit``, with one decimal, when given
    (``0.5 MiB``: figures a line compares)."""
    if unit is not None:
        return f"{n / _UNITS[unit]:.1f} {unit}"
    if n < 1024:
        return f"{int(n)} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
    raise AssertionError("unreachable")


# -- low-level helpers ------------------------------------------------------------------


def _renameat2(src: os.PathLike | str, dst: os.PathLike | str, flags: int) -> bool:
    """Linux ``renameat2``/macOS ``renamex_np`` with ``flags``; False when unsupported."""
    if _LIBC is None:
        return False
    s, d = os.fsencode(src), os.fsencode(dst)
    if sys.platform == "linux":
        fn = getattr(_LIBC, "renameat2", None)
        if fn is None:
            return False
        result = fn(-100, s, -100, d, ctypes.c_uint(flags))  # AT_FDCWD
    else:
        fn = getattr(_LIBC, "renamex_np", None)
        if fn is None:
            return False
        result = fn(s, d, ctypes.c_uint({1: 0x4, 2: 0x2}[flags]))  # RENAME_EXCL, RENAME_SWAP
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))


def rename_noreplace(src: os.PathLike | str, dst: os.PathLike | str) -> None:
    """Rename ``src`` to ``dst``; ``FileExistsError`` if ``dst`` exists, never replaced."""
    if _renameat2(src, dst, 1):
        return
    if os.path.isdir(src) and not os.path.islink(src):
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst))
        os.rename(src, dst)
        return
    os.link(src, dst)  # fails if dst exists
    os.unlink(src)


def rename_exchange(a: os.PathLike | str, b: os.PathLike | str) -> bool:
    """Swap two names atomically; False when the platform or filesystem cannot."""
    return _renameat2(a, b, 2)


def fsync_dir(path: os.PathLike | str) -> None:
    """Make renames in ``path`` durable (no-op where directories cannot be opened)."""
    if not _O_DIRECTORY:
        return
    try:
        fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


Identity = tuple[int, int, int, int]
"""(device, inode, size, mtime_ns): which file, and that nobody rewrote it."""


def file_identity(path: os.PathLike | str | int) -> Identity | None:
    """The identity of a path (not following a final symlink) or an fd; None if absent."""
    try:
        st = os.fstat(path) if isinstance(path, int) else os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _same_inode(path: pathlib.Path, fd: int) -> bool:
    try:
        a, b = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _lock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)


def _try_lock(fd: int) -> bool:
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _temp_name(suffix: str = "") -> str:
    return f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}{suffix}"


def _keep_mode_and_owner(
    fd: int, like: os.stat_result, path: pathlib.Path, *, owner_required: bool = True
) -> None:
    """Give the entry open at ``fd`` the permission bits, owner and group of ``like``.

    The owner first: changing it clears set-user/group-ID bits. ``owner_required``: an
    owner or group we may not set is an error; otherwise the group is still tried alone
    (any group we are in), then left as it is.
    """
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) != (like.st_uid, like.st_gid) and hasattr(os, "fchown"):
        try:
            os.fchown(fd, like.st_uid, like.st_gid)
        except PermissionError:
            if owner_required:
                raise KvCacheError(
                    f"Cannot keep the owner {like.st_uid}:{like.st_gid} of the file replaced in place "
                    f"(in {path.parent}); run as that user (or root), or convert to another path."
                ) from None
            if st.st_gid != like.st_gid:
                with contextlib.suppress(PermissionError):
                    os.fchown(fd, -1, like.st_gid)
    os.fchmod(fd, stat.S_IMODE(like.st_mode))


def keep_mode_and_owner(path: os.PathLike | str, like: os.stat_result) -> None:
    """Give a new entry of ours (file or folder, not a link) ``like``'s mode, and its owner
    and group where we may set them."""
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
    try:
        _keep_mode_and_owner(fd, like, pathlib.Path(path), owner_required=False)
    finally:
        os.close(fd)


# -- temporary entries ------------------------------------------------------------------


_Entry = TypeVar("_Entry", bound="_TempEntry")
_LIVE: set[_TempEntry] = set()
"""Open temporary entries; :func:`close_temporary_entries` removes what a signal left."""


def close_temporary_entries() -> None:
    """Close (and so remove, unless published) every temporary entry still open.

    The command's last step: a signal between creating an entry and the block that
    closes it (a ``with`` not yet entered) leaves it open, and ``os._exit`` runs no
    finalizer.
    """
    for entry in list(_LIVE):
        with contextlib.suppress(OSError):
            entry.close()


class _TempEntry:
    """A new entry under a temporary name, locked until :meth:`close`; removed at close
    unless published. Subclasses say how to open one and how to remove it."""

    kind = "entry"

    def __init__(self, folder: os.PathLike | str, suffix: str = "") -> None:
        folder = pathlib.Path(folder)
        self.fd = -1
        self.published: pathlib.Path | None = None
        try:
            with uninterrupted():  # a signal is raised once the entry is ours to remove
                for _ in range(20):
                    self.path = folder / _temp_name(suffix)
                    self.fd = self._open(self.path)  # ours from here: close() removes it
                    _lock(self.fd)
                    if _same_inode(self.path, self.fd):  # not removed by a sweep between create and lock
                        break
                    os.close(self.fd)
                    self.fd = -1
                else:
                    raise OSError(errno.EAGAIN, f"cannot create a temporary {self.kind}", os.fspath(folder))
                _LIVE.add(self)
        except BaseException:
            self.close()
            raise

    def _open(self, path: pathlib.Path) -> int:
        raise NotImplementedError

    def _remove(self) -> None:
        raise NotImplementedError

    def _published_at(self, target: pathlib.Path) -> None:
        self.published = target
        fsync_dir(target.parent)

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            if self.published is None and _same_inode(self.path, self.fd):
                self._remove()
        finally:
            os.close(self.fd)
            self.fd = -1
            _LIVE.discard(self)

    def __enter__(self: _Entry) -> _Entry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TempFile(_TempEntry):
    """A new file under a temporary name in ``folder``, locked until :meth:`close`.

    Unless published, closing removes it. ``like``: give it that file's mode and owner.
    """

    kind = "file"

    def __init__(self, folder: os.PathLike | str, suffix: str = "", *, like: os.stat_result | None = None):
        super().__init__(folder, suffix)
        try:
            if like is not None:
                _keep_mode_and_owner(self.fd, like, self.path)
        except BaseException:
            self.close()
            raise

    def _open(self, path: pathlib.Path) -> int:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW, 0o666)

    def _remove(self) -> None:
        self.path.unlink()

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        return len(data)

    def publish(self, target: os.PathLike | str, *, replace: bool = False) -> None:
        """fsync, then rename to ``target`` (replacing it only when ``replace``)."""
        target = pathlib.Path(target)
        os.fsync(self.fd)
        if replace:
            os.replace(self.path, target)
        else:
            rename_noreplace(self.path, target)
        self._published_at(target)


class TempDir(_TempEntry):
    """A new folder under a temporary name in ``parent``, locked until :meth:`close`.

    Unless published, closing removes it and everything in it. ``like``: give it that
    folder's mode (set-group-ID included, so what is created in it takes its group) and,
    where we may, its owner and group.
    """

    kind = "folder"

    def __init__(self, parent: os.PathLike | str, *, like: os.stat_result | None = None):
        super().__init__(parent)
        try:
            if like is not None:
                _keep_mode_and_owner(self.fd, like, self.path, owner_required=False)
        except BaseException:
            self.close()
            raise

    def _open(self, path: pathlib.Path) -> int:
        os.mkdir(path, 0o777)
        return os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC | _O_NOFOLLOW)

    def _remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def publish(self, target: os.PathLike | str, *, replace: bool = False) -> None:
        """Rename to ``target``; with ``replace``, swap with an existing ``target`` and remove it.

        The swap is one atomic exchange where the platform has one (Linux, macOS);
        elsewhere the old folder is renamed away first.
        """
        target = pathlib.Path(target)
        for root, dirs, _files in os.walk(self.path):
            for d in dirs:
                fsync_dir(os.path.join(root, d))
        fsync_dir(self.path)
        if replace and os.path.lexists(target):
            if rename_exchange(self.path, target):
                self._published_at(target)
                shutil.rmtree(self.path, ignore_errors=True)  # the old folder, under our name
                return
            old = target.parent / _temp_name()
            os.rename(target, old)
            try:
                os.rename(self.path, target)
            except BaseException:
                os.rename(old, target)
                raise
            self._published_at(target)
            shutil.rmtree(old, ignore_errors=True)
            return
        rename_noreplace(self.path, target)
        self._published_at(target)


def write_new_file(
    path: os.PathLike | str, data: bytes, *, like: os.stat_result | None = None, owner_required: bool = True
) -> None:
    """Create ``path`` (which must not exist) with ``data``, fsynced; umask mode unless ``like``
    (its mode and owner; ``owner_required=False``: its owner and group only where we may)."""
    path = pathlib.Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW, 0o666)
    try:
        if like is not None:
            _keep_mode_and_owner(fd, like, path, owner_required=owner_required)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_as_one(
    folder: os.PathLike | str,
    staged: list[tuple[pathlib.Path, pathlib.Path, bool]],
    commit_src: pathlib.Path,
    commit_target: pathlib.Path,
    *,
    replace: bool,
    remove_after: Iterable[pathlib.Path] = (),
    dirs: Iterable[pathlib.Path] = (),
    expect: Identity | None = None,
) -> None:
    """Several renames in ``folder`` that appear as one: the last is the commit.

    ``dirs``: new folders (parents first) created before anything is published. ``staged``:
    (source, final name, hard link?) published next, never replacing anything; then
    ``commit_src`` is renamed to ``commit_target`` (the commit point); then ``remove_after``
    (files the commit made obsolete) are removed. A journal written before the first
    change lets a later :func:`sweep_stale` undo the staged names and remove the new
    folders while empty (commit not made), or finish the removals (commit made) after a
    kill; every removal checks the file's identity first (one already gone is skipped).
    ``expect``: the identity ``commit_target`` must still have (it was checked against
    it), else nothing is done. Sources must be fsynced.
    """
    folder = pathlib.Path(folder)
    dirs = list(dirs)

    def rel(p: pathlib.Path) -> str:
        r = os.path.relpath(p, folder)
        if r.startswith(".."):
            raise ValueError(f"{p} is not inside {folder}")
        return r

    def ident(p: pathlib.Path) -> Identity:
        result = file_identity(os.path.realpath(p))
        if result is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(p))
        return result

    if expect is not None and file_identity(commit_target) != expect:
        raise KvCacheError(
            f"{commit_target} changed while this run was writing (another conversion?); nothing was "
            "written. Run again to replace what is there now."
        )
    gone = {p for p in remove_after if file_identity(os.path.realpath(p)) is None}  # removed meanwhile
    doc = {
        "kind": "onnx-kvcache journal",
        "dirs": [rel(d) for d in dirs],
        "created": [[rel(final), list(ident(src))] for src, final, _ in staged],
        "commit": [rel(commit_target), list(ident(commit_src)), _as_list(file_identity(commit_target))],
        "remove_after": [[rel(p), list(ident(p))] for p in remove_after if p not in gone],
    }
    made: list[str] = []
    with TempFile(folder, _JOURNAL) as journal:
        journal.write(json.dumps(doc).encode())
        os.fsync(journal.fd)
        fsync_dir(folder)
        try:
            for d in dirs:
                os.mkdir(d, 0o777)
                made.append(rel(d))
            for src, final, link in staged:
                if link:
                    os.link(src, final, follow_symlinks=True)
                else:
                    rename_noreplace(src, final)
            for parent in {final.parent for _, final, _ in staged} | {d.parent for d in dirs}:
                fsync_dir(parent)
            with uninterrupted(completes=True):
                if replace:
                    os.replace(commit_src, commit_target)
                else:
                    rename_noreplace(commit_src, commit_target)
                fsync_dir(commit_target.parent)
                with contextlib.suppress(OSError):
                    _replay(folder, doc, committed=True)
        except BaseException:
            doc["dirs"] = made  # a folder that was there already is not ours to remove
            with uninterrupted():
                _settle(folder, doc)
            raise


def publish_into_empty(tmp: TempDir, folder: pathlib.Path, commit: pathlib.PurePosixPath) -> None:
    """Move everything ``tmp`` holds into ``folder``, an empty folder that holds ``tmp``.

    Renaming a complete folder over an empty one is atomic too (rename(2) allows it), but it
    replaces the user's folder itself: its mode, owner, ACLs and attributes, a shell's
    working directory in it, and it fails on a mount point, the usual reason to create an
    output folder first. So the folder is filled instead, as :func:`publish_as_one`
    publishes: its subfolders are created, every file is renamed in under its final name
    (model files last), never replacing anything, and the rename of
    ``commit`` (genai_config.json, else the model file: what a loader opens) is the commit.
    A run stopped before it leaves the folder empty again: at once after Ctrl-C or SIGTERM,
    at the next run's :func:`sweep_stale` after SIGKILL. The folder must hold nothing but
    ``tmp`` when publishing starts; a file that appears meanwhile is never replaced.
    """
    others = sorted(n for n in os.listdir(folder) if n != tmp.path.name)
    if others:
        raise KvCacheError(
            f"Output {folder} is no longer empty ({', '.join(others[:3])} appeared while converting); "
            "nothing was written. Choose another output path, or empty it and run again."
        )
    dirs, files = [], []
    for dirpath, dirnames, filenames in os.walk(tmp.path):
        here = pathlib.Path(dirpath)
        dirs += [folder / (here / d).relative_to(tmp.path) for d in sorted(dirnames)]
        files += [(here / f).relative_to(tmp.path) for f in sorted(filenames)]
    fsync_dir(tmp.path)
    last = [f for f in files if f.as_posix() != commit.as_posix() and f.suffix == ".onnx"]
    staged = [f for f in files if f.as_posix() != commit.as_posix() and f not in last] + last
    publish_as_one(
        folder,
        [(tmp.path / f, folder / f, False) for f in staged],
        tmp.path / commit,
        folder / commit,
        replace=False,
        dirs=dirs,
    )


def _as_list(identity: Identity | None) -> list[int] | None:
    return list(identity) if identity is not None else None


def _journal_path(folder: pathlib.Path, rel: Any) -> pathlib.Path:
    p = pathlib.PurePath(str(rel))
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ValueError(f"bad journal path {rel!r}")
    return folder / p


def _replay(folder: pathlib.Path, doc: dict[str, Any], committed: bool) -> None:
    steps = doc["remove_after"] if committed else doc["created"]
    for rel, ident in steps:
        path = _journal_path(folder, rel)
        if file_identity(path) == tuple(ident):
            path.unlink()
    if not committed:
        for rel in reversed(doc.get("dirs", [])):
            with contextlib.suppress(OSError):  # not empty: something not ours is in it
                _journal_path(folder, rel).rmdir()
    fsync_dir(folder)


def _settle(folder: pathlib.Path, doc: dict[str, Any]) -> None:
    """Finish (commit made) or undo (commit not made) a journal; else touch nothing."""
    commit, new, old = doc["commit"]
    state = file_identity(_journal_path(folder, commit))
    if state == tuple(new):
        _replay(folder, doc, committed=True)
    elif state == (tuple(old) if old else None):
        _replay(folder, doc, committed=False)
    # anything else: the folder changed since; leave it alone


def _recover(folder: pathlib.Path, journal: pathlib.Path) -> None:
    """Settle a killed run's journal."""
    try:
        doc = json.loads(journal.read_text(encoding="utf-8"))
        _settle(folder, doc)
    except (ValueError, KeyError, TypeError):
        return  # written only partly: nothing was published yet


def sweep_stale(folder: os.PathLike | str) -> list[str]:
    """Remove this package's temporary entries in ``folder`` that no live process owns.

    A stale journal is settled first (see :func:`publish_as_one`). Returns the names removed.
    Without ``flock`` (Windows) nothing can be proven stale and nothing is removed.
    """
    folder = pathlib.Path(folder)
    if fcntl is None:
        return []
    try:
        entries = sorted(
            (e for e in os.scandir(folder) if e.name.startswith(TEMP_PREFIX)),
            key=lambda e: not e.name.endswith(_JOURNAL),  # journals first
        )
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for entry in entries:
        path = folder / entry.name
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            if not is_dir and not entry.is_file(follow_symlinks=False):
                continue  # never ours (a symlink, a device, ...)
            flags = os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW | (_O_DIRECTORY if is_dir else 0)
            fd = os.open(path, flags)
        except OSError:
            continue
        try:
            if not _try_lock(fd) or not _same_inode(path, fd):
                continue  # a live process owns it
            if entry.name.endswith(_JOURNAL):
                _recover(folder, path)
            if is_dir:
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(entry.name)
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        fsync_dir(folder)
    return removed


# -- copying: the choice here (tests replace either way), the ways in _copying ----------


def copy_file(src: os.PathLike | str, dst: os.PathLike | str, *, progress: Any = None) -> CopyStats:
    """Create ``dst`` (which must not exist) with ``src``'s content: a clone, else a copy.

    ``progress``: a tqdm-like object updated with bytes processed.
    """
    size = os.path.getsize(src)
    if clone_file(src, dst):
        if progress is not None:
            progress.update(size)
        return CopyStats(size, 0, True)
    return CopyStats(size, copy_data(src, dst, progress=progress), False)


# -- folders and single files -----------------------------------------------------------


def make_dirs(folder: pathlib.Path) -> list[pathlib.Path]:
    """Create ``folder`` and missing parents (umask mode); the ones created, outermost first."""
    created: list[pathlib.Path] = []
    missing = []
    p = pathlib.Path(os.path.abspath(folder))
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o777)
        except FileExistsError:
            continue
        created.append(d)
    return created


@contextlib.contextmanager
def locked_output(path: pathlib.Path, identity: Identity) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the existing output ``path`` while it is replaced, after
    checking that it is still the file or folder seen as ``identity``.

    Two runs replacing the same output: the second stops here, before copying anything,
    with one clear error (and a run that starts once the first is done sees its output).
    """
    changed = KvCacheError(
        f"Output {path} changed since this run checked it (another conversion?); nothing was written. "
        "Run again to replace what is there now."
    )
    if fcntl is None:  # Windows: no flock (nor folders to open); the identity check only
        if file_identity(path) != identity:
            raise changed
        yield
        return
    try:
        folder = stat.S_ISDIR(os.lstat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW | (_O_DIRECTORY if folder else 0))
    except FileNotFoundError:
        raise changed from None
    try:
        if not _try_lock(fd):
            raise KvCacheError(
                f"Output {path} is being replaced by another run of onnx-kvcache; nothing was written. "
                "Wait for it to finish, or choose another output path."
            )
        if file_identity(fd) != identity or file_identity(path) != identity:
            raise changed
        yield
    finally:
        os.close(fd)


def remove_empty_dirs(created: list[pathlib.Path]) -> None:
    """Undo :func:`make_dirs` where the folders are still empty."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return


def atomic_write_bytes(target: os.PathLike | str, data: bytes, *, like: os.stat_result | None = None) -> None:
    """Write ``target`` through a temporary file, fsync and one rename.

    Missing parent folders are created (and removed again on failure). ``like``: keep
    that file's mode and owner; otherwise the umask decides.
    """
    target = pathlib.Path(target)
    created = make_dirs(target.parent)
    try:
        sweep_stale(target.parent)
        with TempFile(target.parent, like=like) as tmp:
            tmp.write(data)
            with uninterrupted(completes=True):
                tmp.publish(target, replace=True)
    except BaseException:
        if not os.path.lexists(target):
            remove_empty_dirs(created)
        raise


def atomic_write_text(target: os.PathLike | str, text: str) -> None:
    atomic_write_bytes(target, text.encode("utf-8"))
