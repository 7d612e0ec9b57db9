"""onnx-kvcache: shrink the KV cache of ONNX LLM decoders.

Graph-rewrite passes that store the KV cache of GroupQueryAttention and PagedAttention in
FP8 E4M3, INT8 or packed INT4, with the scales, gating, calibration and evaluation around
them.
"""

from __future__ import annotations

__all__ = [
    "ATTENTION_OPS",
    "CACHE_FORMATS",
    "CAPABILITIES",
    "EP_CAPABILITIES",
    "CacheFormat",
    "DecoderConfig",
    "Fp8KvCachePass",
    "GqaFusionPass",
    "KvCacheEmulationPass",
    "KvCacheError",
    "KvCacheQuantizationPass",
    "KvCacheRunner",
    "KvCacheScales",
    "KvCacheWarning",
    "PagedAttentionReferencePass",
    "build_decoder",
    "calibrate_kv_cache",
    "check_kv_cache_support",
    "convert_model",
    "cuda_compute_capability",
    "emulate_fp8_kv_cache",
    "emulate_kv_cache",
    "evaluate_kv_cache",
    "fast_path_diagnostics",
    "get_capabilities",
    "get_format",
    "inspect_kv_cache",
    "load_kv_cache_scale_file",
    "optimize_model",
    "paged_attention_reference",
    "run_doctor",
]

from onnx_kvcache._version import __version__ as __version__
from onnx_kvcache.attention_ops import ATTENTION_OPS
from onnx_kvcache.cache_layout import inspect_kv_cache
from onnx_kvcache.calibration import calibrate_kv_cache
from onnx_kvcache.capabilities import (
    CAPABILITIES,
    EP_CAPABILITIES,
    check_kv_cache_support,
    fast_path_diagnostics,
    get_capabilities,
)
from onnx_kvcache.demo_model import DecoderConfig, build_decoder
from onnx_kvcache.device import cuda_compute_capability
from onnx_kvcache.doctor import run_doctor
from onnx_kvcache.errors import KvCacheError, KvCacheWarning
from onnx_kvcache.evaluation import evaluate_kv_cache
from onnx_kvcache.formats import CACHE_FORMATS, CacheFormat, get_format
from onnx_kvcache.model_files import convert_model
from onnx_kvcache.optimize import optimize_model
from onnx_kvcache.passes import Fp8KvCachePass, KvCacheQuantizationPass
from onnx_kvcache.passes.gqa_fusion import GqaFusionPass
from onnx_kvcache.passes.kv_cache_emulation import (
    KvCacheEmulationPass,
    emulate_fp8_kv_cache,
    emulate_kv_cache,
)
from onnx_kvcache.passes.paged_attention_reference import (
    PagedAttentionReferencePass,
    paged_attention_reference,
)
from onnx_kvcache.runner import KvCacheRunner
from onnx_kvcache.scales import KvCacheScales, load_kv_cache_scale_file
