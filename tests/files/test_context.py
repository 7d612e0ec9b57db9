"""Scales that know their context: a conversion with scales calibrated for ``rope_positions=N``
warns when the model serves more than N positions (files/_context.py)."""

from __future__ import annotations

import json
import pathlib
import shutil
import warnings

import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheScales, convert_model
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import ContextLengthWarning
from onnx_kvcache.files._context import model_context
from onnx_kvcache.model_io.genai_folder import resolve_model_path
from onnx_kvcache.models.decoder import build_decoder, save_genai_folder
from onnx_kvcache.scales.files import load_kv_cache_scale_file

EXPORT = pathlib.Path(__file__).parents[1] / "data" / "export_llama_opset23.onnx"


def scale_file(tmp_path: pathlib.Path, layers: int, rope_positions: int | None) -> pathlib.Path:
    metadata = {"method": "attention"} | ({"rope_positions": rope_positions} if rope_positions else {})
    scales = KvCacheScales(
        {i: [0.5] for i in range(layers)}, {i: [0.2] for i in range(layers)}, format="int4", metadata=metadata
    )
    path = tmp_path / f"scales-{rope_positions}.json"
    scales.save(path, overwrite=True)
    return path


def genai_folder(tmp_path: pathlib.Path) -> tuple[pathlib.Path, int]:
    return save_genai_folder(tmp_path / "genai", num_layers=2), 4096  # its context_length


def export_with_config(tmp_path: pathlib.Path) -> tuple[pathlib.Path, int]:
    folder = tmp_path / "export"
    folder.mkdir()
    shutil.copy(EXPORT, folder / "model.onnx")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    return folder / "model.onnx", 2048


def bare_model_file(tmp_path: pathlib.Path) -> tuple[pathlib.Path, int]:
    path = tmp_path / "model.onnx"
    ir.save(build_decoder(num_layers=2), path)
    return path, 4096  # the rows of its GroupQueryAttention's cos_cache


MODELS = {
    "genai_config.json's context_length": (genai_folder, 2),
    "config.json's max_position_embeddings": (export_with_config, 3),
    "the rows of its rotary table": (bare_model_file, 2),
}


def converted(model: pathlib.Path, out: pathlib.Path, scales: pathlib.Path) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = convert_model(model, out, scales=scales, ep="cpu", overwrite=True)
    assert result.converted
    return [w for w in caught if issubclass(w.category, ContextLengthWarning)]


@pytest.mark.parametrize("where", list(MODELS))
def test_scales_for_a_shorter_context_warn(tmp_path, where):
    make, layers = MODELS[where]
    model, context = make(tmp_path)
    file, config = resolve_model_path(model)
    assert model_context(ir.load(file), file.parent, config) == (context, where)
    short = converted(model, tmp_path / f"short{model.suffix}", scale_file(tmp_path, layers, context // 4))
    assert len(short) == 1
    text = str(short[0].message)
    assert f"up to {context // 4} positions (rope_positions={context // 4})" in text
    assert f"the model serves {context} ({where})" in text and f"rope_positions={context}." in text
    for enough in (context, 2 * context, None):  # as long as the context, longer, the whole table
        assert converted(model, tmp_path / f"ok{model.suffix}", scale_file(tmp_path, layers, enough)) == []


def test_an_export_that_states_no_context_is_said_to_state_none(tmp_path):
    """torch.onnx.export computes the rotary angles from the positions: no table, no config.
    Issue 37: once no warning, and nothing said that the context is unknown."""
    shutil.copy(EXPORT, tmp_path / "model.onnx")
    assert model_context(ir.load(tmp_path / "model.onnx"), tmp_path) is None
    said = converted(tmp_path / "model.onnx", tmp_path / "o.onnx", scale_file(tmp_path, 3, 16))
    assert len(said) == 1
    text = str(said[0].message)
    assert "up to 16 positions (rope_positions=16), and nothing states the model's context" in text
    assert converted(tmp_path / "model.onnx", tmp_path / "p.onnx", scale_file(tmp_path, 3, None)) == []


def test_a_config_that_does_not_parse_states_nothing(tmp_path):
    path, _ = bare_model_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert model_context(ir.load(path), tmp_path) == (4096, "the rows of its rotary table")


def test_the_scale_file_keeps_rope_positions(tmp_path):
    assert load_kv_cache_scale_file(scale_file(tmp_path, 2, 512)).metadata["rope_positions"] == 512
    assert "rope_positions" not in load_kv_cache_scale_file(scale_file(tmp_path, 2, None)).metadata
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"scales": {"k_scales": [0.1], "v_scales": [0.1]}, "rope_positions": "512"}))
    with pytest.raises(KvCacheError, match="'rope_positions' must be an integer >= 1, got '512'"):
        load_kv_cache_scale_file(bad)


def test_the_command_says_it_in_its_words(tmp_path, capsys):
    folder, _ = genai_folder(tmp_path)
    argv = ["convert", str(folder), str(tmp_path / "out"), "--scales", str(scale_file(tmp_path, 2, 512))]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "onnx-kvcache: warning: The KV-cache scales were calibrated for contexts of up to 512 positions "
        "(--rope-positions 512), but the model serves 4096 (genai_config.json's context_length): keys past "
        "position 512 are clipped more, a loss that grows with the position (docs/calibration.md). "
        "Calibrate without --rope-positions (the whole rotary table) or with --rope-positions 4096."
    ]
