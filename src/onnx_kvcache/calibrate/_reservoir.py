"""The bounded sample of a layer's cache rows that thresholds are taken from.

Rules: a uniform reservoir sample (Algorithm R) of whole token rows, at most ``capacity``
rows, whatever the number of windows; each row keeps its attention weights when given, and
the per-channel amax is kept over every row seen (or over ``bound``, the RoPE envelope).
"""

from __future__ import annotations

__all__: list[str] = []

import dataclasses

import numpy as np


@dataclasses.dataclass
class _Reservoir:
    """A uniform sample of token rows (each row: all channels), bounded in size.

    Rows keep their sign (what the kernel stores decides the clip fraction: int8 stores
    -128 but not +128), except K under the RoPE envelope, whose pair norms any rotation
    may store at either sign.
    """

    channels: int
    capacity: int
    rng: np.random.Generator
    rows: np.ndarray = dataclasses.field(init=False)
    seen: int = 0
    amax: np.ndarray = dataclasses.field(init=False)
    weights: np.ndarray | None = None
    """Per sampled value, the weight of its error (``attention``), kept with its row."""

    def __post_init__(self) -> None:
        self.rows = np.empty((0, self.channels), np.float32)
        self.amax = np.zeros(self.channels, np.float32)

    def add(
        self, rows: np.ndarray, weights: np.ndarray | None = None, bound: np.ndarray | None = None
    ) -> None:
        """Sample ``rows``; ``bound`` (default ``|rows|``) raises the amax."""
        self.amax = np.maximum(self.amax, np.abs(rows if bound is None else bound).max(axis=0))
        n = rows.shape[0]
        free = self.capacity - self.rows.shape[0]
        if weights is not None and self.weights is None:
            self.weights = np.empty((0, self.channels), np.float32)
        if free > 0:
            self.rows = np.concatenate([self.rows, rows[:free]])
            if weights is not None and self.weights is not None:
                self.weights = np.concatenate([self.weights, weights[:free]])
        first = max(free, 0)
        if first < n:  # Algorithm R: row i takes slot j ~ U[0, seen + i] if j < capacity
            slots = self.rng.integers(
                0, np.arange(self.seen + first + 1, self.seen + n + 1)
            )  # one draw each, in order
            taken = np.flatnonzero(slots < self.capacity)
            # of rows drawing the same slot, the last one stays
            _, last = np.unique(slots[taken][::-1], return_index=True)
            keep = taken[::-1][last]
            self.rows[slots[keep]] = rows[first + keep]
            if weights is not None and self.weights is not None:
                self.weights[slots[keep]] = weights[first + keep]
        self.seen += n
