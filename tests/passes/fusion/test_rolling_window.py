"""transformers 5.x dynamo exports with rolling window caches (Mistral, Gemma2).

The builder writes ``ExportStyle(window_cache="cropped")``: a sliding layer's past is
cropped to its last ``window - 1`` rows, attention reads ``Concat(cropped, new)`` and the
present is a Slice of that (Gemma2 also in transformers' eager attention, soft-capped).
Fused, such a layer is GroupQueryAttention over the export's own past, its present gathered to
the export's last ``window - 1`` rows: the fused model takes the export's inputs (an empty past
first) and must compute what the export computes, fed its presents back (the real files:
tests/passes/fusion/test_producers.py). An onnxruntime-genai folder's form is window-sized
(``sliding_window_cache=1``: :func:`make_window_sized`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from decoding import PROMPTS, count, generate, max_differences
from onnx_kvcache import KvCacheRunner, calibrate_kv_cache, convert_model, optimize_model
from onnx_kvcache.cache.rolling import split_window_lengths
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass
from onnx_kvcache.passes.fusion.sdpa_fusion import DecomposedAttentionFusionPass
from onnx_kvcache.passes.fusion.window_sized import make_window_sized

from builders.exported import ExportStyle, build_decoder, exported_config
from conftest import gqa_nodes

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
def test_fused_rolling_caches_equal_the_export(arch, case):
    """Logits and each row's last tokens in the caches; a padded row as the export computes it
    from its own columns of the mask (a pure window model: mistral)."""
    original = export(arch)
    model = fused(export(arch))
    assert count(model, "GroupQueryAttention") == 4
    assert count(model, "Attention") == count(model, "Softmax") == 0
    gqa = gqa_nodes(model)
    assert {
        n.attributes["local_window_size"].as_int() for n in gqa if "local_window_size" in n.attributes
    } == {64}
    if case == "left_padded" and arch == "gemma2":
        return  # full and window layers read one mask: no columns are the window layers' own
    want = generate(original, CASES[case], cache_columns=case == "left_padded")
    got = generate(model, CASES[case])
    assert max(max_differences(want, got).values()) < 1e-4
    for (_, a), (_, b) in zip(want, got):  # the export's presents: its shapes, W - 1 rows at most
        assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    if case != "left_padded":  # unpadded rows: the export's presents themselves
        assert _same(want, got) < 1e-4


def test_gemma2_eager_attention_carries_softcap_and_scale():
    model = fused(export("gemma2", window=4))
    for node in gqa_nodes(model):
        assert node.attributes["softcap"].as_float() == pytest.approx(50.0)
        assert node.attributes["scale"].as_float() == pytest.approx(48**-0.5)
    assert count(model, "Tanh") == 1  # the logits' soft-cap stays


def test_rolling_layers_keep_the_exports_caches():
    """GQA over the export's past (no window-sized cache), each row's valid new tokens counted
    (query_seqlens); the present a gather of the node's present, named and declared as the export's."""
    original, model = export("mistral", window=4), fused(export("mistral", window=4))
    declared = {v.name: v.shape for v in original.graph.outputs}
    for node in gqa_nodes(model):
        assert "sliding_window_cache" not in node.attributes
        assert node.attributes["local_window_size"].as_int() == 4
        assert node.inputs[3].is_graph_input() and node.inputs[3].shape == original.graph.inputs[3].shape
        assert node.inputs[16] is not None  # query_seqlens
        for present in node.outputs[1:3]:
            (gather, _), *others = present.uses()
            assert gather.op_type == "GatherND" and not others
            assert gather.outputs[0].is_graph_output() and gather.outputs[0].name.startswith("present.")
            assert gather.outputs[0].shape == declared[gather.outputs[0].name]


def test_a_genai_folder_keeps_window_sized_caches():
    """make_window_sized: GQA's window-sized cache, declared as onnxruntime-genai's builder
    declares it; the present is the node's own output, the lengths the whole mask's."""
    model = fused(export("mistral", window=4))
    assert make_window_sized(model) == 4
    assert count(model, "GatherND") == 0 and count(model, "Min") == 0
    for node in gqa_nodes(model):
        assert node.attributes["sliding_window_cache"].as_int() == 1
        assert node.attributes["local_window_size"].as_int() == 4
        assert node.inputs[3].is_graph_input() and node.inputs[3].shape[2] == "past_sliding_length"
        assert node.outputs[1].is_graph_output() and node.outputs[1].name.startswith("present.")
        assert node.outputs[1].shape[2] == "total_sliding_length"
        assert node.inputs[16] is not None  # query_seqlens
    assert count(model, "Slice") == 2  # query_seqlens' columns and the padding order: no cache Slice


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
    reason = "rolling window cache of W - 1 past tokens: the export keeps its last 3 tokens"
    assert all(reason in why for why in fusion.refused)


def test_the_fused_model_runs_from_the_exports_empty_past():
    """The issue's first call: the export's own inputs (an empty past) run in the fused model and
    give the export's logits and presents (W - 1 rows at most)."""
    original, model = export("mistral", window=4), fused(export("mistral", window=4))
    feeds = {"input_ids": np.arange(1, 8)[None], "attention_mask": np.ones((1, 7), np.int64)}
    feeds["position_ids"] = np.arange(7)[None]
    for value in model.graph.inputs[3:]:
        feeds[value.name] = np.zeros((1, 2, 0, 32), np.float32)
    want, got = (create_session(m).run(None, feeds) for m in (original, model))
    assert [w.shape for w in want] == [g.shape for g in got] and got[1].shape == (1, 2, 3, 32)
    assert max(float(np.abs(w - g).max()) for w, g in zip(want, got)) < 1e-4


def test_the_window_sized_cache_holds_window_rows_not_the_exports_window_minus_one():
    """onnxruntime's window-sized cache (a genai folder's) needs capacity >= local_window_size: it
    takes W rows (zeros at first, as onnxruntime-genai allocates them), not the export's W - 1."""
    model = fused(export("mistral", window=4))
    make_window_sized(model)
    session = create_session(model)
    feeds = {"input_ids": np.zeros((1, 1), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
    feeds["position_ids"] = np.array([[3]])
    for value in model.graph.inputs[3:]:
        feeds[value.name] = np.zeros((1, 2, 3, 32), np.float32)
    with pytest.raises(Exception, match=r"capacity \(3\) must be at least local_window_size \(4\)"):
        session.run(None, feeds)
    for value in model.graph.inputs[3:]:
        feeds[value.name] = np.zeros((1, 2, 4, 32), np.float32)
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    assert outputs["present.0.key"].shape == (1, 2, 4, 32)


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
    assert len(gqa_nodes(model)) == 4 and count(model, "If") == 4  # every layer's prompt in float
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
    for present in presents:  # GatherND takes no float8: the rows are gathered through float16
        gather = present.producer().inputs[0].producer()
        assert present.producer().op_type == "Cast" and gather.op_type == "GatherND"
        assert gather.inputs[0].producer().inputs[0].producer().op_type == "GroupQueryAttention"
    with pytest.raises(Exception, match="NOT_IMPLEMENTED") as caught:
        create_session(model)
    assert "GroupQueryAttention" in str(caught.value)


def test_the_runner_emulates_an_fp8_window_cache_on_cpu(tmp_path):
    """KvCacheRunner binds the rolling caches' presents and runs the fp8 model through emulation."""
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


@pytest.mark.parametrize(
    ("window", "pads", "tokens"),
    [(4, 3, 6), (4, 4, 7), (4, 10, 20), (6, 6, 14)],
    ids=["w4_pad3", "w4_pad4", "w4_pad10_of20", "w6_pad6"],
)
def test_a_left_padded_row_computes_its_own_last_window_tokens(window, pads, tokens):
    """However long its padding, a left-padded row computes what the export computes from its
    own columns of the mask (its cache's: the last past + seq), and what the full-length export
    computes; given the whole mask, the export reads its first columns (ROLLING_WINDOW_WARNING)."""
    config = exported_config(
        "mistral",
        num_layers=2,
        vocab_size=300,
        sliding_window=window,
        exported=ExportStyle(window_cache="cropped"),
    )
    original, model = build_decoder(config), build_decoder(config)
    full = build_decoder(dataclasses.replace(config, exported=ExportStyle()))
    with pytest.warns(Warning, match="keep the export's caches"):
        GqaFusionPass()(model)
    mask = np.array([[1] * tokens, [0] * pads + [1] * (tokens - pads)])
    got = generate(model, mask, steps=12)
    for want in (generate(original, mask, steps=12, cache_columns=True), generate(full, mask, steps=12)):
        assert max(max_differences(want, got).values()) < 1e-4


PRODUCERS = pathlib.Path(__file__).parents[2] / "data" / "producers"
#: The producers' rolling window exports (window 4): mistral's every layer a window layer; qwen2_window,
#: gemma2 and cohere2 alternate window and full layers over one declared past dimension.
ORACLE = sorted(PRODUCERS.glob("*/dynamo-opset23-optimize-rollingcache/*/model.onnx"))
MIXED = [path for path in ORACLE if path.parent.name != "mistral"]
ORACLE_CASES = {
    **CASES,
    "longer_than_window": np.ones((1, 12), np.int64),
    "left_padded_below_the_window": np.array([[1] * 7, [0] * 5 + [1] * 2]),  # 2 tokens < W - 1
}


def _oracle_id(path: pathlib.Path) -> str:
    return "/".join(path.parts[-4:-1])


def _as_called(path: pathlib.Path) -> tuple[ir.Model, bool]:
    """The export, its window caches' pasts declared apart from full-length ones (declared shapes
    only: what its fused form declares), and whether it mixes the two."""
    model = ir.load(path)
    return model, bool(split_window_lengths(model.graph))


def _full_length(path: pathlib.Path) -> ir.Model:
    """The export with full-length caches (DynamicCache()) of the same saved model."""
    return ir.load(path.parents[2] / "dynamo-opset23-optimize" / path.parent.name / "model.onnx")


def _reference(path: pathlib.Path, mask: np.ndarray) -> list:
    """What the converted file must give: the export fed its own columns of the mask (a rolling
    window cache reads its cache's); with rolling and full caches, which no one mask serves, a
    padded batch as the full-length export of the same saved model computes it (transformers')."""
    export, mixed = _as_called(path)
    if mixed and not mask.all():
        return generate(_full_length(path), mask)
    return generate(export, mask, cache_columns=not mixed)


@pytest.mark.parametrize("case", sorted(ORACLE_CASES))
@pytest.mark.parametrize("path", ORACLE, ids=_oracle_id)
def test_a_converted_oracle_file_takes_the_exports_inputs(path, case, tmp_path):
    """The issue's model: a transformers 5.x export with a rolling window cache, fused and saved,
    runs from an empty past with the export's inputs and gives its logits and its presents (their
    shapes; unpadded, their values), fed its own presents back; a padded row's mask as the export
    reads it (its cache's columns) or whole; with full layers too, the whole mask, as transformers
    computes a padded row (the full-length export's)."""
    ir.save(fused(ir.load(path)), tmp_path / "model.onnx")
    model = ir.load(tmp_path / "model.onnx")
    export, mixed = _as_called(path)
    mask = ORACLE_CASES[case]
    want = _reference(path, mask)
    shapes = generate(export, mask, cache_columns=not mixed)  # the export's presents' shapes
    for columns in (True, False) if not mixed else (False,):
        got = generate(model, mask, cache_columns=columns)
        assert max(max_differences(want, got).values()) < 1e-5
        for (_, a), (_, b) in zip(shapes, got):
            assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
            assert min(v.shape[2] for k, v in b.items() if k.startswith("present.")) <= 3  # W - 1
        if not case.startswith("left_padded"):  # a padded row's tokens: first in its rows, not last
            assert _same(want, got) < 1e-5
        assert max(max_differences(shapes[:1], got[:1]).values()) < 1e-5  # the first call: the export's


@pytest.mark.parametrize("path", MIXED, ids=_oracle_id)
def test_a_mixed_export_declares_its_window_caches_apart(path):
    """Window and full layers share the export's one declared past length, while fed its presents
    they hold W - 1 rows and every token: onnxruntime takes the declared length for both (gemma2's
    and cohere2's exports fail on their own presents), and so would a proof. Declared apart, the
    export runs (as transformers computes an unpadded row), and so does its fused form, which
    declares them so."""
    manifest = json.loads((PRODUCERS / "manifest.json").read_text(encoding="utf-8"))["models"]
    entry = next(e for e in manifest if e["path"] == _oracle_id(path))
    if "decode_run" in entry:  # gemma2, cohere2: onnxruntime's error, recorded by the generator
        with pytest.raises(Exception, match="Shape mismatch attempting to re-use buffer"):
            generate(ir.load(path), PROMPTS["single"])
    export, mixed = _as_called(path)
    assert mixed
    windows = {v.name for v in export.graph.inputs[3:] if v.shape[2] == "past_last3"}
    model = fused(ir.load(path))
    assert {v.name for v in model.graph.inputs[3:] if v.shape[2] == "past_last3"} == windows
    assert len(windows) == 2 and {v.shape[2] for v in model.graph.inputs[3:]} == {"past", "past_last3"}
    want = generate(_full_length(path), PROMPTS["single"])
    for run in (export, model):
        assert max(max_differences(want, generate(run, PROMPTS["single"])).values()) < 1e-5
    prompt = [1, 72, 101, 108, 108, 111, 33]  # the runner feeds the fused file's caches: its tokens
    assert KvCacheRunner(model).generate(prompt, 10) == KvCacheRunner(_full_length(path)).generate(prompt, 10)
    mistral = next(p for p in ORACLE if p.parent.name == "mistral")
    assert split_window_lengths(ir.load(mistral).graph) == {}  # every layer a window: one length


def test_a_full_layer_reading_the_window_caches_length_is_refused():
    """The proof reads each cache's own length: a full layer whose mask and K/V repeat are sized
    by the window cache's past (one length with the export's declared dimension) is refused, and
    the model is left as it was."""
    path = next(p for p in MIXED if "torch-tf5/" in str(p) and p.parent.name == "gemma2")
    model = ir.load(path)
    values = {v.name: v for node in model.graph for v in node.outputs}
    window, full = values["sym_size_int_59"], values["sym_size_int_63"]  # the lengths of layers 0, 1
    assert window.producer().inputs[0].producer().inputs[0].name == "past_key_values.0.key"
    for node, index in list(full.uses()):
        node.replace_input_with(index, window)
    before = onnx.printer.to_text(ir.serde.serialize_model(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(KvCacheError):
            GqaFusionPass()(model)
    assert onnx.printer.to_text(ir.serde.serialize_model(model)) == before
    split_window_lengths(model.graph)
    fusion = DecomposedAttentionFusionPass()
    fusion(model)
    assert fusion.report.fused == 1 and len(fusion.report.refused) == 1
    assert "past_last3 + seq" in fusion.report.refused[0]  # the two lengths told apart


#: The logits' largest difference from the export each format stays within, relative to the largest
#: logit (measured: int8 0.053 and int4 0.45 of 3.38, as the same export with a full-length cache).
QUANTIZED = {"int8": (ir.DataType.INT8, 0.05), "int4": (ir.DataType.UINT8, 0.2)}


@pytest.mark.parametrize("fmt", sorted(QUANTIZED))
@pytest.mark.parametrize("path", ORACLE, ids=_oracle_id)
def test_a_quantized_conversion_of_an_oracle_file_runs_from_an_empty_past(path, fmt, tmp_path):
    """onnx-kvcache convert --format int8/int4 (CPU): the export's inputs, an empty past first, run
    in onnxruntime; the presents quantized with the export's rows, the logits the export's within
    the cache's quantization error; the runner feeds the export's caches."""
    dtype, tolerance = QUANTIZED[fmt]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fusion's padding note, random calibration tokens
        scales = calibrate_kv_cache(ir.load(path), format=fmt, num_seqs=4, seq_len=64, progress=False)
    scales.save(tmp_path / "scales.json")
    out = tmp_path / f"model.{fmt}.onnx"
    command = [sys.executable, "-m", "onnx_kvcache", "convert", str(path), str(out), "--format", fmt]
    command += ["--scales", str(tmp_path / "scales.json"), "--ep", "cpu"]
    subprocess.run(command, check=True, capture_output=True)
    model = ir.load(out)
    presents = [v for v in model.graph.outputs if v.name.startswith("present.")]
    assert {v.dtype for v in presents} == {dtype}
    assert count(model, "If") == 2  # the prompt in float: the float kernel takes the export's empty past
    export, mixed = _as_called(path)
    for mask in ORACLE_CASES.values():
        want, got = _reference(path, mask), generate(model, mask)
        shapes = generate(export, mask, cache_columns=not mixed)
        for (_, a), (_, b) in zip(shapes, got):  # int4 packs two values a byte: the rows compared
            assert {k: v.shape[:3] for k, v in a.items()} == {k: v.shape[:3] for k, v in b.items()}
        top = max(float(np.abs(h["logits"]).max()) for _, h in want)
        logits = [[(m, {"logits": h["logits"]}) for m, h in run] for run in (want, got)]
        assert max_differences(*logits)["logits"] < tolerance * top  # the cache's error, not a wrong window
    runner = KvCacheRunner(out)  # the runner feeds the export's caches: empty first, no capacity
    assert len(runner.generate(list(range(1, 10)), 4)) == 4
    assert [b.present for b in runner.bindings] == [v.name for v in presents]
    assert not any(b.capacity for b in runner.bindings)


def test_window_and_full_pasts_declared_as_one_number_stay_refused():
    """A past length declared as a number cannot be declared apart: the window layer keeps the
    rolling-window refusal, and the full layer alone fuses (convert then refuses the model, as
    optimize_model does: test_partial_refusals.py)."""
    path = next(p for p in MIXED if "torch-tf5/" in str(p) and p.parent.name == "gemma2")
    model = ir.load(path)
    for value in model.graph.inputs[3:]:
        value.shape = ir.Shape([value.shape[0], 2, 2, 16])
    assert split_window_lengths(model.graph) == {}
    fusion = GqaFusionPass()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fusion(model)
    assert fusion.fused == 1 and len(fusion.refused) == 1
    assert (
        "past_key_values.0.key keeps its last 3 tokens (W = 4) while past_key_values.1.key"
        in fusion.refused[0]
    )
