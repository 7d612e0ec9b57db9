"""Decoders written the way ``torch.onnx.export(..., dynamo=True)`` writes them.

The bundled decoder as an exporter writes it (``build_decoder(exported_config("llama"))``): no
GroupQueryAttention, but what torch 2.14 with transformers 5.x emits at opset 23 for a
model with a ``DynamicCache`` (see ``tests/data/export_llama_opset23.onnx``): inputs
``input_ids``, ``attention_mask``, ``position_ids`` and ``past_key_values.{i}.key|value``
(BNSH); per layer ``RMSNormalization``, Q/K/V MatMuls, Reshape/Transpose to BNSH,
``RotaryEmbedding`` with cos/sin computed from ``position_ids``, ``Concat(past, new)``
as the present outputs, the K/V repeat to the query heads (Unsqueeze/Expand/Reshape)
and ``Attention(is_causal=0)`` with the boolean mask transformers' ``sdpa_mask`` builds
(``kv <= q`` AND ``attention_mask[b, kv]``, AND ``kv > q - W`` for sliding windows).

:class:`ExportStyle` picks the architecture's variations (Qwen3 q/k norm, Mistral and
Gemma2 windows, Gemma2 soft-capping, grouped K/V without the repeat, a read
``qk_matmul_output``) and the shapes a fusion must refuse (a non-causal mask, a
top-left causal diagonal, an unusual repeat). Tests own their fixtures this way:
nothing here needs torch.
"""

from __future__ import annotations

__all__ = [
    "EXPORT_PRESETS",
    "ExportStyle",
    "ExportedConfig",
    "build_decoder",
    "build_exported_decoder",
    "exported_config",
]


import dataclasses

import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError, Param
from onnx_kvcache.models import decoder
from onnx_kvcache.models.config import DecoderConfig, WeightFactory

from builders.style import ExportedConfig, ExportStyle, GraphWriter, refuse_unwritten
from builders.torchscript import build_torchscript_decoder

EXPORT_PRESETS: dict[str, tuple[dict, ExportStyle]] = {
    "llama": ({}, ExportStyle()),
    "qwen3": ({"qk_norm": True, "rope_theta": 1_000_000.0}, ExportStyle()),
    "mistral": ({"sliding_window_layers": (0, 1, 2, 3), "sliding_window": 4}, ExportStyle()),
    "gemma2": (
        {"sliding_window_layers": (0, 2), "sliding_window": 4},
        ExportStyle(attn_softcap=50.0, final_softcap=30.0, query_scale=48**-0.5, embed_scale=True),
    ),
}
_TS = ExportStyle(exporter="torchscript", opset=18)
EXPORT_PRESETS.update(
    {
        "optimum-llama": ({}, _TS),
        "optimum-qwen2": ({"rope_theta": 1_000_000.0}, dataclasses.replace(_TS, qkv_bias=True)),
        "optimum-mistral": ({"sliding_window_layers": (0, 1, 2, 3), "sliding_window": 4}, _TS),
        "optimum-phi3": ({}, dataclasses.replace(_TS, fused_qkv=True)),
        "optimum-gemma2": (
            {"sliding_window_layers": (0, 2), "sliding_window": 4},
            dataclasses.replace(
                _TS, attn_softcap=50.0, final_softcap=30.0, query_scale=48**-0.5, embed_scale=True
            ),
        ),
        "optimum-llama-q4": ({}, dataclasses.replace(_TS, weights="q4")),
        "optimum-llama-quantized": ({}, dataclasses.replace(_TS, weights="int8")),
    }
)
"""Architecture shapes: DecoderConfig overrides and export style. Mistral's and
Gemma2's windows are small so that short tests cross them. ``optimum-*``: the
TorchScript form of optimum / onnx-community exports (``-q4``, ``-quantized``: their
weight-quantized files; ``dtype="float16"`` gives ``model_fp16.onnx``)."""


def exported_config(arch: str = "llama", **overrides) -> ExportedConfig:
    """An :class:`ExportedConfig` in an architecture's exported shape (see EXPORT_PRESETS).

    ``overrides`` replace config fields; ``exported=ExportStyle(...)`` replaces the style.
    """
    if arch not in EXPORT_PRESETS:
        raise KvCacheError(f"Unknown architecture {arch!r}; choose from {sorted(EXPORT_PRESETS)}.")
    fields, style = EXPORT_PRESETS[arch]
    settings = {"num_layers": 4, "outlier_channels": 0} | fields | {"exported": style} | overrides
    return ExportedConfig(**settings)


def build_decoder(
    config: DecoderConfig | None = None, *, weight_factory: WeightFactory | None = None, **overrides
) -> ir.Model:
    """The library's :func:`~onnx_kvcache.models.decoder.build_decoder`, and the exported forms:
    a config with a style (``exported_config(...)``, or ``exported=ExportStyle(...)`` among the
    overrides) is written as its exporter writes it."""
    config = config or DecoderConfig()
    style = overrides.pop("exported", getattr(config, "exported", None))
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(DecoderConfig)} | overrides
    if style is None:
        return decoder.build_decoder(DecoderConfig(**fields), weight_factory=weight_factory)
    return build_exported_decoder(ExportedConfig(**fields, exported=style), weight_factory=weight_factory)


class _Writer(GraphWriter):
    """An ir graph under construction with the exporter's naming and constants."""

    def __init__(self, config: DecoderConfig, weight_factory: WeightFactory | None) -> None:
        opset = config.exported.opset if config.exported is not None else 23
        super().__init__(config, weight_factory, {"": opset})
        self.tape = ir.tape.Tape(self.graph)
        self._consts: dict[tuple, ir.Value] = {}

    def const(self, array: np.ndarray) -> ir.Value:
        array = np.asarray(array)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            name = f"const_{len(self._consts)}"
            self._consts[key] = self.tape.initializer(ir.tensor(array, name=name), name=name)
        return self._consts[key]

    def ints(self, *values: int) -> ir.Value:
        return self.const(np.array(values, np.int64))

    def weight(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> ir.Value:
        if self.weight_factory is not None:
            tensor = self.weight_factory(name, shape, self.dtype)
        else:
            array = mean + std * self.rng.standard_normal(shape)
            tensor = ir.tensor(array.astype(self.np_dtype), name=name)
        return self.tape.initializer(tensor, name=name)

    def op(self, op_type: str, inputs: list, shape=None, dtype=None, **attrs) -> ir.Value:
        value = self.tape.op(op_type, inputs, attrs or None)
        if shape is not None:
            value.shape = ir.Shape(shape)
        if dtype is not None or shape is not None:
            value.dtype = dtype if dtype is not None else self.dtype
        return value

    def i64(self, op_type: str, inputs: list, shape, **attrs) -> ir.Value:
        return self.op(op_type, inputs, shape, ir.DataType.INT64, **attrs)

    def bool_(self, op_type: str, inputs: list, shape, **attrs) -> ir.Value:
        return self.op(op_type, inputs, shape, ir.DataType.BOOL, **attrs)


B, S, P, T = "batch", "seq", "past", "past + seq"
SP = "sliding_past"
"""A cropped sliding-window cache's length (transformers keeps at most ``window - 1``)."""


def build_exported_decoder(
    config: ExportedConfig, *, weight_factory: WeightFactory | None = None
) -> ir.Model:
    """The decoder of ``config`` in the exporter's shape (``config.exported`` set)."""
    style = config.exported or ExportStyle()
    if style.exporter == "torchscript":
        return build_torchscript_decoder(config, weight_factory=weight_factory)
    _refuse_unwritten_styles(style, config)
    w = _Writer(config, weight_factory)
    input_ids, mask_in, position_ids, pasts = _graph_inputs(w, style)
    sizes = _Sizes.of(w, input_ids, pasts)
    x = _embed(w, style, input_ids)
    g = _Layers.of(w, style, mask_in, position_ids, pasts, sizes)
    for i in range(config.num_layers):
        x = _layer(g, i, x)
    return _head(g, x)


def _refuse_unwritten_styles(style: ExportStyle, c: DecoderConfig) -> None:
    """Refuse the settings the exporter's form does not write (the TorchScript form's, opset
    20's limits, the genai-only settings)."""
    if style.opset == 18 or style.qkv_bias or style.fused_qkv or style.weights != "float":
        raise KvCacheError(
            "opset 18, qkv_bias, fused_qkv and quantized weights are the TorchScript form: set ",
            Param("exporter", "torchscript"),
            ".",
        )
    if c.num_heads % c.kv_num_heads:
        raise KvCacheError("num_heads must be a multiple of kv_num_heads.")
    if style.opset == 20 and (
        style.attn_softcap or style.qk_matmul_output is not None or style.mask == "top_left"
    ):
        raise KvCacheError("opset 20 writes scaled dot-product attention: no softcap, scores or is_causal.")
    if style.opset == 20 and style.kv_repeat == "grouped":
        raise KvCacheError("opset 20 repeats K/V to the query heads (the exporter has no grouped form).")
    _check_new_styles(style)
    refuse_unwritten(c, "exported mode")


def _graph_inputs(
    w: _Writer, style: ExportStyle
) -> tuple[ir.Value, ir.Value, ir.Value | None, list[tuple[ir.Value, ...]]]:
    """``input_ids``, ``attention_mask``, ``position_ids`` (when an input) and each layer's
    past K/V (a cropped sliding-window layer's: ``sliding_past`` long)."""
    c = w.c
    input_ids = ir.val("input_ids", ir.DataType.INT64, [B, S])
    mask_in = ir.val("attention_mask", ir.DataType.INT64, [B, "total"])
    w.graph.inputs.extend([input_ids, mask_in])
    position_ids = None
    if style.position_ids:
        position_ids = ir.val("position_ids", ir.DataType.INT64, [B, S])
        w.graph.inputs.append(position_ids)
    pasts = []
    for i in range(c.num_layers):
        past_dim = SP if _cropped(style, c, i) else P
        pair = tuple(
            ir.val(f"past_key_values.{i}.{kind}", w.dtype, [B, c.kv_num_heads, past_dim, c.head_size])
            for kind in ("key", "value")
        )
        w.graph.inputs.extend(pair)
        pasts.append(pair)
    return input_ids, mask_in, position_ids, pasts


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """The sizes as the exporter reads them (batch from a cache, past from the last cache),
    as scalars and 1-element vectors, and the int64 0 and 1."""

    seq1: ir.Value
    seq: ir.Value
    batch1: ir.Value
    batch: ir.Value
    past: ir.Value
    total: ir.Value
    total1: ir.Value
    zero: ir.Value
    one: ir.Value

    @classmethod
    def of(cls, w: _Writer, input_ids: ir.Value, pasts: list[tuple[ir.Value, ...]]) -> _Sizes:
        seq1 = w.i64("Shape", [input_ids], [1], start=1, end=2)
        seq = w.i64("Squeeze", [seq1], [])
        batch1 = w.i64("Shape", [pasts[0][0]], [1], start=0, end=1)
        batch = w.i64("Squeeze", [batch1], [])
        past = w.i64("Squeeze", [w.i64("Shape", [pasts[-1][1]], [1], start=2, end=3)], [])
        total = w.i64("Add", [past, seq], [])
        total1 = w.i64("Reshape", [total, w.ints(-1)], [1])
        zero, one = w.const(np.array(0, np.int64)), w.const(np.array(1, np.int64))
        return cls(seq1, seq, batch1, batch, past, total, total1, zero, one)


def _embed(w: _Writer, style: ExportStyle, input_ids: ir.Value) -> ir.Value:
    """The token embedding (times ``sqrt(hidden)`` with ``embed_scale``)."""
    c = w.c
    embed = w.weight("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), 1.0)
    x = w.op("Gather", [embed, input_ids], [B, S, c.hidden_size], axis=0)
    if style.embed_scale:
        x = w.op("Mul", [x, w.const(np.array(c.hidden_size**0.5, w.np_dtype))], [B, S, c.hidden_size])
    return x


@dataclasses.dataclass(frozen=True)
class _Layers:
    """What every layer reads: the writer and style, the inputs, sizes, masks (per window),
    rotary angles, the reshape and repeat shapes and the attention scale."""

    w: _Writer
    style: ExportStyle
    mask_in: ir.Value
    pasts: list[tuple[ir.Value, ...]]
    sizes: _Sizes
    masks: dict
    angles: ir.Value
    hidden_shape: ir.Value
    out_shape: ir.Value
    repeat: tuple[ir.Value, ir.Value]
    scale: float

    @classmethod
    def of(
        cls,
        w: _Writer,
        style: ExportStyle,
        mask_in: ir.Value,
        position_ids: ir.Value | None,
        pasts: list[tuple[ir.Value, ...]],
        z: _Sizes,
    ) -> _Layers:
        c = w.c
        h, kv, d = c.num_heads, c.kv_num_heads, c.head_size
        masks = _masks(
            w, style, mask_in, z.batch, z.batch1, z.seq, z.seq1, z.past, z.total, z.total1, z.zero, z.one
        )
        angles = _rotary_angles(w, c, position_ids, z.batch1, z.seq, z.seq1, z.past, z.zero, z.one)
        hidden_shape = w.i64("Concat", [z.batch1, z.seq1, w.ints(-1), w.ints(d)], [4], axis=0)
        out_shape = w.i64("Concat", [z.batch1, z.seq1, w.ints(-1)], [3], axis=0)
        repeat5 = w.i64("Concat", [z.batch1, w.ints(kv), w.ints(h // kv), z.total1, w.ints(d)], [5], axis=0)
        repeat4 = w.i64("Concat", [z.batch1, w.ints(h), z.total1, w.ints(d)], [4], axis=0)
        scale = style.query_scale if style.query_scale is not None else d**-0.5
        return cls(
            w, style, mask_in, pasts, z, masks, angles, hidden_shape, out_shape, (repeat5, repeat4), scale
        )

    def norm(self, value: ir.Value, name: str, shape: list, size: int) -> ir.Value:
        """RMS norm: RMSNormalization (opset 23) or decomposed (opset 20); epsilon 1e-6."""
        w, eps = self.w, 1e-6
        weight = w.weight(name, (size,), 0.1, 1.0)
        if self.style.opset == 20:
            return _rms_norm_decomposed(w, value, weight, shape, eps)
        return w.op("RMSNormalization", [value, weight], shape, axis=-1, epsilon=eps, stash_type=1)

    def linear(self, value: ir.Value, name: str, fan_in: int, fan_out: int, shape: list) -> ir.Value:
        weight = self.w.weight(name, (fan_in, fan_out), fan_in**-0.5)
        return self.w.op("MatMul", [value, weight], shape)


def _layer(g: _Layers, i: int, x: ir.Value) -> ir.Value:
    """Layer ``i``: attention block and MLP, each with its residual; its presents (and scores)
    become graph outputs."""
    c, w = g.w.c, g.w
    h, kv, d = c.num_heads, c.kv_num_heads, c.head_size
    p = f"model.layers.{i}"
    xn = g.norm(x, f"{p}.input_layernorm.weight", [B, S, c.hidden_size], c.hidden_size)
    heads = _heads(g, p, xn)
    window = c.sliding_window if i in c.sliding_window_layers and c.sliding_window else 0
    full_k, full_v, present_k, present_v, layer_mask, layer_repeat = _layer_caches(g, i, heads, window)
    present_k.name, present_v.name = f"present.{i}.key", f"present.{i}.value"
    keys, values = (
        _repeat(w, g.style, cache, *layer_repeat, kv, h // kv, h, d) for cache in (full_k, full_v)
    )
    attn, qk = _attention(g, i, heads["q"], keys, values, layer_mask)
    merged = w.op("Transpose", [attn], [B, S, h, d], perm=[0, 2, 1, 3])
    merged = w.op("Reshape", [merged, g.out_shape], [B, S, h * d], allowzero=1)
    x = w.op(
        "Add",
        [x, g.linear(merged, f"{p}.self_attn.o_proj.weight", h * d, c.hidden_size, [B, S, c.hidden_size])],
        [B, S, c.hidden_size],
    )
    x = _mlp(g, p, x)
    w.graph.outputs.extend([present_k, present_v])
    if qk is not None:
        w.graph.outputs.append(qk)
    return x


def _heads(g: _Layers, p: str, xn: ir.Value) -> dict[str, ir.Value]:
    """q, k, v in BNSH: projected, split into heads, q/k normed (Qwen3) and rotated."""
    c, w = g.w.c, g.w
    d = c.head_size
    heads = {}
    for name, n in (("q", c.num_heads), ("k", c.kv_num_heads), ("v", c.kv_num_heads)):
        flat = g.linear(xn, f"{p}.self_attn.{name}_proj.weight", c.hidden_size, n * d, [B, S, n * d])
        split = w.op("Reshape", [flat, g.hidden_shape], [B, S, n, d], allowzero=1)
        if c.qk_norm and name != "v":
            split = g.norm(split, f"{p}.self_attn.{name}_norm.weight", [B, S, n, d], d)
        bnsh = w.op("Transpose", [split], [B, n, S, d], perm=[0, 2, 1, 3])
        if name != "v" and g.style.opset == 20:
            bnsh = _rotary_decomposed(w, bnsh, g.angles, [B, n, S, d])
        elif name != "v":
            cos, sin = _cos_sin(w, g.angles, d)
            bnsh = w.op("RotaryEmbedding", [bnsh, cos, sin], [B, n, S, d], interleaved=0, num_heads=n)
        heads[name] = bnsh
    return heads


def _layer_caches(g: _Layers, i: int, heads: dict[str, ir.Value], window: int) -> _CroppedLayer:
    """(K and V attention reads, present K and V, the layer's mask, its repeat shapes):
    ``Concat(past, new)`` as both, or a cropped sliding-window layer's."""
    w, z, c = g.w, g.sizes, g.w.c
    if _cropped(g.style, c, i):
        return _cropped_cache(w, g.pasts[i], heads, window, g.mask_in, z.seq, z.batch1, z.seq1, z.zero, z.one)
    kv, d = c.kv_num_heads, c.head_size
    present_k = w.op("Concat", [g.pasts[i][0], heads["k"]], [B, kv, T, d], axis=-2)
    present_v = w.op("Concat", [g.pasts[i][1], heads["v"]], [B, kv, T, d], axis=-2)
    return present_k, present_v, present_k, present_v, g.masks[window], g.repeat


def _attention(
    g: _Layers, i: int, q: ir.Value, keys: ir.Value, values: ir.Value, layer_mask: ir.Value
) -> tuple[ir.Value, ir.Value | None]:
    """The attention output ``[B, h, S, d]`` (eager, decomposed sdpa or the ONNX Attention node)
    and, with ``qk_matmul_output``, its scores output ``attn_weights.{i}``."""
    w, style, c = g.w, g.style, g.w.c
    shape: list[int | str | None] = [B, c.num_heads, S, c.head_size]
    attrs: dict = {"is_causal": int(style.mask == "top_left"), "scale": float(g.scale)}
    if style.attn_softcap:
        attrs["softcap"] = float(style.attn_softcap)
    inputs = [q, keys, values]
    if style.mask != "top_left":
        inputs.append(layer_mask)
    outputs = 1
    if style.qk_matmul_output is not None:
        attrs["qk_matmul_output_mode"] = style.qk_matmul_output
        outputs = 4
    qk = None
    if style.attention == "eager":
        attn = _eager_attention(w, style, q, keys, values, layer_mask, g.scale, shape)
    elif style.opset == 20:
        attn = _sdpa_decomposed(w, q, keys, values, layer_mask, g.scale, shape)
    else:
        node = ir.node("Attention", inputs, attrs, num_outputs=outputs, name=f"node_Attention_{i}")
        w.graph.append(node)
        attn = node.outputs[0]
        attn.dtype, attn.shape = w.dtype, ir.Shape(shape)
        if outputs == 4:
            for k in (1, 2):
                node.outputs[k].name = ""
            qk = node.outputs[3]
    attn.name = f"scaled_dot_product_attention_{i}"
    if qk is not None:
        qk.name, qk.dtype, qk.shape = f"attn_weights.{i}", w.dtype, ir.Shape([B, c.num_heads, S, None])
    return attn, qk


def _mlp(g: _Layers, p: str, x: ir.Value) -> ir.Value:
    """Post-attention norm, SwiGLU MLP and its residual."""
    c, w = g.w.c, g.w
    xn = g.norm(x, f"{p}.post_attention_layernorm.weight", [B, S, c.hidden_size], c.hidden_size)
    width = c.intermediate_size
    gate = g.linear(xn, f"{p}.mlp.gate_proj.weight", c.hidden_size, width, [B, S, width])
    up = g.linear(xn, f"{p}.mlp.up_proj.weight", c.hidden_size, width, [B, S, width])
    gate = w.op("Mul", [gate, w.op("Sigmoid", [gate], [B, S, width])], [B, S, width])
    down = g.linear(
        w.op("Mul", [gate, up], [B, S, width]),
        f"{p}.mlp.down_proj.weight",
        width,
        c.hidden_size,
        [B, S, c.hidden_size],
    )
    return w.op("Add", [x, down], [B, S, c.hidden_size])


def _head(g: _Layers, x: ir.Value) -> ir.Model:
    """The final norm, lm_head and logit soft-cap: ``logits``, the first output; the model
    (shapes made static with ``static_shapes``)."""
    c, w, style = g.w.c, g.w, g.style
    x = g.norm(x, "model.norm.weight", [B, S, c.hidden_size], c.hidden_size)
    logits = g.linear(x, "lm_head.weight", c.hidden_size, c.vocab_size, [B, S, c.vocab_size])
    if style.final_softcap:
        cap = w.const(np.array(style.final_softcap, w.np_dtype))
        logits = w.op("Div", [logits, cap], [B, S, c.vocab_size])
        logits = w.op("Mul", [w.op("Tanh", [logits], [B, S, c.vocab_size]), cap], [B, S, c.vocab_size])
    logits.name = "logits"
    w.graph.outputs.insert(0, logits)
    model = ir.Model(w.graph, ir_version=10, producer_name="onnx-kvcache (exporter shape)")
    if style.static_shapes is not None:
        _make_static(model, style.static_shapes)
    return model


def _masks(
    w: _Writer, style: ExportStyle, mask_in, batch, batch1, seq, seq1, past, total, total1, zero, one
) -> dict:
    """transformers' sdpa_mask, per window size used (0: full attention)."""
    c = w.c
    b_idx = w.i64("Unsqueeze", [w.i64("Range", [zero, batch, one], [B]), w.ints(1, 2)], [B, 1, 1])
    b_idx = w.i64("Unsqueeze", [b_idx, w.ints(3)], [B, 1, 1, 1])
    cache_pos = w.i64("Add", [w.i64("Range", [zero, seq, one], [S]), past], [S])
    q_idx = w.i64("Unsqueeze", [cache_pos, w.ints(0, 1)], [1, 1, S])
    q_idx = w.i64("Unsqueeze", [q_idx, w.ints(3)], [1, 1, S, 1])
    kv_idx = w.i64("Unsqueeze", [w.i64("Range", [zero, total, one], [T]), w.ints(0, 1)], [1, 1, T])
    kv_idx = w.i64("Unsqueeze", [kv_idx, w.ints(2)], [1, 1, 1, T])
    as_bool = w.bool_("Cast", [mask_in], [B, "total"], to=ir.DataType.BOOL)
    index_shape = w.i64("Shape", [w.i64("Max", [b_idx, kv_idx], [B, 1, 1, T])], [4])
    stacked = w.i64(
        "Concat",
        [
            w.i64(
                "Unsqueeze", [w.i64("Expand", [idx, index_shape], [B, 1, 1, T]), w.ints(-1)], [B, 1, 1, T, 1]
            )
            for idx in (b_idx, kv_idx)
        ],
        [B, 1, 1, T, 2],
        axis=-1,
    )
    padding = w.bool_("GatherND", [as_bool, stacked], [B, 1, 1, T], batch_dims=0)
    full_shape = w.i64("Concat", [batch1, w.ints(1), seq1, total1], [4], axis=0)
    windows = {0}
    if c.sliding_window and c.sliding_window_layers and style.window_cache != "cropped":
        windows.add(c.sliding_window)
    masks = {}
    for window in sorted(windows):
        cond = w.const(np.array(True))
        if window:
            lower = w.i64("Sub", [q_idx, w.const(np.array(window, np.int64))], [1, 1, S, 1])
            cond = w.bool_("And", [cond, w.bool_("Greater", [kv_idx, lower], [1, 1, S, T])], [1, 1, S, T])
        if style.mask == "causal":
            cond = w.bool_("And", [cond, w.bool_("LessOrEqual", [kv_idx, q_idx], [1, 1, S, T])], [1, 1, S, T])
        cond = w.bool_("And", [cond, padding], [B, 1, S, T])
        masks[window] = w.bool_("Expand", [cond, full_shape], [B, 1, S, T])
    return masks


def _rotary_angles(
    w: _Writer, c: DecoderConfig, position_ids, batch1, seq, seq1, past, zero, one
) -> ir.Value:
    """Rotary angles ``[batch, seq, head_size / 2]`` from positions, in float32."""
    d = c.head_size
    inv_freq = (1.0 / (c.rope_theta ** (np.arange(0, d, 2) / d))).astype(np.float32)
    if position_ids is None:  # the cache positions, per batch row
        cache_pos = w.i64("Add", [w.i64("Range", [zero, seq, one], [S]), past], [S])
        rows = w.i64("Concat", [batch1, seq1], [2], axis=0)
        position_ids = w.i64("Expand", [w.i64("Unsqueeze", [cache_pos, w.ints(0)], [1, S]), rows], [B, S])
    positions = w.i64("Unsqueeze", [position_ids, w.ints(2)], [B, S, 1])
    as_float = w.op("Cast", [positions], [B, S, 1], ir.DataType.FLOAT, to=ir.DataType.FLOAT)
    return w.op("Mul", [as_float, w.const(inv_freq)], [B, S, d // 2], ir.DataType.FLOAT)


def _cos_sin(w: _Writer, angles: ir.Value, d: int) -> tuple[ir.Value, ir.Value]:
    """cos/sin of the angles in the model's dtype; one pair per RotaryEmbedding, as exported."""
    pair = []
    for op_type in ("Cos", "Sin"):
        value = w.op(op_type, [angles], [B, S, d // 2], ir.DataType.FLOAT)
        if w.dtype != ir.DataType.FLOAT:
            value = w.op("Cast", [value], [B, S, d // 2], to=w.dtype)
        pair.append(value)
    return pair[0], pair[1]


def _repeat(w: _Writer, style: ExportStyle, cache, repeat5, repeat4, kv, group, h, d) -> ir.Value:
    """K/V heads as Attention reads them: repeated to the query heads, or grouped."""
    if style.kv_repeat == "grouped" or group == 1:
        return cache
    length = cache.shape[2] if cache.shape is not None else T
    if style.kv_repeat == "tile":
        return w.op("Tile", [cache, w.ints(1, group, 1, 1)], [B, h, length, d])
    grown = w.op("Unsqueeze", [cache, w.ints(2)], [B, kv, 1, length, d])
    grown = w.op("Expand", [grown, repeat5], [B, kv, group, length, d])
    return w.op("Reshape", [grown, repeat4], [B, h, length, d], allowzero=1)


def _rms_norm_decomposed(w: _Writer, x: ir.Value, weight: ir.Value, shape, eps: float) -> ir.Value:
    """transformers' RMSNorm below opset 23: in float32, then scaled by the weight."""
    f32 = ir.DataType.FLOAT
    wide = x if w.dtype == f32 else w.op("Cast", [x], shape, f32, to=f32)
    square = w.op("Pow", [wide, w.const(np.array(2.0, np.float32))], shape, f32)
    mean = w.op("ReduceMean", [square, w.ints(-1)], [*shape[:-1], 1], f32, keepdims=1)
    rms = w.op(
        "Sqrt",
        [w.op("Add", [mean, w.const(np.array(eps, np.float32))], [*shape[:-1], 1], f32)],
        [*shape[:-1], 1],
        f32,
    )
    normed = w.op("Mul", [wide, w.op("Reciprocal", [rms], [*shape[:-1], 1], f32)], shape, f32)
    if w.dtype != f32:
        normed = w.op("Cast", [normed], shape, to=w.dtype)
    return w.op("Mul", [weight, normed], shape)


def _rotary_decomposed(w: _Writer, x: ir.Value, angles: ir.Value, shape) -> ir.Value:
    """transformers' apply_rotary_pos_emb: ``x * cos + rotate_half(x) * sin``."""
    d = shape[-1]
    full = w.op("Concat", [angles, angles], [B, S, d], ir.DataType.FLOAT, axis=-1)
    tables = []
    for op_type in ("Cos", "Sin"):
        table = w.op(op_type, [full], [B, S, d], ir.DataType.FLOAT)
        if w.dtype != ir.DataType.FLOAT:
            table = w.op("Cast", [table], [B, S, d], to=w.dtype)
        tables.append(w.op("Unsqueeze", [table, w.ints(1)], [B, 1, S, d]))
    cos, sin = tables
    half = d // 2
    first = w.op("Slice", [x, w.ints(0), w.ints(half), w.ints(-1)], [*shape[:-1], half])
    second = w.op("Slice", [x, w.ints(half), w.ints(2**63 - 1), w.ints(-1)], [*shape[:-1], half])
    rotated = w.op("Concat", [w.op("Neg", [second], [*shape[:-1], half]), first], shape, axis=-1)
    return w.op("Add", [w.op("Mul", [x, cos], shape), w.op("Mul", [rotated, sin], shape)], shape)


def _sdpa_decomposed(w: _Writer, q, k, v, mask, scale: float, shape) -> ir.Value:
    """scaled_dot_product_attention with a boolean mask, as the exporter's op library writes it."""
    h, d = shape[1], shape[3]
    key_shape = w.i64("Shape", [k], [4])
    last = w.i64("Slice", [key_shape, w.ints(-1), w.ints(2**63 - 1)], [1])
    second_last = w.i64("Slice", [key_shape, w.ints(-2), w.ints(-1)], [1])
    first = w.i64("Slice", [key_shape, w.ints(-(2**63)), w.ints(-2)], [2])
    squeezed = w.op(
        "Reshape", [k, w.i64("Concat", [w.ints(-1), second_last, last], [3], axis=0)], [None, T, d]
    )
    flipped = w.op("Transpose", [squeezed], [None, d, T], perm=[0, 2, 1])
    key_t = w.op("Reshape", [flipped, w.i64("Concat", [first, last, second_last], [4], axis=0)], [B, h, d, T])
    factor = w.const(np.array(np.sqrt(scale), w.np_dtype))
    scores = w.op(
        "MatMul", [w.op("Mul", [q, factor], shape), w.op("Mul", [key_t, factor], [B, h, d, T])], [B, h, S, T]
    )
    bias = w.op(
        "Where",
        [mask, w.const(np.array(0.0, w.np_dtype)), w.const(np.array(-np.inf, w.np_dtype))],
        [B, 1, S, T],
    )
    probs = w.op("Softmax", [w.op("Add", [scores, bias], [B, h, S, T])], [B, h, S, T], axis=-1)
    dropout = ir.node("Dropout", [probs, w.const(np.array(0.0, np.float32))], num_outputs=1)
    w.graph.append(dropout)
    dropout.outputs[0].dtype, dropout.outputs[0].shape = w.dtype, ir.Shape([B, h, S, T])
    return w.op("MatMul", [dropout.outputs[0], v], shape)


# -- transformers 5.x forms: cropped sliding-window caches, eager attention, static shapes --


def _check_new_styles(style: ExportStyle) -> None:
    if style.static_shapes is not None and (style.opset != 20 or style.attention != "sdpa"):
        raise KvCacheError(
            Param("static_shapes"),
            " writes the opset-20 scaled dot-product form; set ",
            Param("opset", 20),
            ".",
        )
    if style.attention == "eager" and (style.qk_matmul_output is not None or style.mask == "top_left"):
        raise KvCacheError("eager attention has no attention-weights output and no is_causal.")
    if style.attention_sinks and style.attention != "eager":
        raise KvCacheError(
            Param("attention_sinks"), " is written by eager attention; set ", Param("attention", "eager"), "."
        )


def _cropped(style: ExportStyle, c: DecoderConfig, layer: int) -> bool:
    return style.window_cache == "cropped" and layer in c.sliding_window_layers and c.sliding_window > 1


_CroppedLayer = tuple[ir.Value, ir.Value, ir.Value, ir.Value, ir.Value, tuple[ir.Value, ir.Value]]


def _cropped_cache(
    w: _Writer, pasts, heads, window: int, mask_in, seq, batch1, seq1, zero, one
) -> _CroppedLayer:
    """transformers 5.x's DynamicSlidingWindowLayer, as exported: (full K, full V, present K,
    present V, the layer's mask, its repeat shapes).

    The wrapper's ``update`` crops the past to its last ``window - 1`` tokens; the layer's
    ``update`` concatenates the new tokens (what attention reads) and keeps the last
    ``window - 1`` of that as the present. The mask (``sdpa_mask`` with ``get_mask_sizes``)
    counts key positions from ``kv_offset = max(0, past - (window - 1))``, query positions
    from the layer's past.
    """
    c = w.c
    kv, d, h = c.kv_num_heads, c.head_size, c.num_heads
    keep = window - 1
    start, end, axis2 = w.ints(-keep), w.ints(2**63 - 1), w.ints(2)
    cropped_len = f"{SP} - Max(0, {SP} - {keep})"
    total = f"{cropped_len} + {S}"
    kept = f"Max(0, {total} - Max(0, {total} - {keep}))"
    out = []
    for past, new in zip(pasts, (heads["k"], heads["v"])):
        cropped = w.op("Slice", [past, start, end, axis2], [B, kv, cropped_len, d])
        full = w.op("Concat", [cropped, new], [B, kv, total, d], axis=-2)
        out.append((full, w.op("Slice", [full, start, end, axis2], [B, kv, kept, d])))
    (full_k, present_k), (full_v, present_v) = out
    # the layer's mask sizes: kv_offset, kv_length; positions from its own past
    past = w.i64("Squeeze", [w.i64("Shape", [pasts[0]], [1], start=2, end=3)], [])
    offset = w.i64("Max", [w.i64("Sub", [past, w.const(np.array(keep, np.int64))], []), zero], [])
    length = w.i64("Add", [w.i64("Sub", [past, offset], []), seq], [])
    length1 = w.i64("Reshape", [length, w.ints(-1)], [1])
    b_idx = w.i64(
        "Unsqueeze",
        [w.i64("Range", [zero, w.i64("Squeeze", [batch1], []), one], [B]), w.ints(1, 2, 3)],
        [B, 1, 1, 1],
    )
    q_idx = w.i64("Add", [w.i64("Range", [zero, seq, one], [S]), past], [S])
    q_idx = w.i64("Unsqueeze", [q_idx, w.ints(0, 1, 3)], [1, 1, S, 1])
    kv_idx = w.i64("Add", [w.i64("Range", [zero, length, one], [total]), offset], [total])
    kv_idx = w.i64("Unsqueeze", [kv_idx, w.ints(0, 1, 2)], [1, 1, 1, total])
    as_bool = w.bool_("Cast", [mask_in], [B, "total"], to=ir.DataType.BOOL)
    index_shape = w.i64("Shape", [w.i64("Max", [b_idx, kv_idx], [B, 1, 1, total])], [4])
    stacked = w.i64(
        "Concat",
        [
            w.i64(
                "Unsqueeze",
                [w.i64("Expand", [idx, index_shape], [B, 1, 1, total]), w.ints(-1)],
                [B, 1, 1, total, 1],
            )
            for idx in (b_idx, kv_idx)
        ],
        [B, 1, 1, total, 2],
        axis=-1,
    )
    padding = w.bool_("GatherND", [as_bool, stacked], [B, 1, 1, total], batch_dims=0)
    lower = w.i64("Sub", [q_idx, w.const(np.array(window, np.int64))], [1, 1, S, 1])
    cond = w.bool_("Greater", [kv_idx, lower], [1, 1, S, total])
    cond = w.bool_("And", [cond, w.bool_("LessOrEqual", [kv_idx, q_idx], [1, 1, S, total])], [1, 1, S, total])
    cond = w.bool_("And", [cond, padding], [B, 1, S, total])
    full_shape = w.i64("Concat", [batch1, w.ints(1), seq1, length1], [4], axis=0)
    mask = w.bool_("Expand", [cond, full_shape], [B, 1, S, total])
    group = h // kv
    repeat5 = w.i64("Concat", [batch1, w.ints(kv), w.ints(group), length1, w.ints(d)], [5], axis=0)
    repeat4 = w.i64("Concat", [batch1, w.ints(h), length1, w.ints(d)], [4], axis=0)
    return full_k, full_v, present_k, present_v, mask, (repeat5, repeat4)


def _eager_attention(w: _Writer, style: ExportStyle, q, k, v, mask, scale: float, shape) -> ir.Value:
    """transformers' eager_attention_forward (Gemma2's): scale, soft-cap, additive mask, fp32 softmax."""
    kv_len = k.shape[2] if k.shape is not None else None
    scores_shape = [B, shape[1], S, kv_len]
    key_t = w.op("Transpose", [k], [B, shape[1], shape[3], kv_len], perm=[0, 1, 3, 2])
    scores = w.op("MatMul", [q, key_t], scores_shape)
    scores = w.op("Mul", [scores, w.const(np.array(scale, w.np_dtype))], scores_shape)
    if style.attn_softcap:
        cap = w.const(np.array(style.attn_softcap, w.np_dtype))
        scores = w.op("Div", [scores, cap], scores_shape)
        scores = w.op("Mul", [w.op("Tanh", [scores], scores_shape), cap], scores_shape)
    lowest = np.finfo(np.float32 if w.np_dtype == np.dtype("float32") else np.float16).min
    if w.dtype == ir.DataType.BFLOAT16:
        lowest = float(np.finfo(np.float32).min)  # bf16's range is float32's
    bias = w.op(
        "Where",
        [mask, w.const(np.array(0.0, w.np_dtype)), w.const(np.array(lowest, w.np_dtype))],
        [B, 1, S, kv_len],
    )
    key_len = w.i64("Shape", [k], [1], start=2, end=3)
    bias = w.op("Slice", [bias, w.ints(0), key_len, w.ints(3)], [B, 1, S, kv_len])  # mask[..., :kv_len]
    scores = w.op("Add", [scores, bias], scores_shape)
    f32 = ir.DataType.FLOAT
    if w.dtype != f32:
        scores = w.op("Cast", [scores], scores_shape, f32, to=f32)
    if style.attention_sinks:
        scores = _with_sinks(w, q, scores, scores_shape, f32 if w.dtype != f32 else w.dtype)
    softmax_shape = [*scores_shape[:3], None] if style.attention_sinks else scores_shape
    probs = w.op("Softmax", [scores], softmax_shape, f32 if w.dtype != f32 else None, axis=-1)
    if style.attention_sinks:  # the sink column dropped: probs[..., :-1]
        probs = w.op("Slice", [probs, w.ints(0), w.ints(-1), w.ints(-1)], scores_shape, probs.dtype)
    if w.dtype != f32:
        probs = w.op("Cast", [probs], scores_shape, to=w.dtype)
    return w.op("MatMul", [probs, v], shape)


def _with_sinks(
    w: _Writer, q: ir.Value, scores: ir.Value, scores_shape: list, dtype: ir.DataType
) -> ir.Value:
    """gpt-oss's sinks: one logit per head beside the scores (``Concat`` on the key axis), the
    row's maximum subtracted, as transformers' ``eager_attention_forward`` of gpt-oss writes it."""
    heads = w.c.num_heads
    sinks = np.linspace(-1.0, 1.5, heads, dtype=np.float32).reshape(1, heads, 1, 1)
    sink = w.const(sinks.astype(dtype.numpy()))
    rows = w.i64("Shape", [q], [3], start=0, end=3)
    column = w.op("Expand", [sink, w.i64("Concat", [rows, w.ints(1)], [4], axis=0)], [B, heads, S, 1], dtype)
    combined_shape = [*scores_shape[:3], None]
    combined = w.op("Concat", [scores, column], combined_shape, dtype, axis=-1)
    peak = w.op("ReduceMax", [combined, w.ints(-1)], [*scores_shape[:3], 1], dtype, keepdims=1)
    return w.op("Sub", [combined, peak], combined_shape, dtype)


def _make_static(model: ir.Model, sizes: tuple[int, int, int | None]) -> None:
    """Fix batch, seq and past, then fold constants as the exporter's optimizer does."""
    import onnxscript.optimizer

    batch, seq, past = sizes
    names: dict[str, int | str] = {B: batch, S: seq}
    if past is not None:
        names |= {P: past, SP: past, "total": past + seq}
    for value in model.graph.inputs:
        if value.shape is not None:
            value.shape = ir.Shape(
                [names.get(str(d), d) if not isinstance(d, int) else d for d in value.shape]
            )
    for node in model.graph:
        for value in node.outputs:
            value.shape = None  # re-inferred by the optimizer
    for value in model.graph.outputs:
        value.shape = None
    onnxscript.optimizer.optimize(model, num_iterations=2)
