"""Numpy reference of GroupQueryAttention with a quantized cache (the kernels' rules).

New K (after q/k norm and RoPE) and V are quantized on write. The ``cpu`` rule (and CUDA
after the first prompt) attends over every position dequantized, the current tokens
included; CUDA's first prompt (``sequence_length == total_sequence_length``) attends over
the new tokens in full precision and stores them quantized. The cache codec is the tests'
own (``tests/codec.py``), not the library's.
"""

from __future__ import annotations

import numpy as np

import codec


def rope(
    x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool
) -> np.ndarray:
    """Rotate ``x`` [B, S, H, D] at ``positions`` [B, S]."""
    c = cos[positions][:, :, None, :]  # [B, S, 1, D/2]
    s = sin[positions][:, :, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = b * c + a * s
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def channel_scale(scale: np.ndarray, kv_heads: int, head: int) -> np.ndarray:
    scale = np.asarray(scale, np.float32).reshape(-1)
    return scale.reshape(1, 1, 1, 1) if scale.size == 1 else scale.reshape(1, kv_heads, 1, head)


def quantized_gqa_step(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    past_k: np.ndarray,
    past_v: np.ndarray,
    fmt,
    k_scale: np.ndarray,
    v_scale: np.ndarray,
    *,
    num_heads: int,
    kv_heads: int,
    cos: np.ndarray | None,
    sin: np.ndarray | None,
    interleaved: bool = False,
    stored: tuple[np.ndarray, np.ndarray] | None = None,
    qk_norm: tuple[np.ndarray, np.ndarray] | None = None,
    eps: float = 1e-6,
    semantics: str = "cpu",
    sink: np.ndarray | None = None,
):
    """One GQA call. q/k/v are [B, S, H*D] float; past_* are stored caches (BNSH).

    ``fmt`` is the cache format (its name, or a row whose ``name`` is read), None for a
    float cache. Returns (output [B, S, N*D], present_k, present_v) with present_* stored as the
    format stores them (float caches when ``fmt`` is None). With ``stored``, attention
    reads those present caches instead of the ones computed here. ``sink``: one logit per
    query head in the softmax's denominator (``head_sink``).
    """
    if semantics not in ("cpu", "cuda"):
        raise ValueError(semantics)
    batch, seq, _ = q.shape
    head = k.shape[-1] // kv_heads
    past_len = past_k.shape[2]
    q4 = q.astype(np.float32).reshape(batch, seq, num_heads, head)
    k4 = k.astype(np.float32).reshape(batch, seq, kv_heads, head)
    v4 = v.astype(np.float32).reshape(batch, seq, kv_heads, head)
    if qk_norm is not None:
        q4 = q4 / np.sqrt((q4 * q4).mean(-1, keepdims=True) + eps) * qk_norm[0].astype(np.float32)
        k4 = k4 / np.sqrt((k4 * k4).mean(-1, keepdims=True) + eps) * qk_norm[1].astype(np.float32)
    if cos is not None:
        positions = np.tile(np.arange(past_len, past_len + seq), (batch, 1))
        q4 = rope(q4, positions, cos.astype(np.float32), sin.astype(np.float32), interleaved)
        k4 = rope(k4, positions, cos.astype(np.float32), sin.astype(np.float32), interleaved)
    k_new, v_new = k4.transpose(0, 2, 1, 3), v4.transpose(0, 2, 1, 3)
    if fmt is None:
        present_k = np.concatenate([past_k, k_new.astype(past_k.dtype)], axis=2)
        present_v = np.concatenate([past_v, v_new.astype(past_v.dtype)], axis=2)
        keys, values = present_k.astype(np.float32), present_v.astype(np.float32)
    else:
        ks, vs = channel_scale(k_scale, kv_heads, head), channel_scale(v_scale, kv_heads, head)
        present_k = np.concatenate([past_k, codec.quantize(fmt, k_new, ks)], axis=2)
        present_v = np.concatenate([past_v, codec.quantize(fmt, v_new, vs)], axis=2)
        read_k, read_v = stored if stored is not None else (present_k, present_v)
        keys = codec.dequantize(fmt, read_k, ks, head)
        values = codec.dequantize(fmt, read_v, vs, head)
        if semantics == "cuda" and past_len == 0:  # CUDA's first prompt reads K/V unquantized
            keys, values = k_new, v_new
    group = num_heads // kv_heads
    keys = np.repeat(keys, group, axis=1)  # [B, N, T, D]
    values = np.repeat(values, group, axis=1)
    qh = q4.transpose(0, 2, 1, 3)  # [B, N, S, D]
    scores = qh @ keys.transpose(0, 1, 3, 2) / np.sqrt(head)
    total = past_len + seq
    allowed = np.arange(total)[None, :] <= (past_len + np.arange(seq))[:, None]
    scores = np.where(allowed, scores, -np.inf)
    column = None if sink is None else np.asarray(sink, np.float32).reshape(1, -1, 1, 1)
    peak = (
        scores.max(-1, keepdims=True) if column is None else np.maximum(scores.max(-1, keepdims=True), column)
    )
    probs = np.exp(scores - peak)
    denominator = probs.sum(-1, keepdims=True) + (0.0 if column is None else np.exp(column - peak))
    probs /= denominator
    out = (probs @ values).transpose(0, 2, 1, 3).reshape(batch, seq, num_heads * head)
    return out, present_k, present_v
