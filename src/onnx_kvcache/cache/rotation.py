"""Rotated caches: which tensors a rotation turns, its matrix, and how a graph shows one.

A rotated cache holds each head's key ``k H`` (after RoPE and q/k norms) and the query is
turned alike (``q H``), so attention is unchanged: ``(q H)(k H)^T = q k^T`` for an orthonormal
``H``. Rotating the value too (``v H``) turns the attention's output, which is turned back
(``o' H^T = o``). ``H`` is one graph constant shared by every layer; weights are untouched.

Rules:

* ``H`` for head size ``d``: when ``d`` is a power of two, the normalized Walsh-Hadamard
  matrix (Sylvester's construction, every entry ``+-1/sqrt(d)``, symmetric); otherwise, with
  ``d = 2^a * m`` (``m`` odd), ``kron(W_(2^a), C_m)``: the Walsh-Hadamard matrix of the
  power-of-two part times the orthonormal DCT-II of size ``m`` (orthonormal too; its entries
  are not all of one size, so it spreads a channel less evenly).
* What is turned is a row of :data:`ROTATIONS`: ``none``, ``keys`` (query and key) or
  ``keys_and_values`` (query, key and value, the output turned back).
* A graph shows a rotation when what the node reads is turned, ``Reshape(MatMul(., H))`` with
  ``H`` a constant equal to :func:`rotation_matrix` (``d``): its packed QKV (``keys_and_values``),
  or the first input of the Concat that packs it (``keys``); with separate inputs, its key (and
  value). :func:`site_rotation` reads it from the graph, never from a name or a record.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_ROTATIONS",
    "ROTATIONS",
    "Rotation",
    "get_rotation",
    "matrix_name",
    "rotate",
    "default_rotation",
    "rotation_matrix",
    "site_rotation",
]

import dataclasses
import functools

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.sites import CacheSite
from onnx_kvcache.errors import KvCacheError, require_type
from onnx_kvcache.model_io.reading import tensor_values


@dataclasses.dataclass(frozen=True)
class Rotation:
    """Which of a node's tensors a rotation turns."""

    name: str
    keys: bool
    """The query and the key (after RoPE and q/k norms)."""
    values: bool
    """The value, before the cache (the attention's output turned back)."""
    description: str

    @property
    def rotates(self) -> bool:
        return self.keys or self.values


ROTATIONS: dict[str, Rotation] = {
    row.name: row
    for row in (
        Rotation("none", False, False, "no rotation"),
        Rotation("keys", True, False, "the query and the key turned by H"),
        Rotation("keys_and_values", True, True, "the query, the key and the value turned by H"),
    )
}


#: The rotation calibration takes for a format when none is named (by measurement on the real
#: model, ``benchmarks/real_model.py``; docs/rotation.md); formats not listed: ``none``.
DEFAULT_ROTATIONS: dict[str, str] = {"int4": "keys_and_values"}


def default_rotation(format: str, sites: list[CacheSite]) -> Rotation:
    """The rotation for a ``format`` cache of ``sites`` when none is named: the format's
    :data:`DEFAULT_ROTATIONS` where every node is a GroupQueryAttention (the rotation pass
    rewrites no other), else ``none``."""
    if not sites or any(s.op.op_type != "GroupQueryAttention" for s in sites):
        return ROTATIONS["none"]
    return ROTATIONS[DEFAULT_ROTATIONS.get(format, "none")]


def get_rotation(name: str | Rotation) -> Rotation:
    """The :data:`ROTATIONS` row for ``name`` (``none``, ``keys`` or ``keys_and_values``)."""
    if isinstance(name, Rotation):
        return name
    require_type(name, str, "The rotation", f"a name ({', '.join(ROTATIONS)})")
    row = ROTATIONS.get(str(name).lower().replace("-", "_"))
    if row is None:
        raise KvCacheError(f"Unknown rotation {name!r}; choose one of {', '.join(ROTATIONS)}.")
    return row


def _walsh_hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def _dct2(m: int) -> np.ndarray:
    """The orthonormal DCT-II matrix of size ``m`` (rows: frequencies)."""
    k, n = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
    c = np.sqrt(2.0 / m) * np.cos(np.pi * (n + 0.5) * k / m)
    c[0] /= np.sqrt(2.0)
    return c


@functools.cache
def _matrix(size: int) -> np.ndarray:
    power = size & -size  # the largest power of two dividing size
    odd = size // power
    h = _walsh_hadamard(power)
    matrix = h if odd == 1 else np.kron(h, _dct2(odd))
    matrix.setflags(write=False)
    return matrix


def matrix_name(size: int) -> str:
    """How :func:`rotation_matrix` builds ``H`` for head size ``size``, in words."""
    power = size & -size
    if power == size:
        return f"normalized Walsh-Hadamard {size}x{size}"
    return f"Walsh-Hadamard {power}x{power} x DCT-II {size // power}x{size // power}"


def rotation_matrix(size: int) -> np.ndarray:
    """``H`` (float64, ``[size, size]``, orthonormal) for head size ``size``; see the rules."""
    require_type(size, int, "The head size", "a positive integer")
    if size < 1:
        raise KvCacheError(f"The head size must be >= 1, got {size}.")
    return _matrix(size)


def rotate(x: np.ndarray, *, inverse: bool = False) -> np.ndarray:
    """``x @ H`` (``x @ H^T`` with ``inverse``) over the last axis, in ``x``'s dtype."""
    h = rotation_matrix(x.shape[-1])
    return (np.asarray(x, np.float64) @ (h.T if inverse else h)).astype(x.dtype, copy=False)


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant" and not producer.domain:
        attr = producer.attributes.get("value")
        tensor = None if attr is None else attr.as_tensor()
    return None if tensor is None else tensor_values(tensor)


def _source(value: ir.Value | None) -> ir.Node | None:
    """The node that computes ``value``, through Casts and Identities (a float32 model's
    attention computed in float16 reads its inputs cast: Float16AttentionPass)."""
    node = value.producer() if value is not None else None
    while node is not None and node.op_type in ("Cast", "Identity") and not node.domain and node.inputs:
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return node


def _rotated(value: ir.Value | None, size: int) -> bool:
    """``value`` is ``Reshape(MatMul(., H))`` with ``H`` this library's matrix for ``size``."""
    reshape = _source(value)
    if reshape is None or reshape.op_type != "Reshape" or reshape.domain:
        return False
    matmul = reshape.inputs[0].producer() if reshape.inputs[0] is not None else None
    if matmul is None or matmul.op_type != "MatMul" or matmul.domain or len(matmul.inputs) != 2:
        return False
    h = _const(matmul.inputs[1])
    want = rotation_matrix(size)
    return h is not None and h.shape == want.shape and np.allclose(h.astype(np.float64), want, atol=1e-3)


def site_rotation(site: CacheSite) -> Rotation:
    """What the graph turns before ``site``'s node (the rules): a row of :data:`ROTATIONS`."""
    if site.op.op_type != "GroupQueryAttention":
        return ROTATIONS["none"]
    try:
        size = site.head_size()
    except KvCacheError:
        return ROTATIONS["none"]
    if site.packed_qkv:
        packed = site.input("query")
        if _rotated(packed, size):
            return ROTATIONS["keys_and_values"]
        concat = _source(packed)
        keys = concat is not None and concat.op_type == "Concat" and _rotated(concat.inputs[0], size)
        return ROTATIONS["keys"] if keys else ROTATIONS["none"]
    keys, values = _rotated(site.input("key"), size), _rotated(site.input("value"), size)
    if keys and values:
        return ROTATIONS["keys_and_values"]
    return ROTATIONS["keys"] if keys else ROTATIONS["none"]
