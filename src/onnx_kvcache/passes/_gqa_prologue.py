"""A GroupQueryAttention node's prologue outside the node: what the kernel does to Q and K
before it attends, written as ONNX and com.microsoft operators.

Rules, from onnxruntime's GroupQueryAttention kernels:

1. Packed QKV (no key input) is split into query, key and value (``num_heads``,
   ``kv_num_heads``, ``kv_num_heads`` heads of the head size).
2. q/k RMS norm (inputs 14/15) per head: ``x / sqrt(mean(x^2) + eps) * weight`` in float32,
   ``q_norm_epsilon``/``k_norm_epsilon`` (else ``qk_norm_epsilon``, else 1e-6).
3. RoPE (``do_rotary=1``) after the norms, as com.microsoft ``RotaryEmbedding`` with the
   node's cos/sin tables and ``rotary_interleaved``, at the kernel's positions: ``0..S-1`` on
   the first prompt (``sequence_length == total_sequence_length``), else
   ``seqlens_k + 1 - Q + s`` (``Q``: the chunk's valid rows, ``query_seqlens`` when given, else
   ``S``), or ``position_ids`` when given. ``seqlens_k`` and ``query_seqlens`` are read as
   ``[batch]`` whether they come ``[batch]`` or ``[batch, 1]`` (mobius's ReduceSum with
   keepdims), as the kernels read them.

Per-call facts every layer shares (the first-prompt test, the positions) are built once per
graph and set of source values (:class:`Step`). The emulation pass and the rotation pass
build on this; neither copies it.
"""

from __future__ import annotations

__all__ = ["MOVED_ATTRS", "MOVED_INPUTS", "Prologue", "Step", "prologue_opset", "required"]

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.operators import GqaInput
from onnx_kvcache.cache.sites import CacheSite
from onnx_kvcache.errors import KvCachePreconditionError
from onnx_kvcache.passes._graph import Builder

_F32 = ir.DataType.FLOAT
_I64 = ir.DataType.INT64

#: What the prologue takes over from the node: these inputs and attributes are dropped from it.
MOVED_INPUTS = (
    GqaInput.COS_CACHE,
    GqaInput.SIN_CACHE,
    GqaInput.POSITION_IDS,
    GqaInput.Q_NORM_WEIGHT,
    GqaInput.K_NORM_WEIGHT,
)
MOVED_ATTRS = frozenset(
    {"do_rotary", "rotary_interleaved", "qk_norm_epsilon", "q_norm_epsilon", "k_norm_epsilon"}
)


def required(site: CacheSite, slot: GqaInput, doing: str = "emulate") -> ir.Value:
    """The node's input ``slot``, or a refusal naming it."""
    value = site.input(slot)
    if value is None:
        raise KvCachePreconditionError(
            f"Cannot {doing} GroupQueryAttention node {site.name}: it has no {slot.name.lower()} "
            f"(input {int(slot)})."
        )
    return value


def _rotary_width(site: CacheSite, cos: ir.Value, doing: str) -> int:
    """The channels RoPE turns (``2 * cos_cache.shape[-1]``: partial rotary below the head
    size), or a refusal when that width is not a static int (it cannot be told from full)."""
    width = cos.shape[-1] if cos.shape is not None and len(cos.shape) else None
    if not isinstance(width, int):
        raise KvCachePreconditionError(
            f"Cannot {doing} GroupQueryAttention node {site.name}: its cos_cache's last dimension "
            f"({width}) is not a static int, so how many channels RoPE turns is unknown; give "
            "cos_cache and sin_cache static shapes (they are constants in exported models)."
        )
    return 2 * width


def prologue_opset(site: CacheSite) -> tuple[int, str]:
    """The default-domain opset the prologue of ``site`` needs, and for what."""
    if site.input(GqaInput.Q_NORM_WEIGHT) is not None or site.input(GqaInput.K_NORM_WEIGHT) is not None:
        return 18, "ReduceMean with axes as an input (q/k norm)"
    return 13, "Split and Unsqueeze with inputs"


def _float_attr(node: ir.Node, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return default if attr is None else attr.as_float()


def _rms_norm_heads(
    b: Builder, x: ir.Value, weight: ir.Value, heads: int, head: int, eps: float, dtype: ir.DataType
) -> ir.Value:
    shape = b.op("Shape", [x])
    split = b.cast(b.op("Reshape", [x, b.const(np.array([0, 0, heads, head], np.int64))]), _F32)
    mean = b.op("ReduceMean", [b.op("Mul", [split, split]), b.const(np.array([-1], np.int64))], keepdims=1)
    rms = b.op("Sqrt", [b.op("Add", [mean, b.const(np.array(eps, np.float32))])])
    normed = b.cast(b.op("Div", [split, rms], dtype=_F32), dtype)
    return b.op("Reshape", [b.op("Mul", [normed, weight]), shape], dtype=dtype)


class Step:
    """Per-call facts every node of one decoder shares: computed once, read by each layer."""

    def __init__(self, first: ir.Value, positions: ir.Value | None, seq: ir.Value) -> None:
        self.seq = seq
        """Scalar int64: the call's new tokens (the query's sequence length)."""
        self.first = first
        """Scalar bool: ``sequence_length == total_sequence_length`` (the kernels' test)."""
        self.positions = positions
        """Rotary positions ``[B, S]`` as the kernel derives them (None: not needed yet)."""
        self.trips: ir.Value | None = None
        """int64 ``first`` (the emulation's first-prompt Loop's trip count; None: not needed yet)."""


class Prologue:
    """The prologue of one node, written into a :class:`Builder`.

    Construction resolves every input the prologue reads (a refusal is a
    :class:`KvCachePreconditionError`) and builds nothing; the methods build.
    """

    def __init__(
        self, site: CacheSite, b: Builder, dtype: ir.DataType, steps: dict[tuple, Step], doing: str
    ) -> None:
        self.site, self.b, self.dtype, self.steps, self.doing = site, b, dtype, steps, doing
        self.kv, self.heads = site.kv_num_heads, site.num_heads
        self.head = site.head_size()
        self.total = required(site, GqaInput.TOTAL_SEQUENCE_LENGTH, doing)
        self.rotary: tuple[ir.Value, ir.Value] | None = None
        self.seqlens = site.input(GqaInput.SEQLENS_K)
        if site.int_attr("do_rotary"):
            self.rotary = (
                required(site, GqaInput.COS_CACHE, doing),
                required(site, GqaInput.SIN_CACHE, doing),
            )
            _rotary_width(site, self.rotary[0], doing)  # refused before a node is written
            if site.input(GqaInput.POSITION_IDS) is None:  # the kernel's positions need seqlens_k
                self.seqlens = required(site, GqaInput.SEQLENS_K, doing)

    @property
    def moves_anything(self) -> bool:
        """Whether the node applies RoPE or a q/k norm itself."""
        site = self.site
        return self.rotary is not None or any(site.input(s) is not None for s in MOVED_INPUTS[3:])

    def split(self, query: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
        """Packed QKV ``[B, S, (N + 2 KV) * H]`` as query, key and value (rule 1)."""
        b = self.b
        sizes = b.const(
            np.array([self.heads * self.head, self.kv * self.head, self.kv * self.head], np.int64)
        )
        query, key, value = b.ops("Split", [query, sizes], 3, axis=-1)
        for x in (query, key, value):
            x.dtype = self.dtype
        return query, key, value

    def inputs(self) -> tuple[ir.Value, ir.Value, ir.Value]:
        """The node's query, key and value (split when packed)."""
        site = self.site
        query = required(site, GqaInput.QUERY, self.doing)
        key, value = site.input(GqaInput.KEY), site.input(GqaInput.VALUE)
        if key is None or value is None:
            return self.split(query)
        return query, key, value

    def apply(self, query: ir.Value, key: ir.Value) -> tuple[ir.Value, ir.Value, Step]:
        """Query and key after the node's norms and RoPE (rules 2 and 3), and the step facts."""
        query, key = self.norms(query, key)
        step = self.step(query)
        if self.rotary is not None:
            query, key = self.rope(query, self.heads, step), self.rope(key, self.kv, step)
        return query, key, step

    @property
    def has_norms(self) -> bool:
        site = self.site
        return (
            site.input(GqaInput.Q_NORM_WEIGHT) is not None or site.input(GqaInput.K_NORM_WEIGHT) is not None
        )

    def norms(self, query: ir.Value, key: ir.Value) -> tuple[ir.Value, ir.Value]:
        """Query and key after the node's q/k RMS norms (rule 2; as given without)."""
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

    def step(self, query: ir.Value) -> Step:
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
            step = self.steps[key] = Step(first, site.input(GqaInput.POSITION_IDS), seq)
        if step.positions is None and self.rotary is not None:
            step.positions = self._positions(step.seq, step.first)
        return step

    def _positions(self, seq: ir.Value, first: ir.Value) -> ir.Value:
        """``0..S-1`` on the first prompt, else ``seqlens_k + 1 - Q + s`` (Q: valid rows)."""
        site, b = self.site, self.b
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

    def rope(self, x: ir.Value, heads: int, step: Step) -> ir.Value:
        """``x`` ``[B, S, heads * H]`` through the node's RoPE (rule 3): every head at the same
        positions, so query and key heads side by side may take one node."""
        site, b = self.site, self.b
        assert step.positions is not None and self.rotary is not None
        cos, sin = self.rotary
        rot = _rotary_width(site, cos, "rotate")
        extra = {"rotary_embedding_dim": rot} if rot != self.head else {}
        return b.op(
            "RotaryEmbedding",
            [x, step.positions, cos, sin],
            domain="com.microsoft",
            dtype=self.dtype,
            interleaved=site.int_attr("rotary_interleaved"),
            num_heads=heads,
            **extra,
        )
