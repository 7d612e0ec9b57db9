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

A message that names a parameter or a function holds it as a part (:class:`Param`,
:class:`Function`), not as text: a :class:`Message` is the text in the Python API's words
(``in_place=True``: every function names a parameter alike, ``format``, ``granularity``,
``scales``, ``ep``), and :meth:`Message.render` says it in another audience's words (the
command's options).

Every warning is a :class:`KvCacheWarning`, and one subclass for each kind of thing said
(:data:`WARNINGS`), so callers and pytest filter by class, never by text.
"""

from __future__ import annotations

__all__ = [  # the error and warning classes; the message helpers below are the package's own
    "CalibrationDataWarning",
    "ClippingWarning",
    "ContextLengthWarning",
    "Float16AttentionWarning",
    "FusionSkippedWarning",
    "GenaiConfigWarning",
    "KvCacheError",
    "KvCacheFileNotFoundError",
    "KvCachePreconditionError",
    "KvCacheTypeError",
    "KvCacheWarning",
    "MalformedModelError",
    "MeasurementWarning",
    "MissingRuntimeError",
    "NotConvertedWarning",
    "PaddingAssumptionWarning",
    "RuntimeSupportWarning",
    "ScalesAdjustedWarning",
    "SharedWeightsWarning",
    "SkippedNodeWarning",
    "UnfusedAttentionWarning",
    "UnitScalesWarning",
]

import dataclasses
import enum
import errno
import numbers
import os
import sys
import warnings
from collections.abc import Iterable
from typing import Any

TYPE_CHECKING = False  # standard library only: the command imports this before onnx-ir
if TYPE_CHECKING:
    import onnx_ir as ir


class _Unset(enum.Enum):
    UNSET = "unset"  # a Param with no value: its name alone (pickles as itself)


_NO_VALUE: Any = _Unset.UNSET


@dataclasses.dataclass(frozen=True)
class Param:
    """A parameter a message names: ``Param("in_place", True)`` is ``in_place=True`` in
    Python and ``--in-place`` on the command line; ``placeholder`` stands for a value the
    user fills in (``Param("seq_len", placeholder="N")``: ``seq_len=N``); with neither, the
    name alone."""

    name: str
    value: Any = _NO_VALUE
    placeholder: str | None = None

    @property
    def bare(self) -> bool:
        """Neither a value nor a placeholder: the name alone."""
        return self.value is _NO_VALUE and self.placeholder is None


@dataclasses.dataclass(frozen=True)
class Function:
    """A library function a message names, with the arguments it tells the user to give:
    ``calibrate_kv_cache(format='int8')`` in Python, the command that does the same on the
    command line (``onnx-kvcache calibrate --format int8``)."""

    name: str
    args: tuple[Param, ...] = ()


@dataclasses.dataclass(frozen=True)
class Wording:
    """How an audience names parameters and functions; the base class speaks Python, the
    command's subclass its options."""

    def param(self, param: Param) -> str:
        if param.placeholder is not None:
            return f"{param.name}={param.placeholder}"
        return param.name if param.bare else f"{param.name}={param.value!r}"

    def function(self, function: Function) -> str:
        return f"{function.name}({', '.join(map(self.param, function.args))})"


#: The Python API's words: ``format=``, ``scales=``, ``granularity=``, ``ep=``.
PYTHON = Wording()


class Message(str):
    """A message made of parts: text, :class:`Param`, :class:`Function` and other messages.
    As a ``str`` it is the text in Python's words (:data:`PYTHON`);
    :meth:`render` says it for another audience. ``+`` and :meth:`joined` keep the parts."""

    parts: tuple[Any, ...]

    def __new__(cls, *parts: Any) -> Message:
        held = tuple(p if isinstance(p, (str, Param, Function)) else str(p) for p in parts)
        self = super().__new__(cls, _render(held, PYTHON))
        self.parts = held
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as said with its parts."""
        return (_said, (str(self), self.parts))

    def render(self, wording: Wording) -> str:
        """The text in ``wording``'s words."""
        return _render(self.parts, wording)

    def __add__(self, other: str) -> Message:  # type: ignore[override]
        return Message(self, other)

    def __radd__(self, other: str) -> Message:
        return Message(other, self)

    @classmethod
    def joined(cls, parts: Iterable[str], sep: str = " ") -> Message:
        """``sep.join(parts)``, keeping the parts of those that are messages (one string is
        one part, not its characters)."""
        items: list[Any] = []
        for part in [parts] if isinstance(parts, str) else parts:
            items += [sep, part] if items else [part]
        return cls(*items)


def _said(text: str, parts: tuple[Any, ...]) -> Message:
    """A :class:`Message` as it was said (unpickling keeps its text)."""
    message = str.__new__(Message, text)
    message.parts = parts
    return message


def _render(parts: tuple[Any, ...], wording: Wording) -> str:
    said = []
    for part in parts:
        if isinstance(part, Message):
            said.append(part.render(wording))
        elif isinstance(part, Param):
            said.append(wording.param(part))
        elif isinstance(part, Function):
            said.append(wording.function(part))
        else:
            said.append(str(part))
    return "".join(said)


def render(said: object, wording: Wording) -> str:
    """An error's, a warning's or a message's text in ``wording``'s words (a plain string as
    it is)."""
    if isinstance(said, BaseException) and said.args and isinstance(said.args[0], Message):
        said = said.args[0]
    return said.render(wording) if isinstance(said, Message) else str(said)


class KvCacheError(ValueError):
    """Bad input to a conversion: the message names the problem and the fix. Given parts
    (``KvCacheError("Give ", Param("in_place", True), " to rewrite it.")``), its message is a
    :class:`Message`."""

    def __init__(self, *parts: Any) -> None:
        plain = len(parts) == 1 and not isinstance(parts[0], (Param, Function))
        super().__init__(*(parts if plain or not parts else (Message(*parts),)))


class KvCacheFileNotFoundError(KvCacheError, FileNotFoundError):
    """A path given does not exist; ``errno`` is ``ENOENT``, the message names the path."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOENT  # str() stays the message: no filename is set


class KvCacheTypeError(KvCacheError, TypeError):
    """An argument of the wrong type; the message names the type expected and the one given."""


class MalformedModelError(KvCacheError):
    """A model no runtime would run: a node reads an undefined value, an attention node's
    head counts, widths, caches or scales contradict each other (the message names the node
    and the attribute; :mod:`onnx_kvcache.cache.validation` lists the checks)."""


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
    """Something was converted with a default or skipped; the message says what (a
    :class:`Message` when it names a parameter: see :func:`render`)."""


class NotConvertedWarning(KvCacheWarning):
    """A conversion wrote nothing; the message (and ``ConvertResult.reasons``) says why."""


class PaddingAssumptionWarning(KvCacheWarning):
    """A fused attention assumes each row's valid tokens come first (a padding mask, a
    rolling window cache of the export): what a fusion of a padded export relies on."""


class FusionSkippedWarning(KvCacheWarning):
    """A fusion left attention as it was (a pattern it could not prove, a failed rewrite)."""


class SkippedNodeWarning(KvCacheWarning):
    """The quantization pass left an attention node's cache as it was (not a graph input)."""


class UnfusedAttentionWarning(KvCacheWarning):
    """A quantization pass converted nothing: the model's attention is not GroupQueryAttention
    yet (an export), and becomes it only by fusion (``GqaFusionPass``, ``optimize_model``)."""


class UnitScalesWarning(KvCacheWarning):
    """A cache gets (or keeps) unit scales, 1.0: never calibrated."""


class ScalesAdjustedWarning(KvCacheWarning):
    """Scales are used other than as given: merged, repeated per channel, made one tensor,
    partly unused, or mse thresholds carried to another format."""


class CalibrationDataWarning(KvCacheWarning):
    """The calibration data is not real text (seeded random token ids)."""


class ClippingWarning(KvCacheWarning):
    """Calibrated scales clip more of the sampled values than rounding would cost."""


class ContextLengthWarning(KvCacheWarning):
    """The scales were calibrated for a shorter context (``rope_positions``) than the model
    serves: keys past it clip more."""


class MeasurementWarning(KvCacheWarning):
    """A runner or evaluation measures something other than it seems (a hypothetical CPU rule
    for fp8, a quantized baseline)."""


class RuntimeSupportWarning(KvCacheWarning):
    """The target runs the cache only in some builds of onnxruntime (the capability row's warning)."""


class SharedWeightsWarning(KvCacheWarning):
    """A data file is hard-linked (``weights='link'``, or an earlier one): loaders refuse it
    until the other link is gone."""


class Float16AttentionWarning(KvCacheWarning):
    """A float32 model's attention computes in float16 for a target without float32
    GroupQueryAttention (CUDA): the conversion casts around it, weights untouched."""


class GenaiConfigWarning(KvCacheWarning):
    """An onnxruntime-genai config names another provider than the target and was not changed."""


def warn(message: str | Warning, category: type[Warning] = KvCacheWarning) -> None:
    """Issue a :class:`KvCacheWarning` (``message`` an instance: its class) attributed to the
    user's line: the first caller outside this package and onnx_ir (whose pass machinery
    calls our passes). A warning given (one recorded, said again) keeps its class and its
    message's parts."""
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
    UnfusedAttentionWarning,
    UnitScalesWarning,
    ScalesAdjustedWarning,
    CalibrationDataWarning,
    ClippingWarning,
    ContextLengthWarning,
    MeasurementWarning,
    RuntimeSupportWarning,
    SharedWeightsWarning,
    GenaiConfigWarning,
    Float16AttentionWarning,
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
    kind = type(value)
    named = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    raise KvCacheTypeError(f"{name} must be {expected}, got {named} ({value!r:.60}).")


def require_flags(**flags: object) -> None:
    """Raise :class:`KvCacheTypeError` unless every yes/no argument is ``True`` or ``False``:
    ``"no"`` is truthy and would mean yes (``strict must be True or False, got str ('no').``).
    A flag whose ``None`` means "decide for me" is checked by :func:`require_optional_flags`."""
    for name, value in flags.items():
        require_type(value, bool, name, "True or False")


def require_optional_flags(**flags: object) -> None:
    """:func:`require_flags` for yes/no arguments that also take ``None`` (decided for the caller)."""
    for name, value in flags.items():
        require_type(value, (bool, type(None)), name, "True, False or None")


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
