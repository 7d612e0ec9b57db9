"""The attention operators whose KV cache the library quantizes: one frozen row per operator.

A row says where an operator keeps what a quantized cache touches: its input and output
slots (by the schema's names), the cache layout, the shape of a per-channel scale and the
attributes a quantized cache needs. The pass, inspection, gating, the runner and the doctor
read :data:`ATTENTION_OPS`; code that handles "the attention node" asks the node's row,
never its op type.

- ``com.microsoft::GroupQueryAttention``: padded batches, one BNSH cache per sequence
  ``[batch, kv_num_heads, sequence, head_size]``; flat per-channel scales
  (``kv_num_heads * head_size``); ``kv_cache_bit_width`` names the bits.
- ``com.microsoft::PagedAttention``: packed tokens and a block pool
  ``[num_blocks, block_size, kv_num_heads, head_size]`` addressed through ``block_table``;
  per-channel scales shaped ``(kv_num_heads, 1, head_size)``; no bit-width attribute: the
  cache's element type names the format, and ``k_cache_dtype``/``v_cache_dtype`` name the
  packed logical type (``"int4"``). With ``kv_cache_layout="LATENT"`` (absorbed MLA) the node
  has one cache, the key side, which V reads too; its value-side slots and attributes stay unset.
"""

from __future__ import annotations

__all__ = [
    "ATTENTION_OPS",
    "GQA",
    "PAGED",
    "AttentionOp",
    "CacheLayout",
    "CacheSide",
    "GqaInput",
    "GqaOutput",
    "PagedInput",
    "PagedOutput",
    "get_op",
    "op_of",
]

import dataclasses
import enum
from collections.abc import Mapping
from typing import Literal

import onnx_ir as ir

from onnx_kvcache.cache.formats import CacheFormat, scale_granularity
from onnx_kvcache.errors import KvCacheError


class GqaInput(enum.IntEnum):
    """GroupQueryAttention's input slots; the row's schema names are these, lower-cased."""

    QUERY = 0
    KEY = 1
    VALUE = 2
    PAST_KEY = 3
    PAST_VALUE = 4
    SEQLENS_K = 5
    TOTAL_SEQUENCE_LENGTH = 6
    COS_CACHE = 7
    SIN_CACHE = 8
    POSITION_IDS = 9
    ATTENTION_BIAS = 10
    HEAD_SINK = 11
    K_SCALE = 12
    V_SCALE = 13
    Q_NORM_WEIGHT = 14
    K_NORM_WEIGHT = 15
    QUERY_SEQLENS = 16


class GqaOutput(enum.IntEnum):
    """GroupQueryAttention's output slots."""

    OUTPUT = 0
    PRESENT_KEY = 1
    PRESENT_VALUE = 2
    OUTPUT_QK = 3


class PagedInput(enum.IntEnum):
    """PagedAttention's input slots."""

    QUERY = 0
    KEY = 1
    VALUE = 2
    KEY_CACHE = 3
    VALUE_CACHE = 4
    CUMULATIVE_SEQUENCE_LENGTH = 5
    PAST_SEQLENS = 6
    BLOCK_TABLE = 7
    COS_CACHE = 8
    SIN_CACHE = 9
    SLOT_MAPPING = 10
    HEAD_SINK = 11
    Q_NORM_WEIGHT = 12
    K_NORM_WEIGHT = 13
    K_SCALE = 14
    V_SCALE = 15
    ATTENTION_METADATA = 16


class PagedOutput(enum.IntEnum):
    """PagedAttention's output slots."""

    OUTPUT = 0
    KEY_CACHE_OUT = 1
    VALUE_CACHE_OUT = 2


def _names(slots: type[enum.IntEnum]) -> tuple[str, ...]:
    return tuple(slot.name.lower() for slot in slots)


@dataclasses.dataclass(frozen=True)
class CacheSide:
    """One cache of an attention node (``key`` or ``value``): where it and its scale live."""

    kind: Literal["key", "value"]
    past: str
    """Schema name of the cache input."""
    present: str
    """Schema name of the cache output."""
    scale: str
    """Schema name of the float32 scale input."""
    quant_attr: str
    """Attribute naming the granularity (``PER_TENSOR``/``PER_CHANNEL``)."""
    dtype_attr: str | None = None
    """Attribute naming a packed format's logical type (``int4``), when the operator has one."""


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """How a cache tensor is laid out; the head dimension is always last."""

    name: str
    dims: tuple[str, str, str, str]
    heads_axis: int
    """Axis of ``kv_num_heads``."""


BNSH = CacheLayout("bnsh", ("batch", "kv_num_heads", "sequence", "head_size"), 1)
PAGED_BLOCKS = CacheLayout("paged", ("num_blocks", "block_size", "kv_num_heads", "head_size"), 2)


@dataclasses.dataclass(frozen=True)
class AttentionOp:
    """One attention operator with a KV cache.

    Attributes:
        name: Short name (``gqa``, ``paged``), used in tables and capability rows.
        domain, op_type: The operator.
        inputs, outputs: The schema's input and output names, in slot order.
        sides: The key and value caches (slots by schema name).
        layout: The cache layout.
        channel_scale: Per-channel scale shape: ``flat`` (``kv_num_heads * head_size``) or
            ``heads`` (``(kv_num_heads, 1, head_size)``).
        bit_width_attr: Attribute holding the cache's bit width, if the operator has one.
        t_inputs: Inputs typed like the query (T), to read the node's dtype from.
        single_cache: ``(attribute, value)`` selecting a layout with one cache (the key side).
    """

    name: str
    domain: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    sides: tuple[CacheSide, CacheSide]
    layout: CacheLayout
    channel_scale: Literal["flat", "heads"]
    bit_width_attr: str | None
    t_inputs: tuple[str, ...]
    single_cache: tuple[str, str] | None = None

    def slot(self, name: str) -> int:
        """Input slot of the schema input ``name``."""
        return self.inputs.index(name)

    def out_slot(self, name: str) -> int:
        return self.outputs.index(name)

    def input_list(self, values: Mapping[int, ir.Value | None]) -> list[ir.Value | None]:
        """A node's inputs from ``values`` by slot: absent slots empty, trailing ones dropped."""
        used = [slot for slot, value in values.items() if value is not None]
        return [values.get(slot) for slot in range(max(used) + 1)] if used else []

    @property
    def key(self) -> CacheSide:
        return self.sides[0]

    @property
    def value(self) -> CacheSide:
        return self.sides[1]

    @property
    def scale_slots(self) -> frozenset[int]:
        return frozenset(self.slot(side.scale) for side in self.sides)

    @property
    def cache_slots(self) -> frozenset[int]:
        return frozenset(self.slot(side.past) for side in self.sides)

    def matches(self, node: ir.Node) -> bool:
        return node.op_type == self.op_type and node.domain == self.domain

    def scale_shape(self, granularity: str, kv_num_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one scale tensor: ``(1,)`` for one scale, else flat (GQA) or
        ``(heads, 1, dims)`` (PagedAttention), from the granularity row's grid."""
        heads, dims = scale_granularity(granularity).grid(kv_num_heads, head_size)
        if heads * dims == 1:
            return (1,)
        if self.channel_scale == "flat":
            return (heads * dims,)
        return (heads, 1, dims)

    def quant_attributes(
        self, fmt: CacheFormat, granularity: str, sides: tuple[CacheSide, ...]
    ) -> dict[str, str | int]:
        """The attributes a ``fmt`` cache with ``granularity`` scales needs on ``sides``."""
        attrs: dict[str, str | int] = {}
        for side in sides:
            attrs[side.quant_attr] = scale_granularity(granularity).quant_type
            if side.dtype_attr is not None and fmt.logical_name is not None:
                attrs[side.dtype_attr] = fmt.logical_name
        if self.bit_width_attr is not None:
            attrs[self.bit_width_attr] = fmt.bit_width
        return attrs

    @property
    def quant_attribute_names(self) -> tuple[str, ...]:
        """Every attribute :meth:`quant_attributes` may set."""
        names = [side.quant_attr for side in self.sides]
        names += [side.dtype_attr for side in self.sides if side.dtype_attr is not None]
        if self.bit_width_attr is not None:
            names.append(self.bit_width_attr)
        return tuple(names)


GQA = AttentionOp(
    name="gqa",
    domain="com.microsoft",
    op_type="GroupQueryAttention",
    inputs=_names(GqaInput),
    outputs=_names(GqaOutput),
    sides=(
        CacheSide("key", "past_key", "present_key", "k_scale", "k_quant_type"),
        CacheSide("value", "past_value", "present_value", "v_scale", "v_quant_type"),
    ),
    layout=BNSH,
    channel_scale="flat",
    bit_width_attr="kv_cache_bit_width",
    t_inputs=(
        "query",
        "key",
        "value",
        "cos_cache",
        "sin_cache",
        "attention_bias",
        "head_sink",
        "q_norm_weight",
        "k_norm_weight",
    ),
)

PAGED = AttentionOp(
    name="paged",
    domain="com.microsoft",
    op_type="PagedAttention",
    inputs=_names(PagedInput),
    outputs=_names(PagedOutput),
    sides=(
        CacheSide("key", "key_cache", "key_cache_out", "k_scale", "k_quant_type", "k_cache_dtype"),
        CacheSide("value", "value_cache", "value_cache_out", "v_scale", "v_quant_type", "v_cache_dtype"),
    ),
    layout=PAGED_BLOCKS,
    channel_scale="heads",
    bit_width_attr=None,
    t_inputs=(
        "query",
        "key",
        "value",
        "cos_cache",
        "sin_cache",
        "head_sink",
        "q_norm_weight",
        "k_norm_weight",
    ),
    single_cache=("kv_cache_layout", "LATENT"),
)

#: Every operator the library handles, by op type.
ATTENTION_OPS: dict[str, AttentionOp] = {row.op_type: row for row in (GQA, PAGED)}


def get_op(op: str | AttentionOp) -> AttentionOp:
    """The row for ``op``: a row, an op type (``PagedAttention``) or a short name (``paged``)."""
    if isinstance(op, AttentionOp):
        return op
    for row in ATTENTION_OPS.values():
        if op in (row.op_type, row.name):
            return row
    names = ", ".join(f"{row.op_type} ({row.name})" for row in ATTENTION_OPS.values())
    raise KvCacheError(f"Unknown attention operator {op!r}; known: {names}.")


def op_of(node: ir.Node) -> AttentionOp | None:
    """The row of ``node``'s operator, or None when it is not an attention op with a cache."""
    row = ATTENTION_OPS.get(node.op_type)
    return row if row is not None and row.domain == node.domain else None
