"""Scale values: scale files and the token data calibration reads (calibration itself is in ``calibrate``).

``onnx_kvcache.scales`` keeps the public names (``__all__``) of the 0.x scale-file module, now :mod:`.files`.
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
