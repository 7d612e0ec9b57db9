"""_attention_error: the layer-local attention error emulates onnxruntime's int4/int8 CPU kernel."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_kvcache import KvCacheQuantizationPass, KvCacheRunner, calibrate_kv_cache
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.calibrate._attention_error import attention_error, attention_output
from onnx_kvcache.calibrate._attention_error import rope as _rope
from onnx_kvcache.calibrate.calibration import _rope_tables
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.models.decoder import build_decoder

KV, HEAD, LENGTH = 2, 32, 48


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_the_emulated_output_is_the_kernels(fmt, granularity):
    """Layer 0 of a decoder with a quantized cache (its inputs are the float model's): the
    node's output, prefilling in one chunk, is the emulation's with every row quantized, and
    differs from the float cache's by the error the emulation reports."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 300, (1, LENGTH))
    float_model = build_decoder(num_layers=2, vocab_size=300)
    scales = calibrate_kv_cache(
        float_model, [list(ids[0])] * 2, format=fmt, granularity=granularity, method="minmax",
        min_tokens=0, progress=False,
    )  # fmt: skip
    runner = KvCacheRunner(float_model, capture_queries=True)
    runner.forward(ids)
    site = {s.layer_id: s for s in find_attention_sites(float_model)}[0]
    q = _rope(runner.query(0)[0][0], *_rope_tables(site, LENGTH), False)
    k, v = runner.cache_values(0, "key")[0], runner.cache_values(0, "value")[0]

    model = build_decoder(num_layers=2, vocab_size=300)
    KvCacheQuantizationPass(fmt, granularity, scales)(model)
    node = {s.layer_id: s for s in find_attention_sites(model)}[0].node
    model.graph.outputs.append(node.outputs[0])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for value in model.graph.inputs:
        if value.name.startswith("past_key_values."):
            feeds[value.name] = np.zeros((1, KV, 0, get_format(fmt).packed_dim(HEAD)), value.dtype.numpy())
    kernel = create_session(model).run([node.outputs[0].name], feeds)[0][0].reshape(LENGTH, -1, HEAD)

    f = get_format(fmt)
    ks, vs = scales.for_layer(0)
    ks_b = np.asarray(ks, np.float32).reshape(-1, 1, HEAD) if np.size(ks) > 1 else np.float32(ks)
    vs_b = np.asarray(vs, np.float32).reshape(-1, 1, HEAD) if np.size(vs) > 1 else np.float32(vs)
    emulated, _ = attention_output(q, f.round_trip(k, ks_b), f.round_trip(v, vs_b), scale=HEAD**-0.5)
    np.testing.assert_allclose(kernel, emulated, atol=2e-5)

    floating, _ = attention_output(q, k, v, scale=HEAD**-0.5)
    err = attention_error(q, k, v, ks, vs, f, scale=HEAD**-0.5)
    assert err.both == pytest.approx(float(((kernel - floating) ** 2).sum()), rel=1e-3)
    assert err.both > 0 and err.norm == pytest.approx(float((floating**2).sum()), rel=1e-6)


def test_a_sink_rows_error_is_what_exact_rows_remove():
    """Queries that put nearly all attention on row 0: V's error is that row's, and keeping
    the row exact removes it; a coarser V scale costs more."""
    rng = np.random.default_rng(1)
    k = rng.normal(size=(1, 40, 8)).astype(np.float32)
    k[0, 0] = 4.0  # every query scores the sink high
    q = np.full((40, 2, 8), 1.5, np.float32)
    v = rng.normal(size=(1, 40, 8)).astype(np.float32)
    v[0, 0] = 0.3  # a small sink value, below half of int4's step
    fmt = get_format("int4")
    fine, coarse = np.float32(3.0 / 8), np.float32(6.0 / 8)
    err = attention_error(q, k, v, np.float32(1e3), coarse, fmt, scale=1.0)
    kept = attention_error(q, k, v, np.float32(1e3), coarse, fmt, scale=1.0, exact_rows=[0])
    assert err.sink_share > 0.9
    assert kept.value < 0.1 * err.value
    assert attention_error(q, k, v, np.float32(1e3), fine, fmt, scale=1.0).value < err.value
