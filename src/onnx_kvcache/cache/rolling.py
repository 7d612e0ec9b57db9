"""Rolling window caches as fused (docs/exporting.md, "Rolling window caches"): which attention
nodes hold one, and the graph output their present leaves as.

transformers 5.x keeps a sliding-window layer's cache as its last ``W - 1`` tokens. Fused into a
model file, the layer is a GroupQueryAttention node over the export's own past whose present goes
through one ``GatherND`` (``batch_dims=2``: each row's last ``W - 1`` tokens, what the export
returns) to the present graph output (for fp8: ``Cast`` to float16, ``GatherND``, ``Cast`` back).
In an onnxruntime-genai folder it is a window-sized cache (``sliding_window_cache=1``) instead,
its present the node's own output.

An export that mixes rolling and full-length caches (Gemma2, Cohere2, Qwen2 with windows) declares
one past length for both, while fed its own presents a window layer's past holds at most ``W - 1``
rows and a full layer's every token: :func:`split_window_lengths` declares the window layers' pasts
apart, so that neither the fusion's proof nor onnxruntime takes the two for one length.
"""

from __future__ import annotations

__all__ = [
    "is_row_gather",
    "present_output",
    "rolling_attention",
    "split_window_lengths",
    "tail_rows",
    "whole_presents",
]

import re

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


def _cropped_rows(value: ir.Value) -> int | None:
    """``n`` when a reader of ``value`` is ``Slice(value, [-n], ..., axes=[2])`` (its last ``n``
    rows: a rolling window cache's past as transformers 5.x exports it), else None."""
    for user, _ in value.uses():
        if user.op_type != "Slice" or user.domain not in ("", "ai.onnx") or len(user.inputs) < 4:
            continue
        starts, axes = (_ints(user.inputs[k]) for k in (1, 3))
        if starts is not None and len(starts) == 1 and starts[0] < 0 and axes in ([2], [-2]):
            return -starts[0]
    return None


def _ints(value: ir.Value | None) -> list[int] | None:
    """The integers of a constant or initializer ``value``, or None."""
    node = value.producer() if value is not None else None
    tensor = value.const_value if value is not None else None
    if tensor is None and node is not None and node.op_type == "Constant" and "value" in node.attributes:
        tensor = node.attributes["value"].as_tensor()
    return None if tensor is None else [int(x) for x in tensor.numpy().reshape(-1)]


def _length_name(value: ir.Value) -> str | None:
    """The name of a 4-D graph input's declared length (axis 2), if symbolic."""
    shape = value.shape
    dim = shape[2] if shape is not None and len(shape) == 4 else None
    return dim.value if isinstance(dim, ir.SymbolicDim) and dim.value else None


def split_window_lengths(graph: ir.Graph) -> dict[str, str]:
    """Declare each rolling window cache's past (a past input cropped to its last ``keep`` rows)
    with its own length, ``{past}_last{keep}``, where a full-length cache's past shares its declared
    length ``past``; the window presents' declared lengths and every other value's declared shape
    that names ``past`` (shapes the exporter wrote for one length) follow: the former renamed, the
    latter forgotten. Computation is unchanged. Returns ``{input name: its new length}``."""
    pasts = [v for v in graph.inputs if _length_name(v) is not None]
    windows = {v.name: keep for v in pasts if (keep := _cropped_rows(v)) is not None}
    full = {n for v in pasts if (n := _length_name(v)) is not None and v.name not in windows}
    renamed: dict[str, str] = {}
    for value in pasts:
        name = _length_name(value)
        if value.name in windows and name in full and value.shape is not None:
            renamed[str(value.name)] = f"{name}_last{windows[value.name]}"
            value.shape = ir.Shape([*value.shape[:2], renamed[str(value.name)], value.shape[3]])
    for name in {n for n in full if any(r.startswith(f"{n}_last") for r in renamed.values())}:
        _follow(graph, name, {new for new in renamed.values() if new.startswith(f"{name}_last")})
    return renamed


def _follow(graph: ir.Graph, name: str, lengths: set[str]) -> None:
    """Rename ``name`` in the window presents' declared shapes (one ``lengths``) and forget the
    declared shapes of the values between inputs and outputs that name it."""
    word = re.compile(rf"\b{re.escape(name)}\b")
    for node in graph:
        for value in node.outputs:
            dims = value.shape
            if dims is None or not any(
                isinstance(d, ir.SymbolicDim) and word.search(d.value or "") for d in dims
            ):
                continue
            if not value.is_graph_output():
                value.shape = None
            elif len(lengths) == 1 and _window_present(value):
                (new,) = lengths
                value.shape = ir.Shape(
                    [word.sub(new, d.value or "") if isinstance(d, ir.SymbolicDim) else d for d in dims]
                )


def _window_present(value: ir.Value) -> bool:
    """``value`` is ``Slice(Concat(Slice(past, -n), new), -keep)``: a rolling window cache's present."""
    node = value.producer()
    concat = (
        node.inputs[0].producer() if node is not None and node.op_type == "Slice" and node.inputs[0] else None
    )
    first = concat.inputs[0] if concat is not None and concat.op_type == "Concat" and concat.inputs else None
    crop = first.producer() if first is not None else None
    return (
        crop is not None
        and crop.op_type == "Slice"
        and crop.inputs[0] is not None
        and crop.inputs[0].is_graph_input()
    )
