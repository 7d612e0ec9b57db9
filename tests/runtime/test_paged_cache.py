"""BlockPool and PagedCache: blocks handed out in turns, slot mapping, packed feeds, pool growth."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from onnx_kvcache import KvCacheError, KvCacheQuantizationPass, KvCacheRunner
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.runtime._cache import Feeding, discover_cache_bindings
from onnx_kvcache.runtime._paged_cache import BlockPool, PagedCache, PagedLayout

NAMES = ("input_ids", "position_ids", "cumulative_sequence_length", "past_seqlens", "block_table")


def paged_model(fmt: str | None = None):
    model = build_decoder(num_layers=2, vocab_size=300, paged=True)
    if fmt is not None:
        KvCacheQuantizationPass(fmt, "per_tensor", {i: (0.05, 0.02) for i in range(2)})(model)
    return model


def paged_cache(fmt: str | None = None, device: str = "cpu", block_size: int | None = None) -> PagedCache:
    model = paged_model(fmt)
    bindings = discover_cache_bindings(model)
    layout = PagedLayout.read(bindings, model, block_size, None)
    cache = layout.cache(bindings, Feeding("input_ids", NAMES, device, False))
    cache.reset(1)
    return cache


def test_blocks_are_handed_out_in_turns_and_the_pool_grows():
    pool = BlockPool(16, 2)
    assert pool.reserve([20, 5]) == 4  # grown 1, 1, then 2 blocks: 4 in all, one left free
    assert pool.blocks == [[0, 2], [1]] and pool.num_blocks == 4 and pool.free == [3]
    assert pool.reserve([20, 5]) == 0


def test_slot_mapping_addresses_each_new_tokens_pool_row():
    pool = BlockPool(16, 2)
    pool.reserve([20, 5])
    slots = pool.slots([20, 5])
    np.testing.assert_array_equal(slots, [*range(16), *range(32, 36), *range(16, 21)])
    assert slots.dtype == np.int32
    pool.advance([20, 5])
    np.testing.assert_array_equal(pool.slots([1, 1]), [36, 21])
    np.testing.assert_array_equal(pool.rows(0), [*range(16), *range(32, 36)])
    np.testing.assert_array_equal(pool.rows(1), range(16, 21))


def test_length_inputs_of_a_call():
    pool = BlockPool(16, 2)
    pool.reserve([20, 5])
    pool.advance([17, 5])
    feeds = pool.feeds([3, 0])
    np.testing.assert_array_equal(feeds["cumulative_sequence_length"], [0, 3, 3])
    np.testing.assert_array_equal(feeds["past_seqlens"], [17, 5])
    np.testing.assert_array_equal(feeds["block_table"], [[0, 2], [1, -1]])
    np.testing.assert_array_equal(feeds["attention_metadata"], [3, 20, 0])


def test_the_layout_names_the_inputs_the_lengths_come_from():
    cache = paged_cache()
    assert cache.block_size == 16 and cache.layout.block_size == 16
    assert {"cumulative_sequence_length", "past_seqlens", "block_table"} <= set(cache.layout.inputs)
    assert paged_cache(block_size=32).block_size == 32


def test_packed_feeds_grow_every_pool():
    cache = paged_cache()
    cache.reset(2)
    assert {cache.caches[b.past].shape[0] for b in cache.bindings} == {0}
    feeds = cache.feeds([np.arange(1, 21), np.arange(30, 35)])
    assert {cache.caches[b.past].shape[:2] for b in cache.bindings} == {(4, 16)}
    np.testing.assert_array_equal(feeds["input_ids"], [*range(1, 21), *range(30, 35)])
    np.testing.assert_array_equal(feeds["position_ids"], [*range(20), *range(5)])
    np.testing.assert_array_equal(feeds[cache.layout.inputs["block_table"]], [[0, 2], [1, -1]])
    cache.advance([np.arange(20), np.arange(5)])
    assert cache.pool.lengths == [20, 5] and cache.length == 20


def test_values_gather_each_sequence_from_the_pool():
    cache = paged_cache("int8")
    cache.reset(2)
    cache.feeds([np.arange(1, 21), np.arange(30, 35)])
    cache.advance([np.arange(20), np.arange(5)])
    key = cache.bindings[0]
    pool = np.zeros_like(cache.caches[key.past])
    flat = pool.reshape(-1, *pool.shape[2:])
    flat[cache.pool.rows(0)] = 10
    flat[cache.pool.rows(1)] = 20
    cache.caches[key.past] = pool
    values = cache.values(key)
    assert values.shape == (2, key.kv_num_heads, 20, key.head_size)
    np.testing.assert_allclose(values[0], 0.5, rtol=1e-6)
    np.testing.assert_allclose(values[1, :, :5], 1.0, rtol=1e-6)
    assert not values[1, :, 5:].any()  # past the shorter sequence's end


def test_packed_logits_become_rows_per_sequence():
    cache = paged_cache()
    ids = np.ones((2, 3), np.int64)
    assert cache.logits(np.zeros((6, 300), np.float32), ids).shape == (2, 3, 300)
    with pytest.raises(KvCacheError, match="not 6 tokens' rows"):
        cache.logits(np.zeros((5, 7), np.float32), ids)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_device_pool_is_updated_in_place(device):
    cache = paged_cache(device=device)
    binding, b = mock.Mock(), cache.bindings[0]
    cache.bind_present(binding, b)
    if device == "cpu":
        binding.bind_output.assert_called_once_with(b.present, "cpu")
        binding.bind_ortvalue_output.assert_not_called()
    else:  # the kernel writes the new tokens into the pool it was given
        binding.bind_ortvalue_output.assert_called_once_with(b.present, cache.caches[b.past])
        binding.bind_output.assert_not_called()


def test_a_full_fp8_pool_on_a_device_is_refused():
    """fp8 OrtValues on a device cannot be filled from the host: the pool cannot grow there."""
    model = paged_model("fp8")
    bindings = discover_cache_bindings(model)
    layout = PagedLayout.read(bindings, model, None, None)
    cache = layout.cache(bindings, Feeding("input_ids", NAMES, "cuda", True))
    cache.caches = {b.past: b.empty_pool(0, 16) for b in bindings}  # as reset() leaves them
    with pytest.raises(KvCacheError, match="fp8 block pool on the device is full"):
        cache.feeds([np.arange(1, 5)])


def test_the_runner_runs_paged_decoders_through_a_paged_cache():
    runner = KvCacheRunner(paged_model("int8"))
    assert isinstance(runner._cache, PagedCache) and runner.paged
    assert runner.kernel_rule == runner._cache.kernel_rule
    assert (
        runner.kernel_rule
        == "PagedAttention CPU reference (quantized before attending, as every paged kernel)"
    )
    runner.prefill(np.arange(1, 21))
    assert runner.pool is runner._cache.pool and runner.length == 20
