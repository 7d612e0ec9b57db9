"""preview_conversion: convert's decision for an export, taken on a copy fused in memory."""

from __future__ import annotations

import pathlib

import onnx_ir as ir
import pytest

from onnx_kvcache import convert_model
from onnx_kvcache.pipeline.preview import preview_conversion

from builders.exported import build_decoder, exported_config

DATA = pathlib.Path(__file__).parents[1] / "data"
EXPORTS = {
    "torch_opset23": DATA / "export_llama_opset23.onnx",
    "optimum": DATA / "optimum_llama" / "model.onnx",
}


@pytest.mark.parametrize(
    ("ep", "target", "fmt", "after", "half"),
    [
        (None, "cpu", "int8", 384, False),
        ("cuda", "cuda", "fp8", 384, True),
        ("cpu", "cpu", "int8", 384, False),
    ],
)
@pytest.mark.parametrize("export", EXPORTS)
def test_an_export_is_previewed_on_a_fused_copy(export, ep, target, fmt, after, half):
    model = ir.load(EXPORTS[export])
    text = ir.to_onnx_text(model)
    preview = preview_conversion(model, ep)
    assert ir.to_onnx_text(model) == text  # the model given is as it was
    assert preview.fused == 3 and len(preview.cache.layers) == 3
    assert preview.cache.bytes_per_token == 3 * 2 * 2 * 32 * 4  # 3 layers, K and V, 2 heads x 32, float32
    assert (preview.target, preview.format, preview.bytes_per_token_after) == (target, fmt, after)
    assert preview.float16_attention is half and preview.refusal is None


def test_the_preview_is_what_convert_does(tmp_path):
    preview = preview_conversion(ir.load(EXPORTS["torch_opset23"]), "cuda")
    with pytest.warns(Warning):
        result = convert_model(EXPORTS["torch_opset23"], tmp_path / "o.onnx", ep="cuda")
    assert (result.target, result.format, result.granularity) == (
        preview.target,
        preview.format,
        preview.granularity,
    )
    from onnx_kvcache import inspect_kv_cache

    assert inspect_kv_cache(ir.load(tmp_path / "o.onnx")).bytes_per_token == preview.bytes_per_token_after


def test_a_refusal_is_previewed_as_convert_says_it():
    model = build_decoder(exported_config("llama", num_layers=2))
    preview = preview_conversion(model, "dml")
    assert preview.bytes_per_token_after is None and preview.fused == 2
    assert str(preview.refusal).startswith("KV cache not converted to fp8 per_tensor for dml: ")
    assert preview.to_json()["refused"] == str(preview.refusal)


def test_attention_that_does_not_fuse_is_the_refusal():
    model = ir.load(EXPORTS["torch_opset23"])
    for node in model.graph:
        if node.op_type == "Attention":
            node.attributes["scale"] = ir.AttrFloat32("scale", float("nan"))  # no proof holds
    preview = preview_conversion(model)
    assert preview.fused == 0 and preview.bytes_per_token_after is None
    assert not preview.cache.layers  # a float export's own caches: inspect_kv_cache(exported=True)
    assert preview.storage is not None and preview.storage.format == "int8"
    assert "attention fusion fused nothing" in str(preview.refusal)
