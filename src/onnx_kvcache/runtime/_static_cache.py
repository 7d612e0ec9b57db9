"""A decoder's fixed cache buffers (mobius's static cache): ``[batch, rows, kv_num_heads * head_size]``
each, written in place by the model.

Each call feeds the buffers, ``write_indices`` (where the new tokens' rows go: each sequence's
past length) and ``nonpad_kv_seqlen`` (the rows attention reads: the length after the call);
the updated buffers come back as the next call's. Rows past the context are the buffers' zeros,
never read: :meth:`StaticCache.values` gives the written rows only (what calibration samples).
onnxruntime's CPU ``TensorScatter`` copies the whole buffer to its output every call.
"""

from __future__ import annotations

__all__ = ["StaticCache", "StaticLayout"]

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.io_caches import STATIC
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.model_io import host_array
from onnx_kvcache.runtime._cache import CacheBinding, Feeding, Rows
from onnx_kvcache.runtime._dense_cache import RectangularCache


@dataclasses.dataclass(frozen=True)
class StaticLayout:
    """Fixed buffers of ``rows`` tokens, and the inputs that say where calls write."""

    rows: int
    inputs: Mapping[str, str] = dataclasses.field(default_factory=lambda: {n: n for n in STATIC.inputs})

    @classmethod
    def read(
        cls, bindings: Sequence[CacheBinding], model: ir.Model, requested: int | None, config: dict | None
    ) -> StaticLayout:
        """The buffers' rows (one for every cache); ``requested`` and ``config`` do not apply."""
        rows = {b.rows for b in bindings}
        if len(rows) != 1 or None in rows:
            raise KvCacheError(
                f"The model's static cache buffers have different or unknown row counts "
                f"{sorted(map(str, rows))}; the runner needs one length for every buffer."
            )
        return cls(int(rows.pop()))  # type: ignore[arg-type]

    def cache(self, bindings: list[CacheBinding], feeding: Feeding) -> StaticCache:
        return StaticCache(bindings, feeding, self.rows)


class StaticCache(RectangularCache):
    """The fixed buffers of ``batch`` sequences of the same length."""

    def __init__(self, bindings: list[CacheBinding], feeding: Feeding, rows: int) -> None:
        super().__init__(bindings, feeding)
        self.capacity = rows

    def reset(self, batch: int, min_capacity: int = 0) -> None:
        self._check_room(min_capacity)
        self.batch, self.length = batch, 0
        self.caches = {b.past: self.feeding.hold(b.empty(batch), b) for b in self.bindings}

    def _check_room(self, total: int) -> None:
        if total > self.capacity:
            raise KvCacheError(
                f"{total} tokens exceed the {self.capacity} rows of the model's static cache buffers "
                "(fixed when it was built); use shorter sequences, or rebuild it with more rows."
            )

    def feeds(self, rows: Rows) -> dict[str, np.ndarray]:
        """Token ids, positions, where the new rows go and how many rows attention reads."""
        ids = np.asarray(rows)
        batch, seq = ids.shape
        total = self.length + seq
        self._check_room(total)
        feeds: dict[str, np.ndarray] = {self.feeding.ids_name: ids.astype(np.int64)}
        if "position_ids" in self.feeding.input_names:
            feeds["position_ids"] = np.tile(np.arange(self.length, total, dtype=np.int64), (batch, 1))
        write, seqlen = STATIC.inputs
        feeds[write] = np.full((batch,), self.length, np.int64)
        feeds[seqlen] = np.full((batch,), total, np.int64)
        return feeds

    def values(self, cache: CacheBinding) -> np.ndarray:
        """The written rows' float32 values ``[B, kv_num_heads, length, head_size]``."""
        return cache.values(host_array(self.caches[cache.past]))[:, :, : self.length]
