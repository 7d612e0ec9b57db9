"""onnx-kvcache: shrink the KV cache of ONNX LLM decoders.

Graph-rewrite passes that store the KV cache of GroupQueryAttention and PagedAttention in
FP8 E4M3, INT8 or packed INT4, with the scales, gating, calibration and evaluation around
them.

Names are imported on first use (PEP 562), ``__version__`` too: this module imports nothing
and installs nothing, so the console script (``from onnx_kvcache.cli._entry import main``,
which runs this module first) reaches the entry point's signal handling in microseconds.
"""

__all__ = [
    # passes, and the function that runs them
    "AttentionFusionPass",
    "Bfloat16ToFloatPass",
    "CachedAttentionFusionPass",
    "DecomposedAttentionFusionPass",
    "Float16AttentionPass",
    "Fp8KvCachePass",
    "GqaFusionPass",
    "KvCacheEmulationPass",
    "KvCacheQuantizationPass",
    "KvCacheRotationPass",
    "PagedAttentionReferencePass",
    "emulate_kv_cache",
    "optimize_model",
    "paged_attention_reference",
    # the four file operations and what they return
    "CacheLayerInfo",
    "CacheModelInfo",
    "CalibrationStats",
    "ConvertResult",
    "EvaluationReport",
    "calibrate_kv_cache",
    "compare_continuations",
    "Continuations",
    "convert_model",
    "evaluate_kv_cache",
    "inspect_kv_cache",
    "load_model",
    # running
    "KvCacheRunner",
    # scales
    "KvCacheScales",
    "ScalesLike",
    "load_kv_cache_scale_file",
    # who can run what
    "CAPABILITIES",
    "EP_CAPABILITIES",
    "DoctorReport",
    "EpCapabilities",
    "FastPathReport",
    "SupportReport",
    "check_kv_cache_support",
    "cuda_compute_capability",
    "fast_path_diagnostics",
    "get_capabilities",
    "run_doctor",
    # the base error and warning types; every kind of each is in onnx_kvcache.errors
    "KvCacheError",
    "KvCacheWarning",
    "MissingRuntimeError",
]

TYPE_CHECKING = False  # typing is not imported: the command's start-up stays short

_EXPORTS = {  # where each name lives; imported on first use
    "onnx_kvcache.cache.layout": (
        "CacheLayerInfo",
        "CacheModelInfo",
        "inspect_kv_cache",
    ),
    "onnx_kvcache.calibrate.calibration": (
        "CalibrationStats",
        "calibrate_kv_cache",
    ),
    "onnx_kvcache.capabilities.table": (
        "CAPABILITIES",
        "EP_CAPABILITIES",
        "EpCapabilities",
        "FastPathReport",
        "SupportReport",
        "check_kv_cache_support",
        "fast_path_diagnostics",
        "get_capabilities",
    ),
    "onnx_kvcache.capabilities.device": ("cuda_compute_capability",),
    "onnx_kvcache.runtime.doctor": (
        "DoctorReport",
        "run_doctor",
    ),
    "onnx_kvcache.errors": (
        "KvCacheError",
        "KvCacheWarning",
        "MissingRuntimeError",
    ),
    "onnx_kvcache.runtime.continuations": (
        "Continuations",
        "compare_continuations",
    ),
    "onnx_kvcache.runtime.evaluation": (
        "EvaluationReport",
        "evaluate_kv_cache",
    ),
    "onnx_kvcache.files.conversion": (
        "ConvertResult",
        "convert_model",
    ),
    "onnx_kvcache.model_io.reading": ("load_model",),
    "onnx_kvcache.pipeline.optimize": ("optimize_model",),
    "onnx_kvcache.passes": (
        "AttentionFusionPass",
        "Bfloat16ToFloatPass",
        "CachedAttentionFusionPass",
        "DecomposedAttentionFusionPass",
        "Float16AttentionPass",
        "Fp8KvCachePass",
        "GqaFusionPass",
        "KvCacheEmulationPass",
        "KvCacheQuantizationPass",
        "KvCacheRotationPass",
        "PagedAttentionReferencePass",
    ),
    "onnx_kvcache.passes.kv_cache_emulation": ("emulate_kv_cache",),
    "onnx_kvcache.passes.paged_attention_reference": ("paged_attention_reference",),
    "onnx_kvcache.runtime.runner": ("KvCacheRunner",),
    "onnx_kvcache.scales.files": (
        "KvCacheScales",
        "ScalesLike",
        "load_kv_cache_scale_file",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> object:
    """An exported name or a submodule, imported on first use (PEP 562)."""
    import importlib.util

    module = "onnx_kvcache._version" if name == "__version__" else _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}{_elsewhere(name)}")
    globals()[name] = value
    return value


#: where names that are not top-level live (every error and warning; the tables; the demo's decoder)
_HOMES = (
    "onnx_kvcache.errors",
    "onnx_kvcache.cache.formats",
    "onnx_kvcache.cache.operators",
    "onnx_kvcache.models.decoder",
)


def _elsewhere(name: str) -> str:
    """``; it is onnx_kvcache.errors.NAME`` where a module named in :data:`_HOMES` exports it."""
    import importlib

    if name.startswith("_"):  # dunder probes (inspect, doctest) import nothing
        return ""
    for home in _HOMES:
        if name in getattr(importlib.import_module(home), "__all__", ()):
            return f"; import it from {home} (from {home} import {name})"
    return ""


def __dir__() -> list[str]:
    """The public API (and ``__version__``), not this module's own machinery."""
    return sorted({*__all__, "__version__"})


if TYPE_CHECKING:
    from onnx_kvcache._version import __version__ as __version__
    from onnx_kvcache.cache.layout import CacheLayerInfo, CacheModelInfo, inspect_kv_cache
    from onnx_kvcache.calibrate.calibration import CalibrationStats, calibrate_kv_cache
    from onnx_kvcache.capabilities.device import cuda_compute_capability
    from onnx_kvcache.capabilities.table import (
        CAPABILITIES,
        EP_CAPABILITIES,
        EpCapabilities,
        FastPathReport,
        SupportReport,
        check_kv_cache_support,
        fast_path_diagnostics,
        get_capabilities,
    )
    from onnx_kvcache.errors import KvCacheError, KvCacheWarning, MissingRuntimeError
    from onnx_kvcache.files.conversion import ConvertResult, convert_model
    from onnx_kvcache.model_io.reading import load_model
    from onnx_kvcache.passes import (
        AttentionFusionPass,
        Bfloat16ToFloatPass,
        CachedAttentionFusionPass,
        DecomposedAttentionFusionPass,
        Float16AttentionPass,
        Fp8KvCachePass,
        GqaFusionPass,
        KvCacheEmulationPass,
        KvCacheQuantizationPass,
        KvCacheRotationPass,
        PagedAttentionReferencePass,
    )
    from onnx_kvcache.passes.kv_cache_emulation import emulate_kv_cache
    from onnx_kvcache.passes.paged_attention_reference import paged_attention_reference
    from onnx_kvcache.pipeline.optimize import optimize_model
    from onnx_kvcache.runtime.doctor import DoctorReport, run_doctor
    from onnx_kvcache.runtime.evaluation import EvaluationReport, evaluate_kv_cache
    from onnx_kvcache.runtime.runner import KvCacheRunner
    from onnx_kvcache.scales.files import KvCacheScales, ScalesLike, load_kv_cache_scale_file
