"""The facts an attention fusion proves about one attention: its cache, repeat, mask and shapes.

:mod:`onnx_kvcache.passes.fusion._match` states the rules (cache, mask, positions counted from
the mask, shapes); this module proves them with :mod:`onnx_kvcache.passes.fusion._symbolic`:
:func:`mask_condition` and :func:`mask_facts` (:class:`MaskFacts`: causal, padding, window,
positions counted from the mask), :func:`cache_link` (:class:`CacheLink`: ``Concat(past,
new)`` through ``repeat_kv``, or a cropped sliding-window cache, :class:`WindowCache`),
:func:`cache_mask_facts` and :func:`check_shapes`, gathered in an :class:`AttentionMatch`.
What cannot be proven raises :class:`~onnx_kvcache.passes.fusion._symbolic.Unprovable`.
:class:`~onnx_kvcache.passes.fusion._match.GqaWriter` writes the GQA node from the match;
``_match`` re-exports every name here.
"""

from __future__ import annotations

__all__ = [
    "AttentionMatch",
    "CacheLink",
    "MaskFacts",
    "WindowCache",
    "cache_link",
    "cache_mask_facts",
    "check_head_sizes",
    "check_precision",
    "check_shapes",
    "counted_tie",
    "key_columns",
    "mask_condition",
    "mask_facts",
    "restrict",
    "running_count",
]

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TypeVar

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.rolling import rolling_attention
from onnx_kvcache.passes._graph import op_of
from onnx_kvcache.passes.fusion import _opsets as opsets
from onnx_kvcache.passes.fusion._piecewise import equal, same_dims
from onnx_kvcache.passes.fusion._reads import is_copy, read_through, tile_repeat, widening
from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode, proof_step, step
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
    max_of,
    reshape_dims,
)

BATCH, HEAD, QUERY, KEY = (Symbol.index(name) for name in ("batch", "head", "query", "key"))


_B, _I, _J = Affine.of(BATCH), Affine.of(QUERY), Affine.of(KEY)


ATTENTION_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})

_Restricted = TypeVar("_Restricted", Affine, Conj)


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


@step(FusionRefusalCode.MASK)
def mask_condition(
    ev: SymbolicEvaluator,
    mask: ir.Value,
    *,
    query_len: Affine,
    kv_len: Affine,
    domain: Mapping[Symbol, Affine] | None = None,
) -> Conj:
    """The mask as a condition over batch, head, query and key indices (boolean, or 0/-inf
    additive); ``domain``: maxima that are zero where the attention is called (a rolling window
    cache's crop, :attr:`WindowCache.domain`), read as zero in the mask's shape and condition."""
    try:
        tensor = ev.eval(mask)
        elem = tensor.element()
    except Unprovable as reason:
        counted = running_count(mask)
        if counted is None:
            raise reason.wrapped(f"the mask {mask.name!r}: ") from None
        raise reason.wrapped(
            f"the mask {mask.name!r} compares token positions counted by CumSum of {counted} (a "
            "position-based causal/sliding-window mask), not key and query indices, and "
        ) from None
    if tensor.rank > 4:
        raise Unprovable("the mask has more than 4 dimensions")
    cond = elem.cond if isinstance(elem, Additive) else elem
    if not isinstance(cond, Conj):
        raise Unprovable("the mask is neither boolean nor a 0/-inf additive mask")
    names = (BATCH, HEAD, QUERY, KEY)[4 - tensor.rank :]
    dims = {name: restrict(dim, domain) for name, dim in zip(names, tensor.shape)}
    kv_len, cond = restrict(kv_len, domain), restrict(cond, domain)
    if KEY not in dims or not equal(dims[KEY], kv_len):  # ONNX Attention pads a shorter mask with -inf
        raise Unprovable(f"the mask has {dims.get(KEY, ONE)} key columns, the cache {kv_len}")
    if dims.get(QUERY, ONE) != ONE and not equal(dims[QUERY], query_len):
        raise Unprovable(f"the mask has {dims[QUERY]} query rows, the query {query_len}")
    mapping = {
        axis(k): Affine(const=0) if dim == ONE else Affine.of(name)
        for k, (name, dim) in enumerate(zip(names, dims.values()))
    }
    return cond.subs(mapping)


def running_count(mask: ir.Value, limit: int = 200) -> str | None:
    """The input of a ``CumSum`` the mask is computed from (mobius's position-based masks for
    gemma3, granite, olmo2: ``cumsum(attention_mask)`` of query and key compared), or None."""
    source = _counted_source(mask, limit)
    if source is None:
        return None
    return source.name if source.name else "a tensor"


def _counted_source(mask: ir.Value, limit: int = 200) -> ir.Value | None:
    """The first input of the first ``CumSum`` the mask is computed from, or None."""
    seen: set[int] = set()
    todo = [mask]
    while todo and len(seen) < limit:
        node = todo.pop().producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "CumSum" and node.domain in ("", "ai.onnx") and node.inputs:
            return node.inputs[0]
        todo.extend(v for v in node.inputs if v is not None)
    return None


def counted_tie(mask: ir.Value, columns: Affine, total: Affine) -> SymbolicEvaluator | None:
    """An evaluator in which the mask's key columns are the cache's ``P + S``, for a mask
    computed from a running count (``CumSum``) of a 2-D graph input (its padding input) as wide
    as the mask; None for any other.

    mobius names the padding input's width (``past_seq_len + seq_len``) apart from the cache's
    and the query's lengths, so the equation is stated: one name of the mask's width is
    replaced by what it equals. It is the attention mask's contract (one column per key of
    the present cache: what the fused node reads as ``total_sequence_length``), and the
    scores the mask is added to (or onnxruntime's ``Attention``, which refuses other widths)
    have ``P + S`` columns. A mask of counted positions reads the query's position at column
    ``width - S``, which is the causal diagonal only where the two are equal."""
    source = _counted_source(mask)
    if source is None or not source.is_graph_input() or source.shape is None or len(source.shape) != 2:
        return None
    if SymbolicEvaluator().declared_shape(source)[1] != columns:  # the padding input's own width
        return None
    difference = columns - total
    free = [
        s for s, c in difference.terms if abs(c) == 1 and s.kind is SymbolKind.DIM and s not in total.symbols
    ]
    if not free:
        return None
    symbol = free[0]
    sign = difference.coefficient(symbol)
    return SymbolicEvaluator(ties={symbol: (Affine.of(symbol).scale(sign) - difference).scale(sign)})


def _always_true(lhs: Affine) -> bool:
    """``lhs <= 0`` for all values: every symbol here (index, length) is non-negative."""
    return lhs.const <= 0 and all(c <= 0 for _, c in lhs.terms)


@step(FusionRefusalCode.MASK)
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
    tiled: bool = False
    """The repeat is a Tile (``group`` copies of the KV heads as a block: repeated head ``t`` is
    KV head ``t mod kv_heads``), not repeat_kv's ``t // group``."""
    widened: ir.DataType | None = None
    """The float16/bfloat16 type a Cast in front of attention widens the cache from to float32."""

    @property
    def domain(self) -> dict[Symbol, Affine]:
        """Maxima that are zero where the attention is called (:attr:`WindowCache.domain`)."""
        return dict(self.window.domain) if self.window is not None else {}


def key_columns(ev: SymbolicEvaluator, link: CacheLink) -> Affine:
    """The concatenated cache's length where the attention is called (:attr:`CacheLink.domain`)."""
    return restrict(ev.shape(link.present)[2], link.domain)


@dataclasses.dataclass(frozen=True)
class WindowCache:
    """A rolling window cache: transformers 5.x's DynamicSlidingWindowLayer as exported.

    Attention reads ``Concat(Slice(past, -crop), new)`` (the crop is optional); the present
    graph output is ``Slice(that, -keep)``, the last ``keep`` (``window - 1``) rows. Fed its
    own presents, the export's past never holds more than ``keep`` rows: on that domain the
    crop keeps every row (:attr:`domain`), and the layer is causal attention with a window
    ``W <= keep + 1`` over ``Concat(past, new)``, which GQA computes over the export's own
    past, its present gathered to each row's last ``keep`` tokens
    (:mod:`~onnx_kvcache.passes.fusion._window_present`).
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
    domain: tuple[tuple[Symbol, Affine], ...] = ()
    """Maxima that are zero while the past holds at most ``keep`` rows (``max(0, past - keep)``,
    ``max(0, past - crop)``): where a caller that feeds the presents back calls the export."""
    uncropped: str | None = None
    """A past input declared as long as this one whose cache is not cropped (a model that mixes
    rolling and full-length caches), or None."""


def _through_copies(ev: SymbolicEvaluator, value: ir.Value | None, chain: list[ir.Node]) -> ir.Value | None:
    """``value`` before any copies that produce it (:func:`~onnx_kvcache.passes.fusion._reads.is_copy`:
    Identity, whole-tensor Slices, same-type Casts; not an Expand, which repeat_kv is made of),
    added to ``chain``."""
    while value is not None:
        node = value.producer()
        if node is None or node.op_type == "Expand" or node in chain or not is_copy(ev, node):
            return value
        chain.append(node)
        value = node.inputs[0]
    return value


@step(FusionRefusalCode.REPEAT)
def _strip_repeat(ev: SymbolicEvaluator, value: ir.Value) -> tuple[ir.Value, int, list[ir.Node]]:
    """``value`` without transformers' repeat_kv in front: (grouped value, group, chain).

    Identity (``clone``) and Slices that keep every element between the repeat's nodes, and
    before it, are part of the chain (torch's unoptimized dynamo export writes them)."""
    reshape = op_of(value, "Reshape")
    if reshape is None:
        return value, 1, []
    copies: list[ir.Node] = []
    expand = op_of(_through_copies(ev, reshape.inputs[0], copies), "Expand")
    unsqueeze = (
        op_of(_through_copies(ev, expand.inputs[0], copies), "Unsqueeze") if expand is not None else None
    )
    if expand is None or unsqueeze is None:
        raise Unprovable(f"K/V reach attention through Reshape {reshape.name!r}, which is not repeat_kv's")
    axes = opsets.moved(ev, unsqueeze)
    below: list[ir.Node] = []  # the cache's own copies: one may be the present (a graph output)
    base = _through_copies(ev, unsqueeze.inputs[0], below)
    dims = ev.shape(base)
    if base is None or len(dims) != 4 or axes not in ([2], [-3]):
        raise Unprovable(
            f"the K/V repeat's Unsqueeze {unsqueeze.name!r} does not insert its group axis after the "
            "head axis"
        )
    inserted = (dims[0], dims[1], ONE, dims[2], dims[3])
    target = ev.values(expand.inputs[1], "the repeat's Expand shape")
    if len(target) != 5 or not target[2].is_const or target[2].const < 1:
        raise Unprovable(f"the repeat's Expand {expand.name!r} has no constant group size")
    for k in (0, 1, 3, 4):
        if target[k] != ONE and not equal(target[k], inserted[k]):
            raise Unprovable(
                f"the repeat's Expand {expand.name!r} changes axis {k} ({inserted[k]} -> {target[k]})"
            )
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
    if not same_dims(out, (dims[0], dims[1].scale(group), dims[2], dims[3])):
        raise Unprovable(
            f"the repeat's Reshape {reshape.name!r} does not fold the group axis into the head axis"
        )
    for node in [*copies, *below]:  # the copies are read by the repeat only: removed with it
        if any(len(out.uses()) != 1 or (out.is_graph_output() and node not in below) for out in node.outputs):
            raise Unprovable(f"a copy in the K/V repeat ({node.op_type} {node.name!r}) is read elsewhere")
    return base, group, [reshape, expand, unsqueeze, *copies, *below]


@step(FusionRefusalCode.CACHE)
def cache_link(
    ev: SymbolicEvaluator, graph: ir.Graph, value: ir.Value, readers: Iterable[ir.Node]
) -> CacheLink:
    """Prove that ``value`` (an attention K or V input) is a repeated or plain KV cache.

    ``readers`` are the attention's own nodes, which may read the present cache.
    """
    chain: list[ir.Node] = []
    front, widened = read_through(ev, value, chain, "K/V")
    tiles, front = _strip_tile(ev, front, chain)
    grouped, group, repeat = _strip_repeat(ev, front)
    if tiles > 1 and group > 1:
        raise Unprovable("K/V heads are repeated by both a Tile and repeat_kv")
    stripped = _through_copies(ev, grouped, chain)  # a same-type Cast of the present (GPT-J)
    assert stripped is not None
    grouped, chain = stripped, chain + repeat
    concat = op_of(grouped, "Concat")
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
        crop_node = op_of(past, "Slice")
        crop = _tail_rows(ev, crop_node) if crop_node is not None else None
        if crop is not None:
            assert crop_node is not None
            past = crop_node.inputs[0]
    if past is None or new is None or not past.is_graph_input() or past.graph is not graph:
        raise Unprovable("the cache Concat does not start from a past graph input")
    if len(ev.shape(past)) != 4:
        raise Unprovable("the past cache is not 4-D (BNSH)")
    copies = [u for u, _ in grouped.uses() if is_copy(ev, u) and u.outputs[0] in graph.outputs]
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
    _read_only_by(ev, chain, allowed)
    return CacheLink(past, new, grouped, group * tiles, window, tiled=tiles > 1, widened=widened)


def _strip_tile(ev: SymbolicEvaluator, value: ir.Value, chain: list[ir.Node]) -> tuple[int, ir.Value]:
    """``(r, x)`` for K/V read as ``Tile(x, [1, r, 1, 1])`` (through copies: ``x.repeat(...)``
    exports as ``Tile(Expand(x, ones), repeats)``), else ``(1, value)``; the nodes go to ``chain``."""
    tile = op_of(value, "Tile")
    if tile is None or tile.inputs[0] is None:
        return 1, value
    with proof_step(FusionRefusalCode.REPEAT):
        tiles = tile_repeat(ev, tile)
    chain.append(tile)
    base, widened = read_through(ev, tile.inputs[0], chain, "K/V")
    if widened is not None:
        raise Unprovable(f"K/V are widened from {widened.name.lower()} before the Tile {tile.name!r}")
    return tiles, base


def _read_only_by(ev: SymbolicEvaluator, chain: list[ir.Node], allowed: set[int]) -> None:
    """Refuse a node K/V reach attention through whose output something else reads (after the
    fusion it would read GQA's cache, whose rows a padding mask reorders); a copy that is a
    graph output (a present) may stay, read from GQA's present."""
    for node in chain:
        for out in node.outputs:
            if out.is_graph_output() and widening(ev, node) is not None:
                raise Unprovable(f"the widening Cast {node.name!r} in front of attention is a graph output")
            for user, _ in out.uses():
                if id(user) not in allowed and user.op_type != "Shape":
                    raise Unprovable(
                        f"{node.op_type} node {node.name!r}, which K/V reach attention through, is also "
                        f"read by {user.op_type} {user.name!r}"
                    )


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
    length = ev.shape(past)[2]
    vanish = [max_of(length - rows, ZERO) for rows in {keep, crop or keep}]
    domain = tuple((m.terms[0][0], ZERO) for m in vanish if len(m.terms) == 1 and m.const == 0)
    return WindowCache(outputs[0].outputs[0], keep, crop, shift, nodes, domain, _uncropped(ev, graph, past))


def _uncropped(ev: SymbolicEvaluator, graph: ir.Graph, past: ir.Value) -> str | None:
    """A 4-D graph input declared with ``past``'s length that no Slice crops to its last rows."""
    length = ev.shape(past)[2]
    for value in graph.inputs:
        if value is past or value.shape is None or len(value.shape) != 4:
            continue
        if ev.declared_shape(value)[2] != length:
            continue
        readers = [u for u, _ in value.uses()]
        if any(u.op_type == "Slice" and _tail_rows(ev, u) is not None for u in readers):
            continue  # cropped
        if any(rolling_attention(u) for u in readers):
            continue  # a rolling window cache fused already
        return value.name
    return None


def restrict(x: _Restricted, domain: Mapping[Symbol, Affine] | None) -> _Restricted:
    """``x`` (a form or a condition) with the maxima of ``domain`` replaced by their values,
    inside other maxima and lookups too."""
    if not domain:
        return x
    if isinstance(x, Conj):
        atoms = [
            Le(restrict(a.lhs, domain))
            if isinstance(a, Le)
            else MaskAt(a.source, restrict(a.row, domain), restrict(a.col, domain))
            for a in x.atoms
        ]
        return Conj.of(*atoms)  # type: ignore[return-value]
    out = Affine(const=x.const)
    for symbol, c in x.terms:
        if symbol in domain:
            value = domain[symbol]
        elif symbol.kind is SymbolKind.MAX and symbol.form is not None:
            value = max_of(restrict(symbol.form, domain), ZERO)
        elif symbol.at is not None:
            make = Symbol.entry if symbol.kind is SymbolKind.ENTRY else Symbol.count
            at = symbol.at
            value = Affine.of(make(at.source, restrict(at.row, domain), restrict(at.col, domain)))
        else:
            value = Affine.of(symbol)
        out = out + value.scale(c)
    return out  # type: ignore[return-value]


@step(FusionRefusalCode.MASK)
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
    window = key.window
    if (window.crop, window.keep) != (value.window.crop, value.window.keep) or not equal(
        restrict(window.shift, key.domain), restrict(value.window.shift, value.domain)
    ):
        raise Unprovable("K and V are cropped differently")
    shift = restrict(window.shift, key.domain)
    facts = mask_facts(restrict(cond, key.domain).subs({KEY: _J - shift}), past=past, batch=batch)
    if facts.window is None or facts.window > window.keep + 1:
        raise Unprovable(
            f"rolling window cache of W - 1 past tokens: the export keeps its last {window.keep} "
            f"tokens but its mask's window is {facts.window or 'unbounded'}, so fed its own presents it "
            "attends to fewer tokens than the window; export with a full-length cache (DynamicCache(), "
            "docs/exporting.md section 1)"
        )
    if facts.padding is None:
        raise Unprovable(
            "rolling window cache of W - 1 past tokens: the mask reads no attention_mask, which GQA's "
            "window-sized cache needs to count each row's tokens"
        )
    if window.uncropped is not None:
        raise Unprovable(
            f"rolling window cache of W - 1 past tokens: {key.past.name} keeps its last {window.keep} "
            f"tokens (W = {facts.window}) while {window.uncropped}, declared as long, keeps every token, "
            "so past that many tokens the export's presents no longer fit its declared inputs (a declared "
            "length other than a name cannot be declared apart for the window layers); export with a "
            "full-length cache (DynamicCache(), docs/exporting.md section 1)"
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
    head_sink: np.ndarray | None = None
    """Per query head, a logit beside the scores in the softmax (gpt-oss's sinks): GQA's
    ``head_sink`` (:mod:`onnx_kvcache.passes.fusion._sinks`)."""
    fit_mask: bool = False
    """The padding input's columns are fitted to the cache's ``P + S`` (cut, or zeros
    appended): an ONNX ``Attention`` with its own cache reads a mask with fewer key columns
    as padded with ``-inf``, and its mask's width is not provably ``P + S``."""


@step(FusionRefusalCode.SHAPES)
def check_head_sizes(ev: SymbolicEvaluator, key: ir.Value | None, value: ir.Value | None) -> None:
    """Refuse keys and values of different head sizes (the last axis of 4-D K and V as attention
    reads them), before the caches are followed: GroupQueryAttention has one head size, and
    multi-head latent attention (MLA: DeepSeek-V2/V3, whose keys hold a no-rotary and a rotary
    part, its values another width) is what writes them."""
    try:
        k, v = ev.shape(key), ev.shape(value)
    except Unprovable:
        return  # the cache proof says why
    if len(k) == 4 and len(v) == 4 and k[3].is_const and v[3].is_const and k[3] != v[3]:
        raise Unprovable(
            f"keys of head size {k[3]} and values of head size {v[3]}: multi-head latent attention "
            "(MLA, as DeepSeek-V2/V3 write it) or another attention whose K and V widths differ, "
            "which GroupQueryAttention (one head size) does not compute"
        )


@step(FusionRefusalCode.SHAPES)
def check_shapes(
    ev: SymbolicEvaluator,
    query: ir.Value,
    key: CacheLink,
    value: CacheLink,
    query_widened: ir.DataType | None = None,
) -> tuple[int, int, int]:
    """(num_heads, kv_num_heads, head_size), proven static and GQA-compatible.

    Query head ``h`` reads repeated head ``h // (heads / (kv_heads * group))``, which is KV
    head ``h // (heads / kv_heads)``: GQA's grouping, for any number of query heads that
    the repeated K/V heads divide (a Tile's block repeat: GQA's grouping once the query heads
    are reordered, :func:`~onnx_kvcache.passes.fusion._reads.tiled_order`). ``query_widened``:
    the type a Cast in front of attention widens the query from (:func:`check_precision`).
    """
    check_precision(query_widened, key, value)
    q = ev.shape(query)
    pk, pv = ev.shape(key.past), ev.shape(value.past)
    if len(q) != 4:
        raise Unprovable("the query is not 4-D (BNSH)")
    if not (pk[1].is_const and pk[3].is_const and pv == pk):
        raise Unprovable("the past K/V caches have no static, equal head count and head size")
    kv_heads, head = pk[1].const, pk[3].const
    if (
        not q[1].is_const
        or (key.group, key.tiled) != (value.group, value.tiled)
        or q[1].const % (kv_heads * key.group)
    ):
        raise Unprovable(f"{q[1]} query heads do not fit {kv_heads} KV heads repeated {key.group} times")
    if q[3] != Affine(const=head):
        raise Unprovable(f"the query head size {q[3]} is not the cache's {head}")
    if head % 8:
        raise Unprovable(f"head size {head}: GroupQueryAttention needs a multiple of 8")
    for link in (key, value):
        new = ev.shape(link.new)
        if len(new) != 4 or not equal(new[2], q[2]):
            raise Unprovable("the new K/V tokens are not as many as the query tokens")
    dtypes = {ev.dtype(v) for v in (query, key.past, key.new, value.past, value.new)}
    if len(dtypes) != 1 or not dtypes <= ATTENTION_DTYPES:
        names = sorted(str(d) for d in dtypes)
        raise Unprovable(f"Q/K/V/cache element types {names} are not one fp32, fp16 or bf16 type")
    return q[1].const, kv_heads, head


@step(FusionRefusalCode.SHAPES)
def check_precision(query_widened: ir.DataType | None, key: CacheLink, value: CacheLink) -> None:
    """Refuse float Casts in front of attention that GroupQueryAttention does not compute: it
    computes ``Q @ K^T`` and the softmax in float32 from its float16/bfloat16 inputs, and the
    probabilities times V in their type, so Q and K may be widened to float32 (both, from one
    type: an fp16 model that upcasts its scores), V not."""
    if value.widened is not None:
        raise Unprovable(
            f"V reaches attention widened from {value.widened.name.lower()} to float32: the export "
            "multiplies the probabilities by V in float32, GroupQueryAttention in the cache's type"
        )
    if key.widened != query_widened:
        raise Unprovable(
            f"Q reaches the scores {_widened(query_widened)} and K {_widened(key.widened)}: "
            "GroupQueryAttention reads them in one type"
        )


def _widened(dtype: ir.DataType | None) -> str:
    return "in its own type" if dtype is None else f"widened from {dtype.name.lower()} to float32"
