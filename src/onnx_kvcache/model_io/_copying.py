"""Clone-or-copy of data files: a clone where the filesystem can, else the data extents only.

``FICLONE`` on Linux btrfs/XFS, ``clonefile`` on macOS; otherwise only the data extents are
copied (``SEEK_DATA``/``SEEK_HOLE``), so sparse files stay sparse, and ``copy_file_range``
moves the bytes inside the kernel. :data:`PLAIN_COPY_ENV` turns cloning and
``copy_file_range`` off. :func:`~._atomic.copy_file` chooses between :func:`clone_file` and
:func:`copy_data` (in :mod:`._atomic`, where tests replace either), and these are the sizes
a conversion checks against the free space.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

from onnx_kvcache.model_io._os import _LIBC, _O_CLOEXEC, _O_NOFOLLOW, fcntl

PLAIN_COPY_ENV = "ONNX_KVCACHE_PLAIN_COPY"
_FICLONE = 0x40049409
_CHUNK = 64 * 1024 * 1024


@dataclasses.dataclass
class CopyStats:
    """What :func:`copy_file` did: ``size`` bytes long, ``written`` bytes of data written."""

    size: int
    written: int
    cloned: bool


def _plain_copy_only() -> bool:
    return os.environ.get(PLAIN_COPY_ENV, "") not in ("", "0")


def _clone_fd(src_fd: int, dst_fd: int) -> bool:
    if sys.platform != "linux" or fcntl is None:
        return False
    try:
        fcntl.ioctl(dst_fd, _FICLONE, src_fd)
    except OSError:
        return False
    return True


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _clone_darwin(src: pathlib.Path, dst: pathlib.Path) -> bool:
    """macOS ``clonefile``: creates ``dst`` as a clone (then given the umask's mode)."""
    fn = getattr(_LIBC, "clonefile", None) if sys.platform == "darwin" else None
    if fn is None or fn(os.fsencode(src), os.fsencode(dst), ctypes.c_uint(0)) != 0:
        return False
    os.chmod(dst, 0o666 & ~_umask())
    return True


def _data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of every data extent; the whole file where holes cannot be found."""
    seek_data, seek_hole = getattr(os, "SEEK_DATA", None), getattr(os, "SEEK_HOLE", None)
    if seek_data is None or seek_hole is None:
        if size:
            yield 0, size
        return
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, seek_data)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole after pos
                return
            if e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                yield pos, size
                return
            raise
        end = min(os.lseek(fd, start, seek_hole), size)
        yield start, end
        pos = end


def _copy_extent(src_fd: int, dst_fd: int, start: int, end: int, progress: Any, kernel: list[bool]) -> None:
    pos = start
    while pos < end:
        n = min(_CHUNK, end - pos)
        done = 0
        if kernel[0]:
            try:
                done = os.copy_file_range(src_fd, dst_fd, n, pos, pos)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                kernel[0] = False
        if not kernel[0]:
            block = os.pread(src_fd, min(n, 8 * 1024 * 1024), pos)
            view = memoryview(block)
            offset = pos
            while view:
                w = os.pwrite(dst_fd, view, offset)
                view, offset = view[w:], offset + w
            done = len(block)
        if done == 0:
            raise OSError(errno.EIO, "source file shrank while being copied")
        pos += done
        if progress is not None:
            progress.update(done)


def clone_file(src: os.PathLike | str, dst: os.PathLike | str) -> bool:
    """Create ``dst`` as a clone of ``src`` (shared extents, no data written) if the filesystem can.

    Returns False, with ``dst`` not created, where it cannot (or with ``ONNX_KVCACHE_PLAIN_COPY``).
    """
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if _plain_copy_only():
        return False
    if _clone_darwin(src, dst):
        return True
    if sys.platform != "linux":
        return False
    with open(src, "rb") as f:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW, 0o666)
        cloned = False
        try:
            cloned = _clone_fd(f.fileno(), fd)
            if cloned:
                os.fsync(fd)
        finally:
            os.close(fd)
            if not cloned:
                os.unlink(dst)
    return cloned


def copy_data(src: os.PathLike | str, dst: os.PathLike | str, *, progress: Any = None) -> int:
    """Create ``dst`` with ``src``'s data extents (holes stay holes), fsynced; bytes written.

    ``copy_file_range`` moves the bytes inside the kernel where it can.
    """
    with open(src, "rb") as f:
        src_fd = f.fileno()
        size = os.fstat(src_fd).st_size
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW, 0o666)
        try:
            kernel = [hasattr(os, "copy_file_range") and not _plain_copy_only()]
            written = 0
            for start, end in _data_extents(src_fd, size):
                _copy_extent(src_fd, dst_fd, start, end, progress, kernel)
                written += end - start
            os.ftruncate(dst_fd, size)  # a trailing hole
            os.fsync(dst_fd)
        finally:
            os.close(dst_fd)
    if progress is not None:
        progress.update(size - written)
    return written


def allocated_bytes(path: os.PathLike | str) -> int:
    """Bytes ``path`` occupies on disk (less than its size when sparse)."""
    st = os.stat(path)
    blocks = getattr(st, "st_blocks", None)
    return min(st.st_size, blocks * 512) if blocks is not None else st.st_size


def free_bytes(folder: os.PathLike | str) -> int | None:
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize
