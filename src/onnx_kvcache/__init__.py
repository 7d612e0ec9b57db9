"""onnx-kvcache: shrink the KV cache of ONNX LLM decoders.

Graph-rewrite passes that store the KV cache of GroupQueryAttention and PagedAttention in
FP8 E4M3, INT8 or packed INT4, with the scales, gating, calibration and evaluation around
them.
"""

from __future__ import annotations

__all__ = [
    # what a cache is: formats, granularities, attention operators
    "ATTENTION_OPS",
    "CACHE_FORMATS",
    "SCALE_GRANULARITIES",
    "AttentionOp",
    "CacheFormat",
    "GqaInput",
    "GqaOutput",
    "PagedInput",
    "PagedOutput",
    "ScaleGranularity",
    "get_format",
    "scale_granularity",
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
    # passes
    "AttentionFusionPass",
    "Bfloat16ToFloatPass",
    "DecomposedAttentionFusionPass",
    "Fp8KvCachePass",
    "GqaFusionPass",
    "KvCacheEmulationPass",
    "KvCacheQuantizationPass",
    "PagedAttentionReferencePass",
    "emulate_fp8_kv_cache",
    "emulate_kv_cache",
    "optimize_model",
    "paged_attention_reference",
    # files
    "CacheLayerInfo",
    "CacheModelInfo",
    "ConvertResult",
    "convert_model",
    "inspect_kv_cache",
    "load_model",
    # calibration, running, evaluation
    "CalibrationStats",
    "EvaluationReport",
    "KvCacheRunner",
    "calibrate_kv_cache",
    "evaluate_kv_cache",
    # test decoders
    "DecoderConfig",
    "build_decoder",
    # errors
    "KvCacheError",
    "KvCachePreconditionError",
    "KvCacheWarning",
    "MissingRuntimeError",
    "NotConvertedWarning",
]

from onnx_kvcache._version import __version__ as __version__
from onnx_kvcache.attention_ops import (
    ATTENTION_OPS,
    AttentionOp,
    GqaInput,
    GqaOutput,
    PagedInput,
    PagedOutput,
)
from onnx_kvcache.cache_layout import CacheLayerInfo, CacheModelInfo, inspect_kv_cache
from onnx_kvcache.calibration import CalibrationStats, calibrate_kv_cache
from onnx_kvcache.capabilities import (
    CAPABILITIES,
    EP_CAPABILITIES,
    EpCapabilities,
    FastPathReport,
    SupportReport,
    check_kv_cache_support,
    fast_path_diagnostics,
    get_capabilities,
)
from onnx_kvcache.demo_model import DecoderConfig, build_decoder
from onnx_kvcache.device import cuda_compute_capability
from onnx_kvcache.doctor import DoctorReport, run_doctor
from onnx_kvcache.errors import (
    KvCacheError,
    KvCachePreconditionError,
    KvCacheWarning,
    MissingRuntimeError,
    NotConvertedWarning,
)
from onnx_kvcache.evaluation import EvaluationReport, evaluate_kv_cache
from onnx_kvcache.formats import (
    CACHE_FORMATS,
    SCALE_GRANULARITIES,
    CacheFormat,
    ScaleGranularity,
    get_format,
    scale_granularity,
)
from onnx_kvcache.model_files import ConvertResult, convert_model
from onnx_kvcache.model_source import load_model
from onnx_kvcache.optimize import optimize_model
from onnx_kvcache.passes import (
    AttentionFusionPass,
    Bfloat16ToFloatPass,
    DecomposedAttentionFusionPass,
    Fp8KvCachePass,
    GqaFusionPass,
    KvCacheEmulationPass,
    KvCacheQuantizationPass,
    PagedAttentionReferencePass,
)
from onnx_kvcache.passes.kv_cache_emulation import emulate_fp8_kv_cache, emulate_kv_cache
from onnx_kvcache.passes.paged_attention_reference import paged_attention_reference
from onnx_kvcache.runner import KvCacheRunner
from onnx_kvcache.scales import KvCacheScales, ScalesLike, load_kv_cache_scale_file
