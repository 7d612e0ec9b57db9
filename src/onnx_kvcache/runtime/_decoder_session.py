"""The runner's onnxruntime session: which graph runs, on which provider, under which rule.

:func:`choose_target` checks the providers and picks the kernel rule: on CUDA the native
kernel's; on CPU the rule asked for or the one the model targets, with the graph prepared
for the CPU (:func:`prepare_for_cpu`: bfloat16 in float32, the emulation of caches the CPU
kernel cannot run, the PagedAttention reference). :class:`DecoderSession` prunes that graph
to its present outputs for a caches-only runner (:func:`prune_to_caches`), adds the query
outputs ``capture_queries`` asks for, and creates the session from the model's file when it
runs the file's graph unchanged (onnxruntime reads it; from bytes costs ~1.2x the time). A
run feeds the caches (types numpy lacks as their bits, or bound as OrtValues) and keeps the
presents.
"""

from __future__ import annotations

__all__ = [
    "DecoderSession",
    "ModelSource",
    "SessionOptions",
    "Target",
    "choose_target",
    "logits_output",
    "max_positions",
    "prepare_for_cpu",
    "prune_to_caches",
    "target_semantics",
]

import dataclasses
import logging
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from onnx_kvcache.cache.operators import PAGED
from onnx_kvcache.cache.rolling import whole_presents
from onnx_kvcache.cache.rotary_tables import max_positions
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites, find_gqa_sites
from onnx_kvcache.capabilities.table import infer_target
from onnx_kvcache.errors import (
    KvCacheError,
    MeasurementWarning,
    Message,
    MissingRuntimeError,
    Param,
    require_flags,
    require_optional_flags,
    warn,
)
from onnx_kvcache.model_io import create_session, import_onnxruntime, ort_error_text, run_on_host
from onnx_kvcache.model_io.reading import logits_output as read_logits_output
from onnx_kvcache.passes.kv_cache_emulation import Semantics, emulate_kv_cache, get_semantics, needs_emulation
from onnx_kvcache.passes.paged_attention_reference import PagedAttentionReferencePass
from onnx_kvcache.runtime._cache import CacheBinding, Feeding, KvCache

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The decoder as loaded (attention fused in memory if it had none)."""

    model: ir.Model
    file: pathlib.Path | None = None
    """The file whose graph ``model`` is unchanged, if any (the session then reads it)."""
    config: dict[str, Any] | None = None
    """The onnxruntime-genai config of a genai folder."""
    base_dir: pathlib.Path | None = None
    """The folder of the model's file (its external data)."""
    io_caches: bool = False
    """The runner feeds the caches the graph's I/O names (static buffers, an export that does
    not fuse: :mod:`~onnx_kvcache.cache.io_caches`), with no attention node of ours."""


@dataclasses.dataclass(frozen=True)
class SessionOptions:
    """The runner's settings the session follows (see :class:`KvCacheRunner`)."""

    providers: Sequence[Any] | str | None = None
    io_binding: bool | None = None
    semantics: str | None = None
    quantized_io: bool = False
    caches_only: bool = False
    capture_queries: bool = False

    def __post_init__(self) -> None:
        """A yes/no setting that is not ``True`` or ``False`` is refused before any work."""
        require_flags(
            quantized_io=self.quantized_io, caches_only=self.caches_only, capture_queries=self.capture_queries
        )
        require_optional_flags(io_binding=self.io_binding)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the session runs, under which kernel rule, and the graph prepared for it."""

    providers: list[Any]
    device: str
    semantics: Semantics
    reason: str
    """Why this kernel rule: ``target cpu: a float32 model``, ``asked for``, ..."""
    model: ir.Model
    emulated: bool


def target_semantics(model: ir.Model, genai_config: dict[str, Any] | None = None) -> tuple[Semantics, str]:
    """The kernel rule of the provider ``model`` targets (see ``infer_target``), cuda or
    cpu, and why: ``"target cpu: a float32 model"``."""
    ep, why = infer_target(model, genai_config)
    semantics: Semantics = "cuda" if ep == "cuda" else "cpu"
    logger.info("The model targets %s (%s): the %s kernel's rule.", ep, why, semantics)
    return semantics, f"target {ep}: {why}"


def logits_output(model: ir.Model) -> tuple[str, int | None]:
    """The logits output's name and vocabulary size (None when symbolic), read from the
    graph (:func:`~onnx_kvcache.model_io.reading.logits_output`); refused without outputs."""
    found = read_logits_output(model)
    if found is None:
        raise KvCacheError("The model has no outputs: it is not a decoder this library runs.")
    return found


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
    same external data. A rolling window cache's present is its attention node's whole present
    (:func:`~onnx_kvcache.cache.rolling.whole_presents`: every token of a window, not its last
    ``W - 1``)."""
    pruned = model.clone()
    kept = [v for v in pruned.graph.outputs if v.name in set(presents)]
    pruned.graph.outputs.clear()
    pruned.graph.outputs.extend(kept)
    whole_presents(pruned.graph)
    common_passes.RemoveUnusedNodesPass()(pruned)
    return pruned


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


def _cpu_semantics(source: ModelSource, semantics: str | None) -> tuple[Semantics, str]:
    """The kernel rule on CPU: the one asked for, else the one of the provider the model targets."""
    if semantics is None:
        return target_semantics(source.model, source.config)
    rule = get_semantics(semantics)
    if rule == "cpu" and any(
        s.cache_format is not None and s.cache_format.is_float for s in find_gqa_sites(source.model)
    ):
        warn(
            Message(
                Param("semantics", "cpu"),
                " on an fp8 cache: no CPU kernel stores fp8, so this rule is "
                "hypothetical; CUDA's ('cuda') is what an fp8 model gets.",
            ),
            MeasurementWarning,
        )
    return rule, "asked for"


def choose_target(source: ModelSource, options: SessionOptions) -> Target:
    """The providers (each available), the kernel rule, and the graph prepared for them."""
    given = options.providers
    providers = [given] if isinstance(given, str) else list(given or ["CPUExecutionProvider"])
    _require_providers(providers)
    if any("CUDA" in str(p) for p in providers):
        if options.semantics not in (None, "cuda"):
            raise KvCacheError(
                "On CUDA the CUDA kernel runs: ", Param("semantics", options.semantics), " is not possible."
            )
        return Target(providers, "cuda", "cuda", "running on CUDA", source.model, False)
    rule, reason = _cpu_semantics(source, options.semantics)
    model, emulated = prepare_for_cpu(source.model, rule, quantized_io=options.quantized_io)
    return Target(providers, "cpu", rule, reason, model, emulated)


def _query_outputs(model: ir.Model) -> dict[int, tuple[str, CacheSite]]:
    """Per cached layer of the main graph, the name of its GroupQueryAttention's query input."""
    graph_values = {v.name for v in [*model.graph.inputs, *model.graph.outputs]}
    found = {}
    for site in find_gqa_sites(model):
        query = site.input("query")
        in_main = site.outer.graph is model.graph and site.has_cache  # a wrapped node: its If
        if in_main and query is not None and query.name and query.name not in graph_values:
            found[site.layer_id] = (query.name, site)
    return found


def _ids_name(names: list[str], bindings: Sequence[CacheBinding]) -> str:
    ids_name = next((n for n in names if n in ("input_ids", "ids", "tokens")), None)
    if ids_name is None and not bindings:
        raise KvCacheError(
            "The model has no GroupQueryAttention or PagedAttention node with a KV cache, and no "
            "attention to fuse into one, nor an input_ids input: it is not a decoder this library "
            "runs (see docs/exporting.md for PyTorch exports)."
        )
    if ids_name is None:
        raise KvCacheError(f"The decoder has no input_ids input (inputs: {names}).")
    return ids_name


def _check_fed(names: list[str], fed: set[str]) -> None:
    unfed = [n for n in names if n not in fed]
    if unfed:
        raise KvCacheError(
            f"The runner cannot feed the model's input(s) {', '.join(unfed)}: it feeds token ids, "
            "attention_mask, position_ids and the caches GroupQueryAttention or PagedAttention "
            "nodes read (an export's attention that was not fused leaves its cache unread by them)."
        )


class DecoderSession:
    """The onnxruntime session of a runner, and what it feeds and fetches each run.

    ``logits`` is the model's logits output and vocabulary size (:func:`logits_output`);
    ``cache_inputs`` are the graph inputs the cache feeds besides ids, mask, positions
    and the caches themselves (a paged decoder's lengths and block table).
    """

    def __init__(
        self,
        source: ModelSource,
        target: Target,
        logits: tuple[str, int | None],
        bindings: list[CacheBinding],
        cache_inputs: Mapping[str, str],
        options: SessionOptions,
    ) -> None:
        self.target = target
        self.logits_name, self.vocab_size = logits
        self.caches_only = options.caches_only
        model = target.model
        if options.caches_only and bindings:
            model = prune_to_caches(model, [b.present for b in bindings])
        self.model = model
        self._queries = _query_outputs(model) if options.capture_queries else {}
        self.queries: dict[int, np.ndarray] = {}
        self.session = self._create(source)
        self.feeding = self._feeding(bindings, cache_inputs, options)

    def _create(self, source: ModelSource) -> Any:
        """The session, read from the model's file when it runs the file's graph unchanged."""
        model, providers = self.model, self.target.providers
        added = [v for _, s in self._queries.values() if (v := s.input("query")) is not None]
        model.graph.outputs.extend(added)
        spinning = not self.caches_only  # a few long prefills: no latency to buy by spinning
        try:
            if model is source.model and source.file is not None and not added:
                return create_session(source.file, providers, spinning=spinning)
            return create_session(model, providers, source.base_dir, spinning=spinning)
        except (KvCacheError, MissingRuntimeError):
            raise
        except Exception as error:  # onnxruntime raises several unrelated types
            said = ort_error_text(error)
            raise KvCacheError(f"onnxruntime cannot load the model on {providers}: {said}") from error
        finally:
            for _ in added:
                model.graph.outputs.pop()

    def _feeding(
        self, bindings: list[CacheBinding], cache_inputs: Mapping[str, str], options: SessionOptions
    ) -> Feeding:
        """The session's inputs, checked to be all fed, and where the caches live."""
        names = [i.name for i in self.session.get_inputs()]
        ids_name = _ids_name(names, bindings)
        _check_fed(
            names,
            {ids_name, "attention_mask", "position_ids", *(b.past for b in bindings), *cache_inputs.values()},
        )
        if options.capture_queries and options.io_binding:
            raise KvCacheError(
                Param("capture_queries"),
                " fetches the queries as host arrays: use ",
                Param("io_binding", False),
                ".",
            )
        on_device = self.target.device == "cuda" and not options.capture_queries
        bound = on_device if options.io_binding is None else options.io_binding
        return Feeding(ids_name, tuple(names), self.target.device, bound)

    def run(self, feeds: dict[str, Any], cache: KvCache, with_logits: bool) -> np.ndarray | None:
        """One run: feeds plus the past caches in, the presents kept as ``cache``'s tensors."""
        run = self._run_bound if self.feeding.io_binding else self._run_plain
        return run(feeds, cache, with_logits)

    def _run_plain(self, feeds: dict[str, Any], cache: KvCache, with_logits: bool) -> np.ndarray | None:
        for b in cache.bindings:
            feeds[b.past] = self.feeding.feed(cache.caches[b.past], b)
        names = [self.logits_name] * with_logits + [b.present for b in cache.bindings]
        results = run_on_host(self.session, names + [n for n, _ in self._queries.values()], feeds)
        for b, present in zip(cache.bindings, results[with_logits : len(names)]):
            cache.caches[b.past] = present
        self.queries = dict(zip(self._queries, results[len(names) :]))
        return results[0] if with_logits else None

    def _run_bound(self, feeds: dict[str, Any], cache: KvCache, with_logits: bool) -> np.ndarray | None:
        binding = self.session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for b in cache.bindings:
            binding.bind_ortvalue_input(b.past, cache.caches[b.past])
        if with_logits:
            binding.bind_output(self.logits_name, "cpu")
        for b in cache.bindings:
            cache.bind_present(binding, b)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        for b, present in zip(cache.bindings, outputs[with_logits:]):
            cache.caches[b.past] = present
        return outputs[0].numpy() if with_logits else None

    def query(self, layer_id: int) -> tuple[np.ndarray, CacheSite]:
        """A layer's query input of the last run, ``[B, S, num_heads, head_size]``."""
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
