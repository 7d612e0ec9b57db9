"""Fuse exported attention into GroupQueryAttention.

First :class:`AttentionFusionPass` (the ONNX ``Attention`` operator that
``torch.onnx.export(..., opset_version=23)`` writes), then onnxscript's
``optimize_for_ort`` (older exports' decomposed attention), so that fusion chains before
:class:`KvCacheQuantizationPass` in an ``ir.passes.PassManager``. Whether an export
fuses depends on the exporter; count the GQA nodes afterwards.
"""

from __future__ import annotations

__all__ = ["GqaFusionPass"]

import logging

import onnx_ir as ir

from onnx_kvcache.gqa import find_gqa_sites
from onnx_kvcache.passes.attention_fusion import AttentionFusionPass

logger = logging.getLogger(__name__)


class GqaFusionPass(ir.passes.InPlacePass):
    """Fuse ONNX Attention, then run onnxscript's ORT transformer fusions."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        before = len(find_gqa_sites(model, with_cache_only=False))
        attention = AttentionFusionPass()(model).modified
        nodes = model.graph.num_nodes()
        fused, counts = optimize_for_ort(model)
        if fused is not model:
            raise ir.passes.PassError("optimize_for_ort returned a new model; expected in place.")
        after = len(find_gqa_sites(model, with_cache_only=False))
        applied = {k: v for k, v in counts.items() if v}
        logger.info("ORT fusions: %s; GroupQueryAttention nodes %d -> %d.", applied or "none", before, after)
        modified = attention or bool(applied) or nodes != model.graph.num_nodes()
        return ir.passes.PassResult(model, modified=modified)
