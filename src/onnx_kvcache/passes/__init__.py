"""Graph-rewrite passes: one pass per module."""

from __future__ import annotations

__all__ = [
    "AttentionFusionPass",
    "DecomposedAttentionFusionPass",
    "Fp8KvCachePass",
    "KvCacheQuantizationPass",
]

from onnx_kvcache.passes.attention_fusion import AttentionFusionPass
from onnx_kvcache.passes.kv_cache_quantization import Fp8KvCachePass, KvCacheQuantizationPass
from onnx_kvcache.passes.sdpa_fusion import DecomposedAttentionFusionPass
