"""The demo decoder with PagedAttention: continuous-batching I/O as onnxruntime-genai lays it out.

onnxruntime-genai builds paged decoders with ``--extra_options use_paged_attention=true``
(CUDA fp16/bf16). Their I/O, which this builder reproduces:

- ``input_ids [num_tokens]``: the new tokens of every sequence, packed;
- ``past_key_values.{i}.key/value [num_blocks, block_size, kv_num_heads, head_size]``: the
  block pool, updated in place (``present.{i}.key/value`` alias it);
- ``block_table [batch_size, max_num_blocks]``, ``cumulative_sequence_lengths
  [batch_size + 1]``, ``past_sequence_lengths [batch_size]`` (int32) and
  ``attention_metadata [3]`` (int32, host-side bounds);
- ``logits [num_tokens, vocab_size]``; no attention mask.

Q, K and V come from one packed MatMul (q/k norm builds keep them separate and fuse the norm
into the node's inputs 12/13, as the builder does); RoPE runs inside the node. With the same
:class:`~onnx_kvcache.models.decoder.DecoderConfig` and seed, the weights equal those of the GQA
decoder, so the two decoders compute the same function. ``latent=True`` builds absorbed-MLA
layers instead (``kv_cache_layout="LATENT"``: one cache of ``head_size`` channels per token,
V its leading ``head_size - latent_rope_dim`` channels, RoPE on the rest), a shape the
onnxruntime schema defines and genai does not build. float32 paged models are for CPU
evaluation only: onnxruntime's schema types PagedAttention's T as float16/bfloat16.
"""

from __future__ import annotations

__all__ = ["build_paged_decoder", "paged_genai_config"]

import dataclasses
import functools
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.operators import PAGED, PagedInput
from onnx_kvcache.errors import KvCacheError

_INT32 = ir.DataType.INT32


def _paged_io(b: Any) -> dict[str, ir.Value]:
    io = {
        "input_ids": ir.val("input_ids", ir.DataType.INT64, ["num_tokens"]),
        "block_table": ir.val("block_table", _INT32, ["batch_size", "max_num_blocks"]),
        "cumulative_sequence_lengths": ir.val("cumulative_sequence_lengths", _INT32, ["batch_size + 1"]),
        "past_sequence_lengths": ir.val("past_sequence_lengths", _INT32, ["batch_size"]),
        "attention_metadata": ir.val("attention_metadata", _INT32, [3]),
    }
    b.graph.inputs.extend(io.values())
    return io


def _head_rms_norm(b: Any, x: ir.Value, weight: ir.Value, heads: int, name: str) -> ir.Value:
    """RMS norm of each head of ``x`` ``[T, heads * D]`` (epsilon 1e-6, as the op's default)."""
    c = b.config
    split = b.const(f"{name}.split_shape", np.array([0, heads, c.head_size], np.int64))
    merge = b.const(f"{name}.merge_shape", np.array([0, heads * c.head_size], np.int64))
    axes = b.const(f"{name}.axes", np.array([-1], np.int64))
    eps = b.const(f"{name}.eps", np.array(1e-6, c.np_dtype))
    heads_x = b.op("Reshape", [x, split], f"{name}/Reshape")
    mean = b.op("ReduceMean", [b.op("Mul", [heads_x, heads_x], f"{name}/Square"), axes], f"{name}/Mean")
    rms = b.op("Sqrt", [b.op("Add", [mean, eps], f"{name}/Add")], f"{name}/Sqrt")
    normed = b.op("Mul", [b.op("Div", [heads_x, rms], f"{name}/Div"), weight], f"{name}/Scale")
    out = b.op("Reshape", [normed, merge], f"{name}/Merge")
    out.type, out.shape = x.type, x.shape
    return out


def build_paged_decoder(b: Any) -> ir.Model:
    """Build the paged decoder into ``b`` (a :mod:`~onnx_kvcache.models.decoder` builder)."""
    c = b.config
    _refuse_unbuilt(c)
    io = _paged_io(b)
    axes_last = b.const("const_axes_last", np.array([-1], np.int64))
    eps = b.const("const_eps", np.array(1e-5, c.np_dtype))
    rope = b.rope_tables(c.latent_rope_dim if c.latent else c.head_size)
    x = b.embed(io["input_ids"])
    for i in range(c.num_layers):
        x = _paged_layer(b, i, x, io, rope, (axes_last, eps))
    b.logits(x, (axes_last, eps), ["num_tokens"])
    b.graph.name = "onnx_kvcache_demo_paged_decoder"
    return ir.Model(b.graph, ir_version=10, producer_name="onnx-kvcache")


def _refuse_unbuilt(c: Any) -> None:
    """Refuse the settings a paged decoder is not built with (layers without a cache,
    window-sized caches)."""
    if c.no_cache_layers:
        raise KvCacheError("A paged decoder has a cache in every layer (PagedAttention requires key_cache).")
    if c.sliding_window_cache:
        raise KvCacheError(
            "Window-sized paged caches (genai's block_table_windowed) are not built; drop "
            "sliding_window_cache (sliding-window layers then keep full-size caches)."
        )


@dataclasses.dataclass(frozen=True)
class _Widths:
    """A layer's sizes: KV heads (one latent cache under ``latent``), the K/V and Q widths,
    and V's head size (the latent's leading channels)."""

    kv: int
    kv_dim: int
    q_dim: int
    v_head: int

    @classmethod
    def of(cls, c: Any) -> _Widths:
        kv = 1 if c.latent else c.kv_num_heads
        v_head = c.head_size - c.latent_rope_dim if c.latent else c.head_size
        return cls(kv, kv * c.head_size, c.num_heads * c.head_size, v_head)


def _paged_layer(
    b: Any,
    i: int,
    x: ir.Value,
    io: dict[str, ir.Value],
    rope: tuple[ir.Value, ir.Value],
    norm: tuple[ir.Value, ir.Value],
) -> ir.Value:
    """Layer ``i``: input norm, the projections, its cache pool, the optional q/k norm, the
    PagedAttention node, then o_proj, MLP and residuals."""
    c, p, n = b.config, f"/model/layers.{i}", _Widths.of(b.config)
    xn = b.rms_norm(x, f"model.layers.{i}.input_layernorm", *norm)
    inputs = _paged_projections(b, i, xn, n)
    past_k, past_v, presents = _paged_cache_io(b, i, n)
    slots: dict[int, ir.Value | None] = dict(zip(PagedInput, inputs))
    slots |= {
        PagedInput.KEY_CACHE: past_k,
        PagedInput.VALUE_CACHE: past_v,
        PagedInput.CUMULATIVE_SEQUENCE_LENGTH: io["cumulative_sequence_lengths"],
        PagedInput.PAST_SEQLENS: io["past_sequence_lengths"],
        PagedInput.BLOCK_TABLE: io["block_table"],
        PagedInput.COS_CACHE: rope[0],
        PagedInput.SIN_CACHE: rope[1],
        PagedInput.ATTENTION_METADATA: io["attention_metadata"],
    }
    if c.qk_norm and not c.latent:
        b.qk_norm(slots, PAGED, i, n.kv, functools.partial(_head_rms_norm, b))
    attn_out = ir.val(f"{p}/attn/PagedAttention/output_0", c.ir_dtype, ["num_tokens", c.num_heads * n.v_head])
    attn = b.attention(PAGED, slots, _paged_attributes(c, i, n), [attn_out, *presents], p)
    return b.residual_mlp(x, attn, i, c.num_heads * n.v_head, norm)


def _dense(b: Any, fan_in: int, fan_out: int, gain: float = 1.0) -> np.ndarray:
    return b.rng.standard_normal((fan_in, fan_out)) * gain / np.sqrt(fan_in)


def _k_weight(b: Any, n: _Widths) -> np.ndarray:
    """K's projection weight, with the config's outlier channels."""
    c = b.config
    wk = b.rng.standard_normal((c.hidden_size, n.kv_dim)) / np.sqrt(c.hidden_size)
    outliers = b.rng.choice(n.kv_dim, size=min(c.outlier_channels, n.kv_dim), replace=False)
    wk[:, outliers] *= c.outlier_scale
    return wk


def _paged_projections(b: Any, i: int, xn: ir.Value, n: _Widths) -> list[ir.Value]:
    """Layer ``i``'s query/key/value inputs ``[num_tokens, width]``: one packed qkv MatMul, as the
    builder writes paged models, or separate ones under q/k norm (K: the latent's kv_a_proj)."""
    c, p = b.config, f"/model/layers.{i}"
    inputs: list[ir.Value]
    if c.latent or c.qk_norm:  # separate projections: K is the latent's kv_a_proj
        wq = b.weight(
            f"model.layers.{i}.attn.q_proj.weight",
            (c.hidden_size, n.q_dim),
            lambda: _dense(b, c.hidden_size, n.q_dim),
        )
        k_proj = "kv_a_proj" if c.latent else "k_proj"
        wk = b.weight(
            f"model.layers.{i}.attn.{k_proj}.weight", (c.hidden_size, n.kv_dim), lambda: _k_weight(b, n)
        )
        weights = [(wq, "q_proj"), (wk, k_proj)]
        if not c.latent:
            make_wv = functools.partial(_dense, b, c.hidden_size, n.kv_dim)
            wv = b.weight(f"model.layers.{i}.attn.v_proj.weight", (c.hidden_size, n.kv_dim), make_wv)
            weights.append((wv, "v_proj"))
        inputs = [b.op("MatMul", [xn, w], f"{p}/attn/{name}/MatMul") for w, name in weights]
    else:  # one packed MatMul, as the builder writes paged models without q/k norm

        def make_qkv() -> np.ndarray:
            return np.concatenate(
                [_dense(b, c.hidden_size, n.q_dim), _k_weight(b, n), _dense(b, c.hidden_size, n.kv_dim)],
                axis=1,
            )

        wqkv = b.weight(
            f"model.layers.{i}.attn.qkv_proj.weight", (c.hidden_size, n.q_dim + 2 * n.kv_dim), make_qkv
        )
        inputs = [b.op("MatMul", [xn, wqkv], f"{p}/attn/qkv_proj/MatMul")]
    widths = (n.q_dim, n.kv_dim, n.kv_dim) if len(inputs) > 1 else (n.q_dim + 2 * n.kv_dim,)
    for value, width in zip(inputs, widths):
        value.dtype, value.shape = c.ir_dtype, ir.Shape(["num_tokens", width])
    return inputs


def _paged_cache_io(b: Any, i: int, n: _Widths) -> tuple[ir.Value, ir.Value | None, list[ir.Value]]:
    """Layer ``i``'s block pools, added to the graph inputs (no value cache under ``latent``),
    and the presents that alias them."""
    c, dtype = b.config, b.config.ir_dtype
    cache_shape: list[int | str | None] = ["num_blocks", "block_size", n.kv, c.head_size]
    past_k = ir.val(f"past_key_values.{i}.key", dtype, cache_shape)
    b.graph.inputs.append(past_k)
    past_v = None
    if not c.latent:
        past_v = ir.val(f"past_key_values.{i}.value", dtype, cache_shape)
        b.graph.inputs.append(past_v)
    presents = [ir.val(f"present.{i}.key", dtype, cache_shape)]
    if not c.latent:
        presents.append(ir.val(f"present.{i}.value", dtype, cache_shape))
    return past_k, past_v, presents


def _paged_attributes(c: Any, i: int, n: _Widths) -> dict:
    """The PagedAttention node's attributes (RoPE inside; the LATENT layout; a local window)."""
    attributes: dict = {
        "num_heads": c.num_heads,
        "kv_num_heads": n.kv,
        "do_rotary": 1,
        "rotary_interleaved": int(c.rotary_interleaved),
    }
    if c.latent:
        attributes |= {
            "kv_cache_layout": "LATENT",
            "v_head_size": n.v_head,
            "rotary_offset": n.v_head,
            "scale": float(1 / np.sqrt(c.head_size)),
        }
    if i in c.sliding_window_layers and c.sliding_window:
        attributes["local_window_size"] = c.sliding_window
    return attributes


def paged_genai_config(genai: dict[str, Any], block_size: int) -> dict[str, Any]:
    """Turn the demo's genai_config into a paged build's (as ``use_paged_attention`` writes it)."""
    decoder = genai["model"]["decoder"]
    inputs = decoder["inputs"]
    inputs.pop("attention_mask", None)
    inputs |= {
        "block_table": "block_table",
        "cumulative_sequence_lengths": "cumulative_sequence_lengths",
        "past_sequence_lengths": "past_sequence_lengths",
        "attention_metadata": "attention_metadata",
    }
    decoder["session_options"]["provider_options"] = [{"cuda": {}}]
    genai["search"]["past_present_share_buffer"] = True
    genai["engine"] = {"dynamic_batching": {"block_size": block_size, "max_batch_size": 100}}
    return genai
