"""Measure per-layer KV-cache scales from the model itself.

The unquantized model is prefilled on representative token windows with onnxruntime
and every layer's ``present`` K (after RoPE) and V is read: what the kernel will
quantize. Per channel (``kv_num_heads * head_size``) a threshold is taken by

* ``minmax``: the largest ``|x|`` seen;
* ``percentile``: a high percentile of ``|x|`` (tames rare outliers);
* ``mse``: the clip point minimizing round-trip error (integer formats only).

Per tensor takes the max over channels; ``scale = max(threshold * margin, tiny) / qmax``.
With ``rope_envelope``, K thresholds are taken on the rotation-invariant pair norm
``sqrt(k[d]^2 + k[d + h/2]^2)`` (adjacent pairs when ``rotary_interleaved=1``), so a
scale still holds at positions longer than the calibration window, where slow RoPE
dimensions will have rotated energy into their partner.

Memory stays bounded: each layer keeps a reservoir sample of token rows of at most
``sample_budget`` values, whatever the number of sequences.
"""

from __future__ import annotations

__all__ = ["CalibrationStats", "calibrate_kv_cache", "format_calibration_summary", "rope_pair_norm"]

import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.capabilities import default_format, infer_target
from onnx_kvcache.data import TokenData, load_token_windows
from onnx_kvcache.errors import INTEGER, NUMBER, KvCacheError, require_type, warn
from onnx_kvcache.formats import CacheFormat, ScaleGranularity, get_format, get_granularity, scale_granularity
from onnx_kvcache.gqa import find_attention_sites
from onnx_kvcache.runner import KvCacheRunner
from onnx_kvcache.scales import KvCacheScales

logger = logging.getLogger(__name__)

METHODS = ("minmax", "percentile", "mse")
#: A minmax/percentile calibration whose scales put more than this share of a layer's values
#: beyond the threshold (margin below 1, a low percentile) warns, once per layer.
CLIP_WARN_FRACTION = 0.01
_TINY = float(np.finfo(np.float32).tiny)


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

    def __post_init__(self) -> None:
        self.rows = np.empty((0, self.channels), np.float32)
        self.amax = np.zeros(self.channels, np.float32)

    def add(self, rows: np.ndarray) -> None:
        self.amax = np.maximum(self.amax, np.abs(rows).max(axis=0))
        n = rows.shape[0]
        free = self.capacity - self.rows.shape[0]
        if free > 0:
            self.rows = np.concatenate([self.rows, rows[:free]])
        for i in range(max(free, 0), n):
            j = int(self.rng.integers(0, self.seen + i + 1))
            if j < self.capacity:
                self.rows[j] = rows[i]
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


def _mse_threshold(samples: np.ndarray, amax: np.ndarray, fmt: CacheFormat) -> np.ndarray:
    """Per column, the clip point in [0.003, 1] * amax (geometric grid) with least round-trip error.

    ``samples`` are magnitudes: symmetric rounding makes the sign irrelevant. The round
    trip is the format's own (:meth:`CacheFormat.round_trip`).
    """
    best = amax.astype(np.float32).copy()
    best_err = np.full(amax.shape, np.inf, np.float64)
    for frac in np.geomspace(0.003, 1.0, 64):
        clip = np.maximum(amax * frac, _TINY)
        scale = (clip / fmt.qmax).astype(np.float32)
        err = ((fmt.round_trip(samples, scale) - samples) ** 2).mean(axis=0)
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
    covers; mse optimizes one clip point over all the values a scale covers.
    """
    row = scale_granularity(granularity)
    if method == "mse":
        samples = _by_scale(np.abs(res.rows), row, kv_heads)
        return _mse_threshold(samples, _by_scale(res.amax[None], row, kv_heads).max(axis=0), fmt)
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
    method: str = "minmax",
    percentile: float = 99.99,
    rope_envelope: bool = True,
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
        format: The cache format the scales are for; by default the first its target
            (:func:`~onnx_kvcache.capabilities.infer_target`) runs
            (:func:`~onnx_kvcache.capabilities.default_format`: fp8 on CUDA, int8 on CPU),
            recorded as ``format_for`` in the metadata.
        data: Token-id sequences, or a token-id/text file; ``None`` uses the built-in
            corpus (tokenized with the model's tokenizer when it has one).
        seq_len: Longer sequences are cut into windows of this length.
        num_seqs: Use at most this many windows.
        sample_budget: Values kept per layer and tensor for percentile/mse.
        min_tokens: Fewer calibration tokens are an error (scales from a handful of
            tokens are noise). Random ids (no tokenizer found) warn.

    The scales' metadata records the data source and token count.
    """
    for name, value in dict(
        seq_len=seq_len, sample_budget=sample_budget, seed=seed, min_tokens=min_tokens
    ).items():
        require_type(value, INTEGER, name, "an integer")
    require_type(num_seqs, (*INTEGER, type(None)), "num_seqs", "an integer or None")
    for arg, number in dict(percentile=percentile, margin=margin).items():
        require_type(number, NUMBER, arg, "a number")
    require_type(method, str, "method", f"a name ({', '.join(METHODS)})")
    if format is not None:
        get_format(format)  # an unknown name fails before any work
    granularity = get_granularity(granularity)
    if method not in METHODS:
        raise KvCacheError(f"Unknown calibration method {method!r}; choose one of {', '.join(METHODS)}.")
    if not 0 < percentile <= 100:
        raise KvCacheError(f"percentile must be in (0, 100], got {percentile}.")
    if not margin > 0:
        raise KvCacheError(f"margin must be > 0, got {margin}.")
    if sample_budget < 1 or min_tokens < 0:
        raise KvCacheError(
            f"sample_budget must be >= 1 and min_tokens >= 0, got {sample_budget}, {min_tokens}."
        )
    runner = KvCacheRunner(model, providers)
    chosen_for = None
    if format is None:
        target, why = infer_target(runner.source_model, runner.genai_config)
        format = default_format(runner.source_model, target, granularity)
        if format is None:
            raise KvCacheError(
                f"The model's target, {target} ({why}), runs no quantized KV cache for it; give the "
                "format of the provider it will run on, e.g. format='int8'."
            )
        chosen_for = f"{target} (assumed: {why})"
    fmt = get_format(format)
    if method == "mse" and fmt.is_float:
        raise KvCacheError(
            "method='mse' is for integer formats (int8/int4); use minmax or percentile for fp8."
        )
    if any(b.format is not None for b in runner.bindings):
        raise KvCacheError("Calibrate the original model: this one's KV cache is already quantized.")
    if not runner.bindings:
        raise KvCacheError("The model has no GroupQueryAttention or PagedAttention KV cache to calibrate.")
    loaded = load_token_windows(
        data,
        model=model,
        seq_len=seq_len,
        num_seqs=num_seqs,
        tokenizer=tokenizer,
        vocab_size=_vocab_size(runner),
    )
    if loaded.tokens < min_tokens:
        raise KvCacheError(
            f"Calibration data has {loaded.tokens} token(s) ({loaded.source}); scales need at least "
            f"{min_tokens}. Give more text or token ids, or knowingly lower min_tokens=N."
        )
    if loaded.random:
        warn(
            "No tokenizer found: calibrating on seeded random token ids, whose activations are not "
            "those of real text. Give text and its tokenizer, or token ids."
        )
    windows = loaded.windows
    sites = {s.layer_id: s for s in find_attention_sites(runner.source_model)}
    rng = np.random.default_rng(seed)
    reservoirs: dict[tuple[int, str], _Reservoir] = {}
    iterator: Any = windows
    if progress and sys.stderr.isatty():
        from tqdm import tqdm

        iterator = tqdm(windows, desc="calibrating", unit="seq")
    tokens = 0
    for window in iterator:
        runner.reset(1, min_capacity=len(window))  # window caches keep every row resident
        runner.forward(np.asarray(window, np.int64)[None, :])
        tokens += len(window)
        for b in runner.bindings:
            site = sites[b.layer_id]
            x = runner.cache_values(b.layer_id, b.kind)[0]  # [kv, S, hd]
            x = x[:, : b.resident_rows(len(window), x.shape[1])]
            if not np.all(np.isfinite(x)):
                raise KvCacheError(
                    f"Layer {b.layer_id} {b.kind} cache holds non-finite values; the model "
                    "produced NaN/inf on the calibration data."
                )
            seen = x  # signed; under the envelope, K's pair norms
            rotary = _rotary(site) if b.kind == "key" and rope_envelope else None
            if rotary is not None:
                seen = rope_pair_norm(
                    x,
                    interleaved=rotary[0],
                    rotary_dim=rotary[1],
                    rotary_offset=site.int_attr("rotary_offset", 0),
                )
            rows = seen.transpose(1, 0, 2).reshape(seen.shape[1], -1)  # [S, kv*hd]
            key = (b.layer_id, b.kind)
            if key not in reservoirs:
                reservoirs[key] = _Reservoir(rows.shape[1], max(1, sample_budget // rows.shape[1]), rng)
            reservoirs[key].add(rows)
    stats = []
    for layer in sorted({k[0] for k in reservoirs}):
        result = {}
        beyond = 0.0  # share of values beyond the threshold itself: what the settings clip
        for kind in ("key", "value"):
            # a single (LATENT) cache: V is read from the key cache, with the key's scale
            res = reservoirs.get((layer, kind)) or reservoirs[(layer, "key")]
            thr = _thresholds(res, method, percentile, fmt, granularity, sites[layer].kv_num_heads)
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
        if beyond > CLIP_WARN_FRACTION and method != "mse":  # mse clips by design, where it pays
            warn(
                f"The scales clip {beyond:.1%} of layer {layer}'s sampled values beyond their threshold "
                f"(more than {CLIP_WARN_FRACTION:.0%}): check margin={margin:g}"
                + (f" and percentile={percentile:g}" if method == "percentile" else "")
                + "; clipped values lose far more than rounding does."
            )
        (kt, ks, kc), (vt, vs, vc) = result["key"], result["value"]
        stats.append(CalibrationStats(layer, kt, vt, ks, vs, kc, vc))
    metadata = {
        "method": method,
        "rope_envelope": rope_envelope,
        "margin": margin,
        "seq_len": seq_len,
        "num_seqs": len(windows),
        "tokens": tokens,
        "data": loaded.source,
        # never "model": onnxruntime-genai reads a top-level key named after the model file's
        # stem (model.onnx -> "model") as that file's section of scales
        "calibrated_model": (
            None if isinstance(model, ir.Model) else os.path.basename(os.path.normpath(model))
        ),
        "model_dtype": _model_dtype(runner),
    }
    if method == "percentile":
        metadata["percentile"] = percentile
    if chosen_for is not None:
        metadata["format_for"] = chosen_for  # the format was the target's, not named
    scales = KvCacheScales(
        {s.layer_id: s.k_scale for s in stats},
        {s.layer_id: s.v_scale for s in stats},
        format=fmt.name,
        qmax=fmt.qmax,
        metadata=metadata,
        granularity=granularity,
        stats=tuple(stats),
    )
    logger.info(  # the table: format_calibration_summary(scales.stats)
        "Calibrated %d layers on %d tokens (%s).", len(stats), tokens, loaded.source
    )
    return scales


def format_calibration_summary(stats: Sequence[CalibrationStats], format: str | None = None) -> str:
    """A table: per layer, K/V thresholds, scales and the fraction of values clipped
    (``format``: the scales'; an fp8 table leaves out the integer formats' note).

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
    if format is None or not get_format(format).is_float:
        lines.append(
            "minmax clips int8/int4 a little: onnxruntime-genai's amax/128 (/8) stores amax as 127/128 (7/8)"
        )
    return "\n".join(lines)


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


def _vocab_size(runner: Any) -> int | None:
    for value in runner.model.graph.outputs:
        if value.name == runner.logits_name and value.shape is not None:
            last = value.shape[-1]
            return last if isinstance(last, int) else None
    return None
