"""Running the calibration windows and sampling every layer's caches.

Rules:

* Consecutive windows of one length run as one batch (up to the entry point's token budget;
  one by one for the ``attention`` methods, which weigh each window with its own queries), and
  each window's K and V rows are sampled into their layer's reservoir, window by window.
* Only resident rows are read (a windowed cache keeps its last rows); a non-finite value is an
  error. Under the RoPE envelope K is sampled as its pair norms (the amax), and for the
  attention methods as moved to random positions of the rotary table.
* For a rotated cache (``rotation``) K and V are sampled as the cache will hold them: turned
  by ``H``, K first moved to random positions of the rotary table under the envelope (every
  method: no pair norm bounds a rotated key).
* ``attention_search`` keeps each window's queries and float K/V for its refinement.
"""

from __future__ import annotations

__all__: list[str] = []

import dataclasses
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from onnx_kvcache.cache.rotation import Rotation, rotate
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.calibrate import _clip_search
from onnx_kvcache.calibrate._attention_weights import ATTENTION_QUERIES, _attention_weights
from onnx_kvcache.calibrate._reservoir import _Reservoir
from onnx_kvcache.calibrate._rope_envelope import _rope_tables, _rotary, _rotated_anywhere, rope_pair_norm
from onnx_kvcache.calibrate._settings import _Choice, _Sampling, _Setup
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.runtime.runner import KvCacheRunner


def _runs(windows: Sequence[np.ndarray], budget: int) -> Iterator[list[np.ndarray]]:
    """Consecutive windows of one length, ``budget`` tokens together at most (one at least)."""
    run: list[np.ndarray] = []
    for window in windows:
        if run and (len(window) != len(run[0]) or (len(run) + 1) * len(window) > budget):
            yield run
            run = []
        run.append(window)
    if run:
        yield run


def _progress_bar(total: int) -> Any:
    """A tqdm bar on a terminal, else None."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="calibrating", unit="seq")


@dataclasses.dataclass(frozen=True)
class _Sampler:
    """Each layer's reservoirs of K and V rows, filled window by window."""

    sites: dict[int, CacheSite]
    """The attention node of each layer that has one (a static buffer's or an unfused export's
    cache has none: no RoPE envelope, no queries, no rotation of its own)."""
    heads: dict[int, int]
    """Each layer's ``kv_num_heads``, from the runner's caches."""
    attention: bool
    """Weigh each row by the attention it gets (the method's); windows then run one by one."""
    rope_envelope: bool
    sample_budget: int
    rng: np.random.Generator
    positions: np.random.Generator
    """attention's K positions (``rng`` stays the other methods')."""
    rope_positions: int | None
    """attention's K positions are drawn below this (None: the whole rotary table)."""
    rope_tables: dict[int, tuple[np.ndarray, np.ndarray] | None]
    exact: _Exact | None = None
    """``attention_search``'s windows, kept for the refinement."""
    rotation: Rotation | None = None
    """The cache's rotation: K and V are sampled turned (None: as the model computes them)."""
    reservoirs: dict[tuple[int, str], _Reservoir] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, setup: _Setup, choice: _Choice, sampling: _Sampling) -> _Sampler:
        sites = {s.layer_id: s for s in find_attention_sites(setup.runner.source_model)}
        attention = setup.method.attention
        moves_keys = attention or setup.rotation.keys
        rope_tables = {
            layer: _rope_tables(site)
            for layer, site in sites.items()
            if moves_keys and site.int_attr("do_rotary")
        }
        rng, positions = np.random.default_rng(sampling.seed), np.random.default_rng([sampling.seed, 1])
        exact = _Exact(np.random.default_rng([sampling.seed, 2])) if setup.method.exact else None
        heads = {b.layer_id: b.kv_num_heads for b in setup.runner.bindings}
        return cls(
            sites,
            heads,
            attention,
            choice.rope_envelope,
            sampling.sample_budget,
            rng,
            positions,
            choice.rope_positions,
            rope_tables,
            exact,
            setup.rotation if setup.rotation.rotates else None,
        )

    def layers(self) -> list[int]:
        return sorted({k[0] for k in self.reservoirs})

    def run(
        self, runner: KvCacheRunner, windows: Sequence[np.ndarray], progress: bool, tokens_per_run: int
    ) -> int:
        """Prefill the windows (those of one length together, ``tokens_per_run`` at most;
        ``attention`` weighs each with its own queries) and sample their caches; the tokens seen."""
        bar = _progress_bar(len(windows)) if progress else None
        tokens = 0
        for run in _runs(windows, 1 if self.attention else tokens_per_run):
            length = len(run[0])
            runner.reset(len(run), min_capacity=length)  # window caches keep every row resident
            runner.fill(np.asarray(run, np.int64))
            tokens += length * len(run)
            attention = (
                _attention_weights(runner, self.sites, length, self.rope_tables, self.rotation)
                if self.attention
                else {}
            )
            if self.exact is not None:
                self.exact.collect(runner, self, length)
            caches = {(b.layer_id, b.kind): runner.cache_values(b.layer_id, b.kind) for b in runner.bindings}
            for row, b in ((row, b) for row in range(len(run)) for b in runner.bindings):  # window by window
                self.add(b, caches[b.layer_id, b.kind][row], length, attention.get((b.layer_id, b.kind)))
            if bar is not None:
                bar.update(len(run))
        if bar is not None:
            bar.close()
        return tokens

    def add(self, b: Any, x: np.ndarray, length: int, weights: np.ndarray | None) -> None:
        """Sample one window's cache ``x`` ``[kv, S, hd]`` of binding ``b``."""
        site = self.sites.get(b.layer_id)
        x = x[:, : b.resident_rows(length, x.shape[1])]
        if not np.all(np.isfinite(x)):
            raise KvCacheError(
                f"Layer {b.layer_id} {b.kind} cache holds non-finite values; the model "
                "produced NaN/inf on the calibration data."
            )
        if self.rotation is not None and (self.rotation.keys if b.kind == "key" else self.rotation.values):
            self._sample(b, self._turned(b, site, x), weights, None)
            return
        seen = x  # signed; under the envelope, K's pair norms
        rotary = _rotary(site) if site is not None and b.kind == "key" and self.rope_envelope else None
        if rotary is not None:
            seen = rope_pair_norm(
                x,
                interleaved=rotary[0],
                rotary_dim=rotary[1],
                rotary_offset=site.int_attr("rotary_offset", 0),  # type: ignore[union-attr]
            )
        bound = None
        if rotary is not None and (tables := self.rope_tables.get(b.layer_id)) is not None:
            # the search sees K where RoPE may put it (any position); the envelope bounds it
            bound = seen.transpose(1, 0, 2).reshape(seen.shape[1], -1)
            seen = _rotated_anywhere(x, tables, rotary[0], self.positions, self.rope_positions)
        self._sample(b, seen, weights, bound)

    def _turned(self, b: Any, site: CacheSite | None, x: np.ndarray) -> np.ndarray:
        """K or V ``[kv, S, hd]`` as the rotated cache holds it (module rules)."""
        rotary = _rotary(site) if site is not None and b.kind == "key" and self.rope_envelope else None
        if rotary is not None and (tables := self.rope_tables.get(b.layer_id)) is not None:
            x = _rotated_anywhere(x, tables, rotary[0], self.positions, self.rope_positions, signed=True)
        return rotate(x)

    def _sample(self, b: Any, seen: np.ndarray, weights: np.ndarray | None, bound: np.ndarray | None) -> None:
        """Rows ``[kv, S, hd]`` of one window into the binding's reservoir."""
        rows = seen.transpose(1, 0, 2).reshape(seen.shape[1], -1)  # [S, kv*hd]
        key = (b.layer_id, b.kind)
        if key not in self.reservoirs:
            self.reservoirs[key] = _Reservoir(
                rows.shape[1], max(1, self.sample_budget // rows.shape[1]), self.rng
            )
        if self.attention and weights is None:  # no query to weigh with: plain round-trip error
            weights = np.ones_like(rows)
        self.reservoirs[key].add(rows, None if weights is None else weights[: rows.shape[0]], bound)


@dataclasses.dataclass(frozen=True)
class _Exact:
    """``attention_search``'s samples: per layer, each window's queries and float K/V."""

    offsets: np.random.Generator
    """The rotary offsets keys are stored at under the envelope."""
    samples: dict[int, list[_clip_search.LayerSample]] = dataclasses.field(default_factory=dict)

    def collect(self, runner: KvCacheRunner, sampler: _Sampler, length: int) -> None:
        picks = np.unique(np.linspace(0, length - 1, min(length, ATTENTION_QUERIES)).round().astype(np.int64))
        found = _clip_search.collect(
            runner, sampler.sites, length, picks, sampler.rope_tables, sampler.rope_envelope, self.offsets
        )
        for layer, sample in found.items():
            self.samples.setdefault(layer, []).append(sample)
