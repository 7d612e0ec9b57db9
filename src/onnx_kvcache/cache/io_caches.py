"""Caches a decoder's graph inputs and outputs carry with no attention operator the library
quantizes: one frozen row per convention, read from the graph's I/O names.

- ``static`` (mobius's ``--static-cache`` build): fixed buffers ``key_cache.N`` /
  ``value_cache.N`` ``[batch, max_len, kv_num_heads * head_size]``, written in place by
  ``TensorScatter`` at ``write_indices`` (each row's past length) and returned as
  ``updated_key_cache.N``; attention reads ``nonpad_kv_seqlen`` (each row's length after the
  call) rows of them.
- ``exported`` (an export whose attention does not fuse: multi-head latent attention, keys and
  values of different head sizes): ``past_key_values.N.key`` ``[batch, kv_num_heads, past,
  head_size]`` in, ``present.N.key`` (grown by the new tokens) out, ``attention_mask`` fed.

A cache stored quantized (``convert``'s QDQ storage) has an integer or fp8 input read by a
``DequantizeLinear``; its format and scale are read from that node.
"""

from __future__ import annotations

__all__ = ["EXPORTED", "IO_CONVENTIONS", "STATIC", "CachePair", "IoCache", "IoConvention", "find_io_caches"]

import dataclasses
import re

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat, get_format
from onnx_kvcache.cache.sites import constant_values


@dataclasses.dataclass(frozen=True)
class IoConvention:
    """How a family of decoders names, shapes and feeds its caches.

    Attributes:
        name: ``static`` or ``exported``.
        past: A cache input's name; groups ``kind`` (key/value) and ``layer``.
        present: The matching output, formatted with ``kind`` and ``layer``.
        fixed: The model writes fixed buffers in place (their rows never grow).
        inputs: What the runner feeds besides ids, positions and the caches.
        dims: The names of a cache's dimensions.
        label: How ``inspect`` names the caches.
    """

    name: str
    past: re.Pattern[str]
    present: str
    fixed: bool
    inputs: tuple[str, ...]
    dims: tuple[str, ...]
    label: str

    def present_name(self, kind: str, layer: int) -> str:
        return self.present.format(kind=kind, layer=layer)


STATIC = IoConvention(
    "static",
    re.compile(r"^(?P<kind>key|value)_cache\.(?P<layer>\d+)$"),
    "updated_{kind}_cache.{layer}",
    True,
    ("write_indices", "nonpad_kv_seqlen"),
    ("batch", "max_len", "kv_num_heads * head_size"),
    "static buffers (TensorScatter)",
)
EXPORTED = IoConvention(
    "exported",
    re.compile(r"^past_key_values\.(?P<layer>\d+)\.(?P<kind>key|value)$"),
    "present.{layer}.{kind}",
    False,
    ("attention_mask",),
    ("batch", "kv_num_heads", "sequence", "head_size"),
    "exported attention (not fused)",
)
IO_CONVENTIONS: dict[str, IoConvention] = {row.name: row for row in (STATIC, EXPORTED)}

#: The format a quantized (QDQ) cache input's element type stores.
_QDQ_FORMATS = {
    ir.DataType.INT8: "int8",
    ir.DataType.INT4: "int4",
    ir.DataType.FLOAT8E4M3FN: "fp8",
}


@dataclasses.dataclass(frozen=True)
class CachePair:
    """One cache of a layer (``kind``: key or value): its past input paired with its present
    output. What a convention's :class:`IoCache` and the runner's ``CacheBinding`` share."""

    layer_id: int
    kind: str
    past: str
    present: str
    dtype: ir.DataType
    """The element type of the past input as the graph declares it (the stored type)."""
    kv_num_heads: int


@dataclasses.dataclass(frozen=True)
class IoCache(CachePair):
    """One cache a convention names: its past input, present output, shape and storage."""

    convention: IoConvention
    head_size: int
    rows: int | None
    """A fixed buffer's rows (its ``max_len``), else None."""
    format: CacheFormat | None = None
    """The quantized storage format (a ``DequantizeLinear`` reads the input), else None."""
    scale: np.ndarray | None = None
    """The scale, shaped against the cache's ``[batch, kv_num_heads, rows, head_size]`` values."""
    float_dtype: ir.DataType | None = None
    """The type attention reads the cache in: its own, or its DequantizeLinear's output."""

    @property
    def bytes_per_token(self) -> float:
        """Bytes one token takes in this cache as stored."""
        size = self.format.bytes_per_value() if self.format is not None else self.dtype.itemsize
        return self.kv_num_heads * self.head_size * size

    @property
    def float_bytes_per_token(self) -> float:
        """Bytes one token took in this cache unquantized."""
        return self.kv_num_heads * self.head_size * (self.float_dtype or self.dtype).itemsize


def _dim(value: ir.Value, axis: int) -> int | None:
    shape = value.shape
    dim = shape[axis] if shape is not None and len(shape) > axis else None
    return dim if isinstance(dim, int) else None


def _heads_below(value: ir.Value, depth: int = 4) -> int | None:
    """``kv_num_heads`` of the first attention-like node reading ``value`` (a few nodes down)."""
    frontier = [value]
    for _ in range(depth):
        nodes = [use.node for v in frontier for use in v.uses()]
        for node in nodes:
            attr = node.attributes.get("kv_num_heads")
            if attr is not None:
                return int(attr.as_int())
        frontier = [out for node in nodes for out in node.outputs]
    return None


def _dequantizer(past: ir.Value, present: ir.Value) -> ir.Node | None:
    """The DequantizeLinear of a QDQ cache: reading the past (attention reads the stored rows
    through it), else the present (a writer that moves the codes themselves)."""
    for value in (past, present):
        found = next((u.node for u in value.uses() if u.node.op_type == "DequantizeLinear"), None)
        if found is not None:
            return found
    return None


def _scale(reader: ir.Node) -> np.ndarray | None:
    """The dequantization scale: the DequantizeLinear's, times the constant of a ``Mul`` after
    it (a 4-D cache's per-channel scale: a unit-scale DequantizeLinear, then ``Mul``)."""
    found = constant_values(reader.inputs[1]) if len(reader.inputs) > 1 else None
    if found is None:
        return None
    scale = np.asarray(found, np.float32)
    uses = list(reader.outputs[0].uses())
    if len(uses) == 1 and uses[0].node.op_type == "Mul":
        other = uses[0].node.inputs[1 - uses[0].idx]
        extra = constant_values(other)
        if extra is not None and other is not None and other.shape is not None:
            return scale * np.asarray(extra, np.float32).reshape(-1)
    return scale


def _storage(past: ir.Value, present: ir.Value, heads: int, head: int) -> dict[str, object]:
    """A QDQ cache's format, its scale shaped against ``[batch, heads, rows, head]`` values and
    the type it is read in (:class:`IoCache`'s fields); none of them for a float cache."""
    name = _QDQ_FORMATS.get(past.dtype) if past.dtype is not None else None
    reader = _dequantizer(past, present)
    if name is None or reader is None:
        return {}
    found: dict[str, object] = {"format": get_format(name), "float_dtype": reader.outputs[0].dtype}
    scale = _scale(reader)
    if scale is None:
        return found
    shapes = {heads: (1, heads, 1, 1), head: (1, 1, 1, head), heads * head: (1, heads, 1, head)}
    return found | {"scale": scale.reshape(shapes.get(scale.size, (1, 1, 1, 1)))}


def _io_cache(convention: IoConvention, value: ir.Value, outputs: dict[str, ir.Value]) -> IoCache | None:
    match = convention.past.match(value.name or "")
    if match is None or value.dtype is None:
        return None
    kind, layer = match.group("kind"), int(match.group("layer"))
    present = convention.present_name(kind, layer)
    if present not in outputs:
        return None
    if convention.fixed:
        rows, width = _dim(value, 1), _dim(value, 2)
        heads = _heads_below(value) or 1
    else:
        rows, heads, width = None, _dim(value, 1) or 1, _dim(value, 3)
        width = None if width is None else width * heads
    if width is None or width % heads:
        return None
    head = width // heads
    storage = _storage(value, outputs[present], heads, head)
    assert value.name is not None
    return IoCache(layer, kind, value.name, present, value.dtype, heads, convention, head, rows, **storage)  # type: ignore[arg-type]


def find_io_caches(model: ir.Model, conventions: tuple[IoConvention, ...] | None = None) -> list[IoCache]:
    """The caches of the first convention (of ``conventions``, default all) that names any of
    ``model``'s graph inputs, each with its present output; [] when none does."""
    outputs = {v.name: v for v in model.graph.outputs if v.name}
    for convention in conventions or tuple(IO_CONVENTIONS.values()):
        found = [c for v in model.graph.inputs if (c := _io_cache(convention, v, outputs)) is not None]
        if found:
            return found
    return []
