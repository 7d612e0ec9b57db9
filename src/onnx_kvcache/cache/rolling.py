"""Rolling window caches as fused (docs/exporting.md, "Rolling window caches"): which attention
nodes hold one, and the graph output their present leaves as.

transformers 5.x keeps a sliding-window layer's cache as its last ``W - 1`` tokens. Fused into a
model file, the layer is a GroupQueryAttention node over the export's own past whose present goes
through one ``GatherND`` (``batch_dims=2``: each row's last ``W - 1`` tokens, what the export
returns) to the present graph output (for fp8: ``Cast`` to float16, ``GatherND``, ``Cast`` back).
In an onnxruntime-genai folder it is a window-sized cache (``sliding_window_cache=1``) instead,
its present the node's own output.
"""

from __future__ import annotations

__all__ = ["is_row_gather", "present_output", "rolling_attention", "tail_rows", "whole_presents"]

import onnx_ir as ir


def is_row_gather(node: ir.Node) -> bool:
    """``GatherND(x, indices, batch_dims=2)``: rows of a BNSH cache per batch row and head."""
    if node.op_type != "GatherND" or node.domain not in ("", "ai.onnx"):
        return False
    attr = node.attributes.get("batch_dims")
    return attr is not None and attr.as_int() == 2


def _only_reader(value: ir.Value | None, op_type: str) -> ir.Node | None:
    users = [user for user, _ in value.uses()] if value is not None else []
    return users[0] if len(users) == 1 and users[0].op_type == op_type else None


def tail_rows(value: ir.Value | None) -> ir.Node | None:
    """The GatherND of ``value``'s rows whose output is a graph output (a rolling window cache's
    present), if that is its one reader."""
    node = _only_reader(value, "GatherND")
    return node if node is not None and is_row_gather(node) and node.outputs[0].is_graph_output() else None


def present_output(value: ir.Value | None) -> ir.Value | None:
    """The graph output a present cache leaves as: itself, its rows' GatherND's output, or
    for fp8 the output of ``Cast(GatherND(Cast(value, float16)))``."""
    node = tail_rows(value)
    if node is not None:
        return node.outputs[0]
    wide = _only_reader(value, "Cast")
    rows = _only_reader(wide.outputs[0], "GatherND") if wide is not None else None
    narrow = _only_reader(rows.outputs[0], "Cast") if rows is not None and is_row_gather(rows) else None
    if narrow is not None and narrow.outputs[0].is_graph_output():
        return narrow.outputs[0]
    return value


def rolling_attention(node: ir.Node) -> bool:
    """A GroupQueryAttention node of a fused rolling window cache: its present gathered to the
    export's rows (:func:`present_output`), or a window-sized cache (``sliding_window_cache=1``)."""
    if node.op_type != "GroupQueryAttention":
        return False
    attr = node.attributes.get("sliding_window_cache")
    if attr is not None and attr.as_int() == 1:
        return True
    present = node.outputs[1] if len(node.outputs) > 1 else None
    return present is not None and present_output(present) is not present


def whole_presents(graph: ir.Graph) -> int:
    """Make each rolling present graph output the attention node's whole present (every row of
    past and new tokens, before the gather: what calibration reads, a window's every token), under
    the output's name; returns how many. The gathers are left unread."""
    done = 0
    for index, out in enumerate(list(graph.outputs)):
        node = out.producer()
        source = node.inputs[0] if node is not None and is_row_gather(node) else None
        producer = source.producer() if source is not None else None
        if source is None or producer is None or producer.op_type != "GroupQueryAttention":
            continue
        name = out.name
        out.name = f"{name}/rows"
        source.name = name
        graph.outputs[index] = source
        done += 1
    return done
