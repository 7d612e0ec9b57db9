"""Presents of rolling window caches: each row's last ``keep`` tokens of the attention node's present.

transformers 5.x keeps a sliding-window layer's cache as its last ``W - 1`` tokens (a rolling
window cache: docs/exporting.md). Its fused layer is GroupQueryAttention over the export's own
past (``P <= W - 1`` rows, each row's tokens compacted at its start, the lengths of
:meth:`~onnx_kvcache.passes.fusion._match.GqaWriter.rolling_lengths`), whose present holds the
row's ``n`` tokens in rows ``[0, n)`` of ``P + S``. The graph's present is its rows
``[max(0, n - L), max(0, n - L) + L)``, ``L = min(P + S, W - 1)``: one ``GatherND``
(``batch_dims=2``) after the node, by indices computed once per length (:func:`row_indices`).
An unpadded row's are the last ``L`` rows, exactly the export's ``Slice(-(W - 1))``; so a model
file takes the export's inputs (an empty past first) and returns its presents.

ONNX ``GatherND`` takes no float8 type, so an fp8 cache's rows are gathered through float16
(``Cast``, ``GatherND``, ``Cast``: exact, every float8e4m3fn value is a float16 value).
"""

from __future__ import annotations

__all__ = [
    "SLIDING_PAST",
    "SLIDING_TOTAL",
    "cast_fp8_windows",
    "follow_present_types",
    "last_rows",
    "row_indices",
]

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.rolling import is_row_gather, present_output
from onnx_kvcache.passes._graph import insert

SLIDING_PAST, SLIDING_TOTAL = "past_sliding_length", "total_sliding_length"
"""The declared lengths of a window-sized cache's past and present (onnxruntime-genai's names)."""

_GATHER_TYPES = frozenset(
    {
        ir.DataType.FLOAT,
        ir.DataType.FLOAT16,
        ir.DataType.BFLOAT16,
        ir.DataType.DOUBLE,
        ir.DataType.INT8,
        ir.DataType.UINT8,
        ir.DataType.INT16,
        ir.DataType.UINT16,
        ir.DataType.INT32,
        ir.DataType.UINT32,
        ir.DataType.INT64,
        ir.DataType.UINT64,
        ir.DataType.BOOL,
    }
)


def row_indices(
    graph: ir.Graph,
    gqa: ir.Node,
    lengths: tuple[ir.Value, ir.Value],
    keep: int,
    kv_heads: int,
    name: Callable[[str], str],
) -> ir.Value:
    """The rows a rolling present keeps, int64 ``[batch, kv_heads, L, 1]``: row ``b``'s
    ``max(0, n_b - L) + j`` for ``j < L``, ``n_b = seqlens_k[b] + 1``, ``L = min(total, keep)``
    (``lengths``: GQA's ``seqlens_k`` and ``total_sequence_length``; inserted before ``gqa``;
    ``name`` makes each node's name)."""

    def add(op: str, inputs: list[ir.Value], base: str, **attrs) -> ir.Value:
        return insert(graph, gqa, op, inputs, name(f"rolling_rows/{base}"), **attrs)

    def const(values: list[int] | int, base: str) -> ir.Value:
        return insert(
            graph,
            gqa,
            "Constant",
            [],
            name(f"rolling_rows/{base}"),
            value=ir.tensor(np.array(values, np.int64)),
        )

    seqlens, total = lengths
    one, zero = const(1, "one"), const(0, "zero")
    rows = add("Min", [add("Cast", [total], "total", to=ir.DataType.INT64), const(keep, "keep")], "length")
    held = add("Add", [add("Cast", [seqlens], "seqlens", to=ir.DataType.INT64), one], "held")
    start = add("Max", [add("Sub", [held, rows], "first"), zero], "start")
    steps = add("Range", [zero, rows, one], "steps")
    grid = add("Add", [add("Unsqueeze", [start, const([1], "axes")], "column"), steps], "grid")
    indices = add("Unsqueeze", [grid, const([1, 3], "outer")], "indices")
    batch = add("Shape", [indices], "batch", start=0, end=1)
    tail = add("Shape", [indices], "tail", start=2, end=4)
    shape = add("Concat", [batch, const([kv_heads], "kv_heads"), tail], "shape", axis=0)
    return add("Expand", [indices, shape], "every_head")


def last_rows(graph: ir.Graph, gqa: ir.Node, present: ir.Value, indices: ir.Value, name: str) -> ir.Value:
    """``present`` ``[batch, kv_heads, P + S, head]`` at :func:`row_indices`' rows (after ``gqa``)."""
    gather = ir.node("GatherND", [present, indices], {"batch_dims": 2}, name=name)
    gather.outputs[0].name = name
    graph.insert_after(gqa, gather)
    return gather.outputs[0]


def cast_fp8_windows(graph: ir.Graph) -> int:
    """Gather float8 rolling presents through float16 (GatherND takes no float8); returns how many."""
    done = 0
    for node in list(graph):
        source = node.inputs[0] if node.inputs else None
        if not is_row_gather(node) or source is None or source.dtype is None or source.dtype in _GATHER_TYPES:
            continue
        dtype = source.dtype
        wide = insert(graph, node, "Cast", [source], f"{node.name}/to_float16", to=ir.DataType.FLOAT16)
        wide.dtype = ir.DataType.FLOAT16
        node.replace_input_with(0, wide)
        result = node.outputs[0]
        gathered = ir.Value(name=f"{node.name}/float16", type=ir.TensorType(ir.DataType.FLOAT16))
        narrow = ir.node("Cast", [gathered], {"to": dtype}, name=f"{node.name}/to_{dtype.name.lower()}")
        replacement = ir.node(
            "GatherND", list(node.inputs), {"batch_dims": 2}, name=node.name, outputs=[gathered]
        )
        graph.insert_before(node, replacement)
        graph.insert_after(replacement, narrow)
        result.replace_all_uses_with(narrow.outputs[0], replace_graph_outputs=True)
        name, shape = result.name, result.shape
        graph.remove(node, safe=True)
        narrow.outputs[0].name, narrow.outputs[0].shape = name, shape
        narrow.outputs[0].type = ir.TensorType(dtype)
        done += 1
    return done


def follow_present_types(graph: ir.Graph) -> int:
    """Give each rolling present the type of the attention present it gathers from (after a pass
    such as the emulation retyped that present); returns how many it changed."""
    changed = 0
    for node in graph:
        if node.op_type != "GroupQueryAttention":
            continue
        for present in node.outputs[1:3]:
            out = present_output(present)
            if out is None or out is present or present.dtype is None or out.dtype == present.dtype:
                continue
            value: ir.Value = present
            while value is not out:  # the GatherND, or Cast / GatherND / Cast for fp8
                (user, _), *_ = value.uses()
                if user.op_type == "Cast":
                    user.attributes["to"] = ir.AttrInt64("to", present.dtype)
                value = user.outputs[0]
                value.type = ir.TensorType(present.dtype)
                if present.shape is not None and value.shape is not None and len(value.shape) == 4:
                    value.shape = ir.Shape([*value.shape[:3], present.shape[3]])
            changed += 1
    return changed
