"""A block pool for paged decoders: what a continuous-batching scheduler does for one batch.

PagedAttention keeps every sequence's K/V in fixed-size blocks of one pool
``[num_blocks, block_size, kv_num_heads, head_size]`` per cache; ``block_table[b]`` lists
the blocks of sequence ``b`` in order. :class:`BlockPool` hands blocks out as sequences
grow (taking turns between sequences, so no table is a contiguous run), grows the pool
when it runs out, and builds each call's packed inputs: ``cumulative_sequence_lengths``,
``past_sequence_lengths``, ``block_table`` (``-1`` past a sequence's blocks) and
``attention_metadata`` (the host-side bounds ``[max new tokens, max context, 0]``).

:class:`PagedLayout` is what the model fixes (its block size, the graph inputs its
PagedAttention nodes read the lengths from); :class:`PagedCache` is the runner's cache of a
paged decoder: one pool tensor per cache, grown with the block pool, the batch's rows packed
into one token list each call.
"""

from __future__ import annotations

__all__ = ["BlockPool", "PagedCache", "PagedLayout", "check_block_size"]

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.operators import PAGED
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.errors import KvCacheError, Param
from onnx_kvcache.model_io import fed_as_bits, host_array
from onnx_kvcache.model_io.genai_folder import block_size as configured_block_size
from onnx_kvcache.runtime._cache import CacheBinding, Feeding, Rows


def check_block_size(block_size: int) -> int:
    """onnxruntime's rule: a power of two, at least 16."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise KvCacheError(f"block_size must be an integer, got {block_size!r}.")
    if block_size < 16 or block_size & (block_size - 1):
        raise KvCacheError(
            f"block_size must be a power of two and at least 16 (onnxruntime's PagedAttention rule), "
            f"got {block_size}."
        )
    return int(block_size)


class BlockPool:
    """Blocks of one pool shared by ``batch`` sequences (one allocation for every layer)."""

    def __init__(self, block_size: int, batch: int, num_blocks: int = 0) -> None:
        self.block_size = check_block_size(block_size)
        self.batch = batch
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))
        self.blocks: list[list[int]] = [[] for _ in range(batch)]
        self.lengths = [0] * batch

    def reserve(self, lengths: Sequence[int]) -> int:
        """Give each sequence blocks for ``lengths[b]`` tokens; returns how many blocks the pool
        must grow by (the caller enlarges every layer's tensors by that many blocks)."""
        needed = [-(-int(n) // self.block_size) for n in lengths]
        grow = 0
        while any(len(have) < want for have, want in zip(self.blocks, needed)):
            for have, want in zip(self.blocks, needed):  # take turns: tables interleave
                if len(have) >= want:
                    continue
                if not self.free:
                    extra = max(self.num_blocks, 1)
                    self.free = list(range(self.num_blocks, self.num_blocks + extra))
                    self.num_blocks += extra
                    grow += extra
                have.append(self.free.pop(0))
        return grow

    def table(self) -> np.ndarray:
        """``block_table`` ``[batch, max blocks]`` int32, ``-1`` past each sequence's blocks."""
        width = max(1, max(len(b) for b in self.blocks))
        table = np.full((self.batch, width), -1, np.int32)
        for row, blocks in zip(table, self.blocks):
            row[: len(blocks)] = blocks
        return table

    def feeds(self, new_tokens: Sequence[int]) -> dict[str, np.ndarray]:
        """The length inputs of a call adding ``new_tokens[b]`` tokens to each sequence."""
        past = np.asarray(self.lengths, np.int32)
        new = np.asarray(new_tokens, np.int32)
        total = past + new
        return {
            "cumulative_sequence_length": np.concatenate([[0], np.cumsum(new)]).astype(np.int32),
            "past_seqlens": past,
            "block_table": self.table(),
            "attention_metadata": np.array([int(new.max(initial=0)), int(total.max(initial=0)), 0], np.int32),
        }

    def slots(self, new_tokens: Sequence[int]) -> np.ndarray:
        """``slot_mapping`` of a call: each new token's pool row (blocks must be reserved)."""
        slots = []
        for blocks, length, count in zip(self.blocks, self.lengths, new_tokens):
            for position in range(length, length + int(count)):
                slots.append(
                    blocks[position // self.block_size] * self.block_size + position % self.block_size
                )
        return np.asarray(slots, np.int32)

    def advance(self, new_tokens: Sequence[int]) -> None:
        self.lengths = [n + int(k) for n, k in zip(self.lengths, new_tokens)]

    def rows(self, sequence: int) -> np.ndarray:
        """Pool rows (``block * block_size + offset``) of the sequence's tokens, in order."""
        length = self.lengths[sequence]
        blocks = np.asarray(self.blocks[sequence], np.int64)
        positions = np.arange(length)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size


_LENGTHS = ("cumulative_sequence_length", "past_seqlens", "block_table", "attention_metadata")


def _paged_inputs(model: ir.Model) -> dict[str, str]:
    """The graph inputs a paged decoder's PagedAttention nodes read their lengths from."""
    inputs = {v.name for v in model.graph.inputs}
    names: dict[str, str] = {}
    for site in find_attention_sites(model, ops=(PAGED,)):
        for role in (*_LENGTHS, "slot_mapping"):
            value = site.input(role)
            if value is None:
                continue
            if value.name not in inputs:
                raise KvCacheError(
                    f"{site.label} reads its {role} from {value.name!r}, which is not a graph input; "
                    "the runner feeds paged decoders whose lengths and block table are graph inputs "
                    "(onnxruntime-genai's layout)."
                )
            if names.setdefault(role, value.name) != value.name:  # type: ignore[arg-type]
                raise KvCacheError(
                    f"{site.label} reads its {role} from {value.name!r}, other layers from "
                    f"{names[role]!r}: layers with their own tables (genai's windowed paged layers, "
                    "block_table_windowed) are not run by the runner; build the model with full-size "
                    "paged caches."
                )
    return names


def _block_size(bindings: Sequence[CacheBinding], requested: int | None, config: dict | None) -> int:
    """The pool's block size: the model's static one, else ``requested``, else the genai
    config's ``engine.dynamic_batching.block_size``, else 16."""
    static = {b.block_size for b in bindings if b.block_size is not None}
    if len(static) > 1:
        raise KvCacheError(
            f"The model's paged caches declare different block sizes {sorted(static)}; one block table "
            "cannot address them. Rebuild the model with one block size."
        )
    if static:
        fixed = static.pop()
        if requested is not None and requested != fixed:
            raise KvCacheError(
                Param("block_size", requested),
                f" does not match the model's caches, which fix block_size {fixed}.",
            )
        return check_block_size(fixed)
    if requested is not None:
        return check_block_size(requested)
    configured = configured_block_size(config)
    return check_block_size(configured) if configured is not None else 16


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """A paged decoder's block size and the graph inputs of its lengths, by role."""

    block_size: int
    inputs: Mapping[str, str]

    @classmethod
    def read(
        cls, bindings: Sequence[CacheBinding], model: ir.Model, requested: int | None, config: dict | None
    ) -> PagedLayout:
        """The layout of ``model``'s pools (``requested`` and genai ``config``: the block size)."""
        return cls(_block_size(bindings, requested, config), _paged_inputs(model))

    def cache(self, bindings: list[CacheBinding], feeding: Feeding) -> PagedCache:
        return PagedCache(bindings, feeding, self)


class PagedCache:
    """One block pool tensor per cache, shared by ``batch`` sequences of any lengths."""

    capacity: None = None

    def __init__(self, bindings: list[CacheBinding], feeding: Feeding, layout: PagedLayout) -> None:
        self.bindings = bindings
        self.feeding = feeding
        self.layout = layout
        self.block_size: int = layout.block_size
        self.pool = BlockPool(layout.block_size, 1)
        self.batch = 1
        self.caches: dict[str, Any] = {}
        quantized = any(b.format is not None for b in bindings)
        self.kernel_rule = "PagedAttention CPU reference (" + (
            "quantized before attending, as every paged kernel)" if quantized else "a float cache, float32)"
        )

    @property
    def length(self) -> int:
        return max(self.pool.lengths)

    def reset(self, batch: int, min_capacity: int = 0) -> None:
        """A fresh pool with blocks for ``min_capacity`` tokens per sequence."""
        self.batch = batch
        self.pool = BlockPool(self.block_size, batch)
        self.pool.reserve([min_capacity] * batch)
        self.caches = {
            b.past: self.feeding.hold(b.empty_pool(self.pool.num_blocks, self.block_size), b)
            for b in self.bindings
        }

    def require_packed(self) -> None:
        """A block pool takes sequences of different lengths in one call."""

    def feeds(self, rows: Rows) -> dict[str, np.ndarray]:
        """Pack ``rows`` (new tokens per sequence) with the pool's lengths and table."""
        pool = self.pool
        new = [len(s) for s in rows]
        grow = pool.reserve([n + k for n, k in zip(pool.lengths, new)])
        if grow:
            self._grow(grow)
        lengths = pool.feeds(new)
        feeds: dict[str, np.ndarray] = {self.feeding.ids_name: np.concatenate(rows).astype(np.int64)}
        for role, name in self.layout.inputs.items():
            feeds[name] = pool.slots(new) if role == "slot_mapping" else lengths[role]
        if "position_ids" in self.feeding.input_names:
            feeds["position_ids"] = np.concatenate(
                [np.arange(n, n + k, dtype=np.int64) for n, k in zip(pool.lengths, new)]
            )
        return feeds

    def _grow(self, blocks: int) -> None:
        """Add ``blocks`` empty blocks to every layer's pool (host copy for device pools)."""
        feeding = self.feeding
        for b in self.bindings:
            grown = np.concatenate([host_array(self.caches[b.past]), b.empty_pool(blocks, self.block_size)])
            if feeding.io_binding and fed_as_bits(b.feed_dtype or b.dtype) and feeding.device != "cpu":
                raise KvCacheError(
                    "The fp8 block pool on the device is full; reset(batch, min_capacity=...) with "
                    "room for the whole context first."
                )
            self.caches[b.past] = feeding.hold(grown, b)

    def advance(self, rows: Rows) -> None:
        self.pool.advance([len(r) for r in rows])

    def logits(self, logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The packed call's ``[tokens, vocab]`` logits as ``[batch, seq, vocab]``."""
        if logits.size % ids.size:
            raise KvCacheError(f"The model's logits {logits.shape} are not {ids.size} tokens' rows.")
        return logits.reshape(ids.shape[0], ids.shape[1], -1)

    def bind_present(self, binding: Any, cache: CacheBinding) -> None:
        if self.feeding.device != "cpu":  # the kernel updates its pool in place
            binding.bind_ortvalue_output(cache.present, self.caches[cache.past])
        else:
            binding.bind_output(cache.present, self.feeding.device)

    def values(self, cache: CacheBinding) -> np.ndarray:
        """Each sequence's tokens gathered from the pool, BNSH, dequantized."""
        pool = host_array(self.caches[cache.past])
        flat = pool.reshape(-1, *pool.shape[2:])
        rows = [flat[self.pool.rows(i)] for i in range(self.batch)]
        longest = max(len(r) for r in rows)
        view = np.zeros((self.batch, longest, *pool.shape[2:]), pool.dtype)
        for i, r in enumerate(rows):
            view[i, : len(r)] = r
        return cache.values(view.transpose(0, 2, 1, 3))
