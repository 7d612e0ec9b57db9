"""What a model's KV cache looks like: per-layer operator, dtype, shape, quantization, bytes."""

from __future__ import annotations

__all__ = ["CacheLayerInfo", "CacheModelInfo", "format_cache_table", "inspect_kv_cache"]

import dataclasses
from typing import Any

import onnx_ir as ir

from onnx_kvcache.cache.io_caches import EXPORTED, IoCache, find_io_caches
from onnx_kvcache.cache.rolling import present_output
from onnx_kvcache.cache.rotation import ROTATIONS, matrix_name, site_matrix, site_rotation, stored_rotation
from onnx_kvcache.cache.sites import CacheSite, constant_values, find_attention_sites
from onnx_kvcache.cache.validation import validate_model
from onnx_kvcache.errors import require_flags
from onnx_kvcache.model_io.reading import ModelLike, as_model


@dataclasses.dataclass(frozen=True)
class CacheLayerInfo:
    """One attention layer's cache as the graph declares it."""

    layer_id: int
    node: str
    past_key: str
    past_value: str
    dtype: str
    shape: tuple[Any, ...]
    k_quant_type: str
    v_quant_type: str
    bit_width: int | None
    k_scale: list[float] | None
    v_scale: list[float] | None
    shared_scale: bool
    window: int | None
    bytes_per_token: float
    original_bytes_per_token: float
    op: str = "GroupQueryAttention"
    layout: tuple[str, ...] = ()
    """Names of the cache dimensions (``batch, kv_num_heads, sequence, head_size`` or
    ``num_blocks, block_size, kv_num_heads, head_size``)."""
    rotation: str = "none"
    """What the graph turns before the node (:func:`~onnx_kvcache.cache.rotation.site_rotation`):
    ``none``, ``keys`` or ``keys_and_values``; the cache holds the turned values."""
    rotation_matrix: str | None = None
    """By which ``H`` (:func:`~onnx_kvcache.cache.rotation.site_matrix`: ``hadamard`` or
    ``walsh_dct``); None when not rotated."""
    head_size: int = 0
    head_sink: bool = False
    """The node adds attention sinks (``head_sink``: one logit per query head) to its softmax."""
    prompt_in_float: bool = False
    """A call of several tokens attends them through the float kernel, the cache stored
    quantized (:mod:`~onnx_kvcache.cache.prompt_path`); one token a call: the quantized kernel."""
    rolling: int | None = None
    """Rows a rolling window cache keeps (the export's ``W - 1``: :mod:`~onnx_kvcache.cache.rolling`),
    else None: it starts empty, as the export's, and holds each row's last ``W - 1`` tokens."""
    rows: int | None = None
    """Fixed buffers' rows (a static cache): allocated whole, whatever the context."""
    storage: str = "auto"
    """``auto``: the attention kernel holds the cache; ``qdq``: a cache of the model's own attention
    (:func:`~onnx_kvcache.cache.storage.find_qdq_caches`), float or stored through
    QuantizeLinear/DequantizeLinear (``op`` names its writer)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "shape": [str(d) if not isinstance(d, int) else d for d in self.shape]
        }


@dataclasses.dataclass(frozen=True)
class CacheModelInfo:
    layers: tuple[CacheLayerInfo, ...]

    @property
    def bytes_per_token(self) -> float:
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def original_bytes_per_token(self) -> float:
        return sum(layer.original_bytes_per_token for layer in self.layers)

    def cache_bytes(self, context: int, batch: int = 1) -> float:
        """Cache bytes for ``batch`` sequences of ``context`` tokens (windows capped)."""
        total = 0.0
        for layer in self.layers:
            held = layer.window or layer.rolling
            tokens = min(context, held) if held else context
            total += layer.bytes_per_token * (layer.rows or tokens) * batch
        return total

    def to_json(self, context: int | None = None, batch: int = 1) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "layers": [layer.to_json() for layer in self.layers],
            "bytes_per_token": self.bytes_per_token,
            "original_bytes_per_token": self.original_bytes_per_token,
        }
        if context is not None:
            doc |= {"context": context, "batch": batch, "cache_bytes": self.cache_bytes(context, batch)}
        return doc


def _unquantized_dtype(site: CacheSite) -> ir.DataType | None:
    """The type the cache held before quantization: the node's T, unless its T inputs are a
    float32 model's values cast to float16 for the attention alone (Float16AttentionPass), whose
    cache was float32 (the figure ``evaluate`` takes for the original)."""
    query = site.query_dtype
    if query != ir.DataType.FLOAT16:
        return query
    for name in site.op.t_inputs:
        value = site.input(name)
        if value is None or value.dtype is None:
            continue
        cast = value.producer()
        source = cast.inputs[0] if cast is not None and cast.op_type == "Cast" and cast.inputs else None
        return ir.DataType.FLOAT if source is not None and source.dtype == ir.DataType.FLOAT else query
    return query


def _matrix_of(site: CacheSite) -> str | None:
    matrix = site_matrix(site)
    return None if matrix is None else matrix.name


def _layer_info(site: CacheSite) -> CacheLayerInfo:
    past_k, past_v = site.past_key, site.past_value
    assert past_k is not None
    dtype = past_k.dtype
    fmt = site.cache_format
    head = site.head_size()
    bits = fmt.bit_width if fmt is not None else None
    per_value = fmt.bytes_per_value() if fmt is not None else (dtype.itemsize if dtype is not None else 0)
    query = _unquantized_dtype(site) or dtype
    caches = len(site.sides)
    original = caches * site.kv_num_heads * head * (query.itemsize if query is not None else 0)
    k, v = site.input(site.op.key.scale), None if site.single_cache else site.input(site.op.value.scale)
    window = site.int_attr("local_window_size", -1)
    sized = bool(site.int_attr("sliding_window_cache", 0))
    return CacheLayerInfo(
        layer_id=site.layer_id,
        node=site.name,
        past_key=past_k.name or "",
        past_value=past_v.name or "" if past_v is not None else "",
        dtype=str(dtype.name if dtype is not None else "?"),
        shape=tuple(past_k.shape) if past_k.shape is not None else (),
        k_quant_type=site.str_attr(site.op.key.quant_attr, "NONE"),
        v_quant_type="-" if site.single_cache else site.str_attr(site.op.value.quant_attr, "NONE"),
        bit_width=bits,
        k_scale=constant_values(k),
        v_scale=constant_values(v),
        shared_scale=k is not None and k is v,
        window=window if window > 0 and sized else None,
        bytes_per_token=caches * site.kv_num_heads * head * per_value,
        original_bytes_per_token=original,
        op=site.op.op_type,
        layout=site.op.layout.dims,
        rotation=site_rotation(site).name,
        rotation_matrix=_matrix_of(site),
        head_size=head,
        head_sink=site.input("head_sink") is not None,
        prompt_in_float=site.wrapper is not None,
        rolling=window - 1 if window > 0 and _gathered(site) and not sized else None,
    )


def _io_quant(cache: IoCache | None) -> str:
    if cache is None:
        return "-"
    if cache.format is None:
        return "NONE"
    return (
        "QDQ" if cache.scale is None else "QDQ " + ("PER_TENSOR" if cache.scale.size == 1 else "PER_CHANNEL")
    )


def _io_layer_info(key: IoCache, value: IoCache | None, turned: tuple[str, str | None]) -> CacheLayerInfo:
    """One layer of caches the graph's I/O names (:mod:`~onnx_kvcache.cache.io_caches`): static
    buffers, an unfused export's (keys and values may differ in width: MLA); ``turned``: the
    rotation and ``H`` the graph applies before them (:func:`~.rotation.stored_rotation`)."""
    caches = [c for c in (key, value) if c is not None]
    scales = [None if c.scale is None else [float(x) for x in c.scale.reshape(-1)] for c in (key, value) if c]
    return CacheLayerInfo(
        layer_id=key.layer_id,
        node=key.convention.name,
        past_key=key.past,
        past_value=value.past if value is not None else "",
        dtype=key.dtype.name,
        shape=("batch", key.rows, key.kv_num_heads * key.head_size)
        if key.rows is not None
        else ("batch", key.kv_num_heads, "past", key.head_size),
        k_quant_type=_io_quant(key),
        v_quant_type=_io_quant(value),
        bit_width=key.format.bit_width if key.format is not None else None,
        k_scale=scales[0],
        v_scale=scales[1] if len(scales) > 1 else None,
        shared_scale=False,
        window=None,
        bytes_per_token=sum(c.bytes_per_token for c in caches),
        original_bytes_per_token=sum(c.float_bytes_per_token for c in caches),
        op=key.convention.label,
        layout=key.convention.dims,
        head_size=key.head_size,
        rows=key.rows,
        storage="qdq",
        rotation=turned[0],
        rotation_matrix=turned[1],
    )


def _io_layers(model: ir.Model, exported: bool) -> list[CacheLayerInfo]:
    """Static buffers; an export's caches when stored quantized, or float with ``exported``
    (a float export is otherwise what a fused copy shows)."""
    caches = find_io_caches(model)
    if caches and caches[0].convention is EXPORTED and not (exported or any(c.format for c in caches)):
        return []
    values = {c.layer_id: c for c in caches if c.kind == "value"}
    rotation, matrix = stored_rotation(model)
    turned = (rotation.name, matrix.name if matrix is not None else None)
    return [_io_layer_info(c, values.get(c.layer_id), turned) for c in caches if c.kind == "key"]


def inspect_kv_cache(model: ModelLike, *, exported: bool = False) -> CacheModelInfo:
    """Read the cache layout of every attention layer from the graph (no weights are read).

    A model with no attention node of ours: the caches its I/O names
    (:data:`~onnx_kvcache.cache.io_caches.IO_CONVENTIONS`): static buffers, an export's stored
    quantized, or (``exported``) float.
    """
    require_flags(exported=exported)
    model = as_model(model)
    validate_model(model, sort=False)  # malformed: one line, never a ZeroDivisionError
    seen: set[int] = set()
    layers = []
    sites = find_attention_sites(model)
    for site in sites:
        if id(site.past_key) in seen:
            continue
        seen.add(id(site.past_key))
        layers.append(_layer_info(site))
    return CacheModelInfo(tuple(layers) if sites else tuple(_io_layers(model, exported)))


def _fmt_scale(values: list[float] | None) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"[{len(values)}] {min(values):.3g}..{max(values):.3g}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} PiB"


def _gathered(site: CacheSite) -> bool:
    """A rolling window cache's site: its present leaves through the row gather (wrapped or not)."""
    return any(present_output(p) is not p for side in site.sides if (p := site.present(side)) is not None)


def _allocation_lines(info: CacheModelInfo) -> list[str]:
    """What serving code must feed as past inputs once the cache is quantized: their element
    type and shape changed (int4: two values a byte, so the last dimension is halved)."""
    groups: dict[tuple[str, str, int | None, int | None, str], list[int]] = {}
    for layer in info.layers:
        if layer.bit_width is not None:
            shape = "[" + ", ".join(str(d) for d in layer.shape) + "]"
            packed = " (int4: two values a byte, head_size / 2)" if layer.bit_width < 8 else ""
            packed = "" if layer.dtype == "INT4" else packed  # ONNX's int4: a logical type
            rows = -layer.rows if layer.rows else layer.window  # a static buffer: whole, all rows
            key = (layer.dtype, shape + packed, rows, layer.rolling, layer.storage)
            groups.setdefault(key, []).append(layer.layer_id)
    if not groups:
        return []
    lines = ["past inputs to allocate (the quantized cache's type and shape, not the float model's):"]
    for (dtype, shape, window, rolling, storage), ids in groups.items():
        empty = f"{window} zero rows, window-sized" if window else "0 tokens in its sequence"
        empty = f"the whole buffer, {-window} rows" if window and window < 0 else empty
        stored = "as the float model's, in this type (QuantizeLinear/DequantizeLinear)"
        empty = stored if storage == "qdq" and not (window and window < 0) else empty
        empty += f", then at most {rolling} (its presents fed back)" if rolling else ""
        lines.append(f"  {dtype} {shape} (layer(s) {_ranges(ids)}; an empty cache: {empty})")
    return lines


def _layers_by(info: CacheModelInfo, field: str) -> dict[int, list[int]]:
    """The layer ids by their ``field`` value (``window``, ``rolling``), those without one left out."""
    groups: dict[int, list[int]] = {}
    for layer in info.layers:
        if value := getattr(layer, field):
            groups.setdefault(value, []).append(layer.layer_id)
    return groups


def _attention_lines(info: CacheModelInfo) -> list[str]:
    """The layers whose cache is window-sized or rolling, and those with attention sinks."""
    lines = []
    for window, ids in _layers_by(info, "window").items():
        lines.append(
            f"window-sized caches (sliding_window_cache=1): layer(s) {_ranges(ids)} keep the last "
            f"{window} tokens in at least {window} rows (empty: {window} zero rows; no more bytes past it)"
        )
    for rows, ids in _layers_by(info, "rolling").items():
        lines.append(
            f"rolling window caches (the export's): layer(s) {_ranges(ids)} keep each row's last {rows} "
            f"tokens (window {rows + 1}; empty: 0 rows, as the export's; no more bytes past it)"
        )
    sunk = [layer.layer_id for layer in info.layers if layer.head_sink]
    if sunk:
        lines.append(f"attention sinks (head_sink, one logit per query head): layer(s) {_ranges(sunk)}")
    return lines


def _prompt_lines(info: CacheModelInfo) -> list[str]:
    """Which layers' prompts attend through the float kernel."""
    ids = [layer.layer_id for layer in info.layers if layer.prompt_in_float]
    if not ids:
        return []
    return [
        f"prompt in float: in layer(s) {_ranges(ids)} a call of several tokens (a prompt) attends them "
        "through the float kernel and stores them quantized; one token a call goes through the quantized "
        "kernel (a prompt at float speed on the CPU: docs/choosing-a-format.md)"
    ]


def _rotation_lines(info: CacheModelInfo) -> list[str]:
    """Which layers' caches hold rotated values, and by what."""
    groups: dict[tuple[str, str, int, bool], list[int]] = {}
    for layer in info.layers:
        if layer.rotation != "none" and layer.rotation_matrix is not None:
            quantized = layer.k_quant_type != "NONE" or layer.v_quant_type != "NONE"
            key = (layer.rotation, layer.rotation_matrix, layer.head_size, quantized)
            groups.setdefault(key, []).append(layer.layer_id)
    return [
        f"rotated cache: {ROTATIONS[name].description} ({matrix_name(size, matrix)}, after RoPE and q/k "
        f"norms) in layer(s) {_ranges(ids)}; "
        + ("its scales are for the turned values" if quantized else "a float cache, no scales: unquantized")
        for (name, matrix, size, quantized), ids in groups.items()
    ]


def _io_lines(info: CacheModelInfo) -> list[str]:
    """Static buffers' whole size (allocated whatever the context)."""
    lines = []
    rows = {layer.rows for layer in info.layers if layer.rows}
    if rows:
        size = _fmt_bytes(sum(layer.bytes_per_token * (layer.rows or 0) for layer in info.layers))
        lines.append(
            f"static buffers of {max(rows)} rows, allocated whole: {size} a sequence, whatever its length"
        )
    return lines


def _ranges(ids: list[int]) -> str:
    return (
        f"{ids[0]}-{ids[-1]}"
        if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1))
        else ", ".join(map(str, ids))
    )


def format_cache_table(info: CacheModelInfo, context: int | None = None, batch: int = 1) -> str:
    """Human-readable table, one row per attention layer, totals last; each operator's cache
    layout is named first."""
    header = [
        f"{op}: cache [{', '.join(layout)}]"
        for op, layout in dict.fromkeys((layer.op, layer.layout) for layer in info.layers)
    ]
    rows = [("layer", "past_key", "dtype", "quant (k/v)", "bits", "k_scale", "v_scale", "B/token")]
    for layer in info.layers:
        rows.append(
            (
                str(layer.layer_id),
                layer.past_key,
                layer.dtype,
                f"{layer.k_quant_type}/{layer.v_quant_type}",
                str(layer.bit_width or "-"),
                _fmt_scale(layer.k_scale) + (" (shared)" if layer.shared_scale else ""),
                _fmt_scale(layer.v_scale),
                f"{layer.bytes_per_token:g}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = header + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += (
        _io_lines(info)
        + _allocation_lines(info)
        + _attention_lines(info)
        + _rotation_lines(info)
        + _prompt_lines(info)
    )
    before, after = info.original_bytes_per_token, info.bytes_per_token
    ratio = before / after if after else float("nan")
    lines.append(
        f"cache bytes per token: {after:g} (unquantized {before:g}, {ratio:.2f}x smaller)"
        if before != after
        else f"cache bytes per token: {after:g} (unquantized)"
    )
    if context is not None:
        lines.append(
            f"cache for batch {batch} x {context} tokens: {_fmt_bytes(info.cache_bytes(context, batch))}"
        )
    return "\n".join(lines)
