"""inspect_kv_cache / format_cache_table: what the graph declares about its caches."""

from __future__ import annotations

import warnings

import pytest

from onnx_kvcache import GqaFusionPass, optimize_model
from onnx_kvcache.cache.layout import format_cache_table, inspect_kv_cache
from onnx_kvcache.errors import KvCacheWarning

from builders.exported import build_decoder, exported_config


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
        optimize_model(model, ep=None, format=fmt, scales=scales)
    table = format_cache_table(inspect_kv_cache(model))
    if allocate is None:
        assert "past inputs to allocate" not in table
    else:
        assert "past inputs to allocate" in table and f"  {allocate}" in table, table


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_unquantized_bytes_are_the_models_own_when_the_attention_computes_in_float16(fmt, dtype):
    """A float32 model converted for CUDA computes its attention in float16 (Float16AttentionPass):
    its cache held float32 before, as evaluate's baseline says, not float16."""
    model = build_decoder(exported_config("optimum-llama", num_layers=2, dtype=dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        GqaFusionPass()(model)
        before = inspect_kv_cache(model).bytes_per_token
        scales = {0: (0.1, 0.1), 1: (0.1, 0.1)}
        optimize_model(model, ep="cuda", format=fmt, scales=scales)
    info = inspect_kv_cache(model)
    assert any(node.name.endswith("/to_float16") for node in model.graph) == (dtype == "float32")
    assert info.original_bytes_per_token == before
    ratio = {"float32": {"fp8": 4, "int8": 4, "int4": 8}, "float16": {"fp8": 2, "int8": 2, "int4": 4}}
    assert before / info.bytes_per_token == ratio[dtype][fmt]
    assert f"unquantized {before:g}, {ratio[dtype][fmt]:.2f}x smaller" in format_cache_table(info)
