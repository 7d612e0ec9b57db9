"""The bundled decoder's settings: :class:`DecoderConfig` and its exported-mode style.

A leaf module: the builders (:mod:`onnx_kvcache.models.decoder`, its exported and paged modes)
read these settings; nothing here builds a graph.
"""

from __future__ import annotations

__all__ = ["DecoderConfig", "ExportStyle", "GraphWriter", "WeightFactory", "refuse_unwritten"]

import dataclasses
from collections.abc import Callable
from typing import Literal

import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError, Param


@dataclasses.dataclass(frozen=True)
class ExportStyle:
    """How the exported decoder writes attention.

    Attributes:
        kv_repeat: ``expand``: transformers' repeat_kv (Unsqueeze/Expand/Reshape);
            ``grouped``: K/V go to Attention with their own head count; ``tile``: a
            Tile over the head axis (query head h reads KV head h % kv_heads, which is
            not GQA's grouping).
        mask: ``causal`` (sdpa_mask: causal AND padding [AND window]);
            ``bidirectional`` (padding only); ``top_left`` (no mask, ``is_causal=1``,
            whose diagonal ignores the cache).
        position_ids: ``position_ids`` is a graph input (else positions are the
            cache positions, computed in the graph).
        attn_softcap: Attention ``softcap`` (Gemma2: 50).
        final_softcap: Soft-capping of the logits (Gemma2: 30).
        query_scale: Attention ``scale`` (Gemma2: ``query_pre_attn_scalar ** -0.5``);
            None writes ``1/sqrt(head_size)``.
        qk_matmul_output: Give Attention its 4th output in this mode, as graph
            outputs ``attn_weights.{i}``.
        embed_scale: Multiply embeddings by ``sqrt(hidden_size)`` (Gemma).
        opset: 23 writes the ONNX Attention, RotaryEmbedding and RMSNormalization
            operators; 20 writes them decomposed, as the exporter's op library does
            below opset 23 (scaled dot-product attention as MatMul/Softmax/MatMul
            with a Where(mask, 0, -inf) bias, transformers' rotate_half, RMS norm as
            Pow/ReduceMean/Sqrt/Reciprocal); 18 with ``exporter="torchscript"``.
        exporter: ``dynamo`` (``torch.onnx.export(..., dynamo=True)``, transformers 5.x)
            or ``torchscript`` (optimum / onnx-community exports: opset 18, no value_info;
            :mod:`onnx_kvcache.models._torchscript`).
        qkv_bias: Biases on the q/k/v projections (Qwen2). TorchScript form only.
        fused_qkv: One qkv projection split by Slice and a fused gate/up MLP (Phi-3).
            TorchScript form only.
        weights: ``float``; ``q4`` (``model_q4.onnx``: com.microsoft MatMulNBits) or
            ``int8`` (``model_quantized.onnx``: DynamicQuantizeLinear + MatMulInteger),
            onnx-community's weight-quantized files. TorchScript form only.
        window_cache: ``full``: every cache holds the whole sequence (a ``DynamicCache()``
            export); ``cropped``: a sliding-window layer's present is its last
            ``sliding_window - 1`` tokens, as transformers 5.x's ``DynamicSlidingWindowLayer``
            keeps them (``DynamicCache(config=...)``): the past is cropped the same way before
            ``Concat``, attention reads the concatenation, the present is a ``Slice`` of it,
            and the layer's mask counts key positions from ``max(0, past - (W - 1))``.
        attention: ``sdpa``: the ONNX ``Attention`` (opset 23) or scaled dot-product
            attention decomposed (opset 20); ``eager``: transformers'
            ``eager_attention_forward`` at any opset (Gemma2's default): ``MatMul(Q, K^T)``
            times the scale, the soft-cap as ``Tanh(x / cap) * cap``, an additive
            ``Where(mask, 0, min)`` mask, ``Softmax`` in float32, ``MatMul`` with V.
        attention_sinks: With ``attention="eager"``, gpt-oss's sinks: one logit per head
            concatenated beside the scores, the row's maximum subtracted, the softmax's last
            column dropped before the MatMul with V (fused into GQA's ``head_sink``).
        static_shapes: ``(batch, seq, past)`` fixed (``past`` None: left dynamic), as an
            export without dynamic shapes writes them (opset 20 only): those dimensions are numbers, shape
            vectors are constants, and the repeat_kv Reshape is folded into the key
            transpose's first Reshape (one Reshape of the 5-D expanded cache).
    """

    kv_repeat: Literal["expand", "grouped", "tile"] = "expand"
    mask: Literal["causal", "bidirectional", "top_left"] = "causal"
    position_ids: bool = True
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    query_scale: float | None = None
    qk_matmul_output: int | None = None
    embed_scale: bool = False
    opset: Literal[18, 20, 23] = 23
    exporter: Literal["dynamo", "torchscript"] = "dynamo"
    qkv_bias: bool = False
    fused_qkv: bool = False
    weights: Literal["float", "q4", "int8"] = "float"
    window_cache: Literal["full", "cropped"] = "full"
    attention: Literal["sdpa", "eager"] = "sdpa"
    attention_sinks: bool = False
    static_shapes: tuple[int, int, int | None] | None = None


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shape and options of the demo decoder.

    Attributes:
        sliding_window: Layers listed in ``sliding_window_layers`` attend to this many
            positions (``local_window_size``); with ``sliding_window_cache`` their cache
            is window-sized.
        no_cache_layers: Layers whose attention has no past/present cache.
        qk_norm: Per-head RMS norm of q and k before RoPE (Qwen3, Gemma3), fused into GQA
            as inputs 14/15 (a 16-input node, as builds for CUDA/WebGPU have it), or with
            ``qk_norm_fused=False`` as ops before the node (what the CPU kernel can run).
        dtype: ``float32``, ``float16`` or ``bfloat16`` weights and activations.
        symbolic_cache_dim: Declare the caches' head dimension as ``kv_cache_dim``, as
            onnxruntime-genai's builder does, instead of the static head size.
        exported: Write the graph as torch.onnx.export does (ONNX Attention, no GQA;
            see :mod:`onnx_kvcache.models.exported`), in this style.
        paged: Build the decoder with PagedAttention and continuous-batching I/O, as
            onnxruntime-genai's ``use_paged_attention`` builds are laid out (see
            :mod:`onnx_kvcache.models._paged`); ``paged_block_size`` goes to its genai config.
        latent: With ``paged``, absorbed-MLA layers (``kv_cache_layout="LATENT"``, one cache,
            ``latent_rope_dim`` rotary channels at its end).
    """

    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    kv_num_heads: int = 2
    head_size: int = 32
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position: int = 4096
    dtype: str = "float32"
    rotary_interleaved: bool = False
    rope_theta: float = 10000.0
    outlier_channels: int = 4
    outlier_scale: float = 12.0
    sliding_window_layers: tuple[int, ...] = ()
    sliding_window: int = 0
    sliding_window_cache: bool = False
    no_cache_layers: tuple[int, ...] = ()
    qk_norm: bool = False
    qk_norm_fused: bool = True
    symbolic_cache_dim: bool = False
    paged: bool = False
    paged_block_size: int = 16
    latent: bool = False
    latent_rope_dim: int = 16
    seed: int = 0
    exported: ExportStyle | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise KvCacheError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}.")
        if self.latent and not (
            self.paged
            and 0 < self.latent_rope_dim < self.head_size
            and (self.head_size - self.latent_rope_dim) % 8 == 0
        ):
            raise KvCacheError(
                Param("latent"),
                " needs ",
                Param("paged", True),
                " and an even latent_rope_dim below head_size that leaves a "
                "multiple of 8 channels before it (PagedAttention's rotary_offset).",
            )

    @property
    def ir_dtype(self) -> ir.DataType:
        return _DTYPES[self.dtype]

    @property
    def np_dtype(self) -> np.dtype:
        return self.ir_dtype.numpy()


_DTYPES = {"float32": ir.DataType.FLOAT, "float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}


WeightFactory = Callable[[str, tuple[int, ...], ir.DataType], ir.TensorProtocol]
"""Makes a weight tensor from (name, shape, dtype) instead of seeded random values."""


class GraphWriter:
    """What every bundled exporter's graph starts from: the config, its dtypes, the weights'
    source (``weight_factory``, else seeded random) and an empty ``main_graph``."""

    def __init__(
        self, config: DecoderConfig, weight_factory: WeightFactory | None, opset_imports: dict[str, int]
    ) -> None:
        self.c = config
        self.dtype, self.np_dtype = config.ir_dtype, config.np_dtype
        self.weight_factory = weight_factory
        self.rng = np.random.default_rng(config.seed)
        self.graph = ir.Graph([], [], nodes=[], opset_imports=opset_imports, name="main_graph")


def refuse_unwritten(config: DecoderConfig, form: str, **more: bool) -> None:
    """Refuse the settings an exporter's form does not write: the genai-only ones (layers
    without a cache, sliding-window caches, interleaved rotary) and ``more`` (name: set)."""
    settings = {
        "no_cache_layers": bool(config.no_cache_layers),
        "sliding_window_cache": bool(config.sliding_window_cache),
        "rotary_interleaved": bool(config.rotary_interleaved),
        **more,
    }
    unwritten = [name for name, value in settings.items() if value]
    if unwritten:
        raise KvCacheError(f"The {form} does not write {', '.join(unwritten)}; unset it.")
