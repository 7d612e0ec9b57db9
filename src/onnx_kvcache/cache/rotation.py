"""Rotated caches: which tensors a rotation turns, its matrix, and how a graph shows one.

A rotated cache holds each head's key ``k H`` (after RoPE and q/k norms) and the query is
turned alike (``q H``), so attention is unchanged: ``(q H)(k H)^T = q k^T`` for an orthonormal
``H``. Rotating the value too (``v H``) turns the attention's output, which is turned back
(``o' H^T = o``). ``H`` is one graph constant shared by every layer; weights are untouched.

Rules:

* ``H`` for head size ``d`` is a row of :data:`MATRICES`, ``hadamard`` unless a model or
  scale file says otherwise (:data:`DEFAULT_MATRIX`): a Hadamard matrix divided by ``sqrt(d)``
  (every entry ``+-1/sqrt(d)``, so each channel is spread evenly over all of them) where one is
  built, ``d = 2^j * c`` as ``kron(S_(2^j), P_c)`` (Sylvester's Walsh-Hadamard times ``1`` or a
  Paley matrix: every power of two, and 12, 20, 24, 28, 36, 40, 48, 52, 56, 60, 72, 80, 96,
  100, 112, 120, 160, 192, ...; :mod:`onnx_kvcache.cache._hadamard`). Else (``d`` not a multiple
  of 4, or 92, 116, 156, ...) ``kron(H_n, C_m)``, ``d = n * m``: the built Hadamard matrix of the
  largest order ``n`` dividing ``d`` times the orthonormal DCT-II of size ``m``; with ``n`` the
  power-of-two part of ``d`` (every such ``d`` up to 256 but 156) it is ``walsh_dct``'s
  matrix. The measured choice (``benchmarks/rotation_matrices.py``): over the 71 even head sizes
  from 6 to 256 without a Hadamard matrix it rounds keys with outlier channels to int4 with the
  least error, against a Hartley factor or a seeded random orthogonal matrix.
* ``walsh_dct`` is the ``H`` of models and scale files made before ``hadamard``:
  ``kron(W_(2^a), C_m)`` at every head size. At a power of two both are the same matrix
  (:meth:`RotationMatrix.same`), elsewhere they differ where a Hadamard matrix is built.
* What is turned is a row of :data:`ROTATIONS`: ``none``, ``keys`` (query and key) or
  ``keys_and_values`` (query, key and value, the output turned back).
* A graph shows a rotation when what the node reads is turned, ``Reshape(MatMul(., H))`` with
  ``H`` a constant equal to :func:`rotation_matrix` (``d``) of a row of :data:`MATRICES`: its
  packed QKV (``keys_and_values``), or the first input of the Concat that packs it (``keys``);
  with separate inputs, its key (and value). :func:`site_rotation` and :func:`site_matrix` read
  it from the graph, never from a name or a record.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_MATRIX",
    "DEFAULT_ROTATIONS",
    "MATRICES",
    "ROTATIONS",
    "Rotation",
    "RotationMatrix",
    "get_matrix",
    "get_rotation",
    "matrix_name",
    "rotatable",
    "rotate",
    "default_rotation",
    "rotation_matrix",
    "site_matrix",
    "site_rotation",
    "stored_rotation",
    "turned_caches",
]

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache._hadamard import hadamard, sylvester
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.cache.storage import QdqCache, attention_read, find_qdq_caches
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


def turned_caches(model: ir.Model, rotation: Rotation) -> list[QdqCache]:
    """The caches storage keeps (:func:`~onnx_kvcache.cache.storage.find_qdq_caches`) that
    ``rotation`` turns: the keys where it turns keys, the values where it turns values."""
    return [c for c in find_qdq_caches(model.graph) if (rotation.keys if c.side == "k" else rotation.values)]


def rotatable(model: ir.Model, rotation: Rotation) -> bool:
    """Whether ``rotation`` can be placed on every cache of ``model`` it turns: its attention
    nodes are all GroupQueryAttention (:class:`~onnx_kvcache.passes.KvCacheRotationPass`), or,
    with none, one ONNX ``Attention`` reads each such cache storage keeps
    (:func:`~onnx_kvcache.cache.storage.attention_read`,
    :class:`~onnx_kvcache.passes.StoredCacheRotationPass`)."""
    sites = find_attention_sites(model)
    if sites:
        return all(s.op.op_type == "GroupQueryAttention" for s in sites)
    caches = turned_caches(model, rotation)
    return bool(caches) and all(attention_read(c) is not None for c in caches)


def default_rotation(format: str, model: ir.Model) -> Rotation:
    """The rotation for a ``format`` cache of ``model`` when none is named: the format's
    :data:`DEFAULT_ROTATIONS` where it can be placed (:func:`rotatable`), else ``none``."""
    rotation = ROTATIONS[DEFAULT_ROTATIONS.get(format, "none")]
    return rotation if rotation.rotates and rotatable(model, rotation) else ROTATIONS["none"]


_Row = TypeVar("_Row")


def _row(table: Mapping[str, _Row], name: object, what: str) -> _Row:
    """``table``'s row named ``name`` (case and ``-``/``_`` aside), or one error naming the rows."""
    require_type(name, str, f"The {what}", f"a name ({', '.join(table)})")
    row = table.get(str(name).lower().replace("-", "_"))
    if row is None:
        raise KvCacheError(f"Unknown {what} {name!r}; choose one of {', '.join(table)}.")
    return row


def get_rotation(name: str | Rotation) -> Rotation:
    """The :data:`ROTATIONS` row for ``name`` (``none``, ``keys`` or ``keys_and_values``)."""
    return name if isinstance(name, Rotation) else _row(ROTATIONS, name, "rotation")


def _dct2(m: int) -> np.ndarray:
    """The orthonormal DCT-II matrix of size ``m`` (rows: frequencies)."""
    k, n = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
    c = np.sqrt(2.0 / m) * np.cos(np.pi * (n + 0.5) * k / m)
    c[0] /= np.sqrt(2.0)
    return c


def _walsh_dct(size: int) -> tuple[np.ndarray, str]:
    """``kron(W_(2^a), C_m)`` (the rules) and its name."""
    power = size & -size  # the largest power of two dividing size
    odd = size // power
    h = sylvester(power) / np.sqrt(power)
    if odd == 1:
        return h, f"normalized Walsh-Hadamard {size}x{size}"
    return np.kron(h, _dct2(odd)), f"Walsh-Hadamard {power}x{power} x DCT-II {odd}x{odd}"


def _hadamard(size: int) -> tuple[np.ndarray, str]:
    """A built Hadamard matrix over ``sqrt(size)``, else ``kron(H_n, C_m)`` (the rules)."""
    power = size & -size
    built = hadamard(size)
    if built is not None and power != size:  # a power of two: the same matrix, the old name
        return built[0] / np.sqrt(size), f"Hadamard {size}x{size}: {built[1]}"
    n = max(n for n in range(power, size + 1, power) if size % n == 0 and hadamard(n) is not None)
    if n == power:
        return _walsh_dct(size)
    core, words = hadamard(n)  # type: ignore[misc]
    m = size // n
    return np.kron(core / np.sqrt(n), _dct2(m)), f"{words} x DCT-II {m}x{m}"


@dataclasses.dataclass(frozen=True)
class RotationMatrix:
    """How ``H`` is built for a head size (the rules)."""

    name: str
    build: Callable[[int], tuple[np.ndarray, str]]
    """``H`` (float64, orthonormal) for a head size, and how it is built, in words."""
    description: str

    def same(self, other: RotationMatrix, size: int) -> bool:
        """Whether ``other`` builds the same ``H`` for head size ``size``."""
        return self is other or np.array_equal(rotation_matrix(size, self), rotation_matrix(size, other))


MATRICES: dict[str, RotationMatrix] = {
    row.name: row
    for row in (
        RotationMatrix(
            "hadamard",
            _hadamard,
            "a Hadamard matrix (Walsh-Hadamard x Paley) where one is built, else Walsh-Hadamard x DCT-II",
        ),
        RotationMatrix(
            "walsh_dct",
            _walsh_dct,
            "Walsh-Hadamard of the power-of-two part x DCT-II of the odd part (models and scales made "
            "before hadamard)",
        ),
    )
}

#: The :data:`MATRICES` row a rotation takes unless a rotated model or its scales name another.
DEFAULT_MATRIX = "hadamard"


def get_matrix(name: str | RotationMatrix) -> RotationMatrix:
    """The :data:`MATRICES` row for ``name`` (``hadamard`` or ``walsh_dct``)."""
    return name if isinstance(name, RotationMatrix) else _row(MATRICES, name, "rotation matrix")


@functools.cache
def _matrix(size: int, name: str) -> tuple[np.ndarray, str]:
    matrix, words = MATRICES[name].build(size)
    matrix.setflags(write=False)
    return matrix, words


def _size(size: int) -> int:
    require_type(size, int, "The head size", "a positive integer")
    if size < 1:
        raise KvCacheError(f"The head size must be >= 1, got {size}.")
    return size


def matrix_name(size: int, matrix: str | RotationMatrix = DEFAULT_MATRIX) -> str:
    """How :func:`rotation_matrix` builds ``H`` for head size ``size``, in words."""
    return _matrix(_size(size), get_matrix(matrix).name)[1]


def rotation_matrix(size: int, matrix: str | RotationMatrix = DEFAULT_MATRIX) -> np.ndarray:
    """``H`` (float64, ``[size, size]``, orthonormal, read-only) for head size ``size``, as the
    :data:`MATRICES` row ``matrix`` builds it; see the rules."""
    return _matrix(_size(size), get_matrix(matrix).name)[0]


def rotate(
    x: np.ndarray, *, inverse: bool = False, matrix: str | RotationMatrix = DEFAULT_MATRIX
) -> np.ndarray:
    """``x @ H`` (``x @ H^T`` with ``inverse``) over the last axis, in ``x``'s dtype."""
    h = rotation_matrix(x.shape[-1], matrix)
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


def _last_dim(value: ir.Value | None) -> object:
    """The last dimension of a value of rank 2 or more (rows of it), else None."""
    shape = value.shape if value is not None else None
    return shape[-1] if shape is not None and len(shape) >= 2 else None


def _moves_rows(node: ir.Node) -> bool:
    """``node`` only moves whole rows of its first input, each row's last axis kept: a Gather on
    axis 0, or a Reshape of a Reshape keeping a static last dimension (an attention fusion's
    padding order flattens the tokens and gathers them)."""
    if node.domain or not node.inputs or node.inputs[0] is None:
        return False
    if node.op_type == "Gather":
        return node.attributes.get_int("axis", 0) == 0 and _last_dim(node.inputs[0]) is not None
    below = node.inputs[0].producer()
    last = _last_dim(node.outputs[0])
    same = isinstance(last, int) and last == _last_dim(node.inputs[0])
    return node.op_type == "Reshape" and same and below is not None and below.op_type == "Reshape"


def _source(value: ir.Value | None) -> ir.Node | None:
    """The node that computes ``value``, through Casts and Identities (a float32 model's
    attention computed in float16 reads its inputs cast: Float16AttentionPass) and the nodes
    that only move its rows (:func:`_moves_rows`)."""
    node = value.producer() if value is not None else None
    while node is not None and (
        (node.op_type in ("Cast", "Identity") and not node.domain and node.inputs) or _moves_rows(node)
    ):
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return node


def _rotated(value: ir.Value | None, size: int, through: tuple[str, ...] = ()) -> RotationMatrix | None:
    """The :data:`MATRICES` row (the first that matches) when ``value`` is ``Reshape(MatMul(.,
    H))`` (or ``MatMul(., H)`` for ``through``'s callers) with ``H`` its matrix for ``size``,
    read through the ops ``through`` names (a stored cache's QuantizeLinear); else None."""
    reshape = _source(value)
    while reshape is not None and reshape.op_type in through and not reshape.domain:
        reshape = _source(reshape.inputs[0])
    bare = bool(through) and reshape is not None and reshape.op_type == "MatMul"
    if reshape is None or (reshape.op_type != "Reshape" and not bare) or reshape.domain:
        return None
    matmul = reshape if bare else reshape.inputs[0].producer() if reshape.inputs[0] is not None else None
    if matmul is None or matmul.op_type != "MatMul" or matmul.domain or len(matmul.inputs) != 2:
        return None
    weight = matmul.inputs[1]
    declared: tuple | None = None if weight is None or weight.shape is None else tuple(weight.shape)
    if declared is None and weight is not None and weight.const_value is not None:
        declared = tuple(weight.const_value.shape)
    if declared is not None and declared != (size, size):  # a projection: its weights are not read
        return None
    h = _const(weight)
    if h is None or h.shape != (size, size):
        return None
    h = h.astype(np.float64)
    matches = (row for row in MATRICES.values() if np.allclose(h, rotation_matrix(size, row), atol=1e-3))
    return next(matches, None)


def _turned(site: CacheSite) -> tuple[Rotation, RotationMatrix | None]:
    """What the graph turns before ``site``'s node, and by which matrix (the rules)."""
    none = ROTATIONS["none"], None
    if site.op.op_type != "GroupQueryAttention":
        return none
    try:
        size = site.head_size()
    except KvCacheError:
        return none
    if site.packed_qkv:
        packed = site.input("query")
        matrix = _rotated(packed, size)
        if matrix is not None:
            return ROTATIONS["keys_and_values"], matrix
        concat = _source(packed)
        keys = _rotated(concat.inputs[0], size) if concat is not None and concat.op_type == "Concat" else None
        return (ROTATIONS["keys"], keys) if keys is not None else none
    keys, values = _rotated(site.input("key"), size), _rotated(site.input("value"), size)
    if keys is None:
        return none
    return ROTATIONS["keys_and_values" if values is not None else "keys"], keys


def site_rotation(site: CacheSite) -> Rotation:
    """What the graph turns before ``site``'s node (the rules): a row of :data:`ROTATIONS`."""
    return _turned(site)[0]


def site_matrix(site: CacheSite) -> RotationMatrix | None:
    """The :data:`MATRICES` row whose ``H`` turns ``site``'s node's inputs (the first of those
    that build it, at a power of two ``hadamard``); None when none is turned."""
    return _turned(site)[1]


def stored_rotation(model: ir.Model) -> tuple[Rotation, RotationMatrix | None]:
    """What the graph turns before its stored caches' ONNX Attention (:func:`~onnx_kvcache.cache.
    storage.attention_read`): a cache's new rows ``Reshape(MatMul(Reshape(.), H))`` or, with heads
    on their own axis, ``MatMul(., H)`` (read through the QuantizeLinear that stores them); keys
    when a key cache's are, values when a value cache's are too. None turned: ``none``."""
    turned: dict[str, RotationMatrix] = {}
    for read in filter(None, map(attention_read, find_qdq_caches(model.graph))):
        node, slot = read.new
        matrix = _rotated(node.inputs[slot], read.head_size, ("QuantizeLinear", "Div"))
        if matrix is not None:
            turned.setdefault(read.cache.side, matrix)
    if "k" not in turned:
        return ROTATIONS["none"], None
    return ROTATIONS["keys_and_values" if "v" in turned else "keys"], turned["k"]
