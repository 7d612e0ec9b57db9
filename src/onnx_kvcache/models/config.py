"""The bundled decoder's settings: :class:`DecoderConfig`.

A leaf module: the builders (:mod:`onnx_kvcache.models.decoder`, its paged mode) read these
settings; nothing here builds a graph. (The exporters' forms the tests imitate are
tests/builders/'s.)
"""

from __future__ import annotations

__all__ = ["DecoderConfig", "WeightFactory"]

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError, Param


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
