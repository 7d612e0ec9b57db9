"""``evaluate``'s verdict: the rows a candidate's perplexity change and top-1 agreement fall in,
each row's advice as it fits the candidate (its cache smaller than the baseline's or not, its
scales per channel or not), and the perplexity change's 95% interval the rows are judged at
(batch means over blocks of :data:`NLL_BLOCK` decode steps: neighbouring positions are not
independent)."""

from __future__ import annotations

__all__ = ["NLL_BLOCK", "VERDICTS", "Advice", "Candidate", "Verdict", "change_margin", "perplexity"]

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What a verdict's advice follows: the candidate's cache against the baseline's."""

    saves: bool
    """Its cache takes fewer bytes a token than the baseline's."""
    granularity: str | None
    """Its scales' granularity (``per_tensor``, ``per_channel``), None for a float cache."""


@dataclasses.dataclass(frozen=True)
class Advice:
    """One advice of a :class:`Verdict`, for the candidates it fits (None: any)."""

    words: str
    saves: bool | None = None
    """For a candidate whose cache is smaller than the baseline's (True) or not (False)."""
    per_channel: bool | None = None
    """For a candidate whose scales are per channel (True) or not (False)."""

    def fits(self, candidate: Candidate) -> bool:
        per_channel = candidate.granularity == "per_channel"
        return self.saves in (None, candidate.saves) and self.per_channel in (None, per_channel)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One row of :data:`VERDICTS`: the loss a candidate shows within both bounds."""

    words: str
    max_perplexity_change: float
    """The perplexity's relative increase over the baseline's, at most."""
    min_top1: float
    """Top-1 agreement over the decode steps, at least."""
    advice: tuple[Advice, ...]
    """What to do, the first that fits the candidate (the last fits any)."""

    def advice_for(self, candidate: Candidate) -> str:
        """The words of the first :attr:`advice` that fits ``candidate``."""
        return next(a.words for a in self.advice if a.fits(candidate))


#: A loss with no bytes saved (a rotated float cache, a float16 cache of a float16 model).
_NOTHING_SAVED = Advice(
    "and nothing is saved: the candidate's cache takes no fewer bytes than the baseline's; keep the baseline",
    saves=False,
)

#: The first row whose bounds the figures meet says it, with the advice that fits the candidate.
#: On SmolLM2-135M's held-out text (docs/choosing-a-format.md) int8 per channel scores -0.1%
#: perplexity and 97% top-1 (near-ties flip a few argmaxes at any precision: top-1 is the second
#: bound), fp8 about +0.8% and 95%, rotated int4 about +14% and 77%.
VERDICTS: tuple[Verdict, ...] = (
    Verdict(
        "no measurable loss",
        0.005,
        0.95,
        (
            Advice("the cache's bytes are saved for free", saves=True),
            Advice(
                "but nothing is saved: the candidate's cache takes no fewer bytes than the baseline's; "
                "quantize it (int8, fp8) to save them"
            ),
        ),
    ),
    Verdict(
        "a small loss",
        0.02,
        0.90,
        (
            _NOTHING_SAVED,
            Advice(
                "usually fine for chat and summaries; read a few continuations side by side "
                "(onnx-kvcache compare) before shipping"
            ),
        ),
    ),
    Verdict(
        "a clear loss",
        0.10,
        0.75,
        (
            _NOTHING_SAVED,
            Advice(
                "try per-channel scales, a wider format (int8, fp8), or calibration on the model's own text",
                per_channel=False,
            ),
            Advice(
                "its scales are per channel already: try a wider format (int8, fp8), or calibration "
                "on the model's own text"
            ),
        ),
    ),
    Verdict(
        "a large loss",
        float("inf"),
        0.0,
        (
            _NOTHING_SAVED,
            Advice(
                "generations will drift (loops, wrong facts): use a wider format (int8, fp8) for this model"
            ),
        ),
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
