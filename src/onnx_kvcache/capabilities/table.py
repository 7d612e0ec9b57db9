"""The capability table's names in one place: its rows, gating and rendering.

The rows are :mod:`.rows` (pure data), what they say about a model :mod:`.gating`, the
Markdown of the docs page :mod:`.rendering`; this module keeps the path the docs name
(``onnx_kvcache.capabilities.table.CAPABILITIES``) and imports nothing else.
"""

from __future__ import annotations

__all__ = [
    "CAPABILITIES",
    "EP_CAPABILITIES",
    "FAST_PATHS",
    "EpCapabilities",
    "FastPathReport",
    "FastPathRule",
    "FormatSupport",
    "PAGED_CAPABILITIES",
    "STORAGE_CAPABILITIES",
    "SupportReport",
    "check_kv_cache_support",
    "conversion_warnings",
    "default_format",
    "fast_path_diagnostics",
    "get_capabilities",
    "infer_target",
    "render_capability_table",
    "storage_refusals",
]

from onnx_kvcache.capabilities.gating import (
    FastPathReport,
    SupportReport,
    check_kv_cache_support,
    conversion_warnings,
    default_format,
    fast_path_diagnostics,
    infer_target,
    storage_refusals,
)
from onnx_kvcache.capabilities.rendering import render_capability_table
from onnx_kvcache.capabilities.rows import (
    CAPABILITIES,
    EP_CAPABILITIES,
    FAST_PATHS,
    PAGED_CAPABILITIES,
    STORAGE_CAPABILITIES,
    EpCapabilities,
    FastPathRule,
    FormatSupport,
    get_capabilities,
)
