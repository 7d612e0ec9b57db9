"""The ``attention`` method's weights: what each cached value's error costs the layer.

Rules: the attention probabilities ``p`` of :data:`ATTENTION_QUERIES` query positions per
window (evenly spread, the last included) are recomputed from the captured query (rotated as
the node does) and the present K: causal, the node's scale, softcap, local window and sinks
(``head_sink``: one logit per query head in the denominator), query heads grouped over KV
heads. K's error moves the score ``q . k`` of every query attending to the row, so K is
weighted by ``sum_i p_ij * q_i[d]^2`` (``q`` as its RoPE-pair energy, which no rotation
changes); V's error reaches the output in proportion to ``p`` and independent errors add in
square, so V is weighted by ``sum_i p_ij^2``. Layers without a usable query are left out.
"""

from __future__ import annotations

__all__ = ["ATTENTION_QUERIES"]

import numpy as np

from onnx_kvcache.cache.sites import CacheSite
from onnx_kvcache.calibrate._attention_error import head_sink, softmax_with_sink
from onnx_kvcache.calibrate._attention_error import rope as _rope
from onnx_kvcache.runtime.runner import KvCacheRunner

#: Query positions per window whose attention weighs the rows (evenly spread, the last included).
ATTENTION_QUERIES = 128


def _pair_energy(q: np.ndarray, interleaved: bool, rotary_dim: int) -> np.ndarray:
    """``q^2`` with each RoPE pair's channels given the pair's mean energy (rotation-invariant)."""
    e = q * q
    half = rotary_dim // 2
    if interleaved:
        m = (e[..., 0:rotary_dim:2] + e[..., 1:rotary_dim:2]) / 2
        e[..., 0:rotary_dim:2], e[..., 1:rotary_dim:2] = m, m
    else:
        m = (e[..., :half] + e[..., half:rotary_dim]) / 2
        e[..., :half], e[..., half:rotary_dim] = m, m
    return e


def _attention_weights(
    runner: KvCacheRunner,
    sites: dict[int, CacheSite],
    length: int,
    rope_tables: dict[int, tuple[np.ndarray, np.ndarray] | None],
) -> dict[tuple[int, str], np.ndarray]:
    """Per (layer, kind), the weight of each cached value's squared error in this window.

    The attention probabilities ``p`` of :data:`ATTENTION_QUERIES` query positions over the
    window's rows are recomputed from the captured query (rotated as the node does) and the
    present K (causal, the node's scale, softcap and local window). K: ``sum_i p_ij * e_i[d]``
    with ``e`` the query's RoPE-pair energy; V: ``sum_i p_ij^2``, summed over the query heads
    of each KV head. Layers without a usable query are left out (unweighted).
    """
    out: dict[tuple[int, str], np.ndarray] = {}
    picks = np.unique(np.linspace(0, length - 1, min(length, ATTENTION_QUERIES)).round().astype(np.int64))
    for layer in runner.queries:
        site = sites.get(layer)
        if site is None:
            continue
        q = runner.query(layer)[0][0]  # [S, H, D]
        k = runner.cache_values(layer, "key")[0][:, :length]  # [kv, S, D], after RoPE
        weights = _layer_attention_weights(site, q, k, length, picks, rope_tables.get(layer))
        if weights is not None:
            out[(layer, "key")], out[(layer, "value")] = weights
    return out


def _layer_attention_weights(
    site: CacheSite,
    q: np.ndarray,
    k: np.ndarray,
    length: int,
    picks: np.ndarray,
    tables: tuple[np.ndarray, np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """One layer's K and V weights ``[S, kv*hd]`` (see :func:`_attention_weights`) from its
    query ``[S, H, D]`` and present K ``[kv, S, D]``; None when the query is not usable."""
    kv, heads, head = k.shape[0], q.shape[1], q.shape[2]
    if q.shape[0] != length or heads % kv:
        return None
    interleaved = bool(site.int_attr("rotary_interleaved"))
    rotary_dim = head
    if site.int_attr("do_rotary"):
        if tables is None or tables[0].shape[0] < length:
            return None
        rotary_dim = 2 * tables[0].shape[-1]
        q = _rope(q, tables[0][:length], tables[1][:length], interleaved)
    q = q[picks]  # [n, H, D]
    energy = _pair_energy(q, interleaved, rotary_dim) if site.int_attr("do_rotary") else q * q
    pos = np.arange(length)
    masked = pos[None, :] > picks[:, None]
    window = site.int_attr("local_window_size", -1)
    if window > 0:
        masked |= pos[None, :] <= picks[:, None] - window
    return _kv_head_weights(site, q, k, energy, masked)


def _kv_head_weights(
    site: CacheSite, q: np.ndarray, k: np.ndarray, energy: np.ndarray, masked: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per KV head, the attention ``p`` of its query heads' picked positions over the rows
    (``masked`` ones excluded), made K and V weights ``[S, kv*hd]``."""
    kv, length, head = k.shape[0], masked.shape[1], q.shape[2]
    group = q.shape[1] // kv
    scale = site.float_attr("scale") or 1.0 / np.sqrt(head)
    softcap = site.float_attr("softcap")
    sink = head_sink(site)
    wk = np.empty((length, kv, head), np.float32)
    wv = np.empty((length, kv, head), np.float32)
    for g in range(kv):
        qg = q[:, g * group : (g + 1) * group]  # [n, group, D]
        scores = np.matmul(qg.transpose(1, 0, 2), k[g].T) * np.float32(scale)  # [group, n, S]
        if softcap > 0:
            scores = softcap * np.tanh(scores / softcap)
        scores[:, masked] = -np.inf
        p = softmax_with_sink(scores, None if sink is None else sink[g * group : (g + 1) * group])
        wk[:, g] = p.reshape(-1, length).T @ energy[:, g * group : (g + 1) * group].transpose(
            1, 0, 2
        ).reshape(-1, head)
        wv[:, g] = (p * p).sum(axis=(0, 1))[:, None]
    return wk.reshape(length, kv * head), wv.reshape(length, kv * head)
