"""Graph-rewrite passes: one pass per module."""

from __future__ import annotations

__all__ = [
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
    "PromptFloatAttentionPass",
    "QdqKvCachePass",
    "StoredCacheRotationPass",
]

from onnx_kvcache.passes._prompt_float_attention import PromptFloatAttentionPass
from onnx_kvcache.passes._qdq_kv_cache import QdqKvCachePass
from onnx_kvcache.passes._stored_cache_rotation import StoredCacheRotationPass
from onnx_kvcache.passes.bfloat16_to_float import Bfloat16ToFloatPass
from onnx_kvcache.passes.float16_attention import Float16AttentionPass
from onnx_kvcache.passes.fusion.attention_fusion import AttentionFusionPass
from onnx_kvcache.passes.fusion.cached_attention_fusion import CachedAttentionFusionPass
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass
from onnx_kvcache.passes.fusion.sdpa_fusion import DecomposedAttentionFusionPass
from onnx_kvcache.passes.kv_cache_emulation import KvCacheEmulationPass
from onnx_kvcache.passes.kv_cache_quantization import Fp8KvCachePass, KvCacheQuantizationPass
from onnx_kvcache.passes.kv_cache_rotation import KvCacheRotationPass
from onnx_kvcache.passes.paged_attention_reference import PagedAttentionReferencePass
