"""Store a KV cache quantized with standard operators: ``QdqKvCachePass``.

For caches no attention kernel holds quantized (multi-head latent attention, whose keys and
values differ in width; static buffers written by ``TensorScatter``; any attention computed
from plain ONNX operators), the cache is stored in the format's element type and the graph
converts at its edges with ``QuantizeLinear`` and ``DequantizeLinear``, which every
onnxruntime provider runs (``storage="qdq"``; the attention itself stays as it is).

Rules:

1. A cache is a graph input (``past``) and a graph output (``present``) joined by one writer
   node of :data:`~.QDQ_WRITERS`: ``Concat(past, new)`` on the sequence axis (the exports
   of DeepSeek-V3's MLA), ``TensorScatter(past, new, write_indices)`` (static buffers, present the
   updated buffer), or an ONNX ``Attention`` holding its cache (``past_key``/``past_value``,
   inputs 4/5, to ``present_key``/``present_value``, outputs 1/2). Its side (key or value)
   and layer id come from the input's name (``key``/``value``/``k``/``v``; the layer's
   number). A float cache is converted; one already in the format's type is counted as stored.
2. A writer that moves rows (Concat, TensorScatter) runs on the stored codes where
   onnxruntime's CPU runs it on the format's type (:meth:`~.Writer.moves_codes`: int8): ``past``
   takes the format's type, the new rows are quantized before it, its output (the graph's
   present, its name kept) is in the format's type, and one
   ``DequantizeLinear`` of it feeds every other reader. Rows already stored are never rounded
   again, and attention reads the new rows as stored (as onnxruntime's quantized kernels do).
3. Another writer (Attention; Concat and TensorScatter for fp8 and int4) reads
   ``DequantizeLinear(past)``, and its present is quantized by one ``QuantizeLinear`` before it
   leaves the graph: the rows it read come back as they were
   stored (``round(q * s / s) == q``), the new ones quantized.
4. ``Shape`` and ``Size`` readers of ``past`` keep reading it (its shape is unchanged: ONNX's
   int4 is a logical type) where onnxruntime runs them on the type (not int4:
   :attr:`~.QdqType.shape_readable`); any other reader reads the dequantized past.
5. Scales (dequantization scales, ``x = q * scale``, float32 or the cache's float type; zero
   point 0: from opset 21 none, QuantizeLinear's ``output_dtype`` naming the type, else a zero
   of the format's type; :meth:`~QdqKvCachePass.granularity_for` infers the granularity of
   scales recording none from their sizes): per tensor one scalar (per-channel scales given are
   merged by their max, with a warning); per channel, where the cache's last axis holds
   ``kv_heads * head_size`` (a static buffer) a 1-D scale on ``axis=-1``; on a 4-D
   ``[batch, kv_heads, seq, head_size]`` cache the scale ``[1, kv_heads, 1, head_size]`` divides
   before a unit-scale ``QuantizeLinear`` and multiplies after a unit-scale ``DequantizeLinear``.
   Keys and values may differ in width (MLA). Without scales fp8 takes unit scales (a warning);
   int8 and int4 refuse.
6. The operators must define the format's type at the model's opset (:data:`~.QDQ_TYPES`: int8
   10, fp8 19, int4 21), and a float16 or bfloat16 scale (19): an older model is refused (no
   opset is upgraded).
7. Scales for a layer the model does not have, or measured on caches rotated otherwise than the
   model's (their ``rotation`` and ``rotation_matrix`` against what the graph turns:
   :func:`~onnx_kvcache.cache.rotation.stored_rotation`; rotate it first with
   :class:`~onnx_kvcache.passes.StoredCacheRotationPass`), are refused.

The tables are :mod:`onnx_kvcache.cache.storage`'s. Refusals are
:class:`~onnx_kvcache.errors.KvCachePreconditionError`, raised before anything changes. A
model with no cache of these forms is left as it is (``modified`` False).
"""

from __future__ import annotations

__all__ = ["QdqKvCachePass"]

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat, get_format, scale_granularity
from onnx_kvcache.cache.io_caches import find_io_caches
from onnx_kvcache.cache.rotation import get_rotation, stored_rotation
from onnx_kvcache.cache.storage import QDQ_TYPES, QdqCache, attention_read, find_qdq_caches
from onnx_kvcache.errors import (
    KvCachePreconditionError,
    Param,
    ScalesAdjustedWarning,
    UnitScalesWarning,
    warn,
)
from onnx_kvcache.passes._base import InPlacePass, preconditions
from onnx_kvcache.passes._graph import Builder
from onnx_kvcache.passes._kv_cache_plan import check_known_layers
from onnx_kvcache.scales.files import KvCacheScales

_SHAPE_READERS = ("Shape", "Size")
#: From this opset QuantizeLinear names its type (``output_dtype``) and no zero point is written:
#: with an int8 zero point, onnxruntime 1.32's extended optimizations (its QDQ propagation and
#: int8-to-uint8 transformers together; disabling either avoids it) add a QuantizeLinear whose
#: ``output_dtype`` INT8 contradicts its UINT8 zero point, and session creation fails (mobius's
#: gpt_oss export, whose present is read through Unsqueeze).
_OUTPUT_DTYPE = 21


class QdqKvCachePass(InPlacePass):
    """Store every cache :func:`find_qdq_caches` finds in ``format`` (module docstring: rules)."""

    def __init__(
        self, format: str, granularity: str = "per_tensor", scales: KvCacheScales | None = None
    ) -> None:
        super().__init__()
        self.format: CacheFormat = get_format(format)
        self.granularity = scale_granularity(granularity)
        self.scales = scales
        self.converted = 0
        """Caches converted by the last call."""

    def requires(self, model: ir.Model) -> None:
        with preconditions():
            _check_opset(model, self.format)
            if self.scales is None and not self.format.is_float:
                raise KvCachePreconditionError(
                    f"The {self.format.name} cache needs calibrated scales: a unit scale is meaningless "
                    "for integer formats. Pass ",
                    Param("scales", placeholder="FILE"),
                    ".",
                )
            if self.scales is not None:
                self._check_scales(model, self.scales)
            for cache in find_qdq_caches(model.graph):
                if not cache.stored:
                    self._scale(cache)  # a missing layer or a width that fits no scale: refused here
                    _check_float_scale(model, cache)

    @staticmethod
    def _check_scales(model: ir.Model, scales: KvCacheScales) -> None:
        """Rule 7: scales of a layer the model lacks (its I/O caches' layers, or the ones found), or
        measured on caches rotated otherwise than the model's (or by another ``H``), are refused."""
        layers = {c.layer for c in find_qdq_caches(model.graph)} | {c.layer_id for c in find_io_caches(model)}
        check_known_layers(scales, layers)
        recorded = get_rotation(scales.metadata.get("rotation", "none"))
        own, matrix = stored_rotation(model)
        reads = filter(None, map(attention_read, find_qdq_caches(model.graph)))
        wanted = scales.rotation_matrix
        same = matrix is None or wanted is None or all(matrix.same(wanted, r.head_size) for r in reads)
        if recorded != own or not same:
            turn = f"rotate the float model first (StoredCacheRotationPass({recorded.name!r}); convert: "
            fix: tuple[object, ...] = (
                (turn, Param("rotation", recorded.name), ")")
                if recorded.rotates and not own.rotates
                else ("store the original model with them",)
            )
            raise KvCachePreconditionError(
                f"The scales were measured on caches rotated {recorded.name}"
                f"{f' by H = {wanted.name}' if wanted is not None else ''}; the model's caches "
                f"are rotated {own.name}{f' by H = {matrix.name}' if matrix is not None else ''}: ",
                *fix,
                ", or calibrate again.",
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        caches = [c for c in find_qdq_caches(model.graph) if not c.stored]
        if self.scales is None and caches:
            warn("No KV-cache scales given: using unit scales (1.0) for the fp8 cache.", UnitScalesWarning)
        merged = sorted({c.layer for c in caches if self._merges(c)})
        if merged:
            warn(
                f"Layer(s) {merged}: the per-channel scales given merged into one per tensor, their max.",
                ScalesAdjustedWarning,
            )
        for cache in caches:
            _Convert(model.graph, cache, self.format, self._scale(cache), _opset(model)).run()
        if caches:
            model.graph.sort()
        self.converted = len(caches)
        return ir.passes.PassResult(model, modified=bool(caches))

    def _given(self, cache: QdqCache) -> np.ndarray:
        """The scales given for ``cache`` (flat float64); unit scales without any."""
        if self.scales is None:
            return np.ones(1)
        k, v = self.scales.for_layer(cache.layer)
        return np.asarray(k if cache.side == "k" else v, np.float64).reshape(-1)

    @staticmethod
    def granularity_for(model: ir.Model, scales: KvCacheScales | None) -> str:
        """The granularity ``scales`` record, else the one their sizes fit on every float cache of
        ``model`` (one element: ``per_tensor``; the cache's width: ``per_channel``; rule 5), else
        ``per_tensor`` without scales. Sizes that fit no granularity, or different ones, are refused."""
        if scales is None or scales.granularity is not None:
            return scales.granularity if scales is not None and scales.granularity else "per_tensor"
        fits: dict[str, str] = {}
        for cache in find_qdq_caches(model.graph):
            if cache.stored or cache.layer not in scales.k:
                continue
            k, v = scales.for_layer(cache.layer)
            given = np.asarray(k if cache.side == "k" else v, np.float64).reshape(-1)
            if given.size > 1:
                _Scale.per_channel(cache, given)  # refuses a size that fits no channel of the cache
            fits[cache.past.name or ""] = "per_tensor" if given.size == 1 else "per_channel"
        found = set(fits.values())
        if len(found) > 1:
            raise KvCachePreconditionError(
                f"The scales given fit different granularities ({fits}): give scales of one "
                "granularity for every cache."
            )
        return "per_channel" if found == {"per_channel"} else "per_tensor"

    def _merges(self, cache: QdqCache) -> bool:
        return self.granularity.single and self._given(cache).size > 1

    def _scale(self, cache: QdqCache) -> _Scale:
        """The scale of ``cache`` and where it applies (rule 5)."""
        given = self._given(cache)
        if self.granularity.single or given.size == 1:
            return _Scale(np.array(given.max()), None)
        return _Scale.per_channel(cache, given)


@dataclasses.dataclass(frozen=True)
class _Scale:
    """One cache's scale values and how they apply: ``axis`` -1 on the last axis; ``grid``
    (a 4-D ``[1, heads, 1, head]`` array) divided and multiplied around unit-scale Q/DQ."""

    values: np.ndarray
    axis: int | None
    grid: bool = False

    @classmethod
    def per_channel(cls, cache: QdqCache, given: np.ndarray) -> _Scale:
        shape = cache.past.shape
        dims = list(shape) if shape is not None else []
        several = len(dims) == 4 and isinstance(dims[1], int) and dims[1] > 1  # heads: not one head's
        if dims and isinstance(dims[-1], int) and dims[-1] == given.size and not several:
            return cls(given, -1)
        head = dims[-1] if len(dims) == 4 and isinstance(dims[-1], int) else None
        heads = given.size // head if head and given.size % head == 0 else None
        if head and heads and (not isinstance(dims[1], int) or dims[1] == heads):  # [batch, heads, seq, head]
            return cls(given.reshape(1, heads, 1, head), None, grid=True)
        raise KvCachePreconditionError(
            f"Cache {cache.past.name!r} {list(dims)} fits no per-channel scale of {given.size} elements "
            "(kv_heads * head_size on its last axis, or [batch, kv_heads, seq, head_size]): give scales "
            "of its width, or convert with ",
            Param("granularity", "per_tensor"),
            ".",
        )


def _opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


def _check_float_scale(model: ir.Model, cache: QdqCache) -> None:
    """A float16 or bfloat16 cache's scale is of its type: QuantizeLinear takes one from opset 19."""
    if cache.past.dtype not in (None, ir.DataType.FLOAT) and _opset(model) < 19:
        raise KvCachePreconditionError(
            f"Cache {cache.past.name!r} is {cache.past.dtype.name.lower()}: QuantizeLinear and "
            f"DequantizeLinear take its scale from opset 19; the model's is {_opset(model)}. Export it at "
            "a newer opset."
        )


def _check_opset(model: ir.Model, fmt: CacheFormat) -> None:
    opset = _opset(model)
    if opset < QDQ_TYPES[fmt.name].opset:
        raise KvCachePreconditionError(
            f"The {fmt.name} cache stored through QuantizeLinear/DequantizeLinear needs opset "
            f"{QDQ_TYPES[fmt.name].opset} or newer; the model's is {opset}. Export it at a newer opset or "
            "choose a format it has (",
            Param("format", "int8"),
            f" from opset {QDQ_TYPES['int8'].opset}).",
        )


class _Convert:
    """Rules 2 to 5 for one cache."""

    def __init__(self, graph: ir.Graph, cache: QdqCache, fmt: CacheFormat, scale: _Scale, opset: int) -> None:
        self.graph, self.cache, self.fmt, self.scale = graph, cache, fmt, scale
        self.float_type = cache.past.dtype or ir.DataType.FLOAT
        name = cache.past.name
        values = scale.values if not scale.grid else np.ones((), np.float64)
        self.qdq_scale = self._initializer(f"{name}.qdq_scale", values.astype(self.float_type.numpy()))
        self.stored = QDQ_TYPES[fmt.name]
        zero = ir.tensor(np.zeros(values.shape, self.stored.numpy), dtype=self.stored.dtype)
        self.zero = self._initializer(f"{name}.qdq_zero_point", zero) if opset < _OUTPUT_DTYPE else None
        self.grid = (
            self._initializer(f"{name}.qdq_channel_scale", scale.values.astype(self.float_type.numpy()))
            if scale.grid
            else None
        )
        self.b = Builder(f"{name}/qdq")

    def _initializer(self, name: str, array: np.ndarray | ir.TensorProtocol) -> ir.Value:
        tensor = ir.tensor(array) if isinstance(array, np.ndarray) else array
        value = ir.Value(name=name, const_value=tensor)
        value.dtype, value.shape = tensor.dtype, ir.Shape(tensor.shape.numpy())
        self.graph.register_initializer(value)
        return value

    def _node(
        self, op_type: str, inputs: list[ir.Value | None], dtype: ir.DataType, shape: ir.Shape | None
    ) -> ir.Value:
        attrs: dict[str, Any] = {}
        if self.scale.axis is not None and op_type.endswith("Linear"):
            attrs["axis"] = self.scale.axis
        if op_type == "QuantizeLinear" and self.zero is None:
            attrs["output_dtype"] = int(self.stored.dtype)
        out = self.b.op(op_type, [v for v in inputs if v is not None], dtype=dtype, **attrs)
        out.shape = shape
        return out

    def quantize(self, x: ir.Value) -> ir.Value:
        if self.grid is not None:
            x = self._node("Div", [x, self.grid], self.float_type, x.shape)
        return self._node("QuantizeLinear", [x, self.qdq_scale, self.zero], self.stored.dtype, x.shape)

    def dequantize(self, q: ir.Value) -> ir.Value:
        x = self._node("DequantizeLinear", [q, self.qdq_scale, self.zero], self.float_type, q.shape)
        if self.grid is not None:
            x = self._node("Mul", [x, self.grid], self.float_type, q.shape)
        return x

    def run(self) -> None:
        cache = self.cache
        shapes = _SHAPE_READERS if self.stored.shape_readable else ()
        readers = [(n, i) for n, i in cache.past.uses() if n is not cache.writer and n.op_type not in shapes]
        cache.past.dtype = self.stored.dtype
        codes = cache.row.moves_codes(self.fmt)
        if readers or not codes:
            past = self.dequantize(cache.past)
            for node, slot in readers:
                node.replace_input_with(slot, past)
            if not codes:
                cache.writer.replace_input_with(cache.row.past, past)
        if codes:
            self._store_rows()
        else:
            self._quantize_present()
        self.graph.extend(self.b.nodes)

    def _store_rows(self) -> None:
        """Rule 2: the writer moves codes; other readers of the present read it dequantized."""
        cache, row = self.cache, self.cache.row
        assert row.new is not None
        new = cache.writer.inputs[row.new]
        assert new is not None
        cache.writer.replace_input_with(row.new, self.quantize(new))
        present = cache.present
        readers = list(present.uses())  # taken before the DequantizeLinear that reads it
        present.dtype = self.stored.dtype
        if readers:
            stored = self.dequantize(present)
            for node, slot in readers:
                node.replace_input_with(slot, stored)

    def _quantize_present(self) -> None:
        """Rule 3: the present leaves the graph quantized, under its name."""
        present = self.cache.present
        name = present.name
        present.name = f"{name}/float"
        stored = self.quantize(present)
        index = [i for i, v in enumerate(self.graph.outputs) if v is present]
        for i in index:
            self.graph.outputs[i] = stored
        stored.name = name
