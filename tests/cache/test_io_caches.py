"""Caches the graph's I/O names: the conventions' rows, and a QDQ cache's format and scale."""

from __future__ import annotations

import pathlib

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache.cache.io_caches import EXPORTED, STATIC, find_io_caches
from onnx_kvcache.cache.layout import inspect_kv_cache
from onnx_kvcache.model_io import host_array, to_ort_value
from onnx_kvcache.model_io.reading import load_model

PRODUCERS = pathlib.Path(__file__).parents[1] / "data" / "producers"
STATIC_FILES = [PRODUCERS / "mobius" / "mobius-static" / f / "model.onnx" for f in ("llama", "phi3", "qwen3")]
MLA = PRODUCERS / "torch-tf5" / "dynamo-opset23-optimize" / "deepseek_v3" / "model.onnx"
FUSABLE = PRODUCERS / "torch-tf5" / "dynamo-opset23-optimize" / "llama" / "model.onnx"


@pytest.mark.parametrize("path", STATIC_FILES, ids=lambda p: p.parent.name)
def test_static_buffers(path):
    caches = find_io_caches(load_model(path))
    assert [(c.convention, c.layer_id, c.kind) for c in caches] == [
        (STATIC, 0, "key"),
        (STATIC, 0, "value"),
        (STATIC, 1, "key"),
        (STATIC, 1, "value"),
    ]
    assert {(c.rows, c.kv_num_heads, c.head_size, c.format) for c in caches} == {(64, 2, 16, None)}
    assert caches[0].present == "updated_key_cache.0"


def test_mla_keys_and_values_keep_their_widths():
    caches = find_io_caches(load_model(MLA))
    assert {(c.kind, c.head_size, c.rows) for c in caches} == {("key", 32, None), ("value", 16, None)}
    assert {c.convention for c in caches} == {EXPORTED}
    info = inspect_kv_cache(load_model(MLA), exported=True)
    assert [layer.bytes_per_token for layer in info.layers] == [(32 + 16) * 4] * 2
    assert not inspect_kv_cache(load_model(MLA)).layers  # a float export: what a fused copy shows


def test_a_convention_asked_for_alone():
    model = load_model(FUSABLE)
    assert find_io_caches(model, (STATIC,)) == []
    assert {c.convention for c in find_io_caches(model)} == {EXPORTED}


def _qdq_static(dtype: ir.DataType, scale: np.ndarray) -> ir.Model:
    """A static buffer stored as ``dtype``: DequantizeLinear(past) -> TensorScatter -> QuantizeLinear."""
    past = ir.Value(name="key_cache.0", type=ir.TensorType(dtype), shape=ir.Shape(["batch", 8, 8]))
    new = ir.Value(name="new", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", 1, 8]))
    where = ir.Value(name="write_indices", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch"]))
    s = ir.Value(name="s", const_value=ir.tensor(scale))
    dq = ir.node("DequantizeLinear", [past, s])
    scatter = ir.node("TensorScatter", [dq.outputs[0], new, where], attributes={"axis": 1})
    attention = ir.node("Attention", [scatter.outputs[0]], attributes={"kv_num_heads": 2})
    q = ir.node("QuantizeLinear", [scatter.outputs[0], s], attributes={"output_dtype": int(dtype)})
    q.outputs[0].name = "updated_key_cache.0"
    graph = ir.Graph(
        [past, new, where], [q.outputs[0], attention.outputs[0]], nodes=[dq, scatter, attention, q],
        initializers=[s], opset_imports={"": 24},
    )  # fmt: skip
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize(("dtype", "fmt"), [(ir.DataType.INT8, "int8"), (ir.DataType.INT4, "int4")])
def test_a_qdq_cache_reads_its_format_and_scale(dtype, fmt):
    scale = np.linspace(0.01, 0.08, 8).astype(np.float32)
    (cache,) = find_io_caches(_qdq_static(dtype, scale))
    assert cache.format is not None and cache.format.name == fmt
    assert (cache.kv_num_heads, cache.head_size) == (2, 4)  # the attention's heads split the width
    np.testing.assert_array_equal(cache.scale, scale.reshape(1, 2, 1, 4))


def test_int4_ort_values_pack_two_values_a_byte():
    values = (np.arange(27).reshape(3, 9) % 16 - 8).astype(ml_dtypes.int4)
    value = to_ort_value(values, ir.DataType.INT4)
    assert value.shape() == [3, 9] and value.tensor_size_in_bytes() == 14
    back = host_array(value)
    np.testing.assert_array_equal(back.astype(np.int8), values.astype(np.int8))
