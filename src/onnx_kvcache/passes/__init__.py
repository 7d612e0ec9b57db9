"""Graph-rewrite passes: one pass per module."""

from __future__ import annotations

__all__ = ["Fp8KvCachePass", "KvCacheQuantizationPass"]

from onnx_kvcache.passes.kv_cache_quantization import Fp8KvCachePass, KvCacheQuantizationPass
