"""``attention_search``: the ``attention`` method's int scales refined on each layer's true
attention-output error (:mod:`onnx_kvcache.calibrate._attention_error`, the CPU kernel's rule).

Rules:

* Samples: per calibration window and layer, the node's rotated queries at the
  ``attention`` method's query positions and the window's float K (after RoPE) and V. Under the
  RoPE envelope each window's keys are stored as if the window sat at a random offset of the
  rotary table (rotated there, quantized, rotated back: ``q . k`` is unchanged, what the cache
  rounds is what RoPE stores at that offset).
* Fit on the first windows, check on the last quarter (one at least): K's scales are scaled
  by the multiplier of :data:`K_MULTIPLIERS` with the least output error (V as ``attention``
  chose); then V's clip points (:data:`V_FRACTIONS` of the fit windows' amax, per scale) are
  searched exactly on the output error given the quantized K's probabilities (V's error
  reaches the output linearly, so each V scale's choice is independent).
* A layer keeps ``attention``'s scales unless the check windows' output error with the new
  scales is lower: the refinement never ends worse than ``attention`` on held-out windows. One
  window only: no refinement.
"""

from __future__ import annotations

__all__ = ["K_MULTIPLIERS", "V_FRACTIONS", "LayerSample", "collect", "refine"]

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnx_kvcache.cache.formats import CacheFormat
from onnx_kvcache.calibrate._attention_error import attention_output, scale_grid
from onnx_kvcache.calibrate._attention_error import rope as _rope

K_MULTIPLIERS = (0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4)
V_FRACTIONS = tuple(float(f) for f in np.geomspace(0.1, 1.0, 32))


@dataclasses.dataclass(frozen=True)
class LayerSample:
    """One window of one layer: rotated queries ``[n, H, D]`` at ``picks``, K/V ``[kv, S, D]``,
    and the rotary table offset its keys are stored at (0: as calibrated)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    picks: np.ndarray
    offset: int = 0


@dataclasses.dataclass(frozen=True)
class _Node:
    scale: float
    softcap: float
    window: int
    tables: tuple[np.ndarray, np.ndarray] | None
    interleaved: bool
    sink: np.ndarray | None = None


def _stored_k(s: LayerSample, k_scale: np.ndarray, fmt: CacheFormat, node: _Node) -> np.ndarray:
    """K as the cache reads it back, rotated at the sample's offset (then rotated back)."""
    if not s.offset or node.tables is None:
        return fmt.round_trip(s.k, k_scale)
    cos, sin = (np.broadcast_to(t[s.offset], (s.k.shape[1], t.shape[-1])) for t in node.tables)
    moved = _rope(s.k.transpose(1, 0, 2), cos, sin, node.interleaved).transpose(1, 0, 2)
    stored = fmt.round_trip(moved, k_scale).transpose(1, 0, 2)
    return _rope(stored, cos, -sin, node.interleaved).transpose(1, 0, 2)


def _error(
    samples: Sequence[LayerSample], ks: np.ndarray, vs: np.ndarray, fmt: CacheFormat, node: _Node
) -> float:
    total = 0.0
    for s in samples:
        kw = dict(scale=node.scale, picks=s.picks, softcap=node.softcap, window=node.window, sink=node.sink)
        out, _ = attention_output(s.q, s.k, s.v, **kw)  # type: ignore[arg-type]
        got, _ = attention_output(s.q, _stored_k(s, ks, fmt, node), fmt.round_trip(s.v, vs), **kw)  # type: ignore[arg-type]
        total += float(((got - out) ** 2).sum())
    return total


def _v_search(
    samples: Sequence[LayerSample], ks: np.ndarray, v_shape: tuple[int, ...], fmt: CacheFormat, node: _Node
) -> np.ndarray:
    """V scales (shaped like ``v_shape``'s grid) minimizing the fit windows' output error."""
    kv, _, head = samples[0].v.shape
    amax = np.max([np.abs(s.v).max(axis=1, keepdims=True) for s in samples], axis=0)  # [kv, 1, D]
    if v_shape == (1, 1, 1):
        amax = np.full_like(amax, amax.max())
    err = np.zeros((len(V_FRACTIONS), kv, head))
    for s in samples:
        kw = dict(scale=node.scale, picks=s.picks, softcap=node.softcap, window=node.window, sink=node.sink)
        out, _ = attention_output(s.q, s.k, s.v, **kw)  # type: ignore[arg-type]
        _, p = attention_output(s.q, _stored_k(s, ks, fmt, node), s.v, **kw)  # type: ignore[arg-type]
        group = p.shape[0] // kv
        target = out.transpose(1, 0, 2).reshape(kv, group, -1, head)
        for c, frac in enumerate(V_FRACTIONS):
            stored = fmt.round_trip(s.v, np.maximum(amax * np.float32(frac), np.float32(1e-30)) / fmt.qmax)
            got = np.matmul(p.reshape(kv, group, *p.shape[1:]), stored[:, None])  # [kv, group, n, D]
            err[c] += ((got - target) ** 2).sum(axis=(1, 2))
    best = (
        np.full(amax.shape, V_FRACTIONS[int(err.sum(axis=(1, 2)).argmin())], np.float32)
        if v_shape == (1, 1, 1)
        else np.asarray(V_FRACTIONS, np.float32)[err.argmin(axis=0)][:, None, :]
    )
    vs = (np.maximum(amax * best, np.float32(1e-30)) / fmt.qmax).astype(np.float32)
    return vs[:1, :1, :1] if v_shape == (1, 1, 1) else vs


def refine(
    samples: Sequence[LayerSample],
    k_scale: np.ndarray,
    v_scale: np.ndarray,
    fmt: CacheFormat,
    *,
    scale: float,
    softcap: float = 0.0,
    window: int = -1,
    tables: tuple[np.ndarray, np.ndarray] | None = None,
    interleaved: bool = False,
    sink: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The layer's (K, V) scales, flat as given: ``attention``'s unless the held-out windows'
    output error is lower with the refined ones (module docstring)."""
    if len(samples) < 2:
        return k_scale, v_scale
    node = _Node(scale, softcap, window, tables, interleaved, sink)
    held = max(1, len(samples) // 4)
    fit, check = samples[:-held], samples[-held:]
    kv, _, head = samples[0].k.shape
    ks0, vs0 = scale_grid(k_scale, kv, head), scale_grid(v_scale, kv, head)
    k_errors = [_error(fit, ks0 * np.float32(m), vs0, fmt, node) for m in K_MULTIPLIERS]
    ks = (ks0 * np.float32(K_MULTIPLIERS[int(np.argmin(k_errors))])).astype(np.float32)
    vs = _v_search(fit, ks, vs0.shape, fmt, node)
    if _error(check, ks, vs, fmt, node) >= _error(check, ks0, vs0, fmt, node):
        return k_scale, v_scale
    return ks.reshape(np.shape(k_scale)), vs.reshape(np.shape(v_scale))


def collect(
    runner: Any,
    sites: dict[int, Any],
    length: int,
    picks: np.ndarray,
    rope_tables: dict[int, tuple[np.ndarray, np.ndarray] | None],
    envelope: bool,
    rng: np.random.Generator,
) -> dict[int, LayerSample]:
    """Per layer with a captured query, the last run's first window as a :class:`LayerSample`
    (one offset drawn per window under the envelope)."""
    out: dict[int, LayerSample] = {}
    for layer in runner.queries:
        site = sites.get(layer)
        if site is None:
            continue
        q = runner.query(layer)[0][0]
        k, v = (
            runner.cache_values(layer, "key")[0][:, :length],
            runner.cache_values(layer, "value")[0][:, :length],
        )
        if q.shape[0] != length or q.shape[1] % k.shape[0] or v.shape != k.shape:
            continue
        offset = 0
        if site.int_attr("do_rotary"):
            tables = rope_tables.get(layer)
            if tables is None or tables[0].shape[0] < length:
                continue
            q = _rope(q, tables[0][:length], tables[1][:length], bool(site.int_attr("rotary_interleaved")))
            offset = int(rng.integers(0, tables[0].shape[0] - length + 1)) if envelope else 0
        out[layer] = LayerSample(q[picks].copy(), k.copy(), v.copy(), picks, offset)
    return out
