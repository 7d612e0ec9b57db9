"""Translation validation: an export and its fused model side by side on onnxruntime's CPU."""

from __future__ import annotations

import pathlib
import warnings

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, convert_model
from onnx_kvcache.cache.sites import find_gqa_sites
from onnx_kvcache.pipeline import _fusing, verification
from onnx_kvcache.pipeline.decision import fuse_unless_attention
from onnx_kvcache.pipeline.verification import verify_fusion

DATA = pathlib.Path(__file__).parents[1] / "data"
EXPORT = DATA / "export_llama_opset23.onnx"
SCALES = {layer: (0.05, 0.05) for layer in range(3)}


def _fused() -> tuple[ir.Model, ir.Model]:
    original = ir.load(EXPORT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the padding note
        fused = fuse_unless_attention(ir.load(EXPORT), verify=False).model
    return original, fused


def test_an_export_and_its_fusion_agree():
    original, fused = _fused()
    checked = verify_fusion(original, fused)
    assert checked.verified and checked.error < 1e-5
    assert checked.cases == ("one row", "a left-padded batch of 2")
    assert "fusion verified" in checked.line


def test_a_wrong_fusion_is_refused():
    original, fused = _fused()
    node = find_gqa_sites(fused)[0].node
    node.attributes["scale"] = ir.AttrFloat32("scale", 2 * node.attributes["scale"].as_float())
    checked = verify_fusion(original, fused)
    assert not checked.verified and "the fusion is wrong for this model" in checked.differs
    assert checked.line.startswith("fusion refused: the fused model's logits differ")


def test_what_is_not_verified_says_why(monkeypatch):
    original, fused = _fused()
    monkeypatch.setattr(verification, "MAX_BYTES", 0)
    skipped = verify_fusion(original, fused)
    assert not skipped.verified and "GiB of weights" in skipped.skipped and "not verified" in skipped.line
    assert verify_fusion(original, fused, forced=True).verified  # True: whatever the size


class _WrongFusion(_fusing.GqaFusionPass):
    """The fusion, then one layer's scale doubled: a fusion that computes otherwise."""

    def call(self, model):
        result = super().call(model)
        node = find_gqa_sites(model)[0].node
        node.attributes["scale"] = ir.AttrFloat32("scale", 2 * node.attributes["scale"].as_float())
        return result


def test_convert_refuses_a_wrong_fusion_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(_fusing, "GqaFusionPass", _WrongFusion)
    out = tmp_path / "int8.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        refused = convert_model(EXPORT, out, format="int8", scales=SCALES, ep="cpu", progress=False)
        assert not refused.converted and not out.exists()
        assert "the fusion is wrong" in " ".join(refused.reasons)
        with pytest.raises(KvCacheError, match="the fusion is wrong"):
            convert_model(
                EXPORT, out, format="int8", scales=SCALES, ep="cpu", strict=True, allow_partial=True
            )
        result = convert_model(
            EXPORT, out, format="int8", scales=SCALES, ep="cpu", verify=False, progress=False
        )
    assert result.converted and not any("fusion" in n for n in result.notes if "verified" in n)


def test_convert_says_it_verified(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = convert_model(
            EXPORT, tmp_path / "o.onnx", format="int8", scales=SCALES, ep="cpu", progress=False
        )
    assert [n for n in result.notes if n.startswith("fusion verified")] and result.verified is True


def test_an_export_that_quantizes_activations_over_the_batch_is_compared_on_one_row():
    """DynamicQuantizeLinear scales a whole tensor, padding rows included (which the fusion does
    not compute as the export does): the batch's valid rows move with them, so one row is compared."""
    from builders.exported import build_decoder, exported_config

    original = build_decoder(exported_config("optimum-llama-quantized", num_layers=2, vocab_size=300))
    assert any(n.op_type == "DynamicQuantizeLinear" for n in original.graph)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = fuse_unless_attention(original.clone(), verify=False).model
    checked = verify_fusion(original, fused)
    assert checked.verified and checked.cases == ("one row",) and checked.error < 1e-5


def _last_token_logits(model: ir.Model) -> ir.Model:
    """The export with logits for each call's last token alone (a common export)."""
    logits = next(o for o in model.graph.outputs if o.name == "logits")
    logits.name = "all_logits"
    starts, ends, axes = (
        ir.Value(name=n, const_value=ir.tensor(np.array(v, np.int64)))
        for n, v in (("last_start", [-1]), ("last_end", [2**62]), ("last_axis", [1]))
    )
    for value in (starts, ends, axes):
        model.graph.register_initializer(value)
    node = ir.node("Slice", [logits, starts, ends, axes], name="last_token")
    node.outputs[0].name = "logits"
    node.outputs[0].dtype = logits.dtype
    model.graph.append(node)
    index = list(model.graph.outputs).index(logits)
    model.graph.outputs[index] = node.outputs[0]
    return model


def test_an_export_with_the_last_tokens_logits_alone_is_verified():
    original = _last_token_logits(ir.load(EXPORT))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = fuse_unless_attention(original.clone(), verify=False).model
    checked = verify_fusion(original, fused)
    assert checked.verified and checked.error < 1e-5, checked.line


def test_verify_true_says_when_it_could_not(monkeypatch):
    from onnx_kvcache import optimize_model
    from onnx_kvcache.errors import FusionSkippedWarning

    model = ir.load(EXPORT)
    model.graph.inputs.append(ir.val("cache_position", ir.DataType.INT64, ["s"]))  # read by nothing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", FusionSkippedWarning)
        with pytest.warns(FusionSkippedWarning, match=r"an input it does not feed \(cache_position\)"):
            optimize_model(model, ep="cpu", format="int8", scales=SCALES, verify=True)


def test_the_command_refuses_a_wrong_fusion_with_exit_1(tmp_path, monkeypatch, capsys):
    import json

    from onnx_kvcache.cli.commands import main

    monkeypatch.setattr(_fusing, "GqaFusionPass", _WrongFusion)
    scales = tmp_path / "s.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.05] * 3, "v_scales": [0.05] * 3}, "qmax": 128}))
    out = tmp_path / "o.onnx"
    assert main(["convert", str(EXPORT), str(out), "--format", "int8", "--scales", str(scales)]) == 1
    assert "fusion refused" in capsys.readouterr().err and not out.exists()
