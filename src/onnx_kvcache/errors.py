"""Exception and warning types: every user-facing problem is one of these.

Every error is a :class:`KvCacheError`, a ``ValueError``; the ones that have a standard
Python meaning are that class too, so ``except FileNotFoundError`` and ``except
TypeError`` catch them as they would anywhere else:

* :class:`KvCacheFileNotFoundError` (also a ``FileNotFoundError``): a path given does not
  exist (a model, a scale file, a data, text or tokenizer file).
* :class:`KvCacheTypeError` (also a ``TypeError``): an argument of the wrong type (a
  ``ModelProto`` or a path given to a pass, ``seq_len="64"``, ``ep=3``).
* :class:`KvCachePreconditionError` (also onnx-ir's ``PreconditionError``): a pass cannot
  run on this model.

Every warning is a :class:`KvCacheWarning`, and one subclass for each kind of thing said
(:data:`WARNINGS`), so callers and pytest filter by class, never by text.
"""

from __future__ import annotations

__all__ = [
    "CalibrationDataWarning",
    "ClippingWarning",
    "FusionSkippedWarning",
    "GenaiConfigWarning",
    "KvCacheError",
    "KvCacheFileNotFoundError",
    "KvCachePreconditionError",
    "KvCacheTypeError",
    "KvCacheWarning",
    "MeasurementWarning",
    "MissingRuntimeError",
    "NotConvertedWarning",
    "PaddingAssumptionWarning",
    "RuntimeSupportWarning",
    "ScalesAdjustedWarning",
    "SharedWeightsWarning",
    "SkippedNodeWarning",
    "UnitScalesWarning",
    "require_type",
    "warn",
]

import errno
import numbers
import os
import sys
import warnings
from typing import Any

TYPE_CHECKING = False  # standard library only: the command imports this before onnx-ir
if TYPE_CHECKING:
    import onnx_ir as ir


class KvCacheError(ValueError):
    """Bad input to a conversion: the message names the problem and the fix."""


class KvCacheFileNotFoundError(KvCacheError, FileNotFoundError):
    """A path given does not exist; ``errno`` is ``ENOENT``, the message names the path."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOENT  # str() stays the message: no filename is set


class KvCacheTypeError(KvCacheError, TypeError):
    """An argument of the wrong type; the message names the type expected and the one given."""


class MissingRuntimeError(ImportError):
    """An optional dependency (onnxruntime, tokenizers, ...) is not installed."""


def missing_dependency(error: ImportError, message: str) -> MissingRuntimeError:
    """The :class:`MissingRuntimeError` for a failed import; but a signal (Ctrl-C, SIGTERM)
    that landed during the import, which an extension module's initialisation reports as
    an ImportError caused by it, is raised again as what it is."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            raise cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return MissingRuntimeError(message)


class KvCacheWarning(UserWarning):
    """Something was converted with a default or skipped; the message says what."""


class NotConvertedWarning(KvCacheWarning):
    """A conversion wrote nothing; the message (and ``ConvertResult.reasons``) says why."""


class PaddingAssumptionWarning(KvCacheWarning):
    """A fused attention assumes each row's valid tokens come first (a padding mask, a
    sliding window cropped by the export): what a fusion of a padded export relies on."""


class FusionSkippedWarning(KvCacheWarning):
    """A fusion left attention as it was (a pattern it could not prove, a failed rewrite)."""


class SkippedNodeWarning(KvCacheWarning):
    """The quantization pass left an attention node's cache as it was (not a graph input)."""


class UnitScalesWarning(KvCacheWarning):
    """A cache gets (or keeps) unit scales, 1.0: never calibrated."""


class ScalesAdjustedWarning(KvCacheWarning):
    """Scales are used other than as given: merged, repeated per channel, made one tensor,
    partly unused, or mse thresholds carried to another format."""


class CalibrationDataWarning(KvCacheWarning):
    """The calibration data is not real text (seeded random token ids)."""


class ClippingWarning(KvCacheWarning):
    """Calibrated scales clip more of the sampled values than rounding would cost."""


class MeasurementWarning(KvCacheWarning):
    """A runner or evaluation measures something other than it seems (a hypothetical CPU rule
    for fp8, a quantized baseline)."""


class RuntimeSupportWarning(KvCacheWarning):
    """The target runs the cache only in some builds of onnxruntime (the capability row's warning)."""


class SharedWeightsWarning(KvCacheWarning):
    """A data file is hard-linked (``weights='link'``, or an earlier one): loaders refuse it
    until the other link is gone."""


class GenaiConfigWarning(KvCacheWarning):
    """An onnxruntime-genai config names another provider than the target and was not changed."""


def warn(message: str | KvCacheWarning, category: type[Warning] = KvCacheWarning) -> None:
    """Issue a :class:`KvCacheWarning` (``message`` an instance: its class) attributed to the
    user's line: the first caller outside this package and onnx_ir (whose pass machinery
    calls our passes)."""
    onnx_ir = getattr(sys.modules.get("onnx_ir"), "__file__", None)  # not imported: none of its frames
    internal = tuple(os.path.dirname(f) + os.sep for f in (__file__, onnx_ir) if f)
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    if isinstance(message, Warning):
        warnings.warn(message, stacklevel=level)
    else:
        warnings.warn(message, category, stacklevel=level)


#: The kinds of warning the library says, each a :class:`KvCacheWarning` (docs/warnings.md).
WARNINGS: tuple[type[KvCacheWarning], ...] = (
    NotConvertedWarning,
    PaddingAssumptionWarning,
    FusionSkippedWarning,
    SkippedNodeWarning,
    UnitScalesWarning,
    ScalesAdjustedWarning,
    CalibrationDataWarning,
    ClippingWarning,
    MeasurementWarning,
    RuntimeSupportWarning,
    SharedWeightsWarning,
    GenaiConfigWarning,
)


#: What :func:`require_type` takes for an integer (numpy's too, never a bool) and a number.
INTEGER: tuple[type, ...] = (numbers.Integral,)
NUMBER: tuple[type, ...] = (numbers.Real,)


def require_type(value: Any, types: type | tuple[type, ...], name: str, expected: str) -> None:
    """Raise :class:`KvCacheTypeError` unless ``value`` is one of ``types`` (a bool counts
    only where ``bool`` is named): ``seq_len must be an integer, got str ('64').``"""
    allowed = types if isinstance(types, tuple) else (types,)
    if isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool)):
        return
    raise KvCacheTypeError(f"{name} must be {expected}, got {type(value).__name__} ({value!r:.60}).")


def __getattr__(name: str) -> object:
    """:class:`KvCachePreconditionError` on first use: its base is onnx-ir's (PEP 562)."""
    if name != "KvCachePreconditionError":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import onnx_ir as ir

    class KvCachePreconditionError(KvCacheError, ir.passes.PreconditionError):
        """A pass cannot run on this model (raised before it changes anything); onnx-ir's pass
        machinery passes it through as a precondition failure."""

    KvCachePreconditionError.__qualname__ = name  # pickles as onnx_kvcache.errors.KvCachePreconditionError
    globals()[name] = KvCachePreconditionError
    return KvCachePreconditionError


if TYPE_CHECKING:

    class KvCachePreconditionError(KvCacheError, ir.passes.PreconditionError): ...  # see __getattr__
