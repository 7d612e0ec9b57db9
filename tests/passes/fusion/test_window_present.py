"""transformers 5.x dynamo exports with cropped sliding-window caches (Mistral, Gemma2).

The builder writes ``ExportStyle(window_cache="cropped")``: a sliding layer's past is
cropped to its last ``window - 1`` rows, attention reads ``Concat(cropped, new)`` and the
present is a Slice of that (Gemma2 also in transformers' eager attention, soft-capped).
The fused model must compute what the export computes, presents included.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from decoding import PROMPTS, count, generate, max_differences
from onnx_kvcache import build_decoder, calibrate_kv_cache, convert_model, optimize_model
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.models.exported import ExportStyle, exported_config
from onnx_kvcache.passes.fusion._window_present import tail_slice
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass

GEMMA2 = {
    "attention": "eager",
    "attn_softcap": 50.0,
    "final_softcap": 30.0,
    "query_scale": 48**-0.5,
    "embed_scale": True,
}
STYLES = {"mistral": {}, "gemma2": GEMMA2}
LONG = np.ones((1, 70), np.int64)
CASES = {"single": PROMPTS["single"], "left_padded": PROMPTS["left_padded"], "longer_than_window": LONG}


def export(arch: str, *, window: int = 64, dtype: str = "float32", **style) -> ir.Model:
    style = {"window_cache": "cropped"} | STYLES[arch] | style
    config = exported_config(
        arch, num_layers=4, vocab_size=300, sliding_window=window, dtype=dtype, exported=ExportStyle(**style)
    )
    return build_decoder(config)


def fused(model: ir.Model) -> ir.Model:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optimize_model(model)


def _same(want: list, got: list) -> float:
    """Largest difference of every output, same shapes required (unpadded rows)."""
    worst = 0.0
    for (_, a), (_, b) in zip(want, got):
        for name in a:
            assert a[name].shape == b[name].shape, name
            worst = max(worst, float(np.abs(a[name] - b[name]).max()))
    return worst


def test_the_builder_writes_transformers_cropped_caches():
    model = export("mistral", window=4)
    for i in range(4):
        present = next(v for v in model.graph.outputs if v.name == f"present.{i}.key")
        node = present.producer()
        assert node.op_type == "Slice" and node.inputs[0].producer().op_type == "Concat"
        assert node.inputs[0].producer().inputs[0].producer().op_type == "Slice"  # the cropped past
    history = generate(model, PROMPTS["single"])
    assert [h["present.0.key"].shape[2] for _, h in history] == [3, 3, 3, 3]


@pytest.mark.parametrize("arch", sorted(STYLES))
def test_cropped_caches_attend_as_full_caches_do(arch):
    """The builder's cropped form computes the window the full-cache form does (logits)."""
    cropped, full = export(arch, window=4), export(arch, window=4, window_cache="full")
    a, b = generate(cropped, PROMPTS["single"]), generate(full, PROMPTS["single"])
    assert max(float(np.abs(x["logits"] - y["logits"]).max()) for (_, x), (_, y) in zip(a, b)) < 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("arch", sorted(STYLES))
def test_fused_cropped_caches_equal_the_export(arch, case):
    original = export(arch)
    model = fused(export(arch))
    assert count(model, "GroupQueryAttention") == 4
    assert count(model, "Attention") == count(model, "Softmax") == 0
    gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert {
        n.attributes["local_window_size"].as_int() for n in gqa if "local_window_size" in n.attributes
    } == {64}
    want, got = generate(original, CASES[case]), generate(model, CASES[case])
    # a left-padded row's fused cache holds its valid tokens first
    worst = max(max_differences(want, got).values()) if case == "left_padded" else _same(want, got)
    assert worst < 1e-4
    if case == "longer_than_window":
        assert got[-1][1]["present.0.key"].shape[2] == 63


def test_gemma2_eager_attention_carries_softcap_and_scale():
    model = fused(export("gemma2", window=4))
    for node in (n for n in model.graph if n.op_type == "GroupQueryAttention"):
        assert node.attributes["softcap"].as_float() == pytest.approx(50.0)
        assert node.attributes["scale"].as_float() == pytest.approx(48**-0.5)
    assert count(model, "Tanh") == 1  # the logits' soft-cap stays


def test_the_present_is_a_slice_of_the_fused_node():
    model = fused(export("mistral", window=4))
    for node in (n for n in model.graph if n.op_type == "GroupQueryAttention"):
        window = tail_slice(node.outputs[1])
        assert window is not None and window.outputs[0].name.startswith("present.")
        assert node.inputs[3].is_graph_input()  # the uncropped past, no Slice in front


def test_a_window_wider_than_the_crop_is_refused():
    """With a mask window W > crop + 1 the cropped rows would be visible to GQA: refused."""
    model = export("mistral", window=4)
    wider = ir.Value(name="window_5", const_value=ir.tensor(np.array(5, np.int64)))
    wider.dtype, wider.shape = ir.DataType.INT64, ir.Shape([])
    model.graph.register_initializer(wider)
    for node in model.graph:  # kv > q - 5 instead of kv > q - 4
        constant = node.inputs[1].const_value if node.op_type == "Sub" else None
        if constant is not None and constant.numpy().shape == () and int(constant.numpy()) == 4:
            node.replace_input_with(1, wider)
    fusion = GqaFusionPass()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fusion(model)
    assert fusion.fused == 0 and len(fusion.refused) == 4
    assert all("cropped to its last 3 rows but the mask's window is 5" in why for why in fusion.refused)


def test_sliding_window_cache_attribute_rejects_the_exports_capacity():
    """onnxruntime's window-sized cache needs capacity >= local_window_size; the export's is W - 1."""
    model = fused(export("mistral", window=4))
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    node.attributes["sliding_window_cache"] = ir.AttrInt64("sliding_window_cache", 1)
    session = create_session(model)
    feeds = {"input_ids": np.zeros((1, 1), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
    feeds["position_ids"] = np.array([[3]])
    for value in model.graph.inputs[3:]:
        feeds[value.name] = np.zeros((1, 2, 3, 32), np.float32)
    with pytest.raises(Exception, match=r"capacity \(3\) must be at least local_window_size \(4\)"):
        session.run(None, feeds)


def test_cli_int8_conversion_runs_on_cpu(tmp_path):
    source = tmp_path / "model.onnx"
    ir.save(export("gemma2"), source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fusion's padding note
        scales = calibrate_kv_cache(ir.load(source), format="int8", num_seqs=4, seq_len=70, progress=False)
    scales.save(tmp_path / "scales.json")
    out = tmp_path / "model.int8.onnx"
    command = [sys.executable, "-m", "onnx_kvcache", "convert", str(source), str(out), "--format", "int8"]
    command += ["--scales", str(tmp_path / "scales.json"), "--ep", "cpu"]
    subprocess.run(command, check=True, capture_output=True)
    model = ir.load(out)
    assert count(model, "GroupQueryAttention") == 4
    assert {v.dtype for v in model.graph.outputs if v.name.startswith("present.")} == {ir.DataType.INT8}
    original = export("gemma2")
    for mask in CASES.values():
        want, got = generate(original, mask), generate(model, mask)
        assert all(np.isfinite(h["logits"]).all() for _, h in got)
        worst = float(np.abs(want[-1][1]["logits"] - got[-1][1]["logits"]).max())
        assert worst < 0.5  # int8 cache error, not a wrong window


def test_fp16_converts_to_fp8_for_cuda(tmp_path):
    source = tmp_path / "model.onnx"
    ir.save(export("mistral", dtype="float16", window=4), source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = convert_model(source, tmp_path / "model.fp8.onnx", format="fp8")
    assert result.converted and result.target == "cuda"
    onnx.checker.check_model(onnx.load(tmp_path / "model.fp8.onnx"), full_check=True)
    model = ir.load(tmp_path / "model.fp8.onnx")
    presents = [v for v in model.graph.outputs if v.name.startswith("present.")]
    assert {v.dtype for v in presents} == {ir.DataType.FLOAT8E4M3FN}
    assert all(v.producer().op_type == "Cast" for v in presents)  # Slice through float16
    with pytest.raises(Exception, match="NOT_IMPLEMENTED") as caught:
        create_session(model)
    assert "GroupQueryAttention" in str(caught.value)


def test_the_runner_emulates_an_fp8_window_cache_on_cpu(tmp_path):
    """KvCacheRunner binds the Cast/Slice/Cast present and runs the fp8 model through emulation."""
    from onnx_kvcache import KvCacheRunner

    source = tmp_path / "model.onnx"
    ir.save(export("gemma2", dtype="float16", window=4), source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_model(source, tmp_path / "model.fp8.onnx", format="fp8")
        runner = KvCacheRunner(tmp_path / "model.fp8.onnx")
        tokens = runner.generate(list(range(1, 8)), 4)
        float_runner = KvCacheRunner(source)
        reference = float_runner.generate(list(range(1, 8)), 4)
    assert len(tokens) == len(reference) == 4
    assert all(b.present.startswith("present.") for b in runner.bindings)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_eager_attention_fuses_with_its_float32_softmax(dtype):
    """fp16/bf16 exports cast the scores to float32 for the softmax and back: fused the same."""
    model = fused(export("gemma2", dtype=dtype, window=4))
    assert count(model, "GroupQueryAttention") == 4 and count(model, "Softmax") == 0


def _padded_row_logits(want: list, got: list) -> list[float]:
    """Largest logits difference of row 1 at its valid query positions, per step."""
    out = []
    for (mask, a), (_, b) in zip(want, got):
        valid = mask[1, -a["logits"].shape[1] :].astype(bool)
        out.append(float(np.abs(a["logits"][1] - b["logits"][1])[valid].max(initial=0.0)))
    return out


@pytest.mark.parametrize(
    ("window", "pads", "tokens"),
    [(4, 3, 6), (4, 4, 7), (4, 10, 20), (6, 5, 8), (6, 6, 14)],
    ids=["w4_pad3", "w4_pad4", "w4_pad10_of20", "w6_pad5", "w6_pad6"],
)
def test_a_left_padded_row_matches_while_its_padding_is_under_the_window(window, pads, tokens):
    """Cropped window caches: a row left-padded by at most window - 1 tokens computes as the
    export (any prompt length, any number of steps); by window or more, its prompt still does
    and every decode step differs (what CROPPED_WINDOW_WARNING says)."""
    config = exported_config(
        "mistral",
        num_layers=2,
        vocab_size=300,
        sliding_window=window,
        exported=ExportStyle(window_cache="cropped"),
    )
    original, model = build_decoder(config), build_decoder(config)
    with pytest.warns(Warning, match="left-padded row only when its padding is at most window - 1 tokens"):
        GqaFusionPass()(model)
    mask = np.array([[1] * tokens, [0] * pads + [1] * (tokens - pads)])
    worst = _padded_row_logits(generate(original, mask, steps=12), generate(model, mask, steps=12))
    if pads < window:
        assert max(worst) < 1e-4, worst
    else:
        assert worst[0] < 1e-4 and min(worst[1:]) > 0.1, worst
