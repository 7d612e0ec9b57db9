"""inspect_kv_cache / format_cache_table: what the graph declares about its caches."""

from __future__ import annotations

import warnings

import pytest

from onnx_kvcache import build_decoder, optimize_model
from onnx_kvcache.cache.layout import format_cache_table, inspect_kv_cache
from onnx_kvcache.errors import KvCacheWarning
from onnx_kvcache.models.exported import exported_config


@pytest.mark.parametrize(
    ("fmt", "allocate"),
    [
        ("int8", "INT8 [batch_size, 2, past_sequence_length, 32] (layer(s) 0-1;"),
        ("int4", "UINT8 [batch_size, 2, past_sequence_length, 16] (int4: two values a byte, head_size / 2)"),
        ("fp8", "FLOAT8E4M3FN [batch_size, 2, past_sequence_length, 32] (layer(s) 0-1;"),
        (None, None),
    ],
)
def test_the_table_says_what_past_inputs_to_allocate(fmt, allocate):
    """Serving code that feeds empty float32 pasts must allocate the quantized type and shape."""
    model = build_decoder(exported_config("optimum-llama", num_layers=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        scales = {0: (0.1, 0.1), 1: (0.1, 0.1)} if fmt else None
        optimize_model(model, execution_provider=None, kv_cache_format=fmt, kv_cache_scales=scales)
    table = format_cache_table(inspect_kv_cache(model))
    if allocate is None:
        assert "past inputs to allocate" not in table
    else:
        assert "past inputs to allocate" in table and f"  {allocate}" in table, table
