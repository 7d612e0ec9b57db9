"""Measure per-layer KV-cache scales from the model itself.

The unquantized model is prefilled on representative token windows with onnxruntime
and every layer's ``present`` K (after RoPE) and V is read: what the kernel will
quantize. Per channel (``kv_num_heads * head_size``) a threshold is taken by

* ``minmax``: the largest ``|x|`` seen;
* ``percentile``: a high percentile of ``|x|`` (tames rare outliers);
* ``mse``: the clip point minimizing round-trip error (integer formats only);
* ``attention``: the clip point minimizing what attention loses (integer formats only; the
  default for int4): each window's queries are captured with the caches, and every cached
  row's squared round-trip error is weighted by what it costs the layer's attention. A K
  value's error moves the score ``q . k`` of every query that attends to the row, which
  costs in proportion to the attention probability, so K is weighted by
  ``sum_i p_ij * q_i[d]^2`` (``q`` as its RoPE-pair energy, which no rotation changes); a V
  row's error reaches the output in proportion to its probability, and independent errors
  add in square, so V is weighted by ``sum_i p_ij^2``. Rows the model attends to (the first
  token's attention sink) are kept, rows it ignores are clipped. Under the RoPE envelope its
  K search runs on the keys moved to random positions of the rotary table (the envelope
  stays the grid's top): the values RoPE will store, not their worst phase.
* ``attention_search``: ``attention``'s scales, then refined per layer on the layer's true
  attention-output error, kept where held-out windows agree
  (:mod:`onnx_kvcache.calibrate._clip_search`).

Per tensor takes the max over channels; ``scale = max(threshold * margin, tiny) / qmax``.
With ``rope_envelope``, K thresholds are taken on the rotation-invariant pair norm
``sqrt(k[d]^2 + k[d + h/2]^2)`` (adjacent pairs when ``rotary_interleaved=1``), so a
scale still holds at positions longer than the calibration window, where slow RoPE
dimensions will have rotated energy into their partner.

Memory stays bounded: each layer keeps a reservoir sample of token rows of at most
``sample_budget`` values, whatever the number of sequences.
"""

from __future__ import annotations

__all__ = [
    "CALIBRATION_METHODS",
    "DEFAULT_METHODS",
    "CalibrationMethod",
    "CalibrationStats",
    "calibrate_kv_cache",
    "format_calibration_summary",
    "rope_pair_norm",
]

import dataclasses
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import (
    CacheFormat,
    ScaleGranularity,
    get_format,
    get_granularity,
    scale_granularity,
)
from onnx_kvcache.cache.sites import CacheSite, constant_values, find_attention_sites
from onnx_kvcache.calibrate import _clip_search
from onnx_kvcache.calibrate._attention_error import rope as _rope
from onnx_kvcache.errors import (
    INTEGER,
    NUMBER,
    CalibrationDataWarning,
    ClippingWarning,
    KvCacheError,
    Message,
    Param,
    require_type,
    warn,
)
from onnx_kvcache.model_io._inputs import check_input_file
from onnx_kvcache.pipeline.decision import inferred_format
from onnx_kvcache.runtime.runner import KvCacheRunner
from onnx_kvcache.scales.data import TokenData, TokenWindows, find_tokenizer, load_token_windows
from onnx_kvcache.scales.files import KvCacheScales

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CalibrationMethod:
    """How a calibration method takes its thresholds.

    Attributes:
        clip_search: Searches the clip point on the format's integer rounding (integer
            formats only; clips by design).
        attention: Weights each cached row's error by the attention the model pays it
            (captures every layer's queries; see the module docstring).
        exact: Then refines each layer's scales on its true attention-output error, checked
            on held-out windows (:mod:`onnx_kvcache.calibrate._clip_search`).
    """

    name: str
    clip_search: bool = False
    attention: bool = False
    exact: bool = False


CALIBRATION_METHODS = {
    m.name: m
    for m in (
        CalibrationMethod("minmax"),
        CalibrationMethod("percentile"),
        CalibrationMethod("mse", clip_search=True),
        CalibrationMethod("attention", clip_search=True, attention=True),
        CalibrationMethod("attention_search", clip_search=True, attention=True, exact=True),
    )
}
METHODS = tuple(CALIBRATION_METHODS)
#: The method taken when none is named, per format (others: ``minmax``).
DEFAULT_METHODS = {"int4": "attention"}
#: Query positions per window whose attention weighs the rows (evenly spread, the last included).
ATTENTION_QUERIES = 128
#: A minmax/percentile calibration whose scales put more than this share of a layer's values
#: beyond the threshold (margin below 1, a low percentile) warns, once per layer.
CLIP_WARN_FRACTION = 0.01
_TINY = float(np.finfo(np.float32).tiny)
#: Consecutive windows of one length run as one batch of up to this many tokens: larger matrix
#: products cost less a token, and each row's caches are the same bit for bit.
TOKENS_PER_RUN = 1024


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


def rope_pair_norm(
    x: np.ndarray, *, interleaved: bool, rotary_dim: int | None = None, rotary_offset: int = 0
) -> np.ndarray:
    """``|x|`` with each RoPE pair replaced by its norm (last axis = head dim); RoPE covers
    channels ``[rotary_offset, rotary_offset + rotary_dim)`` (PagedAttention's offset RoPE)."""
    x = np.abs(np.asarray(x, np.float32))
    head = x.shape[-1]
    start = min(rotary_offset, head)
    rot = min(rotary_dim or head - start, head - start)
    out = x.copy()
    if interleaved:
        a, b = x[..., start : start + rot : 2], x[..., start + 1 : start + rot : 2]
        norm = np.sqrt(a * a + b * b)
        out[..., start : start + rot : 2] = norm
        out[..., start + 1 : start + rot : 2] = norm
    else:
        half = rot // 2
        a, b = x[..., start : start + half], x[..., start + half : start + 2 * half]
        norm = np.sqrt(a * a + b * b)
        out[..., start : start + half] = norm
        out[..., start + half : start + 2 * half] = norm
    return out


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


@dataclasses.dataclass
class CalibrationStats:
    """Per-layer thresholds, scales and clip fractions of one calibration."""

    layer_id: int
    k_threshold: np.ndarray
    v_threshold: np.ndarray
    k_scale: np.ndarray
    v_scale: np.ndarray
    k_clip: float
    v_clip: float


def _mse_threshold(
    samples: np.ndarray, amax: np.ndarray, fmt: CacheFormat, weights: np.ndarray | None = None
) -> np.ndarray:
    """Per column, the clip point in [0.003, 1] * amax (geometric grid) with least round-trip
    error (weighted by ``weights`` when given).

    ``samples`` are magnitudes: symmetric rounding makes the sign irrelevant. The round
    trip is the format's own (:meth:`CacheFormat.round_trip`).
    """
    best = amax.astype(np.float32).copy()
    best_err = np.full(amax.shape, np.inf, np.float64)
    for frac in np.geomspace(0.003, 1.0, 64):
        clip = np.maximum(amax * frac, _TINY)
        scale = (clip / fmt.qmax).astype(np.float32)
        sq = (fmt.round_trip(samples, scale) - samples) ** 2
        err = sq.mean(axis=0) if weights is None else (sq * weights).sum(axis=0)
        better = err < best_err
        best[better], best_err[better] = clip[better], err[better]
    return best


def _by_scale(values: np.ndarray, row: ScaleGranularity, kv_heads: int) -> np.ndarray:
    """``[N, kv*head]`` values regrouped ``[N * shared, scales]``: one column per scale."""
    n, channels = values.shape
    heads, dims = row.grid(kv_heads, channels // kv_heads)
    grid = values.reshape(n, kv_heads, channels // kv_heads)
    shared = [axis for axis, keep in ((1, row.per_head), (2, row.per_dim)) if not keep]
    kept = [axis for axis in (1, 2) if axis not in shared]
    return np.moveaxis(grid, [0, *shared, *kept], [0, 1, 2]).reshape(-1, heads * dims)


def _thresholds(
    res: _Reservoir, method: str, percentile: float, fmt: CacheFormat, granularity: str, kv_heads: int = 1
) -> np.ndarray:
    """One threshold per scale of ``granularity`` (``[kv_heads, head]`` channels).

    minmax and percentile take the per-channel thresholds' max over the channels a scale
    covers; mse and attention optimize one clip point over all the values a scale covers.
    """
    row = scale_granularity(granularity)
    if CALIBRATION_METHODS[method].clip_search:
        samples = _by_scale(np.abs(res.rows), row, kv_heads)
        weights = None if res.weights is None else _by_scale(res.weights, row, kv_heads)
        return _mse_threshold(samples, _by_scale(res.amax[None], row, kv_heads).max(axis=0), fmt, weights)
    thr = res.amax if method == "minmax" else np.percentile(np.abs(res.rows), percentile, axis=0)
    return _by_scale(np.asarray(thr, np.float32)[None], row, kv_heads).max(axis=0)


def _clip_fraction(res: _Reservoir, scale: np.ndarray, fmt: CacheFormat) -> float:
    """Share of sampled values beyond what the scale can represent (not mere rounding):
    above the top level or below the bottom one by more than half a step (integers), or
    beyond them at all (fp8). int8 stores -128 and int4 -8, one level more than on top.

    A float32 ulp of tolerance: ``threshold / qmax * qmax`` may round just below the
    threshold, which costs nothing when stored.
    """
    if not res.rows.size:
        return 0.0
    half = 0.0 if fmt.is_float else 0.5
    step = _expand(scale, res.channels) * (1 + 2e-7)
    clipped = (res.rows > step * (fmt.qmax_stored + half)) | (res.rows < step * (fmt.qmin_stored - half))
    return float(clipped.mean())


def _expand(scale: np.ndarray, channels: int) -> np.ndarray:
    """Per-scale values broadcast to ``channels`` columns (a scale covers a contiguous block)."""
    return np.repeat(scale, channels // scale.size)


def calibrate_kv_cache(
    model: ir.Model | str | os.PathLike,
    data: TokenData = None,
    *,
    format: str | None = None,
    granularity: str = "per_tensor",
    method: str | None = None,
    percentile: float = 99.99,
    rope_envelope: bool = True,
    rope_positions: int | None = None,
    margin: float = 1.0,
    seq_len: int = 512,
    num_seqs: int | None = None,
    providers: Sequence[Any] | None = None,
    progress: bool = True,
    tokenizer: str | os.PathLike | None = None,
    sample_budget: int = 1 << 20,
    seed: int = 0,
    min_tokens: int = 256,
) -> KvCacheScales:
    """Calibrate K/V scales of every cached layer; see the module docstring.

    Args:
        model: Unquantized model (``ir.Model``, ``.onnx`` file or genai folder).
        method: ``minmax``, ``percentile``, ``mse``, ``attention`` or ``attention_search``
            (module docstring); by default :data:`DEFAULT_METHODS`'s for the format (int4:
            attention), else minmax.
        format: The cache format the scales are for; by default the first its target
            (:func:`~onnx_kvcache.capabilities.table.infer_target`) runs
            (:func:`~onnx_kvcache.capabilities.table.default_format`: fp8 on CUDA, int8 on CPU),
            recorded as ``format_for`` in the metadata.
        data: Token-id sequences, or a token-id/text file; ``None`` uses the built-in
            corpus (tokenized with the model's tokenizer when it has one).
        seq_len: Longer sequences are cut into windows of this length.
        num_seqs: Use at most this many windows.
        rope_positions: Under the envelope, the context the attention methods' K search
            assumes: keys are moved to random positions below it (default: the whole rotary
            table). Contexts no longer than the calibration windows keep slow RoPE pairs near
            their calibrated phase; scales chosen for them clip such pairs further out.
        sample_budget: Values kept per layer and tensor for percentile/mse.
        min_tokens: Fewer calibration tokens are an error (scales from a handful of
            tokens are noise). Random ids (no tokenizer found) warn.

    The scales' metadata records the data source and token count.
    """
    sampling = _Sampling(seq_len, num_seqs, tokenizer, sample_budget, seed, min_tokens, progress)
    asked = _Choice(format, granularity, method, percentile, rope_envelope, margin, rope_positions)
    choice = _checked(asked, sampling, data)
    setup = _setup(model, providers, choice)
    loaded = _token_windows(model, data, setup.runner, sampling)
    sampler = _Sampler.of(setup, choice, sampling)
    tokens = sampler.run(setup.runner, loaded.windows, sampling.progress)
    stats = [
        _refined(_layer_stats(layer, sampler, setup, choice), sampler, setup) for layer in sampler.layers()
    ]
    return _scales(model, setup, choice, _Measured(loaded, tokens, tuple(stats)), sampling)


@dataclasses.dataclass(frozen=True)
class _Choice:
    """How thresholds are taken and made scales (:func:`calibrate_kv_cache`'s arguments)."""

    format: str | None
    granularity: str
    method: str | None
    percentile: float
    rope_envelope: bool
    margin: float
    rope_positions: int | None = None
    """Under the envelope, the context attention's K search assumes (None: the whole table)."""


@dataclasses.dataclass(frozen=True)
class _Sampling:
    """Which token windows are sampled, and how much of them is kept."""

    seq_len: int
    num_seqs: int | None
    tokenizer: str | os.PathLike | None
    sample_budget: int
    seed: int
    min_tokens: int
    progress: bool


@dataclasses.dataclass(frozen=True)
class _Setup:
    """The runner over the model, and the format and method the scales are for."""

    runner: KvCacheRunner
    fmt: CacheFormat
    method: CalibrationMethod
    chosen_for: str | None
    """The target the format was chosen for, when none was named."""


@dataclasses.dataclass(frozen=True)
class _Measured:
    """What the sampled windows gave: their source, tokens and each layer's statistics."""

    loaded: TokenWindows
    tokens: int
    stats: tuple[CalibrationStats, ...]


def _check_types(choice: _Choice, sampling: _Sampling) -> None:
    for name, value in dict(
        seq_len=sampling.seq_len,
        sample_budget=sampling.sample_budget,
        seed=sampling.seed,
        min_tokens=sampling.min_tokens,
    ).items():
        require_type(value, INTEGER, name, "an integer")
    require_type(sampling.num_seqs, (*INTEGER, type(None)), "num_seqs", "an integer or None")
    require_type(choice.rope_positions, (*INTEGER, type(None)), "rope_positions", "an integer or None")
    for arg, number in dict(percentile=choice.percentile, margin=choice.margin).items():
        require_type(number, NUMBER, arg, "a number")
    require_type(choice.method, (str, type(None)), "method", f"a name ({', '.join(METHODS)}) or None")


def _checked(choice: _Choice, sampling: _Sampling, data: TokenData) -> _Choice:
    """The settings checked before any work (types, ranges, the data and tokenizer files), with
    the granularity's name and, for a named format, its default method."""
    _check_types(choice, sampling)
    format, method, percentile, margin = choice.format, choice.method, choice.percentile, choice.margin
    sample_budget, min_tokens = sampling.sample_budget, sampling.min_tokens
    if format is not None:
        get_format(format)  # an unknown name fails before any work
    granularity = get_granularity(choice.granularity)
    if method is not None and method not in METHODS:
        raise KvCacheError(f"Unknown calibration method {method!r}; choose one of {', '.join(METHODS)}.")
    if not 0 < percentile <= 100:
        raise KvCacheError(f"percentile must be in (0, 100], got {percentile}.")
    if not 0 < margin < float("inf"):
        raise KvCacheError(f"margin must be > 0 and finite, got {margin}.")
    if choice.rope_positions is not None and choice.rope_positions < 1:
        raise KvCacheError(
            Param("rope_positions"), f" must be >= 1 (or None: the whole table), got {choice.rope_positions}."
        )
    if sample_budget < 1 or min_tokens < 0:
        raise KvCacheError(
            f"sample_budget must be >= 1 and min_tokens >= 0, got {sample_budget}, {min_tokens}."
        )
    if method is None and format is not None:
        method = DEFAULT_METHODS.get(get_format(format).name, "minmax")
    if isinstance(data, (str, os.PathLike)):  # a FIFO or folder is refused before the model loads
        check_input_file(data, "Data file", missing="does not exist")
    if sampling.tokenizer is not None:
        find_tokenizer(tokenizer=sampling.tokenizer)
    return dataclasses.replace(choice, granularity=granularity, method=method)


def _setup(model: ir.Model | str | os.PathLike, providers: Sequence[Any] | None, choice: _Choice) -> _Setup:
    """The runner (no LM head: only caches are read and, for ``attention``, each layer's
    query), the format (by default the target's) and the method (by default the format's)."""
    method = choice.method
    runner = KvCacheRunner(
        model,
        providers,
        caches_only=True,
        capture_queries=method is not None and CALIBRATION_METHODS[method].attention,
    )
    format, chosen_for = choice.format, None
    if format is None:
        target, why, format = inferred_format(runner.source_model, runner.genai_config, choice.granularity)
        if format is None:
            raise KvCacheError(
                f"The model's target, {target} ({why}), runs no quantized KV cache for it; give the "
                "format of the provider it will run on, e.g. ",
                Param("format", "int8"),
                ".",
            )
        chosen_for = f"{target} (assumed: {why})"
    fmt = get_format(format)
    if method is None:
        method = DEFAULT_METHODS.get(fmt.name, "minmax")
        if CALIBRATION_METHODS[method].attention:  # the queries are needed after all
            runner = KvCacheRunner(model, providers, caches_only=True, capture_queries=True)
    chosen = CALIBRATION_METHODS[method]
    if chosen.clip_search and fmt.is_float:
        raise KvCacheError(
            Param("method", method), " is for integer formats (int8/int4); use minmax or percentile for fp8."
        )
    if any(b.format is not None for b in runner.bindings):
        raise KvCacheError("Calibrate the original model: this one's KV cache is already quantized.")
    if not runner.bindings:
        raise KvCacheError("The model has no GroupQueryAttention or PagedAttention KV cache to calibrate.")
    return _Setup(runner, fmt, chosen, chosen_for)


def _token_windows(
    model: ir.Model | str | os.PathLike, data: TokenData, runner: KvCacheRunner, sampling: _Sampling
) -> TokenWindows:
    """The calibration windows; too few tokens are an error, random ids a warning."""
    loaded = load_token_windows(
        data,
        model=model,
        seq_len=sampling.seq_len,
        num_seqs=sampling.num_seqs,
        tokenizer=sampling.tokenizer,
        vocab_size=runner.vocab_size,
    )
    min_tokens = sampling.min_tokens
    if loaded.tokens < min_tokens:
        raise KvCacheError(
            f"Calibration data has {loaded.tokens} token(s) ({loaded.source}); scales need at least "
            f"{min_tokens}. Give more text or token ids, or knowingly lower ",
            Param("min_tokens", placeholder="N"),
            ".",
        )
    if loaded.random:
        warn(
            Message(
                "No tokenizer found: calibrating on seeded random token ids, whose activations are not "
                "those of real text. Give the model's tokenizer (",
                Param("tokenizer", placeholder="PATH"),
                ": tokenizer.json or its folder; the built-in corpus is then read) or token ids.",
            ),
            CalibrationDataWarning,
        )
    return loaded


@dataclasses.dataclass(frozen=True)
class _Sampler:
    """Each layer's reservoirs of K and V rows, filled window by window."""

    sites: dict[int, CacheSite]
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
    reservoirs: dict[tuple[int, str], _Reservoir] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, setup: _Setup, choice: _Choice, sampling: _Sampling) -> _Sampler:
        sites = {s.layer_id: s for s in find_attention_sites(setup.runner.source_model)}
        attention = setup.method.attention
        rope_tables = {
            layer: _rope_tables(site)
            for layer, site in sites.items()
            if attention and site.int_attr("do_rotary")
        }
        rng, positions = np.random.default_rng(sampling.seed), np.random.default_rng([sampling.seed, 1])
        exact = _Exact(np.random.default_rng([sampling.seed, 2])) if setup.method.exact else None
        return cls(
            sites,
            attention,
            choice.rope_envelope,
            sampling.sample_budget,
            rng,
            positions,
            choice.rope_positions,
            rope_tables,
            exact,
        )

    def layers(self) -> list[int]:
        return sorted({k[0] for k in self.reservoirs})

    def run(self, runner: KvCacheRunner, windows: Sequence[np.ndarray], progress: bool) -> int:
        """Prefill the windows (those of one length together; ``attention`` weighs each with its
        own queries) and sample their caches; the tokens seen."""
        bar = _progress_bar(len(windows)) if progress else None
        tokens = 0
        for run in _runs(windows, 1 if self.attention else TOKENS_PER_RUN):
            length = len(run[0])
            runner.reset(len(run), min_capacity=length)  # window caches keep every row resident
            runner.fill(np.asarray(run, np.int64))
            tokens += length * len(run)
            attention = (
                _attention_weights(runner, self.sites, length, self.rope_tables) if self.attention else {}
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
        site = self.sites[b.layer_id]
        x = x[:, : b.resident_rows(length, x.shape[1])]
        if not np.all(np.isfinite(x)):
            raise KvCacheError(
                f"Layer {b.layer_id} {b.kind} cache holds non-finite values; the model "
                "produced NaN/inf on the calibration data."
            )
        seen = x  # signed; under the envelope, K's pair norms
        rotary = _rotary(site) if b.kind == "key" and self.rope_envelope else None
        if rotary is not None:
            seen = rope_pair_norm(
                x,
                interleaved=rotary[0],
                rotary_dim=rotary[1],
                rotary_offset=site.int_attr("rotary_offset", 0),
            )
        bound = None
        if rotary is not None and (tables := self.rope_tables.get(b.layer_id)) is not None:
            # the search sees K where RoPE may put it (any position); the envelope bounds it
            bound = seen.transpose(1, 0, 2).reshape(seen.shape[1], -1)
            seen = _rotated_anywhere(x, tables, rotary[0], self.positions, self.rope_positions)
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


def _refined(stats: CalibrationStats, sampler: _Sampler, setup: _Setup) -> CalibrationStats:
    """``attention_search``: one layer's stats after the exact refinement (others: as given)."""
    layer, fmt = stats.layer_id, setup.fmt
    exact = sampler.exact
    if exact is None or layer not in exact.samples or (layer, "value") not in sampler.reservoirs:
        return stats
    samples, site = exact.samples[layer], sampler.sites[layer]
    ks, vs = _clip_search.refine(
        samples,
        stats.k_scale,
        stats.v_scale,
        fmt,
        scale=site.float_attr("scale") or 1.0 / np.sqrt(samples[0].q.shape[-1]),
        softcap=site.float_attr("softcap"),
        window=site.int_attr("local_window_size", -1),
        tables=sampler.rope_tables.get(layer),
        interleaved=bool(site.int_attr("rotary_interleaved")),
    )
    kc, vc = (
        _clip_fraction(sampler.reservoirs[layer, kind], s, fmt) for kind, s in (("key", ks), ("value", vs))
    )
    qmax = np.float32(fmt.qmax)
    return CalibrationStats(layer, ks * qmax, vs * qmax, ks, vs, kc, vc)


def _progress_bar(total: int) -> Any:
    """A tqdm bar on a terminal, else None."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="calibrating", unit="seq")


def _layer_stats(layer: int, sampler: _Sampler, setup: _Setup, choice: _Choice) -> CalibrationStats:
    """One layer's thresholds, scales and clip fractions; warns when the settings clip."""
    fmt, method, margin = setup.fmt, setup.method.name, choice.margin
    result = {}
    beyond = 0.0  # share of values beyond the threshold itself: what the settings clip
    for kind in ("key", "value"):
        # a single (LATENT) cache: V is read from the key cache, with the key's scale
        res = sampler.reservoirs.get((layer, kind)) or sampler.reservoirs[(layer, "key")]
        kv_heads = sampler.sites[layer].kv_num_heads
        thr = _thresholds(res, method, choice.percentile, fmt, choice.granularity, kv_heads)
        with np.errstate(over="ignore"):
            scale = (np.maximum(thr * margin, _TINY) / fmt.qmax).astype(np.float32)
        if not np.all(np.isfinite(scale)):
            raise KvCacheError(
                f"Layer {layer} {kind} scales overflow float32 (threshold {thr.max():.3g} x margin "
                f"{margin:g}); use a margin near 1."
            )
        result[kind] = (thr, scale, _clip_fraction(res, scale, fmt))
        if res.rows.size:
            limit = _expand(scale, res.channels) * fmt.qmax * (1 + 2e-7)
            beyond = max(beyond, float((np.abs(res.rows) > limit).mean()))
    if beyond > CLIP_WARN_FRACTION and not setup.method.clip_search:  # those clip by design, where it pays
        warn(
            Message(
                f"The scales clip {beyond:.1%} of layer {layer}'s sampled values beyond their threshold "
                f"(more than {CLIP_WARN_FRACTION:.0%}): check ",
                Param("margin", placeholder=f"{margin:g}"),
                *(
                    (" and ", Param("percentile", placeholder=f"{choice.percentile:g}"))
                    if method == "percentile"
                    else ()
                ),
                "; clipped values lose far more than rounding does.",
            ),
            ClippingWarning,
        )
    (kt, ks, kc), (vt, vs, vc) = result["key"], result["value"]
    return CalibrationStats(layer, kt, vt, ks, vs, kc, vc)


def _scales(
    model: ir.Model | str | os.PathLike,
    setup: _Setup,
    choice: _Choice,
    measured: _Measured,
    sampling: _Sampling,
) -> KvCacheScales:
    """The scales, their metadata recording how they were measured."""
    method, loaded, stats = setup.method.name, measured.loaded, measured.stats
    metadata: dict[str, Any] = {
        "method": method,
        "rope_envelope": choice.rope_envelope,
        **({"rope_positions": choice.rope_positions} if choice.rope_positions is not None else {}),
        "margin": choice.margin,
        "seq_len": sampling.seq_len,
        "num_seqs": len(loaded.windows),
        "tokens": measured.tokens,
        "data": loaded.source,
        # never "model": onnxruntime-genai reads a top-level key named after the model file's
        # stem (model.onnx -> "model") as that file's section of scales
        "calibrated_model": (
            None if isinstance(model, ir.Model) else os.path.basename(os.path.normpath(model))
        ),
        "model_dtype": _model_dtype(setup.runner),
    }
    if method == "percentile":
        metadata["percentile"] = choice.percentile
    if setup.chosen_for is not None:
        metadata["format_for"] = setup.chosen_for  # the format was the target's, not named
    scales = KvCacheScales(
        {s.layer_id: s.k_scale for s in stats},
        {s.layer_id: s.v_scale for s in stats},
        format=setup.fmt.name,
        qmax=setup.fmt.qmax,
        metadata=metadata,
        granularity=choice.granularity,
        stats=stats,
    )
    logger.info(  # the table: format_calibration_summary(scales.stats)
        "Calibrated %d layers on %d tokens (%s).", len(stats), measured.tokens, loaded.source
    )
    return scales


def format_calibration_summary(
    stats: Sequence[CalibrationStats], format: str | None = None, method: str | None = None
) -> str:
    """A table: per layer, K/V thresholds, scales and the fraction of values clipped
    (``format`` and ``method``: the scales'; the integer formats' minmax note is left out
    of an fp8 table and of another method's, whose clipping is its choice).

    A value is clipped when it lies beyond the top or bottom stored level by more than half
    a step (integers) or beyond it at all (fp8), so storing it costs more than rounding.
    Under onnxruntime-genai's convention (``scale = threshold / qmax``, qmax 128 for int8 and
    8 for int4, stored levels -128..127 and -8..7), minmax stores a positive threshold value
    at the top level, as 127/128 (7/8) of itself, and clips the positive values within half
    a step of it: a small clip fraction is expected there (zero where the largest magnitude
    is negative). The last line of the table says so, since the CLI prints only the table.
    """
    names = ("k thresh", "k scale", "k clip", "v thresh", "v scale", "v clip")
    head = f"{'layer':>5}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, (9, 10, 8, 9, 10, 8)))
    lines = [head]
    for s in stats:
        lines.append(
            f"{s.layer_id:>5}  {s.k_threshold.max():9.4g}  {s.k_scale.max():10.4g}  {s.k_clip:8.2e}  "
            f"{s.v_threshold.max():9.4g}  {s.v_scale.max():10.4g}  {s.v_clip:8.2e}"
        )
    lines.append(
        "clip: share of sampled values stored at the top or bottom level with more than rounding "
        "error (thresholds and scales: largest per layer)"
    )
    if (format is None or not get_format(format).is_float) and method in (None, "minmax"):
        lines.append(
            "minmax clips int8/int4 a little: onnxruntime-genai's amax/128 (/8) stores amax as 127/128 (7/8)"
        )
    return "\n".join(lines)


def _pair_energy(q: np.ndarray, interleaved: bool, rotary_dim: int) -> np.ndarray:
    """``q^2`` with each RoPE pair's channels given the pair's mean energy (rotation-invariant)."""
    e = q * q
    half = rotary_dim // 2
    if interleaved:
        m = (e[..., 0:rotary_dim:2] + e[..., 1:rotary_dim:2]) / 2
        e[..., 0:rotary_dim:2], e[..., 1:rotary_dim:2] = m, m
    else:
        m = (e[..., :half] + e[..., half:rotary_dim]) / 2
        e[..., :half], e[..., half:rotary_dim] = m, m
    return e


def _rope_tables(site: CacheSite, length: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """The node's constant cos/sin tables ``[positions, r/2]`` (the first ``length``), or None."""
    tables = []
    for name in ("cos_cache", "sin_cache"):
        value = site.input(name)
        tensor = None if value is None else value.const_value
        if tensor is None:
            values = constant_values(value)  # a Constant node
            if values is None or value is None or value.shape is None or not isinstance(value.shape[-1], int):
                return None
            array = np.asarray(values, np.float32).reshape(-1, value.shape[-1])
        else:
            array = np.asarray(tensor.numpy(), np.float32)
        if array.ndim != 2 or array.shape[0] < (length or 1):
            return None
        tables.append(array[:length])
    return tables[0], tables[1]


def _rotated_anywhere(
    x: np.ndarray,
    tables: tuple[np.ndarray, np.ndarray],
    interleaved: bool,
    rng: np.random.Generator,
    limit: int | None = None,
) -> np.ndarray:
    """``|K|`` ``[kv, S, D]`` (rotated at positions 0..S-1) moved to positions drawn uniformly
    over the rotary table (its first ``limit``): what the cache stores for these keys anywhere
    in the context."""
    cos, sin = tables
    kv, length, _ = x.shape
    pre = _rope(x.transpose(1, 0, 2), cos[:length], -sin[:length], interleaved)  # undo RoPE
    where = rng.integers(0, min(limit or cos.shape[0], cos.shape[0]), size=(length, kv))
    return np.abs(_rope(pre, cos[where], sin[where], interleaved)).transpose(1, 0, 2)


def _attention_weights(
    runner: KvCacheRunner,
    sites: dict[int, CacheSite],
    length: int,
    rope_tables: dict[int, tuple[np.ndarray, np.ndarray] | None],
) -> dict[tuple[int, str], np.ndarray]:
    """Per (layer, kind), the weight of each cached value's squared error in this window.

    The attention probabilities ``p`` of :data:`ATTENTION_QUERIES` query positions over the
    window's rows are recomputed from the captured query (rotated as the node does) and the
    present K (causal, the node's scale, softcap and local window). K: ``sum_i p_ij * e_i[d]``
    with ``e`` the query's RoPE-pair energy; V: ``sum_i p_ij^2``, summed over the query heads
    of each KV head. Layers without a usable query are left out (unweighted).
    """
    out: dict[tuple[int, str], np.ndarray] = {}
    picks = np.unique(np.linspace(0, length - 1, min(length, ATTENTION_QUERIES)).round().astype(np.int64))
    for layer in runner.queries:
        site = sites.get(layer)
        if site is None:
            continue
        q = runner.query(layer)[0][0]  # [S, H, D]
        k = runner.cache_values(layer, "key")[0][:, :length]  # [kv, S, D], after RoPE
        weights = _layer_attention_weights(site, q, k, length, picks, rope_tables.get(layer))
        if weights is not None:
            out[(layer, "key")], out[(layer, "value")] = weights
    return out


def _layer_attention_weights(
    site: CacheSite,
    q: np.ndarray,
    k: np.ndarray,
    length: int,
    picks: np.ndarray,
    tables: tuple[np.ndarray, np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """One layer's K and V weights ``[S, kv*hd]`` (see :func:`_attention_weights`) from its
    query ``[S, H, D]`` and present K ``[kv, S, D]``; None when the query is not usable."""
    kv, heads, head = k.shape[0], q.shape[1], q.shape[2]
    if q.shape[0] != length or heads % kv:
        return None
    interleaved = bool(site.int_attr("rotary_interleaved"))
    rotary_dim = head
    if site.int_attr("do_rotary"):
        if tables is None or tables[0].shape[0] < length:
            return None
        rotary_dim = 2 * tables[0].shape[-1]
        q = _rope(q, tables[0][:length], tables[1][:length], interleaved)
    q = q[picks]  # [n, H, D]
    energy = _pair_energy(q, interleaved, rotary_dim) if site.int_attr("do_rotary") else q * q
    pos = np.arange(length)
    masked = pos[None, :] > picks[:, None]
    window = site.int_attr("local_window_size", -1)
    if window > 0:
        masked |= pos[None, :] <= picks[:, None] - window
    return _kv_head_weights(site, q, k, energy, masked)


def _kv_head_weights(
    site: CacheSite, q: np.ndarray, k: np.ndarray, energy: np.ndarray, masked: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per KV head, the attention ``p`` of its query heads' picked positions over the rows
    (``masked`` ones excluded), made K and V weights ``[S, kv*hd]``."""
    kv, length, head = k.shape[0], masked.shape[1], q.shape[2]
    group = q.shape[1] // kv
    scale = site.float_attr("scale") or 1.0 / np.sqrt(head)
    softcap = site.float_attr("softcap")
    wk = np.empty((length, kv, head), np.float32)
    wv = np.empty((length, kv, head), np.float32)
    for g in range(kv):
        qg = q[:, g * group : (g + 1) * group]  # [n, group, D]
        scores = np.matmul(qg.transpose(1, 0, 2), k[g].T) * np.float32(scale)  # [group, n, S]
        if softcap > 0:
            scores = softcap * np.tanh(scores / softcap)
        scores[:, masked] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)  # [group, n, S]
        wk[:, g] = p.reshape(-1, length).T @ energy[:, g * group : (g + 1) * group].transpose(
            1, 0, 2
        ).reshape(-1, head)
        wv[:, g] = (p * p).sum(axis=(0, 1))[:, None]
    return wk.reshape(length, kv * head), wv.reshape(length, kv * head)


def _rotary(site: Any) -> tuple[bool, int | None] | None:
    """(interleaved, rotary_dim) of the RoPE that K went through, or None.

    GQA's own (``do_rotary=1``), or a RotaryEmbedding feeding its key input through
    Reshape/Transpose and the fusion's token reorder, as fused exports keep it.
    """
    if site.int_attr("do_rotary"):
        return bool(site.int_attr("rotary_interleaved")), _rotary_dim(site)
    value = site.input("key")  # the schema name: every attention op has one
    while value is not None and (node := value.producer()) is not None:
        if node.op_type == "RotaryEmbedding":
            interleaved, dim = node.attributes.get("interleaved"), node.attributes.get("rotary_embedding_dim")
            return bool(interleaved and interleaved.as_int()), (dim.as_int() or None) if dim else None
        if node.op_type not in ("Reshape", "Transpose", "Identity") and not _takes_rows(node):
            return None
        value = node.inputs[0]
    return None


def _takes_rows(node: ir.Node) -> bool:
    """A Gather of whole rows (axis 0 of a 2-D or larger tensor): channels are kept."""
    axis = node.attributes.get("axis")
    data = node.inputs[0] if node.inputs else None
    return (
        node.op_type == "Gather"
        and (axis is None or axis.as_int() == 0)
        and data is not None
        and data.shape is not None
        and len(data.shape) >= 2
    )


def _model_dtype(runner: Any) -> str | None:
    """The model's attention dtype, and how the CPU computed it when it differs."""
    sites = find_attention_sites(runner.source_model)
    dtype = sites[0].query_dtype if sites else None
    if dtype is None:
        return None
    name = dtype.name.lower()
    return f"{name} (computed in float32 on CPU)" if dtype == ir.DataType.BFLOAT16 else name


def _rotary_dim(site: Any) -> int | None:
    cos = site.input("cos_cache")
    if cos is not None and cos.shape is not None and isinstance(cos.shape[-1], int):
        return 2 * cos.shape[-1]
    return None
