"""Decoders written as optimum's TorchScript export writes them (``exporter="torchscript"``).

``optimum-cli export onnx --task text-generation-with-past`` (optimum-onnx 0.1.0,
transformers 4.57, ``torch.onnx.export`` with TorchScript, opset 18) is the form of the
onnx-community / transformers.js models; ``tests/data/optimum_llama/model.onnx`` is one.
What it writes, and this builder too:

- no ``value_info``: only graph inputs, outputs and initializers have shapes; constants
  are ``Constant`` nodes; sizes come from ``Shape``/``Gather`` of activations;
- the mask from ``attention_mask`` (sdpa_mask): ``ConstantOfShape(True)`` AND
  ``kv <= q`` [AND ``kv > q - W``] AND the padding looked up as
  ``Gather(Flatten(mask), b * width + kv)``, then ``Expand`` to ``[batch, 1, seq, total]``
  whose target goes through torch's ``Where(shape == -1, 1, shape)``;
- RMS norm, rotary embeddings (half split, cos/sin from ``MatMul(inv_freq, position_ids)``)
  and repeat_kv (``Unsqueeze``/``Expand``/``Reshape``) written out; the presents are
  ``Concat(past, new)``;
- attention as sdpa's decomposition (``Slice`` of the mask to the key length,
  ``Mul(Q, sqrt(scale))``/``Mul(K^T, sqrt(scale))``, ``Where(mask, 0, -inf)``, ``Softmax``,
  the ``IsNaN`` guard) or, for soft-capped attention (Gemma-2), transformers' eager
  attention (``MatMul`` then ``Mul(scale)``, ``Tanh`` soft-cap, the mask as
  ``Where(mask, 0, min)`` added, ``Softmax`` in float32);
- family variations: q/k/v biases (Qwen2), one qkv projection split by ``Slice`` and a
  fused gate/up MLP (Phi-3), sliding windows (Mistral, Gemma-2), embedding scaling by
  ``sqrt(hidden)`` and logit soft-capping (Gemma-2), fp16 weights, and the
  onnx-community weight-quantized files: ``model_q4.onnx`` (``com.microsoft::MatMulNBits``,
  4 bits, blocks of 32) and ``model_quantized.onnx`` (``DynamicQuantizeLinear`` +
  ``MatMulInteger`` with int8 weights).
"""

from __future__ import annotations

__all__ = ["build_torchscript_decoder"]

import dataclasses

import ml_dtypes
import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.models.config import DecoderConfig, WeightFactory

from builders.style import ExportStyle, GraphWriter, refuse_unwritten

B, S, P = "batch_size", "sequence_length", "past_sequence_length"
T = f"{P} + {S}"
_END = np.iinfo(np.int64).max
_BLOCK = 32


class _Script(GraphWriter):
    """A graph written with TorchScript's habits: Constant nodes, no annotations."""

    def __init__(self, config: DecoderConfig, weight_factory: WeightFactory | None) -> None:
        opset = {"": 18}
        if (config.exported or ExportStyle()).weights == "q4":
            opset["com.microsoft"] = 1
        super().__init__(config, weight_factory, opset)
        self.count = 0

    def op(self, op_type: str, inputs: list, domain: str = "", outputs: int = 1, **attrs):
        self.count += 1
        node = ir.node(op_type, inputs, attrs or None, domain=domain, num_outputs=outputs)
        node.name = f"/{op_type}_{self.count}"
        for k, value in enumerate(node.outputs):
            value.name = f"{node.name}_output_{k}"
        self.graph.append(node)
        return node.outputs[0] if outputs == 1 else node.outputs

    def cst(self, array) -> ir.Value:
        return self.op("Constant", [], value=ir.tensor(np.asarray(array)))

    def ints(self, *values: int) -> ir.Value:
        return self.cst(np.array(values, np.int64))

    def scalar(self, value: float, dtype=None) -> ir.Value:
        return self.cst(np.array(value, dtype or self.np_dtype))

    def init(self, name: str, array: np.ndarray) -> ir.Value:
        return self._register(name, ir.tensor(array, name=name))

    def _register(self, name: str, tensor: ir.TensorProtocol) -> ir.Value:
        value = ir.Value(name=name, const_value=tensor)
        value.dtype, value.shape = tensor.dtype, ir.Shape(tensor.shape.numpy())
        self.graph.register_initializer(value)
        return value

    def weight(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> ir.Value:
        if self.weight_factory is not None:
            return self._register(name, self.weight_factory(name, shape, self.dtype))
        array = mean + std * self.rng.standard_normal(shape)
        return self.init(name, array.astype(self.np_dtype))

    def size(self, value: ir.Value, index: int) -> ir.Value:
        """A scalar dimension, as torch writes ``x.shape[i]``."""
        return self.op("Gather", [self.op("Shape", [value]), self.cst(np.array(index, np.int64))], axis=0)

    def u0(self, scalar: ir.Value) -> ir.Value:
        return self.op("Unsqueeze", [scalar, self.ints(0)])

    def expand_target(self, dims: list[ir.Value]) -> ir.Value:
        """torch's Expand target: ``Where(shape == -1, 1, shape)``."""
        shape = self.op("Reshape", [self.op("Concat", dims, axis=0), self.ints(-1)])
        ones = self.op(
            "ConstantOfShape", [self.op("Shape", [shape])], value=ir.tensor(np.array([1], np.int64))
        )
        minus = self.op("Mul", [ones, self.cst(np.array(-1, np.int64))])
        return self.op("Where", [self.op("Equal", [shape, minus]), ones, shape])


def build_torchscript_decoder(
    config: DecoderConfig, *, weight_factory: WeightFactory | None = None
) -> ir.Model:
    """The decoder of ``config`` as optimum's TorchScript export writes it."""
    style = config.exported or ExportStyle(exporter="torchscript", opset=18)
    _refuse_unwritten_styles(style, config, weight_factory)
    w = _Script(config, weight_factory)
    input_ids, mask_in, position_ids, pasts = _graph_inputs(w)
    embed = w.weight("model.embed_tokens.weight", (config.vocab_size, config.hidden_size), 1.0)
    x = w.op("Gather", [embed, input_ids])
    if style.embed_scale:
        x = w.op("Mul", [x, w.scalar(config.hidden_size**0.5)])
    g = _Layers.of(w, style, x, mask_in, position_ids, pasts)
    for i in range(config.num_layers):
        x = _layer(g, i, x)
    return _head(g, x)


def _refuse_unwritten_styles(
    style: ExportStyle, c: DecoderConfig, weight_factory: WeightFactory | None
) -> None:
    """Refuse what the TorchScript form does not write (and quantized weights it cannot make)."""
    if c.num_heads % c.kv_num_heads:
        raise KvCacheError("num_heads must be a multiple of kv_num_heads.")
    if style.weights != "float" and (
        weight_factory is not None or (style.weights == "int8" and c.dtype != "float32")
    ):
        raise KvCacheError(
            "Quantized weights (q4, int8) are made from the builder's seeded weights: no "
            "weight_factory; int8 needs dtype float32."
        )
    refuse_unwritten(
        c,
        "TorchScript form",
        qk_norm=bool(c.qk_norm),
        kv_repeat=style.kv_repeat != "expand",
        mask=style.mask != "causal",
        qk_matmul_output=style.qk_matmul_output is not None,
        **{"position_ids=False": not style.position_ids},
    )


def _graph_inputs(w: _Script) -> tuple[ir.Value, ir.Value, ir.Value, list[tuple[ir.Value, ...]]]:
    """``input_ids``, ``attention_mask``, ``position_ids`` and each layer's past K/V."""
    c = w.c
    input_ids = ir.val("input_ids", ir.DataType.INT64, [B, S])
    mask_in = ir.val("attention_mask", ir.DataType.INT64, [B, T])
    position_ids = ir.val("position_ids", ir.DataType.INT64, [B, S])
    w.graph.inputs.extend([input_ids, mask_in, position_ids])
    pasts = []
    for i in range(c.num_layers):
        pair = tuple(
            ir.val(f"past_key_values.{i}.{kind}", w.dtype, [B, c.kv_num_heads, P, c.head_size])
            for kind in ("key", "value")
        )
        w.graph.inputs.extend(pair)
        pasts.append(pair)
    return input_ids, mask_in, position_ids, pasts


@dataclasses.dataclass(frozen=True)
class _Layers:
    """What every layer reads: the writer and style, the pasts, the masks per window (additive
    under eager attention), the rotary cos/sin and the attention scale."""

    w: _Script
    style: ExportStyle
    pasts: list[tuple[ir.Value, ...]]
    masks: dict[int, ir.Value]
    eager: bool
    """Soft-capped attention is transformers' eager attention (Gemma-2)."""
    cos: ir.Value
    sin: ir.Value
    scale: float

    @classmethod
    def of(
        cls,
        w: _Script,
        style: ExportStyle,
        embeds: ir.Value,
        mask_in: ir.Value,
        position_ids: ir.Value,
        pasts: list[tuple[ir.Value, ...]],
    ) -> _Layers:
        masks = _masks(w, embeds, mask_in, pasts[0][0])
        eager = bool(style.attn_softcap)
        if eager:  # transformers' eager_mask: 0 where attended, the dtype's lowest elsewhere
            low = float(ml_dtypes.finfo(w.np_dtype).min)  # numpy has no bfloat16 finfo
            masks = {k: w.op("Where", [m, w.scalar(0.0), w.scalar(low)]) for k, m in masks.items()}
        cos, sin = _rotary(w, position_ids)
        scale = style.query_scale if style.query_scale is not None else w.c.head_size**-0.5
        return cls(w, style, pasts, masks, eager, cos, sin, scale)

    def linear(self, value: ir.Value, name: str, fan_in: int, fan_out: int, bias: bool = False) -> ir.Value:
        w = self.w
        out = _linear(w, self.style, value, name, fan_in, fan_out)
        if bias:
            out = w.op("Add", [out, w.weight(name.replace(".weight", ".bias"), (fan_out,), 0.02)])
        return out


def _layer(g: _Layers, i: int, x: ir.Value) -> ir.Value:
    """Layer ``i``: q/k/v in heads and rotated, the presents, attention, o_proj, MLP and the
    residuals; its presents become graph outputs."""
    c, w = g.w.c, g.w
    h, kv, d = c.num_heads, c.kv_num_heads, c.head_size
    p = f"model.layers.{i}"
    xn = _rms_norm(w, x, f"{p}.input_layernorm.weight")
    batch, seq = w.size(xn, 0), w.size(xn, 1)
    flats = _projections(g, p, xn)
    heads = {}
    for n in ("q", "k", "v"):
        shape = w.op("Concat", [w.u0(batch), w.u0(seq), w.ints(-1), w.ints(d)], axis=0)
        heads[n] = w.op("Transpose", [w.op("Reshape", [flats[n], shape])], perm=[0, 2, 1, 3])
    cos_u, sin_u = (w.op("Unsqueeze", [t, w.ints(1)]) for t in (g.cos, g.sin))
    q, k = (_rotate(w, heads[n], cos_u, sin_u) for n in ("q", "k"))
    present_k = w.op("Concat", [g.pasts[i][0], k], axis=-2)
    present_v = w.op("Concat", [g.pasts[i][1], heads["v"]], axis=-2)
    for value, kind in ((present_k, "key"), (present_v, "value")):
        value.name, value.dtype = f"present.{i}.{kind}", w.dtype
        value.shape = ir.Shape([B, kv, T, d])
    keys, values = (_repeat_kv(w, cache, h // kv) for cache in (present_k, present_v))
    window = c.sliding_window if i in c.sliding_window_layers and c.sliding_window else 0
    attn = _attention(g, q, keys, values, g.masks[window])
    merged = w.op("Transpose", [attn], perm=[0, 2, 1, 3])
    merged = w.op("Reshape", [merged, w.op("Concat", [w.u0(batch), w.u0(seq), w.ints(-1)], axis=0)])
    x = w.op("Add", [x, g.linear(merged, f"{p}.self_attn.o_proj.weight", h * d, c.hidden_size)])
    x = _mlp(g, p, x)
    w.graph.outputs.extend([present_k, present_v])
    return x


def _projections(g: _Layers, p: str, xn: ir.Value) -> dict[str, ir.Value]:
    """The flat q, k, v: one qkv projection sliced (Phi-3) or three (with biases: Qwen2)."""
    c, w, style = g.w.c, g.w, g.style
    h, kv, d = c.num_heads, c.kv_num_heads, c.head_size
    if style.fused_qkv:
        qkv = g.linear(xn, f"{p}.self_attn.qkv_proj.weight", c.hidden_size, (h + 2 * kv) * d)
        bounds = {"q": (0, h * d), "k": (h * d, (h + kv) * d), "v": ((h + kv) * d, _END)}
        return {
            n: w.op("Slice", [qkv, w.ints(a), w.ints(b), w.ints(-1), w.ints(1)])
            for n, (a, b) in bounds.items()
        }
    return {
        n: g.linear(xn, f"{p}.self_attn.{n}_proj.weight", c.hidden_size, heads * d, bias=style.qkv_bias)
        for n, heads in (("q", h), ("k", kv), ("v", kv))
    }


def _attention(g: _Layers, q: ir.Value, keys: ir.Value, values: ir.Value, window_mask: ir.Value) -> ir.Value:
    """Attention over the repeated keys/values, the mask sliced to the key length: eager
    (scale, soft-cap, additive mask, float32 softmax) or sdpa's decomposition."""
    w, style = g.w, g.style
    key_len = w.op("Unsqueeze", [w.size(keys, 2), w.ints(0)])
    mask = w.op("Slice", [window_mask, w.ints(0), key_len, w.ints(3), w.ints(1)])
    key_t = w.op("Transpose", [keys], perm=[0, 1, 3, 2])
    if g.eager:
        scores = w.op("Mul", [w.op("MatMul", [q, key_t]), w.scalar(g.scale)])
        cap = w.scalar(style.attn_softcap)
        scores = w.op("Mul", [w.op("Tanh", [w.op("Div", [scores, cap])]), cap])
        scores = w.op("Add", [scores, mask])
        if w.dtype == ir.DataType.FLOAT:
            probs = w.op("Cast", [w.op("Softmax", [scores], axis=-1)], to=ir.DataType.FLOAT)
        else:
            wide = w.op("Cast", [scores], to=ir.DataType.FLOAT)
            probs = w.op("Cast", [w.op("Softmax", [wide], axis=-1)], to=w.dtype)
    else:
        factor = w.scalar(float(np.sqrt(g.scale)))
        scores = w.op("MatMul", [w.op("Mul", [q, factor]), w.op("Mul", [key_t, factor])])
        bias = w.op(
            "Where", [mask, w.cst(np.array([0.0], w.np_dtype)), w.cst(np.array([-np.inf], w.np_dtype))]
        )
        probs = w.op("Softmax", [w.op("Add", [scores, bias])], axis=-1)
        probs = w.op("Where", [w.op("IsNaN", [probs]), w.cst(np.array([0.0], w.np_dtype)), probs])
    return w.op("MatMul", [probs, values])


def _mlp(g: _Layers, p: str, x: ir.Value) -> ir.Value:
    """Post-attention norm, the gated MLP (SiLU; gelu-tanh under eager attention; gate/up fused
    for Phi-3) and its residual."""
    c, w = g.w.c, g.w
    xn = _rms_norm(w, x, f"{p}.post_attention_layernorm.weight")
    width = c.intermediate_size
    if g.style.fused_qkv:
        both = g.linear(xn, f"{p}.mlp.gate_up_proj.weight", c.hidden_size, 2 * width)
        gate = w.op("Slice", [both, w.ints(0), w.ints(width), w.ints(-1), w.ints(1)])
        up = w.op("Slice", [both, w.ints(width), w.ints(_END), w.ints(-1), w.ints(1)])
    else:
        gate = g.linear(xn, f"{p}.mlp.gate_proj.weight", c.hidden_size, width)
        up = g.linear(xn, f"{p}.mlp.up_proj.weight", c.hidden_size, width)
    act = _gelu_tanh(w, gate) if g.eager else w.op("Mul", [gate, w.op("Sigmoid", [gate])])
    return w.op(
        "Add", [x, g.linear(w.op("Mul", [act, up]), f"{p}.mlp.down_proj.weight", width, c.hidden_size)]
    )


def _head(g: _Layers, x: ir.Value) -> ir.Model:
    """The final norm, lm_head and logit soft-cap: ``logits``, the first output; the model."""
    c, w = g.w.c, g.w
    x = _rms_norm(w, x, "model.norm.weight")
    logits = g.linear(x, "lm_head.weight", c.hidden_size, c.vocab_size)
    if g.style.final_softcap:
        cap = w.scalar(g.style.final_softcap)
        logits = w.op("Mul", [w.op("Tanh", [w.op("Div", [logits, cap])]), cap])
    logits.name, logits.dtype, logits.shape = "logits", w.dtype, ir.Shape([B, S, c.vocab_size])
    w.graph.outputs.insert(0, logits)
    return ir.Model(w.graph, ir_version=8, producer_name="pytorch", producer_version="2.13.0")


def _masks(w: _Script, embeds: ir.Value, mask_in: ir.Value, past_key: ir.Value) -> dict[int, ir.Value]:
    """transformers' sdpa_mask as TorchScript writes it, per window size (0: full)."""
    c = w.c
    zero, one = w.cst(np.array(0, np.int64)), w.cst(np.array(1, np.int64))
    past = w.size(past_key, 2)
    seq = w.size(embeds, 1)
    cache_position = w.op(
        "Range",
        [
            w.op("Cast", [past], to=ir.DataType.INT64),
            w.op("Cast", [w.op("Add", [past, seq])], to=ir.DataType.INT64),
            one,
        ],
    )
    kv_len = w.op("Add", [past, w.size(cache_position, 0)])
    batch = w.size(embeds, 0)

    def unsqueezed(value: ir.Value, *axes: int) -> ir.Value:
        for a in axes:
            value = w.op("Unsqueeze", [value, w.ints(a)])
        return value

    q_idx = unsqueezed(cache_position, 0, 1, 3)
    b_idx = unsqueezed(w.op("Range", [zero, w.op("Cast", [batch], to=ir.DataType.INT64), one]), 1, 2, 3)
    kv_idx = unsqueezed(w.op("Range", [zero, w.op("Cast", [kv_len], to=ir.DataType.INT64), one]), 0, 1, 2)
    as_bool = w.op("Cast", [mask_in], to=ir.DataType.BOOL)
    width = w.op("Gather", [w.op("Shape", [as_bool]), w.ints(1)], axis=0)
    index = w.op("Add", [kv_idx, w.op("Mul", [b_idx, width])])
    looked_up = w.op("Gather", [w.op("Flatten", [as_bool], axis=2), index], axis=0)
    padding = w.op(
        "Reshape",
        [w.op("Reshape", [looked_up, w.ints(-1)]), w.op("Concat", [w.op("Shape", [index])], axis=0)],
    )
    target = w.expand_target([w.u0(batch), w.ints(-1), w.u0(seq), w.u0(kv_len)])
    windows = {  # the masks some layer reads (TorchScript drops the others)
        c.sliding_window if i in c.sliding_window_layers and c.sliding_window else 0
        for i in range(c.num_layers)
    }
    masks = {}
    for window in sorted(windows):
        cond = w.op("ConstantOfShape", [w.cst(np.zeros(0, np.int64))], value=ir.tensor(np.array([True])))
        causal = w.op("LessOrEqual", [kv_idx, q_idx])
        cond = w.op("And", [cond, w.op("Cast", [causal], to=ir.DataType.BOOL)])
        if window:
            lower = w.op("Sub", [q_idx, w.cst(np.array(window, np.int64))])
            cond = w.op("And", [cond, w.op("Cast", [w.op("Greater", [kv_idx, lower])], to=ir.DataType.BOOL)])
        cond = w.op("And", [cond, w.op("Cast", [padding], to=ir.DataType.BOOL)])
        masks[window] = w.op("Expand", [cond, target])
    return masks


def _rotary(w: _Script, position_ids: ir.Value) -> tuple[ir.Value, ir.Value]:
    """cos/sin ``[batch, seq, head_size]`` as LlamaRotaryEmbedding computes them."""
    d = w.c.head_size
    inv_freq = (1.0 / (w.c.rope_theta ** (np.arange(0, d, 2) / d))).astype(np.float32)
    rows = w.expand_target([w.u0(w.size(position_ids, 0)), w.ints(-1), w.ints(1)])
    inv = w.op("Cast", [w.op("Expand", [w.cst(inv_freq[None, :, None]), rows])], to=ir.DataType.FLOAT)
    pos = w.op("Cast", [w.op("Unsqueeze", [position_ids, w.ints(1)])], to=ir.DataType.FLOAT)
    freqs = w.op("Transpose", [w.op("MatMul", [inv, pos])], perm=[0, 2, 1])
    emb = w.op("Concat", [freqs, freqs], axis=-1)
    one = w.cst(np.array(1.0, np.float32))
    return tuple(  # type: ignore[return-value]
        w.op("Cast", [w.op("Mul", [w.op(fn, [emb]), one])], to=w.dtype) for fn in ("Cos", "Sin")
    )


def _rotate(w: _Script, x: ir.Value, cos: ir.Value, sin: ir.Value) -> ir.Value:
    """``x * cos + rotate_half(x) * sin``, the half found as ``x.shape[-1] // 2``."""
    half = w.op("Div", [w.size(x, 3), w.cst(np.array(2, np.int64))])
    half = w.op(
        "Unsqueeze",
        [w.op("Cast", [w.op("Cast", [half], to=ir.DataType.INT64)], to=ir.DataType.INT64), w.ints(0)],
    )
    first = w.op("Slice", [x, w.ints(0), half, w.ints(3), w.ints(1)])
    second = w.op("Slice", [x, half, w.ints(_END), w.ints(3), w.ints(1)])
    rotated = w.op("Concat", [w.op("Neg", [second]), first], axis=-1)
    return w.op("Add", [w.op("Mul", [x, cos]), w.op("Mul", [rotated, sin])])


def _repeat_kv(w: _Script, cache: ir.Value, group: int) -> ir.Value:
    """transformers' repeat_kv: ``[b, kv, t, d] -> [b, kv * group, t, d]`` (none for group 1)."""
    if group == 1:
        return cache
    dims = [w.size(cache, k) for k in range(4)]
    grown = w.op("Unsqueeze", [cache, w.ints(2)])
    target = w.expand_target([w.u0(dims[0]), w.u0(dims[1]), w.ints(group), w.u0(dims[2]), w.u0(dims[3])])
    heads = w.op("Mul", [dims[1], w.cst(np.array(group, np.int64))])
    shape = w.op("Concat", [w.u0(dims[0]), w.u0(heads), w.u0(dims[2]), w.u0(dims[3])], axis=0)
    return w.op("Reshape", [w.op("Expand", [grown, target]), shape])


def _rms_norm(w: _Script, x: ir.Value, name: str) -> ir.Value:
    weight = w.weight(name, (w.c.hidden_size,), 0.1, 1.0)
    wide = w.op("Cast", [x], to=ir.DataType.FLOAT)
    mean = w.op("ReduceMean", [w.op("Pow", [wide, w.cst(np.array(2.0, np.float32))]), w.ints(-1)], keepdims=1)
    rms = w.op("Sqrt", [w.op("Add", [mean, w.cst(np.array(1e-6, np.float32))])])
    normed = w.op("Mul", [wide, w.op("Div", [w.cst(np.array(1.0, np.float32)), rms])])
    return w.op("Mul", [weight, w.op("Cast", [normed], to=w.dtype)])


def _gelu_tanh(w: _Script, x: ir.Value) -> ir.Value:
    """gelu_pytorch_tanh (Gemma-2's activation), written out."""
    cube = w.op("Mul", [w.scalar(0.044715), w.op("Pow", [x, w.scalar(3.0)])])
    inner = w.op("Mul", [w.scalar(float(np.sqrt(2.0 / np.pi))), w.op("Add", [x, cube])])
    return w.op("Mul", [w.op("Mul", [w.scalar(0.5), x]), w.op("Add", [w.scalar(1.0), w.op("Tanh", [inner])])])


def _linear(w: _Script, style: ExportStyle, x: ir.Value, name: str, fan_in: int, fan_out: int) -> ir.Value:
    """``x @ W`` as the file writes it: MatMul, MatMulNBits (q4) or MatMulInteger (int8)."""
    std = fan_in**-0.5
    if style.weights == "float":
        return w.op("MatMul", [x, w.weight(name, (fan_in, fan_out), std)])
    weight = (std * w.rng.standard_normal((fan_in, fan_out))).astype(np.float32)
    if style.weights == "q4":  # symmetric 4-bit blocks along K, zero point 8 (the default)
        if fan_in % _BLOCK:
            raise KvCacheError(f"q4 weights need in-features divisible by {_BLOCK}.")
        blocks = weight.T.reshape(fan_out, fan_in // _BLOCK, _BLOCK)
        scales = np.maximum(np.abs(blocks).max(axis=-1), 1e-8) / 7.0
        codes = (np.clip(np.round(blocks / scales[..., None]), -8, 7) + 8).astype(np.uint8)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
        inputs = [
            x,
            w.init(f"{name}_Q4", packed),
            w.init(f"{name}_scales", scales.reshape(-1).astype(w.np_dtype)),
        ]
        return w.op(
            "MatMulNBits", inputs, domain="com.microsoft", K=fan_in, N=fan_out, bits=4, block_size=_BLOCK
        )
    scale = np.float32(max(float(np.abs(weight).max()), 1e-8) / 127.0)  # int8: per-tensor symmetric
    codes = np.clip(np.round(weight / scale), -127, 127).astype(np.int8)
    x_q, x_scale, x_zero = w.op("DynamicQuantizeLinear", [x], outputs=3)
    acc = w.op(
        "MatMulInteger",
        [x_q, w.init(f"{name}_quantized", codes), x_zero, w.init(f"{name}_zero_point", np.array(0, np.int8))],
    )
    factor = w.op("Mul", [x_scale, w.init(f"{name}_scale", np.array(scale, np.float32))])
    return w.op("Mul", [w.op("Cast", [acc], to=ir.DataType.FLOAT), factor])
