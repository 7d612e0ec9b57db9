"""Rolling window caches as onnxruntime-genai keeps them: window-sized (``sliding_window_cache=1``).

A fused rolling window cache (:mod:`onnx_kvcache.cache.rolling`) takes the export's inputs: an
empty past first, then each row's last ``W - 1`` tokens. onnxruntime-genai allocates a window
layer's cache itself, window-sized (``W`` rows plus its slack, zeros at first) in one buffer that
past and present share, and feeds the whole ``attention_mask``: what GroupQueryAttention's
window-sized cache takes. :func:`make_window_sized` rewrites each such layer so, for a
converted onnxruntime-genai folder (its ``genai_config.json`` then names the window layers):

* the node gets ``sliding_window_cache=1``; its ``seqlens_k`` and ``total_sequence_length`` are
  the whole mask's (each row's tokens so far less one, the mask's width) instead of the export's
  cache's (:meth:`~onnx_kvcache.passes.fusion._match.GqaWriter.rolling_lengths`: the inputs of
  the ``Min`` each of those ends in);
* its present is the node's own output (the row gather goes), declared ``total_sliding_length``
  rows, its past ``past_sliding_length`` rows (onnxruntime-genai's builder's names).
"""

from __future__ import annotations

__all__ = ["make_window_sized"]

import onnx_ir as ir

from onnx_kvcache.cache.operators import GqaInput
from onnx_kvcache.cache.rolling import rolling_attention, tail_rows
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.passes.fusion._match import remove_dead
from onnx_kvcache.passes.fusion._window_present import SLIDING_PAST, SLIDING_TOTAL


def _whole_mask_input(value: ir.Value | None, *ops: str) -> ir.Value:
    """The value under ``ops`` (outermost first, each node's first input) that ``value`` is made of."""
    for op in ops:
        node = value.producer() if value is not None else None
        if node is None or node.op_type != op:
            raise KvCacheError(
                f"a rolling window cache's GroupQueryAttention reads {value.name if value else None}, "
                "not the lengths the fusion writes; fuse the export again (optimize_model)."
            )
        value = node.inputs[0]
    assert value is not None
    return value


def _window_sized(graph: ir.Graph, node: ir.Node) -> list[ir.Node]:
    """Rewrite one rolling layer's node in place; returns the nodes that may be left unread."""
    seqlens = node.inputs[GqaInput.SEQLENS_K]
    total = node.inputs[GqaInput.TOTAL_SEQUENCE_LENGTH]
    unread = [v.producer() for v in (seqlens, total) if v is not None and v.producer() is not None]
    node.replace_input_with(GqaInput.SEQLENS_K, _whole_mask_input(seqlens, "Max", "Min"))
    node.replace_input_with(GqaInput.TOTAL_SEQUENCE_LENGTH, _whole_mask_input(total, "Min"))
    node.attributes["sliding_window_cache"] = ir.AttrInt64("sliding_window_cache", 1)
    for present in node.outputs[1:3]:
        gather = tail_rows(present)
        if gather is None:
            continue
        out = gather.outputs[0]
        name, shape = out.name, out.shape
        out.replace_all_uses_with(present, replace_graph_outputs=True)
        unread.append(gather)
        present.name, present.type = name, out.type
        if shape is not None and len(shape) == 4:
            present.shape = ir.Shape([*shape[:2], SLIDING_TOTAL, shape[3]])
    for past in node.inputs[3:5]:
        if past is not None and past.shape is not None and len(past.shape) == 4:
            past.shape = ir.Shape([*past.shape[:2], SLIDING_PAST, past.shape[3]])
    return [n for n in unread if n is not None]


def make_window_sized(model: ir.Model) -> int:
    """Make each fused rolling window cache of ``model`` window-sized, as onnxruntime-genai allocates
    it (see the module docstring), in place; layers already window-sized and other layers stay as
    they are. Returns how many layers changed."""
    unread: list[ir.Node] = []
    changed = 0
    for node in list(model.graph):
        attr = node.attributes.get("sliding_window_cache")
        if rolling_attention(node) and (attr is None or attr.as_int() != 1):
            unread += _window_sized(model.graph, node)
            changed += 1
    if unread:
        remove_dead(model.graph, unread)
    return changed
