"""``evaluate``'s verdict: the rows a candidate's perplexity change and top-1 agreement fall in,
and the perplexity change's 95% interval they are judged at (batch means over blocks of
:data:`NLL_BLOCK` decode steps: neighbouring positions are not independent)."""

from __future__ import annotations

__all__ = ["NLL_BLOCK", "VERDICTS", "Verdict", "change_margin", "perplexity"]

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One row of :data:`VERDICTS`: the loss a candidate shows within both bounds."""

    words: str
    max_perplexity_change: float
    """The perplexity's relative increase over the baseline's, at most."""
    min_top1: float
    """Top-1 agreement over the decode steps, at least."""
    advice: str


#: The first row whose bounds the figures meet says it. On SmolLM2-135M's held-out text
#: (docs/choosing-a-format.md) int8 per channel scores -0.1% perplexity and 97% top-1 (near-ties
#: flip a few argmaxes at any precision: top-1 is the second bound), fp8 about +0.8% and 95%,
#: rotated int4 about +14% and 77%.
VERDICTS: tuple[Verdict, ...] = (
    Verdict("no measurable loss", 0.005, 0.95, "the cache's bytes are saved for free"),
    Verdict(
        "a small loss",
        0.02,
        0.90,
        "usually fine for chat and summaries; read a few continuations side by side "
        "(onnx-kvcache compare) before shipping",
    ),
    Verdict(
        "a clear loss",
        0.10,
        0.75,
        "try per-channel scales, a wider format (int8, fp8), or calibration on the model's own text",
    ),
    Verdict(
        "a large loss",
        float("inf"),
        0.0,
        "generations will drift (loops, wrong facts): use a wider format (int8, fp8) for this model",
    ),
)


#: Consecutive decode steps whose mean NLL difference is one sample of the margin's estimate.
NLL_BLOCK = 32


def change_margin(nlls: tuple[list[np.ndarray], list[np.ndarray]], change: float) -> float:
    """The perplexity ``change``'s 95% half-width from blocks of :data:`NLL_BLOCK` steps of
    each window (inf with fewer than two blocks: nothing tells the noise)."""
    means = []
    for base, cand in zip(*nlls):
        diff = cand - base
        diff = diff[~np.isnan(diff)]
        means += [
            float(diff[i : i + NLL_BLOCK].mean()) for i in range(0, len(diff) - NLL_BLOCK + 1, NLL_BLOCK)
        ]
    if len(means) < 2:
        return float("inf")
    half = 1.96 * float(np.std(means, ddof=1)) / np.sqrt(len(means))
    return float((1.0 + change) * np.expm1(half))  # exp(mean + half) - exp(mean), mean = log1p(change)


def perplexity(nlls: list[np.ndarray]) -> float:
    """``exp`` of the mean NLL over every position whose next token is known (NaN: none)."""
    values = np.concatenate(nlls) if nlls else np.empty(0)
    values = values[~np.isnan(values)]
    return float(np.exp(values.mean())) if values.size else float("nan")
