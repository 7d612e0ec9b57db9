"""Finding attention nodes with a KV cache, the caches they read and write, layer ids.

A *site* is one attention node (any operator of :data:`~onnx_kvcache.cache.operators.ATTENTION_OPS`:
GroupQueryAttention, PagedAttention) with the graph or function that holds it and its
operator's row, through which every slot and attribute is read. A *cache* is the key cache
a site reads: two sites that read one value share a layer id and a scale. Layer ids come
from cache names (``past_key_values.3.key`` -> 3); when a name holds no number, or numbers
collide, caches are numbered in node order. :func:`find_gqa_sites` keeps to
GroupQueryAttention; :func:`find_attention_sites` finds every operator.
"""

from __future__ import annotations

__all__ = [
    "GQA_DOMAIN",
    "GQA_OP_TYPE",
    "CacheSite",
    "cache_name",
    "constant_values",
    "find_attention_sites",
    "find_gqa_sites",
    "function_call_sites",
    "is_gqa",
    "layer_id_from_name",
    "resident_rows",
    "unread_caches",
]

import dataclasses
import re
from collections.abc import Iterator

import onnx_ir as ir

from onnx_kvcache.cache.formats import SCALE_GRANULARITIES, CacheFormat, format_of
from onnx_kvcache.cache.operators import ATTENTION_OPS, GQA, AttentionOp, CacheSide, op_of
from onnx_kvcache.cache.prompt_path import wrapped_node
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.model_io.reading import tensor_values

GQA_DOMAIN = GQA.domain
GQA_OP_TYPE = GQA.op_type

_LAYER_PATTERNS = (
    re.compile(r"(?:^|[._/\-])(\d+)(?=[._/\-]|$)"),
    re.compile(r"(\d+)"),
)


def is_gqa(node: ir.Node) -> bool:
    return GQA.matches(node)


def layer_id_from_name(name: str | None) -> int | None:
    """The layer number in a cache name: ``past_key_values.3.key`` -> 3."""
    if not name:
        return None
    for pattern in _LAYER_PATTERNS:
        match = pattern.search(name)
        if match:
            return int(match.group(1))
    return None


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


def _output(node: ir.Node, index: int) -> ir.Value | None:
    return node.outputs[index] if index < len(node.outputs) else None


@dataclasses.dataclass
class CacheSite:
    """One attention node, where it lives, its operator's row, layer id and cache owner."""

    node: ir.Node
    function: ir.Function | None
    layer_id: int = -1
    _owner: CacheSite | None = dataclasses.field(default=None, repr=False, compare=False)
    op: AttentionOp = GQA
    wrapper: ir.Node | None = None
    """The ``If`` whose multi-token calls attend through the float kernel, when the node is
    wrapped (:mod:`~onnx_kvcache.cache.prompt_path`): its outputs are the node's to the caller."""

    @property
    def outer(self) -> ir.Node:
        """The node the site's graph holds: the wrapper, else the attention node itself."""
        return self.wrapper or self.node

    @property
    def owner(self) -> CacheSite:
        """The site whose cache this node reads: itself, or the first writer upstream whose
        present it reads as its past (KV sharing). Set by :func:`find_attention_sites`."""
        return self._owner or self

    @property
    def name(self) -> str:
        where = f" in function {self.function.name}" if self.function is not None else ""
        return f"{self.node.name or '<unnamed>'}{where}"

    @property
    def label(self) -> str:
        """``<op_type> node <name>``, for messages."""
        return f"{self.op.op_type} node {self.name}"

    def input(self, slot: int | str) -> ir.Value | None:
        """The node's input at ``slot`` (index or schema name), or None when absent."""
        return _input(self.node, self.op.slot(slot) if isinstance(slot, str) else slot)

    def output(self, slot: int | str) -> ir.Value | None:
        """The node's output at ``slot``; a wrapped node's: its wrapper's."""
        return _output(self.outer, self.op.out_slot(slot) if isinstance(slot, str) else slot)

    @property
    def single_cache(self) -> bool:
        """The node keeps one cache (PagedAttention's LATENT layout): the key side."""
        rule = self.op.single_cache
        return rule is not None and self.str_attr(rule[0]) == rule[1]

    @property
    def sides(self) -> tuple[CacheSide, ...]:
        """The caches this node has: key and value, or the key alone (single cache)."""
        return self.op.sides[:1] if self.single_cache else self.op.sides

    def past(self, side: CacheSide) -> ir.Value | None:
        return self.input(side.past)

    def present(self, side: CacheSide) -> ir.Value | None:
        return self.output(side.present)

    @property
    def past_key(self) -> ir.Value | None:
        return self.past(self.op.key)

    @property
    def past_value(self) -> ir.Value | None:
        return None if self.single_cache else self.past(self.op.value)

    @property
    def present_key(self) -> ir.Value | None:
        return self.present(self.op.key)

    @property
    def present_value(self) -> ir.Value | None:
        return None if self.single_cache else self.present(self.op.value)

    @property
    def has_cache(self) -> bool:
        return all(self.past(side) is not None for side in self.sides)

    @property
    def cache_writer(self) -> ir.Node | None:
        """The node of the same operator whose present caches this node reads as its past."""
        pasts = [self.past(side) for side in self.sides]
        if any(p is None for p in pasts):
            return None
        writer = pasts[0].producer()  # type: ignore[union-attr]
        if writer is None or not self.op.matches(writer):
            return None
        for side, past in zip(self.sides, pasts):
            if _output(writer, self.op.out_slot(side.present)) is not past:
                return None
        return writer

    def int_attr(self, name: str, default: int = 0) -> int:
        attr = self.node.attributes.get(name)
        return default if attr is None else int(attr.as_int())

    def str_attr(self, name: str, default: str = "") -> str:
        attr = self.node.attributes.get(name)
        return default if attr is None else attr.as_string()

    def float_attr(self, name: str, default: float = 0.0) -> float:
        attr = self.node.attributes.get(name)
        return default if attr is None else float(attr.as_float())

    @property
    def num_heads(self) -> int:
        return self.int_attr("num_heads")

    @property
    def kv_num_heads(self) -> int:
        return self.int_attr("kv_num_heads")

    @property
    def cache_dtype(self) -> ir.DataType | None:
        value = self.past_key
        return None if value is None else value.dtype

    @property
    def cache_format(self) -> CacheFormat | None:
        """The quantized format of the cache this node reads, or None for a float cache."""
        quant = self.str_attr(self.op.key.quant_attr, "NONE")
        if quant == "NONE" and format_of(self.cache_dtype) is None:
            return None
        return format_of(self.cache_dtype, self.cache_bit_width, self.cache_logical_type)

    @property
    def cache_bit_width(self) -> int | None:
        """The operator's bit-width attribute (GQA's ``kv_cache_bit_width``), when it has one."""
        attr = self.op.bit_width_attr
        return self.int_attr(attr, 8) if attr is not None else None

    @property
    def cache_logical_type(self) -> str | None:
        """The operator's logical cache type attribute (PagedAttention's ``k_cache_dtype``)."""
        names = [self.str_attr(side.dtype_attr) for side in self.sides if side.dtype_attr]
        return next((name for name in names if name), None)

    @property
    def granularity(self) -> str | None:
        """The :data:`~onnx_kvcache.cache.formats.SCALE_GRANULARITIES` row name the node's
        ``k_quant_type`` states, else None (a float cache)."""
        quant = self.str_attr(self.op.key.quant_attr, "NONE")
        return next((row.name for row in SCALE_GRANULARITIES.values() if row.quant_type == quant), None)

    @property
    def query_dtype(self) -> ir.DataType | None:
        """The node's T: from the query, else any other T-typed input that knows it."""
        for name in self.op.t_inputs:
            value = self.input(name)
            if value is not None and value.dtype is not None:
                return value.dtype
        output = _output(self.node, 0)
        return None if output is None else output.dtype

    @property
    def packed_qkv(self) -> bool:
        """Query, key and value arrive packed in the query input."""
        return self.input("key") is None and not self.single_cache

    def head_size(self, *, cache_is_packed: bool | None = None) -> int:
        """Head size from key/query/cache shapes; raises when no shape tells it.

        ``cache_is_packed`` defaults to whether the cache's format packs values.
        """
        if cache_is_packed is None:
            fmt = self.cache_format
            cache_is_packed = fmt is not None and fmt.packed
        kv, n = self.kv_num_heads, self.num_heads
        key, query = self.input("key"), self.input("query")
        candidates = []
        if key is not None and key.shape is not None and isinstance(key.shape[-1], int):
            candidates.append(key.shape[-1] / kv)
        if query is not None and query.shape is not None and isinstance(query.shape[-1], int):
            heads = n + 2 * kv if self.packed_qkv else n
            candidates.append(query.shape[-1] / heads)
        past = self.past_key
        if (
            not cache_is_packed
            and past is not None
            and past.shape is not None
            and len(past.shape) == 4
            and isinstance(past.shape[3], int)
        ):
            candidates.append(past.shape[3])
        granularity = SCALE_GRANULARITIES.get(self.granularity or "")
        if granularity is not None and granularity.per_dim:  # a per-channel scale: kv x head values
            found = constant_values(self.input(self.sides[0].scale))
            if found is not None and len(found) > 1:
                candidates.append(len(found) / granularity.size(kv, 1))
        for size in candidates:
            if size == int(size) and size > 0:
                return int(size)
        packed = " (its packed cache's does not tell it)" if cache_is_packed else ""
        raise KvCacheError(
            f"Cannot tell the head size of {self.label}: no static last dimension on its query, "
            f"key or cache{packed}, and no per-channel scale. Run shape inference on the model "
            "(onnx_ir.passes.common.ShapeInferencePass) or re-export it with value_info, so that "
            "its key input (or cache) has a static last dimension."
        )

    @property
    def v_head_size(self) -> int:
        """Width of V and of each output head (PagedAttention's ``v_head_size``; 0 = head size)."""
        return self.int_attr("v_head_size", 0) or self.head_size()


def _iter_nodes(model: ir.Model) -> Iterator[tuple[ir.Node, ir.Function | None]]:
    for node in _walk(model.graph):
        yield node, None
    for function in model.functions.values():
        for node in _walk(function):
            yield node, function


_GRAPH_ATTRIBUTES = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)


def _walk(graph: ir.Graph | ir.Function) -> Iterator[ir.Node]:
    """Every node of ``graph`` and, after each, those of its subgraphs (at any depth): what
    ``RecursiveGraphIterator`` yields, without its per-node generator."""
    for node in graph:
        yield node
        for sub in _nested(node):
            yield from _walk(sub)


def _nested(node: ir.Node) -> list[ir.Graph]:
    """The subgraphs of ``node``'s attributes (most nodes: none)."""
    attributes = node.attributes.data
    if not attributes:
        return []
    found: list[ir.Graph] = []
    for attr in attributes.values():
        if attr.type in _GRAPH_ATTRIBUTES:
            found.extend(attr.value if attr.type == ir.AttributeType.GRAPHS else (attr.value,))
    return found


def _attention_nodes(model: ir.Model) -> list[tuple[ir.Node, ir.Function | None, ir.Node | None]]:
    """The nodes named like an attention operator, in ``_iter_nodes``'s order (80 layers: looking
    for them node by node through a generator was a fifth of a conversion's time), each with its
    wrapper: a wrapped node stands for its wrapper's two branches."""
    found: list[tuple[ir.Node, ir.Function | None, ir.Node | None]] = []

    def visit(graph: ir.Graph | ir.Function, function: ir.Function | None) -> None:
        for node in graph:
            if node.op_type in ATTENTION_OPS:
                found.append((node, function, None))
            elif node.op_type == "If" and (inner := wrapped_node(node)) is not None:
                found.append((inner, function, node))
                continue
            if node.attributes:
                for sub in _nested(node):
                    visit(sub, function)

    visit(model.graph, None)
    for function in model.functions.values():
        visit(function, function)
    return found


def find_attention_sites(
    model: ir.Model,
    *,
    with_cache_only: bool = True,
    ops: tuple[AttentionOp, ...] | None = None,
) -> list[CacheSite]:
    """Every attention node (of ``ops``, default all) in the model, its subgraphs and
    functions, with layer ids."""
    rows = ops or tuple(ATTENTION_OPS.values())
    sites = []
    for node, function, wrapper in _attention_nodes(model):
        row = op_of(node)
        if row is not None and row in rows:
            sites.append(CacheSite(node, function, op=row, wrapper=wrapper))
    for site in sites:
        if "num_heads" not in site.node.attributes or "kv_num_heads" not in site.node.attributes:
            raise KvCacheError(f"{site.label} lacks num_heads or kv_num_heads; the model is malformed.")
    if with_cache_only:
        sites = [s for s in sites if s.has_cache]
    _link_owners(sites)
    _assign_layer_ids(model, sites)
    return sites


def find_gqa_sites(model: ir.Model, *, with_cache_only: bool = True) -> list[CacheSite]:
    """Every GroupQueryAttention node of the model, its subgraphs and its functions."""
    return find_attention_sites(model, with_cache_only=with_cache_only, ops=(GQA,))


def cache_name(site: CacheSite, model: ir.Model) -> str | None:
    """Name of the key cache input as the model's caller sees it."""
    value = site.past_key
    if value is None:
        return None
    if site.function is not None and value.is_graph_input():
        callers = function_call_sites(model, site.function)
        if len(callers) == 1:
            index = list(site.function.inputs).index(value)
            outer = _input(callers[0], index)
            if outer is not None:
                return outer.name
    return value.name


def _link_owners(sites: list[CacheSite]) -> None:
    """Set each site's owner: follow cache writers upstream (one node map for all)."""
    by_node = {id(s.node): s for s in sites}
    for site in sites:
        owner, seen = site, {id(site.node)}
        while (writer := owner.cache_writer) is not None and id(writer) in by_node and id(writer) not in seen:
            owner = by_node[id(writer)]
            seen.add(id(writer))
        site._owner = owner


def _assign_layer_ids(model: ir.Model, sites: list[CacheSite]) -> None:
    caches: dict[int, list[CacheSite]] = {}
    for site in sites:
        caches.setdefault(id(site.owner.past_key), []).append(site)
    parsed = {key: layer_id_from_name(cache_name(group[0], model)) for key, group in caches.items()}
    ids = list(parsed.values())
    use_names = None not in ids and len(set(ids)) == len(ids)
    for order, (key, group) in enumerate(caches.items()):
        layer = parsed[key] if use_names else order
        for site in group:
            site.layer_id = layer  # type: ignore[assignment]


def function_call_sites(model: ir.Model, function: ir.Function) -> list[ir.Node]:
    """Nodes (anywhere in the model) that call ``function``."""
    identifier = function.identifier()
    return [node for node, _ in _iter_nodes(model) if node.op_identifier() == identifier]


def unread_caches(model: ir.Model, sites: list[CacheSite]) -> list[ir.Value]:
    """``model``'s graph inputs named like a cache (``past``, ``cache``), 4-D where their rank is
    known, that no site reads (by name): the pasts of layers the fusion left as exported."""
    read = {past.name for s in sites for side in s.sides if (past := s.past(side)) is not None}
    return [
        value
        for value in model.graph.inputs
        if value.name not in read
        and ("past" in (value.name or "") or "cache" in (value.name or ""))
        and (value.shape is None or len(value.shape) == 4)
    ]


def resident_rows(total: int, capacity: int, window: int | None) -> int:
    """Rows of a present cache holding tokens after ``total`` tokens, for ``capacity`` rows.

    A full-length cache (``window`` None) holds them all. A window-sized cache
    (``sliding_window_cache=1``, window W) keeps the most recent ``L`` positions in rows
    ``[0, L)`` and evicts in blocks of ``G = capacity - W + 1``:
    ``L = total - G * ceil((total - capacity) / G)``.
    """
    if total <= capacity or window is None:
        return min(total, capacity)
    block = capacity - window + 1
    return total - block * -(-(total - capacity) // block)


def constant_values(value: ir.Value | None) -> list[float] | None:
    """The values of a constant (initializer or Constant node output), e.g. a scale."""
    if value is None:
        return None
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant":
        tensor = producer.attributes["value"].value
    return None if tensor is None else [float(x) for x in tensor_values(tensor).reshape(-1)]
