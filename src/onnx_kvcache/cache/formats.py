"""What a quantized KV-cache format is, and what a scale covers: one frozen row each.

Every rule that depends on the format (element type, bit width, the divisor used to
turn a threshold into a scale, packing of the head dimension, how values are stored and
clipped) is read from :data:`CACHE_FORMATS`, and every rule that depends on the scale
granularity (how many scales, their shape against a cache) from :data:`SCALE_GRANULARITIES`;
nothing else in the library branches on a name.
"""

from __future__ import annotations

__all__ = [
    "CACHE_FORMATS",
    "SCALE_GRANULARITIES",
    "CacheFormat",
    "ScaleGranularity",
    "format_of",
    "get_format",
    "get_granularity",
    "granularity_of",
    "scale_granularity",
]

import dataclasses
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError, require_type


@dataclasses.dataclass(frozen=True)
class ScaleGranularity:
    """What one K or V scale tensor covers.

    Attributes:
        name: Public name (``per_tensor``, ``per_channel``).
        quant_type: Value of the ``k_quant_type`` / ``v_quant_type`` attributes.
        per_head: One scale per KV head (else shared across heads).
        per_dim: One scale per head dimension (else shared across it).
    """

    name: str
    quant_type: str
    per_head: bool
    per_dim: bool

    def grid(self, kv_num_heads: int, head_size: int) -> tuple[int, int]:
        """``(heads, dims)`` of the scales, broadcast over ``(kv_num_heads, head_size)``."""
        return (kv_num_heads if self.per_head else 1, head_size if self.per_dim else 1)

    def size(self, kv_num_heads: int, head_size: int) -> int:
        heads, dims = self.grid(kv_num_heads, head_size)
        return heads * dims

    @property
    def single(self) -> bool:
        """One scale per tensor, whatever the cache's shape."""
        return not (self.per_head or self.per_dim)

    def bnsh(self, kv_num_heads: int, head_size: int) -> tuple[int, int, int, int]:
        """The scales' shape against a BNSH cache ``[B, kv_num_heads, S, head_size]``."""
        heads, dims = self.grid(kv_num_heads, head_size)
        return (1, heads, 1, dims)


SCALE_GRANULARITIES: dict[str, ScaleGranularity] = {
    row.name: row
    for row in (
        ScaleGranularity("per_tensor", "PER_TENSOR", per_head=False, per_dim=False),
        ScaleGranularity("per_channel", "PER_CHANNEL", per_head=True, per_dim=True),
    )
}


@dataclasses.dataclass(frozen=True)
class CacheFormat:
    """One quantized KV-cache storage format (GroupQueryAttention and PagedAttention share them).

    Attributes:
        name: Public name (``fp8``, ``int8``, ``int4``).
        dtype: ONNX element type of past/present cache tensors.
        bit_width: Value of the ``kv_cache_bit_width`` attribute.
        qmax: Divisor that maps a threshold to a scale (``scale = threshold / qmax``).
        values_per_byte: Cache values stored in one element (2 for packed int4).
        qmin_stored: Smallest representable quantized value.
        qmax_stored: Largest representable quantized value.
        is_float: Values are a float type (saturate and round to the float grid).
        logical_name: The logical type as operators name it (PagedAttention's
            ``k_cache_dtype="int4"``); None when the element type says it all. A format
            stored in another's element type needs one: PagedAttention has no bit width.
    """

    name: str
    dtype: ir.DataType
    bit_width: int
    qmax: float
    values_per_byte: int
    qmin_stored: float
    qmax_stored: float
    is_float: bool
    logical_name: str | None = None

    def packed_dim(self, head_size: int) -> int:
        """Last cache dimension for a head of ``head_size`` values."""
        return (head_size + self.values_per_byte - 1) // self.values_per_byte

    def bytes_per_value(self) -> float:
        return self.dtype.itemsize / self.values_per_byte

    @property
    def packed(self) -> bool:
        """Several values share one stored element (the head dimension shrinks)."""
        return self.values_per_byte > 1

    @property
    def clip_level(self) -> float:
        """``|x| / scale`` beyond which storing costs more than rounding: the largest level,
        plus half a step for integers (a float format's top level is exact)."""
        return self.qmax_stored if self.is_float else self.qmax_stored + 0.5

    @property
    def storage_offset(self) -> int:
        """Added to a packed value to store it unsigned (int4: ``q + 8`` in a nibble)."""
        return -int(self.qmin_stored) if self.values_per_byte > 1 else 0

    @staticmethod
    def reciprocal(scale: np.ndarray | float) -> np.ndarray:
        """``1 / scale`` in float32, what the kernels multiply by to quantize."""
        return np.float32(1.0) / np.asarray(scale, np.float32)

    def levels(self, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """The levels the kernels store ``x`` as, as float32 (fp8: values on its grid).

        Like the kernels, values are multiplied by the float32 reciprocal of the scale
        (``x / scale`` rounds differently at ties), then saturated to the fp8 grid (round
        half to even), or rounded half to even and clamped for integers.
        """
        q = np.asarray(x, np.float32) * self.reciprocal(scale)
        if self.is_float:
            return np.clip(q, self.qmin_stored, self.qmax_stored).astype(self._float_type).astype(np.float32)
        return np.clip(np.rint(q), self.qmin_stored, self.qmax_stored)

    def round_trip(self, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """``x`` as a cache holding it reads it back (float32): stored, then dequantized."""
        return self.levels(x, scale) * np.asarray(scale, np.float32)

    @property
    def _float_type(self) -> np.dtype:
        return np.dtype(self.dtype.numpy())

    def quantize(self, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """Quantize ``x`` (last axis = head values) as the kernels store it (:meth:`levels`).

        Returns the cache tensor as onnxruntime feeds and returns it: fp8 as its uint8
        bits, int8, or uint8 with two int4 values per byte (low nibble first, offset 8).
        """
        q = self.levels(x, scale)
        if self.is_float:
            return q.astype(self._float_type).view(np.uint8)
        if self.values_per_byte == 1:
            return q.astype(self.dtype.numpy())
        nibbles = (q + self.storage_offset).astype(np.uint8)
        if nibbles.shape[-1] % 2:
            nibbles = np.concatenate([nibbles, np.full_like(nibbles[..., :1], self.storage_offset)], axis=-1)
        return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)

    def dequantize(self, q: np.ndarray, scale: np.ndarray, head_size: int) -> np.ndarray:
        """Inverse of :meth:`quantize`: float32 values of a stored cache tensor."""
        if self.values_per_byte == 2:
            q = np.asarray(q, np.uint8)
            lo = (q & 0x0F).astype(np.int16) - self.storage_offset
            hi = (q >> 4).astype(np.int16) - self.storage_offset
            values = np.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], -1)[..., :head_size]
        elif self.is_float:
            values = np.asarray(q).view(self._float_type)
        else:
            values = np.asarray(q)
        return values.astype(np.float32) * np.asarray(scale, np.float32)

    def numpy_dtype(self) -> np.dtype:
        """Numpy dtype of cache arrays as onnxruntime feeds and returns them."""
        return np.dtype(np.uint8) if self.is_float else self.dtype.numpy()


CACHE_FORMATS: dict[str, CacheFormat] = {
    row.name: row
    for row in (
        CacheFormat("fp8", ir.DataType.FLOAT8E4M3FN, 8, 448.0, 1, -448.0, 448.0, True),
        CacheFormat("int8", ir.DataType.INT8, 8, 128.0, 1, -128.0, 127.0, False),
        CacheFormat("int4", ir.DataType.UINT8, 4, 8.0, 2, -8.0, 7.0, False, "int4"),
    )
}


def get_format(name: str | CacheFormat) -> CacheFormat:
    """The :class:`CacheFormat` row for ``name`` (``fp8``, ``int8`` or ``int4``)."""
    if isinstance(name, CacheFormat):
        return name
    require_type(name, str, "The KV-cache format", f"a name ({', '.join(CACHE_FORMATS)})")
    key = str(name).lower().replace("-", "").replace("_", "")
    aliases = {"float8": "fp8", "float8e4m3fn": "fp8", "e4m3": "fp8", "uint4": "int4"}
    row = CACHE_FORMATS.get(aliases.get(key, key))
    if row is None:
        raise KvCacheError(f"Unknown KV-cache format {name!r}; choose one of {', '.join(CACHE_FORMATS)}.")
    return row


def format_of(
    dtype: ir.DataType | None, bit_width: int | None = None, logical_name: str | None = None
) -> CacheFormat | None:
    """The format whose cache has element type ``dtype``, or None for a float cache.

    ``bit_width`` (GroupQueryAttention's ``kv_cache_bit_width``) and ``logical_name``
    (PagedAttention's ``k_cache_dtype``) narrow the choice where the operator has them;
    among rows still sharing the element type the table's first wins (an INT8 cache with
    no such attribute is int8).
    """
    rows = [row for row in CACHE_FORMATS.values() if row.dtype == dtype]
    if bit_width:
        rows = [row for row in rows if row.bit_width == bit_width]
    if logical_name:
        rows = [row for row in rows if logical_name in (row.logical_name, row.dtype.name.lower(), row.name)]
    return rows[0] if rows else None


def get_granularity(name: str) -> str:
    """Validate a granularity name (a key of :data:`SCALE_GRANULARITIES`)."""
    require_type(name, str, "The scale granularity", f"a name ({', '.join(SCALE_GRANULARITIES)})")
    key = str(name).lower().replace("-", "_")
    if key not in SCALE_GRANULARITIES:
        choices = ", ".join(SCALE_GRANULARITIES)
        raise KvCacheError(f"Unknown scale granularity {name!r}; choose one of {choices}.")
    return key


def granularity_of(caches: Iterable[tuple[int, int, int | None]]) -> str | None:
    """The first granularity whose scales have ``size`` elements for every cache
    ``(size, kv_num_heads, head_size)`` (``head_size`` None: unknown), or None when none fits.

    Table order breaks ties: one scale for a single KV head is ``per_tensor``.
    """
    caches = list(caches)
    for row in SCALE_GRANULARITIES.values():
        if all(
            size == row.size(kv, head or 0) and (head is not None or not row.per_dim)
            for size, kv, head in caches
        ):
            return row.name
    return None


def scale_granularity(name: str) -> ScaleGranularity:
    """The :class:`ScaleGranularity` row for a granularity name."""
    return SCALE_GRANULARITIES[get_granularity(name)]
