"""Rotate the caches an ONNX ``Attention`` reads, before they are stored: ``StoredCacheRotationPass``.

The rotation of :mod:`~onnx_kvcache.passes.kv_cache_rotation` (why: docs/rotation.md) for the
caches ``storage="qdq"`` keeps (:func:`~onnx_kvcache.cache.storage.find_qdq_caches`): static
buffers written by ``TensorScatter`` and caches an ONNX ``Attention`` holds. RoPE is applied
before such an Attention (it has none of its own), so what it reads is what a rotated cache
turns: ``(q H)(k H)^T = q k^T``.

Rules:

1. A float cache is rotated where one ONNX ``Attention`` reads it as it is stored
   (:func:`~onnx_kvcache.cache.storage.attention_read`): its new rows (the writer's new-row
   input: TensorScatter's updates, Attention's key or value) are turned per head by ``H``, and
   that Attention's query by its key's ``H``. With ``keys_and_values`` the value cache's new rows
   are turned too and the Attention's output turned back by ``H^T``. Each Attention is rewritten
   once; the caches then hold ``k H`` (and ``v H``), which
   :class:`~onnx_kvcache.passes.QdqKvCachePass` stores.
2. 3-D inputs (``[batch, seq, heads * head]``) are turned ``Reshape(MatMul(Reshape(x, [0, 0,
   heads, d]), H), [0, 0, heads * d])``; 4-D ones (``[batch, heads, seq, head]``) ``MatMul(x, H)``.
   ``H`` is the pass's row of :data:`~onnx_kvcache.cache.rotation.MATRICES`, one initializer per
   head size and dtype, shared (the names of ``KvCacheRotationPass``).
3. Refused before anything changes, naming the cache: a cache no ONNX Attention reads alone
   (multi-head latent attention's latents, which an up-projection reads; attention of plain
   operators; a buffer anything else reads), a cache stored quantized already (its scales were
   measured unrotated), a model rotated otherwise or by another ``H``. A model rotated as asked,
   or with no such cache, is left as it is (``modified`` False).
"""

from __future__ import annotations

__all__ = ["StoredCacheRotationPass"]

import logging

import onnx_ir as ir

from onnx_kvcache.cache.rotation import RotationMatrix, stored_rotation, turned_caches
from onnx_kvcache.cache.storage import AttentionRead, QdqCache, attention_read
from onnx_kvcache.errors import KvCachePreconditionError, Param
from onnx_kvcache.passes._base import RotationPass
from onnx_kvcache.passes._graph import Builder
from onnx_kvcache.passes.kv_cache_rotation import _Constants

logger = logging.getLogger(__name__)


class StoredCacheRotationPass(RotationPass):
    """Turn every cache an ONNX ``Attention`` reads by ``H``; see the module.

    Args:
        rotation: A row of :data:`~onnx_kvcache.cache.rotation.ROTATIONS`: ``keys_and_values``
            (default) or ``keys``; ``none`` leaves the model as it is.
        matrix: A row of :data:`~onnx_kvcache.cache.rotation.MATRICES` (``hadamard`` unless named).
    """

    def _check(self, model: ir.Model) -> list[AttentionRead]:
        """The caches to turn, every one checked; nothing changes."""
        caches = turned_caches(model, self.rotation)
        if not caches:
            return []
        have, matrix = stored_rotation(model)
        if have.rotates:
            assert matrix is not None
            if have == self.rotation and self._same(matrix, caches):
                return []
            raise KvCachePreconditionError(
                f"The model's caches are already rotated ({have.name}, H = {matrix.name}); "
                f"{self.rotation.name} by {self.matrix.name} was asked. Rotate the original model."
            )
        return [self._read(cache) for cache in caches]

    def _same(self, matrix: RotationMatrix, caches: list[QdqCache]) -> bool:
        reads = filter(None, map(attention_read, caches))
        return all(matrix.same(self.matrix, r.head_size) for r in reads)

    @staticmethod
    def _read(cache: QdqCache) -> AttentionRead:
        if cache.stored:
            raise KvCachePreconditionError(
                f"Cannot rotate cache {cache.past.name!r}: it is stored quantized already, with scales "
                "measured on unrotated values. Rotate the float model, then store it with scales "
                "calibrated for the rotation."
            )
        read = attention_read(cache)
        if read is None:
            readers = sorted({n.op_type for n, _ in cache.writer.outputs[cache.row.present].uses()})
            raise KvCachePreconditionError(
                f"Cannot rotate cache {cache.past.name!r}: no ONNX Attention reads it alone (its present "
                f"goes to {', '.join(readers) or 'the graph output only'}: a latent or an attention of "
                "plain operators), so no query can be turned with it. Store it with ",
                Param("rotation", "none"),
                ".",
            )
        return read

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        reads = self._check(model)
        turn = _Turn(model.graph, self.matrix)
        for read in reads:
            turn.cache(read)
        if reads:
            model.graph.extend(turn.b.nodes)
            model.graph.sort()
        logger.info("Rotation (%s): turned %d stored cache(s).", self.rotation.name, len(reads))
        return ir.passes.PassResult(model, modified=bool(reads))


class _Turn:
    """Rules 1 and 2 for one graph: the nodes made on :attr:`b`'s tape (the pass adds them to the
    graph), each Attention rewritten once."""

    def __init__(self, graph: ir.Graph, matrix: RotationMatrix) -> None:
        self.graph, self.constants = graph, _Constants(graph, matrix)
        self.b = Builder("stored_cache_rotation")
        self.done: set[tuple[int, int]] = set()

    def cache(self, read: AttentionRead) -> None:
        node, slot = read.new
        dtype = read.node.inputs[0].dtype if read.node.inputs[0] is not None else None
        dtype = dtype or read.cache.past.dtype or ir.DataType.FLOAT
        rows = node.inputs[slot]
        assert rows is not None
        node.replace_input_with(slot, self._turned(rows, read.heads, read.head_size, read.split, dtype))
        attention = read.node
        if read.cache.side == "k" and (id(attention), 0) not in self.done:  # its query, once
            self.done.add((id(attention), 0))
            query = attention.inputs[0]
            assert query is not None
            turned = self._turned(query, read.query_heads, read.key_head_size, read.split, dtype)
            attention.replace_input_with(0, turned)
        if read.cache.side == "v" and (id(attention), 1) not in self.done:  # its output, once
            self.done.add((id(attention), 1))
            self._turn_back(attention.outputs[0], read, dtype)

    def _turn_back(self, out: ir.Value, read: AttentionRead, dtype: ir.DataType) -> None:
        """The Attention's output turned back by ``H^T`` for everything that reads it."""
        uses = list(out.uses())
        back = self._turned(out, read.query_heads, read.head_size, read.split, dtype, transposed=True)
        for node, slot in uses:
            node.replace_input_with(slot, back)
        outputs = self.graph.outputs
        for i in [i for i, v in enumerate(outputs) if v is out]:
            outputs[i] = back
            back.name, out.name = out.name, f"{out.name}/turned"

    def _turned(
        self, x: ir.Value, heads: int, size: int, split: bool, dtype: ir.DataType, transposed: bool = False
    ) -> ir.Value:
        """``x`` turned per head by ``H`` (``H^T``) of head size ``size`` (rule 2)."""
        h = self.constants.matrix(size, dtype, transposed=transposed)
        if split:
            out = self.constants.turned(self.b, x, h, heads, size, dtype)
        else:
            out = self.b.op("MatMul", [x, h], dtype=dtype)
        out.shape = x.shape
        return out
