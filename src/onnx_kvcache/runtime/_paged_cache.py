"""A block pool for paged decoders: what a continuous-batching scheduler does for one batch.

PagedAttention keeps every sequence's K/V in fixed-size blocks of one pool
``[num_blocks, block_size, kv_num_heads, head_size]`` per cache; ``block_table[b]`` lists
the blocks of sequence ``b`` in order. :class:`BlockPool` hands blocks out as sequences
grow (taking turns between sequences, so no table is a contiguous run), grows the pool
when it runs out, and builds each call's packed inputs: ``cumulative_sequence_lengths``,
``past_sequence_lengths``, ``block_table`` (``-1`` past a sequence's blocks) and
``attention_metadata`` (the host-side bounds ``[max new tokens, max context, 0]``).
"""

from __future__ import annotations

__all__ = ["BlockPool", "check_block_size"]

from collections.abc import Sequence

import numpy as np

from onnx_kvcache.errors import KvCacheError


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
