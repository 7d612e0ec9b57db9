"""Run GroupQueryAttention on CPU as a chosen kernel computes it: the emulation.

onnxruntime's CPU provider has no fp8 cache, no q/k norm inputs (14/15), and quantizes
int8/int4 caches by its own rule. This pass rewrites each GroupQueryAttention node that the
CPU cannot run as asked into ops it can run:

1. q/k RMS norm (inputs 14/15) and RoPE are applied outside the node, with the kernel's
   positions (``0..S-1`` on the first prompt, else ``seqlens_k + 1 - S + s``, or
   ``position_ids`` when given); ``seqlens_k`` and ``query_seqlens`` are read as ``[batch]``
   whether they come ``[batch]`` or ``[batch, 1]`` (mobius's ReduceSum with keepdims), as the
   kernels read them;
2. the new K (after norm and RoPE) and V are quantized and dequantized by the cache
   format's rule: multiply by the float32 reciprocal of the scale, then saturate to the
   fp8 grid, or round half to even and clamp for integers;
3. a float-cache GroupQueryAttention without rotary attends; every other attribute and
   input (window, softcap, sinks, bias) is kept.

Kernel rules (``semantics``), from onnxruntime's sources:

- ``cuda``: the first prompt (``sequence_length == total_sequence_length``) attends over
  the new K/V in full precision and then stores them quantized; a later prompt chunk and
  every decode step store the new tokens first and attend over the dequantized cache. The
  first prompt's attention runs in a Loop of one iteration (none on later calls: cheaper
  per decode step than an If, whose branch runs every call).
- ``cpu``: the new tokens are quantized before attention in every phase.

Cache I/O: by default the emulated caches are float tensors of the query's dtype holding
the dequantized values ``q * scale`` (what the kernels attend to), so a step quantizes only
its new tokens and the native float kernel attends: as fast as the float model. With
``quantized_io=True`` the graph's cache inputs and outputs keep the stored format (fp8 bits,
int8, packed int4) and every step dequantizes the whole past and requantizes the present.

Rewritten: nodes whose cache format the CPU kernel lacks (fp8), whose rule differs from
``semantics`` (int8/int4 under ``cuda``), or that have q/k norm inputs. Others are kept.
Every node is checked before any is rewritten (``requires()``): a refusal is a
:class:`~onnx_kvcache.errors.KvCachePreconditionError` and leaves the model as it was.
"""

from __future__ import annotations

__all__ = [
    "SEMANTICS",
    "KvCacheEmulationPass",
    "emulate_kv_cache",
    "get_semantics",
    "needs_emulation",
]

import logging
from collections.abc import Sequence
from typing import Literal

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from onnx_kvcache.cache.formats import CacheFormat, scale_granularity
from onnx_kvcache.cache.operators import GqaInput, GqaOutput
from onnx_kvcache.cache.prompt_path import unwrap
from onnx_kvcache.cache.sites import CacheSite, find_gqa_sites
from onnx_kvcache.capabilities.table import get_capabilities
from onnx_kvcache.errors import KvCacheError, KvCachePreconditionError, Param, require_flags
from onnx_kvcache.model_io.reading import ModelLike, as_model
from onnx_kvcache.passes._base import InPlacePass, preconditions
from onnx_kvcache.passes._gqa_prologue import (
    MOVED_ATTRS,
    MOVED_INPUTS,
    Prologue,
    Step,
    prologue_opset,
    required,
)
from onnx_kvcache.passes._graph import Builder, Codec
from onnx_kvcache.passes.bfloat16_to_float import Bfloat16ToFloatPass
from onnx_kvcache.passes.fusion._window_present import follow_present_types

logger = logging.getLogger(__name__)

Semantics = Literal["cuda", "cpu"]
SEMANTICS: tuple[Semantics, ...] = ("cuda", "cpu")

_F32 = ir.DataType.FLOAT
_I64 = ir.DataType.INT64
_DROPPED_ATTRS = MOVED_ATTRS | {"k_quant_type", "v_quant_type", "kv_cache_bit_width"}


def _min_opset(site: CacheSite, quantized_io: bool) -> tuple[int, str]:
    """The default-domain opset the rewrite of ``site`` needs, and for what."""
    fmt = site.cache_format
    if fmt is not None and fmt.is_float:
        return 19, f"Cast to {fmt.dtype.name} with saturate"
    need = prologue_opset(site)
    if need[0] < 18 and fmt is not None and fmt.values_per_byte > 1 and quantized_io:
        return 18, "BitwiseAnd (unpacking)"
    return need


#: Default-domain opset raises that change no node's meaning: every operator with a new
#: version in 19 (Cast, CastLike, QuantizeLinear: ``saturate``, which acts on float8 only;
#: AveragePool: ``dilations``, default 1; Pad, Resize: one more mode; Equal, Reshape, Shape,
#: Size, Identity, Constant, If, Loop, Scan, DequantizeLinear: more types) keeps version
#: 18's behaviour for every graph valid at 18 (``onnx.defs``, since_version 19).
_EXACT_OPSET_RAISES = frozenset({(18, 19)})


def _raise_opset(model: ir.Model, sites: list[CacheSite], quantized_io: bool) -> None:
    """Raise ``model``'s default-domain opset to what emulating ``sites`` needs where that
    is exact (:data:`_EXACT_OPSET_RAISES`: an opset-18 TorchScript export's fp8 cache)."""
    have = model.opset_imports.get("", 1)
    need = max((_min_opset(s, quantized_io)[0] for s in sites), default=have)
    if need > have and (have, need) in _EXACT_OPSET_RAISES:
        logger.info("Emulation: the copy it runs imports opset %d instead of %d (exact).", need, have)
        model.opset_imports[""] = need


def get_semantics(name: str) -> Semantics:
    """Validate a kernel-rule name (``cuda`` or ``cpu``)."""
    key = str(name).lower()
    if key not in SEMANTICS:
        raise KvCacheError(f"Unknown kernel semantics {name!r}; choose one of {', '.join(SEMANTICS)}.")
    return key  # type: ignore[return-value]


def needs_emulation(site: CacheSite, semantics: Semantics) -> bool:
    """Whether the CPU kernel cannot run ``site`` as ``semantics`` asks (see the rules)."""
    cpu = get_capabilities("cpu")
    if site.input(GqaInput.Q_NORM_WEIGHT) is not None or site.input(GqaInput.K_NORM_WEIGHT) is not None:
        return not cpu.qk_norm
    fmt = site.cache_format
    if fmt is None:
        return False
    support = cpu.formats.get(fmt.name)
    return support is None or site.granularity not in support.granularities or semantics != "cpu"


def _required(site: CacheSite, slot: GqaInput) -> ir.Value:
    return required(site, slot, "emulate")


def _quantized_granularity(site: CacheSite, fmt: CacheFormat) -> str:
    granularity = site.granularity
    if granularity is None:
        attr = site.op.key.quant_attr
        raise KvCachePreconditionError(
            f"Cannot emulate GroupQueryAttention node {site.name}: its cache is {fmt.name} but its "
            f"{attr} is {site.str_attr(attr, 'NONE')!r}; set PER_TENSOR or PER_CHANNEL (and the scales), "
            "as KvCacheQuantizationPass does."
        )
    return granularity


class _Rewrite:
    """The emulated replacement of one GroupQueryAttention node.

    Construction checks and resolves everything the rewrite reads, and changes nothing (a
    refusal is a :class:`KvCachePreconditionError`); :meth:`run` only builds and replaces.
    """

    def __init__(
        self, site: CacheSite, semantics: Semantics, quantized_io: bool, steps: dict[tuple, Step]
    ) -> None:
        self.site, self.semantics, self.quantized_io = site, semantics, quantized_io
        self.steps = steps
        node = site.node
        self.b = Builder((node.name or f"gqa{site.layer_id}") + "/emulation")
        self.fmt = site.cache_format
        dtype = site.query_dtype
        if dtype is None:
            raise KvCachePreconditionError(
                f"GroupQueryAttention node {site.name}: the query has no known dtype."
            )
        self.dtype = dtype
        self.kv = site.kv_num_heads
        self.head = site.head_size()
        _required(site, GqaInput.QUERY)
        self.pasts = (_required(site, GqaInput.PAST_KEY), _required(site, GqaInput.PAST_VALUE))
        self.granularity: str | None = None
        self.scales: tuple[ir.Value, ir.Value] | None = None
        if self.fmt is not None:
            self.granularity = _quantized_granularity(site, self.fmt)
            self.scales = (_required(site, GqaInput.K_SCALE), _required(site, GqaInput.V_SCALE))
        self.prologue = Prologue(site, self.b, dtype, steps, "emulate")

    def run(self) -> None:
        site, b, fmt = self.site, self.b, self.fmt
        node = site.node
        query, key, value = self.prologue.inputs()
        query, key, step = self.prologue.apply(query, key)
        past_key, past_value = self.pasts
        stored_key, stored_value = key, value
        codecs: list[Codec] = []
        if fmt is not None:
            assert self.granularity is not None and self.scales is not None
            row = scale_granularity(self.granularity)
            heads, dims = row.grid(self.kv, self.head)
            # new tokens are [B, S, kv * head]: a scale grid other than one or all channels
            # needs the heads split out (and merged back after)
            split = (heads, dims) not in ((1, 1), (self.kv, self.head))
            scales = self.scales
            new_shape = [heads, dims] if split else [heads * dims]
            new = [
                Codec.reshaped(b, fmt, s, new_shape) if split else Codec.for_rows(b, fmt, s, heads * dims)
                for s in scales
            ]
            codecs = [Codec.reshaped(b, fmt, s, list(row.bnsh(self.kv, self.head))) for s in scales]
            stored_key, stored_value = (
                self._round_trip_new(x, codec, split) for x, codec in zip((key, value), new)
            )
            if self.quantized_io:
                past_key, past_value = (
                    codec.load(past, self.head, self.dtype)
                    for past, codec in zip((past_key, past_value), codecs)
                )
        rest = list(node.inputs[GqaInput.SEQLENS_K :])
        attrs = {name: attr for name, attr in node.attributes.items() if name not in _DROPPED_ATTRS}
        inner = self._attention(b, [query, stored_key, stored_value, past_key, past_value, *rest], attrs)
        results = list(inner)
        if fmt is not None and self.semantics == "cuda":
            results[0] = self._first_prompt(
                step, inner[0], [query, key, value, past_key, past_value, *rest], attrs
            )
        if fmt is not None and self.quantized_io:
            for slot, codec in zip((GqaOutput.PRESENT_KEY, GqaOutput.PRESENT_VALUE), codecs):
                if slot < len(results):
                    results[slot] = codec.store(inner[slot], self.head)
        self._replace(results)

    def _first_prompt(
        self, step: Step, later: ir.Value, inputs: list[ir.Value | None], attrs: dict
    ) -> ir.Value:
        """CUDA's first prompt attends over the new K/V unquantized (the cache is the same):
        the attention output is ``later`` (over the quantized K/V) except on the first
        prompt, where a Loop of one iteration attends over the raw K/V. Every other call
        runs the Loop zero times, which costs less than an If's branch run each step."""
        b, body = self.b, Builder(f"{self.b.prefix}/first_prompt")
        full = self._attention(body, inputs, attrs)[0]
        full.dtype = self.dtype
        iteration = ir.Value(name=f"{body.prefix}/iteration", type=ir.TensorType(_I64), shape=ir.Shape([]))
        go = ir.Value(name=f"{body.prefix}/cond", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
        carried = ir.Value(name=f"{body.prefix}/carried", type=ir.TensorType(self.dtype))
        again = body.op("Identity", [go], dtype=ir.DataType.BOOL)
        graph = ir.Graph(
            [iteration, go, carried], [again, full], nodes=body.nodes, name=f"{body.prefix}_graph"
        )
        if step.trips is None:
            step.trips = b.cast(step.first, _I64)  # 1 on the first prompt, else 0
        return b.op("Loop", [step.trips, None, later], dtype=self.dtype, body=graph)

    def _round_trip_new(self, x: ir.Value, codec: Codec, split: bool) -> ir.Value:
        """New tokens ``[B, S, kv * head]`` as the cache will hold them, dequantized."""
        if not split:
            return codec.round_trip(x, self.dtype)
        b = self.b
        heads = b.op("Reshape", [x, b.const(np.array([0, 0, self.kv, self.head], np.int64))], dtype=x.dtype)
        merged = b.const(np.array([0, 0, self.kv * self.head], np.int64))
        return b.op("Reshape", [codec.round_trip(heads, self.dtype), merged], dtype=self.dtype)

    def _attention(self, b: Builder, inputs: list[ir.Value | None], attrs: dict) -> Sequence[ir.Value]:
        """A float-cache GroupQueryAttention on prepared q/k/v: no rotary, norm or scales."""
        node = self.site.node
        inputs = list(inputs)
        for slot in (*MOVED_INPUTS, GqaInput.K_SCALE, GqaInput.V_SCALE):
            if slot < len(inputs):
                inputs[slot] = None
        while inputs and inputs[-1] is None:
            inputs.pop()
        return b.ops(node.op_type, inputs, len(node.outputs), node.domain, **attrs)

    def _replace(self, results: list[ir.Value]) -> None:
        node = self.site.node
        assert node.graph is not None
        olds = list(node.outputs)
        ir.convenience.replace_nodes_and_values(node.graph, node, [node], self.b.nodes, olds, results)
        if self.fmt is not None and not self.quantized_io:
            for slot in (GqaOutput.PRESENT_KEY, GqaOutput.PRESENT_VALUE):
                if slot < len(results):
                    results[slot].type = ir.TensorType(self.dtype)
                    results[slot].shape = _unpacked(olds[slot].shape, self.head)


def _unpacked(shape: ir.Shape | None, head: int) -> ir.Shape | None:
    return None if shape is None or len(shape) != 4 else ir.Shape([*shape[:3], head])


class KvCacheEmulationPass(InPlacePass):
    """Rewrite the GroupQueryAttention nodes the CPU cannot run as asked; see the module.

    Args:
        semantics: The kernel rule to compute: ``cuda`` or ``cpu``.
        quantized_io: Keep the graph's cache inputs and outputs in the stored format.
    """

    def __init__(self, semantics: str = "cuda", *, quantized_io: bool = False) -> None:
        super().__init__()
        require_flags(quantized_io=quantized_io)
        self.semantics = get_semantics(semantics)
        self.quantized_io = quantized_io

    def sites(self, model: ir.Model) -> list[CacheSite]:
        """The GroupQueryAttention nodes this pass rewrites in ``model``."""
        return [s for s in find_gqa_sites(model) if needs_emulation(s, self.semantics)]

    def requires(self, model: ir.Model) -> None:
        """Every refusal is raised here, before the model changes: a node in a function, an
        opset too old for the rewrite, an input the rewrite reads that the node lacks."""
        with preconditions():
            self._check(model)

    def _check(self, model: ir.Model) -> list[_Rewrite]:
        """The rewrites of ``model``'s sites, every one checked; nothing changes."""
        sites = self.sites(model)
        for site in sites:
            if site.function is not None:
                raise KvCachePreconditionError(
                    f"Cannot emulate {site.name}: inline the model's functions first "
                    "(onnx_ir.passes.common.InlinePass)."
                )
            fmt = site.cache_format
            need, why = _min_opset(site, self.quantized_io)
            if model.opset_imports.get("", 1) < need:
                raise KvCachePreconditionError(
                    f"Emulating {site.name} needs opset >= {need} ({why}); the model imports opset "
                    f"{model.opset_imports.get('', 1)}. Convert the model to a newer opset first "
                    "(onnxscript.version_converter)."
                )
            if not self.quantized_io and fmt is not None:
                for cache in (site.past_key, site.past_value):
                    producer = cache.producer() if cache is not None else None
                    if cache is not None and not cache.is_graph_input() and producer is None:
                        raise KvCachePreconditionError(
                            f"Cannot emulate {site.name} with float cache I/O: its cache "
                            f"{cache.name!r} is not a graph input; use ",
                            Param("quantized_io", True),
                            ".",
                        )
        steps: dict[tuple, Step] = {}
        return [_Rewrite(site, self.semantics, self.quantized_io, steps) for site in sites]

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        unwrap(model)  # the kernel's rule for every call: the node as it is, not its float prompt
        rewrites = self._check(model)
        float_io: list[tuple[ir.Value, ir.DataType, int]] = []  # caches that will hold dequantized values
        if not self.quantized_io:
            for r in rewrites:
                if r.fmt is not None:
                    float_io += [(v, r.dtype, r.head) for v in r.pasts]
        for r in rewrites:
            r.run()
        for value, dtype, head in float_io:
            if value.is_graph_input():
                value.type = ir.TensorType(dtype)
                value.shape = _unpacked(value.shape, head)
        if float_io:
            follow_present_types(model.graph)  # a rolling window's row gather (GatherND after GQA)
        if rewrites:
            model.opset_imports.setdefault("com.microsoft", 1)
        logger.info(
            "Emulation (%s rule%s): rewrote %d GroupQueryAttention node(s) for CPU.",
            self.semantics,
            ", quantized cache I/O" if self.quantized_io else "",
            len(rewrites),
        )
        return ir.passes.PassResult(model, modified=bool(rewrites))


def emulate_kv_cache(model: ModelLike, semantics: str = "cuda", *, quantized_io: bool = False) -> ir.Model:
    """A copy of ``model`` that runs on CPU under ``semantics`` (the input is unchanged).

    An opset-18 model with an fp8 cache (TorchScript exports) imports opset 19 in the copy:
    its Cast to float8 needs ``saturate``, and no operator means otherwise at 19.

    A bfloat16 model also computes in float32 (:class:`Bfloat16ToFloatPass`: the CPU has
    no bf16 kernels), and model-local functions holding nodes to emulate are inlined.
    """
    require_flags(quantized_io=quantized_io)
    copy = as_model(model).clone()
    Bfloat16ToFloatPass()(copy)
    emulation = KvCacheEmulationPass(semantics, quantized_io=quantized_io)
    _raise_opset(copy, emulation.sites(copy), quantized_io)
    if copy.functions and any(s.function is not None for s in emulation.sites(copy)):
        common_passes.InlinePass()(copy)
    emulation(copy)
    return copy
