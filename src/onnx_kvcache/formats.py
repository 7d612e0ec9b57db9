"""What a quantized KV-cache format is: one frozen row per format.

Every rule that depends on the format (element type, bit width, the divisor used to
turn a threshold into a scale, packing of the head dimension, how values are stored)
is read from :data:`CACHE_FORMATS`; nothing else in the library branches on a name.
"""

from __future__ import annotations

__all__ = [
    "CACHE_FORMATS",
    "GRANULARITIES",
    "CacheFormat",
    "Granularity",
    "format_of",
    "get_format",
    "get_granularity",
]

import dataclasses
from typing import Literal

import ml_dtypes
import numpy as np
import onnx_ir as ir

Granularity = Literal["per_tensor", "per_channel"]

#: Granularity name -> value of the ``k_quant_type`` / ``v_quant_type`` attributes.
GRANULARITIES: dict[str, str] = {"per_tensor": "PER_TENSOR", "per_channel": "PER_CHANNEL"}


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
        logical_name: The packed logical type as operators name it (PagedAttention's
            ``k_cache_dtype="int4"``); None when the element type says it all.
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
    def storage_offset(self) -> int:
        """Added to a packed value to store it unsigned (int4: ``q + 8`` in a nibble)."""
        return -int(self.qmin_stored) if self.values_per_byte > 1 else 0

    @staticmethod
    def reciprocal(scale: np.ndarray | float) -> np.ndarray:
        """``1 / scale`` in float32, what the kernels multiply by to quantize."""
        return np.float32(1.0) / np.asarray(scale, np.float32)

    def quantize(self, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """Quantize ``x`` (last axis = head values) as the kernels store it.

        Returns the cache tensor as onnxruntime feeds and returns it: fp8 as its uint8
        bits, int8, or uint8 with two int4 values per byte (low nibble first, offset 8).
        Like the kernels, values are multiplied by the float32 reciprocal of the scale
        (``x / scale`` rounds differently at ties).
        """
        q = np.asarray(x, np.float32) * self.reciprocal(scale)
        if self.is_float:
            fp8 = np.clip(q, self.qmin_stored, self.qmax_stored).astype(ml_dtypes.float8_e4m3fn)
            return fp8.view(np.uint8)
        q = np.clip(np.rint(q), self.qmin_stored, self.qmax_stored)
        if self.values_per_byte == 1:
            return q.astype(np.int8)
        nibbles = (q + self.storage_offset).astype(np.uint8)
        if nibbles.shape[-1] % 2:
            nibbles = np.concatenate([nibbles, np.full_like(nibbles[..., :1], 8)], axis=-1)
        return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)

    def dequantize(self, q: np.ndarray, scale: np.ndarray, head_size: int) -> np.ndarray:
        """Inverse of :meth:`quantize`: float32 values of a stored cache tensor."""
        if self.values_per_byte == 2:
            q = np.asarray(q, np.uint8)
            lo = (q & 0x0F).astype(np.int16) - self.storage_offset
            hi = (q >> 4).astype(np.int16) - self.storage_offset
            values = np.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], -1)[..., :head_size]
        elif self.is_float:
            values = np.asarray(q).view(ml_dtypes.float8_e4m3fn)
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
    key = str(name).lower().replace("-", "").replace("_", "")
    aliases = {"float8": "fp8", "float8e4m3fn": "fp8", "e4m3": "fp8", "uint4": "int4"}
    row = CACHE_FORMATS.get(aliases.get(key, key))
    if row is None:
        raise ValueError(f"Unknown KV-cache format {name!r}; choose one of {', '.join(CACHE_FORMATS)}.")
    return row


def format_of(dtype: ir.DataType | None, bit_width: int | None = None) -> CacheFormat | None:
    """The format whose cache has element type ``dtype`` (and ``kv_cache_bit_width``).

    ``None`` for a float cache. UINT8 with no bit width is packed int4, the only
    format stored as UINT8.
    """
    rows = [row for row in CACHE_FORMATS.values() if row.dtype == dtype]
    if bit_width:
        rows = [row for row in rows if row.bit_width == bit_width] or rows
    return rows[0] if rows else None


def get_granularity(name: str) -> Granularity:
    """Validate a granularity name (``per_tensor`` or ``per_channel``)."""
    key = str(name).lower().replace("-", "_")
    if key not in GRANULARITIES:
        raise ValueError(f"Unknown scale granularity {name!r}; choose one of {', '.join(GRANULARITIES)}.")
    return key  # type: ignore[return-value]
