"""What a model's KV cache looks like: per-layer dtype, shape, quantization, bytes."""

from __future__ import annotations

__all__ = ["CacheLayerInfo", "CacheModelInfo", "format_cache_table", "inspect_kv_cache"]

import dataclasses
from typing import Any

import onnx_ir as ir

from onnx_kvcache.gqa import K_SCALE, V_SCALE, GqaSite, constant_values, find_gqa_sites


@dataclasses.dataclass(frozen=True)
class CacheLayerInfo:
    """One GQA layer's cache as the graph declares it."""

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
            tokens = min(context, layer.window) if layer.window else context
            total += layer.bytes_per_token * tokens * batch
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


def _layer_info(site: GqaSite) -> CacheLayerInfo:
    past_k, past_v = site.past_key, site.past_value
    assert past_k is not None and past_v is not None
    dtype = past_k.dtype
    packed = dtype == ir.DataType.UINT8
    head = site.head_size(cache_is_packed=packed)
    bits = site.int_attr("kv_cache_bit_width", 0) or None
    per_value = 0.5 if packed and bits == 4 else (dtype.itemsize if dtype is not None else 0)
    query = site.query_dtype or dtype
    original = 2 * site.kv_num_heads * head * (query.itemsize if query is not None else 0)
    k, v = site.input(K_SCALE), site.input(V_SCALE)
    window = site.int_attr("local_window_size", -1)
    return CacheLayerInfo(
        layer_id=site.layer_id,
        node=site.name,
        past_key=past_k.name or "",
        past_value=past_v.name or "",
        dtype=str(dtype.name if dtype is not None else "?"),
        shape=tuple(past_k.shape) if past_k.shape is not None else (),
        k_quant_type=site.str_attr("k_quant_type", "NONE"),
        v_quant_type=site.str_attr("v_quant_type", "NONE"),
        bit_width=bits,
        k_scale=constant_values(k),
        v_scale=constant_values(v),
        shared_scale=k is not None and k is v,
        window=window if window > 0 and site.int_attr("sliding_window_cache", 0) else None,
        bytes_per_token=2 * site.kv_num_heads * head * per_value,
        original_bytes_per_token=original,
    )


def inspect_kv_cache(model: ir.Model) -> CacheModelInfo:
    """Read the cache layout of every GQA layer from the graph (no weights are read)."""
    seen: set[int] = set()
    layers = []
    for site in find_gqa_sites(model):
        if id(site.past_key) in seen:
            continue
        seen.add(id(site.past_key))
        layers.append(_layer_info(site))
    return CacheModelInfo(tuple(layers))


def _fmt_scale(values: list[float] | None) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"[{len(values)}] {min(values):.3g}..{max(values):.3g}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_cache_table(info: CacheModelInfo, context: int | None = None, batch: int = 1) -> str:
    """Human-readable table, one row per GQA layer, totals last."""
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
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
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
