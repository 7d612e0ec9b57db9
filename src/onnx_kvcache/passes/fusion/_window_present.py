"""Presents of cropped sliding-window caches: a ``Slice`` of the attention node's present.

transformers 5.x keeps a sliding-window layer's cache as its last ``window - 1`` tokens;
the fused model computes that as ``Slice(present, [-keep], [INT64_MAX], [2])`` after the
GroupQueryAttention node (docs/exporting.md, "Sliding-window caches"), so a present output
is either the node's own output or that Slice's. ONNX ``Slice`` takes no float8 type, so an
fp8 cache's window is sliced through float16 (``Cast``, ``Slice``, ``Cast``: exact, every
float8e4m3fn value is a float16 value).
"""

from __future__ import annotations

__all__ = ["cast_fp8_windows", "follow_present_types", "present_output", "tail_slice"]

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes._graph import insert

_SLICE_TYPES = frozenset(
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


def _ints(value: ir.Value | None) -> list[int] | None:
    tensor = value.const_value if value is not None else None
    producer = value.producer() if value is not None else None
    if tensor is None and producer is not None and producer.op_type == "Constant":
        attr = producer.attributes.get("value")
        tensor = attr.value if attr is not None and attr.type == ir.AttributeType.TENSOR else None
    if tensor is None or tensor.size > 8:
        return None
    array = np.asarray(tensor.numpy())
    return [int(x) for x in array.reshape(-1)] if array.dtype.kind in "iu" else None


def _is_tail(node: ir.Node) -> bool:
    """``Slice(x, [-n], [end], [2])``: the last ``n`` rows of a BNSH cache."""
    if node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or not 4 <= len(node.inputs) <= 5:
        return False
    starts, ends, axes = (_ints(v) for v in node.inputs[1:4])
    steps = _ints(node.inputs[4]) if len(node.inputs) == 5 and node.inputs[4] is not None else [1]
    return (
        starts is not None
        and len(starts) == 1
        and starts[0] < 0
        and ends is not None
        and len(ends) == 1
        and ends[0] >= 2**31
        and axes in ([2], [-2])
        and steps == [1]
    )


def tail_slice(value: ir.Value | None) -> ir.Node | None:
    """The Slice of ``value``'s last rows whose output is a graph output, if that is its one reader."""
    if value is None or value.is_graph_output():
        return None
    users = [user for user, _ in value.uses()]
    if len(users) != 1 or not _is_tail(users[0]) or users[0].inputs[0] is not value:
        return None
    return users[0] if users[0].outputs[0].is_graph_output() else None


def _only_reader(value: ir.Value | None, op_type: str) -> ir.Node | None:
    users = [user for user, _ in value.uses()] if value is not None else []
    return users[0] if len(users) == 1 and users[0].op_type == op_type else None


def present_output(value: ir.Value | None) -> ir.Value | None:
    """The graph output a present cache leaves as: itself, its window Slice's output, or
    for fp8 the output of ``Cast(Slice(Cast(value, float16)))``."""
    node = tail_slice(value)
    if node is not None:
        return node.outputs[0]
    wide = _only_reader(value, "Cast")
    window = _only_reader(wide.outputs[0], "Slice") if wide is not None else None
    narrow = _only_reader(window.outputs[0], "Cast") if window is not None and _is_tail(window) else None
    if narrow is not None and narrow.outputs[0].is_graph_output():
        return narrow.outputs[0]
    return value


def cast_fp8_windows(graph: ir.Graph) -> int:
    """Slice float8 window presents through float16 (Slice takes no float8); returns how many."""
    done = 0
    for node in list(graph):
        source = node.inputs[0] if node.inputs else None
        if not _is_tail(node) or source is None or source.dtype is None or source.dtype in _SLICE_TYPES:
            continue
        dtype = source.dtype
        wide = insert(graph, node, "Cast", [source], f"{node.name}/to_float16", to=ir.DataType.FLOAT16)
        wide.dtype = ir.DataType.FLOAT16
        node.replace_input_with(0, wide)
        result = node.outputs[0]
        sliced = ir.Value(name=f"{node.name}/float16", type=ir.TensorType(ir.DataType.FLOAT16))
        narrow = ir.node("Cast", [sliced], {"to": dtype}, name=f"{node.name}/to_{dtype.name.lower()}")
        # the Slice now writes float16 into `sliced`; the Cast writes the graph output
        replacement = ir.node("Slice", list(node.inputs), name=node.name, outputs=[sliced])
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
    """Give each window present the type of the attention present it slices (after a pass
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
            while value is not out:  # the Slice, or Cast / Slice / Cast for fp8
                (user, _), *_ = value.uses()
                if user.op_type == "Cast":
                    user.attributes["to"] = ir.AttrInt64("to", present.dtype)
                value = user.outputs[0]
                value.type = ir.TensorType(present.dtype)
                if present.shape is not None and value.shape is not None and len(value.shape) == 4:
                    value.shape = ir.Shape([*value.shape[:3], present.shape[3]])
            changed += 1
    return changed
