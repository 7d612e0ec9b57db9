"""_clip_search (``attention_search``): exact layer-local refinement of ``attention``'s scales."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_kvcache import KvCacheError, KvCacheRunner, calibrate_kv_cache
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.calibrate._attention_error import scale_grid
from onnx_kvcache.calibrate._clip_search import LayerSample, _error, _Node, _stored_k, collect, refine
from onnx_kvcache.calibrate.calibration import DEFAULT_METHODS, _rope_tables
from onnx_kvcache.models.decoder import build_decoder

LENGTH = 96


@pytest.fixture(scope="module")
def decoder():
    return build_decoder(num_layers=2, vocab_size=300)


@pytest.fixture(scope="module")
def windows():
    rng = np.random.default_rng(3)
    return [list(rng.integers(0, 300, LENGTH)) for _ in range(4)]


def _samples(model, windows, envelope):
    sites = {s.layer_id: s for s in find_attention_sites(model)}
    tables = {layer: _rope_tables(site) for layer, site in sites.items()}
    runner = KvCacheRunner(model, caches_only=True, capture_queries=True)
    picks = np.arange(0, LENGTH, 3)
    rng = np.random.default_rng(0)
    out: dict[int, list[LayerSample]] = {}
    for window in windows:
        runner.reset(1, min_capacity=LENGTH)
        runner.fill(np.asarray([window], np.int64))
        for layer, sample in collect(runner, sites, LENGTH, picks, tables, envelope, rng).items():
            out.setdefault(layer, []).append(sample)
    return out, tables


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("envelope", [False, True])
def test_held_out_error_is_never_above_attentions(decoder, windows, granularity, envelope):
    """On the held-out window, the refined scales' attention-output error is at most
    ``attention``'s, and lower whenever the scales changed."""
    fmt = get_format("int4")
    base = calibrate_kv_cache(
        decoder, windows, format="int4", granularity=granularity, method="attention", progress=False
    )
    samples, tables = _samples(decoder, windows, envelope)
    changed = 0
    for layer, layer_samples in samples.items():
        ks0, vs0 = base.for_layer(layer)
        ks, vs = refine(layer_samples, ks0, vs0, fmt, scale=32**-0.5, tables=tables[layer])
        assert np.shape(ks) == np.shape(ks0) and np.shape(vs) == np.shape(vs0)
        node = _Node(32**-0.5, 0.0, -1, tables[layer], False)
        kv, _, head = layer_samples[0].k.shape

        check = layer_samples[-1:]
        new, old = (
            _error(check, scale_grid(ks, kv, head), scale_grid(vs, kv, head), fmt, node),
            _error(check, scale_grid(ks0, kv, head), scale_grid(vs0, kv, head), fmt, node),
        )
        assert new <= old
        if not (np.array_equal(ks, ks0) and np.array_equal(vs, vs0)):
            changed += 1
            assert new < old
    assert samples  # every layer was sampled


def test_one_window_is_not_refined(decoder, windows):
    samples, tables = _samples(decoder, windows[:1], False)
    ks, vs = np.float32([0.1]), np.float32([0.2])
    assert refine(samples[0], ks, vs, get_format("int4"), scale=0.2, tables=tables[0]) == (ks, vs)


def test_keys_stored_at_an_offset_come_back_rotated_home(decoder, windows):
    """The envelope's offset changes only what the cache rounds: with a fine scale the keys
    read back are the window's own, and at offset 0 they are the plain round trip."""
    samples, tables = _samples(decoder, windows[:1], True)
    s = samples[0][0]
    assert s.offset > 0
    node = _Node(1.0, 0.0, -1, tables[0], False)
    fine = get_format("int8")
    step = np.float32(2 * np.abs(s.k).max() / 128)  # room for any rotation; a pair errs by its two half steps
    np.testing.assert_allclose(_stored_k(s, step, fine, node), s.k, atol=step * 0.75)
    home = LayerSample(s.q, s.k, s.v, s.picks, 0)
    coarse = get_format("int4")
    np.testing.assert_array_equal(
        _stored_k(home, np.float32(0.5), coarse, node), coarse.round_trip(s.k, np.float32(0.5))
    )
    assert not np.array_equal(
        _stored_k(s, np.float32(0.5), coarse, node), _stored_k(home, np.float32(0.5), coarse, node)
    )


def test_calibration_records_the_method_and_keeps_other_formats_defaults(decoder, windows):
    scales = calibrate_kv_cache(
        decoder, windows, format="int4", granularity="per_tensor", method="attention_search", progress=False
    )
    assert scales.metadata["method"] == "attention_search"
    assert {f for f, _ in DEFAULT_METHODS} == {"int4"}  # int8/fp8 keep minmax: their scales are today's
    with pytest.raises(KvCacheError, match="integer formats"):
        calibrate_kv_cache(decoder, windows, format="fp8", method="attention_search", progress=False)
    int8 = calibrate_kv_cache(decoder, windows, format="int8", progress=False)
    assert int8.metadata["method"] == "minmax"
