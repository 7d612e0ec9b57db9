"""Exception and warning types: every user-facing problem is one of these."""

from __future__ import annotations

__all__ = [
    "KvCacheError",
    "KvCachePreconditionError",
    "KvCacheWarning",
    "MissingRuntimeError",
    "NotConvertedWarning",
    "warn",
]

import os
import sys
import warnings

import onnx_ir as ir


class KvCacheError(ValueError):
    """Bad input to a conversion: the message names the problem and the fix."""


class KvCachePreconditionError(KvCacheError, ir.passes.PreconditionError):
    """A pass cannot run on this model (raised before it changes anything); onnx-ir's pass
    machinery passes it through as a precondition failure."""


class MissingRuntimeError(ImportError):
    """An optional dependency (onnxruntime, tokenizers, ...) is not installed."""


class KvCacheWarning(UserWarning):
    """Something was converted with a default or skipped; the message says what."""


class NotConvertedWarning(KvCacheWarning):
    """A conversion wrote nothing; the message (and ``ConvertResult.reasons``) says why."""


def warn(message: str, category: type[Warning] = KvCacheWarning) -> None:
    """Issue a :class:`KvCacheWarning` attributed to the user's line: the first caller
    outside this package and onnx_ir (whose pass machinery calls our passes)."""
    internal = (os.path.dirname(__file__) + os.sep, os.path.dirname(ir.__file__) + os.sep)
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    warnings.warn(message, category, stacklevel=level)
