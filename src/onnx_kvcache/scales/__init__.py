"""Scale values: scale files and the token data calibration reads (calibration itself is in ``calibrate``).

``onnx_kvcache.scales`` names the scale-file API (``__all__``) of :mod:`.files`.
"""

from __future__ import annotations

__all__ = [
    "KvCacheScales",
    "ScalesLike",
    "as_kv_cache_scales",
    "load_kv_cache_scale_file",
    "resolve_granularity",
]

from onnx_kvcache.scales.files import (
    KvCacheScales,
    ScalesLike,
    as_kv_cache_scales,
    load_kv_cache_scale_file,
    resolve_granularity,
)
