"""A decoder's dense KV caches: one ``[batch, kv_num_heads, seq, last_dim]`` tensor per cache.

Each run feeds the past caches and keeps the present outputs as the next run's past (the
kernel grows them by the new tokens). A window-sized cache (``sliding_window_cache=1``)
starts at its window, or at ``min_capacity`` rows when the model's shape lets it grow, so
that calibration sees every row the kernel will quantize; the kernel keeps the last
``capacity`` tokens resident (:meth:`CacheBinding.resident_rows`).
"""

from __future__ import annotations

__all__ = ["DenseCache", "DenseLayout", "RectangularCache"]

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.model_io import host_array
from onnx_kvcache.runtime._cache import CacheBinding, Feeding, Rows


@dataclasses.dataclass(frozen=True)
class DenseLayout:
    """Dense caches fix nothing beyond their bindings and feed no inputs of their own."""

    inputs: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def read(
        cls, bindings: Sequence[CacheBinding], model: ir.Model, requested: int | None, config: dict | None
    ) -> DenseLayout:
        """Dense caches: ``requested`` (a block size) and ``config`` do not apply."""
        return cls()

    def cache(self, bindings: list[CacheBinding], feeding: Feeding) -> DenseCache:
        return DenseCache(bindings, feeding)


class RectangularCache:
    """What the caches of ``batch`` sequences of the same length share (a dense cache, fixed
    buffers): no blocks, calls of one length each, the present outputs bound as they come."""

    block_size: None = None
    kernel_rule: None = None
    pool: None = None

    def __init__(self, bindings: list[CacheBinding], feeding: Feeding) -> None:
        self.bindings = bindings
        self.feeding = feeding
        self.batch = 1
        self.length = 0
        self.caches: dict[str, Any] = {}

    def require_packed(self) -> None:
        raise KvCacheError("forward_packed needs a paged decoder (PagedAttention); use forward.")

    def advance(self, rows: Rows) -> None:
        self.length += len(rows[0])

    def logits(self, logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return logits

    def bind_present(self, binding: Any, cache: CacheBinding) -> None:
        """The present output in a new OrtValue each call (a fixed buffer too: bound to the
        input's own, onnxruntime 1.32's CPU gives wrong logits after the first call, measured)."""
        binding.bind_output(cache.present, self.feeding.device)


class DenseCache(RectangularCache):
    """The dense caches of ``batch`` sequences of the same length."""

    capacity: None = None

    def reset(self, batch: int, min_capacity: int = 0) -> None:
        self.batch, self.length = batch, 0
        self.caches = {b.past: self.feeding.hold(b.empty(batch, min_capacity), b) for b in self.bindings}

    def feeds(self, rows: Rows) -> dict[str, np.ndarray]:
        """Token ids, and the attention mask and positions when the session takes them."""
        ids = np.asarray(rows)
        batch, seq = ids.shape
        total = self.length + seq
        names = self.feeding.input_names
        feeds: dict[str, np.ndarray] = {self.feeding.ids_name: ids.astype(np.int64)}
        if "attention_mask" in names:
            feeds["attention_mask"] = np.ones((batch, total), np.int64)
        if "position_ids" in names:
            feeds["position_ids"] = np.tile(np.arange(self.length, total, dtype=np.int64), (batch, 1))
        return feeds

    def values(self, cache: CacheBinding) -> np.ndarray:
        return cache.values(host_array(self.caches[cache.past]))
