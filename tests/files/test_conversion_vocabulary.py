"""convert_model's vocabularies are enums that equal their old strings: placement, weights, refusals."""

from __future__ import annotations

import json
import pathlib
from contextlib import nullcontext

import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheWarning, convert_model
from onnx_kvcache.capabilities.refusals import RefusalCode
from onnx_kvcache.files.conversion import ConvertResult, Placement, Weights, WeightsMode
from onnx_kvcache.models.decoder import build_decoder

SCALES = {0: (0.05, 0.04), 1: (0.06, 0.05)}


def save(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    ir.save(
        build_decoder(num_layers=2, vocab_size=300),
        path,
        external_data="model.onnx.data",
        size_threshold_bytes=1024,
    )
    return path


@pytest.mark.parametrize(
    ("out", "weights", "placement", "outcome"),
    [
        ("in/model.int8.onnx", None, Placement.BESIDE, Weights.SHARED),
        ("out/model.onnx", None, Placement.ELSEWHERE, Weights.COPIED),
        ("out/model.onnx", "link", Placement.ELSEWHERE, Weights.LINKED),
        ("out/model.onnx", WeightsMode.COPY, Placement.ELSEWHERE, Weights.COPIED),
    ],
)
def test_the_result_says_placement_and_weights_as_enums_equal_to_their_strings(
    tmp_path, out, weights, placement, outcome
):
    src = save(tmp_path / "in")
    with pytest.warns(KvCacheWarning, match="hard links") if weights == "link" else nullcontext():
        result = convert_model(src, tmp_path / out, format="int8", scales=SCALES, ep="cpu", weights=weights)
    assert result.placement is placement and result.placement == placement.value
    got = (
        Weights.CLONED if result.weights is Weights.CLONED and outcome is Weights.COPIED else outcome
    )  # a CoW fs
    assert result.weights is got and result.weights == got.value and f"{result.weights}" == got.value
    assert json.dumps({"placement": result.placement}) == json.dumps({"placement": placement.value})


@pytest.mark.parametrize("weights", list(Weights))
def test_every_weights_outcome_has_a_summary(tmp_path, weights):
    result = ConvertResult(tmp_path, tmp_path / "m.onnx", 2, weights=weights, weight_bytes=2048)
    summary = result.weights_summary()
    assert summary.startswith("weights: ") and len({summary} | {weights.value}) == 2


def test_weights_share_is_not_a_mode_a_caller_asks_for(tmp_path):
    with pytest.raises(KvCacheError, match="weights must be 'copy' or 'link'"):
        convert_model(save(tmp_path / "in"), tmp_path / "out" / "m.onnx", weights="share")


def test_reasons_are_the_refusals_texts(tmp_path):
    src = save(tmp_path / "in")
    with pytest.warns(match="not converted to fp8"):
        result = convert_model(src, tmp_path / "out.onnx", format="fp8", ep="cpu")
    assert not result.converted and result.reasons == [r.text for r in result.refusals]
    assert [r.code for r in result.refusals] == [RefusalCode.FORMAT_UNSUPPORTED]
