"""How much a quantized KV cache changes a model's outputs, measured on CPU.

Both models see the same tokens. Teacher-forced: a prompt is prefilled, the rest of
the window is fed one token a step (the cache is read back every step), and the
next-token distributions of those decode steps are compared (KL divergence, top-1
agreement); the prompt's own positions are reported apart, since CUDA's first prompt
reads its K/V unquantized. Greedy: both generate from the prompt and the tokens are
compared. The candidate's cache is
dequantized with its own scales and compared with the baseline's, layer by layer.
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
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.layout import inspect_kv_cache
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.errors import INTEGER, KvCacheError, MeasurementWarning, Param, require_type, warn
from onnx_kvcache.runtime._memory import FEWER_WINDOWS, WINDOW_BYTES, MemoryEstimate, run_parts
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
    """KL(P || Q) per row of two logit arrays (last axis = vocabulary), in nats."""
    p = np.asarray(p_logits, np.float64)
    q = np.asarray(q_logits, np.float64)
    p = p - p.max(axis=-1, keepdims=True)
    q = q - q.max(axis=-1, keepdims=True)
    log_p = p - np.log(np.exp(p).sum(axis=-1, keepdims=True))
    log_q = q - np.log(np.exp(q).sum(axis=-1, keepdims=True))
    return np.maximum((np.exp(log_p) * (log_p - log_q)).sum(axis=-1), 0.0)


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
    held_out_from_calibration: bool = False
    """The data is evaluation's default, disjoint from calibration's default data (another
    part of the built-in corpus, or random ids of another seed); False for data given, whose
    overlap with the calibration data the caller knows."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; numbers that were not measured (NaN) are null."""
        doc = dataclasses.asdict(self)
        doc["layer_errors"] = {str(k): {"k": v[0], "v": v[1]} for k, v in self.layer_errors.items()}
        return {k: None if isinstance(v, float) and v != v else v for k, v in doc.items()}

    def _data_row(self) -> str:
        """What was scored: the source, windows, tokens, decode steps, and whether it is held
        out from calibration's default data."""
        held_out = ""
        if self.held_out_from_calibration:
            held_out = " (held out: disjoint from calibrate's default data)"
        return (
            f"{self.data_note}{held_out}; {_count(self.num_sequences, 'window')}, "
            f"{_count(self.tokens, 'token')}, {self.positions} decode steps scored"
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
                "greedy match",
                f"{self.greedy_match_share:.2%} of tokens; the first {self.greedy_match_prefix:g} "
                "identical on average"
                if self.greedy_match_share == self.greedy_match_share  # not NaN
                else "not measured (no tokens generated)",
            ),
            ("data", self._data_row()),
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
    :data:`DEFAULT_NEW_TOKENS`, each shortened to what the candidate's context holds.
    """
    asked = (
        DEFAULT_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
        DEFAULT_SEQ_LEN if seq_len is None else seq_len,
    )
    scoring = _Scoring(asked[0], prompt_len, asked[1], num_seqs, tokenizer, progress)
    _check(scoring)
    base, cand = _runners(baseline, candidate, providers, semantics)
    scoring = _fitted_defaults(scoring, cand.max_positions, seq_len is None, max_new_tokens is None)
    loaded = _bounded_windows(baseline, data, (base, cand), scoring)
    tally = _Tally()
    for window in _progress(loaded.windows, scoring.progress):
        tally.score(base, cand, window, scoring)
    return tally.report(base, cand, loaded)


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


def _check(scoring: _Scoring) -> None:
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


def _check_positions(scoring: _Scoring, runner: KvCacheRunner) -> None:
    """Lengths against the positions the model covers (its rotary table), before any run: a
    window of ``seq_len`` tokens feeds ``seq_len - 1``; generating after a prompt of ``p``
    feeds ``p + max_new_tokens - 1``."""
    limit = runner.max_positions
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
    _check_positions(scoring, runners[1])
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
    what is kept per window for the report, and each model's run of one window (its caches, as
    long as the window or the prompt and its greedy tokens, the prompt's attention scores, the
    logits of its decode steps); runtime/_memory.py."""
    layers = len({b.layer_id for b in runners[0].bindings})
    kept = windows * (length * _KEPT_PER_TOKEN + layers * _KEPT_PER_LAYER + _KEPT_PER_WINDOW)
    generated = windows * (length * 8 + WINDOW_BYTES) if ids else 0
    parts = [
        (f"random token ids of {windows} windows x {length} tokens", generated),
        (f"the scores kept of {windows} windows", kept),
    ]
    prompt = min(scoring.prompt_len, max(1, length // 2))
    positions = max(length, prompt + scoring.max_new_tokens)
    queries = -(-prompt * prompt // positions)  # the prompt's scores (p x p), else a step's (1 x T)
    for name, runner in zip(("baseline", "candidate"), runners):
        parts += [
            (f"{name}: {what}", size)
            for what, size in run_parts(runner, 1, positions, queries=queries, logits=False)
        ]
        logits = length * (runner.vocab_size or 0) * 4
        parts.append((f"{name}: {length} tokens' logits", logits))
    return MemoryEstimate("evaluation", tuple(parts))


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
    if any(b.format is not None for b in base.bindings):
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


def _progress(windows: list[np.ndarray], progress: bool) -> Any:
    """The windows, through a tqdm bar on a terminal."""
    if not (progress and sys.stderr.isatty()):
        return windows
    from tqdm import tqdm

    return tqdm(windows, desc="evaluating", unit="seq")


@dataclasses.dataclass
class _Tally:
    """What the windows scored so far measured."""

    kls: list[np.ndarray] = dataclasses.field(default_factory=list)
    prompt_kls: list[np.ndarray] = dataclasses.field(default_factory=list)
    agree: list[np.ndarray] = dataclasses.field(default_factory=list)
    errors: dict[int, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    prefixes: list[int] = dataclasses.field(default_factory=list)
    shares: list[float] = dataclasses.field(default_factory=list)

    def score(self, base: KvCacheRunner, cand: KvCacheRunner, window: np.ndarray, scoring: _Scoring) -> None:
        """Prefill the prompt, teacher-force the rest, compare the caches, then generate."""
        p = scoring.prompt(window)
        prompt, rest = window[:p], window[p:]
        self.prompt_kls.append(kl_divergence(base.prefill(prompt)[0], cand.prefill(prompt)[0]))
        seq_b, seq_c = [], []
        for token in rest[:-1]:
            seq_b.append(base.step(int(token))[0])
            seq_c.append(cand.step(int(token))[0])
        if seq_b:
            b_logits, c_logits = np.stack(seq_b), np.stack(seq_c)
            self.kls.append(kl_divergence(b_logits, c_logits))
            self.agree.append(top1_agreement(b_logits, c_logits))
        self.cache_errors(base, cand)
        if scoring.max_new_tokens > 0:
            gb = base.generate(prompt.tolist(), scoring.max_new_tokens)
            gc = cand.generate(prompt.tolist(), scoring.max_new_tokens)
            prefix, share = greedy_agreement(gb, gc)
            self.prefixes.append(prefix)
            self.shares.append(share)

    def cache_errors(self, base: KvCacheRunner, cand: KvCacheRunner) -> None:
        """Each layer's relative K and V error of the candidate's cache (dequantized)."""
        per_layer: dict[int, list[float]] = {}
        for bb, cb in zip(base.bindings, cand.bindings):
            ref = base.cache_values(bb.layer_id, bb.kind)
            test = cand.cache_values(cb.layer_id, cb.kind)
            rows = bb.resident_rows(base.length, ref.shape[2])  # the rest is unspecified
            per_layer.setdefault(bb.layer_id, []).append(_relative_error(ref[:, :, :rows], test[:, :, :rows]))
        for layer, found in per_layer.items():  # a single (LATENT) cache serves K and V
            self.errors.setdefault(layer, []).append((found[0], found[-1]))

    def report(self, base: KvCacheRunner, cand: KvCacheRunner, loaded: TokenWindows) -> EvaluationReport:
        kls = self.kls
        positions = max(len(k) for k in kls)
        kl_pos = [float(np.mean([k[i] for k in kls if i < len(k)])) for i in range(positions)]
        all_kl = np.concatenate(kls)
        return EvaluationReport(
            kl_mean=float(all_kl.mean()),
            kl_max=float(all_kl.max()),
            top1_agreement=float(np.concatenate(self.agree).mean()),
            greedy_match_prefix=float(np.mean(self.prefixes)) if self.prefixes else float("nan"),
            greedy_match_share=float(np.mean(self.shares)) if self.shares else float("nan"),
            kl_prompt_mean=float(np.concatenate(self.prompt_kls).mean()),
            layer_errors={
                layer: (float(np.mean([e[0] for e in errs])), float(np.mean([e[1] for e in errs])))
                for layer, errs in self.errors.items()
            },
            kl_per_position=kl_pos,
            baseline_bytes_per_token=inspect_kv_cache(base.source_model).bytes_per_token,
            candidate_bytes_per_token=_bytes_per_token(cand),
            candidate_format=_format_name(cand),
            emulated=cand.emulated,
            kernel_rule=cand.kernel_rule,
            kernel_rule_reason=cand.semantics_reason,
            data_note=loaded.source,
            num_sequences=len(loaded.windows),
            positions=int(all_kl.size),
            tokens=loaded.tokens,
            held_out_from_calibration=loaded.held_out,
        )


def _layout(runner: KvCacheRunner) -> list[tuple]:
    return [(b.layer_id, b.kind, b.kv_num_heads, b.head_size, b.capacity, b.window) for b in runner.bindings]


def _format_name(runner: KvCacheRunner) -> str:
    sites = find_attention_sites(runner.source_model)
    if not sites:
        return "none"
    fmt = sites[0].cache_format
    if fmt is None:
        return str(sites[0].cache_dtype.name if sites[0].cache_dtype else "?").lower()
    return f"{fmt.name} {sites[0].granularity}"


def _bytes_per_token(runner: KvCacheRunner) -> float:
    return inspect_kv_cache(runner.source_model).bytes_per_token
