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

from onnx_kvcache import (
    Fp8KvCachePass,
    GqaFusionPass,
    KvCacheQuantizationPass,
    KvCacheWarning,
    UnfusedAttentionWarning,
    build_decoder,
)
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.models.exported import build_exported_decoder, exported_config

DATA = pathlib.Path(__file__).parents[1] / "data"
EXPORTS = {
    "torch_opset23": lambda: ir.load(DATA / "export_llama_opset23.onnx"),
    "optimum": lambda: ir.load(DATA / "optimum_llama" / "model.onnx"),
}
PASSES = {
    "fp8": lambda: Fp8KvCachePass(),
    "int8": lambda: KvCacheQuantizationPass("int8", "per_tensor", {i: (0.1, 0.1) for i in range(3)}),
}


@pytest.mark.parametrize("export", EXPORTS)
@pytest.mark.parametrize("make", PASSES)
def test_an_export_is_left_as_it_is_with_a_warning_naming_the_fusion(export, make):
    model, quantize = EXPORTS[export](), PASSES[make]()
    with pytest.warns(UnfusedAttentionWarning) as said:
        assert quantize(model).modified is False
    assert len(said) == 1
    text = str(said[0].message)
    assert type(quantize).__name__ in text
    assert "GqaFusionPass" in text and "optimize_model" in text and "3 attention node(s)" in text
    assert not find_attention_sites(
        model, with_cache_only=False
    )  # nothing was fused behind the caller's back


@pytest.mark.parametrize("export", EXPORTS)
def test_fused_first_it_converts_and_says_nothing_of_fusion(export):
    model = EXPORTS[export]()
    GqaFusionPass()(model)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert KvCacheQuantizationPass("int8", "per_tensor", {i: (0.1, 0.1) for i in range(3)})(
            model
        ).modified
    assert not [w for w in said if issubclass(w.category, UnfusedAttentionWarning)]
    assert {s.cache_format.name for s in find_attention_sites(model)} == {"int8"}


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
