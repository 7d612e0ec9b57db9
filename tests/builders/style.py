"""The settings of the exporter imitations: :class:`ExportStyle`, how an exporter writes
attention, and :class:`ExportedConfig`, the bundled decoder's settings with a style.

Test scaffolding, not the library's: the library reads what real exporters write
(tests/data/producers holds their files, the oracle); these builders write the same forms at
any size and with every variation, without torch.
"""

from __future__ import annotations

__all__ = ["ExportStyle", "ExportedConfig", "GraphWriter", "refuse_unwritten"]

import dataclasses
from typing import Literal

import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.models.config import DecoderConfig, WeightFactory


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
            :mod:`builders.torchscript`).
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
class ExportedConfig(DecoderConfig):
    """:class:`DecoderConfig` written as an exporter does (ONNX Attention, no GQA; see
    :mod:`builders.exported`), in the style ``exported`` (None: onnxruntime-genai's form)."""

    exported: ExportStyle | None = ExportStyle()


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
