"""QdqKvCachePass on the producers' static builds (mobius ``--features static-cache``), MLA
exports (DeepSeek-V3), an export whose attention does not fuse and ONNX Attention holding its
cache: caches stored in the format's type, run on onnxruntime's CPU in the model's own calling
convention, next-token distributions close to the float model's."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import onnx_ir as ir
import pytest

import qdq_models as storage
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cache.storage import QDQ_TYPES, find_qdq_caches
from onnx_kvcache.errors import KvCachePreconditionError, UnitScalesWarning
from onnx_kvcache.passes import QdqKvCachePass
from onnx_kvcache.scales.files import KvCacheScales

MODELS = storage.STATIC + storage.MLA + storage.CONCAT + storage.OWN_CACHE


@pytest.fixture(scope="module", params=MODELS)
def producer(request):
    """``(path, float logits)`` of one producer file."""
    return request.param, storage.run(storage.load(request.param))[0]


def _converted(path: str, fmt: str, granularity: str = "per_tensor") -> ir.Model:
    model = storage.load(path)
    scales = storage.calibrate(model, fmt, granularity, get_format(fmt).qmax)
    result = QdqKvCachePass(fmt, granularity, scales)(model)
    assert result.modified
    return model


@pytest.mark.parametrize(
    ("fmt", "granularity"),
    [("int8", "per_tensor"), ("int8", "per_channel"), ("fp8", "per_tensor"), ("int4", "per_channel")],
)
def test_stored_caches_run_close_to_the_float_model(producer, fmt, granularity):
    """Where the model's opset defines the format's QuantizeLinear; else the pass refuses it."""
    path, want = producer
    if storage.load(path).opset_imports[""] < QDQ_TYPES[fmt].opset:  # optimum's opset 18: int8 only
        with pytest.raises(KvCachePreconditionError):
            _converted(path, fmt, granularity)
        return
    model = _converted(path, fmt, granularity)
    caches = find_qdq_caches(model.graph)
    assert len(caches) == 4 and all(c.stored for c in caches)
    assert {c.past.dtype for c in caches} == {c.present.dtype for c in caches} == {QDQ_TYPES[fmt].dtype}
    got, _ = storage.run(model)
    assert storage.kl_mean(want, got) < 1e-2


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_static_buffer_keeps_its_stored_rows_exactly(fmt):
    """int8 moves codes (TensorScatter on int8); fp8 dequantizes and quantizes the buffer again,
    which gives every stored code back."""
    model = _converted(storage.STATIC[0], fmt)
    _, seen = storage.run(model, capture=True)
    buffers = seen["key_cache.0"]  # the buffer after the prompt and after each decode step
    written = len(storage.PROMPT)
    for before, after in itertools.pairwise(buffers):
        assert np.array_equal(before[:, :written].view(np.uint8), after[:, :written].view(np.uint8))
        assert np.any(after[:, written] != 0)
        written += 1


def test_a_converted_model_is_found_stored_and_left_as_it_is():
    model = _converted(storage.MLA[0], "int8")
    nodes = len(model.graph)
    scales = storage.calibrate(storage.load(storage.MLA[0]), "int8", "per_tensor", 128.0)
    assert not QdqKvCachePass("int8", "per_tensor", scales)(model).modified
    assert len(model.graph) == nodes


def test_integer_formats_refuse_without_scales_and_fp8_takes_unit_scales():
    model = storage.load(storage.STATIC[0])
    with pytest.raises(KvCachePreconditionError):
        QdqKvCachePass("int8")(model)
    assert all(c.past.dtype == ir.DataType.FLOAT for c in find_qdq_caches(model.graph))
    with pytest.warns(UnitScalesWarning):
        assert QdqKvCachePass("fp8")(model).modified


def test_an_opset_without_the_type_is_refused():
    model = storage.load(storage.MLA[0])
    model.opset_imports[""] = 20  # int4 QuantizeLinear needs 21
    scales = KvCacheScales({0: 0.1, 1: 0.1}, {0: 0.1, 1: 0.1}, format="int4")
    with pytest.raises(KvCachePreconditionError):
        QdqKvCachePass("int4", "per_tensor", scales)(model)


def test_per_channel_scales_must_fit_the_cache():
    model = storage.load(storage.STATIC[0])
    wrong = {layer: (np.full(7, 0.1), np.full(7, 0.1)) for layer in (0, 1)}
    with pytest.raises(KvCachePreconditionError):
        QdqKvCachePass("int8", "per_channel", KvCacheScales.from_mapping(wrong))(model)


def test_keys_and_values_of_different_widths_take_their_own_channel_scales():
    """MLA: key head 32, value head 16 (one KV head: a scale per channel on the last axis)."""
    model = storage.load(storage.MLA[0])
    scales = KvCacheScales.from_mapping({i: (np.full(32, 0.05), np.full(16, 0.02)) for i in (0, 1)})
    QdqKvCachePass("int8", "per_channel", scales)(model)
    sizes = {v.name: v.const_value.size for v in model.graph.initializers.values() if "qdq_scale" in v.name}
    assert sizes["past_key_values.0.key.qdq_scale"] == 32
    assert sizes["past_key_values.0.value.qdq_scale"] == 16


def _concat_cache(heads: int, head: int, dtype: ir.DataType = ir.DataType.FLOAT, opset: int = 21) -> ir.Model:
    """``present.0.key = Concat(past_key_values.0.key, new)`` on the sequence axis, and ``read``:
    what attention would read (the present plus zero)."""
    past = ir.Value(name="past_key_values.0.key", shape=ir.Shape(["b", heads, "p", head]))
    new = ir.Value(name="new", shape=ir.Shape(["b", heads, "s", head]))
    for value in (past, new):
        value.dtype = dtype
    concat = ir.node("Concat", [past, new], {"axis": 2}, name="concat")
    zero = ir.Value(name="zero", const_value=ir.tensor(np.zeros((), dtype.numpy())))
    add = ir.node("Add", [concat.outputs[0], zero], name="add")
    concat.outputs[0].name, add.outputs[0].name = "present.0.key", "read"
    concat.outputs[0].dtype = add.outputs[0].dtype = dtype
    graph = ir.Graph(
        [past, new],
        [concat.outputs[0], add.outputs[0]],
        nodes=[concat, add],
        initializers=[zero],
        opset_imports={"": opset},
    )
    return ir.Model(graph, ir_version=10)


def test_channels_of_several_heads_scale_around_unit_quantizers():
    """A [batch, kv_heads, seq, head] cache of two heads: the scale [1, 2, 1, head] divides before
    a unit-scale QuantizeLinear; attention reads the rows as stored, the old rows unchanged."""
    model = _concat_cache(2, 4)
    grid = np.arange(1, 9, dtype=np.float32) / 100
    scales = KvCacheScales.from_mapping({0: (grid, grid)})
    QdqKvCachePass("int8", "per_channel", scales)(model)
    shapes = {v.name: v.const_value.shape for v in model.graph.initializers.values()}
    assert shapes["past_key_values.0.key.qdq_channel_scale"] == (1, 2, 1, 4)
    past = np.random.default_rng(0).integers(-128, 128, (1, 2, 3, 4)).astype(np.int8)
    new = np.random.default_rng(1).normal(size=(1, 2, 2, 4)).astype(np.float32)
    present, read = storage.session(model).run(None, {"past_key_values.0.key": past, "new": new})
    codes = np.clip(np.round(new / grid.reshape(1, 2, 1, 4)), -128, 127)
    assert present.dtype == np.int8 and np.array_equal(
        present, np.concatenate([past, codes.astype(np.int8)], 2)
    )
    np.testing.assert_allclose(read, present * grid.reshape(1, 2, 1, 4), rtol=1e-6)


def test_channel_scales_of_another_head_count_and_float16_scales_before_opset_19_are_refused():
    scales = KvCacheScales.from_mapping({0: (np.full(12, 0.1), np.full(12, 0.1))})  # 3 heads of 4
    with pytest.raises(KvCachePreconditionError):
        QdqKvCachePass("int8", "per_channel", scales)(_concat_cache(2, 4))
    half = _concat_cache(2, 4, ir.DataType.FLOAT16, opset=18)
    with pytest.raises(KvCachePreconditionError):
        QdqKvCachePass("int8", "per_tensor", KvCacheScales.from_mapping({0: (0.1, 0.1)}))(half)
    half = _concat_cache(2, 4, ir.DataType.FLOAT16, opset=19)
    QdqKvCachePass("int8", "per_tensor", KvCacheScales.from_mapping({0: (0.1, 0.1)}))(half)
    past = np.zeros((1, 2, 1, 4), np.int8)
    new = np.full((1, 2, 1, 4), 0.3, np.float16)
    present, read = storage.session(half).run(None, {"past_key_values.0.key": past, "new": new})
    assert read.dtype == np.float16 and np.all(present[:, :, 1] == 3) and abs(read[0, 0, 1, 0] - 0.3) < 1e-3


def _scales(layers: tuple[int, ...], size: int, rotation: str | None = None, value: int = 0) -> KvCacheScales:
    """Scales of ``size`` elements per cache (``value``: the values', if other)."""
    scales = KvCacheScales.from_mapping(
        {i: (np.full(size, 0.1), np.full(value or size, 0.1)) for i in layers}
    )
    return scales if rotation is None else dataclasses.replace(scales, metadata={"rotation": rotation})


@pytest.mark.parametrize(
    ("path", "granularity", "scales"),
    [
        (storage.STATIC[0], "per_tensor", _scales((0, 1, 2), 1)),  # a layer the model does not have
        (storage.STATIC[0], "per_tensor", _scales((0, 1), 1, rotation="keys_and_values")),  # measured rotated
        (
            storage.MLA[1],
            "per_channel",
            _scales((0, 1), 32, value=16),
        ),  # one head's channels; the cache has 4 heads
    ],
    ids=["foreign-layer", "rotated", "one-head-of-four"],
)
def test_scales_the_auto_path_refuses_are_refused(path, granularity, scales):
    model = storage.load(path)
    with pytest.raises(KvCachePreconditionError):
        QdqKvCachePass("int8", granularity, scales)(model)
    assert all(not c.stored for c in find_qdq_caches(model.graph))  # refused before anything changed
