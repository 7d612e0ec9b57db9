"""What attention reads Q, K and V through: copies, float Casts, and K/V heads repeated by Tile.

Rules (each proven with the evaluator; what does not hold raises ``Unprovable``):

- **Copies.** ``Identity``, a ``Slice`` that keeps every element, an ``Expand`` to its input's
  own shape (``x.repeat(...)`` exports as ``Tile(Expand(x, ones), repeats)``) and a ``Cast`` to
  the type its input already has (``q.to(torch.float32)`` in a float32 model, as GPT-J's
  attention writes it) compute their input: they are read as it (:func:`is_copy`).
- **Widening casts.** A ``Cast`` of Q or K from float16/bfloat16 to float32 (an fp16 model whose
  attention upcasts its scores) is what GroupQueryAttention computes when both Q and K are
  widened from the cache's type and V is not: the products of fp16 values are exact in float32,
  GQA accumulates ``Q @ K^T`` and takes the softmax in float32 and multiplies the probabilities,
  in the cache's type, by V (:func:`read_through`). Any other Cast between float types (a
  narrowing one, V widened, a second widening) is refused, naming the Cast.
- **Tile.** ``Tile(x, [1, r, 1, 1])`` repeats the KV heads as a block: repeated head ``t`` is
  KV head ``t mod kv_heads``, where GQA (and repeat_kv) group query head ``h`` with KV head
  ``h // (heads / kv_heads)`` (:func:`tile_repeat`). With ``m = heads / (kv_heads * r)`` query
  heads per repeated head, query head ``h = (j * kv_heads + g) * m + i`` reads KV head ``g``;
  reordered to ``p = (g * r + j) * m + i`` (:func:`tiled_order`) it is GQA's head ``p``, whose
  group is ``g``. The fusion gives GQA the query heads in that order and puts its output
  heads back (graph-only: a Reshape/Transpose/Reshape each side, no weight touched).
"""

from __future__ import annotations

__all__ = ["FLOATS", "is_copy", "read_through", "tile_repeat", "tiled_order", "widening"]

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes.fusion._piecewise import same_dims
from onnx_kvcache.passes.fusion._symbolic import ZERO, SymbolicEvaluator, Unprovable

FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_NARROW = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def _onnx(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _cast_types(ev: SymbolicEvaluator, node: ir.Node) -> tuple[ir.DataType | None, ir.DataType | None]:
    """(the type a Cast reads, the type it writes; None: not known, or not a type)."""
    to = node.attributes.get("to")
    try:
        target = ir.DataType(to.as_int()) if to is not None and to.type == ir.AttributeType.INT else None
    except ValueError:
        target = None
    return ev.dtype(node.inputs[0]), target


def is_copy(ev: SymbolicEvaluator, node: ir.Node) -> bool:
    """``node`` computes its first input: Identity, a whole Slice, an Expand to the input's own
    shape, a Cast to the input's own type."""
    if node.domain not in ("", "ai.onnx") or not node.inputs or node.inputs[0] is None:
        return False
    if node.op_type == "Identity":
        return True
    if node.op_type == "Cast":
        source, target = _cast_types(ev, node)
        return target is not None and source == target
    if node.op_type not in ("Slice", "Expand"):
        return False
    try:
        kept = same_dims(ev.shape(node.outputs[0]), ev.shape(node.inputs[0]))
    except Unprovable:
        return False
    return kept and (node.op_type == "Expand" or _whole_slice(ev, node))


def _whole_slice(ev: SymbolicEvaluator, node: ir.Node) -> bool:
    """A Slice that keeps every element: starts 0, steps 1 (its shape is its input's)."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    try:
        starts = ev.values(inputs[1], "Slice starts")
        steps = ev.const_ints(inputs[4], "Slice steps") if inputs[4] is not None else None
    except Unprovable:
        return False
    return all(s == ZERO for s in starts) and (steps is None or set(steps) <= {1})


def widening(ev: SymbolicEvaluator, node: ir.Node) -> ir.DataType | None:
    """The type a Cast widens from float16/bfloat16 to float32, or None."""
    if not _onnx(node, "Cast"):
        return None
    source, target = _cast_types(ev, node)
    return source if source in _NARROW and target == ir.DataType.FLOAT else None


def read_through(
    ev: SymbolicEvaluator, value: ir.Value, chain: list[ir.Node], what: str
) -> tuple[ir.Value, ir.DataType | None]:
    """``value`` before the copies and the one widening Cast attention reads ``what`` (Q, K or
    V) through (added to ``chain``), and the type that Cast widens from (None: none)."""
    widened = None
    while (node := value.producer()) is not None and node not in chain:  # (a cycle: malformed)
        cast = _onnx(node, "Cast")
        if is_copy(ev, node) or (cast and widened is None and (widened := widening(ev, node)) is not None):
            chain.append(node)
        elif cast and set(_cast_types(ev, node)) <= FLOATS:
            source, target = _cast_types(ev, node)
            raise Unprovable(
                f"{what} reaches attention through Cast node {node.name!r} from {_name(source)} to "
                f"{_name(target)}{' after a widening one' if widened else ''}: the export computes "
                "attention in another precision than the float16/bfloat16 inputs widened to float32 "
                "that GroupQueryAttention computes in"
            )
        else:
            return value, widened
        source_value = node.inputs[0]
        assert source_value is not None
        value = source_value
    return value, widened


def _name(dtype: ir.DataType | None) -> str:
    return dtype.name.lower() if dtype is not None else "an unknown type"  # (not reached: FLOATS)


def tile_repeat(ev: SymbolicEvaluator, node: ir.Node) -> int:
    """``r`` when ``node`` is ``Tile(x, [1, r, 1, 1])`` of a 4-D ``x`` (KV heads repeated as a
    block), else Unprovable."""
    repeats = ev.const_ints(node.inputs[1] if len(node.inputs) > 1 else None, "Tile repeats")
    if repeats is None or len(repeats) != 4 or repeats[0] != 1 or repeats[2:] != [1, 1] or repeats[1] < 1:
        raise Unprovable(
            f"K/V reach attention through Tile node {node.name!r} with repeats {repeats}, not "
            "[1, r, 1, 1] (KV heads repeated as a block)"
        )
    return repeats[1]


def tiled_order(heads: int, kv_heads: int, tiles: int) -> np.ndarray:
    """Query head ``h`` of the export at GQA's head ``p``: ``order[p] = h`` (module docstring)."""
    per = heads // (kv_heads * tiles)
    return np.arange(heads).reshape(tiles, kv_heads, per).transpose(1, 0, 2).reshape(-1)
