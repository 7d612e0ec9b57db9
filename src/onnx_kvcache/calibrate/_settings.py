"""What one calibration was asked and set up with, passed between its steps.

:func:`~onnx_kvcache.calibrate.calibration.calibrate_kv_cache`'s arguments grouped by what
they decide (how thresholds are taken, which windows are sampled) and the runner, format and
method its setup chose.
"""

from __future__ import annotations

__all__: list[str] = []

import dataclasses
import os

from onnx_kvcache.cache.formats import CacheFormat
from onnx_kvcache.cache.rotation import ROTATIONS, Rotation
from onnx_kvcache.calibrate._methods import CalibrationMethod
from onnx_kvcache.runtime.runner import KvCacheRunner


@dataclasses.dataclass(frozen=True)
class _Choice:
    """How thresholds are taken and made scales (:func:`calibrate_kv_cache`'s arguments)."""

    format: str | None
    granularity: str
    method: str | None
    percentile: float
    rope_envelope: bool
    margin: float
    rope_positions: int | None = None
    """Under the envelope, the context attention's K search assumes (None: the whole table)."""
    rotation: str | None = None
    """The cache's rotation (a row of ROTATIONS; None: the format's default)."""


@dataclasses.dataclass(frozen=True)
class _Sampling:
    """Which token windows are sampled, and how much of them is kept."""

    seq_len: int
    num_seqs: int | None
    tokenizer: str | os.PathLike | None
    sample_budget: int
    seed: int
    min_tokens: int
    progress: bool


@dataclasses.dataclass(frozen=True)
class _Setup:
    """The runner over the model, and the format and method the scales are for."""

    runner: KvCacheRunner
    fmt: CacheFormat
    method: CalibrationMethod
    chosen_for: str | None
    """The target the format was chosen for, when none was named."""
    rotation: Rotation = ROTATIONS["none"]
    """The rotation the scales are for: K and V are sampled as the rotated cache holds them."""
