"""Finding GroupQueryAttention nodes and the KV caches they read and write.

A *site* is one GQA node with the graph or function that holds it. A *cache* is the
``past_key`` value a site reads: two sites that read one value share a layer id and
a scale. Layer ids come from cache names (``past_key_values.3.key`` -> 3); when a
name holds no number, or numbers collide, caches are numbered in node order.
"""

from __future__ import annotations

__all__ = [
    "GQA_DOMAIN",
    "GQA_OP_TYPE",
    "GqaSite",
    "cache_name",
    "constant_values",
    "find_gqa_sites",
    "function_call_sites",
    "is_gqa",
    "layer_id_from_name",
    "resident_rows",
]

import dataclasses
import re
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.formats import GRANULARITIES, CacheFormat, format_of

GQA_DOMAIN = "com.microsoft"
GQA_OP_TYPE = "GroupQueryAttention"

# Input / output slots of GroupQueryAttention.
QUERY, KEY, VALUE, PAST_KEY, PAST_VALUE = 0, 1, 2, 3, 4
SEQLENS_K, TOTAL_SEQUENCE_LENGTH, COS_CACHE, SIN_CACHE, POSITION_IDS = 5, 6, 7, 8, 9
K_SCALE, V_SCALE, Q_NORM, K_NORM, QUERY_SEQLENS = 12, 13, 14, 15, 16
PRESENT_KEY, PRESENT_VALUE = 1, 2

_LAYER_PATTERNS = (
    re.compile(r"(?:^|[._/\-])(\d+)(?=[._/\-]|$)"),
    re.compile(r"(\d+)"),
)


def is_gqa(node: ir.Node) -> bool:
    return node.op_type == GQA_OP_TYPE and node.domain == GQA_DOMAIN


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
class GqaSite:
    """One GQA node, where it lives, its layer id and the site owning its cache."""

    node: ir.Node
    function: ir.Function | None
    layer_id: int = -1
    _owner: GqaSite | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def owner(self) -> GqaSite:
        """The site whose cache this node reads: itself, or the first GQA writer upstream
        whose present it reads as its past (KV sharing). Set by :func:`find_gqa_sites`."""
        return self._owner or self

    @property
    def name(self) -> str:
        where = f" in function {self.function.name}" if self.function is not None else ""
        return f"{self.node.name or '<unnamed>'}{where}"

    def input(self, slot: int) -> ir.Value | None:
        """The node's input at ``slot``, or None when absent (empty or past the end)."""
        return _input(self.node, slot)

    @property
    def past_key(self) -> ir.Value | None:
        return _input(self.node, PAST_KEY)

    @property
    def past_value(self) -> ir.Value | None:
        return _input(self.node, PAST_VALUE)

    @property
    def present_key(self) -> ir.Value | None:
        return _output(self.node, PRESENT_KEY)

    @property
    def present_value(self) -> ir.Value | None:
        return _output(self.node, PRESENT_VALUE)

    @property
    def has_cache(self) -> bool:
        return self.past_key is not None and self.past_value is not None

    @property
    def cache_writer(self) -> ir.Node | None:
        """The GQA node whose present K/V this node reads as its past (KV sharing)."""
        pk, pv = self.past_key, self.past_value
        writer = pk.producer() if pk is not None else None
        if writer is None or not is_gqa(writer) or pv is None or pv.producer() is not writer:
            return None
        if _output(writer, PRESENT_KEY) is pk and _output(writer, PRESENT_VALUE) is pv:
            return writer
        return None

    def int_attr(self, name: str, default: int = 0) -> int:
        attr = self.node.attributes.get(name)
        return default if attr is None else int(attr.as_int())

    def str_attr(self, name: str, default: str = "") -> str:
        attr = self.node.attributes.get(name)
        return default if attr is None else attr.as_string()

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
        if self.str_attr("k_quant_type", "NONE") == "NONE" and format_of(self.cache_dtype) is None:
            return None
        return format_of(self.cache_dtype, self.int_attr("kv_cache_bit_width", 0))

    @property
    def granularity(self) -> str | None:
        """``per_tensor`` or ``per_channel`` for a quantized cache, else None."""
        quant = self.str_attr("k_quant_type", "NONE")
        return next((name for name, attr in GRANULARITIES.items() if attr == quant), None)

    @property
    def query_dtype(self) -> ir.DataType | None:
        """The node's T: from the query, else any other T-typed input that knows it."""
        for slot in (QUERY, KEY, VALUE, 7, 8, 10, 11, 14, 15):
            value = _input(self.node, slot)
            if value is not None and value.dtype is not None:
                return value.dtype
        output = _output(self.node, 0)
        return None if output is None else output.dtype

    def head_size(self, *, cache_is_packed: bool | None = None) -> int:
        """Head size from key/query/cache shapes; raises when no shape tells it.

        ``cache_is_packed`` defaults to whether the cache's format packs values.
        """
        if cache_is_packed is None:
            fmt = self.cache_format
            cache_is_packed = fmt is not None and fmt.values_per_byte > 1
        kv, n = self.kv_num_heads, self.num_heads
        key, query = _input(self.node, KEY), _input(self.node, QUERY)
        candidates = []
        if key is not None and key.shape is not None and isinstance(key.shape[-1], int):
            candidates.append(key.shape[-1] / kv)
        if query is not None and query.shape is not None and isinstance(query.shape[-1], int):
            heads = n if key is not None else n + 2 * kv
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
        for size in candidates:
            if size == int(size) and size > 0:
                return int(size)
        raise KvCacheError(
            f"Cannot tell the head size of GroupQueryAttention node {self.name}: no static "
            "last dimension on its query, key or past_key. Run shape inference on the model "
            "first (onnx_ir.passes.common.ShapeInferencePass)."
        )


def _iter_nodes(model: ir.Model) -> Iterator[tuple[ir.Node, ir.Function | None]]:
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        yield node, None
    for function in model.functions.values():
        for node in ir.traversal.RecursiveGraphIterator(function):
            yield node, function


def find_gqa_sites(model: ir.Model, *, with_cache_only: bool = True) -> list[GqaSite]:
    """Every GQA node of the model, its subgraphs and its functions, with layer ids."""
    sites = [GqaSite(node, function) for node, function in _iter_nodes(model) if is_gqa(node)]
    for site in sites:
        if "num_heads" not in site.node.attributes or "kv_num_heads" not in site.node.attributes:
            raise KvCacheError(
                f"GroupQueryAttention node {site.name} lacks num_heads or kv_num_heads; "
                "the model is malformed."
            )
    if with_cache_only:
        sites = [s for s in sites if s.has_cache]
    _link_owners(sites)
    _assign_layer_ids(model, sites)
    return sites


def cache_name(site: GqaSite, model: ir.Model) -> str | None:
    """Name of the past_key value as the model's caller sees it."""
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


def _link_owners(sites: list[GqaSite]) -> None:
    """Set each site's owner: follow cache writers upstream (one node map for all)."""
    by_node = {id(s.node): s for s in sites}
    for site in sites:
        owner, seen = site, {id(site.node)}
        while (writer := owner.cache_writer) is not None and id(writer) in by_node and id(writer) not in seen:
            owner = by_node[id(writer)]
            seen.add(id(writer))
        site._owner = owner


def _assign_layer_ids(model: ir.Model, sites: list[GqaSite]) -> None:
    caches: dict[int, list[GqaSite]] = {}
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
    return None if tensor is None else [float(x) for x in np.asarray(tensor.numpy()).reshape(-1)]
