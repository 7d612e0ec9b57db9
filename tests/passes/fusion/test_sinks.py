"""Attention sinks (gpt-oss) fused into GroupQueryAttention's ``head_sink``, and what runs them.

The builder writes transformers' gpt-oss attention (``ExportStyle(attention_sinks=True)``): one
constant logit per head concatenated beside the scores, the row's maximum subtracted, the
softmax's last column dropped. Fused, each layer keeps its own window (Gemma2's alternating
ones here) and, with a rolling window cache, takes a window-sized cache; the real files are
tests/passes/fusion/test_producers.py's.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import onnx_ir as ir
import pytest

from decoding import PROMPTS, count, generate, max_differences
from onnx_kvcache import KvCacheQuantizationPass, KvCacheRunner, calibrate_kv_cache
from onnx_kvcache.cache.layout import format_cache_table, inspect_kv_cache
from onnx_kvcache.cache.rolling import rolling_attention
from onnx_kvcache.calibrate._attention_error import attention_output
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass
from onnx_kvcache.passes.kv_cache_emulation import emulate_kv_cache

from builders.exported import ExportStyle, build_decoder, exported_config

SINKS = np.linspace(-1.0, 1.5, 4, dtype=np.float32)  # what the builder writes for 4 heads
CASES = {
    "single": PROMPTS["single"],
    "left_padded": PROMPTS["left_padded"],
    "long": np.ones((1, 12), np.int64),
}


def export(arch: str = "gemma2", **style) -> ir.Model:
    style = {"attention": "eager", "attention_sinks": True} | style
    config = exported_config(
        arch, num_layers=2, vocab_size=300, sliding_window=4, exported=ExportStyle(**style)
    )
    return build_decoder(config)


def fused(model: ir.Model) -> tuple[ir.Model, GqaFusionPass]:
    fusion = GqaFusionPass()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fusion(model)
    return model, fusion


@pytest.mark.parametrize("case", sorted(CASES))
def test_sinks_fuse_into_head_sink_and_compute_as_the_export(case):
    original, (model, fusion) = export(), fused(export())
    assert fusion.fused == 2 and count(model, "Softmax") == count(model, "ReduceMax") == 0
    gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    for node in gqa:
        np.testing.assert_array_equal(node.inputs[11].const_value.numpy(), SINKS)
    windows = [
        n.attributes["local_window_size"].as_int() if "local_window_size" in n.attributes else None
        for n in gqa
    ]
    assert windows == [4, None]  # Gemma2's alternating layers, each its own
    want, got = generate(original, CASES[case]), generate(model, CASES[case])
    assert max(max_differences(want, got).values()) < 1e-4


def test_sinks_with_a_rolling_window_cache():
    """Mistral's window on every layer, its cache cropped: head_sink over the export's rolling cache."""
    original, (model, _) = (
        export("mistral", window_cache="cropped"),
        fused(export("mistral", window_cache="cropped")),
    )
    for node in (n for n in model.graph if n.op_type == "GroupQueryAttention"):
        assert rolling_attention(node) and node.inputs[11] is not None
    for mask in CASES.values():
        want, got = generate(original, mask, cache_columns=True), generate(model, mask)
        assert max(max_differences(want, got).values()) < 1e-4


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("cut", "not its first K columns"),
        ("input", "not a constant per head (it is computed by a graph input)"),
    ],
)
def test_a_sink_column_other_than_gpt_oss_is_refused_with_the_reason(change, reason):
    model = export()
    for node in list(model.graph):
        first = node.inputs[0].const_value if node.inputs and node.inputs[0] is not None else None
        end = node.inputs[2].const_value if len(node.inputs) > 2 and node.inputs[2] is not None else None
        if change == "cut" and node.op_type == "Slice" and end is not None and end.numpy().tolist() == [-1]:
            two = ir.Value(name=f"{node.name}/minus_two", const_value=ir.tensor(np.array([-2], np.int64)))
            model.graph.register_initializer(two)  # probs[..., :-2]
            node.replace_input_with(2, two)
        if (
            change == "input"
            and node.op_type == "Expand"
            and first is not None
            and first.shape == (1, 4, 1, 1)
        ):
            sinks = ir.val("sinks", ir.DataType.FLOAT, [1, 4, 1, 1])
            model.graph.inputs.append(sinks)
            node.replace_input_with(0, sinks)
    _, fusion = fused(model)
    assert fusion.fused == 0 and all(reason in why for why in fusion.refused), fusion.refused


def test_softmax_with_sinks_is_softmax_over_the_sink_column():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((5, 4, 8)), rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    _, p = attention_output(q, k, v, scale=0.3, sink=SINKS)
    scores = np.einsum("nhd,hsd->hns", q, np.repeat(k, 2, axis=0)) * np.float32(0.3)
    scores = np.where(np.arange(5)[None, :] > np.arange(5)[:, None], -np.inf, scores)
    full = np.concatenate([scores, np.broadcast_to(SINKS[:, None, None], (4, 5, 1))], axis=-1)
    want = np.exp(full - full.max(-1, keepdims=True))
    np.testing.assert_allclose(p, (want / want.sum(-1, keepdims=True))[..., :5], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def rolling(tmp_path_factory):
    """The fused rolling-window model with sinks, saved."""
    path = tmp_path_factory.mktemp("sinks") / "model.onnx"
    ir.save(fused(export("mistral", window_cache="cropped"))[0], path)
    return path


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_runner_runs_sinks_and_rolling_window_caches(rolling, fmt):
    """int8 on onnxruntime's CPU kernel, fp8 through the CUDA-rule emulation: the runner's
    greedy tokens follow the float model's logits within the format's noise; its caches are the
    export's (empty first, no window-sized capacity), bound to the presents' row gathers."""
    model = ir.load(rolling)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        KvCacheQuantizationPass(fmt, scales={0: (0.03, 0.03), 1: (0.03, 0.03)})(model)
        runner = KvCacheRunner(model)
        reference = KvCacheRunner(ir.load(rolling))
        prompt = list(range(1, 10))  # past the window of 4
        got, want = runner.generate(prompt, 4), reference.generate(prompt, 4)
    assert len(got) == len(want) == 4
    assert len(runner.bindings) == 4 and not any(b.capacity for b in runner.bindings)
    assert all(b.present.startswith("present.") for b in runner.bindings)
    float_logits = generate(ir.load(rolling), np.ones((1, 9), np.int64))
    emulated = emulate_kv_cache(model, "cuda") if fmt == "fp8" else model
    quantized_logits = generate(emulated, np.ones((1, 9), np.int64))
    for (_, a), (_, b) in zip(float_logits, quantized_logits):
        assert float(np.abs(a["logits"] - b["logits"]).max()) < 0.1 * float(np.abs(a["logits"]).max())


def test_calibration_and_inspect_read_the_sinks(rolling):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scales = calibrate_kv_cache(
            rolling, format="int8", method="attention", num_seqs=2, seq_len=24, min_tokens=48, progress=False
        )
    assert set(scales.layer_ids) == {0, 1}
    table = format_cache_table(inspect_kv_cache(rolling))
    assert "attention sinks (head_sink, one logit per query head): layer(s) 0-1" in table
    assert "rolling window caches (the export's): layer(s) 0-1 keep each row's last 3 tokens" in table


def test_the_builder_writes_sinks_only_for_eager_attention():
    from onnx_kvcache.errors import KvCacheError

    config = exported_config("mistral", num_layers=1, exported=ExportStyle(attention_sinks=True))
    with pytest.raises(KvCacheError, match="attention_sinks"):
        build_decoder(dataclasses.replace(config))
