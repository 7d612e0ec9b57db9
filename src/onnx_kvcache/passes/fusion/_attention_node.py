"""What the two ONNX ``Attention`` fusions read off the node alike: its attributes, whether an
output is read, and the scores output and scale GroupQueryAttention can take over.

Rules: ``qk_matmul_output`` (output 3) may be read only in mode 3 (softmax), the one GQA's
``output_qk`` equals; the scale (the attribute, else ``1/sqrt(head_size)``) must be finite and
positive, since onnxruntime's ``Attention`` and GQA read other values differently.
"""

from __future__ import annotations

__all__ = ["attribute", "is_read", "not_causal", "probs_and_scale"]

import math

import onnx_ir as ir

from onnx_kvcache.passes.fusion._match import default_scale
from onnx_kvcache.passes.fusion._symbolic import Unprovable

_QK_SOFTMAX = 3


def attribute(node: ir.Node, name: str, default: float) -> float:
    """A numeric attribute of ``node`` as a float (``default`` when absent)."""
    attr = node.attributes.get(name)
    if attr is None:
        return default
    return float(attr.as_float()) if attr.type == ir.AttributeType.FLOAT else float(attr.as_int())


def is_read(value: ir.Value | None) -> bool:
    """Whether a node or the graph's outputs read ``value``."""
    return value is not None and (bool(value.uses()) or value.is_graph_output())


def probs_and_scale(node: ir.Node, head: int) -> tuple[ir.Value | None, float]:
    """The read scores output (None when unread) and the scale; raises where GQA differs."""
    probs = node.outputs[3] if len(node.outputs) > 3 and is_read(node.outputs[3]) else None
    mode = int(attribute(node, "qk_matmul_output_mode", 0))
    if probs is not None and mode != _QK_SOFTMAX:
        raise Unprovable(
            f"qk_matmul_output (mode {mode}) is read; GQA's output_qk equals only mode 3 (softmax)"
        )
    scale = attribute(node, "scale", default_scale(head))
    if not (math.isfinite(scale) and scale > 0):
        raise Unprovable(
            f"scale={scale} (onnxruntime's Attention and GQA read a non-positive or NaN scale differently)"
        )
    return probs, scale


def not_causal(node: ir.Node, mask: ir.Value | None) -> str:
    """The refusal of an ``Attention`` whose mask and ``is_causal`` let a query see later keys."""
    causal = int(attribute(node, "is_causal", 0))
    what = (
        f"the mask {mask.name!r} (with is_causal={causal})"
        if mask is not None
        else f"is_causal={causal} without a mask"
    )
    return f"{what} is not causal (a query would see later keys)"
