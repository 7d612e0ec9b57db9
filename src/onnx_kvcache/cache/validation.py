"""One validation of a model, before it is read or any output is committed: a table of checks.

Every entry point runs :func:`validate_model` on the model it reads (``convert_model`` and
``optimize_model`` through the pipeline's decision, ``inspect_kv_cache``, ``KvCacheRunner``
and through it calibration and evaluation), and the pipeline runs it again on the model it
quantized before that model is returned or written: no output is one onnxruntime refuses,
and no malformed input ends in a traceback. A model that fails is refused with
:class:`~onnx_kvcache.errors.MalformedModelError`, one line naming the node and the
attribute or input; nothing is written. docs/validation.md lists the checks.

The rules, in order (:data:`GRAPH_CHECKS`, then :data:`NODE_CHECKS` on every attention node of
:data:`~onnx_kvcache.cache.operators.ATTENTION_OPS`, in the graph, its subgraphs and functions;
a node's rows run in order, each only once the rows before it passed):

- every value a node reads, and every output of a graph, is defined (a graph input, an
  initializer or a node's output);
- the IR version and every opset are ones the installed onnxruntime loads (none installed:
  not checked);
- nodes are in topological order: a graph that is not (onnxruntime runs it; graph-surgery
  tools write such graphs) is sorted in memory, the file read is never changed; a cycle is
  refused;
- an attention node has ``num_heads`` and ``kv_num_heads``, both 1 or more, ``num_heads`` a
  multiple of ``kv_num_heads``; where shapes are static (or the projections tell them) the
  query and key widths are whole heads of one head size, and a cache's heads axis holds ``kv_num_heads``;
- its caches: both past inputs or neither (the key alone in a single-cache layout), and no
  present output of the graph without its past input;
- quantization: ``k_quant_type``/``v_quant_type`` name a granularity, the bit width is one a
  format has, and a quantized side has its scale input; a scale is float32 with the number of
  elements its granularity takes (one per tensor, ``kv_num_heads * head_size`` per channel).
"""

from __future__ import annotations

__all__ = [
    "ATTRIBUTE_TYPES",
    "GRAPH_CHECKS",
    "NODE_CHECKS",
    "GraphCheck",
    "NodeCheck",
    "validate_model",
]

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import onnx_ir as ir

from onnx_kvcache.cache.formats import CACHE_FORMATS, SCALE_GRANULARITIES, format_of
from onnx_kvcache.cache.operators import ATTENTION_OPS, op_of
from onnx_kvcache.cache.sites import CacheSite, constant_values
from onnx_kvcache.errors import MalformedModelError
from onnx_kvcache.model_io import unloadable_header
from onnx_kvcache.model_io.reading import UNDEFINED_FIX, undefined_value

_FIX = "The model is malformed: export it again, or repair the node."

GraphLike = ir.Graph | ir.Function


# -- graph checks --------------------------------------------------------------------


def _roots(model: ir.Model) -> list[GraphLike]:
    """The main graph and every function (each sorted on its own)."""
    return [model.graph, *model.functions.values()]


def _subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    if not node.attributes:  # most nodes: no attribute to look at
        return
    for attr in node.attributes.data.values():
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.value
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.value


def _graphs(model: ir.Model) -> Iterator[GraphLike]:
    """The main graph, every function and every subgraph of their nodes."""
    for root in _roots(model):
        yield from _with_subgraphs(root)


def _with_subgraphs(graph: GraphLike) -> Iterator[GraphLike]:
    """``graph`` and every subgraph of its nodes, at any depth."""
    yield graph
    for node in graph:
        if node.attributes:
            for sub in _subgraphs(node):
                yield from _with_subgraphs(sub)


def _where(graph: GraphLike) -> str:
    return f" in function {graph.name}" if isinstance(graph, ir.Function) else ""


def _undefined(model: ir.Model, sort: bool) -> str | None:
    """A value a node reads, or a graph outputs, that nothing defines (a node removed by hand, a
    broken export)."""
    for graph in _graphs(model):
        problem = undefined_value(graph, _where(graph))
        if problem is not None:
            return f"{problem}. {UNDEFINED_FIX}"
    return None


def _in_order(graph: GraphLike) -> bool:
    """Whether every node comes after the producers of what it (and its subgraphs) reads."""
    nodes = set(graph)
    seen: set[ir.Node] = set()
    for node in graph:
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and producer not in seen and producer in nodes:
                return False  # read before it is made (a node reading its own output too)
        if node.attributes:  # what its subgraphs read is read by the node
            for subgraph in _subgraphs(node):
                for reader in ir.traversal.RecursiveGraphIterator(subgraph):
                    for value in reader.inputs:
                        producer = value.producer() if value is not None else None
                        if producer is not None and producer not in seen and producer in nodes:
                            return False
        seen.add(node)
    return True


def _acyclic(graph: GraphLike) -> bool:
    """Whether the nodes can be ordered (Kahn's count; a subgraph's reads are its node's)."""
    nodes = {id(node): node for node in graph}
    waiting: dict[int, int] = {}
    readers: dict[int, list[int]] = {key: [] for key in nodes}
    for key, node in nodes.items():
        producers = set()
        for reader in [node, *(n for g in _subgraphs(node) for n in ir.traversal.RecursiveGraphIterator(g))]:
            for value in reader.inputs:
                producer = value.producer() if value is not None else None
                if producer is not None and id(producer) in nodes:
                    producers.add(id(producer))
        waiting[key] = len(producers)
        for producer_key in producers:
            readers[producer_key].append(key)
    ready = [key for key, count in waiting.items() if count == 0]
    done = 0
    while ready:
        done += 1
        for reader_key in readers[ready.pop()]:
            waiting[reader_key] -= 1
            if waiting[reader_key] == 0:
                ready.append(reader_key)
    return done == len(nodes)


def _order(model: ir.Model, sort: bool) -> str | None:
    """Nodes in topological order: sorted in memory when not (``sort``); a cycle refused."""
    for graph in _roots(model):
        if _in_order(graph):
            continue
        try:
            if sort:
                graph.sort()
            elif not _acyclic(graph):  # reading only needs no order, but onnxruntime runs no cycle
                raise ValueError("a cycle")
        except ValueError:
            return f"the graph{_where(graph)} has a cycle: its nodes cannot be ordered. {_FIX}"
    return None


def _names(model: ir.Model, sort: bool) -> str | None:
    """Node names of the main graph are unique (onnxruntime: "two nodes with same node name")."""
    seen: set[str] = set()
    for node in model.graph:
        if node.name and node.name in seen:
            return (
                f"two nodes of the graph are named {node.name!r}: onnxruntime refuses a graph whose "
                "node names repeat. The model is malformed: export it again, or rename one of them."
            )
        seen.add(node.name or "")
    return None


def _loadable(model: ir.Model, sort: bool) -> str | None:
    """The IR version and opsets are ones the installed onnxruntime loads (none installed: no check)."""
    problem = unloadable_header(model.ir_version, dict(model.opset_imports))
    return None if problem is None else f"the model cannot be converted or run here: {problem}."


@dataclasses.dataclass(frozen=True)
class GraphCheck:
    """One rule on the whole model: ``run(model, sort)`` is the problem's text, or None."""

    name: str
    rule: str
    """What it checks, for docs/validation.md."""
    run: Callable[[ir.Model, bool], str | None]


GRAPH_CHECKS: tuple[GraphCheck, ...] = (
    GraphCheck(
        "defined",
        "every value a node reads, and every graph output, is a graph input, an initializer or a "
        "node's output",
        _undefined,
    ),
    GraphCheck(
        "order",
        "nodes are in topological order (sorted in memory when not; a cycle is refused)",
        _order,
    ),
    GraphCheck("names", "the main graph's node names are unique", _names),
    GraphCheck(
        "runtime",
        "the IR version and every opset are ones the installed onnxruntime loads",
        _loadable,
    ),
)


# -- node checks ---------------------------------------------------------------------


def _last_dim(value: ir.Value | None) -> int | None:
    shape = value.shape if value is not None else None
    if shape is None or len(shape) == 0 or not isinstance(shape[-1], int):
        return None
    return shape[-1]


#: Ops whose output's last axis is their first input's (unary, elementwise).
_SAME_WIDTH = frozenset({"Cast", "Identity", "Neg", "Relu", "Sigmoid", "Tanh", "Erf", "Clip"})
#: Elementwise ops that broadcast: the output's last axis is the widest input's.
_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div"})


def _width(value: ir.Value | None, depth: int = 8) -> int | None:
    """A value's static last dimension: its shape's, else what its producer tells (a projection:
    a MatMul's weight, MatMulNBits' ``N``, through a bias added or a Cast), else None. A builder
    that records no shape (mobius's packed QKV) still has its projections' widths."""
    last = _last_dim(value)
    if last is not None or value is None or depth == 0:
        return last
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx", "com.microsoft"):
        return None
    if node.op_type == "MatMul" and len(node.inputs) == 2 and node.inputs[1] is not None:
        weight = node.inputs[1].shape
        return _last_dim(node.inputs[1]) if weight is not None and len(weight) >= 2 else None
    if node.op_type == "MatMulNBits" and "N" in node.attributes:
        n = node.attributes["N"]
        return n.value if n.type == ir.AttributeType.INT else None
    if node.op_type in _SAME_WIDTH and node.inputs:
        return _width(node.inputs[0], depth - 1)
    if node.op_type in _BROADCAST:
        widths = [w for w in (_width(v, depth - 1) for v in node.inputs) if w is not None]
        return max(widths) if widths and max(widths) > 1 else None
    return None


ATTRIBUTE_TYPES: Mapping[str, ir.AttributeType] = MappingProxyType(
    {
        **dict.fromkeys(
            (
                "num_heads",
                "kv_num_heads",
                "do_rotary",
                "rotary_interleaved",
                "local_window_size",
                "sliding_window_cache",
                "rotary_offset",
                "v_head_size",
                "is_causal",
                "causal",
                "kv_cache_bit_width",
                "smooth_softmax",
                "qk_output",
            ),
            ir.AttributeType.INT,
        ),
        **dict.fromkeys(
            ("scale", "softcap", "qk_norm_epsilon", "q_norm_epsilon", "k_norm_epsilon"),
            ir.AttributeType.FLOAT,
        ),
        **dict.fromkeys(
            ("k_quant_type", "v_quant_type", "k_cache_dtype", "v_cache_dtype", "kv_cache_layout"),
            ir.AttributeType.STRING,
        ),
    }
)
"""The type of each attribute of GroupQueryAttention and PagedAttention (onnxruntime's
schemas; both operators agree where they share a name)."""


def _attribute_types(site: CacheSite) -> str | None:
    for name, attr in site.node.attributes.items():
        wanted = ATTRIBUTE_TYPES.get(name)
        if wanted is not None and attr.type != wanted:
            return f"has {name} of type {attr.type.name}, where onnxruntime's schema takes {wanted.name}"
    return None


def _attributes(site: CacheSite) -> str | None:
    missing = [a for a in ("num_heads", "kv_num_heads") if a not in site.node.attributes]
    return f"lacks {' and '.join(missing)}" if missing else None


def _positive(site: CacheSite) -> str | None:
    for attr in ("num_heads", "kv_num_heads"):
        if site.int_attr(attr) < 1:
            return f"has {attr}={site.int_attr(attr)}: a head count must be 1 or more"
    return None


def _groups(site: CacheSite) -> str | None:
    n, kv = site.num_heads, site.kv_num_heads
    if n % kv:
        return f"has num_heads={n} and kv_num_heads={kv}: num_heads must be a multiple of kv_num_heads"
    return None


def _head_size(site: CacheSite) -> int | None:
    """The head size the query's static width tells (whole heads), else the key's, else None."""
    n, kv = site.num_heads, site.kv_num_heads
    query, key = _width(site.input("query")), _width(site.input("key"))
    if query is not None:
        heads = n + 2 * kv if site.packed_qkv else n
        if query % heads == 0:
            return query // heads
    if key is not None and key % kv == 0:
        return key // kv
    return None


def _widths(site: CacheSite) -> str | None:
    """Query and key widths (their shapes', else their projections') are whole heads of one head size."""
    n, kv = site.num_heads, site.kv_num_heads
    query, key = _width(site.input("query")), _width(site.input("key"))
    if query is not None:
        heads, said = (n + 2 * kv, "num_heads + 2 * kv_num_heads") if site.packed_qkv else (n, "num_heads")
        if query % heads:
            return f"has {said} = {heads}, which does not divide its query's width {query}"
    if key is not None and key % kv:
        return f"has kv_num_heads={kv}, which does not divide its key's width {key}"
    if query is not None and key is not None and not site.packed_qkv and query // n != key // kv:
        return (
            f"has num_heads={n} and kv_num_heads={kv}, which give its query ({query} wide) and key "
            f"({key} wide) different head sizes"
        )
    return None


def _cache_heads(site: CacheSite) -> str | None:
    """A cache has the layout's rank; where static, its heads axis holds kv_num_heads and the key
    cache's last axis the head size the query and key tell (a packed format: its elements)."""
    if site.single_cache:
        return None
    layout = site.op.layout
    fmt = format_of(site.cache_dtype, site.cache_bit_width, site.cache_logical_type)
    head = _head_size(site)
    stored = head if head is None or fmt is None else fmt.packed_dim(head)
    for side in site.sides:
        past = site.past(side)
        if past is None or past.shape is None:
            continue
        if len(past.shape) != len(layout.dims):
            return (
                f"has a {side.past} {past.name!r} of rank {len(past.shape)}: its cache is "
                f"[{', '.join(layout.dims)}]"
            )
        heads = past.shape[layout.heads_axis]
        if isinstance(heads, int) and heads != site.kv_num_heads:
            return (
                f"has kv_num_heads={site.kv_num_heads} but its {side.past} {past.name!r} holds {heads} heads"
            )
        width = past.shape[-1]
        if side is site.sides[0] and stored is not None and isinstance(width, int) and width != stored:
            packed = f" ({fmt.name}: {stored} elements)" if fmt is not None and fmt.packed else ""
            return (
                f"has heads of size {head}{packed} but its {side.past} {past.name!r} holds {width} per head"
            )
    return None


def _caches(site: CacheSite) -> str | None:
    """Both past inputs or neither; no present output of the graph without its past."""
    given = [side.past for side in site.sides if site.past(side) is not None]
    missing = [side.past for side in site.sides if site.past(side) is None]
    if given and missing:
        return f"reads {given[0]} but has no {missing[0]} input: its cache inputs are incomplete"
    for side in site.sides:
        present = site.present(side)
        if site.past(side) is None and present is not None and present.is_graph_output():
            return (
                f"writes {side.present} {present.name!r}, an output of the graph, but has no {side.past} "
                "input: its cache input is missing"
            )
    return None


def _quantization(site: CacheSite) -> str | None:
    """Granularity attributes name a row; the bit width is a format's; quantized sides have scales."""
    quant_types = ("NONE", *(row.quant_type for row in SCALE_GRANULARITIES.values()))  # the tables as now
    bit_widths = tuple(sorted({row.bit_width for row in CACHE_FORMATS.values()}))
    quants = {side.quant_attr: site.str_attr(side.quant_attr, "NONE") for side in site.sides}
    for attr, quant in quants.items():
        if quant not in quant_types:
            return f"has {attr}={quant!r}: expected one of {', '.join(quant_types)}"
    quantized = [side for side in site.sides if quants[side.quant_attr] != "NONE"]
    bits_attr = site.op.bit_width_attr
    if quantized and bits_attr is not None and bits_attr in site.node.attributes:
        bits = site.int_attr(bits_attr)
        if bits not in bit_widths:
            return f"has {bits_attr}={bits}: expected one of {', '.join(map(str, bit_widths))}"
    if not quantized and bits_attr is not None and bits_attr in site.node.attributes:
        bits = site.int_attr(bits_attr)
        if bits != 0:
            return f"has {bits_attr}={bits} but no quantized side: onnxruntime takes 0 for a float cache"
    for side in quantized:
        if site.input(side.scale) is None:
            return f"has {side.quant_attr}={quants[side.quant_attr]} but no {side.scale} input"
    dtype = site.cache_dtype
    known = dtype is None or format_of(dtype, site.cache_bit_width, site.cache_logical_type) is not None
    if quantized and site.past_key is not None and not known and dtype is not None:
        said = f" and {bits_attr}={site.cache_bit_width}" if bits_attr in site.node.attributes else ""
        names = ", ".join(
            f"{row.name} ({row.dtype.name.lower()}, {row.bit_width} bits)" for row in CACHE_FORMATS.values()
        )
        return f"has a quantized {dtype.name.lower()} cache{said}, which is no format's: {names}"
    return None


def _elements(value: ir.Value) -> int | None:
    found = constant_values(value)
    if found is not None:
        return len(found)
    shape = value.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return math.prod(d for d in shape if isinstance(d, int))


def _scales(site: CacheSite) -> str | None:
    """Scale inputs are float32, as many elements as their granularity takes."""
    for side in site.sides:
        scale = site.input(side.scale)
        if scale is None:
            continue
        if scale.dtype is not None and scale.dtype != ir.DataType.FLOAT:
            return f"has a {scale.dtype.name.lower()} {side.scale} {scale.name!r}: scales are float32"
        found = constant_values(scale) or []
        bad = next((x for x in found if not (math.isfinite(x) and x > 0)), None)
        if bad is not None:
            return f"has a {side.scale} {scale.name!r} holding {bad}: a scale is finite and above 0"
        quant = site.str_attr(side.quant_attr, "NONE")
        row = next((r for r in SCALE_GRANULARITIES.values() if r.quant_type == quant), None)
        count = _elements(scale)
        if row is None or count is None:
            continue
        head = _head_size(site)
        fmt = format_of(site.cache_dtype, site.cache_bit_width, site.cache_logical_type)
        if head is None and not (fmt is not None and fmt.packed):
            head = _last_dim(site.past(side))
        if head is None and row.per_dim:
            continue
        wanted = row.size(site.kv_num_heads, head or 1)
        if count != wanted:
            return (
                f"has {side.quant_attr}={quant} and a {side.scale} {scale.name!r} of {count} element(s); "
                f"that granularity takes {wanted}"
            )
    return None


@dataclasses.dataclass(frozen=True)
class NodeCheck:
    """One rule on an attention node: ``run(site)`` is the problem (said after the node), or None."""

    name: str
    rule: str
    """What it checks, for docs/validation.md."""
    run: Callable[[CacheSite], str | None]


NODE_CHECKS: tuple[NodeCheck, ...] = (
    NodeCheck(
        "attribute types", "each attribute has the type onnxruntime's schema gives it", _attribute_types
    ),
    NodeCheck("attributes", "num_heads and kv_num_heads are given", _attributes),
    NodeCheck("head counts", "num_heads and kv_num_heads are 1 or more", _positive),
    NodeCheck("groups", "num_heads is a multiple of kv_num_heads", _groups),
    NodeCheck(
        "widths",
        "a static query width (packed: num_heads + 2 * kv_num_heads heads) and key width (their "
        "shapes', else their projections': a MatMul's weight, through a bias or a Cast) are whole "
        "heads of one size",
        _widths,
    ),
    NodeCheck(
        "cache heads",
        "a cache has the layout's rank; its static heads axis holds kv_num_heads, a key cache's "
        "last axis the head size (packed: its elements)",
        _cache_heads,
    ),
    NodeCheck(
        "caches", "both past inputs or neither; a present output of the graph has its past input", _caches
    ),
    NodeCheck(
        "quantization",
        "k_quant_type/v_quant_type name a granularity, kv_cache_bit_width a format's width; a "
        "quantized side has its scale input, a quantized cache a format's element type",
        _quantization,
    ),
    NodeCheck(
        "scales",
        "k_scale/v_scale are float32, finite and above 0: one element per tensor, kv_num_heads * "
        "head_size per channel",
        _scales,
    ),
)


def _sites(model: ir.Model) -> Iterator[CacheSite]:
    roots: list[tuple[GraphLike, ir.Function | None]] = [(model.graph, None)]
    roots += [(function, function) for function in model.functions.values()]
    for root, function in roots:
        for node in ir.traversal.RecursiveGraphIterator(root):
            if node.op_type not in ATTENTION_OPS:  # most nodes: no attention's name
                continue
            row = op_of(node)
            if row is not None:
                yield CacheSite(node, function, op=row)


def validate_model(model: ir.Model, *, sort: bool = True) -> bool:
    """Run every check on ``model``; whether its nodes were sorted (``sort``: a graph out of
    topological order is sorted in place, else left as it is: reading it needs no order).

    Raises:
        MalformedModelError: the first check that fails, naming the node and the attribute.
    """
    was_in_order = all(_in_order(graph) for graph in _roots(model))
    for graph_check in GRAPH_CHECKS:
        problem = graph_check.run(model, sort)
        if problem is not None:
            raise MalformedModelError(problem[:1].upper() + problem[1:])
    for site in _sites(model):
        for check in NODE_CHECKS:
            problem = check.run(site)
            if problem is not None:
                raise MalformedModelError(f"{site.label} {problem}. {_FIX}")
    return sort and not was_in_order
