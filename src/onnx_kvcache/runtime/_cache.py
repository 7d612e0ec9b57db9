"""What the runner's two caches share: the bindings and the Protocol it calls them through.

A :class:`CacheBinding` pairs a cache's past input with its present output (found from the
GroupQueryAttention or PagedAttention nodes, :func:`discover_cache_bindings`). A dense cache
(:mod:`onnx_kvcache.runtime._dense_cache`) and a paged block pool
(:mod:`onnx_kvcache.runtime._paged_cache`) hold the tensors behind them; both are a
:class:`KvCache`, built from a :class:`CacheLayout` (what the model fixes, read before the
session exists) and a :class:`Feeding` (what the session feeds and where its tensors live).
"""

from __future__ import annotations

__all__ = [
    "CacheBinding",
    "CacheLayout",
    "Feeding",
    "KvCache",
    "Rows",
    "discover_cache_bindings",
    "with_feed_dtypes",
]

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat, scale_granularity
from onnx_kvcache.cache.io_caches import CachePair, IoCache, find_io_caches
from onnx_kvcache.cache.operators import PAGED, CacheSide
from onnx_kvcache.cache.rolling import present_output
from onnx_kvcache.cache.sites import CacheSite, constant_values, find_attention_sites, resident_rows
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.model_io import fed_as_bits, to_ort_value

_PAST = re.compile(r"^(past|cache|kv_cache|past_key_values)", re.IGNORECASE)
_KIND = re.compile(r"(?:^|[._\-])(key|value|k|v)(?:[._\-]|$)|(key|value)", re.IGNORECASE)


def _cache_kind(name: str) -> str | None:
    match = _KIND.search(name.split("/")[-1])
    if not match:
        return None
    word = (match.group(1) or match.group(2)).lower()
    return "key" if word in ("key", "k") else "value"


@dataclasses.dataclass(frozen=True)
class CacheBinding(CachePair):
    """One cache tensor: its past input, present output, layout and stored format."""

    last_dim: int
    """Last dimension as stored (packed for int4)."""
    capacity: int | None
    """Sequence capacity of a window-sized cache (sliding_window_cache=1), else None."""
    static_capacity: bool = False
    """The model fixes that capacity in the cache's shape (it cannot be enlarged)."""
    window: int | None = None
    """``local_window_size`` of a window-sized cache, else None."""
    format: CacheFormat | None = None
    """The quantized format, or None for a float cache."""
    scale: np.ndarray | None = None
    """Dequantization scale, broadcastable to the BNSH cache."""
    head_size: int = 0
    feed_dtype: ir.DataType | None = None
    """Element type of the tensors the session takes, when not ``dtype`` (emulated or
    bfloat16 caches: they hold float values, dequantized for a quantized format)."""
    paged: bool = False
    """A block pool ``[num_blocks, block_size, kv_num_heads, last_dim]`` (PagedAttention)."""
    block_size: int | None = None
    """The pool's static block size, when the model fixes one."""
    rows: int | None = None
    """A fixed buffer's rows: the cache is ``[batch, rows, kv_num_heads * head_size]``, written in
    place by the model (mobius's static cache, :data:`~onnx_kvcache.cache.io_caches.STATIC`)."""

    @property
    def kind_of_cache(self) -> str:
        """``paged``, ``static`` (fixed buffers) or ``dense``: which layout the runner keeps."""
        return "paged" if self.paged else "static" if self.rows is not None else "dense"

    @property
    def holds_values(self) -> bool:
        """The session's tensors hold float values of a quantized cache (emulation)."""
        return self.format is not None and self.feed_dtype is not None

    @property
    def feed_last_dim(self) -> int:
        return self.head_size if self.holds_values else self.last_dim

    def resident_rows(self, total: int, capacity: int) -> int:
        """Rows of this cache, ``capacity`` rows long, that hold tokens after ``total``."""
        return resident_rows(total, capacity, self.window)

    @property
    def logical(self) -> bool:
        """A quantized cache whose element type is the format's values, one a numpy element
        (ONNX's INT4 of a QDQ cache, not the kernels' packed uint8)."""
        return self.format is not None and self.dtype != self.format.dtype

    def _zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        if self.feed_dtype is None and self.format is not None and not self.logical:
            return np.zeros(shape, self.format.numpy_dtype())
        return np.zeros(shape, (self.feed_dtype or self.dtype).numpy())

    def empty(self, batch: int, min_capacity: int = 0) -> np.ndarray:
        if self.rows is not None:
            return self._zeros((batch, self.rows, self.kv_num_heads * self.feed_last_dim))
        length = self.capacity or 0
        if self.capacity and not self.static_capacity:
            length = max(length, min_capacity)
        return self._zeros((batch, self.kv_num_heads, length, self.feed_last_dim))

    def empty_pool(self, num_blocks: int, block_size: int) -> np.ndarray:
        return self._zeros((num_blocks, block_size, self.kv_num_heads, self.feed_last_dim))

    def values(self, cache: np.ndarray) -> np.ndarray:
        """float32 values of a cache tensor as the session holds it (dequantized), BNSH (a fixed
        buffer's ``[batch, rows, kv_num_heads * head_size]`` split into its heads)."""
        if self.rows is not None:
            cache = np.asarray(cache)
            cache = cache.reshape(*cache.shape[:2], self.kv_num_heads, -1).transpose(0, 2, 1, 3)
        if self.format is None or self.holds_values:
            return np.asarray(cache, np.float32)
        assert self.scale is not None
        if self.logical:
            return np.asarray(cache).astype(np.float32) * self.scale
        return self.format.dequantize(cache, self.scale, self.head_size)

    def stored(self, cache: np.ndarray) -> np.ndarray:
        """A cache tensor in the stored format (fp8 bits, int8, packed int4)."""
        if not self.holds_values:
            return np.asarray(cache)
        assert self.format is not None and self.scale is not None
        return self.format.quantize(cache, self.scale)

    def nbytes(self, cache_shape: Sequence[int]) -> int:
        """Bytes of this cache as stored, for a session tensor of ``cache_shape``."""
        rows = int(np.prod(cache_shape[:2]) * self.kv_num_heads if self.rows else np.prod(cache_shape[:3]))
        stored = self.format.dtype if self.format is not None and not self.logical else self.dtype
        itemsize = stored.itemsize
        return int(rows * self.last_dim * itemsize)


def _scale_of(site: CacheSite, slot: str, head: int) -> np.ndarray | None:
    """A scale input's values shaped against a BNSH cache (the granularity row's shape)."""
    values = constant_values(site.input(slot))
    if values is None or site.granularity is None:
        return None
    return np.asarray(values, np.float32).reshape(
        scale_granularity(site.granularity).bnsh(site.kv_num_heads, head)
    )


def _capacity(site: CacheSite) -> int | None:
    """The window of a window-sized cache (sliding_window_cache=1), else None."""
    if site.int_attr("sliding_window_cache", 0) and site.int_attr("local_window_size", -1) > 0:
        return site.int_attr("local_window_size", -1)
    return None


def _binding(site: CacheSite, side: CacheSide, past: ir.Value, present: ir.Value) -> CacheBinding:
    """The binding of one side (key or value) of ``site``, read from its past input's shape."""
    assert past.name is not None and present.name is not None
    if past.dtype is None:
        raise KvCacheError(
            f"{site.label}: its cache input {past.name!r} has no element type; the model is "
            "malformed (every graph input needs one)."
        )
    fmt, paged = site.cache_format, site.op.layout.name == PAGED.layout.name
    shape, capacity, static = past.shape, _capacity(site), False
    if capacity and shape is not None and len(shape) == 4 and isinstance(shape[2], int):
        capacity, static = shape[2], True
    head = site.head_size()
    last = shape[3] if shape is not None and len(shape) == 4 else None
    if not isinstance(last, int):
        last = fmt.packed_dim(head) if fmt is not None else head
    block = shape[1] if paged and shape is not None and len(shape) == 4 else None
    return CacheBinding(
        site.layer_id,
        side.kind,
        past.name,
        present.name,
        past.dtype,
        site.kv_num_heads,
        last,
        capacity,
        static,
        site.int_attr("local_window_size", -1) if capacity else None,
        fmt,
        _scale_of(site, side.scale, head) if fmt is not None else None,
        head,
        paged=paged,
        block_size=block if isinstance(block, int) else None,
    )


def _refuse_unread_caches(model: ir.Model) -> None:
    """An input named like a cache that no attention node reads: the export was not fused."""
    for value in model.graph.inputs:
        if _PAST.match(value.name or "") and _cache_kind(value.name or ""):
            raise KvCacheError(
                f"Input {value.name!r} looks like a KV cache but no GroupQueryAttention or "
                "PagedAttention node reads it; the runner needs such a decoder. Fuse an exported "
                "model's attention first: optimize_model(model) (docs/exporting.md)."
            )


def _io_binding(cache: IoCache) -> CacheBinding:
    """The binding of a cache the graph's I/O names (a static buffer, an unfused export's)."""
    fmt = cache.format
    packed = fmt is not None and cache.dtype == fmt.dtype  # else a type that packs itself (INT4)
    last = fmt.packed_dim(cache.head_size) if fmt is not None and packed else cache.head_size
    return CacheBinding(
        cache.layer_id,
        cache.kind,
        cache.past,
        cache.present,
        cache.dtype,
        cache.kv_num_heads,
        last,
        None,
        format=fmt,
        scale=cache.scale,
        head_size=cache.head_size,
        rows=cache.rows,
    )


def discover_cache_bindings(model: ir.Model, *, io_caches: bool = False) -> list[CacheBinding]:
    """Pair each cache graph input with its present output, using the attention nodes; with
    ``io_caches``, a model whose attention nodes read none: the caches its I/O names
    (:func:`~onnx_kvcache.cache.io_caches.find_io_caches`)."""
    bindings: list[CacheBinding] = []
    inputs = {v.name for v in model.graph.inputs}
    outputs = {v.name for v in model.graph.outputs}
    for site in find_attention_sites(model):
        for side in site.sides:
            past, present = site.past(side), present_output(site.present(side))
            if past is None or present is None or past.name not in inputs or present.name not in outputs:
                continue
            bindings.append(_binding(site, side, past, present))
    if not bindings and io_caches:
        bindings = [_io_binding(cache) for cache in find_io_caches(model)]
    if not bindings:
        _refuse_unread_caches(model)
    return bindings


def with_feed_dtypes(bindings: Sequence[CacheBinding], model: ir.Model) -> list[CacheBinding]:
    """``bindings`` with the element type ``model`` (the graph the session runs) takes each
    past in, where it is not the stored one (emulated or bfloat16 caches)."""
    feeds = {v.name: v.dtype for v in model.graph.inputs}
    return [
        b if feeds.get(b.past) in (None, b.dtype) else dataclasses.replace(b, feed_dtype=feeds[b.past])
        for b in bindings
    ]


@dataclasses.dataclass(frozen=True)
class Feeding:
    """What the session takes: its token-ids input, its input names, and where the caches live."""

    ids_name: str
    input_names: tuple[str, ...]
    device: str
    """``cpu`` or ``cuda``."""
    io_binding: bool
    """The caches are OrtValues on ``device``, bound to the session."""

    def hold(self, cache: np.ndarray, binding: CacheBinding) -> Any:
        """A fresh or grown cache tensor as the session's caches hold it."""
        if self.io_binding:
            return to_ort_value(cache, binding.feed_dtype or binding.dtype, self.device)
        return cache

    def feed(self, cache: Any, binding: CacheBinding) -> Any:
        """A cache as a plain run feeds it (types numpy lacks, fp8 or bfloat16, as their bits)."""
        return (
            to_ort_value(cache, binding.dtype) if fed_as_bits(binding.feed_dtype or binding.dtype) else cache
        )


Rows = Sequence[np.ndarray] | np.ndarray
"""New tokens per sequence: a ``[batch, seq]`` array, or one array per sequence (paged)."""


class KvCache(Protocol):
    """The runner's caches: dense tensors (``DenseCache``) or a block pool (``PagedCache``)."""

    bindings: list[CacheBinding]
    caches: dict[str, Any]
    """Each binding's tensor as the session holds it, by past input name."""

    @property
    def batch(self) -> int: ...

    @property
    def length(self) -> int:
        """Tokens of the longest sequence in the context."""

    @property
    def block_size(self) -> int | None:
        """Tokens per block of a paged decoder's pool (None for dense caches)."""

    @property
    def pool(self) -> Any:
        """The block pool of a paged decoder, else None."""

    @property
    def capacity(self) -> int | None:
        """Tokens a sequence may hold: fixed buffers' rows (a static cache), else None."""

    @property
    def kernel_rule(self) -> str | None:
        """The rule every run follows whatever the provider (the paged CPU reference), else None."""

    def reset(self, batch: int, min_capacity: int) -> None:
        """Empty caches for ``batch`` sequences, room for ``min_capacity`` tokens each."""

    def require_packed(self) -> None:
        """Refuse sequences of different lengths in one call unless the cache packs them."""

    def feeds(self, rows: Rows) -> dict[str, np.ndarray]:
        """The non-cache inputs of a call adding ``rows[b]`` tokens to sequence ``b``."""

    def advance(self, rows: Rows) -> None:
        """Count the tokens of a run that :meth:`feeds` prepared."""

    def logits(self, logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """A rectangular call's logits as ``[batch, seq, vocab]``."""

    def bind_present(self, binding: Any, cache: CacheBinding) -> None:
        """Bind ``cache``'s present output on an onnxruntime io binding."""

    def values(self, cache: CacheBinding) -> np.ndarray:
        """A cache's float32 values ``[B, kv_num_heads, S, head_size]``, dequantized."""


class CacheLayout(Protocol):
    """What a model fixes about its caches, read before the session exists."""

    @property
    def inputs(self) -> Mapping[str, str]:
        """Graph inputs the cache feeds besides ids, mask and positions, by role."""

    def cache(self, bindings: list[CacheBinding], feeding: Feeding) -> KvCache:
        """The live caches of this layout."""
