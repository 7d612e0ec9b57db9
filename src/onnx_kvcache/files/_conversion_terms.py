"""What a conversion is asked and answers: where weights come from, where the output goes, the result.

:class:`WeightsMode` (``share``, ``copy``, ``link``: what a caller asks for,
:data:`ASKED_WEIGHTS`), :class:`Placement` (the output relative to the input),
:class:`Weights` (what was done with them) and :class:`ConvertResult`, what
:func:`onnx_kvcache.files.conversion.convert_model` returns (with its one-line
``weights_summary``). :mod:`onnx_kvcache.files.conversion` re-exports them all.
"""

from __future__ import annotations

__all__ = ["ASKED_WEIGHTS", "ConvertResult", "Placement", "Weights", "WeightsMode"]

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Literal

from onnx_kvcache._enums import StrEnum
from onnx_kvcache.capabilities.refusals import Refusal, texts
from onnx_kvcache.model_io import format_bytes


class WeightsMode(StrEnum):
    """Where the output's weights come from: the input's files (``share``, beside it), its own
    copy (``copy``: cloned where the filesystem can) or hard links (``link``). A caller asks for
    ``copy`` or ``link``; ``share`` is what a model file beside its input gets."""

    SHARE = "share"
    COPY = "copy"
    LINK = "link"


#: What a caller may ask for (``convert_model(weights=...)``).
ASKED_WEIGHTS = (WeightsMode.COPY, WeightsMode.LINK)


class Placement(StrEnum):
    """Where the output goes relative to the input."""

    IN_PLACE = "in-place"
    BESIDE = "beside"
    ELSEWHERE = "elsewhere"
    FOLDER = "folder"


class Weights(StrEnum):
    """What a conversion did with the weights (:attr:`ConvertResult.weights`)."""

    SHARED = "shared"
    CLONED = "cloned"
    COPIED = "copied"
    LINKED = "linked"
    UNCHANGED = "unchanged"
    INLINE = "inline"

    @classmethod
    def copied(cls, cloned: bool) -> Weights:
        return cls.CLONED if cloned else cls.COPIED


@dataclasses.dataclass
class ConvertResult:
    """What a conversion did."""

    output: pathlib.Path
    model_file: pathlib.Path
    nodes: int
    granularity: str = "per_tensor"
    format: str = "fp8"
    bytes_written: int = 0
    """Everything written: graph, config, copied data and other files."""
    converted: bool = True
    refusals: list[Refusal] = dataclasses.field(default_factory=list)
    """Why nothing was written: each a code, the parameter it concerns and its text."""
    target: str | None = None
    """The provider gated on; ``None`` when gating was skipped (``ep=None``)."""
    target_source: str = ""
    """How the target was chosen: ``given`` (``ep=``), or ``assumed: ...`` what it was inferred from."""
    placement: Placement | Literal[""] = ""
    """``beside``, ``elsewhere``, ``folder`` or ``in-place`` (a :class:`Placement`)."""
    weights: Weights | Literal[""] = ""
    """``shared``, ``cloned``, ``copied``, ``linked``, ``unchanged`` or ``inline`` (a :class:`Weights`)."""
    weight_bytes: int = 0
    """Size of the data files the output uses."""
    weight_bytes_written: int = 0
    """Data bytes actually written (0 for shared, cloned and linked weights)."""
    shared_with: pathlib.Path | None = None
    data_files: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    ops: dict[str, int] = dataclasses.field(default_factory=dict)
    """Converted nodes per operator (``{"PagedAttention": 32}``)."""
    fused: int = 0
    """Attention layers fused into GroupQueryAttention first (an export)."""
    verified: bool | None = None
    """The export and its fusion ran side by side and agreed (False: not verified, the notes say
    why; None: no fusion ran, or ``verify=False``)."""
    method: str | None = None
    """The calibration method of the cache's scales, as they record it (None: not recorded,
    or no scales)."""
    rotation: str = "none"
    """The cache's rotation (``none``, ``keys``, ``keys_and_values``; docs/rotation.md)."""

    @property
    def reasons(self) -> list[str]:
        """The refusals' texts (why nothing was written)."""
        return list(texts(self.refusals))

    def weights_summary(self) -> str:
        summary = _WEIGHTS_SUMMARIES.get(self.weights, _copied_summary) if self.weights else _copied_summary
        return summary(self)


def _shared_summary(result: ConvertResult) -> str:
    name = result.shared_with.name if result.shared_with else "the input"
    files = result.data_files
    which = ", ".join(files) if 0 < len(files) <= 3 else f"{len(files)} data files"
    return f"weights: {which}, shared with {name} (0 bytes)"  # the data, not the graph


def _copied_summary(result: ConvertResult) -> str:
    holes = (
        f", {format_bytes(result.weight_bytes_written)} of data (holes kept)"
        if result.weight_bytes_written < result.weight_bytes
        else ""
    )
    return f"weights: copied {format_bytes(result.weight_bytes)}{holes}"


#: ``ConvertResult.weights_summary`` per outcome.
_WEIGHTS_SUMMARIES: dict[Weights, Callable[[ConvertResult], str]] = {
    Weights.INLINE: lambda r: "weights: inline in the graph",
    Weights.UNCHANGED: lambda r: (
        f"weights: unchanged ({format_bytes(r.weight_bytes)} in place, 0 bytes written)"
    ),
    Weights.SHARED: _shared_summary,
    Weights.CLONED: lambda r: f"weights: cloned {format_bytes(r.weight_bytes)} (0 bytes written)",
    Weights.LINKED: lambda r: (
        f"weights: hard-linked {format_bytes(r.weight_bytes)} (0 bytes written); onnx.load and onnx-ir "
        "refuse both models' weights"
    ),
    Weights.COPIED: _copied_summary,
}
