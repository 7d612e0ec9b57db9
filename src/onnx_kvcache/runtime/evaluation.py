"""How much a quantized KV cache changes a model's outputs, measured on CPU.

Both models see the same tokens. Teacher-forced: every position after a window's prompt
gets the logits a decode step computes there (each reads the quantized cache back), and the
next-token distributions are compared (KL divergence, top-1 agreement); the prompt's own
positions are reported apart, since CUDA's first prompt reads its K/V unquantized. Greedy:
both generate from the prompt and the tokens are compared. The candidate's cache is
dequantized with its own scales and compared with the baseline's, layer by layer.

The figures are token-by-token decoding's, computed with the fewest model calls that give
them (:mod:`onnx_kvcache.runtime._scoring`): where the kernel's logits do not depend on how
positions are split into calls (onnxruntime's CPU int8/int4 kernel, the PagedAttention
reference, a float32 float cache) a window is one call; elsewhere (the emulation) the prompt
is one call and every later position one step. Windows of one length are batched in every
call, greedy generation too, within memory bounds; the report says which pattern produced
each model's figures.
"""

from __future__ import annotations

__all__ = [
    "EvaluationReport",
    "evaluate_kv_cache",
    "greedy_agreement",
    "kl_divergence",
    "top1_agreement",
]

import dataclasses
import itertools
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import granularity_of
from onnx_kvcache.cache.layout import inspect_kv_cache
from onnx_kvcache.cache.rotation import (
    Rotation,
    RotationMatrix,
    rotate,
    site_matrix,
    site_rotation,
    stored_rotation,
)
from onnx_kvcache.errors import (
    INTEGER,
    KvCacheError,
    MeasurementWarning,
    Param,
    require_flags,
    require_type,
    warn,
)
from onnx_kvcache.runtime._memory import FEWER_WINDOWS, WINDOW_BYTES, MemoryEstimate
from onnx_kvcache.runtime._scoring import GREEDY_NOTE, Limits, aligned, call_pattern, greedy, teacher_forced
from onnx_kvcache.runtime._speed import Speed, measure_speed
from onnx_kvcache.runtime._verdicts import VERDICTS, Candidate, Verdict, change_margin, perplexity
from onnx_kvcache.runtime.runner import KvCacheRunner
from onnx_kvcache.scales.data import (
    RANDOM_WINDOWS,
    TokenData,
    TokenWindows,
    find_tokenizer,
    load_token_windows,
)

logger = logging.getLogger(__name__)


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row of two logit arrays (last axis = vocabulary), in nats.

    Computed in float64 as ``sum(P * (p - q)) - logsumexp(p) + logsumexp(q)``, a few rows at
    a time (the temporaries stay small whatever the vocabulary)."""
    p_all, q_all = np.asarray(p_logits), np.asarray(q_logits)
    vocab = p_all.shape[-1]
    p_rows, q_rows = p_all.reshape(-1, vocab), q_all.reshape(-1, vocab)
    out = np.empty(len(p_rows), np.float64)
    step = max(1, _KL_BLOCK // max(1, vocab))
    for start in range(0, len(p_rows), step):
        p = np.asarray(p_rows[start : start + step], np.float64)
        q = np.asarray(q_rows[start : start + step], np.float64)
        p = p - p.max(axis=-1, keepdims=True)
        q = q - q.max(axis=-1, keepdims=True)
        e = np.exp(p)
        total = e.sum(axis=-1)
        np.subtract(p, q, out=p)
        kl = np.einsum("ij,ij->i", e, p) / total - np.log(total) + np.log(np.exp(q).sum(axis=-1))
        out[start : start + step] = kl
    return np.maximum(out, 0.0).reshape(p_all.shape[:-1])


#: Values of each model's logits :func:`kl_divergence` converts to float64 at once.
_KL_BLOCK = 1 << 21
_Turn = tuple[Rotation, RotationMatrix | None]
"""What a model's graph turns before a layer's node, and by which ``H``."""


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The negative log-likelihood (nats) of ``targets`` (``[...]``) under ``logits``
    (``[..., V]``), in float64, a few rows at a time."""
    rows = np.asarray(logits).reshape(-1, logits.shape[-1])
    picked = np.asarray(targets).reshape(-1)
    out = np.empty(len(rows), np.float64)
    step = max(1, _KL_BLOCK // max(1, rows.shape[1]))
    for start in range(0, len(rows), step):
        block = np.asarray(rows[start : start + step], np.float64)
        top = block.max(axis=-1)
        lse = top + np.log(np.exp(block - top[:, None]).sum(axis=-1))
        out[start : start + step] = lse - block[np.arange(len(block)), picked[start : start + step]]
    return out.reshape(np.shape(targets))


def top1_agreement(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """Per row, whether both logit arrays pick the same most likely token."""
    return np.argmax(p_logits, axis=-1) == np.argmax(q_logits, axis=-1)


def greedy_agreement(a: Sequence[int], b: Sequence[int]) -> tuple[int, float]:
    """Tokens until the first divergence, and the share of positions that match."""
    n = min(len(a), len(b))
    if n == 0:
        return 0, float("nan")
    same = [x == y for x, y in zip(a[:n], b[:n])]
    return (same.index(False) if False in same else n), float(np.mean(same))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@dataclasses.dataclass
class EvaluationReport:
    """Accuracy of a candidate (quantized-cache) model against its baseline."""

    kl_mean: float
    """Mean KL over the decode steps (each reads the quantized cache back)."""
    kl_max: float
    top1_agreement: float
    greedy_match_prefix: float
    greedy_match_share: float
    layer_errors: dict[int, tuple[float, float]]
    kl_per_position: list[float]
    baseline_bytes_per_token: float
    candidate_bytes_per_token: float
    candidate_format: str
    emulated: bool
    kernel_rule: str
    """Which kernel's rule produced the candidate's outputs (``cuda (emulated on CPU)``, ...)."""
    data_note: str
    num_sequences: int
    positions: int
    """Decode steps scored (the prompt's own positions are reported apart)."""
    kl_prompt_mean: float = float("nan")
    """Mean KL over the prompt's positions (CUDA's first prompt reads K/V unquantized: ~0)."""
    kernel_rule_reason: str = ""
    """Why that rule: the candidate's target and how it was inferred, or ``asked for``."""
    tokens: int = 0
    """Tokens in the scored windows (prompts and decode steps)."""
    prompt_tokens: tuple[int, ...] = ()
    """The prompt lengths fed, each in one call before the decode steps (``prompt_len``, at most
    half a window)."""
    held_out_from_calibration: bool = False
    """The data is evaluation's default, disjoint from calibration's default data (another
    part of the built-in corpus, or random ids of another seed); False for data given, whose
    overlap with the calibration data the caller knows."""
    calls: dict[str, str] = dataclasses.field(default_factory=dict)
    """How each model's figures were computed (``candidate``, ``baseline``, ``greedy``): the
    call pattern of the kernel and why it gives token-by-token decoding's logits
    (:data:`~onnx_kvcache.runtime._scoring.CALL_PATTERNS`)."""
    perplexity_baseline: float = float("nan")
    """The baseline's perplexity on the data's next tokens, over the decode steps scored."""
    perplexity_candidate: float = float("nan")
    """The candidate's, over the same positions (each a decode step reading its cache back)."""
    perplexity_change_margin: float = 0.0
    """Half the width of the perplexity change's 95% interval: the standard error of the mean
    NLL difference over blocks of :data:`NLL_BLOCK` consecutive decode steps (batch means:
    neighbouring positions are not independent), 1.96 of them, as a change."""
    speed: Speed | None = None
    """Both models' prefill and decode speed and cache bytes at one context, timed here once
    (None: not timed)."""
    candidate_granularity: str | None = None
    """The candidate's scale granularity (``per_tensor``, ``per_channel``), None for a float cache."""

    @property
    def perplexity_change(self) -> float:
        """The candidate's perplexity relative to the baseline's, minus one (``0.01``: +1%)."""
        return self.perplexity_candidate / self.perplexity_baseline - 1.0

    def _row(self, change: float) -> Verdict:
        return next(
            v
            for v in VERDICTS
            if (change <= v.max_perplexity_change or v.max_perplexity_change == float("inf"))
            and self.top1_agreement >= v.min_top1
        )

    def _ends(self) -> tuple[Verdict, Verdict] | None:
        """The rows of both ends of the perplexity change's 95% interval (None: not measured)."""
        change, margin = self.perplexity_change, self.perplexity_change_margin
        if change != change:  # NaN: no decode step had a known next token
            return None
        return self._row(change - margin), self._row(change + margin)

    @property
    def verdict(self) -> Verdict | None:
        """The first of :data:`VERDICTS` whose bounds the perplexity change and top-1 meet, at
        both ends of the change's 95% interval; None when the ends fall in different rows (too
        few decode steps to tell them apart) or nothing was measured."""
        ends = self._ends()
        return ends[0] if ends is not None and ends[0] is ends[1] else None

    @property
    def candidate(self) -> Candidate:
        """What the verdict's advice follows: whether the candidate's cache is the smaller, its
        granularity."""
        saves = self.candidate_bytes_per_token < self.baseline_bytes_per_token
        return Candidate(saves, self.candidate_granularity)

    @property
    def verdict_line(self) -> str:
        """The verdict in one line, with the figures it rests on and the data's caveat."""
        change, margin = self.perplexity_change, self.perplexity_change_margin
        figures = f"perplexity {change:+.2%} ± {margin:.2%}, top-1 {self.top1_agreement:.1%}"
        ends = self._ends()
        if ends is None:
            line = "not measured: no decode step had a known next token"
        elif ends[0] is not ends[1]:
            low, high = ends
            line = (
                f"between {low.words} and {high.words} ({figures} over {self.positions} decode steps): "
                "score more windows (num_seqs) or longer ones to tell them apart"
            )
        else:
            line = f"{ends[0].words} ({figures}): {ends[0].advice_for(self.candidate)}"
        if self.data_note.startswith("seeded random token ids"):
            line += "; on random token ids: give text (a tokenizer) for a verdict about language"
        return line

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; numbers that were not measured (NaN) are null. With the perplexity
        change and the verdict's line (``verdict``: its words, null between two rows)."""
        doc = dataclasses.asdict(self)
        doc["layer_errors"] = {str(k): {"k": v[0], "v": v[1]} for k, v in self.layer_errors.items()}
        doc["perplexity_change"] = self.perplexity_change
        doc["verdict"] = self.verdict.words if self.verdict is not None else None
        doc["verdict_line"] = self.verdict_line
        return {k: None if isinstance(v, float) and v != v else v for k, v in doc.items()}

    def _data_row(self) -> str:
        """What was scored: the source, windows, tokens, decode steps, and whether it is held
        out from calibration's default data."""
        held_out = ""
        if self.held_out_from_calibration:
            held_out = " (held out: disjoint from calibrate's default data)"
        lengths = "/".join(map(str, self.prompt_tokens))
        prompts = f", prompts of {lengths} token(s)" if self.prompt_tokens else ""
        return (
            f"{self.data_note}{held_out}; {_count(self.num_sequences, 'window')}, "
            f"{_count(self.tokens, 'token')}{prompts}, {self.positions} decode steps scored"
        )

    def format_table(self) -> str:
        rows = [
            ("candidate cache", self.candidate_format),
            (
                "kernel rule",
                f"{self.kernel_rule} ({self.kernel_rule_reason})"
                if self.kernel_rule_reason and self.kernel_rule != "float cache"
                else self.kernel_rule,
            ),
            (
                "cache bytes / token",
                f"{self.candidate_bytes_per_token:g} (baseline {self.baseline_bytes_per_token:g})",
            ),
            ("KL mean / max (nats)", f"{self.kl_mean:.3e} / {self.kl_max:.3e} over decode steps"),
            ("KL mean, prompt", f"{self.kl_prompt_mean:.3e} over the prompts' own positions"),
            ("top-1 agreement", f"{self.top1_agreement:.2%} of decode steps"),
            (
                "perplexity",
                f"{self.perplexity_candidate:.4g} (baseline {self.perplexity_baseline:.4g}, "
                f"{self.perplexity_change:+.2%}) on the data's next tokens, over decode steps",
            ),
            (
                "greedy match",
                f"{self.greedy_match_share:.2%} of tokens; the first {self.greedy_match_prefix:g} "
                "identical on average"
                if self.greedy_match_share == self.greedy_match_share  # not NaN
                else "not measured (no tokens generated)",
            ),
            *(self.speed.rows() if self.speed is not None else []),
            ("data", self._data_row()),
            *((f"calls, {who}", note) for who, note in self.calls.items()),
            ("verdict", self.verdict_line),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
        lines.append("per-layer cache error (relative L2, k / v):")
        for layer, (k, v) in sorted(self.layer_errors.items()):
            lines.append(f"  layer {layer:>3}: {k:.3e} / {v:.3e}")
        return "\n".join(lines)


def _relative_error(ref: np.ndarray, test: np.ndarray) -> float:
    denom = float(np.linalg.norm(ref))
    return float(np.linalg.norm(test - ref)) / denom if denom else float(np.linalg.norm(test))


def evaluate_kv_cache(
    baseline: ir.Model | str | os.PathLike,
    candidate: ir.Model | str | os.PathLike,
    data: TokenData = None,
    *,
    max_new_tokens: int | None = None,
    prompt_len: int = 64,
    seq_len: int | None = None,
    num_seqs: int | None = 4,
    providers: Sequence[Any] | None = None,
    tokenizer: str | os.PathLike | None = None,
    progress: bool = True,
    semantics: str | None = None,
    speed_context: int | None = None,
) -> EvaluationReport:
    """Compare a quantized-cache model with its baseline; see the module docstring.

    ``semantics`` is the kernel rule the candidate follows on CPU (``cuda`` or ``cpu``;
    see :class:`KvCacheRunner`); by default the rule of the provider the candidate targets
    (:func:`~onnx_kvcache.capabilities.table.infer_target`: fp8, genai config, fp16/bf16 -> cuda).
    The baseline runs under the same rule. KL and top-1 are scored on the decode steps after
    each prompt (every one reads the quantized cache back); the prompts' own positions are
    reported apart. The report states which rule produced it. A progress bar (tqdm) shows on
    a terminal unless ``progress=False``.

    ``seq_len`` and ``max_new_tokens`` left out are :data:`DEFAULT_SEQ_LEN` and
    :data:`DEFAULT_NEW_TOKENS`, each shortened to what the candidate's context holds. Both
    models' prefill of ``speed_context`` tokens and decode after it are timed, and their caches'
    bytes there given (:mod:`~onnx_kvcache.runtime._speed`; 0: not timed).
    """
    require_flags(progress=progress)
    asked = (
        DEFAULT_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
        DEFAULT_SEQ_LEN if seq_len is None else seq_len,
    )
    scoring = _Scoring(asked[0], prompt_len, asked[1], num_seqs, tokenizer, progress)
    _check(scoring, speed_context)
    base, cand = _runners(baseline, candidate, providers, semantics)
    scoring = _fitted_defaults(scoring, _context(base, cand), seq_len is None, max_new_tokens is None)
    loaded = _bounded_windows(baseline, data, (base, cand), scoring)
    report = _scored(base, cand, loaded, scoring).report(base, cand, loaded)
    report.speed = measure_speed((base, cand), speed_context, _context(base, cand))
    return report


def _scored(base: KvCacheRunner, cand: KvCacheRunner, loaded: TokenWindows, scoring: _Scoring) -> _Tally:
    """Every window's prompt and decode steps scored, with a progress bar."""
    tally = _Tally()
    bar = _progress(loaded.windows, scoring)
    try:
        for group, prompt, limits in _groups(loaded.windows, scoring, base, cand):
            tally.score(base, cand, group, prompt, limits, scoring.max_new_tokens, bar)
    finally:
        bar.close()
    return tally


@dataclasses.dataclass(frozen=True)
class _Scoring:
    """Which windows are scored and how (:func:`evaluate_kv_cache`'s arguments)."""

    max_new_tokens: int
    prompt_len: int
    seq_len: int
    num_seqs: int | None
    tokenizer: str | os.PathLike | None
    progress: bool

    def prompt(self, window: np.ndarray) -> int:
        """The window's prompt length: ``prompt_len``, at most half the window, at least 1."""
        return min(self.prompt_len, max(1, len(window) // 2))


def _check(scoring: _Scoring, speed_context: int | None = None) -> None:
    require_type(speed_context, (*INTEGER, type(None)), "speed_context", "an integer or None")
    if speed_context is not None and speed_context < 0:
        raise KvCacheError(Param("speed_context", speed_context), " must be >= 0 (0: not timed).")
    max_new_tokens, prompt_len = scoring.max_new_tokens, scoring.prompt_len
    for name, value in dict(
        max_new_tokens=max_new_tokens, prompt_len=prompt_len, seq_len=scoring.seq_len
    ).items():
        require_type(value, INTEGER, name, "an integer")
    require_type(scoring.num_seqs, (*INTEGER, type(None)), "num_seqs", "an integer or None")
    if max_new_tokens < 0 or prompt_len < 1:
        raise KvCacheError(
            f"max_new_tokens must be >= 0 and prompt_len >= 1, got {max_new_tokens} and {prompt_len}."
        )
    for name, value in dict(seq_len=scoring.seq_len, max_new_tokens=max_new_tokens).items():
        if value > MAX_POSITIONS:
            raise KvCacheError(
                Param(name, value),
                f" is more positions than any KV cache model counts: GroupQueryAttention counts them in "
                f"int32 (at most {MAX_POSITIONS}).",
            )


#: Tokens per window and greedy tokens by default, each shortened to the model's context.
DEFAULT_SEQ_LEN = 256
DEFAULT_NEW_TOKENS = 64


def _fitted_defaults(scoring: _Scoring, limit: int | None, seq_len: bool, new_tokens: bool) -> _Scoring:
    """The default ``seq_len`` (a window feeds one position less) and ``max_new_tokens`` (after
    the prompt) shortened to a context of ``limit`` positions; given values are kept, and
    checked against it (:func:`_check_positions`)."""
    if limit is None:
        return scoring
    if seq_len:
        scoring = dataclasses.replace(scoring, seq_len=min(scoring.seq_len, limit + 1))
    if new_tokens:
        prompt = min(scoring.prompt_len, max(1, scoring.seq_len // 2))
        scoring = dataclasses.replace(
            scoring, max_new_tokens=max(0, min(scoring.max_new_tokens, limit - prompt + 1))
        )
    return scoring


#: The most positions a GroupQueryAttention model counts (``seqlens_k`` and
#: ``total_sequence_length`` are int32).
MAX_POSITIONS = 2**31 - 1


def _context(*runners: KvCacheRunner) -> int | None:
    """The positions both models cover (the shorter rotary table), None when neither says."""
    limits = [r.max_positions for r in runners if r.max_positions is not None]
    return min(limits) if limits else None


def _check_positions(scoring: _Scoring, runners: tuple[KvCacheRunner, KvCacheRunner]) -> None:
    """Lengths against the positions the models cover (their rotary tables), before any run: a
    window of ``seq_len`` tokens feeds ``seq_len - 1``; generating after a prompt of ``p``
    feeds ``p + max_new_tokens - 1``."""
    limit = _context(*runners)
    if limit is None:
        return
    prompt = min(scoring.prompt_len, max(1, scoring.seq_len // 2))
    why = f"the model's rotary tables (cos_cache) cover {limit} positions (its context)"
    if scoring.seq_len - 1 > limit:
        raise KvCacheError(
            Param("seq_len", scoring.seq_len),
            f" feeds {scoring.seq_len - 1} positions, but {why}: give at most ",
            Param("seq_len", limit + 1),
            ".",
        )
    if prompt + scoring.max_new_tokens - 1 > limit:
        raise KvCacheError(
            Param("max_new_tokens", scoring.max_new_tokens),
            f" after a prompt of {prompt} token(s) feeds {prompt + scoring.max_new_tokens - 1} positions, "
            f"but {why}: give at most ",
            Param("max_new_tokens", limit - prompt + 1),
            ".",
        )


#: What lowers an evaluation's memory, said when it is refused (runtime/_memory.py).
_FEWER = (*FEWER_WINDOWS, " or fewer greedy tokens (", Param("max_new_tokens", placeholder="N"), ").")

#: Bytes kept per scored position (its KL as float64, its top-1 agreement) and per window and
#: layer (the cache errors, the lists' entries): the report's figures until the last window.
_KEPT_PER_TOKEN, _KEPT_PER_LAYER, _KEPT_PER_WINDOW = 17, 120, 700


def _bounded_windows(
    baseline: ir.Model | str | os.PathLike,
    data: TokenData,
    runners: tuple[KvCacheRunner, KvCacheRunner],
    scoring: _Scoring,
) -> TokenWindows:
    """The windows to score, once the lengths fit the model's positions and the memory the
    run will hold fits the machine: random ids estimated before they are generated, other data
    once read (runtime/_memory.py). Nothing has run yet."""
    _check_positions(scoring, runners)
    model = baseline if not isinstance(baseline, ir.Model) else None
    if data is None and find_tokenizer(model, scoring.tokenizer) is None:  # random ids: generated
        count = scoring.num_seqs or RANDOM_WINDOWS
        _memory(runners, scoring, count, scoring.seq_len, ids=True).check(*_FEWER)
    loaded = _windows(baseline, data, runners[0], scoring)
    longest = max(len(w) for w in loaded.windows)
    _memory(runners, scoring, len(loaded.windows), longest, ids=False).check(*_FEWER)
    return loaded


def _memory(
    runners: tuple[KvCacheRunner, KvCacheRunner], scoring: _Scoring, windows: int, length: int, *, ids: bool
) -> MemoryEstimate:
    """What scoring ``windows`` windows of ``length`` tokens holds (``ids``: their random ids too):
    what is kept per window for the report, and the run of the largest batch that will run (its
    caches, as long as the window or the prompt and its greedy tokens, a call's attention scores
    and logits: :meth:`Limits.parts`, from runtime/_memory.py's estimate)."""
    layers = len({b.layer_id for b in runners[0].bindings})
    kept = windows * (length * _KEPT_PER_TOKEN + layers * _KEPT_PER_LAYER + _KEPT_PER_WINDOW)
    generated = windows * (length * 8 + WINDOW_BYTES) if ids else 0
    parts = [
        (f"random token ids of {windows} windows x {length} tokens", generated),
        (f"the scores kept of {windows} windows", kept),
    ]
    parts += _limits(runners, scoring, length).parts(runners, windows)
    return MemoryEstimate("evaluation", tuple(parts))


def _limits(runners: Sequence[KvCacheRunner], scoring: _Scoring, length: int) -> Limits:
    """The batch and call sizes for windows of ``length`` tokens (runtime/_scoring.py)."""
    prompt = min(scoring.prompt_len, max(1, length // 2))
    positions = max(length, prompt + scoring.max_new_tokens)
    whole = any(call_pattern(r).whole_window for r in runners)
    return Limits.of(runners, length, prompt, positions, whole)


def _runners(
    baseline: ir.Model | str | os.PathLike,
    candidate: ir.Model | str | os.PathLike,
    providers: Sequence[Any] | None,
    semantics: str | None,
) -> tuple[KvCacheRunner, KvCacheRunner]:
    """The baseline's and the candidate's runners, under the candidate's rule; they must
    have the same caches and vocabulary."""
    cand = KvCacheRunner(candidate, providers, semantics=semantics)
    base = KvCacheRunner(baseline, providers, semantics=cand.semantics)  # a quantized baseline: same rule
    for who, runner in (("candidate", cand), ("baseline", base)):
        if not runner.bindings:
            raise KvCacheError(
                f"The {who} has no KV cache (no GroupQueryAttention or PagedAttention node with past and "
                "present inputs): nothing to compare. Give a model with a cache and its conversion."
            )
    if base.quantized:
        warn(
            "The baseline's KV cache is quantized: compare against the original (unquantized) model, "
            "or the figures measure one quantization against another.",
            MeasurementWarning,
        )
    if _layout(base) != _layout(cand) or base.vocab_size != cand.vocab_size:
        raise KvCacheError(
            "Baseline and candidate differ in their KV caches (layers, heads, windows) or vocabulary; "
            "compare a model with its own conversion."
        )
    return base, cand


def _windows(
    baseline: ir.Model | str | os.PathLike, data: TokenData, base: KvCacheRunner, scoring: _Scoring
) -> TokenWindows:
    """The windows to score; at least one must leave a decode step after its prompt."""
    loaded = load_token_windows(
        data,
        model=baseline if not isinstance(baseline, ir.Model) else None,  # its folder's tokenizer
        seq_len=scoring.seq_len,
        num_seqs=scoring.num_seqs,
        tokenizer=scoring.tokenizer,
        vocab_size=base.vocab_size,
        purpose="evaluation",  # without data: held out from calibration's default
    )
    windows, prompt_len = loaded.windows, scoring.prompt_len
    if not any(len(w) - scoring.prompt(w) >= 2 for w in windows):
        raise KvCacheError(
            f"The sequences ({max(len(w) for w in windows)} tokens at most) leave no decode step after "
            f"a prompt of up to {prompt_len}: use longer sequences (",
            Param("seq_len", placeholder="N"),
            ").",
        )
    return loaded


def _positions(window: np.ndarray, scoring: _Scoring) -> int:
    """Teacher-forced positions of a window: all but the last (a one-token window: its prompt)."""
    return max(len(window) - 1, scoring.prompt(window))


def _groups(
    windows: list[np.ndarray], scoring: _Scoring, base: KvCacheRunner, cand: KvCacheRunner
) -> Iterator[tuple[np.ndarray, int, Limits]]:
    """Consecutive windows of one length (and so one prompt) as ``[B, L]`` batches, each as
    large as the memory bounds allow (:class:`~onnx_kvcache.runtime._scoring.Limits`)."""
    for length, same in itertools.groupby(windows, key=len):
        run = list(same)
        limits = _limits((base, cand), scoring, length)
        for start in range(0, len(run), limits.windows):
            yield np.stack(run[start : start + limits.windows]), scoring.prompt(run[0]), limits


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(windows: list[np.ndarray], scoring: _Scoring) -> Any:
    """A tqdm bar of the tokens scored (teacher-forced positions and greedy tokens) and the
    time left, on a terminal."""
    if not (scoring.progress and sys.stderr.isatty()):
        return _NoBar()
    from tqdm import tqdm

    total = sum(_positions(w, scoring) + scoring.max_new_tokens for w in windows)
    return tqdm(total=total, desc="evaluating", unit="token")


@dataclasses.dataclass
class _Tally:
    """What the windows scored so far measured."""

    kls: list[np.ndarray] = dataclasses.field(default_factory=list)
    prompt_kls: list[np.ndarray] = dataclasses.field(default_factory=list)
    nlls: tuple[list[np.ndarray], list[np.ndarray]] = dataclasses.field(default_factory=lambda: ([], []))
    """The baseline's and the candidate's next-token NLL at each decode step scored."""
    agree: list[np.ndarray] = dataclasses.field(default_factory=list)
    errors: dict[int, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    prefixes: list[int] = dataclasses.field(default_factory=list)
    shares: list[float] = dataclasses.field(default_factory=list)
    turned: tuple[dict[int, _Turn], dict[int, _Turn]] | None = None
    """The baseline's and the candidate's rotation per layer, read from their graphs once."""
    prompts: set[int] = dataclasses.field(default_factory=set)
    """The prompt lengths fed (each window's: ``prompt_len``, at most half the window)."""

    def score(
        self,
        base: KvCacheRunner,
        cand: KvCacheRunner,
        group: np.ndarray,
        prompt: int,
        limits: Limits,
        max_new_tokens: int,
        bar: Any,
    ) -> None:
        """Teacher-force the windows ``group`` (``[B, L]``), compare the caches, then generate
        from their prompts."""
        rows, positions = len(group), max(group.shape[1] - 1, prompt)
        self.prompts.add(prompt)
        ids = group[:, :positions]
        kl, agree = np.empty((rows, positions)), np.empty((rows, positions), bool)
        nll = np.full((2, rows, positions), np.nan)
        targets = group[:, 1 : positions + 1]  # position t predicts token t + 1
        done = 0
        streams = (teacher_forced(r, ids, prompt, limits) for r in (base, cand))
        for b_logits, c_logits in aligned(*streams):
            n = b_logits.shape[1]
            kl[:, done : done + n] = kl_divergence(b_logits, c_logits)
            agree[:, done : done + n] = top1_agreement(b_logits, c_logits)
            known = max(0, min(n, targets.shape[1] - done))
            for side, logits in enumerate((b_logits, c_logits)):
                nll[side, :, done : done + known] = token_nll(
                    logits[:, :known], targets[:, done : done + known]
                )
            done += n
            bar.update(rows * n)
        self.prompt_kls.extend(kl[:, :prompt])
        if positions > prompt:
            self.kls.extend(kl[:, prompt:])
            self.agree.extend(agree[:, prompt:])
            for side in (0, 1):
                self.nlls[side].extend(nll[side, :, prompt:])
        self.cache_errors(base, cand)
        if max_new_tokens > 0:
            self.generate(base, cand, group[:, :prompt], max_new_tokens, bar)

    def generate(
        self, base: KvCacheRunner, cand: KvCacheRunner, prompts: np.ndarray, max_new_tokens: int, bar: Any
    ) -> None:
        """Both models decode greedily from ``prompts``, every window at once."""
        rows = len(prompts)
        runs = [greedy(r, prompts, max_new_tokens) for r in (base, cand)]
        made: list[list[list[int]]] = [[], []]
        calls = 0
        for step in itertools.zip_longest(*runs):  # the two models' calls alternate
            made = [old if new is None else new for old, new in zip(made, step)]
            calls += 1
            bar.update(rows)
        bar.update(rows * (max_new_tokens - calls))  # every row stopped early
        for gb, gc in zip(made[0], made[1]):
            prefix, share = greedy_agreement(gb, gc)
            self.prefixes.append(prefix)
            self.shares.append(share)

    def cache_errors(self, base: KvCacheRunner, cand: KvCacheRunner) -> None:
        """Each layer's relative K and V error of the candidate's cache (dequantized; each
        model's rotated cache turned back by ``H^T``, so both stand for the float cache)."""
        per_layer: dict[int, list[list[float]]] = {}
        if self.turned is None:
            self.turned = (_rotations(base), _rotations(cand))
        for bb, cb in zip(base.bindings, cand.bindings):
            ref = _turned_back(
                base.cache_values(bb.layer_id, bb.kind), self.turned[0].get(bb.layer_id), bb.kind
            )
            test = _turned_back(
                cand.cache_values(cb.layer_id, cb.kind), self.turned[1].get(cb.layer_id), cb.kind
            )
            rows = bb.resident_rows(base.length, ref.shape[2])  # the rest is unspecified
            per_layer.setdefault(bb.layer_id, []).append(
                [_relative_error(r[:, :rows], t[:, :rows]) for r, t in zip(ref, test)]  # window by window
            )
        for layer, found in per_layer.items():  # a single (LATENT) cache serves K and V
            self.errors.setdefault(layer, []).extend(zip(found[0], found[-1]))

    def report(self, base: KvCacheRunner, cand: KvCacheRunner, loaded: TokenWindows) -> EvaluationReport:
        kls = self.kls
        positions = max(len(k) for k in kls)
        kl_pos = [float(np.mean([k[i] for k in kls if i < len(k)])) for i in range(positions)]
        all_kl = np.concatenate(kls)
        perplexities = (perplexity(self.nlls[0]), perplexity(self.nlls[1]))
        return EvaluationReport(
            kl_mean=float(all_kl.mean()),
            kl_max=float(all_kl.max()),
            top1_agreement=float(np.concatenate(self.agree).mean()),
            greedy_match_prefix=float(np.mean(self.prefixes)) if self.prefixes else float("nan"),
            greedy_match_share=float(np.mean(self.shares)) if self.shares else float("nan"),
            kl_prompt_mean=float(np.concatenate(self.prompt_kls).mean()),
            perplexity_baseline=perplexities[0],
            perplexity_candidate=perplexities[1],
            perplexity_change_margin=change_margin(self.nlls, perplexities[1] / perplexities[0] - 1.0),
            layer_errors={
                layer: (float(np.mean([e[0] for e in errs])), float(np.mean([e[1] for e in errs])))
                for layer, errs in self.errors.items()
            },
            kl_per_position=kl_pos,
            baseline_bytes_per_token=inspect_kv_cache(base.source_model, exported=True).bytes_per_token,
            candidate_bytes_per_token=_bytes_per_token(cand),
            candidate_format=_format_name(cand),
            candidate_granularity=_granularity(cand),
            emulated=cand.emulated,
            kernel_rule=cand.kernel_rule,
            kernel_rule_reason=cand.semantics_reason,
            data_note=loaded.source,
            num_sequences=len(loaded.windows),
            positions=int(all_kl.size),
            tokens=loaded.tokens,
            prompt_tokens=tuple(sorted(self.prompts)),
            held_out_from_calibration=loaded.held_out,
            calls={
                "candidate": call_pattern(cand).note,
                "baseline": call_pattern(base).note,
                **({"greedy": GREEDY_NOTE} if self.prefixes else {}),
            },
        )


def _rotations(runner: KvCacheRunner) -> dict[int, _Turn]:
    """Each layer's rotation and ``H``: its attention node's, or for caches stored around the
    model's own attention, what the graph turns before them (one for every layer)."""
    if runner.sites:
        return {s.layer_id: (site_rotation(s), site_matrix(s)) for s in runner.sites}
    stored = stored_rotation(runner.source_model)
    return {b.layer_id: stored for b in runner.bindings}


def _turned_back(values: np.ndarray, turn: _Turn | None, kind: str) -> np.ndarray:
    """A cache's values as the float cache they stand for: turned back by ``H^T`` (the model's
    own) where the model rotates that cache (``kind``: key or value)."""
    rotation, matrix = turn if turn is not None else (None, None)
    if rotation is not None and matrix is not None and (rotation.keys if kind == "key" else rotation.values):
        return rotate(values, inverse=True, matrix=matrix)
    return values


def _layout(runner: KvCacheRunner) -> list[tuple]:
    return [(b.layer_id, b.kind, b.kv_num_heads, b.head_size, b.capacity, b.window) for b in runner.bindings]


def _format_name(runner: KvCacheRunner) -> str:
    sites = runner.sites
    if not sites:  # caches the graph's I/O names (static buffers, an export's), if any
        first = runner.bindings[0] if runner.bindings else None
        if first is None or first.format is None:
            return first.dtype.name.lower() if first is not None else "none"
        return f"{first.format.name} (QuantizeLinear/DequantizeLinear)"
    fmt = sites[0].cache_format
    if fmt is None:
        return str(sites[0].cache_dtype.name if sites[0].cache_dtype else "?").lower()
    return f"{fmt.name} {sites[0].granularity}"


def _granularity(runner: KvCacheRunner) -> str | None:
    """The granularity of the runner's quantized cache: its attention node's, else the one the
    scales of caches stored around the model's own attention fit; None for a float cache."""
    if runner.sites:
        return runner.sites[0].granularity
    found = [
        (b.scale.size, b.kv_num_heads, b.head_size)
        for b in runner.bindings
        if b.format is not None and b.scale is not None
    ]
    return granularity_of(found) if found else None


def _bytes_per_token(runner: KvCacheRunner) -> float:
    return inspect_kv_cache(runner.source_model, exported=True).bytes_per_token
