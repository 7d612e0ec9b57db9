"""``storage="qdq"`` through ``convert_model`` and ``optimize_model``: the producers' static builds
and DeepSeek-V3's MLA export convert to int8 caches whose next-token distributions stay within a
KL mean of 1e-2 of the float model's; under the default ``auto`` their refusal names the option;
a target without a storage row is refused, and a GroupQueryAttention model is left to the kernel."""

from __future__ import annotations

import logging
import pathlib

import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import qdq_models as storage
from onnx_kvcache import convert_model, optimize_model
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cache.rotation import stored_rotation
from onnx_kvcache.cache.storage import find_qdq_caches
from onnx_kvcache.capabilities.refusals import RefusalCode
from onnx_kvcache.errors import FusionSkippedWarning, KvCacheError, NotConvertedWarning, Param
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.passes import StoredCacheRotationPass
from onnx_kvcache.scales.files import KvCacheScales


def _parts(text: object) -> list[object]:
    """A message's parts, nested messages flattened (the Params it names)."""
    found = []
    for part in getattr(text, "parts", ()):
        found += [part, *_parts(part)]
    return found


@pytest.fixture(scope="module", params=storage.STATIC + storage.MLA + storage.CONCAT)
def producer(request, tmp_path_factory):
    """``(path, float logits, int8 scale file)`` of one producer file."""
    model = storage.load(request.param)
    scales = storage.calibrate(model, "int8", "per_channel", 128.0)
    path = tmp_path_factory.mktemp("scales") / "scales.json"
    scales.save(path)
    return request.param, storage.run(model)[0], path


def test_convert_stores_int8_caches_close_to_the_float_model(producer, tmp_path):
    path, want, scales = producer
    source = storage.ROOT / path / "model.onnx"
    result = convert_model(source, tmp_path / "q.onnx", storage="qdq", scales=scales)
    assert result.converted and result.format == "int8" and result.target == "cpu"
    onnx.checker.check_model(str(tmp_path / "q.onnx"), full_check=True)  # loads in onnx, with its data
    ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    model = ir.load(tmp_path / "q.onnx")
    caches = find_qdq_caches(model.graph)
    assert len(caches) == 4 and {c.past.dtype for c in caches} == {ir.DataType.INT8}
    got, _ = storage.run(ir.external_data.load_to_model(model))
    assert storage.kl_mean(want, got) < 1e-2


@pytest.mark.parametrize("path", storage.STATIC + storage.MLA)
def test_auto_refuses_them_naming_the_storage(path, tmp_path):
    with pytest.warns(NotConvertedWarning):
        result = convert_model(storage.ROOT / path / "model.onnx", tmp_path / "q.onnx", format="int8")
    assert not result.converted and not (tmp_path / "q.onnx").exists()
    assert result.refusals[0].code is RefusalCode.ATTENTION_UNFUSED
    assert Param("storage", "qdq") in _parts(result.refusals[0].text)


def test_optimize_model_stores_the_cache_in_place():
    model = storage.load(storage.MLA[0])
    scales = storage.calibrate(model, "int8", "per_tensor", 128.0)
    assert optimize_model(model, storage="qdq", scales=scales, strict=True) is model
    assert {c.past.dtype for c in find_qdq_caches(model.graph)} == {ir.DataType.INT8}
    optimize_model(model, storage="qdq", scales=scales, strict=True)  # stored already: nothing to do
    assert {c.past.dtype for c in find_qdq_caches(model.graph)} == {ir.DataType.INT8}


def test_a_target_without_a_storage_row_is_refused(tmp_path):
    path = storage.ROOT / storage.STATIC[0] / "model.onnx"
    with pytest.warns(NotConvertedWarning):
        result = convert_model(path, tmp_path / "q.onnx", storage="qdq", format="fp8", ep="cuda")
    assert not result.converted and result.refusals[0].code is RefusalCode.FORMAT_UNSUPPORTED
    with pytest.warns(NotConvertedWarning):
        result = convert_model(path, tmp_path / "q.onnx", storage="qdq", format="fp8", ep="openvino")
    assert not result.converted and not (tmp_path / "q.onnx").exists()


def test_a_model_without_such_a_cache_is_refused_and_the_storage_name_checked(tmp_path):
    model = build_decoder(num_layers=1)  # GroupQueryAttention holds its cache: the kernel's
    ir.save(model, tmp_path / "gqa.onnx")
    with pytest.warns(NotConvertedWarning):
        result = convert_model(tmp_path / "gqa.onnx", tmp_path / "q.onnx", storage="qdq", format="fp8")
    assert result.refusals[0].code is RefusalCode.NO_ATTENTION
    assert Param("storage", "auto") in _parts(result.refusals[0].text)  # the way forward
    with pytest.raises(KvCacheError):
        convert_model(tmp_path / "gqa.onnx", tmp_path / "q.onnx", storage="kernel")
    before = ir.to_proto(model).SerializeToString()
    optimize_model(model, storage="qdq", format="fp8", rotation="keys")  # nothing stored, nothing turned
    assert ir.to_proto(model).SerializeToString() == before


def test_unrecorded_scales_take_the_granularity_their_sizes_fit(tmp_path):
    model = storage.load(storage.MLA[1])  # keys 128 wide, values 64: per-channel scales of each width
    found = storage.calibrate(model, "int8", "per_channel", 128.0)
    path = tmp_path / "pc.json"
    KvCacheScales(found.k, found.v, format="int8").save(path)  # no granularity recorded
    source = storage.ROOT / storage.MLA[1] / "model.onnx"
    result = convert_model(source, tmp_path / "q.onnx", storage="qdq", scales=path)
    assert result.converted and result.granularity == "per_channel"
    narrow = {layer: k[: k.size // 2] for layer, k in found.k.items()}  # fits no key cache's width
    KvCacheScales(narrow, found.v, format="int8").save(path)
    with pytest.raises(KvCacheError):
        convert_model(source, tmp_path / "r.onnx", storage="qdq", scales=path)
    assert not (tmp_path / "r.onnx").exists()


def test_verify_does_not_apply_and_a_fusing_export_is_told_of_the_kernel(tmp_path, caplog):
    static = storage.ROOT / storage.STATIC[0] / "model.onnx"
    scales = tmp_path / "s.json"
    storage.calibrate(storage.load(storage.STATIC[0]), "int8", "per_tensor", 128.0).save(scales)
    with (
        caplog.at_level(logging.INFO, logger="onnx_kvcache.pipeline.storage_decision"),
        pytest.warns(FusionSkippedWarning),  # nothing is fused: nothing to verify
    ):
        result = convert_model(static, tmp_path / "q.onnx", storage="qdq", scales=scales, verify=True)
    assert result.converted and not result.verified
    assert not [
        r for r in caplog.records if Param("storage", "auto") in _parts(r.args[0] if r.args else r.msg)
    ]
    fuses = storage.ROOT / storage.CONCAT[0] / "model.onnx"  # under auto its attention fuses
    storage.calibrate(storage.load(storage.CONCAT[0]), "int8", "per_tensor", 128.0).save(scales)
    with caplog.at_level(logging.INFO, logger="onnx_kvcache.pipeline.storage_decision"):
        assert convert_model(fuses, tmp_path / "r.onnx", storage="qdq", scales=scales).converted
    said = [r.args[0] for r in caplog.records if r.levelno == logging.INFO and r.args]
    assert any(Param("storage", "auto") in _parts(m) for m in said)


@pytest.mark.parametrize("name", ["gemma2", "qwen2_window"])
def test_a_window_layers_cache_left_float_refuses_unless_allow_partial(name, tmp_path):
    """A rolling-window export: the full layers' caches are Concat-written, the window layer's not."""
    source = storage.ROOT / "torch-tf5/dynamo-opset23-optimize-rollingcache" / name / "model.onnx"
    path = tmp_path / "s.json"
    KvCacheScales({0: 0.1, 1: 0.1}, {0: 0.1, 1: 0.1}, format="int8").save(path)
    with pytest.warns(NotConvertedWarning):
        result = convert_model(source, tmp_path / "q.onnx", storage="qdq", scales=path)
    assert not result.converted and not (tmp_path / "q.onnx").exists()
    assert result.refusals[0].code is RefusalCode.PARTIAL_CONVERSION
    assert Param("allow_partial", True) in _parts(result.refusals[0].text)
    result = convert_model(source, tmp_path / "q.onnx", storage="qdq", scales=path, allow_partial=True)
    assert result.converted


def _rotated_scales(path: str, fmt: str, rotation: str, file: pathlib.Path) -> pathlib.Path:
    """Scales measured on ``path``'s caches rotated by ``rotation`` (recording it), saved to ``file``."""
    model = storage.load(path)
    StoredCacheRotationPass(rotation)(model)
    storage.calibrate(model, fmt, "per_channel", get_format(fmt).qmax, rotation).save(file)
    return file


@pytest.mark.parametrize("path", [storage.STATIC[0], *storage.OWN_CACHE])
def test_scales_of_a_rotated_cache_rotate_it(path, tmp_path):
    """The rotation the scales record is placed before the caches are stored (the caches an ONNX
    Attention reads), and the converted file says so in its graph."""
    scales = _rotated_scales(path, "int4", "keys_and_values", tmp_path / "s.json")
    source = storage.ROOT / path / "model.onnx"
    result = convert_model(source, tmp_path / "q.onnx", storage="qdq", format="int4", scales=scales)
    assert result.converted and result.rotation == "keys_and_values"
    model = ir.external_data.load_to_model(ir.load(tmp_path / "q.onnx"))
    assert stored_rotation(model)[0].name == "keys_and_values"
    assert {c.past.dtype for c in find_qdq_caches(model.graph)} == {ir.DataType.INT4}
    want, _ = storage.run(storage.load(path))
    assert storage.kl_mean(want, storage.run(model)[0]) < 1e-2


@pytest.mark.parametrize("path", storage.MLA)
def test_a_rotation_no_attention_reads_is_refused(path, tmp_path):
    """MLA's latents are read by an up-projection, not an attention whose query turns with them."""
    model = storage.load(path)
    storage.calibrate(model, "int8", "per_tensor", 128.0, "keys").save(tmp_path / "s.json")
    with pytest.raises(KvCacheError) as raised:
        convert_model(
            storage.ROOT / path / "model.onnx", tmp_path / "q.onnx", storage="qdq", scales=tmp_path / "s.json"
        )
    assert Param("rotation", "none") in _parts(raised.value.args[0])
    assert not (tmp_path / "q.onnx").exists()


def test_a_rotated_model_keeps_its_rotation(tmp_path):
    path = storage.STATIC[0]
    scales = storage.calibrate(storage.load(path), "int8", "per_channel", 128.0, "keys")
    model = storage.load(path)
    StoredCacheRotationPass("keys")(model)
    with pytest.raises(KvCacheError):
        optimize_model(model, storage="qdq", scales=scales, rotation="keys_and_values")
    optimize_model(model, storage="qdq", scales=scales, strict=True)
    assert stored_rotation(model)[0].name == "keys"
    assert {c.past.dtype for c in find_qdq_caches(model.graph)} == {ir.DataType.INT8}


PLAIN = "torch-tf5/dynamo-opset23-optimize/llama"  # attention of plain operators: fuses under auto


@pytest.mark.parametrize(
    ("path", "recorded", "asked", "fixes", "not_named"),
    [
        # scales the kernel's rotation takes (calibrated on the fused export): rotation none, or auto
        (PLAIN, "keys_and_values", None, [Param("rotation", "none"), Param("storage", "auto")], []),
        (PLAIN, "keys_and_values", "none", [Param("rotation", "none"), Param("storage", "auto")], []),
        # a rotation the scales do not record: calibrate for it, or convert as they record
        (storage.STATIC[0], "none", "keys", [Param("rotation", "none"), Param("rotation", "keys")], []),
        # a rotation asked where none is placed: not "calibrate with keys" (calibrate refuses it too)
        (storage.MLA[0], "none", "keys", [Param("rotation", "none")], [Param("rotation", "keys")]),
    ],
)
def test_a_refused_rotation_names_only_fixes_that_work(path, recorded, asked, fixes, not_named, tmp_path):
    model = storage.load(path)
    storage.calibrate(model, "int8", "per_tensor", 128.0, recorded).save(tmp_path / "s.json")
    with pytest.raises(KvCacheError) as raised:
        convert_model(
            storage.ROOT / path / "model.onnx",
            tmp_path / "q.onnx",
            storage="qdq",
            scales=tmp_path / "s.json",
            rotation=asked,
        )
    named = _parts(raised.value.args[0])
    assert all(fix in named for fix in fixes) and not any(p in named for p in not_named)
    assert not (tmp_path / "q.onnx").exists()


def test_a_rotated_models_other_scales_name_its_own_rotation(tmp_path):
    """Not "convert with rotation R": a rotated model keeps its own."""
    path = storage.STATIC[0]
    model = storage.load(path)
    StoredCacheRotationPass("keys_and_values")(model)
    scales = storage.calibrate(storage.load(path), "int8", "per_tensor", 128.0, "keys")
    with pytest.raises(KvCacheError) as raised:
        optimize_model(model, storage="qdq", scales=scales)
    named = _parts(raised.value.args[0])
    assert Param("rotation", "keys_and_values") in named and Param("rotation", "keys") not in named


@pytest.mark.parametrize("path", [storage.STATIC[0], *storage.OWN_CACHE])
def test_a_stored_model_under_auto_is_refused_as_stored_not_as_unfused(path, tmp_path):
    """Not an attention fusion's explanation: the caches are stored already."""
    model = storage.load(path)
    scales = storage.calibrate(model, "int8", "per_tensor", 128.0)
    optimize_model(model, storage="qdq", scales=scales, strict=True)
    ir.save(model, tmp_path / "stored.onnx")
    with pytest.warns(NotConvertedWarning):
        result = convert_model(tmp_path / "stored.onnx", tmp_path / "q.onnx", format="int8", scales=scales)
    assert [r.code for r in result.refusals] == [RefusalCode.ALREADY_CONVERTED]
    assert not (tmp_path / "q.onnx").exists()
    before = ir.to_proto(model).SerializeToString()
    optimize_model(model, format="int8", scales=scales)  # nothing to do
    assert ir.to_proto(model).SerializeToString() == before


def test_a_stored_model_is_refused_as_stored_whatever_the_scales_rotation(tmp_path):
    path = storage.STATIC[0]
    model = storage.load(path)
    StoredCacheRotationPass("keys_and_values")(model)
    rotated = storage.calibrate(model, "int8", "per_channel", 128.0, "keys_and_values")
    optimize_model(model, storage="qdq", scales=rotated, strict=True)
    ir.save(model, tmp_path / "stored.onnx")
    other = storage.calibrate(storage.load(path), "int8", "per_channel", 128.0, "keys")
    with pytest.warns(NotConvertedWarning):
        result = convert_model(tmp_path / "stored.onnx", tmp_path / "q.onnx", storage="qdq", scales=other)
    assert [r.code for r in result.refusals] == [RefusalCode.ALREADY_CONVERTED]
