"""The RoPE envelope: K as any position of the rotary table may store it.

Rules:

* K thresholds are taken on the rotation-invariant pair norm ``sqrt(k[d]^2 + k[d + h/2]^2)``
  (adjacent pairs when ``rotary_interleaved=1``; PagedAttention's channels from
  ``rotary_offset``), so a scale still holds at positions longer than the calibration window,
  where slow RoPE dimensions will have rotated energy into their partner.
* K went through RoPE when GQA rotates it (``do_rotary=1``) or a RotaryEmbedding feeds its key
  input through Reshape/Transpose/Identity and whole-row Gathers (fused exports).
* The attention methods' search sees K moved to positions drawn uniformly over the node's
  constant cos/sin tables (the first ``rope_positions``): the values RoPE will store.
* A rotated cache (``k H``) mixes the pairs, so no pair norm bounds it: every method sees K
  moved to such random positions (signed), then turned by ``H``: what the rotated cache stores
  anywhere in the context.
"""

from __future__ import annotations

__all__ = ["rope_pair_norm"]

from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.sites import CacheSite, constant_values
from onnx_kvcache.calibrate._attention_error import rope as _rope
from onnx_kvcache.model_io.reading import tensor_values


def rope_pair_norm(
    x: np.ndarray, *, interleaved: bool, rotary_dim: int | None = None, rotary_offset: int = 0
) -> np.ndarray:
    """``|x|`` with each RoPE pair replaced by its norm (last axis = head dim); RoPE covers
    channels ``[rotary_offset, rotary_offset + rotary_dim)`` (PagedAttention's offset RoPE)."""
    x = np.abs(np.asarray(x, np.float32))
    head = x.shape[-1]
    start = min(rotary_offset, head)
    rot = min(rotary_dim or head - start, head - start)
    out = x.copy()
    if interleaved:
        a, b = x[..., start : start + rot : 2], x[..., start + 1 : start + rot : 2]
        norm = np.sqrt(a * a + b * b)
        out[..., start : start + rot : 2] = norm
        out[..., start + 1 : start + rot : 2] = norm
    else:
        half = rot // 2
        a, b = x[..., start : start + half], x[..., start + half : start + 2 * half]
        norm = np.sqrt(a * a + b * b)
        out[..., start : start + half] = norm
        out[..., start + half : start + 2 * half] = norm
    return out


def _rope_tables(site: CacheSite, length: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """The node's constant cos/sin tables ``[positions, r/2]`` (the first ``length``), or None."""
    tables = []
    for name in ("cos_cache", "sin_cache"):
        value = site.input(name)
        tensor = None if value is None else value.const_value
        if tensor is None:
            values = constant_values(value)  # a Constant node
            if values is None or value is None or value.shape is None or not isinstance(value.shape[-1], int):
                return None
            array = np.asarray(values, np.float32).reshape(-1, value.shape[-1])
        else:
            array = np.asarray(tensor_values(tensor), np.float32)
        if array.ndim != 2 or array.shape[0] < (length or 1):
            return None
        tables.append(array[:length])
    return tables[0], tables[1]


def _rotated_anywhere(
    x: np.ndarray,
    tables: tuple[np.ndarray, np.ndarray],
    interleaved: bool,
    rng: np.random.Generator,
    limit: int | None = None,
    *,
    signed: bool = False,
) -> np.ndarray:
    """``|K|`` ``[kv, S, D]`` (rotated at positions 0..S-1) moved to positions drawn uniformly
    over the rotary table (its first ``limit``): what the cache stores for these keys anywhere
    in the context (``signed``: K itself, not its magnitude)."""
    cos, sin = tables
    kv, length, _ = x.shape
    pre = _rope(x.transpose(1, 0, 2), cos[:length], -sin[:length], interleaved)  # undo RoPE
    where = rng.integers(0, min(limit or cos.shape[0], cos.shape[0]), size=(length, kv))
    moved = _rope(pre, cos[where], sin[where], interleaved).transpose(1, 0, 2)
    return moved if signed else np.abs(moved)


def _rotary(site: Any) -> tuple[bool, int | None] | None:
    """(interleaved, rotary_dim) of the RoPE that K went through, or None.

    GQA's own (``do_rotary=1``), or a RotaryEmbedding feeding its key input through
    Reshape/Transpose and the fusion's token reorder, as fused exports keep it.
    """
    if site.int_attr("do_rotary"):
        return bool(site.int_attr("rotary_interleaved")), _rotary_dim(site)
    value = site.input("key")  # the schema name: every attention op has one
    while value is not None and (node := value.producer()) is not None:
        if node.op_type == "RotaryEmbedding":
            interleaved, dim = node.attributes.get("interleaved"), node.attributes.get("rotary_embedding_dim")
            return bool(interleaved and interleaved.as_int()), (dim.as_int() or None) if dim else None
        if node.op_type not in ("Reshape", "Transpose", "Identity") and not _takes_rows(node):
            return None
        value = node.inputs[0]
    return None


def _takes_rows(node: ir.Node) -> bool:
    """A Gather of whole rows (axis 0 of a 2-D or larger tensor): channels are kept."""
    axis = node.attributes.get("axis")
    data = node.inputs[0] if node.inputs else None
    return (
        node.op_type == "Gather"
        and (axis is None or axis.as_int() == 0)
        and data is not None
        and data.shape is not None
        and len(data.shape) >= 2
    )


def _rotary_dim(site: Any) -> int | None:
    cos = site.input("cos_cache")
    if cos is not None and cos.shape is not None and isinstance(cos.shape[-1], int):
        return 2 * cos.shape[-1]
    return None
