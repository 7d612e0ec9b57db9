"""The calibration methods as a table, and how each takes a layer's thresholds.

Rules:

* :data:`CALIBRATION_METHODS` is the table: per method, whether it searches the clip point on
  the format's integer rounding (``mse``, ``attention``, ``attention_search``), weighs each
  row by the attention it gets, and refines the result on the true attention-output error.
* ``minmax`` and ``percentile`` take per-channel thresholds (the largest ``|x|``, a high
  percentile of it) and a scale's threshold is their max over the channels it covers; the
  clip searches optimize one clip point over all the values a scale covers
  (geometric grid of 64 fractions of amax in [0.003, 1]).
* A value is clipped when it lies beyond the top or bottom stored level by more than half a
  step (integers) or beyond it at all (fp8).

Split from :mod:`onnx_kvcache.calibrate.calibration` (which re-exports the table) so the
methods' rules read apart from the run that feeds them.
"""

from __future__ import annotations

__all__ = ["CALIBRATION_METHODS", "DEFAULT_METHODS", "METHODS", "CalibrationMethod", "default_method"]

import dataclasses

import numpy as np

from onnx_kvcache.cache.formats import CacheFormat, ScaleGranularity, scale_granularity
from onnx_kvcache.calibrate._reservoir import _Reservoir


@dataclasses.dataclass(frozen=True)
class CalibrationMethod:
    """How a calibration method takes its thresholds.

    Attributes:
        clip_search: Searches the clip point on the format's integer rounding (integer
            formats only; clips by design).
        attention: Weights each cached row's error by the attention the model pays it
            (captures every layer's queries; see the module docstring).
        exact: Then refines each layer's scales on its true attention-output error, checked
            on held-out windows (:mod:`onnx_kvcache.calibrate._clip_search`).
    """

    name: str
    clip_search: bool = False
    attention: bool = False
    exact: bool = False


CALIBRATION_METHODS = {
    m.name: m
    for m in (
        CalibrationMethod("minmax"),
        CalibrationMethod("percentile"),
        CalibrationMethod("mse", clip_search=True),
        CalibrationMethod("attention", clip_search=True, attention=True),
        CalibrationMethod("attention_search", clip_search=True, attention=True, exact=True),
    )
}
METHODS = tuple(CALIBRATION_METHODS)
#: The method taken when none is named, per format and rotation (others: ``minmax``), by
#: measurement on SmolLM2-135M (``benchmarks/real_model.py``; docs/rotation.md): a rotated int4
#: cache loses least with ``mse`` (its rows weighed alike; ``attention`` weighs them by 512-token
#: windows' attention, which clips what longer contexts read), an unrotated one with ``attention``.
DEFAULT_METHODS: dict[tuple[str, str], str] = {
    ("int4", "none"): "attention",
    ("int4", "keys"): "mse",
    ("int4", "keys_and_values"): "mse",
}


def default_method(format: str, rotation: str) -> str:
    """The method for a ``format`` cache of ``rotation`` when none is named (:data:`DEFAULT_METHODS`)."""
    return DEFAULT_METHODS.get((format, rotation), "minmax")


_TINY = float(np.finfo(np.float32).tiny)


def _mse_threshold(
    samples: np.ndarray, amax: np.ndarray, fmt: CacheFormat, weights: np.ndarray | None = None
) -> np.ndarray:
    """Per column, the clip point in [0.003, 1] * amax (geometric grid) with least round-trip
    error (weighted by ``weights`` when given).

    ``samples`` are magnitudes: symmetric rounding makes the sign irrelevant. The round
    trip is the format's own (:meth:`CacheFormat.round_trip`).
    """
    best = amax.astype(np.float32).copy()
    best_err = np.full(amax.shape, np.inf, np.float64)
    for frac in np.geomspace(0.003, 1.0, 64):
        clip = np.maximum(amax * frac, _TINY)
        scale = (clip / fmt.qmax).astype(np.float32)
        sq = (fmt.round_trip(samples, scale) - samples) ** 2
        err = sq.mean(axis=0) if weights is None else (sq * weights).sum(axis=0)
        better = err < best_err
        best[better], best_err[better] = clip[better], err[better]
    return best


def _by_scale(values: np.ndarray, row: ScaleGranularity, kv_heads: int) -> np.ndarray:
    """``[N, kv*head]`` values regrouped ``[N * shared, scales]``: one column per scale."""
    n, channels = values.shape
    heads, dims = row.grid(kv_heads, channels // kv_heads)
    grid = values.reshape(n, kv_heads, channels // kv_heads)
    shared = [axis for axis, keep in ((1, row.per_head), (2, row.per_dim)) if not keep]
    kept = [axis for axis in (1, 2) if axis not in shared]
    return np.moveaxis(grid, [0, *shared, *kept], [0, 1, 2]).reshape(-1, heads * dims)


def _thresholds(
    res: _Reservoir, method: str, percentile: float, fmt: CacheFormat, granularity: str, kv_heads: int = 1
) -> np.ndarray:
    """One threshold per scale of ``granularity`` (``[kv_heads, head]`` channels).

    minmax and percentile take the per-channel thresholds' max over the channels a scale
    covers; mse and attention optimize one clip point over all the values a scale covers.
    """
    row = scale_granularity(granularity)
    if CALIBRATION_METHODS[method].clip_search:
        samples = _by_scale(np.abs(res.rows), row, kv_heads)
        weights = None if res.weights is None else _by_scale(res.weights, row, kv_heads)
        return _mse_threshold(samples, _by_scale(res.amax[None], row, kv_heads).max(axis=0), fmt, weights)
    thr = res.amax if method == "minmax" else np.percentile(np.abs(res.rows), percentile, axis=0)
    return _by_scale(np.asarray(thr, np.float32)[None], row, kv_heads).max(axis=0)


def _clip_fraction(res: _Reservoir, scale: np.ndarray, fmt: CacheFormat) -> float:
    """Share of sampled values beyond what the scale can represent (not mere rounding):
    above the top level or below the bottom one by more than half a step (integers), or
    beyond them at all (fp8). int8 stores -128 and int4 -8, one level more than on top.

    A float32 ulp of tolerance: ``threshold / qmax * qmax`` may round just below the
    threshold, which costs nothing when stored.
    """
    if not res.rows.size:
        return 0.0
    half = 0.0 if fmt.is_float else 0.5
    step = _expand(scale, res.channels) * (1 + 2e-7)
    clipped = (res.rows > step * (fmt.qmax_stored + half)) | (res.rows < step * (fmt.qmin_stored - half))
    return float(clipped.mean())


def _expand(scale: np.ndarray, channels: int) -> np.ndarray:
    """Per-scale values broadcast to ``channels`` columns (a scale covers a contiguous block)."""
    return np.repeat(scale, channels // scale.size)
