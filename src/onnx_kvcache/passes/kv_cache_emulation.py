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
  every decode step store the new tokens first and attend over the dequantized cache.
- ``cpu``: the new tokens are quantized before attention in every phase.

Cache I/O: by default the emulated caches are float tensors of the query's dtype holding
the dequantized values ``q * scale`` (what the kernels attend to), so a step quantizes only
its new tokens and the native float kernel attends: as fast as the float model. With
``quantized_io=True`` the graph's cache inputs and outputs keep the stored format (fp8 bits,
int8, packed int4) and every step dequantizes the whole past and requantizes the present.

Rewritten: nodes whose cache format the CPU kernel lacks (fp8), whose rule differs from
``semantics`` (int8/int4 under ``cuda``), or that have q/k norm inputs. Others are kept.
Every node is checked before any is rewritten (``requires()``): a refusal is a
:class:`~onnx_kvcache.KvCachePreconditionError` and leaves the model as it was.
"""

from __future__ import annotations

__all__ = [
    "SEMANTICS",
    "KvCacheEmulationPass",
    "emulate_fp8_kv_cache",
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
from onnx_kvcache.cache.sites import CacheSite, find_gqa_sites
from onnx_kvcache.capabilities.table import get_capabilities
from onnx_kvcache.errors import KvCacheError, KvCachePreconditionError, Param
from onnx_kvcache.model_io.reading import ModelLike, as_model
from onnx_kvcache.passes._base import InPlacePass, preconditions
from onnx_kvcache.passes._graph import Builder, Codec
from onnx_kvcache.passes.bfloat16_to_float import Bfloat16ToFloatPass

logger = logging.getLogger(__name__)

Semantics = Literal["cuda", "cpu"]
SEMANTICS: tuple[Semantics, ...] = ("cuda", "cpu")

_F32 = ir.DataType.FLOAT
_I64 = ir.DataType.INT64
_DROPPED_ATTRS = frozenset(
    {
        "k_quant_type",
        "v_quant_type",
        "kv_cache_bit_width",
        "do_rotary",
        "rotary_interleaved",
        "qk_norm_epsilon",
        "q_norm_epsilon",
        "k_norm_epsilon",
    }
)


def _min_opset(site: CacheSite, quantized_io: bool) -> tuple[int, str]:
    """The default-domain opset the rewrite of ``site`` needs, and for what."""
    fmt = site.cache_format
    if fmt is not None and fmt.is_float:
        return 19, f"Cast to {fmt.dtype.name} with saturate"
    if site.input(GqaInput.Q_NORM_WEIGHT) is not None or site.input(GqaInput.K_NORM_WEIGHT) is not None:
        return 18, "ReduceMean with axes as an input (q/k norm)"
    if fmt is not None and fmt.values_per_byte > 1 and quantized_io:
        return 18, "BitwiseAnd (unpacking)"
    return 13, "Split and Unsqueeze with inputs"


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


def _rms_norm_heads(
    b: Builder, x: ir.Value, weight: ir.Value, heads: int, head: int, eps: float, dtype: ir.DataType
) -> ir.Value:
    shape = b.op("Shape", [x])
    split = b.cast(b.op("Reshape", [x, b.const(np.array([0, 0, heads, head], np.int64))]), _F32)
    mean = b.op("ReduceMean", [b.op("Mul", [split, split]), b.const(np.array([-1], np.int64))], keepdims=1)
    rms = b.op("Sqrt", [b.op("Add", [mean, b.const(np.array(eps, np.float32))])])
    normed = b.cast(b.op("Div", [split, rms], dtype=_F32), dtype)
    return b.op("Reshape", [b.op("Mul", [normed, weight]), shape], dtype=dtype)


def _float_attr(node: ir.Node, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return default if attr is None else attr.as_float()


def _required(site: CacheSite, slot: GqaInput) -> ir.Value:
    value = site.input(slot)
    if value is None:
        raise KvCachePreconditionError(
            f"Cannot emulate GroupQueryAttention node {site.name}: it has no {slot.name.lower()} "
            f"(input {int(slot)})."
        )
    return value


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


class _Step:
    """Per-call facts every node of one decoder shares: computed once, read by each layer."""

    def __init__(self, first: ir.Value, positions: ir.Value | None) -> None:
        self.first = first
        """Scalar bool: ``sequence_length == total_sequence_length`` (the kernels' test)."""
        self.positions = positions
        """Rotary positions ``[B, S]`` as the kernel derives them (None: not needed yet)."""


class _Rewrite:
    """The emulated replacement of one GroupQueryAttention node.

    Construction checks and resolves everything the rewrite reads, and changes nothing (a
    refusal is a :class:`KvCachePreconditionError`); :meth:`run` only builds and replaces.
    """

    def __init__(
        self, site: CacheSite, semantics: Semantics, quantized_io: bool, steps: dict[tuple, _Step]
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
        self.kv, self.heads = site.kv_num_heads, site.num_heads
        self.head = site.head_size()
        self.query = _required(site, GqaInput.QUERY)
        self.pasts = (_required(site, GqaInput.PAST_KEY), _required(site, GqaInput.PAST_VALUE))
        self.total = _required(site, GqaInput.TOTAL_SEQUENCE_LENGTH)
        self.granularity: str | None = None
        self.scales: tuple[ir.Value, ir.Value] | None = None
        if self.fmt is not None:
            self.granularity = _quantized_granularity(site, self.fmt)
            self.scales = (_required(site, GqaInput.K_SCALE), _required(site, GqaInput.V_SCALE))
        self.rotary: tuple[ir.Value, ir.Value] | None = None
        self.seqlens = site.input(GqaInput.SEQLENS_K)
        if site.int_attr("do_rotary"):
            self.rotary = (_required(site, GqaInput.COS_CACHE), _required(site, GqaInput.SIN_CACHE))
            if site.input(GqaInput.POSITION_IDS) is None:  # the kernel's positions need seqlens_k
                self.seqlens = _required(site, GqaInput.SEQLENS_K)

    def run(self) -> None:
        site, b, fmt = self.site, self.b, self.fmt
        node = site.node
        query = self.query
        key, value = site.input(GqaInput.KEY), site.input(GqaInput.VALUE)
        if key is None or value is None:
            sizes = b.const(
                np.array([self.heads * self.head, self.kv * self.head, self.kv * self.head], np.int64)
            )
            query, key, value = b.ops("Split", [query, sizes], 3, axis=-1)
            for x in (query, key, value):
                x.dtype = self.dtype
        query, key = self._norm(query, key)
        step = self._step(query)
        if site.int_attr("do_rotary"):
            query, key = self._rotary(query, key, step)
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
            new = [Codec.reshaped(b, fmt, s, new_shape) for s in scales]
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
            # CUDA's first prompt attends over the new K/V unquantized; the cache is the same.
            raw = Builder(f"{b.prefix}/first_prompt")
            full = self._attention(raw, [query, key, value, past_key, past_value, *rest], attrs)[0]
            later = Builder(f"{b.prefix}/later")
            same = later.op("Identity", [inner[0]])
            results[0] = b.op(
                "If",
                [step.first],
                then_branch=ir.Graph([], [full], nodes=raw.nodes, name=f"{raw.prefix}_graph"),
                else_branch=ir.Graph([], [same], nodes=later.nodes, name=f"{later.prefix}_graph"),
            )
        if fmt is not None and self.quantized_io:
            for slot, codec in zip((GqaOutput.PRESENT_KEY, GqaOutput.PRESENT_VALUE), codecs):
                if slot < len(results):
                    results[slot] = codec.store(inner[slot], self.head)
        self._replace(results)

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
        for slot in (
            GqaInput.COS_CACHE,
            GqaInput.SIN_CACHE,
            GqaInput.POSITION_IDS,
            GqaInput.K_SCALE,
            GqaInput.V_SCALE,
            GqaInput.Q_NORM_WEIGHT,
            GqaInput.K_NORM_WEIGHT,
        ):
            if slot < len(inputs):
                inputs[slot] = None
        while inputs and inputs[-1] is None:
            inputs.pop()
        return b.ops(node.op_type, inputs, len(node.outputs), node.domain, **attrs)

    def _norm(self, query: ir.Value, key: ir.Value) -> tuple[ir.Value, ir.Value]:
        site, node = self.site, self.site.node
        shared = _float_attr(node, "qk_norm_epsilon", 1e-6)
        q_norm, k_norm = site.input(GqaInput.Q_NORM_WEIGHT), site.input(GqaInput.K_NORM_WEIGHT)
        if q_norm is not None:
            eps = _float_attr(node, "q_norm_epsilon", shared)
            query = _rms_norm_heads(self.b, query, q_norm, self.heads, self.head, eps, self.dtype)
        if k_norm is not None:
            eps = _float_attr(node, "k_norm_epsilon", shared)
            key = _rms_norm_heads(self.b, key, k_norm, self.kv, self.head, eps, self.dtype)
        return query, key

    def _step(self, query: ir.Value) -> _Step:
        """The shared per-call facts for this node's inputs, built by the first node to ask."""
        site, b = self.site, self.b
        sources = (
            GqaInput.SEQLENS_K,
            GqaInput.TOTAL_SEQUENCE_LENGTH,
            GqaInput.POSITION_IDS,
            GqaInput.QUERY_SEQLENS,
        )
        key = (id(site.node.graph), *(id(site.input(slot)) for slot in sources))
        step = self.steps.get(key)
        if step is None:
            seq = b.op("Gather", [b.op("Shape", [query]), b.const(np.array(1, np.int64))], axis=0)
            total = b.cast(self.total, _I64)
            first = b.op("Equal", [seq, b.op("Reshape", [total, b.const(np.array([], np.int64))])])
            step = self.steps[key] = _Step(first, site.input(GqaInput.POSITION_IDS))
        if step.positions is None and site.int_attr("do_rotary"):
            step.positions = self._positions(query, step.first)
        return step

    def _positions(self, query: ir.Value, first: ir.Value) -> ir.Value:
        """``0..S-1`` on the first prompt, else ``seqlens_k + 1 - Q + s`` (Q: valid rows)."""
        site, b = self.site, self.b
        seq = b.op("Gather", [b.op("Shape", [query]), b.const(np.array(1, np.int64))], axis=0)
        steps = b.op("Range", [b.const(np.array(0, np.int64)), seq, b.const(np.array(1, np.int64))])
        flat = b.const(np.array([-1], np.int64))  # [batch] or [batch, 1] (ReduceSum keepdims): [batch]
        valid = seq
        if site.input(GqaInput.QUERY_SEQLENS) is not None:  # right-padded chunks
            valid = b.op("Reshape", [b.cast(site.input(GqaInput.QUERY_SEQLENS), _I64), flat])  # type: ignore[arg-type]
        assert self.seqlens is not None
        seqlens = b.op("Reshape", [b.cast(self.seqlens, _I64), flat])
        start = b.op("Sub", [b.op("Add", [seqlens, b.const(np.array(1, np.int64))]), valid])
        later = b.op("Add", [b.op("Unsqueeze", [start, b.const(np.array([1], np.int64))]), steps])
        prompt = b.op("Unsqueeze", [steps, b.const(np.array([0], np.int64))])
        return b.op("Where", [first, prompt, later])

    def _rotary(self, query: ir.Value, key: ir.Value, step: _Step) -> tuple[ir.Value, ir.Value]:
        site, b = self.site, self.b
        assert step.positions is not None and self.rotary is not None
        cos, sin = self.rotary
        rot = cos.shape[-1] * 2 if cos.shape is not None and isinstance(cos.shape[-1], int) else self.head
        extra = {"rotary_embedding_dim": rot} if rot != self.head else {}
        interleaved = site.int_attr("rotary_interleaved")
        rotated = [
            b.op(
                "RotaryEmbedding",
                [x, step.positions, cos, sin],
                domain="com.microsoft",
                dtype=self.dtype,
                interleaved=interleaved,
                num_heads=n,
                **extra,
            )
            for x, n in ((query, self.heads), (key, self.kv))
        ]
        return rotated[0], rotated[1]

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
        steps: dict[tuple, _Step] = {}
        return [_Rewrite(site, self.semantics, self.quantized_io, steps) for site in sites]

    def call(self, model: ir.Model) -> ir.passes.PassResult:
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
    copy = as_model(model).clone()
    Bfloat16ToFloatPass()(copy)
    emulation = KvCacheEmulationPass(semantics, quantized_io=quantized_io)
    _raise_opset(copy, emulation.sites(copy), quantized_io)
    if copy.functions and any(s.function is not None for s in emulation.sites(copy)):
        common_passes.InlinePass()(copy)
    emulation(copy)
    return copy


def emulate_fp8_kv_cache(model: ModelLike, semantics: str = "cuda") -> ir.Model:
    """:func:`emulate_kv_cache` keeping the graph's cache I/O in the stored format (fp8 bits).

    Every GroupQueryAttention node the CPU cannot run under ``semantics`` is rewritten,
    whatever its format (an int8 cache under ``cuda`` too).
    """
    return emulate_kv_cache(model, semantics, quantized_io=True)
