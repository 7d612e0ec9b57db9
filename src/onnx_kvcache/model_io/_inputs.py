"""Reading the files a user names: regular files only, bounded parsers, one-line errors.

Rules every reader of an input file (a model, ``genai_config.json``, a scale file, a text,
token-id or tokenizer file) follows:

* The path is classified before it is opened (:func:`check_input_file`): missing is a
  :class:`~onnx_kvcache.errors.KvCacheFileNotFoundError`; a folder, FIFO, socket,
  device, symbolic-link loop or dangling link is a :class:`~onnx_kvcache.errors.KvCacheError`
  that says which it is.
* It is opened with ``O_NONBLOCK`` and checked again on the open file
  (:func:`read_input_bytes`), so a FIFO put there after the check never blocks.
* JSON (:func:`load_json`) is UTF-8 and standard (no ``NaN``/``Infinity``), nested at most
  :data:`MAX_JSON_DEPTH` levels, its integers at most :data:`MAX_INT_DIGITS` digits.
* ``.npy`` (:func:`load_npy_integers`): the header is read and checked first (version 1 or
  2, no Python objects, an integer dtype, at most two dimensions, exactly as many data
  bytes as it declares), so a hostile or truncated file allocates nothing.

Every problem is one line that names the file.
"""

from __future__ import annotations

__all__ = [
    "shown_shape",
    "MAX_INT_DIGITS",
    "MAX_JSON_DEPTH",
    "check_input_file",
    "input_kind",
    "load_json",
    "load_npy_integers",
    "read_input_bytes",
    "read_input_chunks",
    "tokenizer_file",
]

import contextlib
import errno
import json
import math
import numbers
import os
import pathlib
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from onnx_kvcache.errors import KvCacheError, KvCacheFileNotFoundError

if TYPE_CHECKING:  # numpy is imported where a .npy file is read: the command checks paths first
    import numpy as np

MAX_JSON_DEPTH = 64
"""Nesting levels a JSON input may have (onnxruntime-genai's configs have 6)."""
MAX_INT_DIGITS = 30
"""Digits a JSON integer may have (2**64 has 20)."""

_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_MISSING = "missing"
_KINDS = {  # stat.S_IFMT -> what the path is
    stat.S_IFDIR: "a folder",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def shown_shape(shape: Any, limit: int = 8) -> str:
    """A shape for a message: at most ``limit`` dimensions shown, ``(1, 2, ... 1990 more, 5)``."""
    dims = [int(d) if isinstance(d, numbers.Integral) else d for d in tuple(shape)]  # numpy's too
    if len(dims) <= limit:
        return str(tuple(dims))
    head, tail = dims[: limit - 2], dims[-2:]
    return f"({', '.join(map(str, head))}, ... {len(dims) - limit} more, {', '.join(map(str, tail))})"


def input_kind(path: os.PathLike | str) -> str | None:
    """What ``path`` is when it is not a regular file (links followed); None for one.

    ``"missing"``, ``"a folder"``, ``"a FIFO (named pipe)"``, ``"a socket"``, ``"a character
    device"``, ``"a block device"``, ``"a symbolic link loop"``, ``"a broken symbolic link
    (to ...)"``, or why it cannot be examined.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return _MISSING
    except NotADirectoryError:
        return _MISSING
    except OSError as e:
        return "a symbolic link loop" if e.errno == errno.ELOOP else f"unreadable ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return f"a broken symbolic link (to {os.readlink(os.fspath(path))})"
        except OSError as e:
            return "a symbolic link loop" if e.errno == errno.ELOOP else f"unreadable ({e.strerror})"
    if stat.S_ISREG(st.st_mode):
        return None
    return _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")


def _refusal(
    path: os.PathLike | str, what: str, kind: str, expected: str, fix: str, missing: str
) -> KvCacheError:
    tail = f"; {fix}." if fix else "."
    if kind == _MISSING:
        return KvCacheFileNotFoundError(f"{what} {os.fspath(path)} {missing}{tail}")
    return KvCacheError(f"{what} {os.fspath(path)} is {kind}, not {expected}{tail}")


def check_input_file(
    path: os.PathLike | str,
    what: str,
    *,
    expected: str = "a regular file",
    fix: str = "",
    missing: str = "is missing",
) -> pathlib.Path:
    """``path``, after checking that it is a regular file (links followed); else one error:
    ``"{what} {path} {missing}; {fix}."`` or ``"{what} {path} is a FIFO (named pipe), not
    {expected}; {fix}."``."""
    kind = input_kind(path)
    if kind is not None:
        raise _refusal(path, what, kind, expected, fix, missing)
    return pathlib.Path(path)


#: What a tokenizer argument must name (``--tokenizer``, ``tokenizer=``): nothing is downloaded.
TOKENIZER_WANTED = "give a local tokenizer.json or a folder holding one"


def tokenizer_file(path: os.PathLike | str) -> pathlib.Path:
    """A tokenizer argument: a ``tokenizer.json`` file, or a folder holding one. Anything else
    is one error saying what is wanted; for a name that is no local path (a Hugging Face hub id
    such as ``meta-llama/Llama-3.2-1B``), that nothing is downloaded."""
    p = pathlib.Path(path)
    if p.is_dir():
        p, hub = p / "tokenizer.json", ""
    else:
        hub = " (hub ids are not downloaded)" if input_kind(p) == _MISSING else ""
    words = {"expected": "a tokenizer.json file", "missing": "does not exist"}
    return check_input_file(p, "Tokenizer", **words, fix=TOKENIZER_WANTED + hub)


@contextlib.contextmanager
def _open_input(path: os.PathLike | str, what: str, expected: str, fix: str) -> Iterator[BinaryIO]:
    """A regular file opened so that nothing can block (checked again once open)."""
    check_input_file(path, what, expected=expected, fix=fix)
    try:
        fd = os.open(path, os.O_RDONLY | _O_NONBLOCK | _O_CLOEXEC)
    except OSError as e:
        raise KvCacheError(f"{what} {os.fspath(path)} cannot be read ({e.strerror}).") from None
    with open(fd, "rb", closefd=True) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the check and the open
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise _refusal(path, what, kind, expected, fix, "")
        yield f


def read_input_bytes(
    path: os.PathLike | str,
    what: str,
    *,
    expected: str = "a regular file",
    fix: str = "",
    max_bytes: int | None = None,
) -> bytes:
    """The bytes of a regular file, opened so that nothing can block (checked again once open)."""
    with _open_input(path, what, expected, fix) as f:
        size = os.fstat(f.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise KvCacheError(
                f"{what} {os.fspath(path)} is {size} bytes, more than the {max_bytes} such a file "
                "can need; give the right file."
            )
        try:
            return f.read()
        except OSError as e:
            raise KvCacheError(f"{what} {os.fspath(path)} cannot be read ({e.strerror}).") from None


def read_input_chunks(
    path: os.PathLike | str, what: str, *, expected: str = "a regular file", chunk_bytes: int = 1 << 20
) -> Iterator[bytes]:
    """The bytes of a regular file (opened as :func:`read_input_bytes` opens it), ``chunk_bytes``
    at a time: a reader that stops early never holds the rest."""
    with _open_input(path, what, expected, "") as f:
        while True:
            try:
                chunk = f.read(chunk_bytes)
            except OSError as e:
                raise KvCacheError(f"{what} {os.fspath(path)} cannot be read ({e.strerror}).") from None
            if not chunk:
                return
            yield chunk


class _Refused(ValueError):
    """A JSON value outside the bounds (raised from the decoder's hooks)."""


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} are read)")
    return int(text)


def _parse_constant(text: str) -> Any:
    raise _Refused(f"{text}, which is not JSON (numbers must be finite)")


def _depth(value: Any) -> int:
    """How deeply ``value``'s lists and objects nest (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


def load_json(path: os.PathLike | str, what: str, *, fix: str = "", max_bytes: int | None = None) -> Any:
    """A JSON file's value, read within :data:`MAX_JSON_DEPTH` and :data:`MAX_INT_DIGITS`."""
    raw = read_input_bytes(path, what, expected="a JSON file", fix=fix, max_bytes=max_bytes)
    name = f"{what} {os.fspath(path)}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KvCacheError(f"{name}: not UTF-8 text (byte {e.start}); JSON files are UTF-8.") from None
    too_deep = KvCacheError(
        f"{name}: nested more than {MAX_JSON_DEPTH} levels deep (no such file needs that)."
    )
    try:  # the decoder is linear; past Python's recursion limit it stops with RecursionError
        value = json.loads(text, parse_int=_parse_int, parse_constant=_parse_constant)
    except _Refused as e:
        raise KvCacheError(f"{name}: {e}.") from None
    except json.JSONDecodeError as e:
        raise KvCacheError(f"{name}: not valid JSON ({e}).") from None
    except RecursionError:
        raise too_deep from None
    except ValueError as e:  # nothing known reaches here: kept one line
        raise KvCacheError(f"{name}: not readable JSON ({e}).") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise too_deep
    return value


def load_npy_integers(path: os.PathLike | str, what: str) -> np.ndarray:
    """A 1-D or 2-D integer array from a ``.npy`` file, its header checked before any data
    is read (Python objects, other dtypes, other ranks, truncated data are refused)."""
    import numpy as np

    name = f"{what} {os.fspath(path)}"
    raw = read_input_bytes(path, what, expected="a .npy file")
    if not raw:
        raise KvCacheError(f"{name}: empty (0 bytes), not a .npy array.")
    import io

    f = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"format version {version[0]}.{version[1]}, which token ids never need")
        reader = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = reader(f)
    except Exception as e:  # numpy's header parser raises ValueError, SyntaxError, TokenError, ...
        raise KvCacheError(f"{name}: not a readable .npy array ({type(e).__name__}: {e}).") from None
    if dtype.hasobject:
        raise KvCacheError(f"{name}: an array of Python objects; token ids are integers (save an int array).")
    if dtype.kind not in "iu":
        raise KvCacheError(f"{name}: a {dtype} array; token ids are integers (no floats, no records).")
    if len(shape) not in (1, 2):
        raise KvCacheError(
            f"{name}: a {len(shape)}-D array (shape {shown_shape(shape)}); token ids are a 1-D array "
            "or a 2-D "
            "array of sequences."
        )
    expected = math.prod(shape) * dtype.itemsize
    present = len(raw) - f.tell()
    if present != expected:
        problem = "truncated" if present < expected else "longer than its header says"
        raise KvCacheError(
            f"{name}: {problem}: its header declares shape {shown_shape(shape)} of {dtype} "
            f"({expected} bytes of "
            f"data) but {present} bytes follow."
        )
    data = np.frombuffer(raw, dtype, math.prod(shape), f.tell())
    return data.reshape(shape, order="F" if fortran else "C")
