"""Run a decoder with its KV cache: prefill, decode steps, greedy generation.

:class:`KvCacheRunner` discovers the decoder's I/O (onnxruntime-genai names and common
variants), allocates empty caches of the model's cache dtype and shape (int4 packed,
fp8 as its bits, sliding-window layers window-sized) and feeds each step's present
caches back as the next step's past. A paged decoder (PagedAttention, genai's
``use_paged_attention`` I/O) gets a block pool instead (:mod:`onnx_kvcache.runtime._paged_cache`):
its sequences are packed into one token list, with block tables, cumulative and past
lengths and ``attention_metadata`` fed every call.

On the CPU provider, what the CPU cannot run as asked is prepared first: a bfloat16
model computes in float32, GroupQueryAttention nodes with an fp8 cache, q/k norm
inputs, or a kernel rule (``semantics``) other than the CPU kernel's run through the
emulation (:mod:`onnx_kvcache.passes.kv_cache_emulation`), whose caches hold dequantized
values, and PagedAttention nodes (no CPU kernel) through the CPU reference
(:mod:`onnx_kvcache.passes.paged_attention_reference`). :meth:`KvCacheRunner.present`
gives every cache in its stored format all the same.

A runner built with ``caches_only=True`` runs the graph pruned to the present outputs
(:func:`prune_to_caches`: no LM head, nothing after the last cache), which is all
calibration reads: :meth:`KvCacheRunner.fill` advances the caches, and nothing computes
logits. A session is created from the model's file when the graph it runs is the file's.

The runner delegates to three collaborators: the session (:mod:`onnx_kvcache.runtime._decoder_session`:
which graph runs where, under which rule), and a dense cache
(:mod:`onnx_kvcache.runtime._dense_cache`) or a paged one (:mod:`onnx_kvcache.runtime._paged_cache`),
both a :class:`~onnx_kvcache.runtime._cache.KvCache`.
"""

from __future__ import annotations

__all__ = ["CacheBinding", "KvCacheRunner", "discover_cache_bindings", "prepare_for_cpu", "prune_to_caches"]

import functools
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.io_caches import EXPORTED, STATIC, find_io_caches
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.cache.validation import validate_model
from onnx_kvcache.errors import (
    INTEGER,
    KvCacheError,
    KvCacheTypeError,
    PaddingAssumptionWarning,
    Param,
    require_type,
)
from onnx_kvcache.files import read_export_config
from onnx_kvcache.model_io import host_array, ort_error_text
from onnx_kvcache.model_io.genai_folder import eos_token_ids, pad_token_id, resolve_model_path
from onnx_kvcache.model_io.reading import load_model
from onnx_kvcache.passes.kv_cache_emulation import Semantics
from onnx_kvcache.pipeline.decision import fuse_unless_attention
from onnx_kvcache.runtime._cache import (
    CacheBinding,
    CacheLayout,
    KvCache,
    discover_cache_bindings,
    with_feed_dtypes,
)
from onnx_kvcache.runtime._decoder_session import (
    DecoderSession,
    ModelSource,
    SessionOptions,
    choose_target,
    logits_output,
    max_positions,
    prepare_for_cpu,
    prune_to_caches,
)
from onnx_kvcache.runtime._dense_cache import DenseLayout
from onnx_kvcache.runtime._paged_cache import BlockPool, PagedLayout
from onnx_kvcache.runtime._static_cache import StaticLayout

logger = logging.getLogger(__name__)


def _fused(model: ir.Model, unfused: Callable[[], ir.Model]) -> tuple[ir.Model, bool]:
    """A decoder without attention nodes (a PyTorch export), fused in memory (the file, or
    the caller's model, unchanged), and whether it runs as exported instead.

    The runner feeds unpadded rows, so what a fused padding mask assumes does not apply. An
    export whose attention does not fuse at all but whose caches follow the exported convention
    (:data:`~onnx_kvcache.cache.io_caches.EXPORTED`: multi-head latent attention) runs as exported
    (``unfused()`` gives it back when the fusion changed the graph); one that fuses in part is
    refused in one line, the fusion's reason (as ``convert`` says it), its warnings unsaid: the
    runner needs every cache in GroupQueryAttention.
    """
    fusion = fuse_unless_attention(model)  # its warnings recorded, said below unless refused
    if fusion.refusal is not None:
        original = unfused() if fusion.modified else model
        if not fusion.fused and find_io_caches(original, (EXPORTED,)):
            logger.info("Running the export as it is (its attention does not fuse): %s", fusion.refusal.text)
            return original, True
        raise KvCacheError(f"Cannot run this export: {fusion.refusal.text}")
    for recorded in fusion.recorded:
        if not issubclass(recorded.category, PaddingAssumptionWarning):
            warnings.warn_explicit(recorded.message, recorded.category, recorded.filename, recorded.lineno)
    if fusion.modified:
        model.graph.sort()  # a fused node may land after a reader of its outputs; sessions clone it
        logger.info("Fused the model's attention into GroupQueryAttention (in memory, file unchanged).")
    return model, False


def _source(model: ir.Model, unfused: Callable[[], ir.Model], **where: Any) -> ModelSource:
    """``model`` as the runner runs it: as it is with attention nodes, or with static cache
    buffers (:data:`~onnx_kvcache.cache.io_caches.STATIC`, which no fusion reads), else fused in
    memory (:func:`_fused`, on ``unfused()``'s copy: a caller's model stays as it is). ``where``:
    the file, genai config and folder it came from."""
    if find_attention_sites(model, with_cache_only=False):
        return ModelSource(model, **where)
    if find_io_caches(model, (STATIC,)):
        return ModelSource(model, **where, io_caches=True)
    ran, as_exported = _fused(unfused(), unfused)
    if not as_exported:
        where["file"] = None  # the session runs the fused graph
    return ModelSource(ran, **where, io_caches=as_exported)


def _load(model_or_path: ir.Model | str | os.PathLike) -> ModelSource:
    """The decoder of a model, ``.onnx`` file or genai folder, with its attention fused in
    memory when it has none (the caller's model and the file unchanged)."""
    if isinstance(model_or_path, ir.Model):
        model = model_or_path
        validate_model(model)  # malformed: one line; out of order: sorted (computing the same)
        return _source(model, model.clone)
    path, config = resolve_model_path(model_or_path)
    model = load_model(path)
    validate_model(model)  # the session still reads the file: onnxruntime runs it in any order
    loaded = iter([model])  # the fusion takes the model loaded; a copy asked again is read again
    return _source(
        model, lambda: next(loaded, None) or load_model(path), file=path, config=config, base_dir=path.parent
    )


def _special_tokens(source: ModelSource) -> tuple[frozenset[int], int | None]:
    """End-of-sequence and padding ids: a genai config's, else those of the transformers
    configs beside the model file (optimum's export folder)."""
    if source.config is not None or source.base_dir is None:
        return eos_token_ids(source.config), pad_token_id(source.config)
    export = read_export_config(source.base_dir)
    return (frozenset(export.eos_token_ids), export.pad_token_id) if export else (frozenset(), None)


#: the layout of each kind of cache, by ``CacheBinding.kind_of_cache``
_LAYOUTS: dict[str, type[DenseLayout] | type[PagedLayout] | type[StaticLayout]] = {
    "dense": DenseLayout,
    "paged": PagedLayout,
    "static": StaticLayout,
}


def _layout(bindings: list[CacheBinding], source: ModelSource, block_size: int | None) -> CacheLayout:
    """The layout of the model's caches: dense or paged (a model has one kind)."""
    kinds = {b.kind_of_cache for b in bindings}
    if len(kinds) > 1:
        raise KvCacheError(
            f"The model mixes {' and '.join(sorted(kinds))} KV caches; the runner takes one kind."
        )
    return _LAYOUTS[kinds.pop() if kinds else "dense"].read(bindings, source.model, block_size, source.config)


def _open(
    source: ModelSource, options: SessionOptions, block_size: int | None
) -> tuple[DecoderSession, KvCache]:
    """The session and the caches of ``source``, checked in the runner's order: providers and
    kernel rule, logits output, cache bindings, cache layout, then the session's inputs."""
    target = choose_target(source, options)
    logits = logits_output(source.model)
    found = discover_cache_bindings(source.model, io_caches=source.io_caches)
    bindings = with_feed_dtypes(found, target.model)
    layout = _layout(bindings, source, block_size)
    session = DecoderSession(source, target, logits, bindings, layout.inputs, options)
    return session, layout.cache(bindings, session.feeding)


def _context_limit(source: ModelSource, cache: KvCache) -> int | None:
    """Tokens a context may hold: the rotary tables' length and a static cache's rows, the fewer."""
    limits = [n for n in (max_positions(source.model), cache.capacity) if n is not None]
    return min(limits) if limits else None


class KvCacheRunner:
    """An onnxruntime session wrapper that owns the decoder's KV cache.

    Args:
        model_or_path: ``ir.Model``, ``.onnx`` file or onnxruntime-genai folder. A file
            without GroupQueryAttention (a PyTorch export) has its attention fused in
            memory (docs/exporting.md); the file is not changed.
        providers: onnxruntime providers (CPU by default); one name (a ``str``) is taken as
            the list of that provider alone.
        io_binding: Keep caches as OrtValues on the session's device and bind them
            (default: on for CUDA, where caches then never leave the GPU).
        semantics: On CPU, the kernel rule quantized caches follow: ``cuda`` emulates
            CUDA's (first prompt attended in full precision), ``cpu`` is the CPU kernel's.
            Default: the rule of the provider the model targets (``infer_target``: genai
            config, fp8 cache, fp16/bf16 -> cuda; float32 -> cpu). On CUDA the native
            kernel runs and only ``cuda`` is accepted.
        quantized_io: When emulating, keep the caches in their stored format between
            steps (slower: the whole cache is converted every step).
        block_size: Paged decoders: tokens per block of the pool (a power of two >= 16).
            Default: the model's static block size, else the genai config's
            ``engine.dynamic_batching.block_size``, else 16.
        caches_only: Run the graph pruned to the present outputs (:func:`prune_to_caches`):
            :meth:`fill` advances the caches at about 0.7x the cost of a full forward on a
            small model (the LM head is skipped); the methods that return logits refuse.
            ``logits_name`` and ``vocab_size`` are still the model's. Its onnxruntime threads
            sleep between parallel sections instead of spinning (a few long runs).
        capture_queries: Also fetch every cached GroupQueryAttention node's query input at
            each run (:meth:`query`); the graph outputs are added for the session only.

    A paged decoder packs the batch's rows into one token list each call and keeps a block
    pool per cache: :meth:`present` returns the pool, :meth:`cache_values` each sequence's
    cache in BNSH order, and :meth:`forward_packed` adds a different number of tokens to each
    sequence (continuous batching).
    """

    def __init__(
        self,
        model_or_path: ir.Model | str | os.PathLike,
        providers: Sequence[Any] | None = None,
        *,
        io_binding: bool | None = None,
        semantics: str | None = None,
        quantized_io: bool = False,
        block_size: int | None = None,
        caches_only: bool = False,
        capture_queries: bool = False,
    ) -> None:
        require_type(
            model_or_path, (ir.Model, str, os.PathLike), "model_or_path", "an onnx_ir.Model or a path"
        )
        require_type(providers, (str, Sequence, type(None)), "providers", "a list of provider names")
        options = SessionOptions(providers, io_binding, semantics, quantized_io, caches_only, capture_queries)
        self._source = _load(model_or_path)
        #: End-of-sequence tokens and the padding token (None when none is given): a genai
        #: folder's genai_config.json, else an export's generation_config.json or config.json
        #: (as transformers' ``generate`` reads them).
        self.eos_token_ids, self.pad_token_id = _special_tokens(self._source)
        self._session, self._cache = _open(self._source, options, block_size)
        self.max_positions = _context_limit(self._source, self._cache)
        """Tokens a context may hold (the rotary tables' length, a static cache's rows), or None
        when unknown."""
        self.reset()

    # the model and the session (see DecoderSession)

    @property
    def genai_config(self) -> dict[str, Any] | None:
        """The onnxruntime-genai config of a genai folder, else None."""
        return self._source.config

    @property
    def source_model(self) -> ir.Model:
        """The model as given (before any preparation for CPU)."""
        return self._source.model

    @functools.cached_property
    def sites(self) -> list[CacheSite]:
        """The source model's attention nodes with a cache, found once for every reader."""
        return find_attention_sites(self._source.model)

    @property
    def providers(self) -> list[Any]:
        return self._session.target.providers

    @property
    def semantics(self) -> Semantics:
        """The kernel rule quantized caches follow (``cuda`` or ``cpu``)."""
        return self._session.target.semantics

    @property
    def semantics_reason(self) -> str:
        """Why this kernel rule: ``target cpu: a float32 model``, ``asked for``, ..."""
        return self._session.target.reason

    @property
    def quantized(self) -> bool:
        """Some cache the runner feeds is stored quantized."""
        return any(b.format is not None for b in self.bindings)

    @property
    def prompt_in_float(self) -> bool:
        """Some attention node's multi-token calls attend through the float kernel
        (:mod:`~onnx_kvcache.cache.prompt_path`)."""
        return any(s.wrapper is not None for s in self.sites)

    @property
    def emulated(self) -> bool:
        """The session runs the CPU emulation or reference of the model's attention."""
        return self._session.target.emulated

    @property
    def device(self) -> str:
        return self._session.target.device

    @property
    def logits_name(self) -> str:
        """The model's logits output."""
        return self._session.logits_name

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary size (None when symbolic), the model's."""
        return self._session.vocab_size

    @property
    def caches_only(self) -> bool:
        """The session runs the graph pruned to the caches (no logits)."""
        return self._session.caches_only

    @property
    def model(self) -> ir.Model:
        """The model the session runs (prepared for CPU, pruned to the caches)."""
        return self._session.model

    @property
    def session(self) -> Any:
        """The onnxruntime InferenceSession."""
        return self._session.session

    @property
    def queries(self) -> dict[int, np.ndarray]:
        """Each layer's query input of the last run (with ``capture_queries``)."""
        return self._session.queries

    @property
    def input_names(self) -> list[str]:
        return list(self._session.feeding.input_names)

    @property
    def ids_name(self) -> str:
        return self._session.feeding.ids_name

    @property
    def io_binding(self) -> bool:
        return self._session.feeding.io_binding

    # the caches (see DenseCache, PagedCache)

    @property
    def bindings(self) -> list[CacheBinding]:
        return self._cache.bindings

    @property
    def caches(self) -> dict[str, Any]:
        """Each cache as the session holds it, by past input name."""
        return self._cache.caches

    @property
    def batch(self) -> int:
        return self._cache.batch

    @property
    def length(self) -> int:
        """Tokens of the context (the longest sequence's, for a paged decoder)."""
        return self._cache.length

    @property
    def paged(self) -> bool:
        return self._cache.block_size is not None

    @property
    def block_size(self) -> int | None:
        """Tokens per block of a paged decoder's pool (None for dense caches)."""
        return self._cache.block_size

    @property
    def pool(self) -> BlockPool | None:
        """A paged decoder's block pool (None for dense caches)."""
        return self._cache.pool

    @property
    def cache_dtype(self) -> ir.DataType | None:
        """The stored element type of the first cache (the model's, not the session's)."""
        return self.bindings[0].dtype if self.bindings else None

    @property
    def kernel_rule(self) -> str:
        """Which rule produced this runner's outputs, in words."""
        if self._cache.kernel_rule is not None:
            return self._cache.kernel_rule
        if not self.quantized:
            return "float cache"
        if not self.sites:  # static buffers, an export's own caches
            return "QuantizeLinear/DequantizeLinear around the model's own attention (any provider)"
        if self.device == "cuda":
            return "cuda (native kernel)"
        if self.emulated:
            return f"{self.semantics} (emulated on CPU)"
        if self.prompt_in_float:
            return "cpu (onnxruntime CPU kernel, prompt in float)"
        return "cpu (onnxruntime CPU kernel)"

    def reset(self, batch: int = 1, *, min_capacity: int = 0) -> None:
        """Forget the context: empty caches for ``batch`` sequences.

        ``min_capacity`` enlarges window-sized caches (when the model's shape allows) so
        that ``min_capacity`` tokens stay resident: onnxruntime accepts any capacity at
        least the window, and calibration must see every row the kernel will quantize. A
        paged decoder's pool starts with blocks for ``min_capacity`` tokens per sequence and
        grows as needed.
        """
        require_type(batch, INTEGER, "batch", "an integer")
        require_type(min_capacity, INTEGER, "min_capacity", "an integer")
        if batch < 1 or min_capacity < 0:
            raise KvCacheError(
                f"reset takes batch >= 1 and min_capacity >= 0, got {batch} and {min_capacity}."
            )
        self._cache.reset(batch, min_capacity)

    def cache_nbytes(self) -> int:
        """Bytes the caches take in their stored format (what the target runtime holds)."""
        total = 0
        for b in self.bindings:
            cache = self.caches[b.past]
            shape = cache.shape() if callable(getattr(cache, "shape", None)) else cache.shape
            total += b.nbytes(shape)
        return total

    def _run(self, feeds: dict[str, Any], with_logits: bool = True) -> np.ndarray | None:
        try:
            raw = self._session.run(feeds, self._cache, with_logits)
        except Exception as error:  # onnxruntime raises several unrelated types
            raise KvCacheError(f"onnxruntime failed running the model: {ort_error_text(error)}") from error
        if raw is None:
            return None
        logits = np.asarray(raw, np.float32)
        if logits.ndim not in (2, 3) or not logits.size:
            raise KvCacheError(
                f"The model's logits output {self.logits_name!r} has shape {logits.shape}, not "
                "[batch, seq, vocab] (or [tokens, vocab] for a paged model)."
            )
        if not np.all(np.isfinite(logits)):
            raise KvCacheError("The model produced non-finite logits.")
        return logits

    def _need_logits(self) -> None:
        if self.caches_only:
            raise KvCacheError(
                "This runner runs the graph pruned to its caches (",
                Param("caches_only", True),
                ") and computes no logits: use fill(ids), or a runner built without ",
                Param("caches_only"),
                ".",
            )

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence token (genai configs may list several)."""
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def _check_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        require_type(ids, (list, tuple, range, np.ndarray), "Token ids", "a list (or array) of integers")
        try:
            array = np.asarray(ids)
        except ValueError:  # rows of different lengths
            raise KvCacheError(
                "Token ids must be one list, or rows of one length (pad the shorter)."
            ) from None
        if array.size == 0 or array.ndim not in (1, 2):
            raise KvCacheError(
                f"Token ids must be a non-empty [seq] or [batch, seq] array, got shape {array.shape}."
            )
        if array.dtype.kind not in "iu":
            raise KvCacheTypeError(f"Token ids must be integers, got {array.dtype}.")
        if array.min() < 0 or (self.vocab_size is not None and array.max() >= self.vocab_size):
            raise KvCacheError(
                f"Token ids must be in [0, {self.vocab_size}), found {array.min()}..{array.max()}."
            )
        return array.astype(np.int64).reshape(-1, array.shape[-1])

    def forward(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Run new tokens through the model; returns their float32 logits ``[B, S, V]``.

        The batch size is the context's (set by :meth:`prefill` or :meth:`reset`).
        """
        self._need_logits()
        logits = self._advance(ids, with_logits=True)
        assert logits is not None
        return logits

    def fill(self, ids: Sequence[int] | np.ndarray) -> None:
        """Run new tokens through the model for their caches only, as :meth:`forward` does
        without fetching logits (a ``caches_only`` runner computes none)."""
        self._advance(ids, with_logits=False)

    def _advance(self, ids: Sequence[int] | np.ndarray, with_logits: bool) -> np.ndarray | None:
        ids = self._check_ids(ids)
        if ids.shape[0] != self.batch:
            if self.length:
                raise KvCacheError(
                    f"The context holds {self.batch} sequence(s), got ids for {ids.shape[0]}: "
                    "continue with one row per sequence, or start over with prefill()."
                )
            self.reset(ids.shape[0])
        if self.max_positions is not None and self.length + ids.shape[1] > self.max_positions:
            raise KvCacheError(
                f"{self.length + ids.shape[1]} tokens exceed the {self.max_positions} positions the "
                "model's rotary tables cover; use shorter sequences or fewer new tokens."
            )
        logits = self._run(self._cache.feeds(ids), with_logits)
        self._cache.advance(ids)
        return None if logits is None else self._cache.logits(logits, ids)

    def forward_packed(self, sequences: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
        """Paged decoders: add ``sequences[b]`` (any number of tokens, none included) to
        sequence ``b`` in one call, as a continuous-batching scheduler does; returns each
        sequence's float32 logits ``[n_b, V]``. ``length`` becomes the longest context."""
        self._cache.require_packed()
        self._need_logits()
        arrays = [np.asarray(s, np.int64).reshape(-1) for s in sequences]
        if len(arrays) != self.batch:
            self.reset(len(arrays))
        logits = self._run(self._cache.feeds(arrays))
        assert logits is not None
        self._cache.advance(arrays)
        return np.split(logits, np.cumsum([len(a) for a in arrays])[:-1])

    def prefill(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Start a new context with ``ids`` (``[seq]`` or ``[batch, seq]``); returns their logits."""
        self._need_logits()
        self.reset(self._check_ids(ids).shape[0])
        return self.forward(ids)

    def step(self, token: int | Sequence[int] | np.ndarray) -> np.ndarray:
        """Append one token (per batch row); returns its logits ``[B, V]``."""
        ids = np.asarray(token if isinstance(token, (list, tuple, np.ndarray)) else [token]).reshape(-1, 1)
        return self.forward(ids)[:, -1]

    def generate(
        self, ids: Sequence[int], max_new_tokens: int, *, eos_token_id: int | None = -1
    ) -> list[int]:
        """Greedy decoding of one sequence: up to ``max_new_tokens`` tokens after ``ids``
        (``[seq]`` or ``[1, seq]``; a batch decodes with :meth:`prefill` and :meth:`step`).

        Stops after an end-of-sequence token: ``eos_token_id``, or by default any the
        model's genai config names; ``None`` never stops early.
        """
        require_type(max_new_tokens, INTEGER, "max_new_tokens", "an integer")
        require_type(eos_token_id, (*INTEGER, type(None)), "eos_token_id", "a token id or None")
        if max_new_tokens < 0:
            raise KvCacheError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
        array = self._check_ids(ids)
        rows = array.shape[0]
        if self.max_positions is not None and array.shape[1] + max_new_tokens - 1 > self.max_positions:
            raise KvCacheError(
                Param("max_new_tokens", max_new_tokens),
                f" after a prompt of {array.shape[1]} token(s) feeds {array.shape[1] + max_new_tokens - 1} "
                f"positions, but the model's rotary tables cover {self.max_positions}: give at most ",
                Param("max_new_tokens", max(0, self.max_positions - array.shape[1] + 1)),
                ".",
            )
        if rows != 1:
            raise KvCacheError(
                f"generate decodes one sequence, got {rows}: pass one list of ids, or decode a batch "
                "with prefill() and step()."
            )
        eos = self.eos_token_ids if eos_token_id == -1 else frozenset({eos_token_id} - {None})
        logits = self.prefill(ids)[0, -1]
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(np.argmax(logits))
            out.append(token)
            if len(out) == max_new_tokens or token in eos:
                break
            logits = self.step(token)[0]
        return out

    def cache_array(self, past_name: str) -> np.ndarray:
        """A cache as the session holds it, as a host numpy array (fp8 as uint8 bits)."""
        return host_array(self.caches[past_name])

    def _binding(self, layer_id: int, kind: str) -> CacheBinding:
        if kind not in ("key", "value"):
            raise KvCacheError(f"A cache kind is 'key' or 'value', got {kind!r}.")
        for b in self.bindings:
            if b.layer_id == layer_id and b.kind == kind:
                return b
        layers = sorted({b.layer_id for b in self.bindings})
        raise KvCacheError(f"No {kind} cache for layer {layer_id}; the layers with a cache are {layers}.")

    def present(self, layer_id: int, kind: str) -> np.ndarray:
        """A layer's cache (``kind`` is ``key`` or ``value``) in its stored format (a paged
        decoder's: the block pool)."""
        b = self._binding(layer_id, kind)
        return b.stored(self.cache_array(b.past))

    def query(self, layer_id: int) -> tuple[np.ndarray, CacheSite]:
        """A layer's query input of the last run, ``[B, S, num_heads, head_size]`` (packed QKV
        sliced), and its attention site (with ``capture_queries``)."""
        return self._session.query(layer_id)

    def cache_values(self, layer_id: int, kind: str) -> np.ndarray:
        """A layer's cache as float32 values ``[B, kv_num_heads, S, head_size]``, dequantized
        with its scales (a paged decoder's: each sequence's tokens gathered from the pool)."""
        return self._cache.values(self._binding(layer_id, kind))
