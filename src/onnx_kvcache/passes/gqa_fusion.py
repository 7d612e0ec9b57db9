"""Fuse exported attention into GroupQueryAttention with onnxscript's ORT fusions.

A thin pass around ``onnxscript.rewriter.ort_fusions.optimize_for_ort`` so that the
fusion chains before :class:`KvCacheQuantizationPass` in an ``ir.passes.PassManager``.
Whether an export fuses depends on the exporter; count the GQA nodes afterwards.
"""

from __future__ import annotations

__all__ = ["GqaFusionPass"]

import logging

import onnx_ir as ir

from onnx_kvcache.gqa import find_gqa_sites

logger = logging.getLogger(__name__)


class GqaFusionPass(ir.passes.InPlacePass):
    """Run onnxscript's ORT transformer fusions (attention -> GroupQueryAttention)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        before = len(find_gqa_sites(model, with_cache_only=False))
        nodes = model.graph.num_nodes()
        fused, counts = optimize_for_ort(model)
        if fused is not model:
            raise ir.passes.PassError("optimize_for_ort returned a new model; expected in place.")
        after = len(find_gqa_sites(model, with_cache_only=False))
        applied = {k: v for k, v in counts.items() if v}
        logger.info("ORT fusions: %s; GroupQueryAttention nodes %d -> %d.", applied or "none", before, after)
        return ir.passes.PassResult(model, modified=bool(applied) or nodes != model.graph.num_nodes())
