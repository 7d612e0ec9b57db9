"""The context a model's rotary tables cover: :func:`max_positions`.

RoPE reads one row of its cos/sin tables a position, so a graph whose tables are static
constants serves at most their rows. Where the table stands is a row of :data:`ROTARY_TABLES`
(in the attention node, or in a RotaryEmbedding before it), and a per-token cos is followed back
through the nodes of :data:`ROW_GATHERS` to the table it was gathered from.
"""

from __future__ import annotations

__all__ = ["ROTARY_TABLES", "ROW_GATHERS", "RotaryTable", "max_positions", "table_rows"]

import dataclasses

import onnx_ir as ir

from onnx_kvcache.cache.operators import GqaInput, PagedInput


@dataclasses.dataclass(frozen=True)
class RotaryTable:
    """Where a node that applies RoPE reads its cos table (one row a position)."""

    domain: str
    op_type: str
    cos: int
    """The input index of ``cos_cache``."""
    flag: str | None = None
    """The attribute that turns RoPE on, when the node may not rotate (``do_rotary``)."""


#: Where RoPE's cos table stands: in the attention node (``do_rotary=1``), in the
#: com.microsoft RotaryEmbedding a rotated cache moves it to, or in ONNX's RotaryEmbedding
#: (opset 23; without ``position_ids`` its ``cos_cache`` is already one row a token, gathered
#: from the table: :data:`ROW_GATHERS`).
ROTARY_TABLES = (
    RotaryTable("com.microsoft", "GroupQueryAttention", int(GqaInput.COS_CACHE), "do_rotary"),
    RotaryTable("com.microsoft", "PagedAttention", int(PagedInput.COS_CACHE), "do_rotary"),
    RotaryTable("com.microsoft", "RotaryEmbedding", 2),
    RotaryTable("", "RotaryEmbedding", 1),
)

#: ``(domain, op_type)`` of the nodes a per-token cos stands behind -> the input it reads:
#: ``Gather`` (axis 0) picks the table's rows by position, ``Cast`` and ``Identity`` keep them.
ROW_GATHERS = {("", "Gather"): 0, ("", "Cast"): 0, ("", "Identity"): 0}


def table_rows(cos: ir.Value | None) -> int | None:
    """The rows of the static table behind ``cos``: its own (a 2-D table), else those of the
    table a ``Gather`` on axis 0 picked it from (:data:`ROW_GATHERS`)."""
    while cos is not None and (cos.shape is None or len(cos.shape) != 2):
        node = cos.producer()
        index = None if node is None else ROW_GATHERS.get((node.domain, node.op_type))
        axis = None if node is None else node.attributes.get("axis")
        if node is None or index is None or (axis is not None and axis.as_int() != 0):
            return None
        cos = node.inputs[index]
    rows = None if cos is None or cos.shape is None else cos.shape[0]
    return rows if isinstance(rows, int) and rows > 0 else None


def max_positions(model: ir.Model) -> int | None:
    """Positions the rotary tables cover (the model's context limit), when static: read
    wherever RoPE stands (:data:`ROTARY_TABLES`), in the attention node or in a RotaryEmbedding
    before it, its table given or gathered by position (:func:`table_rows`)."""
    tables = {(t.domain, t.op_type): t for t in ROTARY_TABLES}
    limits = []
    owners: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
    for node in (n for owner in owners for n in ir.traversal.RecursiveGraphIterator(owner)):
        table = tables.get((node.domain, node.op_type))
        if table is None or len(node.inputs) <= table.cos:
            continue
        flag = node.attributes.get(table.flag) if table.flag is not None else None
        if table.flag is not None and (flag is None or not flag.as_int()):
            continue
        rows = table_rows(node.inputs[table.cos])
        if rows is not None:
            limits.append(rows)
    return min(limits) if limits else None
