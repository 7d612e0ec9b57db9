"""Graph-building helpers the passes share: a named-node tape, a cache format's
quantize/dequantize rule written as ONNX ops, and node insertion."""

from __future__ import annotations

__all__ = ["Builder", "Codec", "insert", "ints", "op_of", "prepend"]

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat

_F32 = ir.DataType.FLOAT
_I64 = ir.DataType.INT64


class Builder:
    """An ``onnx_ir`` tape whose every node and value gets a unique, prefixed name."""

    def __init__(self, prefix: str) -> None:
        self.tape = ir.tape.Tape()
        self.prefix = prefix
        self._count = 0

    def op(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        domain: str = "",
        dtype: ir.DataType | None = None,
        **attrs,
    ) -> ir.Value:
        """One node's single output; ``dtype`` records its element type when known."""
        value = self.ops(op_type, inputs, 1, domain, **attrs)[0]
        if dtype is not None:
            value.dtype = dtype
        return value

    def ops(
        self, op_type: str, inputs: Sequence[ir.Value | None], n: int, domain: str = "", **attrs
    ) -> Sequence[ir.Value]:
        self._count += 1
        name = f"{self.prefix}/{op_type}_{self._count}"
        outputs = self.tape.op_multi_out(
            op_type, inputs, attrs or None, num_outputs=n, domain=domain, name=name
        )
        for i, value in enumerate(outputs):
            value.name = f"{name}_out{i}"
        return outputs

    def const(self, array: np.ndarray) -> ir.Value:
        return self.op("Constant", [], value=ir.tensor(array))

    def cast(self, x: ir.Value, dtype: ir.DataType) -> ir.Value:
        return x if x.dtype == dtype else self.op("Cast", [x], dtype=dtype, to=dtype)

    @property
    def nodes(self) -> Sequence[ir.Node]:
        return self.tape.nodes


class Codec:
    """The format's quantize/dequantize rule as ops, for one scale of a fitting shape."""

    def __init__(self, b: Builder, fmt: CacheFormat, scale: ir.Value) -> None:
        self.b, self.fmt, self.scale = b, fmt, scale
        self.inverse = b.op("Reciprocal", [scale], dtype=_F32)
        self.linear_axis: int | None = None
        """fp8 levels are dequantized by one DequantizeLinear over this axis of a 1-D scale
        (``for_rows``; the same float32 multiply as Cast then Mul)."""
        self.linear_scalar = False
        """... or by one DequantizeLinear with a scalar scale."""

    @classmethod
    def reshaped(cls, b: Builder, fmt: CacheFormat, scale: ir.Value, shape: list[int]) -> Codec:
        return cls(b, fmt, b.op("Reshape", [scale, b.const(np.array(shape, np.int64))], dtype=_F32))

    @classmethod
    def for_rows(cls, b: Builder, fmt: CacheFormat, scale: ir.Value, channels: int) -> Codec:
        """A codec for rows ``[..., channels]`` whose scale is one value (``channels == 1``)
        or one per channel, as a scalar or a 1-D scale over the last axis: fp8 then
        dequantizes in one node."""
        codec = cls.reshaped(b, fmt, scale, [channels] if channels > 1 else [])
        codec.linear_axis, codec.linear_scalar = (-1, False) if channels > 1 else (None, True)
        return codec

    def levels(self, x: ir.Value) -> ir.Value:
        """Quantized values as float32 (fp8: as the float8 type itself)."""
        b, fmt = self.b, self.fmt
        scaled = b.op("Mul", [b.cast(x, _F32), self.inverse], dtype=_F32)
        if fmt.is_float:
            return b.op("Cast", [scaled], to=fmt.dtype, saturate=1)
        low, high = (b.const(np.array(v, np.float32)) for v in (fmt.qmin_stored, fmt.qmax_stored))
        return b.op("Clip", [b.op("Round", [scaled]), low, high], dtype=_F32)

    def from_levels(self, levels: ir.Value, dtype: ir.DataType) -> ir.Value:
        b = self.b
        if self.fmt.is_float and (self.linear_scalar or self.linear_axis is not None):
            inputs = [levels, self.scale]
            if self.linear_axis is None:
                return b.cast(b.op("DequantizeLinear", inputs, dtype=_F32), dtype)
            return b.cast(b.op("DequantizeLinear", inputs, dtype=_F32, axis=self.linear_axis), dtype)
        return b.cast(b.op("Mul", [b.cast(levels, _F32), self.scale], dtype=_F32), dtype)

    def round_trip(self, x: ir.Value, dtype: ir.DataType) -> ir.Value:
        """``x`` as the cache will hold it, dequantized, in ``dtype``."""
        return self.from_levels(self.levels(x), dtype)

    def store(self, x: ir.Value, head: int) -> ir.Value:
        """``x`` (BNSH) as the stored cache tensor: fp8, int8, or packed integers."""
        b, fmt = self.b, self.fmt
        levels = self.levels(x)
        if fmt.values_per_byte == 1:
            return b.cast(levels, fmt.dtype)
        return _pack(b, fmt, levels, head)

    def load(self, stored: ir.Value, head: int, dtype: ir.DataType) -> ir.Value:
        """The dequantized values of a stored cache tensor (BNSH)."""
        levels = stored if self.fmt.values_per_byte == 1 else _unpack(self.b, self.fmt, stored, head)
        return self.from_levels(levels, dtype)


def _reshape_tail(b: Builder, x: ir.Value, leading: ir.Value, tail: list[int]) -> ir.Value:
    """Reshape ``x`` to ``leading``'s dimensions but the last, then ``tail`` (zero rows allowed)."""
    shape = b.op(
        "Concat", [b.op("Slice", [leading, *ints(b, [0], [-1])]), b.const(np.array(tail, np.int64))], axis=0
    )
    return b.op("Reshape", [x, shape])


def ints(b: Builder, *lists: list[int]) -> list[ir.Value]:
    """One int64 constant per list."""
    return [b.const(np.array(v, np.int64)) for v in lists]


def _pack(b: Builder, fmt: CacheFormat, levels: ir.Value, head: int) -> ir.Value:
    """``values_per_byte`` values a byte, element ``2i`` in the low bits, offset to unsigned."""
    bits, n = 8 // fmt.values_per_byte, fmt.values_per_byte
    packed = fmt.packed_dim(head)
    codes = b.op("Cast", [b.op("Add", [levels, b.const(np.array(fmt.storage_offset, np.float32))])], to=_I64)
    if packed * n != head:  # odd head: pad with the stored zero
        pads = np.zeros(8, np.int64)
        pads[7] = packed * n - head
        codes = b.op("Pad", [codes, b.const(pads), b.const(np.array(fmt.storage_offset, np.int64))])
    groups = _reshape_tail(b, codes, b.op("Shape", [levels]), [packed, n])
    weights = b.const(np.array([1 << (bits * i) for i in range(n)], np.int64))
    byte = b.op("ReduceSum", [b.op("Mul", [groups, weights]), *ints(b, [-1])], keepdims=0)
    return b.op("Cast", [byte], to=fmt.dtype)


def _unpack(b: Builder, fmt: CacheFormat, stored: ir.Value, head: int) -> ir.Value:
    bits, n = 8 // fmt.values_per_byte, fmt.values_per_byte
    axis = b.const(np.array([-1], np.int64))
    parts = []
    for i in range(n):
        shifted = b.op("BitShift", [stored, b.const(np.array(bits * i, np.uint8))], direction="RIGHT")
        part = b.op("BitwiseAnd", [shifted, b.const(np.array((1 << bits) - 1, np.uint8))])
        parts.append(b.op("Unsqueeze", [part, axis]))
    codes = _reshape_tail(
        b, b.op("Concat", parts, axis=-1), b.op("Shape", [stored]), [fmt.packed_dim(head) * n]
    )
    if fmt.packed_dim(head) * n != head:
        codes = b.op("Slice", [codes, *ints(b, [0], [head], [-1])])
    offset = b.const(np.array(fmt.storage_offset, np.float32))
    return b.op("Sub", [b.cast(codes, _F32), offset], dtype=_F32)


def insert(
    graph: ir.Graph, before: ir.Node, op_type: str, inputs: Sequence[ir.Value | None], name: str, **attrs
) -> ir.Value:
    """A node ``name`` inserted before ``before``; its one output, named as the node."""
    node = ir.node(op_type, inputs, {k: _attribute(k, v) for k, v in attrs.items()} or None, name=name)
    node.outputs[0].name = node.name
    graph.insert_before(before, node)
    return node.outputs[0]


def _attribute(name: str, value: object) -> ir.Attr:
    """An attribute of the type its Python value has, made directly (onnx-ir's inference of the
    type checks each value against its protocols: a tenth of writing 80 fused layers)."""
    if isinstance(value, bool | int | np.integer):
        return ir.AttrInt64(name, int(value))
    if isinstance(value, float | np.floating):
        return ir.AttrFloat32(name, float(value))
    if isinstance(value, str):
        return ir.AttrString(name, value)
    if isinstance(value, ir.Tensor):
        return ir.AttrTensor(name, value)
    if isinstance(value, list | tuple) and all(isinstance(v, int) for v in value):
        return ir.AttrInt64s(name, list(value))
    return ir.Attr(name, _inferred_type(value), value)


def _inferred_type(value: object) -> ir.AttributeType:
    return ir.convenience.convert_attribute("_", value).type  # type: ignore[arg-type]


def prepend(graph: ir.Graph | ir.Function, node: ir.Node) -> None:
    """``node`` as the first node of ``graph`` (for a value every node may read)."""
    first = next(iter(graph), None)
    if first is None:
        graph.append(node)
    else:
        graph.insert_before(first, node)


def op_of(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    """The ONNX-domain node of one of ``op_types`` that produces ``value``, or None."""
    node = value.producer() if value is not None else None
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in op_types:
        return None
    return node
