"""The test oracles' own cache codec: numpy and ml_dtypes, nothing from onnx_kvcache.

Written from onnxruntime's kernel rules, not from ``onnx_kvcache.cache.formats``, so that a bug in
the library's codec shows up as a mismatch instead of being on both sides of a comparison:

- every format multiplies by the float32 reciprocal of the scale (``x / scale`` rounds
  differently at ties);
- ``fp8``: clamp to ±448, then round to nearest even on the E4M3FN grid
  (``ml_dtypes.float8_e4m3fn``); fed and returned as its uint8 bits;
- ``int8``: ``rint`` (half to even), clamp to [-128, 127];
- ``int4``: ``rint``, clamp to [-8, 7], stored as ``q + 8`` in a nibble, two a byte,
  element ``2i`` in the low nibble; an odd head size pads with the code of zero.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_INT_RANGE = {"int8": (-128, 127), "int4": (-8, 7)}
_FP8_MAX = 448.0
_INT4_OFFSET = 8


def format_name(fmt) -> str:
    """A format's name: given as a string, or as any object with a ``name`` (a CacheFormat)."""
    name = fmt if isinstance(fmt, str) else fmt.name
    if name not in ("fp8", *_INT_RANGE):
        raise ValueError(f"unknown cache format {name!r}")
    return name


def levels(fmt, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The values a kernel stores for ``x``, as float32 (fp8: its grid values)."""
    name = format_name(fmt)
    scaled = np.asarray(x, np.float32) * (np.float32(1.0) / np.asarray(scale, np.float32))
    if name == "fp8":
        clamped = np.minimum(np.maximum(scaled, np.float32(-_FP8_MAX)), np.float32(_FP8_MAX))
        return clamped.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    low, high = _INT_RANGE[name]
    return np.minimum(np.maximum(np.rint(scaled), np.float32(low)), np.float32(high))


def quantize(fmt, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``x`` (head values on the last axis) as the stored cache tensor onnxruntime feeds."""
    name = format_name(fmt)
    q = levels(name, x, scale)
    if name == "fp8":
        return q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    if name == "int8":
        return q.astype(np.int8)
    codes = q.astype(np.int64) + _INT4_OFFSET
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.full((*codes.shape[:-1], 1), _INT4_OFFSET)], axis=-1)
    return (codes[..., 0::2] + 16 * codes[..., 1::2]).astype(np.uint8)


def dequantize(fmt, stored: np.ndarray, scale: np.ndarray, head_size: int) -> np.ndarray:
    """float32 values of a stored cache tensor (the inverse of :func:`quantize`)."""
    name = format_name(fmt)
    stored = np.asarray(stored)
    if name == "fp8":
        q = stored.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    elif name == "int8":
        q = stored.astype(np.float32)
    else:
        byte = stored.astype(np.int64)
        pairs = np.stack([byte % 16, byte // 16], axis=-1) - _INT4_OFFSET
        q = pairs.reshape(*stored.shape[:-1], -1)[..., :head_size].astype(np.float32)
    return q * np.asarray(scale, np.float32)
