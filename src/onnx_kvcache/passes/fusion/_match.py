"""What an attention fusion proves about one attention, and how it writes the GQA node.

The fusion passes (:mod:`onnx_kvcache.passes.fusion.attention_fusion`, ...) match an
exporter's attention and build an :class:`AttentionMatch` from facts proven with
:mod:`onnx_kvcache.passes.fusion._symbolic`; :class:`GqaWriter` then replaces it with one
``com.microsoft::GroupQueryAttention`` node. The rules:

- **Cache.** K and V are ``Concat(past, new)`` on the sequence axis, ``past`` an input
  and the concatenation an output of the graph (maybe through Identity; read otherwise
  only by Shape), reaching
  attention directly or through transformers' ``repeat_kv`` (Unsqueeze at axis 2,
  Expand of that axis only, Reshape folding it into the head axis: query head ``h``
  reads KV head ``h // group``, as GQA does). Or a cropped sliding-window cache
  (:class:`WindowCache`): ``Concat(Slice(past, -crop), new)`` read by attention, its
  ``Slice(-keep)`` the present; GQA then reads the uncropped past and a Slice after it
  gives the present.
- **Mask.** The mask condition, over batch ``b``, query row ``i``, key column ``j`` and
  cache length ``P``, is exactly ``j <= P + i`` AND ``attention_mask[b, j]`` and
  optionally ``j > P + i - W`` (GQA's ``local_window_size = W``). Without the padding
  term, the attention ignores the attention mask and so does the fused node.
- **Positions counted from the mask** (mobius's gemma3, granite, olmo2, smollm3): with
  ``c = CumSum(attention_mask)`` along the columns, the query's position ``c[b, P + i]``
  compared with the key's ``c[b, j]``. With entries 0 or 1 (an attention mask's contract:
  this proof assumes it, the others read any nonzero entry as a token and assume nothing
  of the values) and ``attention_mask[b, j]`` in the condition, ``c[b, P + i] >= c[b, j]``
  is exactly ``j <= P + i`` (a later valid key counts at least one more). And
  ``c[b, P + i] - c[b, j] < W`` counts the valid tokens in ``(j, P + i]``: for a valid key
  and query that is the distance of their compacted positions ``c - 1``, which is where
  the fusion puts each row's valid tokens (below), so it is exactly GQA's
  ``local_window_size = W`` over its cache, for any padding (a padding query's row is not
  a token's: its output is not compared, as for every padding mask). A window counted so
  is not combined with a window of key indices.
- **Shapes.** 4-D (BNSH) Q, K, V; static head counts; a head size that is a multiple
  of 8 (GQA's requirement), the same for V. (An ONNX ``Attention`` holding its own cache
  may take 3-D (BSH) Q, K, V, which GQA reads as they are, and its output is BSH.)

GQA takes ``seqlens_k = max(sum(attention_mask != 0, axis=1) - 1, 0)`` (a row without a token
reads as one, which only padding attends to) and
``total_sequence_length = attention_mask.shape[1]``, computed once per graph. GQA reads a
row's valid tokens as its first ones, so with a padding mask the node receives the new
tokens reordered, each row's valid ones first (a stable order, computed once per graph),
and its output is put back in the caller's order: a left-padded prompt is then computed
as the same prompt right-padded, and the cache holds each row's valid tokens compacted at
its start. Rotary embeddings and q/k norms stay where the exporter put them
(``do_rotary=0``): the node receives K already rotated, as the export's cache holds it.
The attention output's ``Reshape(Transpose(y, [0, 2, 1, 3]), [B, S, heads * head])`` reads
GQA's BSH output itself, ``y`` also reached through Reshapes proven to keep its shape
(transformers 5's TorchScript export writes one, its shape read from the repeated V); any
other reader reads the output turned back to BNSH. What only the replaced nodes read goes
with them (the repeat_kv chains, the shape computations).
"""

from __future__ import annotations

__all__ = [
    "AttentionMatch",
    "CacheLink",
    "GqaWriter",
    "MaskFacts",
    "WindowCache",
    "cache_link",
    "cache_mask_facts",
    "mask_condition",
    "mask_facts",
    "running_count",
]

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.operators import GQA, GqaInput, GqaOutput
from onnx_kvcache.passes._graph import insert
from onnx_kvcache.passes.fusion import _symbolic_ops  # noqa: F401  (the rules for graphs without value_info)
from onnx_kvcache.passes.fusion._symbolic import (
    ONE,
    ZERO,
    Additive,
    Affine,
    Conj,
    Le,
    MaskAt,
    Symbol,
    SymbolicEvaluator,
    SymbolKind,
    Unprovable,
    axis,
    reshape_dims,
)

BATCH, HEAD, QUERY, KEY = (Symbol.index(name) for name in ("batch", "head", "query", "key"))
_B, _I, _J = Affine.of(BATCH), Affine.of(QUERY), Affine.of(KEY)
ATTENTION_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


@dataclasses.dataclass(frozen=True)
class MaskFacts:
    """What a proven mask does: causal, an optional window, the padding input read."""

    causal: bool = False
    window: int | None = None
    """Keys ``j > P + i - window`` (GQA ``local_window_size``), or None."""
    padding: str | None = None
    """The 2-D graph input read as ``attention_mask[b, j]``, or None."""
    counted: bool = False
    """The window counts the padding input's valid tokens (a CumSum of it), not key indices:
    GQA's window over the compacted cache is exactly that for any padding."""


def mask_condition(ev: SymbolicEvaluator, mask: ir.Value, *, query_len: Affine, kv_len: Affine) -> Conj:
    """The mask as a condition over batch, head, query and key indices (boolean, or 0/-inf additive)."""
    try:
        tensor = ev.eval(mask)
        elem = tensor.element()
    except Unprovable:
        counted = running_count(mask)
        if counted is None:
            raise
        raise Unprovable(
            f"it compares token positions counted by CumSum of {counted} (a position-based "
            "causal/sliding-window mask), not key and query indices"
        ) from None
    if tensor.rank > 4:
        raise Unprovable("the mask has more than 4 dimensions")
    cond = elem.cond if isinstance(elem, Additive) else elem
    if not isinstance(cond, Conj):
        raise Unprovable("the mask is neither boolean nor a 0/-inf additive mask")
    names = (BATCH, HEAD, QUERY, KEY)[4 - tensor.rank :]
    dims = dict(zip(names, tensor.shape))
    if dims.get(KEY) != kv_len:  # ONNX Attention pads a shorter mask with -inf, not broadcast
        raise Unprovable(f"the mask has {dims.get(KEY, ONE)} key columns, the cache {kv_len}")
    if dims.get(QUERY, ONE) not in (query_len, ONE):
        raise Unprovable(f"the mask has {dims[QUERY]} query rows, the query {query_len}")
    mapping = {
        axis(k): Affine(const=0) if dim == ONE else Affine.of(name)
        for k, (name, dim) in enumerate(zip(names, tensor.shape))
    }
    return cond.subs(mapping)


def running_count(mask: ir.Value, limit: int = 200) -> str | None:
    """The input of a ``CumSum`` the mask is computed from (mobius's position-based masks for
    gemma3, granite, olmo2: ``cumsum(attention_mask)`` of query and key compared), or None."""
    seen: set[int] = set()
    todo = [mask]
    while todo and len(seen) < limit:
        node = todo.pop().producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "CumSum" and node.domain in ("", "ai.onnx"):
            source = node.inputs[0]
            return source.name if source is not None and source.name else "a tensor"
        todo.extend(v for v in node.inputs if v is not None)
    return None


def _always_true(lhs: Affine) -> bool:
    """``lhs <= 0`` for all values: every symbol here (index, length) is non-negative."""
    return lhs.const <= 0 and all(c <= 0 for _, c in lhs.terms)


def mask_facts(cond: Conj, *, past: Affine, batch: Affine | None = None) -> MaskFacts:
    """Classify each condition of a mask; raise on any that is not causal/window/padding.

    ``batch``: the attention's batch size; when it is statically 1, ``attention_mask[0, j]``
    (how a static-shape export indexes it) is row ``b``'s lookup.
    """
    if cond.is_false:
        raise Unprovable("the mask masks everything")
    causal_lhs = _J - _I - past  # j - i - P <= 0
    causal, window, padding = False, None, None
    counts: set[str] = set()  # the inputs whose running sums the mask compares
    counted_window: int | None = None
    for atom in cond.atoms:
        if isinstance(atom, Le) and atom.lhs.lookups:
            source, width = _counted_atom(atom.lhs, past=past, batch=batch)
            counts.add(source)
            if width is None:
                causal = True
            else:
                counted_window = width if counted_window is None else min(counted_window, width)
            continue
        if isinstance(atom, MaskAt):
            row = _B if batch == ONE and atom.row == ZERO else atom.row
            if row != _B or atom.col != _J:
                raise Unprovable(f"the mask reads {atom.source}[{atom.row}, {atom.col}], not [batch, key]")
            if padding not in (None, atom.source):
                raise Unprovable(f"the mask reads two padding inputs ({padding}, {atom.source})")
            padding = atom.source
            continue
        assert isinstance(atom, Le)
        lhs = atom.lhs
        if lhs == causal_lhs:
            causal = True
        elif (lhs + causal_lhs).is_const and 1 - (lhs + causal_lhs).const >= 1:
            width = 1 - (lhs + causal_lhs).const  # i + P - W - j + 1 <= 0  <=>  j > i + P - W
            window = width if window is None else min(window, width)
        elif _always_true(lhs):
            continue
        elif lhs.coefficient(KEY) == 1 and lhs.coefficient(QUERY) == -1:
            offset = -(lhs - _J + _I)
            raise Unprovable(
                f"the causal diagonal is at key <= query + {offset}, not + the cache length {past}"
            )
        else:
            raise Unprovable(f"the mask condition {lhs} <= 0 is neither causal, a window nor padding")
    if counts:
        if counts != {padding}:
            raise Unprovable(
                f"the mask compares positions counted by CumSum of {', '.join(sorted(counts))} "
                f"but masks the keys of {padding or 'no padding input'}: without the valid keys "
                "masked, counted positions are not key positions"
            )
        if counted_window is not None and window is not None:
            raise Unprovable("the mask has both a window of key indices and one of counted positions")
        if counted_window is not None:
            return MaskFacts(causal, counted_window, padding, counted=True)
    return MaskFacts(causal, window, padding)


def _counted_atom(lhs: Affine, *, past: Affine, batch: Affine | None) -> tuple[str, int | None]:
    """``(input, None)`` for ``c[b, j] - c[b, P + i] <= 0`` (causal), ``(input, W)`` for
    ``c[b, P + i] - c[b, j] - (W - 1) <= 0`` (a window of ``W`` counted tokens), where
    ``c = cumsum(input)`` along its columns; Unprovable for any other use of a lookup."""
    if any(symbol.kind is SymbolKind.ENTRY for symbol in lhs.lookups):
        raise Unprovable(
            f"the mask condition {lhs} <= 0 compares an input's values (a padding input is read "
            "only as nonzero or zero)"
        )
    query, key, source = None, None, None
    for symbol, coefficient in lhs.terms:
        at = symbol.at
        if symbol.kind is not SymbolKind.COUNT or at is None or abs(coefficient) != 1:
            break
        row = _B if batch == ONE and at.row == ZERO else at.row
        if row != _B or source not in (None, at.source):
            break
        source = at.source
        if at.col == _I + past and query is None:
            query = coefficient
        elif at.col == _J and key is None:
            key = coefficient
        else:
            break
    else:
        if source is not None and query is not None and key == -query and len(lhs.terms) == 2:
            if query == -1 and lhs.const == 0:  # c[b, P + i] >= c[b, j]
                return source, None
            if query == 1 and 1 - lhs.const >= 1:  # c[b, P + i] - c[b, j] < 1 - const
                return source, 1 - lhs.const
    raise Unprovable(
        f"the mask condition {lhs} <= 0 reads counted positions other than the query's (at "
        f"key {past} + query) against the key's, in causal order or a window"
    )


@dataclasses.dataclass(frozen=True)
class CacheLink:
    """One cache: ``present = Concat(past, new)`` with past/present graph I/O."""

    past: ir.Value
    new: ir.Value
    present: ir.Value
    group: int
    """Query heads per KV head of the repeat in front of attention (1: none)."""
    window: WindowCache | None = None
    """Set for a cropped sliding-window cache (transformers 5.x); ``present`` is then the
    concatenation attention reads, not the graph output."""


@dataclasses.dataclass(frozen=True)
class WindowCache:
    """transformers 5.x's DynamicSlidingWindowLayer as exported.

    Attention reads ``Concat(Slice(past, -crop), new)`` (the crop is optional); the present
    graph output is ``Slice(that, -keep)``. GQA is given the uncropped past: with a window
    ``W <= crop + 1`` the cropped tokens are outside every query's window, so its output is
    the export's, and the last ``keep <= crop`` rows of its present are the export's present.
    """

    output: ir.Value
    """The present graph output (the Slice's output)."""
    keep: int
    """Rows the present keeps (``window - 1``)."""
    crop: int | None
    """Rows the past is cropped to before the Concat, or None."""
    shift: Affine
    """Full-cache key index minus the concatenation's key index (the cropped rows)."""
    nodes: tuple[ir.Node, ...]
    """The present Slice and the crop Slice, removed with the attention."""


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _whole_slice(ev: SymbolicEvaluator, node: ir.Node) -> bool:
    """``node`` is a Slice that keeps every element: starts 0, steps 1, its output's shape its
    input's (torch's unoptimized export writes ``x[:, :, None, :, :]`` so)."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    try:
        starts = ev.values(inputs[1], "Slice starts")
        steps = ev.const_ints(inputs[4], "Slice steps") if inputs[4] is not None else None
        whole = ev.shape(node.outputs[0]) == ev.shape(inputs[0])
    except Unprovable:
        return False
    return whole and all(s == ZERO for s in starts) and (steps is None or set(steps) <= {1})


def _through_copies(ev: SymbolicEvaluator, value: ir.Value | None, chain: list[ir.Node]) -> ir.Value | None:
    """``value`` before any Identity and whole-tensor Slices that produce it (added to ``chain``)."""
    while value is not None:
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return value
        if node.op_type == "Identity" or (node.op_type == "Slice" and _whole_slice(ev, node)):
            chain.append(node)
            value = node.inputs[0]
            continue
        return value
    return value


def _strip_repeat(ev: SymbolicEvaluator, value: ir.Value) -> tuple[ir.Value, int, list[ir.Node]]:
    """``value`` without transformers' repeat_kv in front: (grouped value, group, chain).

    Identity (``clone``) and Slices that keep every element between the repeat's nodes, and
    before it, are part of the chain (torch's unoptimized dynamo export writes them)."""
    reshape = _producer(value, "Reshape")
    if reshape is None:
        return value, 1, []
    copies: list[ir.Node] = []
    expand = _producer(_through_copies(ev, reshape.inputs[0], copies), "Expand")
    unsqueeze = (
        _producer(_through_copies(ev, expand.inputs[0], copies), "Unsqueeze") if expand is not None else None
    )
    if expand is None or unsqueeze is None:
        raise Unprovable("K/V reach attention through a Reshape that is not repeat_kv")
    axes = ev.const_ints(unsqueeze.inputs[1] if len(unsqueeze.inputs) > 1 else None, "Unsqueeze axes")
    if axes is None:
        attr = unsqueeze.attributes.get("axes")
        axes = None if attr is None else list(attr.as_ints())
    base = _through_copies(ev, unsqueeze.inputs[0], copies)
    dims = ev.shape(base)
    if base is None or len(dims) != 4 or axes not in ([2], [-3]):
        raise Unprovable("the K/V repeat does not insert its group axis after the head axis")
    inserted = (dims[0], dims[1], ONE, dims[2], dims[3])
    target = ev.values(expand.inputs[1], "the repeat's Expand shape")
    if len(target) != 5 or not target[2].is_const or target[2].const < 1:
        raise Unprovable("the repeat's Expand shape has no constant group size")
    for k in (0, 1, 3, 4):
        if target[k] not in (inserted[k], ONE):
            raise Unprovable(f"the repeat's Expand changes axis {k} ({inserted[k]} -> {target[k]})")
    group = target[2].const
    expanded = (dims[0], dims[1], Affine(const=group), dims[2], dims[3])
    allowzero = bool(
        reshape.attributes.get("allowzero", ir.Attr("allowzero", ir.AttributeType.INT, 0)).as_int()
    )
    out = reshape_dims(
        expanded, ev.values(reshape.inputs[1], "the repeat's Reshape shape"), allowzero=allowzero
    )
    if not dims[1].is_const:
        raise Unprovable("the number of KV heads is not static")
    if out != (dims[0], dims[1].scale(group), dims[2], dims[3]):
        raise Unprovable("the repeat's Reshape does not fold the group axis into the head axis")
    for node in copies:  # the copies are read by the repeat only: removed with it
        if any(len(out.uses()) != 1 or out.is_graph_output() for out in node.outputs):
            raise Unprovable(f"a copy in the K/V repeat ({node.op_type} {node.name!r}) is read elsewhere")
    return base, group, [reshape, expand, unsqueeze, *copies]


def cache_link(
    ev: SymbolicEvaluator, graph: ir.Graph, value: ir.Value, readers: Iterable[ir.Node]
) -> CacheLink:
    """Prove that ``value`` (an attention K or V input) is a repeated or plain KV cache.

    ``readers`` are the attention's own nodes, which may read the present cache.
    """
    grouped, group, chain = _strip_repeat(ev, value)
    concat = _producer(grouped, "Concat")
    if concat is None:
        source = grouped.producer()
        what = f"{source.op_type} node {source.name!r}" if source is not None else "a graph input"
        raise Unprovable(
            f"K/V reach attention from {what}, not from a KV cache (Concat(past, new), directly or "
            "through repeat_kv)"
        )
    if len(concat.inputs) != 2 or concat.attributes["axis"].as_int() not in (2, -2):
        raise Unprovable("the cache Concat does not append on the sequence axis of two tensors")
    past, new = concat.inputs
    crop_node, crop = None, None
    if past is not None and not past.is_graph_input():
        crop_node = _producer(past, "Slice")
        crop = _tail_rows(ev, crop_node) if crop_node is not None else None
        if crop is not None:
            assert crop_node is not None
            past = crop_node.inputs[0]
    if past is None or new is None or not past.is_graph_input() or past.graph is not graph:
        raise Unprovable("the cache Concat does not start from a past graph input")
    if len(ev.shape(past)) != 4:
        raise Unprovable("the past cache is not 4-D (BNSH)")
    copies = [u for u, _ in grouped.uses() if u.op_type == "Identity" and u.outputs[0] in graph.outputs]
    window = None
    if crop_node is not None or (grouped not in graph.outputs and not copies):
        window = _window_cache(ev, graph, grouped, past, crop_node, crop)
        copies = [node for node in window.nodes if node is not crop_node]
    if grouped not in graph.outputs and not copies:
        raise Unprovable(f"the concatenated cache {grouped.name!r} is not a graph output (present)")
    allowed = {id(n) for n in (*readers, *chain, *copies)}
    for user, _ in grouped.uses():
        if id(user) not in allowed and user.op_type != "Shape":
            raise Unprovable(
                f"the present cache {grouped.name!r} is also read by {user.op_type} {user.name!r}"
            )
    return CacheLink(past, new, grouped, group, window)


def _tail_rows(ev: SymbolicEvaluator, node: ir.Node) -> int | None:
    """``n`` when ``node`` is ``Slice(x, [-n], [end of axis], [2])`` (the last n rows), else None."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    try:
        starts = ev.const_ints(inputs[1], "Slice starts")
        ends = ev.const_ints(inputs[2], "Slice ends")
        axes = ev.const_ints(inputs[3], "Slice axes")
        steps = ev.const_ints(inputs[4], "Slice steps") if inputs[4] is not None else [1]
    except Unprovable:
        return None
    if starts is None or ends is None or axes not in ([2], [-2]) or steps != [1]:
        return None
    if len(starts) != 1 or len(ends) != 1 or starts[0] >= 0 or ends[0] < 2**31:
        return None
    return -starts[0]


def _window_cache(
    ev: SymbolicEvaluator,
    graph: ir.Graph,
    concat: ir.Value,
    past: ir.Value,
    crop_node: ir.Node | None,
    crop: int | None,
) -> WindowCache:
    """The cropped sliding-window cache around ``concat``, or Unprovable."""
    if crop_node is not None and crop is None:
        raise Unprovable("the past cache reaches the Concat through a Slice that is not its last rows")
    slices = [u for u, _ in concat.uses() if u.op_type == "Slice" and u.domain in ("", "ai.onnx")]
    outputs = [u for u in slices if u.outputs[0].is_graph_output() and u.outputs[0].graph is graph]
    if len(outputs) != 1:
        raise Unprovable(f"the concatenated cache {concat.name!r} is not a graph output (present)")
    keep = _tail_rows(ev, outputs[0])
    if keep is None:
        raise Unprovable(f"the present {outputs[0].outputs[0].name!r} is a Slice other than the last rows")
    if crop is not None and keep > crop:
        raise Unprovable(f"the present keeps {keep} rows of a past cropped to {crop}")
    shift = ZERO
    if crop_node is not None:
        shift = ev.shape(past)[2] - ev.shape(crop_node.outputs[0])[2]
    nodes = tuple(n for n in (outputs[0], crop_node) if n is not None)
    return WindowCache(outputs[0].outputs[0], keep, crop, shift, nodes)


def cache_mask_facts(
    cond: Conj, key: CacheLink, value: CacheLink, *, past: Affine, batch: Affine | None = None
) -> MaskFacts:
    """:func:`mask_facts` over the full cache's key positions, for plain and cropped caches.

    A cropped cache's mask is over the concatenation's rows; its key ``j`` is row
    ``j + shift`` of the uncropped cache GQA reads. The cropped rows must lie outside the
    window of every query (``W <= crop + 1``).
    """
    if (key.window is None) != (value.window is None):
        raise Unprovable("one of K and V is a cropped sliding-window cache, the other not")
    if key.window is None or value.window is None:
        return mask_facts(cond, past=past, batch=batch)
    if (key.window.shift, key.window.crop, key.window.keep) != (
        value.window.shift,
        value.window.crop,
        value.window.keep,
    ):
        raise Unprovable("K and V are cropped differently")
    facts = mask_facts(cond.subs({KEY: _J - key.window.shift}), past=past, batch=batch)
    crop = key.window.crop
    if crop is not None and (facts.window is None or facts.window > crop + 1):
        raise Unprovable(
            f"the past is cropped to its last {crop} rows but the mask's window is "
            f"{facts.window or 'unbounded'}: the fused attention would see the cropped rows"
        )
    return facts


@dataclasses.dataclass
class AttentionMatch:
    """One attention proven to be GroupQueryAttention with a KV cache."""

    node: ir.Node
    """The node whose output the GQA output replaces (it and its cone are removed)."""
    output: ir.Value
    """The attention output, BNSH ``[batch, num_heads, seq, head_size]``."""
    query: ir.Value
    """The query, BNSH."""
    key: CacheLink
    value: CacheLink
    num_heads: int
    kv_num_heads: int
    head_size: int
    scale: float
    mask: MaskFacts
    softcap: float = 0.0
    probs: ir.Value | None = None
    """A softmax output to deliver as GQA's ``output_qk`` (``qk_output=2``)."""
    fit_mask: bool = False
    """The padding input's columns are fitted to the cache's ``P + S`` (cut, or zeros
    appended): an ONNX ``Attention`` with its own cache reads a mask with fewer key columns
    as padded with ``-inf``, and its mask's width is not provably ``P + S``."""


def check_shapes(
    ev: SymbolicEvaluator, query: ir.Value, key: CacheLink, value: CacheLink
) -> tuple[int, int, int]:
    """(num_heads, kv_num_heads, head_size), proven static and GQA-compatible.

    Query head ``h`` reads repeated head ``h // (heads / (kv_heads * group))``, which is KV
    head ``h // (heads / kv_heads)``: GQA's grouping, for any number of query heads that
    the repeated K/V heads divide.
    """
    q = ev.shape(query)
    pk, pv = ev.shape(key.past), ev.shape(value.past)
    if len(q) != 4:
        raise Unprovable("the query is not 4-D (BNSH)")
    if not (pk[1].is_const and pk[3].is_const and pv == pk):
        raise Unprovable("the past K/V caches have no static, equal head count and head size")
    kv_heads, head = pk[1].const, pk[3].const
    if not q[1].is_const or key.group != value.group or q[1].const % (kv_heads * key.group):
        raise Unprovable(f"{q[1]} query heads do not fit {kv_heads} KV heads repeated {key.group} times")
    if q[3] != Affine(const=head):
        raise Unprovable(f"the query head size {q[3]} is not the cache's {head}")
    if head % 8:
        raise Unprovable(f"head size {head}: GroupQueryAttention needs a multiple of 8")
    for link in (key, value):
        new = ev.shape(link.new)
        if len(new) != 4 or new[2] != q[2]:
            raise Unprovable("the new K/V tokens are not as many as the query tokens")
    dtypes = {ev.dtype(v) for v in (query, key.past, key.new, value.past, value.new)}
    if len(dtypes) != 1 or not dtypes <= ATTENTION_DTYPES:
        names = sorted(str(d) for d in dtypes)
        raise Unprovable(f"Q/K/V/cache element types {names} are not one fp32, fp16 or bf16 type")
    return q[1].const, kv_heads, head


@dataclasses.dataclass(frozen=True)
class PaddingOrder:
    """Token indices (int64 ``[batch, seq]``) of a padding mask's reorder."""

    gather: ir.Value
    """Flat indices into ``[batch * seq, width]`` putting each row's valid tokens first."""
    scatter: ir.Value
    """Flat indices putting them back."""
    inverse: ir.Value
    """Per-row positions putting them back (``scatter`` before flattening)."""


class GqaWriter:
    """Writes GroupQueryAttention nodes into a graph.

    ``seqlens_k`` and ``total_sequence_length`` are computed once per padding input;
    BNSH -> BSH conversions reuse the exporter's own 3-D projections where the
    Reshape/Transpose in between is proven to split the last axis into heads.
    """

    PREFIX = "/gqa_fusion"

    def __init__(self, graph: ir.Graph, ev: SymbolicEvaluator) -> None:
        self.graph = graph
        self.ev = ev
        self._lengths: dict[str, tuple[ir.Value, ir.Value]] = {}
        self._valid: dict[str, ir.Value] = {}
        self._order: dict[str, PaddingOrder] = {}
        self._bsh: dict[int, ir.Value] = {}
        self._counter = 0

    def _name(self, base: str) -> str:
        self._counter += 1
        return f"{self.PREFIX}/{base}_{self._counter}"

    def _add(
        self, before: ir.Node, op_type: str, inputs: Sequence[ir.Value | None], name: str, **attrs
    ) -> ir.Value:
        return insert(self.graph, before, op_type, inputs, self._name(name), **attrs)

    def _const(self, before: ir.Node, array: np.ndarray, name: str) -> ir.Value:
        return self._add(before, "Constant", [], name, value=ir.tensor(array))

    def lengths(self, site: AttentionMatch) -> tuple[ir.Value, ir.Value]:
        """(seqlens_k int32 [batch], total_sequence_length int32 scalar) for the site."""
        key = self._padding_key(site) or f"shape:{self.ev.shape(site.key.past)[2]}"
        if key in self._lengths:
            return self._lengths[key]
        at = site.node
        if site.mask.padding is not None:
            mask = self._padding_mask(site, at)
            # The export reads any nonzero entry as a valid token: count those, not the values.
            zero = self._const(
                at, np.array(0, (mask.dtype or ir.DataType.INT64).numpy()), "attention_mask/zero"
            )
            valid_tokens = self._add(
                at,
                "Not",
                [self._add(at, "Equal", [mask, zero], "attention_mask/Equal")],
                "attention_mask/Not",
            )
            self._valid[key] = valid_tokens
            counted = self._add(at, "Cast", [valid_tokens], "attention_mask/Cast", to=ir.DataType.INT64)
            counted.dtype = ir.DataType.INT64
            one = self._const(at, np.array(1, np.int64), "attention_mask/one")
            axes = self._const(at, np.array([1], np.int64), "attention_mask/axes")
            valid = self._add(at, "ReduceSum", [counted, axes], "attention_mask/ReduceSum", keepdims=0)
            floor = self._const(at, np.array(0, np.int64), "attention_mask/floor")
            last = self._add(  # a row with no token yet (a free slot of a batch) reads as one
                at,
                "Max",
                [self._add(at, "Sub", [valid, one], "attention_mask/Sub"), floor],
                "attention_mask/Max",
            )
            seqlens = self._add(at, "Cast", [last], "attention_mask/seqlens_k", to=ir.DataType.INT32)
            width = self._add(at, "Shape", [mask], "attention_mask/Shape", start=1, end=2)
        else:
            past = self._add(at, "Shape", [site.key.past], "cache/past_length", start=2, end=3)
            axis = _seq_axis(self.ev, site.query)
            new = self._add(at, "Shape", [site.query], "cache/new_length", start=axis, end=axis + 1)
            width = self._add(at, "Add", [past, new], "cache/total")
            batch = self._add(at, "Shape", [site.query], "cache/batch", start=0, end=1)
            one = self._const(at, np.array([1], np.int64), "cache/one")
            last = self._add(
                at, "Expand", [self._add(at, "Sub", [width, one], "cache/last"), batch], "cache/rows"
            )
            seqlens = self._add(at, "Cast", [last], "cache/seqlens_k", to=ir.DataType.INT32)
        scalar = self._add(at, "Squeeze", [width], "attention_mask/total")
        total = self._add(at, "Cast", [scalar], "attention_mask/total_sequence_length", to=ir.DataType.INT32)
        seqlens.dtype, total.dtype = ir.DataType.INT32, ir.DataType.INT32
        self._lengths[key] = (seqlens, total)
        return seqlens, total

    def _padding_key(self, site: AttentionMatch) -> str | None:
        """The padding input, and for a cropped cache or a fitted mask the columns of it
        that the layer reads."""
        if site.mask.padding is None:
            return None
        if site.fit_mask:
            width = (
                self.ev.shape(site.key.past)[2] + self.ev.shape(site.query)[_seq_axis(self.ev, site.query)]
            )
            return f"{site.mask.padding}|columns:{width}"
        if site.key.window is None:
            return site.mask.padding
        return f"{site.mask.padding}|first columns:{site.key.past.name}"

    def _padding_mask(self, site: AttentionMatch, at: ir.Node) -> ir.Value:
        """The padding input; for a cropped cache its first ``past + seq`` columns (the
        columns the export's mask reads: one per row of the uncropped cache)."""
        mask = next(v for v in self.graph.inputs if v.name == site.mask.padding)
        if site.fit_mask:
            return self._fitted_mask(site, mask, at)
        if site.key.window is None:
            return mask
        past = self._add(at, "Shape", [site.key.past], "window_mask/past_length", start=2, end=3)
        new = self._add(at, "Shape", [site.query], "window_mask/new_length", start=2, end=3)
        zero = self._const(at, np.array([0], np.int64), "window_mask/start")
        axes = self._const(at, np.array([1], np.int64), "window_mask/axes")
        width = self._add(at, "Add", [past, new], "window_mask/width")
        columns = self._add(at, "Slice", [mask, zero, width, axes], "window_mask/columns")
        columns.type, columns.shape = mask.type, ir.Shape([mask.shape[0] if mask.shape else None, None])
        return columns

    def _fitted_mask(self, site: AttentionMatch, mask: ir.Value, at: ir.Node) -> ir.Value:
        """``mask`` with exactly ``P + S`` columns: cut, or zeros (padding) appended."""
        axis = _seq_axis(self.ev, site.query)
        past = self._add(at, "Shape", [site.key.past], "fit_mask/past_length", start=2, end=3)
        new = self._add(at, "Shape", [site.query], "fit_mask/new_length", start=axis, end=axis + 1)
        width = self._add(at, "Add", [past, new], "fit_mask/width")
        have = self._add(at, "Shape", [mask], "fit_mask/columns", start=1, end=2)
        zero = self._const(at, np.array([0], np.int64), "fit_mask/zero")
        short = self._add(
            at, "Max", [self._add(at, "Sub", [width, have], "fit_mask/missing"), zero], "fit_mask/short"
        )
        front = self._const(at, np.array([0, 0, 0], np.int64), "fit_mask/front")
        pads = self._add(at, "Concat", [front, short], "fit_mask/pads", axis=0)
        padded = self._add(at, "Pad", [mask, pads], "fit_mask/Pad")
        axes = self._const(at, np.array([1], np.int64), "fit_mask/axes")
        fitted = self._add(at, "Slice", [padded, zero, width, axes], "fit_mask/Slice")
        fitted.type, fitted.shape = mask.type, ir.Shape([mask.shape[0] if mask.shape else None, None])
        return fitted

    def order(self, site: AttentionMatch, query: ir.Value) -> PaddingOrder | None:
        """The reorder that puts each row's valid new tokens first, and its inverse.

        ``query`` is the site's query as GQA reads it (BSH). None without a padding mask.
        The order is stable (valid tokens keep their order, padding follows), so for
        right-padded or unpadded rows it is the identity. Computed once per graph.
        """
        key = self._padding_key(site)
        if key is None:
            return None
        if key in self._order:
            return self._order[key]
        self.lengths(site)
        at = site.node
        batch = self._add(at, "Shape", [query], "padding_order/batch", start=0, end=1)
        new = self._add(at, "Shape", [query], "padding_order/new_length", start=1, end=2)
        end = self._const(at, np.array([np.iinfo(np.int64).max], np.int64), "padding_order/end")
        axes = self._const(at, np.array([1], np.int64), "padding_order/axes")
        start = self._add(at, "Neg", [new], "padding_order/start")
        valid = self._add(at, "Slice", [self._valid[key], start, end, axes], "padding_order/new_tokens")
        length = self._add(at, "Squeeze", [new], "padding_order/length")
        zero = self._const(at, np.array(0, np.int64), "padding_order/zero")
        one = self._const(at, np.array(1, np.int64), "padding_order/one")
        steps = self._add(at, "Range", [zero, length, one], "padding_order/Range")
        padding_after = self._add(at, "Add", [steps, length], "padding_order/padding_after")
        rank = self._add(at, "Where", [valid, steps, padding_after], "padding_order/rank")
        order = self._argsort(rank, new, at, "padding_order/order")
        inverse = self._argsort(order, new, at, "padding_order/inverse")
        rows = self._add(
            at, "Range", [zero, self._add(at, "Squeeze", [batch], "padding_order/rows"), one], "r"
        )
        first = self._add(  # row b's tokens start at b * seq in [batch * seq, width]
            at,
            "Unsqueeze",
            [self._add(at, "Mul", [rows, length], "padding_order/first"), axes],
            "first_token",
        )
        result = PaddingOrder(
            gather=self._add(at, "Add", [order, first], "padding_order/gather"),
            scatter=self._add(at, "Add", [inverse, first], "padding_order/scatter"),
            inverse=inverse,
        )
        self._order[key] = result
        return result

    def _argsort(self, keys: ir.Value, length: ir.Value, at: ir.Node, name: str) -> ir.Value:
        """Indices sorting distinct int64 ``keys [batch, n]`` along axis 1 (exact below 2**24)."""
        values = self._add(at, "Cast", [keys], f"{name}/Cast", to=ir.DataType.FLOAT)
        node = ir.node(
            "TopK",
            [values, length],
            {"axis": 1, "largest": 0, "sorted": 1},
            num_outputs=2,
            name=self._name(name),
        )
        self.graph.insert_before(at, node)
        node.outputs[0].name, node.outputs[1].name = f"{node.name}/values", node.name
        return node.outputs[1]

    def _reorder(self, value: ir.Value, indices: ir.Value, width: int, at: ir.Node, name: str) -> ir.Value:
        """``value`` ``[batch, seq, width]`` with its tokens taken by flat ``indices`` ``[batch, seq]``.

        A Gather of whole rows of the flattened tokens (a copy per token), which onnxruntime
        runs faster than GatherND with batch dimensions.
        """
        flat = self._const(at, np.array([-1, width], np.int64), f"{name}/flat")
        tokens = self._add(at, "Reshape", [value, flat], f"{name}/tokens")
        tokens.type, tokens.shape = value.type, ir.Shape([ir.SymbolicDim(None), width])
        moved = self._add(at, "Gather", [tokens, indices], name, axis=0)
        moved.type, moved.shape = value.type, value.shape
        return moved

    def bsh(self, value: ir.Value, heads: int, head: int, at: ir.Node) -> ir.Value:
        """``value`` (BNSH) as BSH ``[batch, seq, heads * head]``, reusing exporter values."""
        cached = self._bsh.get(id(value))
        if cached is None and len(self._try_shape(value)) == 3:
            cached = value  # already BSH (ONNX Attention's 3-D form)
        if cached is None:
            cached = self._shortcut(value, heads, head, at)
            if cached is None:
                flipped = self._add(at, "Transpose", [value], "to_bsnh", perm=[0, 2, 1, 3])
                shape = self._const(at, np.array([0, 0, heads * head], np.int64), "bsh_shape")
                cached = self._add(at, "Reshape", [flipped, shape], "to_bsh")
            if cached.type is None:
                cached.type = value.type
            if cached.shape is None:
                cached.shape = _bsh_shape(self._try_shape(value), heads * head)
            self._bsh[id(value)] = cached
        return cached

    def _shortcut(self, value: ir.Value, heads: int, head: int, at: ir.Node) -> ir.Value | None:
        """A BSH form of a BNSH ``value`` that is (nearly) there already, or None.

        ``Transpose(Reshape(x, [B, S, heads, head]), [0, 2, 1, 3])`` is ``x``;
        ``Transpose(y, [0, 2, 1, 3])`` is ``Reshape(y, [0, 0, -1])``; an ONNX
        RotaryEmbedding of such a value is the same RotaryEmbedding of its 3-D form
        (the operator's own definition of 3-D input).
        """
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "RotaryEmbedding":
            x = node.inputs[0]
            dims = self._try_shape(x)
            inner = self._shortcut(x, heads, head, at) if x is not None and len(dims) == 4 else None
            if inner is None or dims[1] != Affine(const=heads):
                return None
            attrs = {k: a.value for k, a in node.attributes.items()} | {"num_heads": heads}
            return self._add(at, "RotaryEmbedding", [inner, *node.inputs[1:]], "rotary_bsh", **attrs)
        if node.op_type != "Transpose" or list(node.attributes["perm"].as_ints()) != [0, 2, 1, 3]:
            return None
        bsnh = node.inputs[0]
        dims = self._try_shape(bsnh)
        if bsnh is None or len(dims) != 4 or dims[2] != Affine(const=heads) or dims[3] != Affine(const=head):
            return None
        split = _producer(bsnh, "Reshape")
        if split is not None:
            source = split.inputs[0]
            src = self._try_shape(source)
            if len(src) == 3 and src[:2] == dims[:2] and src[2] == Affine(const=heads * head):
                return source
        shape = self._const(at, np.array([0, 0, heads * head], np.int64), "bsh_shape")
        return self._add(at, "Reshape", [bsnh, shape], "to_bsh")

    def _try_shape(self, value: ir.Value | None) -> tuple[Affine, ...]:
        if value is None:
            return ()
        try:
            return self.ev.shape(value)
        except Unprovable:
            return ()

    def write(self, site: AttentionMatch) -> ir.Node:
        """Insert the GQA node for ``site``, rewire its outputs, remove what is dead."""
        at = site.node
        for tensor in (site.query, site.key.new, site.value.new, site.output):
            inferred = self.ev.dtype(tensor)
            if tensor.dtype is None and inferred is not None:  # no value_info: what was inferred
                tensor.dtype = inferred
        seqlens, total = self.lengths(site)
        q = self.bsh(site.query, site.num_heads, site.head_size, at)
        k = self.bsh(site.key.new, site.kv_num_heads, site.head_size, at)
        v = self.bsh(site.value.new, site.kv_num_heads, site.head_size, at)
        order = self.order(site, q)
        if order is not None:
            q = self._reorder(q, order.gather, site.num_heads * site.head_size, at, "padding_order/q")
            k = self._reorder(k, order.gather, site.kv_num_heads * site.head_size, at, "padding_order/k")
            v = self._reorder(v, order.gather, site.kv_num_heads * site.head_size, at, "padding_order/v")
        attrs: dict[str, int | float] = {
            "num_heads": site.num_heads,
            "kv_num_heads": site.kv_num_heads,
            "scale": float(site.scale),
            "do_rotary": 0,
        }
        if site.softcap:
            attrs["softcap"] = float(site.softcap)
        if site.mask.window is not None:
            attrs["local_window_size"] = site.mask.window
        if site.probs is not None:
            attrs["qk_output"] = 2
        name = f"{at.name}/GroupQueryAttention" if at.name else self._name("GroupQueryAttention")
        gqa = ir.node(
            GQA.op_type,
            GQA.input_list(
                {
                    GqaInput.QUERY: q,
                    GqaInput.KEY: k,
                    GqaInput.VALUE: v,
                    GqaInput.PAST_KEY: site.key.past,
                    GqaInput.PAST_VALUE: site.value.past,
                    GqaInput.SEQLENS_K: seqlens,
                    GqaInput.TOTAL_SEQUENCE_LENGTH: total,
                }
            ),
            attrs,
            domain=GQA.domain,
            num_outputs=4 if site.probs is not None else 3,
            name=name,
        )
        for output, suffix in zip(gqa.outputs, GQA.outputs):
            output.name = f"{name}/{suffix}"
        self.graph.insert_before(at, gqa)
        out = gqa.outputs[GqaOutput.OUTPUT]
        out.type, out.shape = q.type, q.shape
        if order is not None:
            out = self._reorder(
                out, order.scatter, site.num_heads * site.head_size, at, "padding_order/output"
            )
        named = next((i for i, v in enumerate(self.graph.outputs) if v is site.output), None)
        bsh = len(self._try_shape(site.query)) == 3  # a 3-D attention's output is BSH already
        dead = [] if bsh else self._rewire_output(site, out)
        replaced = [
            *([(site.output, out)] if bsh else []),
            self._present(site.key, gqa.outputs[GqaOutput.PRESENT_KEY], at),
            self._present(site.value, gqa.outputs[GqaOutput.PRESENT_VALUE], at),
        ]
        if site.probs is not None:
            probs = gqa.outputs[GqaOutput.OUTPUT_QK]
            probs.type, probs.shape = site.probs.type, site.probs.shape
            if order is not None:  # query rows back in the caller's order; keys stay compacted
                shape = self._add(at, "Shape", [probs], "padding_order/probs_shape")
                axes = self._const(at, np.array([1, 3], np.int64), "padding_order/probs_axes")
                rows = self._add(at, "Unsqueeze", [order.inverse, axes], "padding_order/probs_rows")
                indices = self._add(at, "Expand", [rows, shape], "padding_order/probs_indices")
                probs = self._add(at, "GatherElements", [probs, indices], "padding_order/probs", axis=2)
            replaced.append((site.probs, probs))
        for before, after in replaced:
            after.type, after.shape = before.type, before.shape
            dead.append(before.producer())
            before.replace_all_uses_with(after, replace_graph_outputs=True)
        remove_dead(self.graph, [*dead, at])
        for before, after in replaced:
            after.name = before.name
        if named is not None:  # the attention output was a graph output: its name stays
            self.graph.outputs[named].name = site.output.name
        return gqa

    def _present(self, link: CacheLink, present: ir.Value, at: ir.Node) -> tuple[ir.Value, ir.Value]:
        """(the export's present, what replaces it): GQA's present, or for a cropped
        sliding-window cache its last ``keep`` rows."""
        if link.window is None:
            return link.present, present
        present.type = link.past.type
        start = self._const(at, np.array([-link.window.keep], np.int64), "window_cache/start")
        end = self._const(at, np.array([np.iinfo(np.int64).max], np.int64), "window_cache/end")
        axes = self._const(at, np.array([2], np.int64), "window_cache/axes")
        kept = ir.node("Slice", [present, start, end, axes], name=self._name("window_cache/present"))
        self.graph.insert_before(at, kept)
        return link.window.output, kept.outputs[0]

    def _rewire_output(self, site: AttentionMatch, out: ir.Value) -> list[ir.Node | None]:
        """Feed the GQA output (BSH) to the attention output's users (BNSH).

        A user chain ``Reshape(Transpose(y, [0, 2, 1, 3]), [B, S, heads * head])``
        reads ``out`` itself, also when ``y`` is reached through Reshapes to its own shape
        (:meth:`_views`); any other user reads ``out`` turned back to BNSH.
        Returns the nodes this left unread.
        """
        width = site.num_heads * site.head_size
        q_dims = self._try_shape(site.query)
        dead: list[ir.Node | None] = []
        for user in self._views(site.output):
            if user.op_type != "Transpose" or list(user.attributes["perm"].as_ints()) != [0, 2, 1, 3]:
                continue
            for merge, _ in list(user.outputs[0].uses()):
                if merge.op_type != "Reshape" or merge.outputs[0].is_graph_output():
                    continue
                dims = self._try_shape(merge.outputs[0])
                if len(q_dims) == 4 and dims == (q_dims[0], q_dims[2], Affine(const=width)):
                    merge.outputs[0].replace_all_uses_with(out)
                    dead.append(merge)
        unread = dead_nodes(self.graph, dead)  # with them, what only they read (shapes)
        if site.output.is_graph_output() or any(u not in unread for u, _ in site.output.uses()):
            at = site.node
            shape = self._const(at, np.array([0, 0, site.num_heads, site.head_size], np.int64), "bsnh_shape")
            split = self._add(at, "Reshape", [out, shape], "to_bsnh")
            bnsh = self._add(at, "Transpose", [split], "to_bnsh", perm=[0, 2, 1, 3])
            bnsh.type, bnsh.shape = site.output.type, site.output.shape
            site.output.replace_all_uses_with(bnsh, replace_graph_outputs=True)
        return dead

    def _views(self, output: ir.Value) -> list[ir.Node]:
        """The readers of ``output`` and, through each Reshape proven to keep its shape (an
        identity: transformers 5's TorchScript export reshapes the attention output to
        ``[B, heads, S, head]`` before its transpose, the head size read from the repeated
        V's Shape), that Reshape's readers."""
        shape = self._try_shape(output)
        readers: list[ir.Node] = []
        work = [output]
        while work:
            for user, slot in list(work.pop().uses()):
                readers.append(user)
                if (
                    user.op_type == "Reshape"
                    and user.domain in ("", "ai.onnx")
                    and slot == 0
                    and len(shape) == 4
                    and not user.outputs[0].is_graph_output()
                    and self._try_shape(user.outputs[0]) == shape
                ):
                    work.append(user.outputs[0])
        return readers


def _seq_axis(ev: SymbolicEvaluator, query: ir.Value) -> int:
    """The sequence axis of a query: 1 in BSH (3-D), 2 in BNSH."""
    try:
        return 1 if len(ev.shape(query)) == 3 else 2
    except Unprovable:
        return 2


def _bsh_shape(q: Sequence[Affine], width: int) -> ir.Shape | None:
    if len(q) != 4:
        return None
    return ir.Shape([_dim(q[0]), _dim(q[2]), width])


def _dim(value: Affine) -> int | str | None:
    if value.is_const:
        return value.const
    if len(value.terms) == 1 and value.terms[0][1] == 1 and not value.const:
        symbol = value.terms[0][0]
        return symbol.name if symbol.kind is SymbolKind.DIM else None
    return None


def remove_dead(graph: ir.Graph, nodes: Iterable[ir.Node | None]) -> int:
    """Remove ``nodes`` and, transitively, their producers once nothing reads them.

    The dead set is found first (:func:`dead_nodes`) and removed in one ``Graph.remove`` (which
    costs a pass over the graph's outputs per call: per node, that was a fifth of fusing 80 layers)."""
    dead = dead_nodes(graph, nodes)
    inputs = {v: None for node in dead for v in node.inputs if v is not None and v.producer() is None}
    graph.remove(dead, safe=True)
    for value in inputs:
        if _unused_initializer(value, graph):
            assert value.name is not None
            del graph.initializers[value.name]
    return len(dead)


def dead_nodes(graph: ir.Graph, nodes: Iterable[ir.Node | None]) -> dict[ir.Node, None]:
    """Of ``nodes`` and, transitively, their producers, those that nothing else reads (in the
    order found: a removal of them is deterministic); the graph is left as it is."""
    dead: dict[ir.Node, None] = {}
    work = [n for n in nodes if n is not None]
    while work:
        node = work.pop()
        if node in dead or node.graph is not graph:
            continue
        if any(o.is_graph_output() or any(u.node not in dead for u in o.uses()) for o in node.outputs):
            continue
        dead[node] = None
        work.extend(p for v in node.inputs if v is not None and (p := v.producer()) is not None)
    return dead


def _unused_initializer(value: ir.Value, graph: ir.Graph) -> bool:
    if not value.is_initializer() or value.uses() or value.is_graph_output() or value.is_graph_input():
        return False
    return value.name is not None and graph.initializers.get(value.name) is value


def default_scale(head: int) -> float:
    return 1.0 / math.sqrt(head)
