"""Run PagedAttention on CPU: rewrite each node into standard ONNX ops (the CPU reference).

onnxruntime has no CPU kernel for ``com.microsoft::PagedAttention``, for any cache type.
This pass replaces each node by the operator's documented semantics, computed in float32:

1. Q, K, V are split from the packed input when ``key`` is absent; per-head RMS norm
   (inputs 12/13, ``qk_norm_epsilon``) and RoPE follow, RoPE on channels
   ``[rotary_offset, rotary_offset + 2 * cos_cache.shape[1])`` at each token's position
   ``past_seqlens[b] + i`` (token ``i`` of sequence ``b``, found from
   ``cumulative_sequence_length``), interleaved or half-split.
2. The new K and V are written into the block pool at their slots: ``slot_mapping[t]``
   when given (``-1`` writes nothing), else ``block_table[b, pos // block_size] *
   block_size + pos % block_size``; a slot outside the pool (unmapped ``-1`` block) writes
   nothing. A quantized cache stores them by its format's rule (the emulation's codec:
   multiply by the float32 reciprocal of the scale, saturate to fp8 or round half to even
   and clamp, int4 packed two a byte): every paged kernel quantizes before attending.
3. Each sequence attends over its context, read back from the pool through ``block_table``
   (dequantized): positions ``j < past + q_len``, causal bottom-right (``j <= past + i``;
   ``is_causal=0`` drops this), within ``local_window_size`` (``j > past + i - W``), unmapped
   blocks masked. Scores are scaled (``scale``, default ``1/sqrt(head_size)``), soft-capped
   (``softcap``), and ``head_sink`` adds one logit per head to the softmax denominator.
   Query head ``h`` reads KV head ``h // (num_heads / kv_num_heads)``.
4. ``kv_cache_layout="LATENT"``: one cache; V is the leading ``v_head_size`` channels of
   the (dequantized) key cache row; the output is ``[num_tokens, num_heads * v_head_size]``.

The graph's cache inputs and outputs keep their stored types (fp8 pools are indexed as
float16, which holds every fp8 value exactly, because CPU Gather/ScatterND take no float8).
``attention_metadata`` only sizes CUDA launches and is ignored. Every node is checked before
any is rewritten (``requires()``): a refusal is a :class:`~onnx_kvcache.errors.KvCachePreconditionError`
and leaves the model as it was.
"""

from __future__ import annotations

__all__ = ["PagedAttentionReferencePass", "paged_attention_reference"]

import logging

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import scale_granularity
from onnx_kvcache.cache.operators import PAGED, CacheSide
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.errors import KvCachePreconditionError
from onnx_kvcache.model_io.reading import ModelLike, as_model
from onnx_kvcache.passes._base import InPlacePass, preconditions
from onnx_kvcache.passes._graph import Builder, Codec, ints

logger = logging.getLogger(__name__)

_F32, _I64 = ir.DataType.FLOAT, ir.DataType.INT64
#: Element types onnxruntime's CPU Gather/ScatterND take (no float8).
_INDEXABLE = frozenset(
    {
        ir.DataType.FLOAT,
        ir.DataType.FLOAT16,
        ir.DataType.BFLOAT16,
        ir.DataType.INT8,
        ir.DataType.UINT8,
    }
)
#: Default-domain opset the rewrite needs (BitwiseAnd for int4, Cast saturate for fp8).
MIN_OPSET = 19
_LOWEST = np.finfo(np.float32).min


#: The inputs every node's :class:`_Step` reads.
_STEP_INPUTS = ("cumulative_sequence_length", "past_seqlens", "block_table")


class _Step:
    """Per-call facts of one batch, shared by every node reading the same length inputs."""

    def __init__(self, b: Builder, lengths: tuple[ir.Value, ...], query: ir.Value) -> None:
        cu, past, block_table = (b.cast(x, _I64) for x in lengths)
        self.block_table = block_table
        self.past = past
        ends = b.op("Slice", [cu, *ints(b, [1], [np.iinfo(np.int64).max])])
        starts = b.op("Slice", [cu, *ints(b, [0], [-1])])
        self.total = b.op("Add", [past, b.op("Sub", [ends, starts])])
        self.max_q = b.op("ReduceMax", [b.op("Sub", [ends, starts])], keepdims=1)
        self.batch = b.op("Shape", [past], start=0, end=1)
        tokens = b.op("Gather", [b.op("Shape", [query]), b.const(np.array(0, np.int64))], axis=0)
        tok = b.op("Range", [b.const(np.array(0, np.int64)), tokens, b.const(np.array(1, np.int64))])
        before = b.op(
            "LessOrEqual",
            [b.op("Unsqueeze", [ends, *ints(b, [0])]), b.op("Unsqueeze", [tok, *ints(b, [1])])],
        )
        self.seq = b.op("ReduceSum", [b.cast(before, _I64), *ints(b, [1])], keepdims=0)
        self.offset = b.op("Sub", [tok, b.op("Gather", [starts, self.seq], axis=0)])
        self.position = b.op("Add", [b.op("Gather", [past, self.seq], axis=0), self.offset])
        self.padded = b.op(
            "Concat",
            [b.op("Unsqueeze", [self.seq, *ints(b, [1])]), b.op("Unsqueeze", [self.offset, *ints(b, [1])])],
            axis=1,
        )


def _scalar(b: Builder, value: float | int, dtype: type = np.float32) -> ir.Value:
    return b.const(np.array(value, dtype))


def _required(site: CacheSite, name: str) -> ir.Value:
    value = site.input(name)
    if value is None:
        raise KvCachePreconditionError(
            f"Cannot run {site.label} on CPU: it has no {name} (input {site.op.slot(name)})."
        )
    return value


class _Rewrite:
    """The reference replacement of one PagedAttention node.

    Construction checks and resolves everything the rewrite reads, and changes nothing (a
    refusal is a :class:`KvCachePreconditionError`); :meth:`run` only builds and replaces.
    """

    def __init__(self, site: CacheSite, steps: dict[tuple, _Step]) -> None:
        self.site = site
        self.steps = steps
        self.b = Builder((site.node.name or f"paged{site.layer_id}") + "/reference")
        dtype = site.query_dtype
        if dtype is None:
            raise KvCachePreconditionError(f"{site.label}: the query has no known dtype.")
        self.dtype = dtype
        self.heads, self.kv = site.num_heads, site.kv_num_heads
        if self.kv <= 0 or self.heads % self.kv:
            raise KvCachePreconditionError(
                f"{site.label}: num_heads {self.heads} is not a multiple of kv_num_heads {self.kv}."
            )
        self.head = site.head_size()
        self.v_head = site.v_head_size
        self.fmt = site.cache_format
        self.query = _required(site, "query")
        self.key = None if site.packed_qkv else _required(site, "key")
        self.value = None if site.packed_qkv or site.single_cache else _required(site, "value")
        self.lengths = tuple(_required(site, name) for name in _STEP_INPUTS)
        self.pasts = {side.kind: _required(site, side.past) for side in site.sides}
        for side in site.sides:
            if self.pasts[side.kind].dtype is None:
                raise KvCachePreconditionError(f"{site.label}: its {side.kind} cache has no element type.")
        self.scales: dict[str, ir.Value] = {}
        self.granularity: str | None = None
        if self.fmt is not None:
            self.granularity = site.granularity
            if self.granularity is None:
                attr = site.op.key.quant_attr
                raise KvCachePreconditionError(
                    f"Cannot run {site.label} on CPU: its cache is {self.fmt.name} but its {attr} is "
                    f"{site.str_attr(attr, 'NONE')!r}; set PER_TENSOR or PER_CHANNEL (and the scales), "
                    "as KvCacheQuantizationPass does."
                )
            self.scales = {side.kind: _required(site, side.scale) for side in site.sides}
        q_norm, k_norm = site.input("q_norm_weight"), site.input("k_norm_weight")
        if (q_norm is None) != (k_norm is None):
            raise KvCachePreconditionError(f"{site.label}: q_norm_weight and k_norm_weight come together.")
        self.norms = (q_norm, k_norm) if q_norm is not None and k_norm is not None else None
        self.rotary = self._rotary_tables() if site.int_attr("do_rotary") else None
        made = {site.op.out_slot("output"), *(site.op.out_slot(side.present) for side in site.sides)}
        if len(site.node.outputs) <= max(made):
            raise KvCachePreconditionError(
                f"Cannot run {site.label} on CPU: it has {len(site.node.outputs)} output(s), not the "
                f"output and its {len(site.sides)} present cache(s)."
            )
        for index, out in enumerate(site.node.outputs):
            if index not in made and (out.uses() or out.is_graph_output()):
                raise KvCachePreconditionError(
                    f"Cannot run {site.label} on CPU: its output {index} ({out.name!r}) is read, but "
                    f"the node keeps {len(site.sides)} cache(s) and the reference does not compute it."
                )

    def _rotary_tables(self) -> tuple[ir.Value, ir.Value, int, int]:
        """``(cos_cache, sin_cache, rotary_dim / 2, rotary_offset)``, checked."""
        site = self.site
        cos, sin = _required(site, "cos_cache"), _required(site, "sin_cache")
        if cos.shape is None or not isinstance(cos.shape[-1], int):
            raise KvCachePreconditionError(
                f"{site.label}: cos_cache needs a static last dimension (rotary_dim / 2)."
            )
        half = cos.shape[-1]
        offset = site.int_attr("rotary_offset", 0)
        if offset + 2 * half > self.head:
            raise KvCachePreconditionError(
                f"{site.label}: rotary_offset {offset} + rotary_dim {2 * half} exceeds head_size {self.head}."
            )
        return cos, sin, half, offset

    def run(self) -> None:
        site, b = self.site, self.b
        q, k, v = self._qkv()
        step = self._step()
        if self.rotary is not None:
            q, k = self._rotary(q, step), self._rotary(k, step)
        pool = self.pasts["key"]
        blocks = b.op("Shape", [pool], start=0, end=1)
        block_size = b.op("Shape", [pool], start=1, end=2)
        slots = self._slots(step, blocks, block_size)
        self._context(step, blocks, block_size)
        news = {"key": k, "value": v}
        presents: dict[str, ir.Value] = {}
        read: dict[str, ir.Value] = {}
        for side in site.sides:
            new = news[side.kind]
            assert new is not None
            presents[side.kind], read[side.kind] = self._write_and_read(side, new, slots)
        keys = read["key"]
        if site.single_cache:
            values = b.op("Slice", [keys, *ints(b, [0], [self.v_head], [-1])])
        else:
            values = read["value"]
        output = self._attend(q, keys, values, step)
        results = {site.op.out_slot("output"): output}
        for side in site.sides:
            results[site.op.out_slot(side.present)] = presents[side.kind]
        self._replace(results)

    # -- inputs -------------------------------------------------------------------

    def _qkv(self) -> tuple[ir.Value, ir.Value, ir.Value | None]:
        site, b = self.site, self.b
        heads, kv, head = self.heads, self.kv, self.head
        query = self.query
        v: ir.Value | None
        if self.key is None:
            sizes = b.const(np.array([heads * head, kv * head, kv * head], np.int64))
            q, k, v = b.ops("Split", [query, sizes], 3, axis=-1)
        else:
            q, k, v = query, self.key, self.value
        q = b.op("Reshape", [b.cast(q, _F32), *ints(b, [0, heads, head])], dtype=_F32)
        k = b.op("Reshape", [b.cast(k, _F32), *ints(b, [0, kv, head])], dtype=_F32)
        if v is not None:
            v = b.op("Reshape", [b.cast(v, _F32), *ints(b, [0, kv, head])], dtype=_F32)
        if self.norms is not None:
            q_norm, k_norm = self.norms
            eps = site.float_attr("qk_norm_epsilon", 1e-6)
            q, k = self._rms_norm(q, q_norm, eps), self._rms_norm(k, k_norm, eps)
        return q, k, v

    def _rms_norm(self, x: ir.Value, weight: ir.Value, eps: float) -> ir.Value:
        b = self.b
        mean = b.op("ReduceMean", [b.op("Mul", [x, x]), *ints(b, [-1])], keepdims=1)
        rms = b.op("Sqrt", [b.op("Add", [mean, _scalar(b, eps)])])
        return b.op("Mul", [b.op("Div", [x, rms]), b.cast(weight, _F32)], dtype=_F32)

    def _step(self) -> _Step:
        key = (id(self.site.node.graph), *(id(x) for x in self.lengths))
        if key not in self.steps:
            self.steps[key] = _Step(self.b, self.lengths, self.query)
        return self.steps[key]

    def _rotary(self, x: ir.Value, step: _Step) -> ir.Value:
        site, b = self.site, self.b
        assert self.rotary is not None
        cos, sin, half, offset = self.rotary
        c, s = (
            b.op("Unsqueeze", [b.cast(b.op("Gather", [t, step.position], axis=0), _F32), *ints(b, [1])])
            for t in (cos, sin)
        )
        parts = []
        if offset:
            parts.append(b.op("Slice", [x, *ints(b, [0], [offset], [-1])]))
        rot = b.op("Slice", [x, *ints(b, [offset], [offset + 2 * half], [-1])])
        if site.int_attr("rotary_interleaved"):
            pairs = b.op("Reshape", [rot, *ints(b, [0, 0, half, 2])])
            a, z = (
                b.op("Squeeze", [p, *ints(b, [-1])])
                for p in b.ops("Split", [pairs], 2, axis=-1, num_outputs=2)
            )
            first = b.op("Sub", [b.op("Mul", [a, c]), b.op("Mul", [z, s])])
            second = b.op("Add", [b.op("Mul", [z, c]), b.op("Mul", [a, s])])
            stacked = b.op(
                "Concat", [b.op("Unsqueeze", [t, *ints(b, [-1])]) for t in (first, second)], axis=-1
            )
            parts.append(b.op("Reshape", [stacked, *ints(b, [0, 0, 2 * half])]))
        else:
            a, z = b.ops("Split", [rot], 2, axis=-1, num_outputs=2)
            parts.append(b.op("Sub", [b.op("Mul", [a, c]), b.op("Mul", [z, s])]))
            parts.append(b.op("Add", [b.op("Mul", [z, c]), b.op("Mul", [a, s])]))
        if offset + 2 * half < self.head:
            parts.append(b.op("Slice", [x, *ints(b, [offset + 2 * half], [self.head], [-1])]))
        return parts[0] if len(parts) == 1 else b.op("Concat", parts, axis=-1, dtype=_F32)

    # -- the cache ------------------------------------------------------------------

    def _codec(self, side: CacheSide) -> Codec | None:
        if self.fmt is None:
            return None
        assert self.granularity is not None
        shape = list(scale_granularity(self.granularity).grid(self.kv, self.head))
        scale = self.scales[side.kind]
        return Codec.reshaped(self.b, self.fmt, scale, shape)

    def _write_and_read(self, side: CacheSide, new: ir.Value, slots: ir.Value) -> tuple[ir.Value, ir.Value]:
        """Store ``new`` [T, kv, D] at ``slots``; returns (present pool, context [B, C, kv, D] f32)."""
        b, fmt = self.b, self.fmt
        past = self.pasts[side.kind]
        stored = past.dtype
        assert stored is not None
        work = stored if stored in _INDEXABLE else ir.DataType.FLOAT16
        width = fmt.packed_dim(self.head) if fmt is not None else self.head
        codec = self._codec(side)
        updates = codec.store(new, self.head) if codec is not None else b.cast(new, stored)
        updates = b.cast(updates, work)
        rows = b.op("Reshape", [self._rows, *ints(b, [1])])
        flat = b.op(
            "Reshape", [b.cast(past, work), b.op("Concat", [rows, *ints(b, [self.kv, width])], axis=0)]
        )
        spare = b.const(np.zeros((1, self.kv, width), work.numpy()))  # where skipped tokens write
        extended = b.op("Concat", [flat, spare], axis=0)
        indices = b.op("Unsqueeze", [slots, *ints(b, [1])])
        pool = b.op(
            "Slice", [b.op("ScatterND", [extended, indices, updates]), *ints(b, [0]), rows, *ints(b, [0])]
        )
        present = b.cast(b.op("Reshape", [pool, b.op("Shape", [past])]), stored)
        context = b.op("Gather", [pool, self._context_rows], axis=0)
        values = codec.load(context, self.head, _F32) if codec is not None else b.cast(context, _F32)
        return present, values

    def _slots(self, step: _Step, blocks: ir.Value, block_size: ir.Value) -> ir.Value:
        """Pool row of each new token; the spare row past the pool when it writes nothing."""
        site, b = self.site, self.b
        self._rows = rows = b.op("Squeeze", [b.op("Mul", [blocks, block_size])])
        mapping = site.input("slot_mapping")
        zero = b.const(np.array(0, np.int64))
        if mapping is not None:
            slot = b.cast(mapping, _I64)
            valid = b.op("And", [b.op("GreaterOrEqual", [slot, zero]), b.op("Less", [slot, rows])])
            return b.op("Where", [valid, slot, rows])
        width = b.op("Shape", [step.block_table], start=1, end=2)
        index = b.op("Div", [step.position, block_size])
        inside = b.op("Less", [index, width])
        clamped = b.op("Min", [index, b.op("Sub", [width, b.const(np.array([1], np.int64))])])
        pair = b.op(
            "Concat",
            [b.op("Unsqueeze", [step.seq, *ints(b, [1])]), b.op("Unsqueeze", [clamped, *ints(b, [1])])],
            axis=1,
        )
        block = b.op("GatherND", [step.block_table, pair])
        mapped = b.op("And", [b.op("GreaterOrEqual", [block, zero]), b.op("Less", [block, blocks])])
        slot = b.op("Add", [b.op("Mul", [block, block_size]), b.op("Mod", [step.position, block_size])])
        return b.op("Where", [b.op("And", [inside, mapped]), slot, rows])

    def _context(self, step: _Step, blocks: ir.Value, block_size: ir.Value) -> None:
        """Context positions ``j`` [C] (``C = max_num_blocks * block_size``), whether each
        sequence's block holding ``j`` is mapped [B, C], and its pool row [B, C]."""
        b = self.b
        width = b.op("Shape", [step.block_table], start=1, end=2)
        length = b.op("Squeeze", [b.op("Mul", [width, block_size])])
        j = b.op("Range", [b.const(np.array(0, np.int64)), length, b.const(np.array(1, np.int64))])
        block = b.op("Gather", [step.block_table, b.op("Div", [j, block_size])], axis=1)
        zero = b.const(np.array(0, np.int64))
        mapped = b.op("And", [b.op("GreaterOrEqual", [block, zero]), b.op("Less", [block, blocks])])
        row = b.op("Add", [b.op("Mul", [block, block_size]), b.op("Mod", [j, block_size])])
        self._positions, self._mapped = j, mapped
        self._context_rows = b.op("Where", [mapped, row, zero])

    # -- attention ------------------------------------------------------------------

    def _mask(self, step: _Step) -> ir.Value:
        """``[B, 1, max_q, C]``: which context positions each (padded) query row attends to."""
        site, b = self.site, self.b
        j = b.op("Unsqueeze", [self._positions, *ints(b, [0, 1])])  # [1, 1, C]
        i = b.op(
            "Range",
            [b.const(np.array(0, np.int64)), b.op("Squeeze", [step.max_q]), b.const(np.array(1, np.int64))],
        )
        p = b.op(
            "Add", [b.op("Unsqueeze", [step.past, *ints(b, [1])]), b.op("Unsqueeze", [i, *ints(b, [0])])]
        )
        p = b.op("Unsqueeze", [p, *ints(b, [2])])  # [B, max_q, 1]
        total = b.op("Unsqueeze", [step.total, *ints(b, [1, 2])])
        allowed = b.op("And", [b.op("Less", [j, total]), b.op("Unsqueeze", [self._mapped, *ints(b, [1])])])
        if site.int_attr("is_causal", 1):
            allowed = b.op("And", [allowed, b.op("LessOrEqual", [j, p])])
        window = site.int_attr("local_window_size", -1)
        if window > 0:
            start = b.op("Sub", [p, b.const(np.array(window, np.int64))])
            allowed = b.op("And", [allowed, b.op("Greater", [j, start])])
        return b.op("Unsqueeze", [allowed, *ints(b, [1])])

    def _attend(self, q: ir.Value, keys: ir.Value, values: ir.Value, step: _Step) -> ir.Value:
        site, b = self.site, self.b
        heads, kv, head, v_head = self.heads, self.kv, self.head, self.v_head
        dims = b.op("Concat", [step.batch, step.max_q, *ints(b, [heads, head])], axis=0)
        zeros = b.op("ConstantOfShape", [dims], value=ir.tensor(np.zeros(1, np.float32)))
        padded = b.op("ScatterND", [zeros, step.padded, q])  # [B, max_q, H, D]
        grouped = b.op(
            "Reshape", [b.op("Transpose", [padded], perm=[0, 2, 1, 3]), *ints(b, [0, kv, -1, head])]
        )
        scores = b.op("MatMul", [grouped, b.op("Transpose", [keys], perm=[0, 2, 3, 1])])
        scores = b.op("Reshape", [scores, *ints(b, [0, heads, -1, 0])])  # [B, H, max_q, C]
        scale = site.float_attr("scale", 0.0) or 1.0 / np.sqrt(head)
        scores = b.op("Mul", [scores, _scalar(b, scale)])
        softcap = site.float_attr("softcap", 0.0)
        if softcap > 0:
            capped = b.op("Tanh", [b.op("Div", [scores, _scalar(b, softcap)])])
            scores = b.op("Mul", [capped, _scalar(b, softcap)])
        scores = b.op("Where", [self._mask(step), scores, _scalar(b, _LOWEST)])
        sink = site.input("head_sink")
        if sink is not None:
            column = b.op("Reshape", [b.cast(sink, _F32), *ints(b, [1, heads, 1, 1])])
            shape = b.op("Concat", [b.op("Shape", [scores], start=0, end=3), *ints(b, [1])], axis=0)
            scores = b.op("Concat", [scores, b.op("Expand", [column, shape])], axis=-1)
        probs = b.op("Softmax", [scores], axis=-1)
        if sink is not None:
            probs = b.op("Slice", [probs, *ints(b, [0], [-1], [-1])])
        probs = b.op("Reshape", [probs, *ints(b, [0, kv, -1, 0])])
        context = b.op("MatMul", [probs, b.op("Transpose", [values], perm=[0, 2, 1, 3])])
        context = b.op("Reshape", [context, *ints(b, [0, heads, -1, v_head])])
        rows = b.op("GatherND", [b.op("Transpose", [context], perm=[0, 2, 1, 3]), step.padded])
        output = b.op("Reshape", [rows, *ints(b, [0, heads * v_head])], dtype=_F32)
        return b.cast(output, self.dtype)

    def _replace(self, results: dict[int, ir.Value]) -> None:
        node = self.site.node
        assert node.graph is not None
        olds = [node.outputs[i] for i in results]
        news = list(results.values())
        ir.convenience.replace_nodes_and_values(node.graph, node, [node], self.b.nodes, olds, news)


class PagedAttentionReferencePass(InPlacePass):
    """Rewrite every PagedAttention node into standard ONNX ops; see the module."""

    def requires(self, model: ir.Model) -> None:
        """Every refusal is raised here, before the model changes: a node in a function, an
        opset too old for the rewrite, an input or shape the rewrite needs that is missing."""
        with preconditions():
            self._check(model)

    def _check(self, model: ir.Model) -> list[_Rewrite]:
        """The rewrites of ``model``'s PagedAttention nodes, every one checked; nothing changes."""
        sites = find_attention_sites(model, ops=(PAGED,))
        for site in sites:
            if site.function is not None:
                raise KvCachePreconditionError(
                    f"Cannot rewrite {site.label}: inline the model's functions first "
                    "(onnx_ir.passes.common.InlinePass)."
                )
        if sites and model.opset_imports.get("", 1) < MIN_OPSET:
            raise KvCachePreconditionError(
                f"The PagedAttention CPU reference needs opset >= {MIN_OPSET}; the model imports "
                f"opset {model.opset_imports.get('', 1)}."
            )
        steps: dict[tuple, _Step] = {}
        return [_Rewrite(site, steps) for site in sites]

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        rewrites = self._check(model)
        for rewrite in rewrites:
            rewrite.run()
        logger.info("PagedAttention CPU reference: rewrote %d node(s).", len(rewrites))
        return ir.passes.PassResult(model, modified=bool(rewrites))


def paged_attention_reference(model: ModelLike) -> ir.Model:
    """A copy of ``model`` whose PagedAttention nodes run on CPU (the input is unchanged)."""
    copy = as_model(model).clone()
    PagedAttentionReferencePass()(copy)
    return copy
