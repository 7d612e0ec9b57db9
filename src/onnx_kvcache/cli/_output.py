"""What the command prints, and how printing fails: every line goes through :func:`_print`.

A path or message is printed as one inert line (control characters escaped, so a file name
holding a newline or a terminal escape cannot forge or colour output); stderr takes what it
can (``2>/dev/full`` drops the line); a failed stdout is told apart from a failed file
(:class:`_StdoutFailed`), since a closed pipe (``| head``) is the reader's choice and a full
disk lost output. The standard streams are reserved before anything opens a file.

Standard library only (and the package's stdlib-only name of its temporary entries): the
command imports this before onnx-ir.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any

from onnx_kvcache.model_io import TEMP_PREFIX

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _printable(text: str, *, lines: bool = False) -> str:
    """``text`` with every control character escaped (``\\n``, ``\\x1b``): a path holding a
    newline or a terminal escape prints as one inert line. ``lines``: keep newlines."""

    def escape(match: re.Match[str]) -> str:
        char = match[0]
        return char if lines and char == "\n" else char.encode("unicode_escape").decode("ascii")

    return _CONTROL.sub(escape, text)


def _print(*values: object, file: Any = None, flush: bool = False) -> None:
    """Print as :func:`print` does, control characters escaped (:func:`_printable`); on stderr
    (errors, warnings) a message is one line, so newlines too."""
    stream = sys.stdout if file is None else file
    text = _printable(" ".join(map(str, values)), lines=stream is not sys.stderr)
    try:
        print(text, file=stream, flush=flush)
    except OSError as e:
        if stream is sys.stdout:
            raise _StdoutFailed(e) from e
        raise


def _say(line: str) -> None:
    """One line on stderr; a stderr that cannot take it (``2>/dev/full``) drops it."""
    with contextlib.suppress(OSError, ValueError):
        _print(line, file=sys.stderr, flush=True)


_STREAMS = ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w"))


def _reserve_standard_streams() -> None:
    """A closed stdin, stdout or stderr (``>&-``) becomes /dev/null: otherwise the first file
    the command opens takes its number, and whatever prints there (onnxruntime's own logging
    included) writes into that file; and Python's ``sys.stdout`` is None. A stream that
    cannot print a path that is not UTF-8 (strict errors) prints its bytes escaped."""
    for fd, name, mode in _STREAMS:
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:
            stream = open(fd, mode, closefd=False, encoding="utf-8", errors="surrogateescape")  # noqa: SIM115
            setattr(sys, name, stream)  # for the process's life
        stream = getattr(sys, name)
        if fd and getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def _silence_stdout() -> None:
    """After a broken pipe: send further output (and the exit-time flush) nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _describe_os_error(e: OSError) -> str:
    """``strerror: path -> path2``, leaving out the package's own temporary entries (an internal
    name of no use to anyone: the other path, or the error alone, says what failed)."""
    text = e.strerror or str(e)
    names = [n for n in (e.filename, e.filename2) if n is not None and not _temporary(n)]
    return f"{text}: {' -> '.join(map(str, names))}" if names else text


def _temporary(name: object) -> bool:
    """Whether ``name`` is, or lies inside, a temporary entry of the package."""
    path = os.fsdecode(name) if isinstance(name, (str, bytes, os.PathLike)) else str(name)
    return any(part.startswith(TEMP_PREFIX) for part in path.split(os.sep))


class _StdoutFailed(Exception):
    """Writing standard output failed (``error``): told apart from a file's failure."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except OSError as e:
        raise _StdoutFailed(e) from e
