"""The demo decoder's exported mode: graphs shaped like torch.onnx.export's, built without torch."""

from __future__ import annotations

import collections
import pathlib

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.models.decoder import DecoderConfig
from onnx_kvcache.models.decoder import build_decoder as library_build_decoder

from builders.exported import EXPORT_PRESETS, ExportedConfig, ExportStyle, build_decoder, exported_config

FIXTURE = pathlib.Path(__file__).parents[1] / "data" / "export_llama_opset23.onnx"


def signature(values) -> list[tuple]:
    return [(v.name, v.dtype, str(v.shape)) for v in values]


def test_llama_preset_is_written_as_the_torch_export_is():
    """Same interface and the same operators, op for op, as the real export's."""
    export = ir.load(FIXTURE)
    model = build_decoder(exported_config("llama", num_layers=3, vocab_size=512, intermediate_size=256))
    assert signature(model.graph.inputs) == signature(export.graph.inputs)
    assert signature(model.graph.outputs) == signature(export.graph.outputs)
    ops = collections.Counter((n.domain, n.op_type) for n in model.graph)
    assert ops == collections.Counter((n.domain, n.op_type) for n in export.graph)
    for node, want in zip(
        (n for n in model.graph if n.op_type == "Attention"),
        (n for n in export.graph if n.op_type == "Attention"),
    ):
        for name in ("is_causal", "scale"):
            assert node.attributes[name].value == pytest.approx(want.attributes[name].value)


@pytest.mark.parametrize("arch", sorted(EXPORT_PRESETS))
def test_presets_run_on_cpu(arch):
    model = build_decoder(exported_config(arch, num_layers=2, vocab_size=300))
    assert not any(n.op_type == "GroupQueryAttention" for n in model.graph)
    session = create_session(model)
    ids = np.arange(5)[None]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": ids}
    for v in model.graph.inputs[3:]:
        feeds[v.name] = np.zeros((1, 2, 0, 32), np.float32)
    logits, *presents = session.run(None, feeds)
    assert logits.shape == (1, 5, 300) and np.all(np.isfinite(logits))
    assert all(p.shape == (1, 2, 5, 32) for p in presents)


def test_qwen3_normalizes_q_and_k_before_rotary():
    model = build_decoder(exported_config("qwen3", num_layers=1))
    norms = [n for n in model.graph if n.op_type == "RMSNormalization" and "_norm" in n.inputs[1].name]
    assert sorted(n.inputs[1].name for n in norms) == [
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ]
    for norm in norms:  # RMSNormalization -> Transpose -> RotaryEmbedding
        ((transpose, _),) = norm.outputs[0].uses()
        assert [u.op_type for u, _ in transpose.outputs[0].uses()] == ["RotaryEmbedding"]


def test_bfloat16_builds_structurally():
    model = build_decoder(exported_config("gemma2", num_layers=2, dtype="bfloat16"))
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    weight = model.graph.initializers["model.layers.0.self_attn.q_proj.weight"].const_value
    assert weight.dtype == ir.DataType.BFLOAT16 and weight.numpy().dtype == ml_dtypes.bfloat16
    assert {v.dtype for v in model.graph.inputs[3:]} == {ir.DataType.BFLOAT16}


def test_exported_mode_is_a_config_field_of_the_tests_builders_only():
    """The library's DecoderConfig knows no exporter: the imitations are test scaffolding."""
    assert not hasattr(DecoderConfig(), "exported") and ExportedConfig().exported == ExportStyle()
    assert not [n for n in library_build_decoder(num_layers=1).graph if n.op_type == "Attention"]
    model = build_decoder(num_layers=1, exported=ExportStyle(kv_repeat="grouped"))
    attention = next(n for n in model.graph if n.op_type == "Attention")
    assert attention.inputs[1].name == "present.0.key"  # K/V go in with their own heads
    with pytest.raises(ValueError, match="Unknown architecture"):
        exported_config("gpt2")
    with pytest.raises(ValueError, match="does not write sliding_window_cache"):
        build_decoder(exported_config("mistral", sliding_window_cache=True))
    with pytest.raises(ValueError, match="opset 20 writes scaled dot-product attention"):
        build_decoder(exported_config("gemma2", exported=ExportStyle(opset=20, attn_softcap=50.0)))
