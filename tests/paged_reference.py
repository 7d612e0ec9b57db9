"""Numpy reference of com.microsoft::PagedAttention, written from its documented semantics.

Sources: onnxruntime's operator schema (input and attribute descriptions, read from the
installed wheel) and its CUDA design notes (docs/contrib_ops/cuda/paged_attention.md: slot
derivation, bottom-right causal mask, window including the current token, head sink as an
extra softmax logit, LATENT V aliasing the key cache row). Loops over sequences and tokens
on purpose: nothing here shares code or structure with the ONNX rewrite it checks, and the
cache codec is the tests' own (``tests/codec.py``), not the library's.
"""

from __future__ import annotations

import numpy as np

import codec


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, offset: int, interleaved: bool) -> np.ndarray:
    """Rotate one token's heads ``x [N, D]`` with its ``cos``/``sin`` rows ``[R/2]``."""
    half = cos.shape[-1]
    out = x.copy()
    rot = x[:, offset : offset + 2 * half]
    if interleaved:
        a, b = rot[:, 0::2], rot[:, 1::2]
        out[:, offset : offset + 2 * half : 2] = a * cos - b * sin
        out[:, offset + 1 : offset + 2 * half : 2] = b * cos + a * sin
    else:
        a, b = rot[:, :half], rot[:, half:]
        out[:, offset : offset + half] = a * cos - b * sin
        out[:, offset + half : offset + 2 * half] = b * cos + a * sin
    return out


def _scale(scale: np.ndarray | None, kv: int, head: int) -> np.ndarray | None:
    if scale is None:
        return None
    scale = np.asarray(scale, np.float32).reshape(-1)
    return scale.reshape(1, 1) if scale.size == 1 else scale.reshape(kv, head)


def paged_attention(
    query: np.ndarray,
    key: np.ndarray | None,
    value: np.ndarray | None,
    key_cache: np.ndarray,
    value_cache: np.ndarray | None,
    cumulative: np.ndarray,
    past: np.ndarray,
    block_table: np.ndarray,
    *,
    num_heads: int,
    kv_heads: int,
    fmt: str | None = None,
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
    cos: np.ndarray | None = None,
    sin: np.ndarray | None = None,
    interleaved: bool = False,
    rotary_offset: int = 0,
    slot_mapping: np.ndarray | None = None,
    head_sink: np.ndarray | None = None,
    qk_norm: tuple[np.ndarray, np.ndarray] | None = None,
    eps: float = 1e-6,
    scale: float | None = None,
    softcap: float = 0.0,
    window: int = -1,
    causal: bool = True,
    latent: bool = False,
    v_head_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One PagedAttention call; returns (output ``[T, H * Dv]`` float32, key_cache, value_cache).

    ``fmt`` names the quantized cache format (``fp8``, ``int8``, ``int4``), None for a float
    cache. Caches are the stored arrays as onnxruntime feeds them (fp8 as uint8 bits, packed int4);
    new ones are returned, the inputs are not changed.
    """
    tokens = query.shape[0]
    kv, heads = kv_heads, num_heads
    if key is None and not latent:  # packed QKV
        head = query.shape[1] // (heads + 2 * kv)
        q, key, value = np.split(query, [heads * head, (heads + kv) * head], axis=1)
    else:
        q = query
        head = q.shape[1] // heads
    dv = v_head_size or head
    q = q.astype(np.float32).reshape(tokens, heads, head)
    k = np.asarray(key, np.float32).reshape(tokens, kv, head)
    v = None if latent else np.asarray(value, np.float32).reshape(tokens, kv, head)
    caches = {"key": key_cache.copy(), "value": None if latent else np.asarray(value_cache).copy()}
    scales = {"key": _scale(k_scale, kv, head), "value": _scale(v_scale, kv, head)}
    blocks, block_size = key_cache.shape[:2]

    seq_of, pos_of = [], []
    for b in range(len(past)):
        for i in range(int(cumulative[b + 1] - cumulative[b])):
            seq_of.append(b)
            pos_of.append(int(past[b]) + i)
    for t in range(tokens):
        if qk_norm is not None:
            q[t] = q[t] / np.sqrt((q[t] * q[t]).mean(-1, keepdims=True) + eps) * qk_norm[0].astype(np.float32)
            k[t] = k[t] / np.sqrt((k[t] * k[t]).mean(-1, keepdims=True) + eps) * qk_norm[1].astype(np.float32)
        if cos is not None and sin is not None:
            c = cos[pos_of[t]].astype(np.float32)
            s = sin[pos_of[t]].astype(np.float32)
            q[t] = _rope(q[t], c, s, rotary_offset, interleaved)
            k[t] = _rope(k[t], c, s, rotary_offset, interleaved)

    def slot(t: int) -> int | None:
        if slot_mapping is not None:
            return int(slot_mapping[t]) if 0 <= slot_mapping[t] < blocks * block_size else None
        b, p = seq_of[t], pos_of[t]
        if p // block_size >= block_table.shape[1]:
            return None
        block = int(block_table[b, p // block_size])
        return block * block_size + p % block_size if 0 <= block < blocks else None

    news = {"key": k, "value": v}
    for kind, cache in caches.items():
        if cache is None:
            continue
        flat = cache.reshape(blocks * block_size, *cache.shape[2:])
        for t in range(tokens):
            row = slot(t)
            if row is None:
                continue
            x = news[kind][t]
            flat[row] = x.astype(cache.dtype) if fmt is None else codec.quantize(fmt, x, scales[kind])

    def read(kind: str, row: int) -> np.ndarray:
        cache = caches[kind]
        stored = cache.reshape(blocks * block_size, *cache.shape[2:])[row]
        if fmt is None:
            return stored.astype(np.float32)
        return codec.dequantize(fmt, stored, scales[kind], head)

    group = heads // kv
    softmax_scale = scale or 1.0 / np.sqrt(head)
    out = np.zeros((tokens, heads, dv), np.float32)
    for t in range(tokens):
        b, p = seq_of[t], pos_of[t]
        total = int(past[b] + cumulative[b + 1] - cumulative[b])
        keys, values = [], []
        for j in range(total):
            if (causal and j > p) or (window > 0 and j <= p - window):
                continue
            block = int(block_table[b, j // block_size])
            if not 0 <= block < blocks:
                continue
            row = block * block_size + j % block_size
            keys.append(read("key", row))
            values.append(read("key", row)[:, :dv] if latent else read("value", row))
        keys_, values_ = np.stack(keys), np.stack(values)  # [L, kv, D]
        for h in range(heads):
            scores = keys_[:, h // group] @ q[t, h] * softmax_scale
            if softcap > 0:
                scores = softcap * np.tanh(scores / softcap)
            logits = scores if head_sink is None else np.append(scores, np.float32(head_sink[h]))
            weights = np.exp(logits - logits.max())
            weights /= weights.sum()
            out[t, h] = weights[: len(scores)] @ values_[:, h // group]
    return out.reshape(tokens, heads * dv), caches["key"], caches["value"]
