"""Calibrating caches the graph's I/O names: the written rows of static buffers, MLA's own caches."""

from __future__ import annotations

import pathlib

import numpy as np
import onnxruntime as ort
import pytest

from onnx_kvcache import KvCacheError, calibrate_kv_cache
from onnx_kvcache.cache.rotation import rotate
from onnx_kvcache.runtime._static_cache import StaticCache
from onnx_kvcache.scales.files import load_kv_cache_scale_file

PRODUCERS = pathlib.Path(__file__).parents[1] / "data" / "producers"
STATIC = [PRODUCERS / "mobius" / "mobius-static" / f for f in ("llama", "mistral", "phi3", "qwen2", "qwen3")]
MLA = PRODUCERS / "torch-tf5" / "dynamo-opset23-optimize" / "deepseek_v3"
SEQ_LEN = 40


@pytest.fixture
def data():
    rng = np.random.default_rng(5)
    return [list(rng.integers(0, 128, SEQ_LEN)) for _ in range(8)]


def _minmax(folder: pathlib.Path, data, granularity: str = "per_channel", rotation: str = "none"):
    return calibrate_kv_cache(
        folder / "model.onnx",
        data,
        format="int8",
        granularity=granularity,
        method="minmax",
        seq_len=SEQ_LEN,
        rotation=rotation,
        progress=False,
    )


def _written_amax(folder: pathlib.Path, data, head_size: int = 0) -> dict[tuple[int, str], np.ndarray]:
    """Per channel, the largest |value| of the rows each window wrote, by hand-fed onnxruntime
    (``head_size``: each head turned by ``H`` first, as a rotated cache holds it)."""
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    caches = [i for i in session.get_inputs() if "cache" in i.name]
    found: dict[tuple[int, str], np.ndarray] = {}
    for window in data:
        feeds = {c.name: np.zeros([1, *c.shape[1:]], np.float32) for c in caches} | {
            "input_ids": np.array([window], np.int64),
            "position_ids": np.arange(len(window), dtype=np.int64)[None],
            "write_indices": np.array([0], np.int64),
            "nonpad_kv_seqlen": np.array([len(window)], np.int64),
        }
        names = ["updated_" + c.name for c in caches]
        for cache, updated in zip(caches, session.run(names, feeds)):
            kind, layer = cache.name.split("_cache.")
            rows = updated[0, : len(window)]
            if head_size:
                rows = rotate(rows.reshape(len(window), -1, head_size)).reshape(len(window), -1)
            amax = np.abs(rows).max(axis=0)
            key = (int(layer), kind)
            found[key] = np.maximum(found.get(key, amax), amax)
    return found


@pytest.mark.parametrize("folder", STATIC, ids=lambda p: p.name)
def test_static_minmax_scales_are_the_written_rows_amax(folder, data):
    scales = _minmax(folder, data)
    for (layer, kind), amax in _written_amax(folder, data).items():
        got = scales.for_layer(layer)[0 if kind == "key" else 1]
        np.testing.assert_allclose(got, amax / 128.0, rtol=1e-6)


def test_rotated_static_scales_are_the_turned_rows_amax(data):
    """A rotated static cache holds each head turned by ``H`` (placed by StoredCacheRotationPass):
    its scales are measured on the turned rows, and record the rotation."""
    scales = _minmax(STATIC[0], data, rotation="keys_and_values")
    assert scales.metadata["rotation"] == "keys_and_values"
    for (layer, kind), amax in _written_amax(STATIC[0], data, head_size=16).items():
        got = scales.for_layer(layer)[0 if kind == "key" else 1]
        np.testing.assert_allclose(got, amax / 128.0, rtol=1e-5)


def test_the_buffers_rows_past_the_context_are_not_sampled(data, monkeypatch):
    """Rows no call wrote hold whatever the buffer held (here 1000): the model never reads them,
    and neither does calibration."""
    expected = _minmax(STATIC[0], data)
    reset = StaticCache.reset

    def filled(self, batch, min_capacity=0):
        reset(self, batch, min_capacity)
        self.caches = {name: np.full_like(cache, 1000.0) for name, cache in self.caches.items()}

    monkeypatch.setattr(StaticCache, "reset", filled)
    found = _minmax(STATIC[0], data)
    for layer in expected.layer_ids:
        for want, got in zip(expected.for_layer(layer), found.for_layer(layer)):
            np.testing.assert_array_equal(got, want)


def test_mla_per_channel_scales_keep_each_width(data, tmp_path):
    scales = _minmax(MLA, data)
    assert {layer: tuple(a.size for a in scales.for_layer(layer)) for layer in scales.layer_ids} == {
        0: (32, 16),
        1: (32, 16),
    }
    scales.save(tmp_path / "s.json")
    loaded = load_kv_cache_scale_file(tmp_path / "s.json")
    for layer in scales.layer_ids:
        for want, got in zip(scales.for_layer(layer), loaded.for_layer(layer)):
            np.testing.assert_array_equal(got, want)


def test_attention_methods_have_no_queries_here(data):
    """int4's default for an unrotated cache weighs by attention: without GroupQueryAttention's
    queries the default is mse, and attention asked is refused."""
    path = STATIC[0] / "model.onnx"
    scales = calibrate_kv_cache(path, data, format="int4", rotation="none", seq_len=SEQ_LEN, progress=False)
    assert scales.metadata["method"] == "mse"
    with pytest.raises(KvCacheError):
        calibrate_kv_cache(path, data, format="int4", method="attention", seq_len=SEQ_LEN, progress=False)


def test_int4_is_rotated_by_default_where_the_rotation_is_placed(data):
    """A static build's caches are read by an ONNX Attention: int4 takes its rotated default
    (mse); MLA's latents are not (an up-projection reads them): unrotated, and a rotation asked is
    refused."""
    scales = calibrate_kv_cache(
        STATIC[0] / "model.onnx", data, format="int4", seq_len=SEQ_LEN, progress=False
    )
    assert (scales.metadata["rotation"], scales.metadata["method"]) == ("keys_and_values", "mse")
    mla = MLA / "model.onnx"
    assert (
        calibrate_kv_cache(mla, data, format="int4", seq_len=SEQ_LEN, progress=False).metadata["rotation"]
        == "none"
    )
    with pytest.raises(KvCacheError):
        calibrate_kv_cache(mla, data, format="int4", rotation="keys", seq_len=SEQ_LEN, progress=False)
