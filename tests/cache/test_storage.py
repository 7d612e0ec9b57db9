"""cache.storage: the caches a storage-quantized conversion keeps, found float or stored, and
their bytes per token."""

from __future__ import annotations

import onnx_ir as ir
import pytest

import qdq_models as storage
from onnx_kvcache.cache.storage import find_qdq_caches, storage_bytes_per_token, stored_format
from onnx_kvcache.errors import UnitScalesWarning
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.passes import QdqKvCachePass
from onnx_kvcache.scales.files import KvCacheScales

SCALES = KvCacheScales({0: 0.05, 1: 0.05}, {0: 0.05, 1: 0.05}, format="int8")


@pytest.mark.parametrize(
    ("path", "writer", "per_token"),
    [(storage.STATIC[0], "TensorScatter", 4 * 32 * 4), (storage.MLA[0], "Concat", 2 * (32 + 16) * 4)],
)
def test_each_cache_is_found_with_its_side_layer_and_writer(path, writer, per_token):
    model = storage.load(path)
    caches = find_qdq_caches(model.graph)
    assert [(c.layer, c.side) for c in caches] == [(0, "k"), (0, "v"), (1, "k"), (1, "v")]
    assert {c.writer.op_type for c in caches} == {writer} and not any(c.stored for c in caches)
    assert storage_bytes_per_token(model) == per_token
    assert storage_bytes_per_token(model, "int8") == per_token / 4
    assert stored_format(model) is None
    QdqKvCachePass("int8", "per_tensor", SCALES)(model)
    assert [c.stored for c in find_qdq_caches(model.graph)] == [True] * 4
    assert stored_format(model) == "int8" and storage_bytes_per_token(model) == per_token / 4


def test_fp8_caches_are_found_through_their_dequantize_and_quantize_nodes():
    model = storage.load(storage.STATIC[0])
    with pytest.warns(UnitScalesWarning):
        QdqKvCachePass("fp8")(model)
    caches = find_qdq_caches(model.graph)
    assert len(caches) == 4 and stored_format(model) == "fp8"
    names = {f"updated_{side}_cache.{i}" for side in ("key", "value") for i in (0, 1)}
    assert {c.present.name for c in caches} == names


def test_a_kernel_held_cache_is_not_one():
    assert find_qdq_caches(build_decoder(num_layers=1).graph) == []
    assert storage_bytes_per_token(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10)) == 0
