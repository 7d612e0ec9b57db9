"""Nothing half-done: a fusion that refuses leaves the model byte for byte as it found it.

Each refusal kind of test_refusal_kinds.py, given on every layer of its producer's file (so the
pass fuses nothing), then :class:`GqaFusionPass`: the serialized model before and after are the
same bytes. And a pass that must raise (a rolling window cache whose length a position reads)
raises before it changes anything.
"""

from __future__ import annotations

import warnings

import onnx_ir as ir
import pytest
import surgery
from test_refusal_kinds import CASES

from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.passes.fusion._base import FusionRefusalCode
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass

from builders.exported import ExportStyle, build_decoder, exported_config


def _bytes(model: ir.Model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString(deterministic=True)


def _layers(model: ir.Model) -> int:
    return sum(1 for v in model.graph.outputs if v.name.startswith("present") and v.name.endswith("key"))


@pytest.mark.parametrize("kind", sorted(CASES, key=lambda k: k.value), ids=lambda k: k.value)
def test_a_refused_pass_leaves_the_file_as_it_was(kind):
    path, change = CASES[kind]
    model = surgery.load(path)
    for layer in range(_layers(model)):
        change(model, layer)
    before = _bytes(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = GqaFusionPass()(model)
    assert result.report.fused == 0 and not result.modified
    assert any(r.code is kind for r in result.report.refusals), [
        (r.code, r.text) for r in result.report.refusals
    ]
    assert _bytes(model) == before


def test_a_copy_of_a_past_input_is_put_back_when_nothing_fuses():
    """TorchScript's ``Concat([past_key_values.0.key])`` is read as the input while proving, and is
    there again when every layer is refused."""
    model = surgery.load("torch-tf4.57/torchscript-opset18/llama")
    copies = [n for n in model.graph if n.op_type == "Concat" and len(n.inputs) == 1]
    assert copies, "the file's layer 0 reads its past through a one-input Concat"
    for node in model.graph:
        if node.op_type == "Softmax":
            surgery.insert_after(model, node.outputs[0], "Mish", name=f"{node.name}/Mish")
    before = _bytes(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = GqaFusionPass()(model).report
    assert report.fused == 0 and report.refusals
    assert all(r.code is FusionRefusalCode.UNKNOWN_ATTENTION for r in report.refusals)
    assert _bytes(model) == before


def test_a_window_past_read_by_a_position_is_refused_before_anything_changes():
    """A rolling window cache the fusion would make window-sized, whose length another node reads:
    the pass raises, and the model is as it was (it once raised after the rewrite)."""
    config = exported_config(
        "mistral",
        num_layers=2,
        vocab_size=300,
        sliding_window=4,
        exported=ExportStyle(window_cache="cropped"),
    )
    model = build_decoder(config)
    past = next(v for v in model.graph.inputs if v.name == "past_key_values.0.key")
    length = ir.node("Shape", [past], {"start": 2, "end": 3}, name="/position/past_length")
    length.outputs[0].name = "past_length"
    model.graph.append(length)
    model.graph.outputs.append(length.outputs[0])
    before = _bytes(model)
    with (
        warnings.catch_warnings(),
        pytest.raises(KvCacheError, match=r"reads the length of past_key_values\.0"),
    ):
        warnings.simplefilter("ignore")
        GqaFusionPass()(model)
    assert _bytes(model) == before


def test_a_mixed_rolling_export_nothing_fuses_keeps_its_declared_shapes():
    """The window caches' pasts of an export mixing rolling and full-length caches are declared
    apart while proving (cache.rolling.split_window_lengths); when every layer is refused the
    model is as it was, its one declared past length and the exporter's shapes too."""
    model = surgery.load("torch-tf5/dynamo-opset23-optimize-rollingcache/gemma2")
    for node in list(model.graph):
        if node.op_type == "Softmax":
            surgery.insert_after(model, node.outputs[0], "Mish", name=f"{node.name}/Mish")
    before = _bytes(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = GqaFusionPass()(model)
    assert result.report.fused == 0 and len(result.report.refusals) == 2 and not result.modified
    assert _bytes(model) == before
