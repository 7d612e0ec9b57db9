"""The quantization passes on a model whose attention is not GroupQueryAttention yet (an export).

They convert GroupQueryAttention and PagedAttention only; on an export they change nothing and
say so with an ``UnfusedAttentionWarning`` naming the fusion pass and ``optimize_model``, instead
of returning ``modified=False`` in silence.
"""

from __future__ import annotations

import pathlib
import warnings

import onnx_ir as ir
import pytest

from onnx_kvcache import Fp8KvCachePass, GqaFusionPass, KvCacheQuantizationPass, KvCacheWarning
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.errors import UnfusedAttentionWarning
from onnx_kvcache.passes.fusion.gqa_fusion import FUSIONS, fusion_candidates

from builders.exported import build_decoder, build_exported_decoder, exported_config

DATA = pathlib.Path(__file__).parents[1] / "data"
EXPORTS = {  # name -> (the model, its attention layers)
    "torch_opset23": (lambda: ir.load(DATA / "export_llama_opset23.onnx"), 3),
    "optimum": (lambda: ir.load(DATA / "optimum_llama" / "model.onnx"), 3),
    # mobius's default build: ONNX Attention holding its own cache (issue 37, row 7: no warning)
    "mobius_default": (lambda: ir.load(DATA / "mobius_llama_default" / "model.onnx"), 2),
}
PASSES = {
    "fp8": lambda layers: Fp8KvCachePass(),
    "int8": lambda layers: KvCacheQuantizationPass(
        "int8", "per_tensor", {i: (0.1, 0.1) for i in range(layers)}
    ),
}


@pytest.mark.parametrize("export", EXPORTS)
@pytest.mark.parametrize("make", PASSES)
def test_an_export_is_left_as_it_is_with_a_warning_naming_the_fusion(export, make):
    load, layers = EXPORTS[export]
    model, quantize = load(), PASSES[make](layers)
    with pytest.warns(UnfusedAttentionWarning) as said:
        assert quantize(model).modified is False
    assert len(said) == 1
    text = str(said[0].message)
    assert type(quantize).__name__ in text
    assert "GqaFusionPass" in text and "optimize_model" in text and f"{layers} attention node(s)" in text
    assert not find_attention_sites(
        model, with_cache_only=False
    )  # nothing was fused behind the caller's back


@pytest.mark.parametrize("export", EXPORTS)
def test_fused_first_it_converts_and_says_nothing_of_fusion(export):
    load, layers = EXPORTS[export]
    model = load()
    GqaFusionPass()(model)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert KvCacheQuantizationPass("int8", "per_tensor", {i: (0.1, 0.1) for i in range(layers)})(
            model
        ).modified
    assert not [w for w in said if issubclass(w.category, UnfusedAttentionWarning)]
    assert {s.cache_format.name for s in find_attention_sites(model)} == {"int8"}


@pytest.mark.parametrize("export", EXPORTS)
def test_the_warning_and_the_fusion_read_one_list_of_candidates(export):
    """fusion_candidates is every node one of GqaFusionPass's fusions (FUSIONS) would try."""
    model = EXPORTS[export][0]()
    found = fusion_candidates(model)
    assert found and {id(n) for n in found} == {
        id(n) for n in model.graph if any(fusion().is_candidate(n) for fusion in FUSIONS)
    }


def test_an_exported_decoder_built_here_warns_too():
    model = build_exported_decoder(exported_config(num_layers=2))
    with pytest.warns(UnfusedAttentionWarning, match="2 attention node"):
        Fp8KvCachePass()(model)


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: build_decoder(num_layers=2), id="gqa"),
        pytest.param(
            lambda: ir.Model(ir.Graph([], [], nodes=[], opset_imports={"": 21}), ir_version=10), id="empty"
        ),
    ],
)
def test_no_unfused_warning_without_unfused_attention(model):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        Fp8KvCachePass()(model())
    assert not [w for w in said if issubclass(w.category, UnfusedAttentionWarning)]
    assert all(issubclass(w.category, KvCacheWarning) for w in said)
