"""Fuse exported attention into GroupQueryAttention.

In order: :class:`AttentionFusionPass` (the ONNX ``Attention`` operator that
``torch.onnx.export(..., opset_version=23)`` writes), :class:`DecomposedAttentionFusionPass`
(the same exports below opset 23), then onnxscript's ``optimize_for_ort`` (older
exports' attention). A decomposed attention that none of them fuses is reported in one
:class:`KvCacheWarning`. Chains before :class:`KvCacheQuantizationPass` in an
``ir.passes.PassManager``. Whether an export fuses depends on the exporter; count the
GQA nodes afterwards.
"""

from __future__ import annotations

__all__ = ["GqaFusionPass"]

import logging
import warnings

import onnx_ir as ir

from onnx_kvcache.errors import KvCacheWarning
from onnx_kvcache.gqa import find_gqa_sites
from onnx_kvcache.passes.attention_fusion import AttentionFusionPass
from onnx_kvcache.passes.sdpa_fusion import DecomposedAttentionFusionPass

logger = logging.getLogger(__name__)


class GqaFusionPass(ir.passes.InPlacePass):
    """Fuse ONNX Attention, then decomposed attention, then run onnxscript's ORT fusions."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        before = len(find_gqa_sites(model, with_cache_only=False))
        attention = AttentionFusionPass()(model).modified
        decomposed = DecomposedAttentionFusionPass()
        attention = decomposed(model).modified or attention
        nodes = model.graph.num_nodes()
        fused, counts = optimize_for_ort(model)
        if fused is not model:
            raise ir.passes.PassError("optimize_for_ort returned a new model; expected in place.")
        after = len(find_gqa_sites(model, with_cache_only=False))
        applied = {k: v for k, v in counts.items() if v}
        logger.info("ORT fusions: %s; GroupQueryAttention nodes %d -> %d.", applied or "none", before, after)
        left = [f"{n.name or '<unnamed>'}: {why}" for n, why in decomposed.refused if n.graph is not None]
        if left:
            warnings.warn(
                f"{len(left)} decomposed attention(s) left as they are (not provably GroupQueryAttention "
                "with a KV cache): " + "; ".join(left),
                KvCacheWarning,
                stacklevel=2,
            )
        modified = attention or bool(applied) or nodes != model.graph.num_nodes()
        return ir.passes.PassResult(model, modified=modified)
