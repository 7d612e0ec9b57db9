"""Exception and warning types: every user-facing problem is one of these."""

from __future__ import annotations

__all__ = ["KvCacheError", "KvCacheWarning", "MissingRuntimeError"]


class KvCacheError(ValueError):
    """Bad input to a conversion: the message names the problem and the fix."""


class MissingRuntimeError(ImportError):
    """An optional dependency (onnxruntime, tokenizers, ...) is not installed."""


class KvCacheWarning(UserWarning):
    """Something was converted with a default or skipped; the message says what."""
