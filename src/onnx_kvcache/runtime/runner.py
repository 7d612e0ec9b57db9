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
"""

from __future__ import annotations

__all__ = ["CacheBinding", "KvCacheRunner", "discover_cache_bindings", "prepare_for_cpu", "prune_to_caches"]

import dataclasses
import logging
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from onnx_kvcache.cache.formats import CacheFormat, scale_granularity
from onnx_kvcache.cache.operators import PAGED, GqaInput
from onnx_kvcache.cache.sites import (
    CacheSite,
    constant_values,
    find_attention_sites,
    find_gqa_sites,
    resident_rows,
)
from onnx_kvcache.capabilities.table import infer_target
from onnx_kvcache.errors import (
    KvCacheError,
    MeasurementWarning,
    MissingRuntimeError,
    PaddingAssumptionWarning,
    require_type,
    warn,
)
from onnx_kvcache.files.genai_folder import block_size, eos_token_ids, resolve_model_path
from onnx_kvcache.files.reading import check_defined, load_model
from onnx_kvcache.passes.fusion._window_present import present_output
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass
from onnx_kvcache.passes.kv_cache_emulation import Semantics, emulate_kv_cache, get_semantics, needs_emulation
from onnx_kvcache.passes.paged_attention_reference import PagedAttentionReferencePass
from onnx_kvcache.runtime._paged_cache import BlockPool, check_block_size
from onnx_kvcache.runtime._sessions import (
    create_session,
    fed_as_bits,
    host_array,
    import_onnxruntime,
    run_on_host,
    to_ort_value,
)

logger = logging.getLogger(__name__)

_PAST = re.compile(r"^(past|cache|kv_cache|past_key_values)", re.IGNORECASE)
_KIND = re.compile(r"(?:^|[._\-])(key|value|k|v)(?:[._\-]|$)|(key|value)", re.IGNORECASE)


def _cache_kind(name: str) -> str | None:
    match = _KIND.search(name.split("/")[-1])
    if not match:
        return None
    word = (match.group(1) or match.group(2)).lower()
    return "key" if word in ("key", "k") else "value"


@dataclasses.dataclass(frozen=True)
class CacheBinding:
    """One cache tensor: its past input, present output, layout and stored format."""

    layer_id: int
    kind: str
    past: str
    present: str
    dtype: ir.DataType
    """Element type of the cache as the model stores it."""
    kv_num_heads: int
    last_dim: int
    """Last dimension as stored (packed for int4)."""
    capacity: int | None
    """Sequence capacity of a window-sized cache (sliding_window_cache=1), else None."""
    static_capacity: bool = False
    """The model fixes that capacity in the cache's shape (it cannot be enlarged)."""
    window: int | None = None
    """``local_window_size`` of a window-sized cache, else None."""
    format: CacheFormat | None = None
    """The quantized format, or None for a float cache."""
    scale: np.ndarray | None = None
    """Dequantization scale, broadcastable to the BNSH cache."""
    head_size: int = 0
    feed_dtype: ir.DataType | None = None
    """Element type of the tensors the session takes, when not ``dtype`` (emulated or
    bfloat16 caches: they hold float values, dequantized for a quantized format)."""
    paged: bool = False
    """A block pool ``[num_blocks, block_size, kv_num_heads, last_dim]`` (PagedAttention)."""
    block_size: int | None = None
    """The pool's static block size, when the model fixes one."""

    @property
    def holds_values(self) -> bool:
        """The session's tensors hold float values of a quantized cache (emulation)."""
        return self.format is not None and self.feed_dtype is not None

    @property
    def feed_last_dim(self) -> int:
        return self.head_size if self.holds_values else self.last_dim

    def resident_rows(self, total: int, capacity: int) -> int:
        """Rows of this cache, ``capacity`` rows long, that hold tokens after ``total``."""
        return resident_rows(total, capacity, self.window)

    def empty(self, batch: int, min_capacity: int = 0) -> np.ndarray:
        length = self.capacity or 0
        if self.capacity and not self.static_capacity:
            length = max(length, min_capacity)
        shape = (batch, self.kv_num_heads, length, self.feed_last_dim)
        if self.feed_dtype is None and self.format is not None:
            return np.zeros(shape, self.format.numpy_dtype())
        return np.zeros(shape, (self.feed_dtype or self.dtype).numpy())

    def empty_pool(self, num_blocks: int, block_size: int) -> np.ndarray:
        shape = (num_blocks, block_size, self.kv_num_heads, self.feed_last_dim)
        if self.feed_dtype is None and self.format is not None:
            return np.zeros(shape, self.format.numpy_dtype())
        return np.zeros(shape, (self.feed_dtype or self.dtype).numpy())

    def values(self, cache: np.ndarray) -> np.ndarray:
        """float32 values of a BNSH cache tensor as the session holds it (dequantized)."""
        if self.format is None or self.holds_values:
            return np.asarray(cache, np.float32)
        assert self.scale is not None
        return self.format.dequantize(cache, self.scale, self.head_size)

    def stored(self, cache: np.ndarray) -> np.ndarray:
        """A cache tensor in the stored format (fp8 bits, int8, packed int4)."""
        if not self.holds_values:
            return np.asarray(cache)
        assert self.format is not None and self.scale is not None
        return self.format.quantize(cache, self.scale)

    def nbytes(self, cache_shape: Sequence[int]) -> int:
        """Bytes of this cache as stored, for a session tensor of ``cache_shape``."""
        rows = int(np.prod(cache_shape[:3]))
        itemsize = self.format.dtype.itemsize if self.format is not None else self.dtype.itemsize
        return int(rows * self.last_dim * itemsize)


def _scale_of(site: CacheSite, slot: str, head: int) -> np.ndarray | None:
    """A scale input's values shaped against a BNSH cache (the granularity row's shape)."""
    values = constant_values(site.input(slot))
    if values is None or site.granularity is None:
        return None
    return np.asarray(values, np.float32).reshape(
        scale_granularity(site.granularity).bnsh(site.kv_num_heads, head)
    )


def discover_cache_bindings(model: ir.Model) -> list[CacheBinding]:
    """Pair each cache graph input with its present output, using the attention nodes."""
    bindings: list[CacheBinding] = []
    inputs = {v.name for v in model.graph.inputs}
    outputs = {v.name for v in model.graph.outputs}
    for site in find_attention_sites(model):
        capacity = None
        if site.int_attr("sliding_window_cache", 0) and site.int_attr("local_window_size", -1) > 0:
            capacity = site.int_attr("local_window_size", -1)
        fmt = site.cache_format
        paged = site.op.layout.name == PAGED.layout.name
        for side in site.sides:
            past, present = site.past(side), present_output(site.present(side))
            if past is None or present is None or past.name not in inputs or present.name not in outputs:
                continue
            assert past.name is not None and present.name is not None
            if past.dtype is None:
                raise KvCacheError(
                    f"{site.label}: its cache input {past.name!r} has no element type; the model is "
                    "malformed (every graph input needs one)."
                )
            shape = past.shape
            static = False
            if capacity and shape is not None and len(shape) == 4 and isinstance(shape[2], int):
                capacity, static = shape[2], True
            head = site.head_size()
            last = shape[3] if shape is not None and len(shape) == 4 else None
            if not isinstance(last, int):
                last = fmt.packed_dim(head) if fmt is not None else head
            block = shape[1] if paged and shape is not None and len(shape) == 4 else None
            bindings.append(
                CacheBinding(
                    site.layer_id,
                    side.kind,
                    past.name,
                    present.name,
                    past.dtype,
                    site.kv_num_heads,
                    last,
                    capacity,
                    static,
                    site.int_attr("local_window_size", -1) if capacity else None,
                    fmt,
                    _scale_of(site, side.scale, head) if fmt is not None else None,
                    head,
                    paged=paged,
                    block_size=block if isinstance(block, int) else None,
                )
            )
    if not bindings:
        for value in model.graph.inputs:
            if _PAST.match(value.name or "") and _cache_kind(value.name or ""):
                raise KvCacheError(
                    f"Input {value.name!r} looks like a KV cache but no GroupQueryAttention or "
                    "PagedAttention node reads it; the runner needs such a decoder. Fuse an exported "
                    "model's attention first: optimize_model(model) (docs/exporting.md)."
                )
    return bindings


def _query_outputs(model: ir.Model) -> dict[int, tuple[str, CacheSite]]:
    """Per cached layer of the main graph, the name of its GroupQueryAttention's query input."""
    graph_values = {v.name for v in [*model.graph.inputs, *model.graph.outputs]}
    found = {}
    for site in find_gqa_sites(model):
        query = site.input("query")
        in_main = site.node.graph is model.graph and site.has_cache
        if in_main and query is not None and query.name and query.name not in graph_values:
            found[site.layer_id] = (query.name, site)
    return found


def _fused(model: ir.Model) -> ir.Model:
    """A decoder without attention nodes (a PyTorch export), fused in memory (the file, or
    the caller's model, unchanged).

    The runner feeds unpadded rows, so what a fused padding mask assumes does not apply.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PaddingAssumptionWarning)
        modified = GqaFusionPass()(model).modified
    if modified:
        logger.info("Fused the model's attention into GroupQueryAttention (in memory, file unchanged).")
    return model


def target_semantics(model: ir.Model, genai_config: dict[str, Any] | None = None) -> tuple[Semantics, str]:
    """The kernel rule of the provider ``model`` targets (see ``infer_target``), cuda or
    cpu, and why: ``"target cpu: a float32 model"``."""
    ep, why = infer_target(model, genai_config)
    semantics: Semantics = "cuda" if ep == "cuda" else "cpu"
    logger.info("The model targets %s (%s): the %s kernel's rule.", ep, why, semantics)
    return semantics, f"target {ep}: {why}"


def _max_positions(model: ir.Model) -> int | None:
    """Positions the rotary tables cover (the model's context limit), when static."""
    limits = []
    for site in find_gqa_sites(model, with_cache_only=False):
        cos = site.input(GqaInput.COS_CACHE)
        shape = cos.shape if cos is not None else None
        if site.int_attr("do_rotary") and shape is not None and isinstance(shape[0], int):
            limits.append(shape[0])
    return min(limits) if limits else None


def _has_bfloat16(model: ir.Model) -> bool:
    values = [*model.graph.inputs, *model.graph.outputs, *model.graph.initializers.values()]
    return any(v.dtype == ir.DataType.BFLOAT16 for v in values)


def prepare_for_cpu(
    model: ir.Model, semantics: Semantics, *, quantized_io: bool = False
) -> tuple[ir.Model, bool]:
    """``model``, or a copy prepared to run on the CPU provider, and whether it emulates.

    bfloat16 computes in float32; GroupQueryAttention nodes the CPU cannot run under
    ``semantics`` are emulated (:func:`emulate_kv_cache`); PagedAttention nodes run through
    the CPU reference (no CPU kernel exists; every paged kernel quantizes before attending,
    whatever ``semantics``). The given model is never changed.
    """
    emulate = any(needs_emulation(s, semantics) for s in find_gqa_sites(model))
    paged = bool(find_attention_sites(model, ops=(PAGED,)))
    if not (emulate or paged or _has_bfloat16(model)):
        return model, False
    if emulate:
        logger.info("Emulating GroupQueryAttention caches on CPU with the %s kernel's rule.", semantics)
    elif not paged:
        logger.info("bfloat16 model: computing in float32 on CPU (no bf16 kernels there).")
    try:
        prepared = emulate_kv_cache(model, semantics, quantized_io=quantized_io)
    except ir.passes.PreconditionError as e:
        raise KvCacheError(f"This model cannot run on CPU: {e}") from None
    if paged:
        if prepared.functions:
            common_passes.InlinePass()(prepared)
        logger.info("Running PagedAttention through its CPU reference (onnxruntime has no CPU kernel).")
        PagedAttentionReferencePass()(prepared)
    return prepared, emulate or paged


def prune_to_caches(model: ir.Model, presents: Sequence[str]) -> ir.Model:
    """A copy of ``model`` whose outputs are the ``presents`` only, without every node and
    initializer none of them depends on (the LM head, the last layer's output projection
    and MLP). Tensors are shared with ``model``, which is not changed: the copy reads the
    same external data."""
    pruned = model.clone()
    kept = [v for v in pruned.graph.outputs if v.name in set(presents)]
    pruned.graph.outputs.clear()
    pruned.graph.outputs.extend(kept)
    common_passes.RemoveUnusedNodesPass()(pruned)
    return pruned


def _logits_output(model: ir.Model) -> tuple[str, int | None]:
    """The logits output's name and vocabulary size (None when symbolic), read from the
    graph: the first output named like ``logits``, else the first output."""
    outputs = list(model.graph.outputs)
    if not outputs:
        raise KvCacheError("The model has no outputs: it is not a decoder this library runs.")
    logits = next((o for o in outputs if "logits" in (o.name or "")), outputs[0])
    assert logits.name is not None
    last = logits.shape[-1] if logits.shape is not None and len(logits.shape) else None
    return logits.name, last if isinstance(last, int) else None


_PAGED_LENGTHS = ("cumulative_sequence_length", "past_seqlens", "block_table", "attention_metadata")


def _paged_feeds(model: ir.Model) -> dict[str, str]:
    """The graph inputs a paged decoder's PagedAttention nodes read their lengths from."""
    inputs = {v.name for v in model.graph.inputs}
    names: dict[str, str] = {}
    for site in find_attention_sites(model, ops=(PAGED,)):
        for role in (*_PAGED_LENGTHS, "slot_mapping"):
            value = site.input(role)
            if value is None:
                continue
            if value.name not in inputs:
                raise KvCacheError(
                    f"{site.label} reads its {role} from {value.name!r}, which is not a graph input; "
                    "the runner feeds paged decoders whose lengths and block table are graph inputs "
                    "(onnxruntime-genai's layout)."
                )
            if names.setdefault(role, value.name) != value.name:  # type: ignore[arg-type]
                raise KvCacheError(
                    f"{site.label} reads its {role} from {value.name!r}, other layers from "
                    f"{names[role]!r}: layers with their own tables (genai's windowed paged layers, "
                    "block_table_windowed) are not run by the runner; build the model with full-size "
                    "paged caches."
                )
    return names


def _paged_block_size(bindings: list[CacheBinding], requested: int | None, config: dict | None) -> int:
    """The pool's block size: the model's static one, else ``requested``, else the genai
    config's ``engine.dynamic_batching.block_size``, else 16."""
    static = {b.block_size for b in bindings if b.block_size is not None}
    if len(static) > 1:
        raise KvCacheError(
            f"The model's paged caches declare different block sizes {sorted(static)}; one block table "
            "cannot address them. Rebuild the model with one block size."
        )
    if static:
        fixed = static.pop()
        if requested is not None and requested != fixed:
            raise KvCacheError(
                f"block_size={requested} does not match the model's caches, which fix block_size {fixed}."
            )
        return check_block_size(fixed)
    if requested is not None:
        return check_block_size(requested)
    configured = block_size(config)
    return check_block_size(configured) if configured is not None else 16


def _require_providers(providers: Sequence[Any]) -> None:
    """Every provider asked for is in this onnxruntime (it would silently fall back otherwise)."""
    available = import_onnxruntime().get_available_providers()
    for provider in providers:
        name = provider[0] if isinstance(provider, tuple) else str(provider)
        if name not in available:
            hint = (
                "install onnxruntime-gpu (the gpu extra) on a machine with CUDA, or run on CPU"
                if "CUDA" in name
                else "give one of those"
            )
            raise KvCacheError(
                f"{name} is not available here (onnxruntime offers {', '.join(available)}); {hint}."
            )


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
            ``logits_name`` and ``vocab_size`` are still the model's.
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
        base_dir, config = None, None
        model_file = None  # the file whose graph the session runs unchanged, if any
        if isinstance(model_or_path, ir.Model):
            model = model_or_path
            if not find_attention_sites(model, with_cache_only=False):
                check_defined(model.graph)
                model = _fused(model.clone())  # the caller's model stays as it is
        else:
            path, config = resolve_model_path(model_or_path)
            model = load_model(path)
            model_file = path
            if not find_attention_sites(model, with_cache_only=False):
                model = _fused(model)
                model_file = None  # the session runs the fused graph, not the file's
            base_dir = path.parent
        self.genai_config = config
        """The onnxruntime-genai config of a genai folder, else None."""
        self.eos_token_ids: frozenset[int] = eos_token_ids(config)
        """End-of-sequence tokens; read from genai_config.json for a genai folder."""
        self.providers = (
            [providers] if isinstance(providers, str) else list(providers or ["CPUExecutionProvider"])
        )
        self.source_model = model
        """The model as given (before any preparation for CPU)."""
        _require_providers(self.providers)
        on_cuda = any("CUDA" in str(p) for p in self.providers)
        if on_cuda:
            if semantics not in (None, "cuda"):
                raise KvCacheError(f"On CUDA the CUDA kernel runs: semantics={semantics!r} is not possible.")
            self.semantics: Semantics = "cuda"
            self.emulated = False
            self.semantics_reason = "running on CUDA"
            """Why this kernel rule: ``target cpu: a float32 model``, ``asked for``, ..."""
        else:
            if semantics is None:
                self.semantics, self.semantics_reason = target_semantics(model, config)
            else:
                self.semantics = get_semantics(semantics)
                self.semantics_reason = "asked for"
                if self.semantics == "cpu" and any(
                    s.cache_format is not None and s.cache_format.is_float for s in find_gqa_sites(model)
                ):
                    warn(
                        "semantics='cpu' on an fp8 cache: no CPU kernel stores fp8, so this rule is "
                        "hypothetical; CUDA's ('cuda') is what an fp8 model gets.",
                        MeasurementWarning,
                    )
            model, self.emulated = prepare_for_cpu(model, self.semantics, quantized_io=quantized_io)
        self.max_positions = _max_positions(self.source_model)
        """Tokens a context may hold (the rotary tables' length), or None when unknown."""
        self.logits_name, self.vocab_size = _logits_output(self.source_model)
        """The logits output and the vocabulary size (None when symbolic), the model's."""
        self.caches_only = caches_only
        """The session runs the graph pruned to the caches (no logits)."""
        feeds = {v.name: v.dtype for v in model.graph.inputs}
        self.bindings = [
            b if feeds.get(b.past) in (None, b.dtype) else dataclasses.replace(b, feed_dtype=feeds[b.past])
            for b in discover_cache_bindings(self.source_model)
        ]
        self.paged = any(b.paged for b in self.bindings)
        if self.paged and not all(b.paged for b in self.bindings):
            raise KvCacheError("The model mixes paged and dense KV caches; the runner takes one kind.")
        self.block_size = _paged_block_size(self.bindings, block_size, config) if self.paged else None
        """Tokens per block of a paged decoder's pool (None for dense caches)."""
        self._paged_inputs = _paged_feeds(self.source_model) if self.paged else {}
        self.pool: BlockPool | None = None
        if caches_only and self.bindings:
            model = prune_to_caches(model, [b.present for b in self.bindings])
        self.model = model
        """The model the session runs (prepared for CPU, pruned to the caches)."""
        self._queries: dict[int, tuple[str, CacheSite]] = {}
        self.queries: dict[int, np.ndarray] = {}
        """Each layer's query input of the last run (with ``capture_queries``)."""
        added: list[ir.Value] = []
        if capture_queries:
            self._queries = _query_outputs(model)
            added = [v for _, s in self._queries.values() if (v := s.input("query")) is not None]
            model.graph.outputs.extend(added)
        try:
            if model is self.source_model and model_file is not None and not added:
                # the file's own graph: onnxruntime reads it (from bytes costs ~1.2x the time)
                self.session = create_session(model_file, self.providers)
            else:
                self.session = create_session(model, self.providers, base_dir)
        except (KvCacheError, MissingRuntimeError):
            raise
        except Exception as error:  # onnxruntime raises several unrelated types
            raise KvCacheError(f"onnxruntime cannot load the model on {self.providers}: {error}") from error
        finally:
            for _ in added:
                model.graph.outputs.pop()
        names = [i.name for i in self.session.get_inputs()]
        self.input_names = names
        ids_name = next((n for n in names if n in ("input_ids", "ids", "tokens")), None)
        if ids_name is None and not self.bindings:
            raise KvCacheError(
                "The model has no GroupQueryAttention or PagedAttention node with a KV cache, and no "
                "attention to fuse into one, nor an input_ids input: it is not a decoder this library "
                "runs (see docs/exporting.md for PyTorch exports)."
            )
        if ids_name is None:
            raise KvCacheError(f"The decoder has no input_ids input (inputs: {names}).")
        self.ids_name: str = ids_name
        fed = {ids_name, "attention_mask", "position_ids", *(b.past for b in self.bindings)}
        unfed = [n for n in names if n not in fed and n not in self._paged_inputs.values()]
        if unfed:
            raise KvCacheError(
                f"The runner cannot feed the model's input(s) {', '.join(unfed)}: it feeds token ids, "
                "attention_mask, position_ids and the caches GroupQueryAttention or PagedAttention "
                "nodes read (an export's attention that was not fused leaves its cache unread by them)."
            )
        self.device = "cuda" if on_cuda else "cpu"
        if capture_queries and io_binding:
            raise KvCacheError("capture_queries fetches the queries as host arrays: use io_binding=False.")
        self.io_binding = (on_cuda and not capture_queries) if io_binding is None else io_binding
        self.reset()

    @property
    def cache_dtype(self) -> ir.DataType | None:
        """The stored element type of the first cache (the model's, not the session's)."""
        return self.bindings[0].dtype if self.bindings else None

    @property
    def kernel_rule(self) -> str:
        """Which rule produced this runner's outputs, in words."""
        if self.paged:
            return "PagedAttention CPU reference (quantized before attending, as every paged kernel)"
        if not any(b.format is not None for b in self.bindings):
            return "float cache"
        if self.device == "cuda":
            return "cuda (native kernel)"
        return f"{self.semantics} (emulated on CPU)" if self.emulated else "cpu (onnxruntime CPU kernel)"

    def reset(self, batch: int = 1, *, min_capacity: int = 0) -> None:
        """Forget the context: empty caches for ``batch`` sequences.

        ``min_capacity`` enlarges window-sized caches (when the model's shape allows) so
        that ``min_capacity`` tokens stay resident: onnxruntime accepts any capacity at
        least the window, and calibration must see every row the kernel will quantize. A
        paged decoder's pool starts with blocks for ``min_capacity`` tokens per sequence and
        grows as needed.
        """
        self.batch = batch
        self.length = 0
        self.caches: dict[str, Any] = {}
        if self.paged:
            assert self.block_size is not None
            self.pool = BlockPool(self.block_size, batch)
            self.pool.reserve([min_capacity] * batch)
        for b in self.bindings:
            if self.pool is not None:
                empty = b.empty_pool(self.pool.num_blocks, self.pool.block_size)
            else:
                empty = b.empty(batch, min_capacity)
            if self.io_binding:
                self.caches[b.past] = to_ort_value(empty, b.feed_dtype or b.dtype, self.device)
            else:
                self.caches[b.past] = empty

    def cache_nbytes(self) -> int:
        """Bytes the caches take in their stored format (what the target runtime holds)."""
        total = 0
        for b in self.bindings:
            cache = self.caches[b.past]
            shape = cache.shape() if callable(getattr(cache, "shape", None)) else cache.shape
            total += b.nbytes(shape)
        return total

    def _inputs(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        batch, seq = ids.shape
        total = self.length + seq
        feeds: dict[str, np.ndarray] = {self.ids_name: ids.astype(np.int64)}
        if "attention_mask" in self.input_names:
            feeds["attention_mask"] = np.ones((batch, total), np.int64)
        if "position_ids" in self.input_names:
            feeds["position_ids"] = np.tile(np.arange(self.length, total, dtype=np.int64), (batch, 1))
        return feeds

    def _paged_feeds(self, sequences: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """Pack ``sequences`` (new tokens per sequence) with the pool's lengths and table."""
        pool = self.pool
        assert pool is not None
        new = [len(s) for s in sequences]
        grow = pool.reserve([n + k for n, k in zip(pool.lengths, new)])
        if grow:
            self._grow_pools(grow)
        lengths = pool.feeds(new)
        feeds: dict[str, np.ndarray] = {self.ids_name: np.concatenate(sequences).astype(np.int64)}
        for role, name in self._paged_inputs.items():
            feeds[name] = pool.slots(new) if role == "slot_mapping" else lengths[role]
        if "position_ids" in self.input_names:
            feeds["position_ids"] = np.concatenate(
                [np.arange(n, n + k, dtype=np.int64) for n, k in zip(pool.lengths, new)]
            )
        return feeds

    def _grow_pools(self, blocks: int) -> None:
        """Add ``blocks`` empty blocks to every layer's pool (host copy for device pools)."""
        assert self.pool is not None
        for b in self.bindings:
            grown = np.concatenate([self.cache_array(b.past), b.empty_pool(blocks, self.pool.block_size)])
            if self.io_binding:
                if fed_as_bits(b.feed_dtype or b.dtype) and self.device != "cpu":
                    raise KvCacheError(
                        "The fp8 block pool on the device is full; reset(batch, min_capacity=...) with "
                        "room for the whole context first."
                    )
                self.caches[b.past] = to_ort_value(grown, b.feed_dtype or b.dtype, self.device)
            else:
                self.caches[b.past] = grown

    def _run_plain(self, feeds: dict[str, Any], with_logits: bool) -> np.ndarray | None:
        for b in self.bindings:
            cache = self.caches[b.past]
            feeds[b.past] = to_ort_value(cache, b.dtype) if fed_as_bits(b.feed_dtype or b.dtype) else cache
        names = [self.logits_name] * with_logits + [b.present for b in self.bindings]
        results = run_on_host(self.session, names + [n for n, _ in self._queries.values()], feeds)
        for b, present in zip(self.bindings, results[with_logits : len(names)]):
            self.caches[b.past] = present
        self.queries = dict(zip(self._queries, results[len(names) :]))
        return results[0] if with_logits else None

    def _run_bound(self, feeds: dict[str, Any], with_logits: bool) -> np.ndarray | None:
        binding = self.session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for b in self.bindings:
            binding.bind_ortvalue_input(b.past, self.caches[b.past])
        if with_logits:
            binding.bind_output(self.logits_name, "cpu")
        for b in self.bindings:
            if self.paged and self.device != "cpu":  # the kernel updates its pool in place
                binding.bind_ortvalue_output(b.present, self.caches[b.past])
            else:
                binding.bind_output(b.present, self.device)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        for b, present in zip(self.bindings, outputs[with_logits:]):
            self.caches[b.past] = present
        return outputs[0].numpy() if with_logits else None

    def _run(self, feeds: dict[str, Any], with_logits: bool = True) -> np.ndarray | None:
        run = self._run_bound if self.io_binding else self._run_plain
        try:
            raw = run(feeds, with_logits)
        except Exception as error:  # onnxruntime raises several unrelated types
            raise KvCacheError(f"onnxruntime failed running the model: {error}") from error
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
                "This runner runs the graph pruned to its caches (caches_only=True) and computes no "
                "logits: use fill(ids), or a runner built without caches_only."
            )

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence token (genai configs may list several)."""
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def _check_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        array = np.asarray(ids)
        if array.size == 0 or array.ndim not in (1, 2):
            raise KvCacheError(
                f"Token ids must be a non-empty [seq] or [batch, seq] array, got shape {array.shape}."
            )
        if array.dtype.kind not in "iu":
            raise KvCacheError(f"Token ids must be integers, got {array.dtype}.")
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
        if self.pool is not None:
            logits = self._run(self._paged_feeds(list(ids)), with_logits)
            self.pool.advance([ids.shape[1]] * ids.shape[0])
            if logits is not None:
                if logits.size % ids.size:
                    raise KvCacheError(f"The model's logits {logits.shape} are not {ids.size} tokens' rows.")
                logits = logits.reshape(ids.shape[0], ids.shape[1], -1)
        else:
            logits = self._run(self._inputs(ids), with_logits)
        self.length += ids.shape[1]
        return logits

    def forward_packed(self, sequences: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
        """Paged decoders: add ``sequences[b]`` (any number of tokens, none included) to
        sequence ``b`` in one call, as a continuous-batching scheduler does; returns each
        sequence's float32 logits ``[n_b, V]``. ``length`` becomes the longest context."""
        if self.pool is None:
            raise KvCacheError("forward_packed needs a paged decoder (PagedAttention); use forward.")
        self._need_logits()
        arrays = [np.asarray(s, np.int64).reshape(-1) for s in sequences]
        if len(arrays) != self.batch:
            self.reset(len(arrays))
        assert self.pool is not None
        logits = self._run(self._paged_feeds(arrays))
        assert logits is not None
        self.pool.advance([len(a) for a in arrays])
        self.length = max(self.pool.lengths)
        return np.split(logits, np.cumsum([len(a) for a in arrays])[:-1])

    def prefill(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Start a new context with ``ids`` (``[seq]`` or ``[batch, seq]``); returns their logits."""
        self._need_logits()
        self.reset(self._check_ids(ids).shape[0])
        return self.forward(ids)

    def step(self, token: int | Sequence[int]) -> np.ndarray:
        """Append one token (per batch row); returns its logits ``[B, V]``."""
        ids = np.asarray(token, np.int64).reshape(-1, 1)
        return self.forward(ids)[:, -1]

    def generate(
        self, ids: Sequence[int], max_new_tokens: int, *, eos_token_id: int | None = -1
    ) -> list[int]:
        """Greedy decoding of one sequence: up to ``max_new_tokens`` tokens after ``ids``
        (``[seq]`` or ``[1, seq]``; a batch decodes with :meth:`prefill` and :meth:`step`).

        Stops after an end-of-sequence token: ``eos_token_id``, or by default any the
        model's genai config names; ``None`` never stops early.
        """
        if max_new_tokens < 0:
            raise KvCacheError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
        rows = self._check_ids(ids).shape[0]
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
        if layer_id not in self.queries:
            raise KvCacheError(
                f"No query captured for layer {layer_id}: create the runner with capture_queries."
            )
        site = self._queries[layer_id][1]
        q = np.asarray(self.queries[layer_id], np.float32)
        heads = site.num_heads
        head = q.shape[-1] // (
            heads + 2 * site.kv_num_heads if site.packed_qkv else heads
        )  # shapes may be gone
        return q[..., : heads * head].reshape(*q.shape[:2], heads, head), site

    def cache_values(self, layer_id: int, kind: str) -> np.ndarray:
        """A layer's cache as float32 values ``[B, kv_num_heads, S, head_size]``, dequantized
        with its scales (a paged decoder's: each sequence's tokens gathered from the pool)."""
        b = self._binding(layer_id, kind)
        cache = self.cache_array(b.past)
        if self.pool is None:
            return b.values(cache)
        flat = cache.reshape(-1, *cache.shape[2:])
        rows = [flat[self.pool.rows(i)] for i in range(self.batch)]
        longest = max(len(r) for r in rows)
        view = np.zeros((self.batch, longest, *cache.shape[2:]), cache.dtype)
        for i, r in enumerate(rows):
            view[i, : len(r)] = r
        return b.values(view.transpose(0, 2, 1, 3))
