"""What an attention fusion proves about one attention, and how it writes the GQA node.

The fusion passes (:mod:`onnx_kvcache.passes.fusion.attention_fusion`, ...) match an
exporter's attention and build an :class:`AttentionMatch` from facts proven with
:mod:`onnx_kvcache.passes.fusion._symbolic`; :class:`GqaWriter` then replaces it with one
``com.microsoft::GroupQueryAttention`` node. The proofs of the rules below (cache, mask,
shapes) are :mod:`onnx_kvcache.passes.fusion._attention_facts` (re-exported here); this module
writes the node. The rules:

- **Cache.** K and V are ``Concat(past, new)`` on the sequence axis, ``past`` an input
  and the concatenation an output of the graph (maybe through Identity; read otherwise
  only by Shape), reaching
  attention directly or through transformers' ``repeat_kv`` (Unsqueeze at axis 2,
  Expand of that axis only, Reshape folding it into the head axis: query head ``h``
  reads KV head ``h // group``, as GQA does). Or a cropped sliding-window cache
  (:class:`WindowCache`): ``Concat(Slice(past, -crop), new)`` read by attention, its
  ``Slice(-keep)`` the present; GQA then reads the export's past (never longer than ``keep``
  when fed its presents) and a per-row gather after it gives the export's present
  (:mod:`~onnx_kvcache.passes.fusion._window_present`).
- **Mask.** The mask condition, over batch ``b``, query row ``i``, key column ``j`` and
  cache length ``P``, is exactly ``j <= P + i`` AND ``attention_mask[b, j]`` and
  optionally ``j > P + i - W`` (GQA's ``local_window_size = W``). Without the padding
  term, the attention ignores the attention mask and so does the fused node.
- **Positions counted from the mask** (mobius's gemma3, granite, olmo2, smollm3, gpt-oss): with
  ``c = CumSum(attention_mask)`` along the columns, the query's position ``c[b, P + i]``
  compared with the key's ``c[b, j]``. With entries 0 or 1 (an attention mask's contract:
  this proof assumes it, the others read any nonzero entry as a token and assume nothing
  of the values) and ``attention_mask[b, j]`` in the condition, ``c[b, P + i] >= c[b, j]``
  is exactly ``j <= P + i`` (a later valid key counts at least one more). And
  ``c[b, P + i] - c[b, j] < W`` counts the valid tokens in ``(j, P + i]``: for a valid key
  and query that is the distance of their compacted positions ``c - 1``, which is where
  the fusion puts each row's valid tokens (below), so it is exactly GQA's
  ``local_window_size = W`` over its cache, for any padding (a padding query's row is not
  a token's: its output is not compared, as for every padding mask). A window counted so
  is not combined with a window of key indices.
- **Shapes.** 4-D (BNSH) Q, K, V; static head counts; a head size that is a multiple
  of 8 (GQA's requirement), the same for V. (An ONNX ``Attention`` holding its own cache
  may take 3-D (BSH) Q, K, V, which GQA reads as they are, and its output is BSH.)

GQA takes ``seqlens_k = max(sum(attention_mask != 0, axis=1) - 1, 0)`` (a row without a token
reads as one, which only padding attends to) and
``total_sequence_length = attention_mask.shape[1]``, computed once per graph. GQA reads a
row's valid tokens as its first ones, so with a padding mask the node receives the new
tokens reordered, each row's valid ones first (a stable order, computed once per graph),
and its output is put back in the caller's order: a left-padded prompt is then computed
as the same prompt right-padded, and the cache holds each row's valid tokens compacted at
its start. Rotary embeddings and q/k norms stay where the exporter put them
(``do_rotary=0``): the node receives K already rotated, as the export's cache holds it.
The attention output's ``Reshape(Transpose(y, [0, 2, 1, 3]), [B, S, heads * head])`` reads
GQA's BSH output itself, ``y`` also reached through Reshapes proven to keep its shape
(transformers 5's TorchScript export writes one, its shape read from the repeated V); any
other reader reads the output turned back to BNSH. What only the replaced nodes read goes
with them (the repeat_kv chains, the shape computations).
"""

from __future__ import annotations

__all__ = [
    "AttentionMatch",
    "CacheLink",
    "GqaWriter",
    "MaskFacts",
    "WindowCache",
    "cache_link",
    "cache_mask_facts",
    "counted_tie",
    "mask_condition",
    "mask_facts",
    "running_count",
]

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.operators import GQA, GqaInput, GqaOutput
from onnx_kvcache.passes._graph import insert

# The facts a fusion proves live in _attention_facts; their old import path is this module.
from onnx_kvcache.passes.fusion._attention_facts import (
    ATTENTION_DTYPES,  # noqa: F401
    KEY,  # noqa: F401
    QUERY,  # noqa: F401
    AttentionMatch,
    CacheLink,
    MaskFacts,
    WindowCache,
    _producer,
    _strip_repeat,  # noqa: F401
    cache_link,
    cache_mask_facts,
    check_head_sizes,  # noqa: F401
    check_shapes,  # noqa: F401
    counted_tie,
    key_columns,  # noqa: F401
    mask_condition,
    mask_facts,
    running_count,
)
from onnx_kvcache.passes.fusion._reads import is_copy, tiled_order
from onnx_kvcache.passes.fusion._symbolic import (
    Affine,
    SymbolicEvaluator,
    SymbolKind,
    Unprovable,
)
from onnx_kvcache.passes.fusion._window_present import last_rows, row_indices


@dataclasses.dataclass(frozen=True)
class PaddingOrder:
    """Token indices (int64 ``[batch, seq]``) of a padding mask's reorder."""

    gather: ir.Value
    """Flat indices into ``[batch * seq, width]`` putting each row's valid tokens first."""
    scatter: ir.Value
    """Flat indices putting them back."""
    inverse: ir.Value
    """Per-row positions putting them back (``scatter`` before flattening)."""


class GqaWriter:
    """Writes GroupQueryAttention nodes into a graph.

    ``seqlens_k`` and ``total_sequence_length`` are computed once per padding input;
    BNSH -> BSH conversions reuse the exporter's own 3-D projections where the
    Reshape/Transpose in between is proven to split the last axis into heads.
    """

    PREFIX = "/gqa_fusion"

    def __init__(self, graph: ir.Graph, ev: SymbolicEvaluator) -> None:
        self.graph = graph
        self.ev = ev
        self._lengths: dict[str, tuple[ir.Value, ir.Value]] = {}
        self._valid: dict[str, ir.Value] = {}
        self._order: dict[str, PaddingOrder] = {}
        self._bsh: dict[int, ir.Value] = {}
        self._rows: dict[tuple[str | None, str | None, int], ir.Value] = {}
        self._consts: dict[tuple[str, tuple[int, ...], bytes], ir.Value] = {}
        self._counter = 0

    def _name(self, base: str) -> str:
        self._counter += 1
        return f"{self.PREFIX}/{base}_{self._counter}"

    def _add(
        self, before: ir.Node, op_type: str, inputs: Sequence[ir.Value | None], name: str, **attrs
    ) -> ir.Value:
        return insert(self.graph, before, op_type, inputs, self._name(name), **attrs)

    def _const(self, before: ir.Node, array: np.ndarray, name: str) -> ir.Value:
        """A Constant of ``array``, one per value and type in the graph (sites are written in
        graph order, so the first is before every later reader)."""
        key = (array.dtype.str, array.shape, array.tobytes())
        made = self._consts.get(key)
        if made is None:
            made = self._consts[key] = self._add(before, "Constant", [], name, value=ir.tensor(array))
        return made

    def lengths(self, site: AttentionMatch) -> tuple[ir.Value, ir.Value]:
        """(seqlens_k int32 [batch], total_sequence_length int32 scalar) for the site."""
        key = self._padding_key(site) or f"shape:{self.ev.shape(site.key.past)[2]}"
        if key in self._lengths:
            return self._lengths[key]
        at = site.node
        if site.mask.padding is not None:
            mask = self._padding_mask(site, at)
            # The export reads any nonzero entry as a valid token: count those, not the values.
            zero = self._const(
                at, np.array(0, (mask.dtype or ir.DataType.INT64).numpy()), "attention_mask/zero"
            )
            valid_tokens = self._add(
                at,
                "Not",
                [self._add(at, "Equal", [mask, zero], "attention_mask/Equal")],
                "attention_mask/Not",
            )
            self._valid[key] = valid_tokens
            counted = self._add(at, "Cast", [valid_tokens], "attention_mask/Cast", to=ir.DataType.INT64)
            counted.dtype = ir.DataType.INT64
            one = self._const(at, np.array(1, np.int64), "attention_mask/one")
            axes = self._const(at, np.array([1], np.int64), "attention_mask/axes")
            valid = self._add(at, "ReduceSum", [counted, axes], "attention_mask/ReduceSum", keepdims=0)
            floor = self._const(at, np.array(0, np.int64), "attention_mask/floor")
            last = self._add(  # a row with no token yet (a free slot of a batch) reads as one
                at,
                "Max",
                [self._add(at, "Sub", [valid, one], "attention_mask/Sub"), floor],
                "attention_mask/Max",
            )
            seqlens = self._add(at, "Cast", [last], "attention_mask/seqlens_k", to=ir.DataType.INT32)
            width = self._add(at, "Shape", [mask], "attention_mask/Shape", start=1, end=2)
        else:
            past = self._add(at, "Shape", [site.key.past], "cache/past_length", start=2, end=3)
            axis = _seq_axis(self.ev, site.query)
            new = self._add(at, "Shape", [site.query], "cache/new_length", start=axis, end=axis + 1)
            width = self._add(at, "Add", [past, new], "cache/total")
            batch = self._add(at, "Shape", [site.query], "cache/batch", start=0, end=1)
            one = self._const(at, np.array([1], np.int64), "cache/one")
            last = self._add(
                at, "Expand", [self._add(at, "Sub", [width, one], "cache/last"), batch], "cache/rows"
            )
            seqlens = self._add(at, "Cast", [last], "cache/seqlens_k", to=ir.DataType.INT32)
        scalar = self._add(at, "Squeeze", [width], "attention_mask/total")
        total = self._add(at, "Cast", [scalar], "attention_mask/total_sequence_length", to=ir.DataType.INT32)
        seqlens.dtype, total.dtype = ir.DataType.INT32, ir.DataType.INT32
        self._lengths[key] = (seqlens, total)
        return seqlens, total

    def rolling_lengths(self, site: AttentionMatch) -> tuple[ir.Value, ir.Value]:
        """(seqlens_k, total_sequence_length) of a rolling window cache's GQA: its cache is the
        export's (``P`` rows, at most ``W - 1``, each row's tokens compacted at its start), so the
        total is ``P + S`` (``Min(mask width, P + S)``) and a row holds ``min(its tokens so far,
        P + its new ones)`` (``Max(Min(seqlens_k, P + query_seqlens - 1), 0)``)."""
        key = f"{self._padding_key(site)}|rolling:{self.ev.shape(site.key.past)[2]}"
        if key in self._lengths:
            return self._lengths[key]
        every, width = self.lengths(site)
        new = self.query_lengths(site)
        at = site.node
        axis = _seq_axis(self.ev, site.query)
        past = self._add(at, "Shape", [site.key.past], "rolling/past_length", start=2, end=3)
        query = self._add(at, "Shape", [site.query], "rolling/new_length", start=axis, end=axis + 1)
        span = self._add(at, "Squeeze", [self._add(at, "Add", [past, query], "rolling/span")], "rolling/s")
        span = self._add(at, "Cast", [span], "rolling/span32", to=ir.DataType.INT32)
        total = self._add(at, "Min", [width, span], "rolling/total_sequence_length")
        one = self._const(at, np.array(1, np.int32), "rolling/one")
        rows = self._add(
            at, "Cast", [self._add(at, "Squeeze", [past], "rolling/p")], "rolling/p32", to=ir.DataType.INT32
        )
        cap = self._add(at, "Sub", [self._add(at, "Add", [rows, new], "rolling/held"), one], "rolling/cap")
        zero = self._const(at, np.array(0, np.int32), "rolling/zero")
        capped = self._add(at, "Min", [every, cap], "rolling/capped")
        seqlens = self._add(at, "Max", [capped, zero], "rolling/seqlens_k")
        seqlens.dtype, total.dtype = ir.DataType.INT32, ir.DataType.INT32
        self._lengths[key] = (seqlens, total)
        return seqlens, total

    def _padding_key(self, site: AttentionMatch) -> str | None:
        """The padding input, and for a fitted mask the columns of it that the layer reads."""
        if site.mask.padding is None:
            return None
        if site.fit_mask:
            width = (
                self.ev.shape(site.key.past)[2] + self.ev.shape(site.query)[_seq_axis(self.ev, site.query)]
            )
            return f"{site.mask.padding}|columns:{width}"
        return site.mask.padding

    def _padding_mask(self, site: AttentionMatch, at: ir.Node) -> ir.Value:
        """The padding input (for a fitted mask, its ``P + S`` columns)."""
        mask = next(v for v in self.graph.inputs if v.name == site.mask.padding)
        return self._fitted_mask(site, mask, at) if site.fit_mask else mask

    def query_lengths(self, site: AttentionMatch) -> ir.Value:
        """``query_seqlens`` (int32 ``[batch]``): each row's valid new tokens, its attention
        mask's last ``S`` columns counted (computed once per padding input)."""
        key = f"{self._padding_key(site)}|new"
        if key in self._lengths:
            return self._lengths[key][0]
        self.lengths(site)
        at = site.node
        new = self._add(at, "Shape", [site.query], "query_seqlens/new_length", start=2, end=3)
        end = self._const(at, np.array([np.iinfo(np.int64).max], np.int64), "query_seqlens/end")
        axes = self._const(at, np.array([1], np.int64), "query_seqlens/axes")
        start = self._add(at, "Neg", [new], "query_seqlens/start")
        valid = self._add(
            at, "Slice", [self._valid[str(self._padding_key(site))], start, end, axes], "query_seqlens/new"
        )
        counted = self._add(at, "Cast", [valid], "query_seqlens/Cast", to=ir.DataType.INT64)
        total = self._add(at, "ReduceSum", [counted, axes], "query_seqlens/ReduceSum", keepdims=0)
        lengths = self._add(at, "Cast", [total], "query_seqlens", to=ir.DataType.INT32)
        lengths.dtype = ir.DataType.INT32
        self._lengths[key] = (lengths, lengths)
        return lengths

    def _fitted_mask(self, site: AttentionMatch, mask: ir.Value, at: ir.Node) -> ir.Value:
        """``mask`` with exactly ``P + S`` columns: cut, or zeros (padding) appended."""
        axis = _seq_axis(self.ev, site.query)
        past = self._add(at, "Shape", [site.key.past], "fit_mask/past_length", start=2, end=3)
        new = self._add(at, "Shape", [site.query], "fit_mask/new_length", start=axis, end=axis + 1)
        width = self._add(at, "Add", [past, new], "fit_mask/width")
        have = self._add(at, "Shape", [mask], "fit_mask/columns", start=1, end=2)
        zero = self._const(at, np.array([0], np.int64), "fit_mask/zero")
        short = self._add(
            at, "Max", [self._add(at, "Sub", [width, have], "fit_mask/missing"), zero], "fit_mask/short"
        )
        front = self._const(at, np.array([0, 0, 0], np.int64), "fit_mask/front")
        pads = self._add(at, "Concat", [front, short], "fit_mask/pads", axis=0)
        padded = self._add(at, "Pad", [mask, pads], "fit_mask/Pad")
        axes = self._const(at, np.array([1], np.int64), "fit_mask/axes")
        fitted = self._add(at, "Slice", [padded, zero, width, axes], "fit_mask/Slice")
        fitted.type, fitted.shape = mask.type, ir.Shape([mask.shape[0] if mask.shape else None, None])
        return fitted

    def order(self, site: AttentionMatch, query: ir.Value) -> PaddingOrder | None:
        """The reorder that puts each row's valid new tokens first, and its inverse.

        ``query`` is the site's query as GQA reads it (BSH). None without a padding mask.
        The order is stable (valid tokens keep their order, padding follows), so for
        right-padded or unpadded rows it is the identity. Computed once per graph.
        """
        key = self._padding_key(site)
        if key is None:
            return None
        if key in self._order:
            return self._order[key]
        self.lengths(site)
        at = site.node
        batch = self._add(at, "Shape", [query], "padding_order/batch", start=0, end=1)
        new = self._add(at, "Shape", [query], "padding_order/new_length", start=1, end=2)
        end = self._const(at, np.array([np.iinfo(np.int64).max], np.int64), "padding_order/end")
        axes = self._const(at, np.array([1], np.int64), "padding_order/axes")
        start = self._add(at, "Neg", [new], "padding_order/start")
        valid = self._add(at, "Slice", [self._valid[key], start, end, axes], "padding_order/new_tokens")
        length = self._add(at, "Squeeze", [new], "padding_order/length")
        zero = self._const(at, np.array(0, np.int64), "padding_order/zero")
        one = self._const(at, np.array(1, np.int64), "padding_order/one")
        steps = self._add(at, "Range", [zero, length, one], "padding_order/Range")
        padding_after = self._add(at, "Add", [steps, length], "padding_order/padding_after")
        rank = self._add(at, "Where", [valid, steps, padding_after], "padding_order/rank")
        order = self._argsort(rank, new, at, "padding_order/order")
        inverse = self._argsort(order, new, at, "padding_order/inverse")
        rows = self._add(
            at, "Range", [zero, self._add(at, "Squeeze", [batch], "padding_order/rows"), one], "r"
        )
        first = self._add(  # row b's tokens start at b * seq in [batch * seq, width]
            at,
            "Unsqueeze",
            [self._add(at, "Mul", [rows, length], "padding_order/first"), axes],
            "first_token",
        )
        result = PaddingOrder(
            gather=self._add(at, "Add", [order, first], "padding_order/gather"),
            scatter=self._add(at, "Add", [inverse, first], "padding_order/scatter"),
            inverse=inverse,
        )
        self._order[key] = result
        return result

    def _argsort(self, keys: ir.Value, length: ir.Value, at: ir.Node, name: str) -> ir.Value:
        """Indices sorting distinct int64 ``keys [batch, n]`` along axis 1 (exact below 2**24)."""
        values = self._add(at, "Cast", [keys], f"{name}/Cast", to=ir.DataType.FLOAT)
        node = ir.node(
            "TopK",
            [values, length],
            {"axis": 1, "largest": 0, "sorted": 1},
            num_outputs=2,
            name=self._name(name),
        )
        self.graph.insert_before(at, node)
        node.outputs[0].name, node.outputs[1].name = f"{node.name}/values", node.name
        return node.outputs[1]

    def _reorder(self, value: ir.Value, indices: ir.Value, width: int, at: ir.Node, name: str) -> ir.Value:
        """``value`` ``[batch, seq, width]`` with its tokens taken by flat ``indices`` ``[batch, seq]``.

        A Gather of whole rows of the flattened tokens (a copy per token), which onnxruntime
        runs faster than GatherND with batch dimensions.
        """
        flat = self._const(at, np.array([-1, width], np.int64), f"{name}/flat")
        tokens = self._add(at, "Reshape", [value, flat], f"{name}/tokens")
        tokens.type, tokens.shape = value.type, ir.Shape([ir.SymbolicDim(None), width])
        moved = self._add(at, "Gather", [tokens, indices], name, axis=0)
        moved.type, moved.shape = value.type, value.shape
        return moved

    def bsh(self, value: ir.Value, heads: int, head: int, at: ir.Node) -> ir.Value:
        """``value`` (BNSH) as BSH ``[batch, seq, heads * head]``, reusing exporter values."""
        cached = self._bsh.get(id(value))
        if cached is None and len(self._try_shape(value)) == 3:
            cached = value  # already BSH (ONNX Attention's 3-D form)
        if cached is None:
            cached = self._shortcut(value, heads, head, at)
            if cached is None:
                flipped = self._add(at, "Transpose", [value], "to_bsnh", perm=[0, 2, 1, 3])
                shape = self._const(at, np.array([0, 0, heads * head], np.int64), "bsh_shape")
                cached = self._add(at, "Reshape", [flipped, shape], "to_bsh")
            if cached.type is None:
                cached.type = value.type
            if cached.shape is None:
                cached.shape = _bsh_shape(self._try_shape(value), heads * head)
            self._bsh[id(value)] = cached
        return cached

    def _shortcut(self, value: ir.Value, heads: int, head: int, at: ir.Node) -> ir.Value | None:
        """A BSH form of a BNSH ``value`` that is (nearly) there already, or None.

        ``Transpose(Reshape(x, [B, S, heads, head]), [0, 2, 1, 3])`` is ``x``;
        ``Transpose(y, [0, 2, 1, 3])`` is ``Reshape(y, [0, 0, -1])``; an ONNX
        RotaryEmbedding of such a value is the same RotaryEmbedding of its 3-D form
        (the operator's own definition of 3-D input).
        """
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "RotaryEmbedding":
            x = node.inputs[0]
            dims = self._try_shape(x)
            inner = self._shortcut(x, heads, head, at) if x is not None and len(dims) == 4 else None
            if inner is None or dims[1] != Affine(const=heads):
                return None
            attrs = {k: a.value for k, a in node.attributes.items()} | {"num_heads": heads}
            return self._add(at, "RotaryEmbedding", [inner, *node.inputs[1:]], "rotary_bsh", **attrs)
        if node.op_type != "Transpose" or list(node.attributes["perm"].as_ints()) != [0, 2, 1, 3]:
            return None
        bsnh = node.inputs[0]
        dims = self._try_shape(bsnh)
        if bsnh is None or len(dims) != 4 or dims[2] != Affine(const=heads) or dims[3] != Affine(const=head):
            return None
        split = _producer(bsnh, "Reshape")
        if split is not None:
            source = split.inputs[0]
            src = self._try_shape(source)
            if len(src) == 3 and src[:2] == dims[:2] and src[2] == Affine(const=heads * head):
                return source
        shape = self._const(at, np.array([0, 0, heads * head], np.int64), "bsh_shape")
        return self._add(at, "Reshape", [bsnh, shape], "to_bsh")

    def _try_shape(self, value: ir.Value | None) -> tuple[Affine, ...]:
        if value is None:
            return ()
        try:
            return self.ev.shape(value)
        except Unprovable:
            return ()

    def write(self, site: AttentionMatch) -> ir.Node:
        """Insert the GQA node for ``site``, rewire its outputs, remove what is dead."""
        at = site.node
        for tensor in (site.query, site.key.new, site.value.new, site.output):
            inferred = self.ev.dtype(tensor)
            if tensor.dtype is None and inferred is not None:  # no value_info: what was inferred
                tensor.dtype = inferred
        rolling = site.key.window is not None
        seqlens, total = self.rolling_lengths(site) if rolling else self.lengths(site)
        q = self.bsh(site.query, site.num_heads, site.head_size, at)
        k = self.bsh(site.key.new, site.kv_num_heads, site.head_size, at)
        v = self.bsh(site.value.new, site.kv_num_heads, site.head_size, at)
        order = self.order(site, q)
        if site.key.tiled:  # GQA's grouping of the query heads (_reads.tiled_order)
            q = self._regroup(q, site, (site.key.group, site.kv_num_heads), "tiled_heads/q")
        if order is not None:
            q = self._reorder(q, order.gather, site.num_heads * site.head_size, at, "padding_order/q")
            k = self._reorder(k, order.gather, site.kv_num_heads * site.head_size, at, "padding_order/k")
            v = self._reorder(v, order.gather, site.kv_num_heads * site.head_size, at, "padding_order/v")
        attrs: dict[str, int | float] = {
            "num_heads": site.num_heads,
            "kv_num_heads": site.kv_num_heads,
            "scale": float(site.scale),
            "do_rotary": 0,
        }
        if site.softcap:
            attrs["softcap"] = float(site.softcap)
        if site.mask.window is not None:
            attrs["local_window_size"] = site.mask.window
        if site.probs is not None:
            attrs["qk_output"] = 2
        name = f"{at.name}/GroupQueryAttention" if at.name else self._name("GroupQueryAttention")
        gqa = ir.node(
            GQA.op_type,
            GQA.input_list(
                {
                    GqaInput.QUERY: q,
                    GqaInput.KEY: k,
                    GqaInput.VALUE: v,
                    GqaInput.PAST_KEY: site.key.past,
                    GqaInput.PAST_VALUE: site.value.past,
                    GqaInput.SEQLENS_K: seqlens,
                    GqaInput.TOTAL_SEQUENCE_LENGTH: total,
                    GqaInput.HEAD_SINK: self._head_sink(site, q),
                    GqaInput.QUERY_SEQLENS: self.query_lengths(site) if rolling else None,
                }
            ),
            attrs,
            domain=GQA.domain,
            num_outputs=4 if site.probs is not None else 3,
            name=name,
        )
        for output, suffix in zip(gqa.outputs, GQA.outputs):
            output.name = f"{name}/{suffix}"
        self.graph.insert_before(at, gqa)
        out = gqa.outputs[GqaOutput.OUTPUT]
        out.type, out.shape = q.type, q.shape
        if site.key.tiled:  # the export's order of the heads back
            out = self._regroup(out, site, (site.kv_num_heads, site.key.group), "tiled_heads/output")
        if order is not None:
            out = self._reorder(
                out, order.scatter, site.num_heads * site.head_size, at, "padding_order/output"
            )
        named = next((i for i, v in enumerate(self.graph.outputs) if v is site.output), None)
        bsh = len(self._try_shape(site.query)) == 3  # a 3-D attention's output is BSH already
        dead = [] if bsh else self._rewire_output(site, out)
        replaced = [
            *([(site.output, out)] if bsh else []),
            self._present(site.key, gqa.outputs[GqaOutput.PRESENT_KEY], gqa),
            self._present(site.value, gqa.outputs[GqaOutput.PRESENT_VALUE], gqa),
        ]
        if site.probs is not None:
            probs = gqa.outputs[GqaOutput.OUTPUT_QK]
            probs.type, probs.shape = site.probs.type, site.probs.shape
            if order is not None:  # query rows back in the caller's order; keys stay compacted
                shape = self._add(at, "Shape", [probs], "padding_order/probs_shape")
                axes = self._const(at, np.array([1, 3], np.int64), "padding_order/probs_axes")
                rows = self._add(at, "Unsqueeze", [order.inverse, axes], "padding_order/probs_rows")
                indices = self._add(at, "Expand", [rows, shape], "padding_order/probs_indices")
                probs = self._add(at, "GatherElements", [probs, indices], "padding_order/probs", axis=2)
            if site.key.tiled:  # the export's order of the heads back
                back = np.argsort(self._order_of(site)).astype(np.int64)
                heads = self._const(at, back, "tiled_heads/probs_order")
                probs = self._add(at, "Gather", [probs, heads], "tiled_heads/probs", axis=1)
            replaced.append((site.probs, probs))
        for before, after in replaced:
            after.type, after.shape = before.type, before.shape
            dead.append(before.producer())
            before.replace_all_uses_with(after, replace_graph_outputs=True)
        remove_dead(self.graph, [*dead, at])
        for before, after in replaced:
            after.name = before.name
        for present in gqa.outputs[1:3]:
            self._drop_copies(present)
        if named is not None:  # the attention output was a graph output: its name stays
            self.graph.outputs[named].name = site.output.name
        return gqa

    def _head_sink(self, site: AttentionMatch, query: ir.Value) -> ir.Value | None:
        """The sink logits (one per query head) as an initializer of the query's type."""
        if site.head_sink is None:
            return None
        dtype = query.dtype or ir.DataType.FLOAT
        values = np.broadcast_to(site.head_sink, (site.num_heads,)).astype(dtype.numpy())
        if site.key.tiled:  # one per GQA head: the export's head at each
            values = values[self._order_of(site)]
        name = self._name("head_sink")
        sink = ir.Value(name=name, const_value=ir.tensor(values, dtype=dtype, name=name))
        sink.dtype, sink.shape = dtype, ir.Shape([site.num_heads])
        self.graph.register_initializer(sink)
        return sink

    def _drop_copies(self, present: ir.Value) -> None:
        """A copy of GQA's present (Identity, a Cast to its own type: TorchScript's GPT-J casts its
        cache to float32 in a float32 model) that is the present graph output, read by nothing
        else, is replaced by the present itself, with its name."""
        if present.is_graph_output():
            return
        for user, _ in list(present.uses()):
            out = user.outputs[0]
            copy = user.op_type in ("Identity", "Cast") and is_copy(self.ev, user)
            if copy and out.is_graph_output() and not out.uses():
                name = out.name
                out.replace_all_uses_with(present, replace_graph_outputs=True)
                self.graph.remove(user, safe=True)
                present.name = name
                return

    @staticmethod
    def _order_of(site: AttentionMatch) -> np.ndarray:
        """The export's query head at each GQA head of a tiled site."""
        return tiled_order(site.num_heads, site.kv_num_heads, site.key.group)

    def _regroup(self, value: ir.Value, site: AttentionMatch, blocks: tuple[int, int], name: str) -> ir.Value:
        """BSH ``value`` with its heads, read as ``[a, b, heads / (a * b)]`` blocks (``blocks``:
        ``(a, b)``), in the order ``[b, a, ...]``: ``(tiles, kv_heads)`` is
        :func:`~onnx_kvcache.passes.fusion._reads.tiled_order`, ``(kv_heads, tiles)`` its inverse."""
        at, (a, b) = site.node, blocks
        width = site.num_heads * site.head_size
        split = self._const(at, np.array([0, 0, a, b, width // (a * b)], np.int64), f"{name}_split")
        blocked = self._add(at, "Reshape", [value, split], f"{name}_blocks")
        swapped = self._add(at, "Transpose", [blocked], f"{name}_swap", perm=[0, 1, 3, 2, 4])
        merge = self._const(at, np.array([0, 0, width], np.int64), "bsh_shape")
        out = self._add(at, "Reshape", [swapped, merge], name)
        out.type, out.shape = value.type, value.shape
        return out

    def _present(self, link: CacheLink, present: ir.Value, gqa: ir.Node) -> tuple[ir.Value, ir.Value]:
        """(the export's present, what replaces it): GQA's present, or for a rolling window cache
        its last rows as the export keeps them (:func:`~onnx_kvcache.passes.fusion._window_present.
        last_rows`: each row's last ``keep`` tokens, in order)."""
        if link.window is None:
            return link.present, present
        seqlens, total = gqa.inputs[GqaInput.SEQLENS_K], gqa.inputs[GqaInput.TOTAL_SEQUENCE_LENGTH]
        assert seqlens is not None and total is not None
        key = (seqlens.name, total.name, link.window.keep)
        if key not in self._rows:
            lengths, heads = (seqlens, total), gqa.attributes["kv_num_heads"].as_int()
            self._rows[key] = row_indices(self.graph, gqa, lengths, link.window.keep, heads, self._name)
        rows = last_rows(self.graph, gqa, present, self._rows[key], self._name("rolling_rows"))
        return link.window.output, rows

    def _rewire_output(self, site: AttentionMatch, out: ir.Value) -> list[ir.Node | None]:
        """Feed the GQA output (BSH) to the attention output's users (BNSH).

        A user chain ``Reshape(Transpose(y, [0, 2, 1, 3]), [B, S, heads * head])``
        reads ``out`` itself, also when ``y`` is reached through Reshapes to its own shape
        (:meth:`_views`); any other user reads ``out`` turned back to BNSH.
        Returns the nodes this left unread.
        """
        width = site.num_heads * site.head_size
        q_dims = self._try_shape(site.query)
        dead: list[ir.Node | None] = []
        for user in self._views(site.output):
            if user.op_type != "Transpose" or list(user.attributes["perm"].as_ints()) != [0, 2, 1, 3]:
                continue
            for merge, _ in list(user.outputs[0].uses()):
                if merge.op_type != "Reshape" or merge.outputs[0].is_graph_output():
                    continue
                dims = self._try_shape(merge.outputs[0])
                if len(q_dims) == 4 and dims == (q_dims[0], q_dims[2], Affine(const=width)):
                    merge.outputs[0].replace_all_uses_with(out)
                    dead.append(merge)
        unread = dead_nodes(self.graph, dead)  # with them, what only they read (shapes)
        if site.output.is_graph_output() or any(u not in unread for u, _ in site.output.uses()):
            at = site.node
            shape = self._const(at, np.array([0, 0, site.num_heads, site.head_size], np.int64), "bsnh_shape")
            split = self._add(at, "Reshape", [out, shape], "to_bsnh")
            bnsh = self._add(at, "Transpose", [split], "to_bnsh", perm=[0, 2, 1, 3])
            bnsh.type, bnsh.shape = site.output.type, site.output.shape
            site.output.replace_all_uses_with(bnsh, replace_graph_outputs=True)
        return dead

    def _views(self, output: ir.Value) -> list[ir.Node]:
        """The readers of ``output`` and, through each Reshape proven to keep its shape (an
        identity: transformers 5's TorchScript export reshapes the attention output to
        ``[B, heads, S, head]`` before its transpose, the head size read from the repeated
        V's Shape), that Reshape's readers."""
        shape = self._try_shape(output)
        readers: list[ir.Node] = []
        work = [output]
        while work:
            for user, slot in list(work.pop().uses()):
                readers.append(user)
                if (
                    user.op_type == "Reshape"
                    and user.domain in ("", "ai.onnx")
                    and slot == 0
                    and len(shape) == 4
                    and not user.outputs[0].is_graph_output()
                    and self._try_shape(user.outputs[0]) == shape
                ):
                    work.append(user.outputs[0])
        return readers


def _seq_axis(ev: SymbolicEvaluator, query: ir.Value) -> int:
    """The sequence axis of a query: 1 in BSH (3-D), 2 in BNSH."""
    try:
        return 1 if len(ev.shape(query)) == 3 else 2
    except Unprovable:
        return 2


def _bsh_shape(q: Sequence[Affine], width: int) -> ir.Shape | None:
    if len(q) != 4:
        return None
    return ir.Shape([_dim(q[0]), _dim(q[2]), width])


def _dim(value: Affine) -> int | str | None:
    if value.is_const:
        return value.const
    if len(value.terms) == 1 and value.terms[0][1] == 1 and not value.const:
        symbol = value.terms[0][0]
        return symbol.name if symbol.kind is SymbolKind.DIM else None
    return None


def remove_dead(graph: ir.Graph, nodes: Iterable[ir.Node | None]) -> int:
    """Remove ``nodes`` and, transitively, their producers once nothing reads them.

    The dead set is found first (:func:`dead_nodes`) and removed in one ``Graph.remove`` (which
    costs a pass over the graph's outputs per call: per node, that was a fifth of fusing 80 layers)."""
    dead = dead_nodes(graph, nodes)
    inputs = {v: None for node in dead for v in node.inputs if v is not None and v.producer() is None}
    graph.remove(dead, safe=True)
    for value in inputs:
        if _unused_initializer(value, graph):
            assert value.name is not None
            del graph.initializers[value.name]
    return len(dead)


def dead_nodes(graph: ir.Graph, nodes: Iterable[ir.Node | None]) -> dict[ir.Node, None]:
    """Of ``nodes`` and, transitively, their producers, those that nothing else reads (in the
    order found: a removal of them is deterministic); the graph is left as it is."""
    dead: dict[ir.Node, None] = {}
    work = [n for n in nodes if n is not None]
    while work:
        node = work.pop()
        if node in dead or node.graph is not graph:
            continue
        if any(o.is_graph_output() or any(u.node not in dead for u in o.uses()) for o in node.outputs):
            continue
        dead[node] = None
        work.extend(p for v in node.inputs if v is not None and (p := v.producer()) is not None)
    return dead


def _unused_initializer(value: ir.Value, graph: ir.Graph) -> bool:
    if not value.is_initializer() or value.uses() or value.is_graph_output() or value.is_graph_input():
        return False
    return value.name is not None and graph.initializers.get(value.name) is value


def default_scale(head: int) -> float:
    return 1.0 / math.sqrt(head)
