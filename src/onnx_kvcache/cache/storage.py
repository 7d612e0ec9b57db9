"""The caches a storage-quantized conversion keeps (``storage="qdq"``): how each format is stored
through QuantizeLinear/DequantizeLinear (:data:`QDQ_TYPES`), which nodes write a graph's present
from its past (:data:`QDQ_WRITERS`), and :func:`find_qdq_caches`, which finds them, float or
stored already. :class:`~onnx_kvcache.passes.QdqKvCachePass` converts them (its rules).
"""

from __future__ import annotations

__all__ = [
    "AttentionRead",
    "QDQ_TYPES",
    "QDQ_WRITERS",
    "QdqCache",
    "QdqType",
    "Writer",
    "attention_read",
    "find_qdq_caches",
    "storage_bytes_per_token",
    "stored_format",
    "values_per_token",
]

import dataclasses
import re

import ml_dtypes
import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat
from onnx_kvcache.cache.sites import layer_id_from_name

_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_SIDE = re.compile(r"(?:^|[._\-])(key|value|k|v)(?:[._\-]|$)|(key|value)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class QdqType:
    """How a format is stored through QuantizeLinear/DequantizeLinear."""

    dtype: ir.DataType
    """The cache's element type (int4: ONNX's logical INT4, not GroupQueryAttention's packed uint8)."""
    numpy: type
    """Its numpy type (ml_dtypes where numpy has none), for the zero point."""
    opset: int
    """The first opset whose QuantizeLinear and DequantizeLinear define the type."""
    shape_readable: bool = True
    """onnxruntime's CPU ``Shape`` and ``Size`` take the type (int4: no kernel)."""


#: One row per format (a model's opset must define the type).
QDQ_TYPES: dict[str, QdqType] = {
    "int8": QdqType(ir.DataType.INT8, np.int8, 10),
    "fp8": QdqType(ir.DataType.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, 19),
    "int4": QdqType(ir.DataType.INT4, ml_dtypes.int4, 21, shape_readable=False),
}


@dataclasses.dataclass(frozen=True)
class Writer:
    """A node that makes a graph's present from its past."""

    op_type: str
    past: int
    """The past's input slot."""
    present: int
    """The present's output slot."""
    new: int | None
    """The new rows' input slot; None for a writer that computes with the cache."""
    on_codes: frozenset[str] = frozenset()
    """The formats whose codes it moves as they are (onnxruntime's CPU kernel takes their type:
    int8; fp8 and int4 have no TensorScatter kernel, and Concat's schema lacks them)."""
    inputs: int | None = None
    """The number of inputs it must have (None: any)."""

    def moves_codes(self, fmt: CacheFormat) -> bool:
        """It moves rows (the pass's rule 2), and runs on ``fmt``'s type."""
        return self.new is not None and fmt.name in self.on_codes


#: The writers a cache is found through, one row per (operator, past slot).
QDQ_WRITERS: tuple[Writer, ...] = (
    Writer("Concat", 0, 0, 1, frozenset({"int8"}), inputs=2),
    Writer("TensorScatter", 0, 0, 1, frozenset({"int8"})),
    Writer("Attention", 4, 1, None),
    Writer("Attention", 5, 2, None),
)


@dataclasses.dataclass(frozen=True)
class QdqCache:
    """One cache found: its past input, present output, writer, side and layer."""

    past: ir.Value
    present: ir.Value
    writer: ir.Node
    row: Writer
    side: str
    """``"k"`` or ``"v"``."""
    layer: int

    @property
    def stored(self) -> bool:
        """The past is not a float: the cache is stored quantized already."""
        return self.past.dtype not in _FLOATS


def _side(name: str | None) -> str | None:
    """``"k"`` or ``"v"``: the name's last key/value word (``past_key_values.0.value``: v)."""
    matches = list(_SIDE.finditer(name or ""))
    return None if not matches else (matches[-1].group(1) or matches[-1].group(2))[0].lower()


def _row(node: ir.Node, slot: int) -> Writer | None:
    for row in QDQ_WRITERS:
        same = node.op_type == row.op_type and node.domain in ("", "ai.onnx") and row.past == slot
        if same and (row.inputs is None or len(node.inputs) == row.inputs):
            return row
    return None


def _concat_on_sequence(node: ir.Node, past: ir.Value) -> bool:
    """A Concat joins rows: its axis is the sequence axis of a 3-D or 4-D cache (-2, or 1/2)."""
    axis = node.attributes.get_int("axis", 0)
    rank = len(past.shape) if past.shape is not None else None
    return rank in (3, 4) and axis in (-2, rank - 2)


def _read_through(value: ir.Value, ops: tuple[str, ...], slot: int) -> list[tuple[ir.Node, int]]:
    """The uses of ``value``, and of what a node of ``ops`` reading it at input ``slot`` makes
    (a stored cache read through its DequantizeLinear, and a Mul by channel scales)."""
    uses = []
    for node, index in value.uses():
        uses.append((node, index))
        if node.op_type in ops and index == slot and node.outputs:
            uses += _read_through(node.outputs[0], ops, 0)
    return uses


def _leaving(value: ir.Value, outputs: set[int]) -> ir.Value | None:
    """``value`` when the graph returns it, else the graph output a QuantizeLinear (after a Div
    by channel scales) makes of it."""
    if id(value) in outputs:
        return value
    for node, index in _read_through(value, ("Div",), 0):
        if node.op_type == "QuantizeLinear" and index == 0 and id(node.outputs[0]) in outputs:
            return node.outputs[0]
    return None


def find_qdq_caches(graph: ir.Graph) -> list[QdqCache]:
    """The caches of ``graph``, in graph-input order (a cache stored
    already too: its writer read through DequantizeLinear, its present made by QuantizeLinear)."""
    outputs = {id(v) for v in graph.outputs}
    found = []
    for past in graph.inputs:
        for node, slot in _read_through(past, ("DequantizeLinear", "Mul"), 0):
            row = _row(node, slot)
            if row is None or row.present >= len(node.outputs):
                continue
            present = _leaving(node.outputs[row.present], outputs)
            if present is None or (row.op_type == "Concat" and not _concat_on_sequence(node, past)):
                continue
            side, layer = _side(past.name), layer_id_from_name(past.name)
            if side is not None and layer is not None:
                found.append(QdqCache(past, present, node, row, side, layer))
                break
    return found


def stored_format(model: ir.Model) -> str | None:
    """The format whose type :func:`find_qdq_caches`' stored caches have (None: none stored)."""
    stored = {c.past.dtype for c in find_qdq_caches(model.graph) if c.stored}
    return next((name for name, row in QDQ_TYPES.items() if row.dtype in stored), None)


def values_per_token(cache: QdqCache) -> int | None:
    """One token's values in ``cache``: its static dimensions but the batch and the sequence
    (``[batch, seq, width]`` or ``[batch, heads, seq, head]``); None when one is symbolic."""
    shape = cache.past.shape
    if shape is None or len(shape) not in (3, 4):
        return None
    dims = [d for i, d in enumerate(shape) if i not in (0, len(shape) - 2)]
    sizes = [d for d in dims if isinstance(d, int)]
    return int(np.prod(sizes)) if len(sizes) == len(dims) else None


def storage_bytes_per_token(model: ir.Model, format: str | None = None) -> float | None:
    """One token's bytes in every cache :func:`find_qdq_caches` finds, in their own types
    (``format``: stored in it); None when a cache's width is symbolic."""
    total = 0.0
    for cache in find_qdq_caches(model.graph):
        values = values_per_token(cache)
        dtype = QDQ_TYPES[format].dtype if format is not None else cache.past.dtype
        if values is None or dtype is None:
            return None
        total += values * dtype.itemsize
    return total


_STORED_READS = ("DequantizeLinear", "Mul")
_LEAVING = ("QuantizeLinear", "Div")


@dataclasses.dataclass(frozen=True)
class AttentionRead:
    """The ONNX ``Attention`` that reads a cache as it is stored: its writer, or the one reader of
    the buffer its writer updates. Where a rotation of the cache is placed: the new rows turned,
    the query (and the output) too."""

    cache: QdqCache
    node: ir.Node
    """The Attention."""
    new: tuple[ir.Node, int]
    """The node and input slot the cache's new rows enter by."""
    heads: int
    """The cache's heads (``kv_num_heads``)."""
    head_size: int
    """The cache's head size (the key's or the value's)."""
    query_heads: int
    key_head_size: int
    """The query's and the key's head size (attention's ``q . k``)."""
    split: bool
    """3-D inputs (``[batch, seq, heads * head]``): a head is turned through a Reshape."""


def _static(shape: ir.Shape | None, axis: int) -> int | None:
    dim = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
    return dim if isinstance(dim, int) and dim > 0 else None


def _only_attention(cache: QdqCache, slot: int) -> ir.Node | None:
    """The Attention reading ``cache``'s present at ``slot`` (as stored: through its
    DequantizeLinear), when nothing else but the QuantizeLinear storing it reads it; else None."""
    present = cache.writer.outputs[cache.row.present]
    readers = _read_through(present, _STORED_READS + _LEAVING, 0)
    attention = [n for n, i in readers if n.op_type == "Attention" and not n.domain and i == slot]
    others = [n for n, _ in readers if n.op_type not in _STORED_READS + _LEAVING and n not in attention]
    return attention[0] if len(attention) == 1 and not others else None


def _past_read_elsewhere(cache: QdqCache) -> bool:
    """Something but its writer (and Shape/Size) reads ``cache``'s past."""
    for node, _ in _read_through(cache.past, _STORED_READS, 0):
        if node is not cache.writer and node.op_type not in (*_STORED_READS, "Shape", "Size"):
            return True
    return False


def attention_read(cache: QdqCache) -> AttentionRead | None:
    """The ONNX ``Attention`` that reads ``cache`` (:class:`AttentionRead`), or None where none
    reads it alone (multi-head latent attention's up-projections, attention of plain operators,
    a buffer read by anything else) or its heads are not static."""
    slot = 1 if cache.side == "k" else 2
    if cache.row.op_type == "Attention":
        node: ir.Node | None = cache.writer
        new = (cache.writer, slot)
    else:
        node = _only_attention(cache, slot)
        assert cache.row.new is not None
        new = (cache.writer, cache.row.new)
    if node is None or _past_read_elsewhere(cache) or len(node.inputs) < 3:
        return None
    query, key, read = node.inputs[0], node.inputs[1], node.inputs[slot]
    rank = len(query.shape) if query is not None and query.shape is not None else None
    if rank == 3:
        heads, query_heads = (
            node.attributes.get_int("kv_num_heads", 0),
            node.attributes.get_int("q_num_heads", 0),
        )
        width, key_width = (_static(v.shape if v is not None else None, -1) for v in (read, key))
        if not (heads and query_heads and width and key_width) or width % heads or key_width % heads:
            return None
        return AttentionRead(cache, node, new, heads, width // heads, query_heads, key_width // heads, True)
    shapes = [v.shape if v is not None else None for v in (query, read, key)]
    kv_heads, head = _static(shapes[1], 1), _static(shapes[1], -1)  # [batch, heads, seq, head]
    q_heads, key_head = _static(shapes[0], 1), _static(shapes[2], -1)
    if rank != 4 or not (kv_heads and head and q_heads and key_head):
        return None
    return AttentionRead(cache, node, new, kv_heads, head, q_heads, key_head, False)
