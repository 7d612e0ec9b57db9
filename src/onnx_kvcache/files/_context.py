"""The context a model serves, and scales calibrated for a shorter one.

Scales calibrated with ``rope_positions=N`` (the scale file records it) hold K scales chosen for
keys at positions below N: served at longer contexts, the slow RoPE pairs of later keys turn
past those scales and are clipped (docs/calibration.md measures what that costs). A
conversion with such scales says so, a :class:`~onnx_kvcache.errors.ContextLengthWarning`,
when the model serves more than N positions. The model's context is the first of
:data:`CONTEXT_SOURCES` that states one:

* ``genai_config.json``'s ``model.context_length`` (an onnxruntime-genai folder);
* ``config.json``'s ``max_position_embeddings`` beside the model file (an export saved with
  its Hugging Face config, an optimum folder);
* the rows of the graph's rotary table: the ``cos_cache`` of GroupQueryAttention,
  PagedAttention or a RotaryEmbedding node (one row a position), or the table a per-token cos
  was gathered from (:func:`~onnx_kvcache.cache.rotary_tables.max_positions`).

Nothing stated (an export alone, its rotary angles computed from the positions): the warning
says that the context is unknown, and what the scales hold.
"""

from __future__ import annotations

__all__ = ["CONTEXT_SOURCES", "ContextSource", "model_context", "warn_short_scales"]

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from onnx_kvcache.cache.rotary_tables import max_positions
from onnx_kvcache.errors import ContextLengthWarning, KvCacheError, Message, Param, warn
from onnx_kvcache.model_io import load_json
from onnx_kvcache.scales.files import KvCacheScales


def _positive(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


def _genai_context(model: ir.Model, folder: pathlib.Path, config: dict[str, Any] | None) -> int | None:
    section = (config or {}).get("model")
    return _positive(section.get("context_length")) if isinstance(section, dict) else None


def _hf_config_context(model: ir.Model, folder: pathlib.Path, config: dict[str, Any] | None) -> int | None:
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        doc = load_json(path, "Model config")
    except KvCacheError:  # a config.json the conversion does not need: it states nothing
        return None
    return _positive(doc.get("max_position_embeddings")) if isinstance(doc, dict) else None


def _rotary_table_context(model: ir.Model, folder: pathlib.Path, config: dict[str, Any] | None) -> int | None:
    return max_positions(model)


@dataclasses.dataclass(frozen=True)
class ContextSource:
    """Where a model's context may be stated, and how to read it there."""

    name: str
    """How the warning names it."""
    read: Callable[[ir.Model, pathlib.Path, dict[str, Any] | None], int | None]


CONTEXT_SOURCES: tuple[ContextSource, ...] = (
    ContextSource("genai_config.json's context_length", _genai_context),
    ContextSource("config.json's max_position_embeddings", _hf_config_context),
    ContextSource("the rows of its rotary table", _rotary_table_context),
)


def model_context(
    model: ir.Model, folder: pathlib.Path, config: dict[str, Any] | None = None
) -> tuple[int, str] | None:
    """The positions ``model`` (its file in ``folder``, with genai ``config``) serves and the
    source that says so; None when none does."""
    for source in CONTEXT_SOURCES:
        positions = source.read(model, folder, config)
        if positions is not None:
            return positions, source.name
    return None


def warn_short_scales(
    scales: KvCacheScales | None, model: ir.Model, folder: pathlib.Path, config: dict[str, Any] | None
) -> None:
    """A :class:`ContextLengthWarning` when ``scales`` were calibrated for fewer positions
    (``rope_positions``) than the model serves, or for some when nothing states its context."""
    calibrated = _positive((scales.metadata if scales is not None else {}).get("rope_positions"))
    if calibrated is None:
        return
    context = model_context(model, folder, config)
    if context is None:
        warn(
            Message(
                f"The KV-cache scales were calibrated for contexts of up to {calibrated} positions (",
                Param("rope_positions", calibrated),
                "), and nothing states the model's context (no genai_config.json context_length, no "
                "config.json max_position_embeddings beside it, no rotary table in the graph): served "
                f"past position {calibrated}, its keys are clipped more, a loss that grows with the "
                "position (docs/calibration.md). Calibrate without ",
                Param("rope_positions"),
                " (the whole rotary table) unless its contexts stay that short.",
            ),
            ContextLengthWarning,
        )
        return
    if context[0] <= calibrated:
        return
    positions, where = context
    warn(
        Message(
            f"The KV-cache scales were calibrated for contexts of up to {calibrated} positions (",
            Param("rope_positions", calibrated),
            f"), but the model serves {positions} ({where}): keys past position {calibrated} are "
            "clipped more, a loss that grows with the position (docs/calibration.md). Calibrate "
            "without ",
            Param("rope_positions"),
            " (the whole rotary table) or with ",
            Param("rope_positions", positions),
            ".",
        ),
        ContextLengthWarning,
    )
