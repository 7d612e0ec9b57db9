"""Requantizing a cache that is quantized already (rule 5 of :mod:`.kv_cache_quantization`).

What format and granularity a node's cache is in (refusing one this library does not know),
and its own scales retargeted to another format and granularity: the same threshold,
``scale * old_qmax / new_qmax``; per channel to per tensor by their max, per tensor to per
channel by broadcasting. The warnings where such scales differ from what calibrating the float
model would give are the plan's (:mod:`._kv_cache_plan`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from onnx_kvcache.cache.formats import (
    SCALE_GRANULARITIES,
    CacheFormat,
    ScaleGranularity,
    granularity_of,
    scale_granularity,
)
from onnx_kvcache.cache.sites import CacheSite, constant_values
from onnx_kvcache.errors import (
    KvCachePreconditionError,
    Param,
)

#: What a message tells the user to give for scales: ``scales=PATH``, ``--scales PATH``.
SCALE_FILE = Param("scales", placeholder="PATH")

_MERGED = "the range stays covered, channels of a smaller range get coarser steps"


@dataclasses.dataclass(frozen=True)
class _Quantized:
    """A node's cache as it is: its format and the granularity its attribute states."""

    format: CacheFormat
    granularity: ScaleGranularity


def _current_format(site: CacheSite) -> tuple[CacheFormat | None, str]:
    """The format the node's cache is in (:attr:`CacheSite.cache_format`), or None,
    with a description for messages."""
    described = str(site.cache_dtype.name if site.cache_dtype is not None else "?").lower()
    if site.cache_bit_width is not None:
        described = f"{described} ({site.cache_bit_width}-bit)"
    if site.cache_logical_type:
        described = f"{described} ({site.op.key.dtype_attr}={site.cache_logical_type!r})"
    fmt = site.cache_format
    return (fmt, fmt.name) if fmt is not None else (None, described)


def quantized_source(site: CacheSite, fmt: CacheFormat, target: ScaleGranularity) -> _Quantized | None:
    """The format and granularity the node's cache is in, None for a float cache;
    refuses a cache in a format this library does not know (``target``: the granularity
    converted to, for the message)."""
    quant = site.str_attr(site.op.key.quant_attr, "NONE")
    current, described = _current_format(site)
    if quant == "NONE" and current is None and site.cache_format is None:
        return None
    granularity = site.granularity
    if current is None or granularity is None:
        raise KvCachePreconditionError(
            f"{site.label} already has a quantized KV cache ({described}, {quant.lower()}) in a "
            f"format onnx-kvcache does not know; cannot convert it to {fmt.name} "
            f"{target.name}. Convert the original (unquantized) model instead."
        )
    return _Quantized(current, scale_granularity(granularity))


def retargeted(
    site: CacheSite, source: _Quantized, fmt: CacheFormat, granularity: ScaleGranularity
) -> tuple[np.ndarray, np.ndarray]:
    """The node's own K and V scales as scales of the requested format and granularity
    (rule 5): the same threshold; per channel to per tensor by the max, per tensor to
    per channel broadcast."""
    kv, factor = site.kv_num_heads, source.format.qmax / fmt.qmax  # in float64, as retarget
    arrays = []
    for side in site.sides:
        value = site.input(side.scale)
        found = constant_values(value)
        # one scale staying one needs no head size (a function's node may know none)
        single = found is not None and len(found) == 1 and granularity.single
        head = 1 if single else site.head_size()
        what = f"{site.label}: its {side.kind} cache is {source.format.name} {source.granularity.name}"
        if found is None:
            reason = "has no scale input" if value is None else f"reads {value.name!r}, not a constant"
            raise KvCachePreconditionError(
                f"{what}, but its {side.scale} {reason}; give ",
                SCALE_FILE,
                f" (a scale file) to convert it to {fmt.name} {granularity.name}.",
            )
        own = np.asarray(found, np.float32)
        fits = granularity_of([(own.size, kv, head)])
        if fits is None or not np.all(np.isfinite(own)) or not np.all(own > 0):
            raise KvCachePreconditionError(
                f"{what}, but its {side.scale} {value.name!r} holds {own.size} value(s) "  # type: ignore[union-attr]
                f"that are no finite positive scales of kv_num_heads {kv} x head_size {head}; give ",
                SCALE_FILE,
                " (a scale file) to convert it.",
            )
        heads, dims = scale_granularity(fits).grid(kv, head)
        grid = own.reshape(heads, dims)
        wanted = granularity.grid(kv, head)
        merged = tuple(axis for axis in range(2) if wanted[axis] < grid.shape[axis])
        grid = np.broadcast_to(grid.max(axis=merged, keepdims=True), wanted)
        arrays.append((grid.reshape(-1).astype(np.float64) * factor).astype(np.float32))
    return arrays[0], arrays[-1]  # a single (LATENT) cache: the key's twice


def _side_granularities(site: CacheSite) -> set[str]:
    """The granularity each cache of ``site`` states (K per channel, V per tensor: both)."""
    states = {site.str_attr(side.quant_attr, "NONE") for side in site.sides}
    return {row.name for row in SCALE_GRANULARITIES.values() if row.quant_type in states}
