"""Decoders shaped like onnxruntime-genai's builds, end to end on a CPU-only machine.

Each build is an onnxruntime-genai folder made by the project's builder the way the model
builder lays models out (symbolic ``kv_cache_dim``, fp16/bf16 weights, q/k norm fused into
GroupQueryAttention, window-sized sliding-window caches). For each: calibrate on CPU, convert
to every format the capability table allows on the target the model implies, evaluate on
CPU, and let onnxruntime-genai generate from every int8/int4 folder the CPU can run.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import (
    KvCacheRunner,
    calibrate_kv_cache,
    check_kv_cache_support,
    convert_model,
    evaluate_kv_cache,
    inspect_kv_cache,
)
from onnx_kvcache.capabilities.table import get_capabilities, infer_target
from onnx_kvcache.model_io.reading import load_model
from onnx_kvcache.models.decoder import build_decoder, save_genai_folder

pytest.importorskip("tokenizers", reason="install the test extra")

COMMON = {"num_layers": 2, "vocab_size": 300, "symbolic_cache_dim": True}
BUILDS = {  # the model builder names a provider in genai_config: cpu (none) or cuda
    "fp32": {},
    "fp16": {"dtype": "float16"},
    "bf16": {"dtype": "bfloat16", "provider": "cuda"},
    "qk-norm-fp16": {"dtype": "float16", "qk_norm": True, "provider": "cuda"},
    "sliding-window": {"sliding_window_layers": (1,), "sliding_window": 16},
    "window-sized-cache": {"sliding_window_layers": (1,), "sliding_window": 16, "sliding_window_cache": True},
}
#: Builds onnxruntime-genai cannot run on CPU, the original folders included.
GENAI_CANNOT = {
    "bf16": "onnxruntime's CPU provider has no bf16 MatMul",
    "qk-norm-fp16": "onnxruntime's CPU GQA rejects q/k norm inputs",
    "window-sized-cache": "onnxruntime-genai 0.18 allocates an empty past for the window-sized cache",
}
CPU_TARGETS = ("fp32", "fp16", "sliding-window", "window-sized-cache")


@pytest.fixture(scope="module", params=list(BUILDS))
def build(request, tmp_path_factory):
    name = request.param
    folder = save_genai_folder(tmp_path_factory.mktemp(name) / "model", **COMMON, **BUILDS[name])
    return name, folder


def test_every_allowed_format_calibrates_converts_and_evaluates_on_cpu(build, tmp_path):
    name, folder = build
    model = load_model(folder)
    target, _ = infer_target(model, json.loads((folder / "genai_config.json").read_text()))
    assert target == ("cpu" if name in CPU_TARGETS else "cuda")
    allowed = [
        f for f in get_capabilities(target).formats if check_kv_cache_support(model, target, f).supported
    ]
    assert allowed == (["int8", "int4"] if target == "cpu" else ["fp8", "int8", "int4"])
    for fmt in allowed:
        scales = calibrate_kv_cache(folder, format=fmt, granularity="per_channel", progress=False)
        out = tmp_path / f"{name}-{fmt}"
        result = convert_model(folder, out, format=fmt, granularity="per_channel", scales=scales, ep=target)
        assert result.converted and result.nodes == 2
        caches = [v for v in load_model(out).graph.inputs if v.name.startswith("past_key_values")]
        assert all(
            v.shape[3] == (16 if fmt == "int4" else "kv_cache_dim") for v in caches
        )  # genai allocates these
        report = evaluate_kv_cache(folder, out, num_seqs=1, seq_len=96, max_new_tokens=4)
        # the CPU's prompt through the float kernel, but for a window-sized cache (onnxruntime's
        # float kernel refuses its empty first past)
        layers = inspect_kv_cache(out).layers
        assert [lay.prompt_in_float for lay in layers] == [
            target == "cpu" and not lay.window for lay in layers
        ]
        float_prompt = any(lay.prompt_in_float for lay in layers)
        want = "cuda (emulated on CPU)" if target != "cpu" else "cpu (onnxruntime CPU kernel)"
        assert report.kernel_rule == (want[:-1] + ", prompt in float)" if float_prompt else want)
        # CUDA's first prompt attends unquantized: no KL but float rounding (a rotated int4
        # cache computes it through the moved-out RoPE and H, ~1e-7); a quantized one is ~1e-2
        assert report.kl_prompt_mean < 1e-5 or target == "cpu"
        assert np.isfinite(report.kl_mean) and report.top1_agreement > 0.5, (fmt, report.format_table())


def test_onnxruntime_genai_generates_from_every_cpu_runnable_int_folder(build, tmp_path):
    og = pytest.importorskip("onnxruntime_genai", reason="install the genai extra (CI does)")
    name, folder = build
    from test_genai import PROMPT, runner_generate

    from conftest import og_generate

    if name in GENAI_CANNOT:  # prove the reason holds for the original, then skip
        with pytest.raises(RuntimeError):
            og_generate(folder, PROMPT, 2)
        pytest.skip(GENAI_CANNOT[name])

    for fmt in ("int8", "int4"):
        scales = calibrate_kv_cache(folder, format=fmt, granularity="per_channel", progress=False)
        out = tmp_path / fmt
        convert_model(folder, out, format=fmt, granularity="per_channel", scales=scales, ep="cpu")
        tokens = og_generate(out, PROMPT, 12)
        assert len(tokens) >= 4 and tokens == runner_generate(out, PROMPT, 12)
    assert og.Model(str(folder))  # the original folder still loads


def test_bf16_calibrates_like_float32_with_the_same_weights():
    """CPU computes bf16 in float32; only bf16 rounding of RoPE tables and eps differs."""
    bf16 = build_decoder(**COMMON, dtype="bfloat16")
    weights = {name: v.const_value.numpy().astype(np.float32) for name, v in bf16.graph.initializers.items()}
    f32 = build_decoder(
        **COMMON, weight_factory=lambda name, shape, dtype: ir.tensor(weights[name], name=name)
    )
    data = [list(np.random.default_rng(0).integers(0, 300, 512))]
    a = calibrate_kv_cache(bf16, data, format="fp8", granularity="per_channel", progress=False)
    b = calibrate_kv_cache(f32, data, format="fp8", granularity="per_channel", progress=False)
    for layer in (0, 1):
        np.testing.assert_allclose(a.k[layer], b.k[layer], rtol=2**-7)  # bf16 keeps 8 significant bits
        np.testing.assert_allclose(a.v[layer], b.v[layer], rtol=2**-7)


def test_fused_qk_norm_calibrates_like_the_norm_outside_the_node():
    fused = build_decoder(**COMMON, qk_norm=True)
    outside = build_decoder(**COMMON, qk_norm=True, qk_norm_fused=False)
    assert KvCacheRunner(fused).emulated and not KvCacheRunner(outside).emulated
    data = [list(np.random.default_rng(1).integers(0, 300, 512))]
    a = calibrate_kv_cache(fused, data, format="int8", granularity="per_channel", progress=False)
    b = calibrate_kv_cache(outside, data, format="int8", granularity="per_channel", progress=False)
    for layer in (0, 1):
        np.testing.assert_allclose(a.k[layer], b.k[layer], rtol=1e-6)
        np.testing.assert_allclose(a.v[layer], b.v[layer], rtol=1e-6)


def test_an_ir_model_with_external_weights_runs_from_any_directory(tmp_path, monkeypatch):
    folder = tmp_path / "weights"
    folder.mkdir()
    ir.save(build_decoder(**COMMON), folder / "model.onnx", external_data="model.onnx.data")
    model = ir.load(folder / "model.onnx")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    data = [list(np.random.default_rng(2).integers(0, 300, 300))]
    scales = calibrate_kv_cache(model, data, format="int8", progress=False)
    assert len(KvCacheRunner(model).generate([1, 2, 3], 3)) == 3
    converted = ir.load(folder / "model.onnx")
    from onnx_kvcache import KvCacheQuantizationPass

    KvCacheQuantizationPass("int8", scales=scales)(converted)
    report = evaluate_kv_cache(model, converted, data, num_seqs=1, max_new_tokens=2)
    assert report.top1_agreement > 0.5
    assert list(elsewhere.iterdir()) == []  # nothing was copied into the working directory
