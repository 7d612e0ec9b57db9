"""Rotated caches through calibration, conversion, requantization, inspection and the command.

The scales say which cache they were measured on (``rotation`` in their metadata): conversion
rotates alike, refuses scales of another rotation, and a rotated model keeps its rotation.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import (
    KvCacheRunner,
    calibrate_kv_cache,
    convert_model,
    inspect_kv_cache,
    load_model,
    optimize_model,
)
from onnx_kvcache.cache.layout import format_cache_table
from onnx_kvcache.cache.rotation import MATRICES, rotation_matrix, site_matrix
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.capabilities.refusals import RefusalCode
from onnx_kvcache.capabilities.table import check_kv_cache_support
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import (
    Float16AttentionWarning,
    KvCacheError,
    NotConvertedWarning,
    ScalesAdjustedWarning,
)
from onnx_kvcache.model_io.reading import tensor_values
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.passes.kv_cache_rotation import KvCacheRotationPass
from onnx_kvcache.scales.files import KvCacheScales, load_kv_cache_scale_file

from conftest import demo_decoder

DATA = [[(11 * i + 5 * j) % 256 for j in range(96)] for i in range(4)]
PROMPT = list(range(40, 52))


def _calibrated(model, fmt="int4", granularity="per_channel", **kwargs) -> KvCacheScales:
    return calibrate_kv_cache(model, DATA, format=fmt, granularity=granularity, progress=False, **kwargs)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rotation") / "model.onnx"
    ir.save(build_decoder(num_layers=2), path)
    return path


@pytest.mark.parametrize(("fmt", "want"), [("int4", "keys_and_values"), ("int8", "none"), ("fp8", "none")])
def test_calibration_records_the_formats_default_rotation(model_file, fmt, want):
    assert _calibrated(model_file, fmt).metadata["rotation"] == want


#: Head sizes: a power of two, Hadamard matrices of Paley I 12 and 20 and Paley II 28 times a
#: power of two, and partial rotary (RoPE on 32 of 80 channels)
HEADS = {"32": (32, None), "48": (48, None), "80": (80, None), "96": (96, None), "112": (112, None)}
HEADS["80-rotary32"] = (80, 32)


@pytest.fixture(scope="module", params=sorted(HEADS))
def sized_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"head{request.param}") / "model.onnx"
    ir.save(demo_decoder(*HEADS[request.param]), path)
    return path


def _stepwise(runner: KvCacheRunner) -> np.ndarray:
    """The logits of PROMPT a token a call (the quantized kernel's path)."""
    return np.concatenate([runner.prefill(PROMPT[:1])[0], *(runner.step(t) for t in PROMPT[1:])])


def _int4_errors(path, granularity: str) -> dict[str, float]:
    """Mean |logit difference| from the float model of its int4 (minmax) cache, unrotated and
    rotated."""
    want = _stepwise(KvCacheRunner(path))
    errors = {}
    for rotation in ("none", "keys_and_values"):
        model = load_model(path)
        scales = _calibrated(path, "int4", granularity, rotation=rotation, method="minmax")
        optimize_model(model, ep="cpu", scales=scales)
        layers = inspect_kv_cache(model).layers
        assert {(layer.rotation, layer.rotation_matrix) for layer in layers} == {
            (rotation, "hadamard" if rotation != "none" else None)
        }
        errors[rotation] = float(np.abs(_stepwise(KvCacheRunner(model)) - want).mean())
    return errors


def test_a_rotated_int4_cache_is_closer_to_the_float_model_than_an_unrotated_one(model_file):
    """The test decoder's keys carry a few large channels (as trained models' do): spread, they
    cost int4 less."""
    errors = _int4_errors(model_file, "per_channel")
    assert errors["keys_and_values"] < errors["none"], errors


def test_every_head_size_rotated_has_a_closer_int4_cache_of_one_scale(sized_file):
    """One scale a cache must cover the outlier channels; spread by H (a Hadamard matrix at 48,
    80, 96, 112; RoPE on part of the head or all of it), they cost int4 far less (about 1.1 to
    0.7 here; per channel the two are within noise of each other on these seeded models)."""
    errors = _int4_errors(sized_file, "per_tensor")
    assert errors["keys_and_values"] < 0.8 * errors["none"], errors


def _unrecorded(scales: KvCacheScales, path):
    """``scales`` as a file calibration wrote before it recorded the matrix."""
    doc = scales.to_json()
    del doc["rotation_matrix"]
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def head48_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("head48") / "model.onnx"
    ir.save(demo_decoder(48), path)
    return path


def _h(path, size: int) -> np.ndarray:
    """The H constant a rotated model file holds."""
    return tensor_values(load_model(path).graph.initializers[f"kv_cache_rotation_{size}"].const_value)


def test_scales_from_before_the_matrix_record_rotate_by_the_old_h(head48_file, tmp_path):
    """A scale file that records a rotation but no matrix was measured with walsh_dct: converting
    with it rotates by walsh_dct (the scales are right for it); a new file records hadamard."""
    scales = _calibrated(head48_file)
    scales.save(tmp_path / "new.json")
    assert json.loads((tmp_path / "new.json").read_text())["rotation_matrix"] == "hadamard"
    old = load_kv_cache_scale_file(_unrecorded(scales, tmp_path / "old.json"))
    assert (old.metadata["rotation_matrix"], old.rotation_matrix) == ("walsh_dct", MATRICES["walsh_dct"])
    want = KvCacheRunner(head48_file).prefill(PROMPT)
    for name, matrix, words in (
        ("new", "hadamard", "Hadamard 48x48: Walsh-Hadamard 4x4 x Paley I 12x12 (q = 11)"),
        ("old", "walsh_dct", "Walsh-Hadamard 16x16 x DCT-II 3x3"),
    ):
        convert_model(head48_file, tmp_path / f"{name}.onnx", scales=tmp_path / f"{name}.json")
        info = inspect_kv_cache(tmp_path / f"{name}.onnx")
        turned = {(layer.rotation, layer.rotation_matrix) for layer in info.layers}
        assert turned == {("keys_and_values", matrix)}
        assert f"turned by H ({words}, after RoPE" in format_cache_table(info)
        got = KvCacheRunner(tmp_path / f"{name}.onnx").prefill(PROMPT)
        assert float(np.abs(got - want).mean()) < 0.05


def test_a_model_rotated_by_the_old_h_keeps_it_and_takes_only_scales_measured_with_it(head48_file, tmp_path):
    """Requantizing a walsh_dct-rotated model keeps its H; scales measured with hadamard are
    refused for it, before anything is written; scales measured with walsh_dct are taken."""
    old4 = _unrecorded(_calibrated(head48_file), tmp_path / "s.json")
    convert_model(head48_file, tmp_path / "int4.onnx", scales=old4)
    with pytest.warns(ScalesAdjustedWarning):
        convert_model(tmp_path / "int4.onnx", tmp_path / "int8.onnx", format="int8")
    for name in ("int4", "int8"):
        model = load_model(tmp_path / f"{name}.onnx")
        assert {site_matrix(s) for s in find_attention_sites(model)} == {MATRICES["walsh_dct"]}
    np.testing.assert_array_equal(
        _h(tmp_path / "int8.onnx", 48), rotation_matrix(48, "walsh_dct").astype(np.float32)
    )
    new = _calibrated(head48_file, "int8", rotation="keys_and_values")
    with pytest.raises(KvCacheError, match=r"turned by H = hadamard .*cache is turned by walsh_dct"):
        convert_model(tmp_path / "int4.onnx", tmp_path / "refused.onnx", format="int8", scales=new)
    assert not (tmp_path / "refused.onnx").exists()
    old = load_kv_cache_scale_file(_unrecorded(new, tmp_path / "old8.json"))
    assert convert_model(tmp_path / "int4.onnx", tmp_path / "int8b.onnx", format="int8", scales=old).converted
    convert_model(head48_file, tmp_path / "new4.onnx", scales=_calibrated(head48_file))  # hadamard
    with pytest.raises(KvCacheError, match=r"turned by H = walsh_dct .*cache is turned by hadamard"):
        convert_model(tmp_path / "new4.onnx", tmp_path / "refused.onnx", format="int8", scales=old)
    assert convert_model(tmp_path / "new4.onnx", tmp_path / "int8c.onnx", format="int8", scales=new).converted


def test_a_power_of_two_model_takes_scales_of_either_record(model_file, tmp_path):
    """At a power of two both matrices are one: old and new files convert alike, and a model
    rotated by either takes either."""
    scales = _calibrated(model_file, "int8", rotation="keys_and_values")
    convert_model(model_file, tmp_path / "old.onnx", scales=_unrecorded(scales, tmp_path / "old.json"))
    convert_model(model_file, tmp_path / "new.onnx", scales=scales)
    np.testing.assert_array_equal(_h(tmp_path / "old.onnx", 32), _h(tmp_path / "new.onnx", 32))
    again = convert_model(tmp_path / "old.onnx", tmp_path / "again.onnx", format="int8", scales=scales)
    assert again.converted


def test_a_scale_files_matrix_record_is_checked(tmp_path):
    scales = KvCacheScales({0: 0.1}, {0: 0.1}, format="int8", metadata={"rotation": "keys"})
    assert scales.rotation_matrix is MATRICES["hadamard"]  # made now: the default
    assert scales.to_json()["rotation_matrix"] == "hadamard"
    assert KvCacheScales({0: 0.1}, {0: 0.1}, format="int8").rotation_matrix is None
    doc = scales.to_json() | {"rotation_matrix": "random"}
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(KvCacheError):
        load_kv_cache_scale_file(tmp_path / "bad.json")


def test_conversion_follows_the_scales_and_the_file_keeps_the_record(model_file, tmp_path):
    scales = _calibrated(model_file, rotation="keys")
    scales.save(tmp_path / "scales.json")
    assert load_kv_cache_scale_file(tmp_path / "scales.json").metadata["rotation"] == "keys"
    result = convert_model(model_file, tmp_path / "out.onnx", scales=tmp_path / "scales.json")
    assert result.rotation == "keys"
    table = format_cache_table(inspect_kv_cache(tmp_path / "out.onnx"))
    assert "rotated cache: the query and the key turned by H (normalized Walsh-Hadamard 32x32" in table


def test_scales_of_another_rotation_are_refused_before_any_work(model_file, tmp_path):
    scales = _calibrated(model_file)  # keys_and_values
    with pytest.raises(KvCacheError, match="calibrated for rotation keys_and_values; keys was asked"):
        convert_model(model_file, tmp_path / "a.onnx", scales=scales, rotation="keys")
    genai_style = KvCacheScales(scales.k, scales.v, format="int4", granularity="per_channel")  # no record
    with pytest.raises(KvCacheError, match="calibrated for rotation none; keys_and_values was asked"):
        convert_model(model_file, tmp_path / "b.onnx", scales=genai_style, rotation="keys_and_values")
    assert not list(tmp_path.iterdir())


def test_requantizing_a_rotated_cache_keeps_its_rotation(model_file, tmp_path):
    convert_model(model_file, tmp_path / "int4.onnx", scales=_calibrated(model_file))
    # int4's mse thresholds kept as int8's: the advice names the original model and its rotation
    with pytest.warns(
        ScalesAdjustedWarning, match=r"Calibrate the original model for int8: .*rotation='keys_and_values'"
    ):
        result = convert_model(tmp_path / "int4.onnx", tmp_path / "int8.onnx", format="int8")
    assert result.rotation == "keys_and_values"
    requantized = load_model(tmp_path / "int8.onnx")
    assert {(layer.rotation, layer.bit_width) for layer in inspect_kv_cache(requantized).layers} == {
        ("keys_and_values", 8)
    }
    assert sum(n.op_type == "RotaryEmbedding" for n in requantized.graph) == 2  # rotated once
    with pytest.raises(KvCacheError, match=r"already rotated \(keys_and_values\): requantizing keeps it"):
        convert_model(tmp_path / "int4.onnx", tmp_path / "c.onnx", format="int8", rotation="none")
    with pytest.raises(
        KvCacheError, match=r"cache is rotated \(keys_and_values\)\. Calibrate the original model with"
    ):
        int8 = _calibrated(model_file, "int8")
        convert_model(tmp_path / "int4.onnx", tmp_path / "d.onnx", format="int8", scales=int8)
    rotated = load_model(model_file)
    KvCacheRotationPass()(rotated)
    with pytest.raises(
        KvCacheError, match="Calibrate the original model: this one's cache is already rotated"
    ):
        _calibrated(rotated)


def test_paged_attention_takes_no_rotation():
    model = build_decoder(num_layers=2, paged=True, dtype="float16")
    assert calibrate_kv_cache(model, DATA, format="int4", progress=False).metadata["rotation"] == "none"
    with pytest.raises(KvCacheError, match="rotation='keys' is for GroupQueryAttention caches"):
        calibrate_kv_cache(model, DATA, format="int4", rotation="keys", progress=False)
    report = check_kv_cache_support(model, "cuda", "int8", rotation="keys")
    assert RefusalCode.ROTATION_UNSUPPORTED in [r.code for r in report.refusals]
    with pytest.raises(Exception, match="proven for GroupQueryAttention only"):
        KvCacheRotationPass()(model)


def test_a_paged_model_asked_to_rotate_is_told_so_before_its_scales_are_compared(tmp_path):
    """Unrotated scales and ``rotation='keys'`` on a PagedAttention model: the refusal names the
    PagedAttention caches, not "calibrate with rotation='keys'" (which calibrate refuses)."""
    model = build_decoder(num_layers=2, paged=True, dtype="float16")
    ir.save(model, tmp_path / "model.onnx")
    scales = calibrate_kv_cache(model, DATA, format="int4", progress=False)
    with pytest.raises(KvCacheError, match="has PagedAttention caches") as info:
        convert_model(tmp_path / "model.onnx", tmp_path / "o.onnx", scales=scales, rotation="keys", ep="cuda")
    assert "Calibrate with" not in str(info.value)
    assert not (tmp_path / "o.onnx").exists()


def test_the_rotation_moves_q_k_norms_out_of_the_node_so_the_cpu_runs_them():
    model = build_decoder(num_layers=1, qk_norm=True)
    assert [r.code for r in check_kv_cache_support(model, "cpu", "int8").refusals] == [
        RefusalCode.QK_NORM_UNSUPPORTED
    ]
    assert check_kv_cache_support(model, "cpu", "int8", rotation="keys").supported


def test_the_command_calibrates_and_converts_rotated(model_file, tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(DATA))
    scales = tmp_path / "s.json"
    argv = ["calibrate", str(model_file), "--out", str(scales), "--token-ids", str(ids), "--format", "int8"]
    assert main([*argv, "--rotation", "keys", "--min-tokens", "0"]) == 0
    assert "method minmax, rotation keys)" in capsys.readouterr().out
    assert main(["convert", str(model_file), str(tmp_path / "o.onnx"), "--scales", str(scales)]) == 0
    assert "to int8 per_tensor, rotated (keys) for cpu" in capsys.readouterr().out
    bad = [
        "convert",
        str(model_file),
        str(tmp_path / "p.onnx"),
        "--scales",
        str(scales),
        "--rotation",
        "none",
    ]
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert "calibrated for rotation keys; none was asked" in err and "--rotation keys" in err


def test_a_float32_model_for_cuda_keeps_its_rotation_around_float16_attention(model_file):
    """Float16AttentionPass casts the node's inputs: the rotation is still read through them."""
    with pytest.warns(Float16AttentionWarning):
        model = optimize_model(load_model(model_file), ep="cuda", scales=_calibrated(model_file))
    assert {layer.rotation for layer in inspect_kv_cache(model).layers} == {"keys_and_values"}
    runner = KvCacheRunner(model)
    assert runner.kernel_rule == "cuda (emulated on CPU)"
    want = KvCacheRunner(model_file).prefill(PROMPT)
    assert float(np.abs(runner.prefill(PROMPT) - want).mean()) < 0.05


@pytest.mark.parametrize("rotation", ["none", "keys"])
def test_another_rotation_for_a_rotated_model_says_convert_the_original(model_file, tmp_path, rotation):
    """Issue 45 row 6: asked for another rotation, a rotated int4 model gets the real reason
    (not "nothing to convert"); asked for nothing new, the result describes the model."""
    convert_model(model_file, tmp_path / "int4.onnx", scales=_calibrated(model_file))
    with pytest.raises(
        KvCacheError, match=rf"already rotated \(keys_and_values\).*original model for rotation='{rotation}'"
    ):
        convert_model(tmp_path / "int4.onnx", tmp_path / "out.onnx", rotation=rotation)
    code = main(["convert", str(tmp_path / "int4.onnx"), str(tmp_path / "out.onnx"), "--rotation", rotation])
    assert code == 2 and not (tmp_path / "out.onnx").exists()
    with pytest.warns(NotConvertedWarning, match="nothing to convert"):
        same = convert_model(tmp_path / "int4.onnx", tmp_path / "out.onnx", format="int4")
    assert not same.converted
    assert (same.format, same.granularity, same.rotation) == ("int4", "per_channel", "keys_and_values")
    assert "nothing to convert" in str(same.reasons)


def test_inspect_says_a_rotated_float_cache_has_no_scales(model_file):
    """Issue 45 row 9."""
    model = load_model(model_file)
    KvCacheRotationPass("keys_and_values")(model)
    table = format_cache_table(inspect_kv_cache(model))
    assert "in layer(s) 0-1; a float cache, no scales: unquantized" in table
    assert "scales are for the turned values" not in table
