"""DenseCache: window-sized caches, the inputs of a call, dequantized values, OrtValue caches."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheQuantizationPass, KvCacheRunner
from onnx_kvcache.model_io._sessions import host_array
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.runtime._cache import CacheBinding, Feeding, discover_cache_bindings
from onnx_kvcache.runtime._dense_cache import DenseCache, DenseLayout

NAMES = ("input_ids", "attention_mask", "position_ids")


def window_bindings(fmt: str | None = "int8") -> list[CacheBinding]:
    """Layer 0 a full cache, layer 1 a window-sized one (window 8), stored as ``fmt``."""
    model = build_decoder(
        num_layers=2, vocab_size=300, sliding_window_layers=(1,), sliding_window=8, sliding_window_cache=True
    )
    if fmt is not None:
        KvCacheQuantizationPass(fmt, "per_tensor", {i: (0.05, 0.02) for i in range(2)})(model)
    return discover_cache_bindings(model)


def dense(bindings: list[CacheBinding], names=NAMES, ids_name="input_ids", io_binding=False) -> DenseCache:
    cache = DenseLayout().cache(bindings, Feeding(ids_name, names, "cpu", io_binding))
    cache.reset(1)
    return cache


def rows(cache: DenseCache) -> dict[int, int]:
    """Sequence rows of each layer's key cache."""
    return {b.layer_id: cache.caches[b.past].shape[2] for b in cache.bindings if b.kind == "key"}


def test_a_window_cache_starts_at_its_window_and_grows_to_min_capacity():
    cache = dense(window_bindings())
    assert rows(cache) == {0: 0, 1: 8}
    cache.reset(2, min_capacity=20)  # calibration keeps every row the kernel quantizes
    assert rows(cache) == {0: 0, 1: 20}
    assert {cache.caches[b.past].shape[0] for b in cache.bindings} == {2}
    cache.reset(1, min_capacity=4)  # never below the window
    assert rows(cache) == {0: 0, 1: 8}


def test_a_window_the_model_fixes_does_not_grow():
    fixed = [dataclasses.replace(b, static_capacity=True) if b.capacity else b for b in window_bindings()]
    cache = dense(fixed)
    cache.reset(1, min_capacity=20)
    assert rows(cache) == {0: 0, 1: 8}


def test_a_window_cache_keeps_its_window_resident_as_the_runner_runs_it():
    """Through the runner: the window layer's cache stays 8 rows (the kernel crops), 20 rows
    when reset with room for them; resident rows follow the window."""
    model = build_decoder(
        num_layers=2, vocab_size=300, sliding_window_layers=(1,), sliding_window=8, sliding_window_cache=True
    )
    runner = KvCacheRunner(model)
    assert isinstance(runner._cache, DenseCache)
    runner.prefill(list(range(1, 21)))
    assert runner.present(1, "key").shape[2] == 8 and runner.present(0, "key").shape[2] == 20
    window = next(b for b in runner.bindings if b.capacity)
    assert window.resident_rows(20, 8) == 8 and window.resident_rows(5, 8) == 5
    runner.reset(1, min_capacity=20)
    runner.fill(list(range(1, 21)))
    assert runner.present(1, "key").shape[2] == 20 and runner.length == 20


def test_feeds_continue_the_context():
    cache = dense(window_bindings())
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    cache.reset(2)
    cache.advance(ids)
    feeds = cache.feeds(np.array([[7, 8], [9, 10]]))
    assert cache.length == 3
    np.testing.assert_array_equal(feeds["input_ids"], [[7, 8], [9, 10]])
    np.testing.assert_array_equal(feeds["attention_mask"], np.ones((2, 5)))
    np.testing.assert_array_equal(feeds["position_ids"], [[3, 4], [3, 4]])
    assert {v.dtype for v in feeds.values()} == {np.dtype(np.int64)}


def test_feeds_name_only_what_the_session_takes():
    cache = dense(window_bindings(), names=("tokens", "position_ids"), ids_name="tokens")
    assert sorted(cache.feeds(np.array([[1, 2]]))) == ["position_ids", "tokens"]


def test_values_dequantize_with_the_scale():
    cache = dense(window_bindings("int8"))
    key = next(b for b in cache.bindings if b.kind == "key" and b.layer_id == 0)
    cache.caches[key.past] = np.full((1, 2, 3, 32), 10, np.int8)
    np.testing.assert_allclose(cache.values(key), np.full((1, 2, 3, 32), 0.5), rtol=1e-6)


def test_a_dense_cache_does_not_pack_ragged_sequences():
    with pytest.raises(KvCacheError, match="forward_packed needs a paged decoder"):
        dense(window_bindings()).require_packed()


def test_bound_caches_are_ortvalues_of_the_stored_type():
    """With io_binding, fresh caches are OrtValues (fp8 as its bits on the host side)."""
    cache = dense(window_bindings("fp8"), io_binding=True)
    for b in cache.bindings:
        value = cache.caches[b.past]
        assert ir.DataType(value.element_type()) == ir.DataType.FLOAT8E4M3FN
        assert host_array(value).dtype == np.uint8 and not host_array(value).any()


def test_presents_are_bound_to_the_device():
    cache = dense(window_bindings())
    binding = mock.Mock()
    cache.bind_present(binding, cache.bindings[0])
    binding.bind_output.assert_called_once_with(cache.bindings[0].present, "cpu")
    binding.bind_ortvalue_output.assert_not_called()
