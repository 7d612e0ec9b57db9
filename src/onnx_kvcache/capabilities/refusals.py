"""Why a request is not carried out: a :class:`Refusal` is a code, the parameter it concerns
and its text.

Callers branch on :class:`RefusalCode` (``refusal.code is RefusalCode.NO_CUDA_DEVICE``), never
on the text; :class:`Parameter` names the parameter in ``convert_model``'s words (the CLI and
``optimize_model`` map it to their own).
"""

from __future__ import annotations

__all__ = ["Parameter", "Refusal", "RefusalCode", "texts"]

import dataclasses
import enum
from collections.abc import Iterable

from onnx_kvcache._enums import StrEnum


class RefusalCode(enum.Enum):
    """What kind of requirement failed."""

    NO_ATTENTION = enum.auto()
    """The model has no attention node with a KV cache (none fused either)."""
    ATTENTION_UNFUSED = enum.auto()
    """Attention fusion left a layer unfused (or fused nothing)."""
    ALREADY_CONVERTED = enum.auto()
    """The model already has the format and granularity asked: nothing to convert."""
    UNKNOWN_PROVIDER = enum.auto()
    """The provider is not in the capability table."""
    NO_KERNEL = enum.auto()
    """The provider has no kernel for the model's attention operator."""
    FORMAT_UNSUPPORTED = enum.auto()
    """The provider's kernel does not run the cache format."""
    GRANULARITY_UNSUPPORTED = enum.auto()
    """The provider runs the format, not at this granularity."""
    RUNTIME_TOO_OLD = enum.auto()
    """The installed runtime (onnxruntime, openvino) predates the format's first version there."""
    COMPUTE_CAPABILITY_TOO_LOW = enum.auto()
    """The GPU's compute capability is below the format's minimum."""
    NO_CUDA_DEVICE = enum.auto()
    """``check_device=True`` and no CUDA GPU here."""
    QK_NORM_UNSUPPORTED = enum.auto()
    """The provider's kernel rejects q/k norm weights."""
    QUERY_DTYPE_UNSUPPORTED = enum.auto()
    """The provider's kernel does not take the model's query dtype."""
    INPUT_UNSUPPORTED = enum.auto()
    """The provider's kernel rejects an input the model's nodes use (``query_seqlens``)."""
    HEAD_SINK_UNSUPPORTED = enum.auto()
    """The provider's kernel is not known to honor attention sinks (``head_sink``) with the cache."""
    PARTIAL_CONVERSION = enum.auto()
    """Some caches would keep their type while others convert (``allow_partial`` permits it)."""
    FUSION_DIFFERS = enum.auto()
    """The fused model computes otherwise than the export (translation validation), or fails where
    it runs: the fusion is wrong for that model."""
    ROTATION_UNSUPPORTED = enum.auto()
    """The provider is not known to run a rotated cache's added operators, or the attention
    operator takes no rotation."""


class Parameter(StrEnum):
    """The parameter a refusal concerns, in ``convert_model``'s words."""

    EP = "ep"
    FORMAT = "format"
    GRANULARITY = "granularity"
    CHECK_DEVICE = "check_device"
    ALLOW_PARTIAL = "allow_partial"
    ROTATION = "rotation"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One reason a request is not carried out."""

    code: RefusalCode
    parameter: Parameter | None
    """The parameter whose value the refusal concerns (``None``: the model itself)."""
    text: str

    def __str__(self) -> str:
        return self.text


def texts(refusals: Iterable[Refusal]) -> tuple[str, ...]:
    """The refusals' texts, in order."""
    return tuple(r.text for r in refusals)
