"""A layer's true attention-output error under quantized K/V caches (numpy, the CPU kernel's rule).

Rules:

* The attention is the node's own: causal, its ``scale``, softcap, local window and sinks
  (``head_sink``: a logit per query head in the softmax's denominator), query heads grouped
  over KV heads; queries are given already rotated (as the node rotates them)
  and K as the present cache holds it (after RoPE).
* Every cached row is stored and read back with the format's round trip
  (:meth:`~onnx_kvcache.cache.formats.CacheFormat.round_trip`: float32 reciprocal, round half to
  even, clamp to the stored levels), the rows of the current chunk included: onnxruntime's
  CPU kernel attends over the dequantized cache it has just written.
* The error reported is ``|| softmax(q K^T s) V - softmax(q Khat^T s) Vhat ||^2`` summed over
  the picked queries, heads and channels, with K alone, V alone and both quantized, beside
  ``|| softmax(q K^T s) V ||^2`` and the share of attention the first row (the attention sink)
  receives. ``exact_rows`` keeps some rows unquantized: what those rows' errors cost.

Used to diagnose what a calibration loses, layer by layer (``benchmarks/attention_error.py``).
"""

from __future__ import annotations

__all__ = [
    "AttentionError",
    "attention_error",
    "attention_output",
    "head_sink",
    "rope",
    "scale_grid",
    "softmax_with_sink",
]

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from onnx_kvcache.cache.formats import CacheFormat
from onnx_kvcache.cache.sites import CacheSite, constant_values


def head_sink(site: CacheSite) -> np.ndarray | None:
    """The node's ``head_sink`` (a constant logit per query head), or None without one."""
    values = constant_values(site.input("head_sink"))
    return None if values is None else np.asarray(values, np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """``x`` ``[S, H, D]`` rotated as GroupQueryAttention's RoPE does (``cos``/``sin`` ``[S, r/2]``)."""
    out = x.copy()
    half = cos.shape[-1]
    c, s = (cos[:, None, :], sin[:, None, :]) if cos.ndim == 2 else (cos, sin)
    if interleaved:
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half], x[..., half : 2 * half]
        out[..., :half], out[..., half : 2 * half] = a * c - b * s, b * c + a * s
    return out


def attention_output(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    scale: float,
    picks: np.ndarray | None = None,
    softcap: float = 0.0,
    window: int = -1,
    sink: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The node's output ``[n, H, D]`` for queries ``q`` ``[n, H, D]`` (rotated) at positions
    ``picks`` (default ``0..n-1``) over ``k``/``v`` ``[kv, S, D]``, and the probabilities
    ``[H, n, S]``. ``sink``: the node's ``head_sink`` (one logit per query head beside the
    scores, in the softmax's denominator only)."""
    kv, length, _ = k.shape
    n, heads, _ = q.shape
    picks = np.arange(n) if picks is None else np.asarray(picks)
    group = heads // kv
    pos = np.arange(length)
    masked = pos[None, :] > picks[:, None]
    if window > 0:
        masked |= pos[None, :] <= picks[:, None] - window
    scores = np.matmul(q.transpose(1, 0, 2), np.repeat(k, group, axis=0).transpose(0, 2, 1))
    scores *= np.float32(scale)
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    scores[:, masked] = -np.inf
    p = softmax_with_sink(scores, sink)
    return np.matmul(p, np.repeat(v, group, axis=0)).transpose(1, 0, 2), p


def softmax_with_sink(scores: np.ndarray, sink: np.ndarray | None) -> np.ndarray:
    """Softmax of ``scores`` ``[H, n, S]`` over the last axis; with ``sink`` (``[H]``) each
    head's sink logit joins the denominator (GroupQueryAttention's ``head_sink``)."""
    peak = scores.max(axis=-1, keepdims=True)
    if sink is not None:
        column = np.asarray(sink, np.float32).reshape(-1, 1, 1)
        peak = np.maximum(peak, column)
    p = np.exp(scores - peak)
    total = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(column - peak)
    return p / total


@dataclasses.dataclass(frozen=True)
class AttentionError:
    """Squared attention-output errors of one layer (summed over queries, heads, channels)."""

    both: float
    key: float
    value: float
    norm: float
    """``|| output ||^2`` of the float cache: the errors' yardstick."""
    sink_share: float
    """Mean probability the first row receives."""

    def relative(self) -> tuple[float, float, float]:
        """(both, K alone, V alone) as shares of ``norm``."""
        return self.both / self.norm, self.key / self.norm, self.value / self.norm


def scale_grid(scale: np.ndarray, kv: int, head: int) -> np.ndarray:
    """A scale (1 element, or ``kv * head`` channels) shaped to broadcast over ``[kv, S, D]``."""
    scale = np.asarray(scale, np.float32).ravel()
    return scale.reshape(kv, 1, head) if scale.size > 1 else scale.reshape(1, 1, 1)


def attention_error(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    k_scale: np.ndarray,
    v_scale: np.ndarray,
    fmt: CacheFormat,
    *,
    scale: float,
    picks: np.ndarray | None = None,
    softcap: float = 0.0,
    window: int = -1,
    sink: np.ndarray | None = None,
    exact_rows: Sequence[int] = (),
) -> AttentionError:
    """What storing ``k``/``v`` ``[kv, S, D]`` with ``k_scale``/``v_scale`` (per tensor or per
    channel) costs the node's output for queries ``q`` (see the module docstring)."""
    kv, _, head = k.shape
    attend = functools.partial(
        attention_output, q, scale=scale, picks=picks, softcap=softcap, window=window, sink=sink
    )
    out, p = attend(k, v)
    kq = fmt.round_trip(k, scale_grid(k_scale, kv, head))
    vq = fmt.round_trip(v, scale_grid(v_scale, kv, head))
    rows = list(exact_rows)
    kq[:, rows], vq[:, rows] = k[:, rows], v[:, rows]
    both, key, value = (float(((attend(a, b)[0] - out) ** 2).sum()) for a, b in ((kq, vq), (kq, v), (k, vq)))
    return AttentionError(both, key, value, float((out**2).sum()), float(p[..., 0].mean()))
