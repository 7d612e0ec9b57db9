"""Models and scale files the command tests share."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest

from onnx_kvcache.models.decoder import build_decoder


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.onnx"
    ir.save(build_decoder(num_layers=2), path)
    return path


def scale_file(tmp_path, layers=2):
    path = tmp_path / "scales.json"
    path.write_text(
        json.dumps({"scales": {"k_scales": [0.1] * layers, "v_scales": [0.05] * layers}, "qmax": 128})
    )
    return path


@pytest.fixture
def fp16_model_file(tmp_path):
    path = tmp_path / "model16.onnx"
    ir.save(build_decoder(num_layers=2, dtype="float16"), path)
    return path
