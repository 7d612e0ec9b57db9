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
    "default_method",
    "CalibrationMethod",
    "CalibrationStats",
    "calibrate_kv_cache",
    "format_calibration_summary",
    "rope_pair_norm",
]
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat, get_format, get_granularity
from onnx_kvcache.cache.rotation import (
    DEFAULT_MATRIX,
    Rotation,
    default_rotation,
    get_rotation,
    rotatable,
    site_rotation,
    stored_rotation,
)
from onnx_kvcache.cache.sites import find_attention_sites

# The steps live in the modules below; the names tests, benchmarks and the CLI import from here
# stay importable from here (marked F401). KvCacheRunner and TOKENS_PER_RUN are read here,
# where tests and benchmarks patch them.
from onnx_kvcache.calibrate._attention_error import rope as _rope  # noqa: F401
from onnx_kvcache.calibrate._attention_weights import ATTENTION_QUERIES
from onnx_kvcache.calibrate._methods import (
    CALIBRATION_METHODS,
    DEFAULT_METHODS,
    METHODS,
    CalibrationMethod,
    _thresholds,  # noqa: F401
    default_method,
)
from onnx_kvcache.calibrate._reservoir import _Reservoir  # noqa: F401
from onnx_kvcache.calibrate._rope_envelope import (
    _rope_tables,  # noqa: F401
    _rotated_anywhere,  # noqa: F401
    rope_pair_norm,
)
from onnx_kvcache.calibrate._sampler import _runs, _Sampler  # noqa: F401
from onnx_kvcache.calibrate._settings import _Choice, _Sampling, _Setup
from onnx_kvcache.calibrate._stats import (
    CLIP_WARN_FRACTION,  # noqa: F401
    CalibrationStats,
    _layer_stats,
    _refined,
    format_calibration_summary,
)
from onnx_kvcache.errors import (
    INTEGER,
    NUMBER,
    CalibrationDataWarning,
    KvCacheError,
    Message,
    Param,
    require_flags,
    require_type,
    warn,
)
from onnx_kvcache.model_io import check_input_file
from onnx_kvcache.pipeline.decision import inferred_format
from onnx_kvcache.runtime import FEWER_WINDOWS, WINDOW_BYTES, MemoryEstimate, run_parts
from onnx_kvcache.runtime.evaluation import MAX_POSITIONS
from onnx_kvcache.runtime.runner import KvCacheRunner
from onnx_kvcache.scales.data import (
    RANDOM_WINDOWS,
    TokenData,
    TokenWindows,
    find_tokenizer,
    load_token_windows,
)
from onnx_kvcache.scales.files import KvCacheScales

logger = logging.getLogger(__name__)

#: Window length by default, shortened to the model's context (its rotary tables) when that is less.
DEFAULT_SEQ_LEN = 512

#: Consecutive windows of one length run as one batch of up to this many tokens: larger matrix
#: products cost less a token, and each row's caches are the same bit for bit.
TOKENS_PER_RUN = 1024


def calibrate_kv_cache(
    model: ir.Model | str | os.PathLike,
    data: TokenData = None,
    *,
    format: str | None = None,
    granularity: str | None = "per_tensor",
    method: str | None = None,
    percentile: float = 99.99,
    rope_envelope: bool = True,
    rope_positions: int | None = None,
    rotation: str | None = None,
    margin: float = 1.0,
    seq_len: int | None = None,
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
            (module docstring); by default :data:`DEFAULT_METHODS`'s for the format and rotation
            (int4: ``mse`` rotated, ``attention`` unrotated), else minmax.
        format: The cache format the scales are for; by default the first its target
            (:func:`~onnx_kvcache.capabilities.table.infer_target`) runs
            (:func:`~onnx_kvcache.capabilities.table.default_format`: fp8 on CUDA, int8 on CPU),
            recorded as ``format_for`` in the metadata.
        data: Token-id sequences, or a token-id/text file; ``None`` uses the built-in
            corpus (tokenized with the model's tokenizer when it has one).
        seq_len: Longer sequences are cut into windows of this length (default:
            :data:`DEFAULT_SEQ_LEN`, or the model's context when shorter).
        num_seqs: Use at most this many windows.
        granularity: ``per_tensor`` (default; ``None`` too, as the other entry points take it)
            or ``per_channel``.
        rope_positions: Under the envelope, the context a rotated cache's K samples (any
            method) and the attention methods' K search assume: keys are moved to random
            positions below it (default: the whole rotary table). Contexts no longer than the
            calibration windows keep slow RoPE pairs near their calibrated phase; scales chosen
            for them clip such pairs further out.
        rotation: The rotated cache the scales are for (:mod:`onnx_kvcache.cache.rotation`):
            ``none``, ``keys`` or ``keys_and_values``; K and V are sampled turned as that cache
            holds them, K moved over the rotary table. By default the format's
            (:data:`~onnx_kvcache.cache.rotation.DEFAULT_ROTATIONS`: int4 ``keys_and_values``)
            where it can be placed (GroupQueryAttention, or caches an ONNX Attention reads:
            :func:`~onnx_kvcache.cache.rotation.rotatable`), ``none`` for other formats and models.
            Recorded as ``rotation`` in the metadata: converting with these scales rotates the cache alike.
        sample_budget: Values kept per layer and tensor for percentile/mse.
        min_tokens: Fewer calibration tokens are an error (scales from a handful of
            tokens are noise). Random ids (no tokenizer found) warn.

    The scales' metadata records the data source and token count.
    """
    given = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    sampling = _Sampling(given, num_seqs, tokenizer, sample_budget, seed, min_tokens, progress)
    granularity = "per_tensor" if granularity is None else granularity
    asked = _Choice(format, granularity, method, percentile, rope_envelope, margin, rope_positions, rotation)
    choice = _checked(asked, sampling, data)
    setup = _setup(model, providers, choice)
    if seq_len is None and setup.runner.max_positions is not None:  # a default fits the model
        sampling = dataclasses.replace(sampling, seq_len=min(given, setup.runner.max_positions))
    loaded = _bounded_windows(model, data, setup, sampling)
    sampler = _Sampler.of(setup, choice, sampling)
    tokens = sampler.run(setup.runner, loaded.windows, sampling.progress, TOKENS_PER_RUN)
    stats = [
        _refined(_layer_stats(layer, sampler, setup, choice), sampler, setup) for layer in sampler.layers()
    ]
    return _scales(model, setup, choice, _Measured(loaded, tokens, tuple(stats)), sampling)


#: What lowers a calibration's memory, said when it is refused (runtime/_memory.py).
_FEWER = (*FEWER_WINDOWS, ".")


def _bounded_windows(
    model: ir.Model | str | os.PathLike, data: TokenData, setup: _Setup, sampling: _Sampling
) -> TokenWindows:
    """The calibration windows, once their length fits the model's positions and the memory
    the run will hold fits the machine: random ids estimated before they are generated, other
    data once read (runtime/_memory.py)."""
    _check_length(setup.runner, sampling.seq_len)
    if data is None and find_tokenizer(model, sampling.tokenizer) is None:  # random ids: generated
        count = sampling.num_seqs or RANDOM_WINDOWS
        _memory(setup, sampling, count, sampling.seq_len, ids=True).check(*_FEWER)
    loaded = _token_windows(model, data, setup.runner, sampling)
    longest = max(len(w) for w in loaded.windows)
    _memory(setup, sampling, len(loaded.windows), longest, ids=False).check(*_FEWER)
    return loaded


def _check_length(runner: KvCacheRunner, seq_len: int) -> None:
    """A window feeds ``seq_len`` positions: at most the model's context (its rotary tables)."""
    limit = runner.max_positions
    if limit is not None and seq_len > limit:
        raise KvCacheError(
            Param("seq_len", seq_len),
            f" feeds {seq_len} positions, but the model's rotary tables (cos_cache) cover {limit} "
            "positions (its context): give at most ",
            Param("seq_len", limit),
            ".",
        )


def _memory(setup: _Setup, sampling: _Sampling, windows: int, length: int, *, ids: bool) -> MemoryEstimate:
    """What calibrating ``windows`` windows of ``length`` tokens holds (``ids``: their random ids
    too): one run's caches, scores and captured queries, the reservoirs, ``attention_search``'s
    samples (runtime/_memory.py)."""
    runner, method = setup.runner, setup.method
    batch = 1 if method.attention else max(1, min(windows, TOKENS_PER_RUN // length))
    heads = {s.layer_id: s.num_heads for s in find_attention_sites(runner.source_model)}
    keys = [b for b in runner.bindings if b.kind == "key"]
    width = {b.layer_id: b.kv_num_heads * b.head_size for b in keys}  # a cache row's values
    generated = windows * (length * 8 + WINDOW_BYTES) if ids else 0
    parts = [(f"random token ids of {windows} windows x {length} tokens", generated)]
    parts += run_parts(runner, batch, length, queries=length, logits=0)
    if method.attention:
        queried = sum(heads.get(b.layer_id, 0) * b.head_size for b in keys)
        parts.append((f"{batch} x {length} tokens' captured queries", batch * length * queried * 4))
    rows = windows * length
    kept = sum(min(sampling.sample_budget, rows * w) for w in width.values()) * 2  # K and V
    parts.append(("the layers' samples", kept * 4 * (2 if method.attention else 1)))
    if method.exact:
        picked = sum(ATTENTION_QUERIES * heads.get(b.layer_id, 0) * b.head_size for b in keys)
        sample = sum(2 * w * length for w in width.values()) + picked
        parts.append((f"attention_search's samples of {windows} windows", windows * sample * 4))
    return MemoryEstimate("calibration", tuple(parts))


@dataclasses.dataclass(frozen=True)
class _Measured:
    """What the sampled windows gave: their source, tokens and each layer's statistics."""

    loaded: TokenWindows
    tokens: int
    stats: tuple[CalibrationStats, ...]


def _check_types(choice: _Choice, sampling: _Sampling) -> None:
    require_flags(rope_envelope=choice.rope_envelope, progress=sampling.progress)
    for name, value in dict(
        seq_len=sampling.seq_len,
        sample_budget=sampling.sample_budget,
        seed=sampling.seed,
        min_tokens=sampling.min_tokens,
    ).items():
        require_type(value, INTEGER, name, "an integer")
    require_type(sampling.num_seqs, (*INTEGER, type(None)), "num_seqs", "an integer or None")
    if sampling.seq_len > MAX_POSITIONS:
        raise KvCacheError(
            Param("seq_len", sampling.seq_len),
            f" is more positions than any KV cache model counts: GroupQueryAttention counts them in "
            f"int32 (at most {MAX_POSITIONS}).",
        )
    require_type(choice.rope_positions, (*INTEGER, type(None)), "rope_positions", "an integer or None")
    for arg, number in dict(percentile=choice.percentile, margin=choice.margin).items():
        require_type(number, NUMBER, arg, "a number")
    require_type(choice.method, (str, type(None)), "method", f"a name ({', '.join(METHODS)}) or None")


def _checked(choice: _Choice, sampling: _Sampling, data: TokenData) -> _Choice:
    """The settings checked before any work (types, ranges, the data and tokenizer files), with
    the granularity's name (the default method waits for the format and rotation: ``_setup``)."""
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
    if choice.rotation is not None:
        get_rotation(choice.rotation)  # an unknown name fails before any work
    if isinstance(data, (str, os.PathLike)):  # a FIFO or folder is refused before the model loads
        check_input_file(data, "Data file", missing="does not exist")
    if sampling.tokenizer is not None:
        find_tokenizer(tokenizer=sampling.tokenizer)
    return dataclasses.replace(choice, granularity=granularity, method=method)


def _setup(model: ir.Model | str | os.PathLike, providers: Sequence[Any] | None, choice: _Choice) -> _Setup:
    """The runner (no LM head: only caches are read and, for ``attention``, each layer's
    query), the format (by default the target's), the rotation (by default the format's) and
    the method (by default the format's for that rotation: :func:`default_method`)."""
    method = choice.method
    if method is None and choice.format is not None and choice.rotation is not None:  # known: one load
        method = default_method(get_format(choice.format).name, get_rotation(choice.rotation).name)
    captured = method is not None and CALIBRATION_METHODS[method].attention
    runner = KvCacheRunner(model, providers, caches_only=True, capture_queries=captured)
    if not runner.bindings:  # before the format: a target's formats mean nothing without a cache
        raise KvCacheError(
            "The model has no KV cache (no GroupQueryAttention or PagedAttention node with past and "
            "present inputs): nothing to calibrate."
        )
    if runner.quantized:
        raise KvCacheError("Calibrate the original model: this one's KV cache is already quantized.")
    fmt, chosen_for = _format(runner, choice)
    rotation = _rotation(runner.source_model, fmt, choice.rotation)
    method = _without_queries(runner, method or default_method(fmt.name, rotation.name), choice.method)
    if CALIBRATION_METHODS[method].attention and not captured:  # the queries are needed after all
        runner = KvCacheRunner(model, providers, caches_only=True, capture_queries=True)
    chosen = CALIBRATION_METHODS[method]
    _check_rope_positions(choice, chosen, rotation)
    _check_rope_table(choice, runner.max_positions)
    if chosen.clip_search and fmt.is_float:
        raise KvCacheError(
            Param("method", method), " is for integer formats (int8/int4); use minmax or percentile for fp8."
        )
    return _Setup(runner, fmt, chosen, chosen_for, rotation)


def _without_queries(runner: KvCacheRunner, method: str, asked: str | None) -> str:
    """``method``, unless it weighs by attention and no attention node of ours reads the caches
    (static buffers, an export's own: no query to weigh with): asked, refused; by default, ``mse``
    (the round trip's error)."""
    if runner.sites or not CALIBRATION_METHODS[method].attention:
        return method
    if asked is not None:
        raise KvCacheError(
            Param("method", asked),
            " weighs by the attention each cached row gets, from GroupQueryAttention's queries; this "
            "model's caches (static buffers or an export's own) have none: use ",
            Param("method", "mse"),
            " or minmax.",
        )
    return "mse"


def _format(runner: KvCacheRunner, choice: _Choice) -> tuple[CacheFormat, str | None]:
    """The format asked, else the first the model's target runs (and what it was chosen for)."""
    if choice.format is not None:
        return get_format(choice.format), None
    target, why, format = inferred_format(runner.source_model, runner.genai_config, choice.granularity)
    if format is None:
        raise KvCacheError(
            f"The model's target, {target} ({why}), runs no quantized KV cache for it; give the "
            "format of the provider it will run on, e.g. ",
            Param("format", "int8"),
            ".",
        )
    return get_format(format), f"{target} (assumed: {why})"


def _check_rope_table(choice: _Choice, table: int | None) -> None:
    """``rope_positions`` past the rotary tables would give the whole table's scales yet record
    the larger context."""
    if choice.rope_positions is not None and table is not None and choice.rope_positions > table:
        raise KvCacheError(
            Param("rope_positions", choice.rope_positions),
            f" is past the model's rotary tables (cos_cache: {table} positions, its context): the scales "
            "would be those of the whole table but record the larger context. Give at most ",
            Param("rope_positions", table),
            ", or drop it (the whole table).",
        )


def _rotation(model: ir.Model, fmt: CacheFormat, asked: str | None) -> Rotation:
    """The rotation the scales are for: the one asked, else the format's default (module docs)."""
    sites = find_attention_sites(model)
    if any(site_rotation(s).rotates for s in sites) or stored_rotation(model)[0].rotates:
        raise KvCacheError(
            "Calibrate the original model: this one's cache is already rotated (the scales record the "
            "rotation they are for, and converting applies it)."
        )
    if asked is None:
        return default_rotation(fmt.name, model)
    rotation = get_rotation(asked)
    if rotation.rotates and not rotatable(model, rotation):
        raise KvCacheError(
            Param("rotation", rotation.name),
            " is for GroupQueryAttention caches and the caches an ONNX Attention reads; this model's "
            "(PagedAttention, multi-head latent attention or attention of plain operators) are "
            "calibrated with ",
            Param("rotation", "none"),
            ".",
        )
    return rotation


def _check_rope_positions(choice: _Choice, method: CalibrationMethod, rotation: Rotation) -> None:
    """``rope_positions`` moves, under the RoPE envelope, the attention methods' K search and a
    rotated cache's K samples (every method's): elsewhere any value gives the same scales, and a
    scale file recording it would warn of a context it never limited."""
    reads = method.attention or rotation.keys
    if choice.rope_positions is None or (reads and choice.rope_envelope):
        return
    if choice.rope_envelope:
        why = Message(Param("method", method.name), " of an unrotated cache never reads it")
        instead = Message("choose an attention method or a rotated cache (", Param("rotation", "keys"), ")")
    else:
        off = Param("rope_envelope", False)
        why, instead = (
            Message("the RoPE envelope is off (", off, ")"),
            Message("keep the envelope (no ", off, ")"),
        )
    raise KvCacheError(
        Param("rope_positions", choice.rope_positions),
        " limits only, under the RoPE envelope, the attention methods' K search (",
        Param("method", "attention"),
        " or attention_search) and a rotated cache's keys, and ",
        why,
        ": the scales would be the same for any value. Drop ",
        Param("rope_positions"),
        ", or ",
        instead,
        ".",
    )


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
        "rotation": setup.rotation.name,
        **({"rotation_matrix": DEFAULT_MATRIX} if setup.rotation.rotates else {}),  # the H it sampled with
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


def _model_dtype(runner: Any) -> str | None:
    """The model's attention dtype, and how the CPU computed it when it differs."""
    sites = find_attention_sites(runner.source_model)
    dtype = sites[0].query_dtype if sites else None
    if dtype is None:
        return None
    name = dtype.name.lower()
    return f"{name} (computed in float32 on CPU)" if dtype == ir.DataType.BFLOAT16 else name
