"""Each layer's statistics (thresholds, scales, clip fractions) and their summary table.

Rules:

* Per kind, ``scale = max(threshold * margin, tiny) / qmax``; a scale that overflows float32 is
  an error, and a minmax/percentile calibration whose scales put more than
  :data:`CLIP_WARN_FRACTION` of a layer's values beyond the threshold warns once per layer.
* A single (LATENT) cache's V is read from the key cache, with the key's scale.
* ``attention_search`` replaces a layer's scales by the refinement's
  (:mod:`onnx_kvcache.calibrate._clip_search`).
"""

from __future__ import annotations

__all__ = ["CLIP_WARN_FRACTION", "CalibrationStats", "format_calibration_summary"]

import dataclasses
from collections.abc import Sequence

import numpy as np

from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.calibrate import _clip_search
from onnx_kvcache.calibrate._attention_error import head_sink
from onnx_kvcache.calibrate._methods import _TINY, _clip_fraction, _expand, _thresholds
from onnx_kvcache.calibrate._sampler import _Sampler
from onnx_kvcache.calibrate._settings import _Choice, _Setup
from onnx_kvcache.errors import ClippingWarning, KvCacheError, Message, Param, warn

#: A minmax/percentile calibration whose scales put more than this share of a layer's values
#: beyond the threshold (margin below 1, a low percentile) warns, once per layer.
CLIP_WARN_FRACTION = 0.01


@dataclasses.dataclass
class CalibrationStats:
    """Per-layer thresholds, scales and clip fractions of one calibration."""

    layer_id: int
    k_threshold: np.ndarray
    v_threshold: np.ndarray
    k_scale: np.ndarray
    v_scale: np.ndarray
    k_clip: float
    v_clip: float


def _layer_stats(layer: int, sampler: _Sampler, setup: _Setup, choice: _Choice) -> CalibrationStats:
    """One layer's thresholds, scales and clip fractions; warns when the settings clip."""
    fmt, method, margin = setup.fmt, setup.method.name, choice.margin
    result = {}
    beyond = 0.0  # share of values beyond the threshold itself: what the settings clip
    for kind in ("key", "value"):
        # a single (LATENT) cache: V is read from the key cache, with the key's scale
        res = sampler.reservoirs.get((layer, kind)) or sampler.reservoirs[(layer, "key")]
        kv_heads = sampler.heads[layer]
        thr = _thresholds(res, method, choice.percentile, fmt, choice.granularity, kv_heads)
        with np.errstate(over="ignore"):
            scale = (np.maximum(thr * margin, _TINY) / fmt.qmax).astype(np.float32)
        if not np.all(np.isfinite(scale)):
            raise KvCacheError(
                f"Layer {layer} {kind} scales overflow float32 (threshold {thr.max():.3g} x margin "
                f"{margin:g}); use a margin near 1."
            )
        result[kind] = (thr, scale, _clip_fraction(res, scale, fmt))
        if res.rows.size:
            limit = _expand(scale, res.channels) * fmt.qmax * (1 + 2e-7)
            beyond = max(beyond, float((np.abs(res.rows) > limit).mean()))
    if beyond > CLIP_WARN_FRACTION and not setup.method.clip_search:  # those clip by design, where it pays
        warn(
            Message(
                f"The scales clip {beyond:.1%} of layer {layer}'s sampled values beyond their threshold "
                f"(more than {CLIP_WARN_FRACTION:.0%}): check ",
                Param("margin", placeholder=f"{margin:g}"),
                *(
                    (" and ", Param("percentile", placeholder=f"{choice.percentile:g}"))
                    if method == "percentile"
                    else ()
                ),
                "; clipped values lose far more than rounding does.",
            ),
            ClippingWarning,
        )
    (kt, ks, kc), (vt, vs, vc) = result["key"], result["value"]
    return CalibrationStats(layer, kt, vt, ks, vs, kc, vc)


def _refined(stats: CalibrationStats, sampler: _Sampler, setup: _Setup) -> CalibrationStats:
    """``attention_search``: one layer's stats after the exact refinement (others: as given)."""
    layer, fmt = stats.layer_id, setup.fmt
    exact = sampler.exact
    if exact is None or layer not in exact.samples or (layer, "value") not in sampler.reservoirs:
        return stats
    samples, site = exact.samples[layer], sampler.sites[layer]
    ks, vs = _clip_search.refine(
        samples,
        stats.k_scale,
        stats.v_scale,
        fmt,
        scale=site.float_attr("scale") or 1.0 / np.sqrt(samples[0].q.shape[-1]),
        softcap=site.float_attr("softcap"),
        window=site.int_attr("local_window_size", -1),
        tables=sampler.rope_tables.get(layer),
        interleaved=bool(site.int_attr("rotary_interleaved")),
        rotation=sampler.rotation,
        sink=head_sink(site),
    )
    kc, vc = (
        _clip_fraction(sampler.reservoirs[layer, kind], s, fmt) for kind, s in (("key", ks), ("value", vs))
    )
    qmax = np.float32(fmt.qmax)
    return CalibrationStats(layer, ks * qmax, vs * qmax, ks, vs, kc, vc)


def format_calibration_summary(
    stats: Sequence[CalibrationStats], format: str | None = None, method: str | None = None
) -> str:
    """A table: per layer, K/V thresholds, scales and the fraction of values clipped
    (``format`` and ``method``: the scales'; the integer formats' minmax note is left out
    of an fp8 table and of another method's, whose clipping is its choice).

    A value is clipped when it lies beyond the top or bottom stored level by more than half
    a step (integers) or beyond it at all (fp8), so storing it costs more than rounding.
    Under onnxruntime-genai's convention (``scale = threshold / qmax``, qmax 128 for int8 and
    8 for int4, stored levels -128..127 and -8..7), minmax stores a positive threshold value
    at the top level, as 127/128 (7/8) of itself, and clips the positive values within half
    a step of it: a small clip fraction is expected there (zero where the largest magnitude
    is negative). The last line of the table says so, since the CLI prints only the table.
    """
    names = ("k thresh", "k scale", "k clip", "v thresh", "v scale", "v clip")
    head = f"{'layer':>5}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, (9, 10, 8, 9, 10, 8)))
    lines = [head]
    for s in stats:
        lines.append(
            f"{s.layer_id:>5}  {s.k_threshold.max():9.4g}  {s.k_scale.max():10.4g}  {s.k_clip:8.2e}  "
            f"{s.v_threshold.max():9.4g}  {s.v_scale.max():10.4g}  {s.v_clip:8.2e}"
        )
    lines.append(
        "clip: share of sampled values stored at the top or bottom level with more than rounding "
        "error (thresholds and scales: largest per layer)"
    )
    if (format is None or not get_format(format).is_float) and method in (None, "minmax"):
        lines.append(
            "minmax clips int8/int4 a little: onnxruntime-genai's amax/128 (/8) stores amax as 127/128 (7/8)"
        )
    return "\n".join(lines)
