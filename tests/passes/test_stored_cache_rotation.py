"""StoredCacheRotationPass on the producers' static builds (mobius ``--features static-cache``) and
ONNX Attention holding its cache: the rotated float model is the model; an int4 cache stored
rotated loses less where the caches have outlier channels; what cannot be rotated is refused
before anything changes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

import qdq_models as storage
from onnx_kvcache import convert_model, evaluate_kv_cache
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cache.rotation import rotation_matrix, site_rotation, stored_rotation
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.cache.storage import attention_read, find_qdq_caches
from onnx_kvcache.errors import KvCachePreconditionError
from onnx_kvcache.passes import QdqKvCachePass, StoredCacheRotationPass
from onnx_kvcache.pipeline.decision import fuse_unless_attention
from onnx_kvcache.scales.files import KvCacheScales

ROTATED = storage.STATIC + storage.OWN_CACHE


@pytest.fixture(scope="module", params=ROTATED)
def producer(request):
    """``(path, float logits)`` of one producer file."""
    return request.param, storage.run(storage.load(request.param))[0]


def _error(want: list[np.ndarray], got: list[np.ndarray]) -> float:
    """The largest logit difference over the prompt and decode steps, relative to the largest logit."""
    scale = max(float(np.abs(w).max()) for w in want)
    return max(float(np.abs(w - g).max()) for w, g in zip(want, got)) / scale


@pytest.mark.parametrize("rotation", ["keys", "keys_and_values"])
def test_a_rotated_float_model_is_the_model(producer, rotation):
    path, want = producer
    model = storage.load(path)
    assert StoredCacheRotationPass(rotation)(model).modified
    assert stored_rotation(model)[0].name == rotation
    got, _ = storage.run(model)
    assert _error(want, got) < 1e-5
    assert not StoredCacheRotationPass(rotation)(model).modified  # rotated as asked: left


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_stored_rotated_cache_reads_as_rotated(fmt):
    """What the graph turns is read through the QuantizeLinear that stores the new rows (int8
    moves codes; int4 quantizes the present), so a stored model says it is rotated."""
    model = storage.load(storage.STATIC[0])
    StoredCacheRotationPass("keys_and_values")(model)
    scales = storage.calibrate(model, fmt, "per_channel", get_format(fmt).qmax, "keys_and_values")
    QdqKvCachePass(fmt, "per_channel", scales)(model)
    assert stored_rotation(model)[0].name == "keys_and_values"
    with pytest.raises(KvCachePreconditionError):  # stored: its scales are the rotated cache's
        StoredCacheRotationPass("keys")(model)


def _with_outliers(model: ir.Model, side: str) -> ir.Model:
    """``model`` whose ``side`` caches get a channel of every head 25 times the others (a Mul on
    the rows each TensorScatter writes): what a rotation spreads over the head."""
    for node in list(model.graph):
        if node.op_type == "TensorScatter" and side in (node.inputs[0].name or ""):
            rows = node.inputs[1]
            factor = np.ones(rows.shape[-1], np.float32)
            factor[3::16] = 25.0
            value = ir.Value(name=f"{node.name}/outliers", const_value=ir.tensor(factor))
            value.dtype, value.shape = ir.DataType.FLOAT, ir.Shape(factor.shape)
            model.graph.register_initializer(value)
            mul = ir.node("Mul", [rows, value], name=f"{node.name}/scaled")
            mul.outputs[0].name, mul.outputs[0].dtype, mul.outputs[0].shape = mul.name, rows.dtype, rows.shape
            model.graph.append(mul)
            node.replace_input_with(1, mul.outputs[0])
    model.graph.sort()
    return model


def _int4_kl(side: str, rotation: str | None) -> float:
    path = storage.STATIC[0]
    want, _ = storage.run(_with_outliers(storage.load(path), side))
    model = _with_outliers(storage.load(path), side)
    if rotation is not None:
        StoredCacheRotationPass(rotation)(model)
    scales = storage.calibrate(model, "int4", "per_tensor", get_format("int4").qmax, rotation or "none")
    QdqKvCachePass("int4", "per_tensor", scales)(model)
    return storage.kl_mean(want, storage.run(model)[0])


def test_rotated_keys_lose_less_with_outlier_channels():
    assert _int4_kl("key", "keys") < 0.5 * _int4_kl("key", None)


def test_rotated_values_lose_less_with_outlier_channels():
    assert _int4_kl("value", "keys_and_values") < 0.6 * _int4_kl("value", "keys")


@pytest.mark.parametrize("path", storage.MLA + storage.CONCAT)
def test_a_cache_no_attention_reads_alone_is_refused(path):
    """MLA's latents (an up-projection reads them) and a present read through Unsqueeze: no
    query can be turned with them; the model is left as it was."""
    model = storage.load(path)
    caches = find_qdq_caches(model.graph)
    assert caches and all(attention_read(c) is None for c in caches)
    before = ir.to_proto(model).SerializeToString()
    with pytest.raises(KvCachePreconditionError):
        StoredCacheRotationPass("keys")(model)
    assert ir.to_proto(model).SerializeToString() == before


def test_a_stored_cache_is_refused():
    model = storage.load(storage.STATIC[0])
    scales = storage.calibrate(model, "int8", "per_tensor", get_format("int8").qmax)
    QdqKvCachePass("int8", "per_tensor", scales)(model)
    with pytest.raises(KvCachePreconditionError):
        StoredCacheRotationPass("keys_and_values")(model)


def test_another_rotation_of_a_rotated_model_is_refused():
    model = storage.load(storage.STATIC[0])
    StoredCacheRotationPass("keys")(model)
    with pytest.raises(KvCachePreconditionError):
        StoredCacheRotationPass("keys_and_values")(model)


def test_no_rotation_leaves_the_model():
    model = storage.load(storage.STATIC[0])
    assert not StoredCacheRotationPass("none")(model).modified


@pytest.mark.parametrize("rotation", ["none", "keys_and_values"])
def test_scales_of_another_rotation_are_refused(rotation):
    """The scales record the rotation they were measured on; the model's graph says its own."""
    model = storage.load(storage.STATIC[0])
    scales = storage.calibrate(model, "int8", "per_tensor", get_format("int8").qmax, rotation)
    if rotation == "none":
        StoredCacheRotationPass("keys")(model)
    with pytest.raises(KvCachePreconditionError):
        QdqKvCachePass("int8", "per_tensor", scales)(model)


def test_a_rotated_model_that_fuses_keeps_one_rotation(tmp_path):
    """An ONNX Attention model rotated here and converted by the kernel (``auto`` fuses it into
    GroupQueryAttention, whose inputs the fusion reorders by rows): the fused nodes read as
    rotated, so the kernel's rotation is not added on top; its stored cache, turned back, is the
    float cache's within int8's rounding, and evaluate reads both as rotated."""
    model = storage.load(storage.OWN_CACHE[0])
    StoredCacheRotationPass("keys_and_values")(model)
    ir.save(model, tmp_path / "rotated.onnx")
    fused = fuse_unless_attention(model, in_copy=True)
    assert fused.fused and {site_rotation(s).name for s in find_attention_sites(fused.model)} == {
        "keys_and_values"
    }
    scales = KvCacheScales(
        {0: 0.05, 1: 0.05}, {0: 0.05, 1: 0.05}, format="int8", metadata={"rotation": "keys_and_values"}
    )
    result = convert_model(tmp_path / "rotated.onnx", tmp_path / "q.onnx", format="int8", scales=scales)
    assert result.converted
    converted = ir.load(tmp_path / "q.onnx")
    assert not [n for n in converted.graph if "/rotation/" in (n.name or "")]  # no kernel rotation added
    data = [list(np.random.default_rng(1).integers(0, 100, 24)) for _ in range(2)]
    report = evaluate_kv_cache(tmp_path / "rotated.onnx", tmp_path / "q.onnx", data, max_new_tokens=0)
    assert max(max(errors) for errors in report.layer_errors.values()) < 0.1
    float_report = evaluate_kv_cache(
        storage.ROOT / storage.OWN_CACHE[0] / "model.onnx", tmp_path / "rotated.onnx", data, max_new_tokens=0
    )
    assert max(max(errors) for errors in float_report.layer_errors.values()) < 1e-5  # turned back


def _attention_4d() -> ir.Model:
    """One ONNX Attention (opset 23) holding its cache, every input 4-D ``[batch, heads, seq, 16]``:
    4 query heads, 2 KV heads."""

    def value(name: str, shape: list) -> ir.Value:
        return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.FLOAT))

    q, k, v = value("q", [1, 4, "s", 16]), value("k", [1, 2, "s", 16]), value("v", [1, 2, "s", 16])
    past_k, past_v = (
        value("past_key_values.0.key", [1, 2, "p", 16]),
        value("past_key_values.0.value", [1, 2, "p", 16]),
    )
    node = ir.node("Attention", [q, k, v, None, past_k, past_v], num_outputs=3, name="attention")
    for out, name in zip(node.outputs, ("y", "present.0.key", "present.0.value")):
        out.name, out.dtype = name, ir.DataType.FLOAT
    node.outputs[0].shape = ir.Shape([1, 4, "s", 16])
    graph = ir.Graph([q, k, v, past_k, past_v], list(node.outputs), nodes=[node], opset_imports={"": 23})
    return ir.Model(graph, ir_version=10)


def test_4d_inputs_are_turned_on_their_last_axis():
    """The output is the model's; the presents hold the cache turned by H, head by head."""
    rng = np.random.default_rng(0)
    feeds = {
        "q": rng.standard_normal((1, 4, 3, 16), np.float32),
        "k": rng.standard_normal((1, 2, 3, 16), np.float32),
        "v": rng.standard_normal((1, 2, 3, 16), np.float32),
        "past_key_values.0.key": rng.standard_normal((1, 2, 5, 16), np.float32),
        "past_key_values.0.value": rng.standard_normal((1, 2, 5, 16), np.float32),
    }
    want = storage.session(_attention_4d()).run(None, feeds)
    model = _attention_4d()
    read = attention_read(find_qdq_caches(model.graph)[0])
    assert read is not None and (read.heads, read.head_size, read.query_heads, read.split) == (
        2,
        16,
        4,
        False,
    )
    assert StoredCacheRotationPass("keys_and_values")(model).modified
    h = rotation_matrix(16).astype(np.float32)
    turned = {
        **feeds,
        **{name: feeds[name] @ h for name in ("past_key_values.0.key", "past_key_values.0.value")},
    }
    y, present_k, present_v = storage.session(model).run(None, turned)
    np.testing.assert_allclose(y, want[0], atol=1e-5)
    np.testing.assert_allclose(present_k, want[1] @ h, atol=1e-5)
    np.testing.assert_allclose(present_v, want[2] @ h, atol=1e-5)
