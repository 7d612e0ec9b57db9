"""``evaluate``'s speed and memory figures: both models timed at one context, here, once.

Rules:

* Each runner starts from an empty cache, is given a prompt of ``context`` token ids in one
  call (the prefill, timed) and then :data:`DECODE_STEPS` ids one a call (decode tokens a second);
  the ids are the same seeded random ids for both models (speed does not depend on them).
* The context is the one asked for (``evaluate --speed-context``), by default
  :data:`DEFAULT_CONTEXT`, each shortened to what both models hold with the decode steps.
* Cache memory is computed from the graph (``inspect``'s bytes per token at the context, batch 1),
  not measured: what the caches hold, not what the process holds.
* Wall time of this process, on a machine others may share: the figures say where and when
  they were taken (onnxruntime's own threads), and are a comparison of the two models, not a
  benchmark (``benchmarks/cpu_context_speed.py`` times onnxruntime-genai in separate processes).
"""

from __future__ import annotations

__all__ = ["DECODE_STEPS", "DEFAULT_CONTEXT", "Speed", "measure_speed"]

import dataclasses
import time
from typing import Any

import numpy as np

from onnx_kvcache.cache.layout import inspect_kv_cache
from onnx_kvcache.model_io import format_bytes
from onnx_kvcache.runtime.runner import KvCacheRunner

#: The prompt ``evaluate`` times by default (tokens), shortened to the models' context.
DEFAULT_CONTEXT = 1024
#: Decode steps timed after the prompt.
DECODE_STEPS = 16


@dataclasses.dataclass(frozen=True)
class Speed:
    """Both models' prefill and decode speed and cache bytes at one context (baseline, candidate)."""

    context: int
    steps: int
    prefill_seconds: tuple[float, float]
    decode_tokens_per_second: tuple[float, float]
    cache_bytes: tuple[float, float]

    def rows(self) -> list[tuple[str, str]]:
        """The report's lines: each figure, the baseline's and the ratio."""
        (pb, pc), (db, dc), (cb, cc) = self.prefill_seconds, self.decode_tokens_per_second, self.cache_bytes
        return [
            (
                f"prefill, {self.context} tokens",
                f"{pc:.3g} s (baseline {pb:.3g} s, {pc / pb:.2f}x its time)",
            ),
            (
                "decode",
                f"{dc:.4g} tokens/s (baseline {db:.4g}, {dc / db:.2f}x its speed) over {self.steps} "
                "steps after that prompt",
            ),
            (
                f"cache at {self.context} tokens",
                f"{format_bytes(cc, 'MiB')} (baseline {format_bytes(cb, 'MiB')}), batch 1; "
                "timed once in this process: a comparison, not a benchmark",
            ),
        ]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _timed(runner: KvCacheRunner, ids: np.ndarray, steps: np.ndarray) -> tuple[float, float]:
    runner.reset(1, min_capacity=len(ids) + len(steps))
    start = time.perf_counter()
    runner.prefill(ids)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for token in steps:
        runner.step(int(token))
    return prefill, len(steps) / (time.perf_counter() - start)


def measure_speed(
    runners: tuple[KvCacheRunner, KvCacheRunner], asked: int | None, limit: int | None
) -> Speed | None:
    """Both runners timed at the context ``asked`` (default :data:`DEFAULT_CONTEXT`) within
    ``limit`` (the models' context) less the decode steps (module rules), each left with an empty
    cache; None when nothing fits, 0 was asked, or a vocabulary is unknown."""
    context = DEFAULT_CONTEXT if asked is None else asked
    if limit is not None:
        context = min(context, limit - DECODE_STEPS)
    sizes = [r.vocab_size for r in runners]
    if context <= 0 or not all(sizes):
        return None
    vocab = min(v for v in sizes if v)
    rng = np.random.default_rng(0)
    ids, steps = rng.integers(0, vocab, context), rng.integers(0, vocab, DECODE_STEPS)
    base, cand = (_timed(r, ids, steps) for r in runners)
    caches = tuple(inspect_kv_cache(r.source_model, exported=True).cache_bytes(context) for r in runners)
    for runner in runners:
        runner.reset(1)
    return Speed(context, DECODE_STEPS, (base[0], cand[0]), (base[1], cand[1]), caches)  # type: ignore[arg-type]
