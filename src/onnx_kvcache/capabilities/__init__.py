"""Who can run what: capability rows, gating, the local device.

``onnx_kvcache.capabilities`` names the capability API (``__all__``) of :mod:`.table`.
"""

from __future__ import annotations

__all__ = [
    "CAPABILITIES",
    "EP_CAPABILITIES",
    "FAST_PATHS",
    "PAGED_CAPABILITIES",
    "EpCapabilities",
    "FastPathReport",
    "FastPathRule",
    "FormatSupport",
    "SupportReport",
    "check_kv_cache_support",
    "conversion_warnings",
    "default_format",
    "fast_path_diagnostics",
    "get_capabilities",
    "infer_target",
    "render_capability_table",
]

from onnx_kvcache.capabilities.table import (
    CAPABILITIES,
    EP_CAPABILITIES,
    FAST_PATHS,
    PAGED_CAPABILITIES,
    EpCapabilities,
    FastPathReport,
    FastPathRule,
    FormatSupport,
    SupportReport,
    check_kv_cache_support,
    conversion_warnings,
    default_format,
    fast_path_diagnostics,
    get_capabilities,
    infer_target,
    render_capability_table,
)
