"""AttentionFusionPass: exports' ONNX Attention -> GroupQueryAttention, proven or left alone.

Every fused model is run against its original over a prefill and three decode steps.
GQA's padding semantics (measured on onnxruntime's CPU kernel): ``seqlens_k`` counts a
row's valid tokens, which the kernel takes to be the first ones; the fusion hands it each
row's valid new tokens first. Unpadded, right-padded and left-padded rows match the export
at every valid position, the cache holding the valid tokens compacted; right padding under
a sliding window, and multi-token steps after a prompt at batch > 1, do not (tested as
such, documented in docs/exporting.md).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from decoding import PROMPTS, count, generate, max_differences
from onnx_kvcache import KvCacheError, KvCacheRunner, KvCacheWarning, calibrate_kv_cache, optimize_model
from onnx_kvcache.cache.sites import find_gqa_sites
from onnx_kvcache.errors import FusionSkippedWarning, PaddingAssumptionWarning
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.passes.fusion.attention_fusion import AttentionFusionPass

from builders.exported import ExportStyle, build_decoder, exported_config
from conftest import gqa_nodes

FIXTURE = pathlib.Path(__file__).parents[2] / "data" / "export_llama_opset23.onnx"
VOCAB = 300
CALIBRATION = [list(np.random.default_rng(7).integers(0, VOCAB, 128)) for _ in range(2)]
"""256 token ids (the calibration minimum) within every model's vocabulary."""


def exported(arch: str = "llama", **overrides) -> ir.Model:
    return build_decoder(exported_config(arch, num_layers=2, vocab_size=VOCAB, **overrides))


SHAPES = {
    "torch_export": lambda: ir.load(FIXTURE),
    "llama": lambda: exported("llama"),
    "qwen3": lambda: exported("qwen3"),
    "mistral": lambda: exported("mistral"),
    "gemma2": lambda: exported("gemma2"),
    "grouped_kv": lambda: exported(exported=ExportStyle(kv_repeat="grouped")),
    "in_graph_positions": lambda: exported(exported=ExportStyle(position_ids=False)),
    "attention_probs": lambda: exported(exported=ExportStyle(qk_matmul_output=3)),
    # KV heads repeated by Tile (query head h reads KV head h mod kv_heads): the query heads
    # regrouped for GQA, its output (and its probabilities) put back
    "tiled_kv": lambda: exported(exported=ExportStyle(kv_repeat="tile")),
    "tiled_kv_probs": lambda: exported(exported=ExportStyle(kv_repeat="tile", qk_matmul_output=3)),
}
WINDOWED = {"mistral", "gemma2"}
PADDING_AFTER_A_TOKEN = ("right_padded", "middle_padded")
"""Masks whose padding a sliding window counts in the export, and GQA does not."""


def fused(model: ir.Model) -> ir.Model:
    result = AttentionFusionPass()(model)
    assert result.modified
    return result.model


CASES = [
    (shape, prompt)
    for shape in SHAPES
    for prompt in ("single", "right_padded", "left_padded", "middle_padded", "empty_row")
    if not (prompt in PADDING_AFTER_A_TOKEN and shape in WINDOWED)
]


@pytest.mark.parametrize(("shape", "prompt"), CASES)
def test_fused_decoder_equals_the_export(shape, prompt):
    original = SHAPES[shape]()
    layers = count(original, "Attention")
    model = fused(SHAPES[shape]())
    assert count(model, "Attention") == 0 and count(model, "GroupQueryAttention") == layers
    assert {v.name for v in model.graph.outputs} == {v.name for v in original.graph.outputs}
    worst = max_differences(generate(original, PROMPTS[prompt]), generate(model, PROMPTS[prompt]))
    assert max(worst.values()) < 1e-4, worst


@pytest.mark.parametrize("prompt", PADDING_AFTER_A_TOKEN)
@pytest.mark.parametrize("shape", sorted(WINDOWED))
def test_padding_after_a_token_under_a_window_differs(shape, prompt):
    """The export's window counts a row's padding positions; GQA's counts its valid tokens."""
    original = SHAPES[shape]()
    model = fused(SHAPES[shape]())
    worst = max_differences(generate(original, PROMPTS[prompt]), generate(model, PROMPTS[prompt]))
    assert worst["logits"] > 1e-2


def test_padding_order_is_computed_once_per_graph():
    model = fused(ir.load(FIXTURE))
    assert count(model, "TopK") == 2  # the order and its inverse, shared by every layer
    gathers = [n for n in model.graph if n.op_type == "Gather" and "padding_order" in n.name]
    assert len(gathers) == 4 * count(model, "GroupQueryAttention")  # q, k, v in; output back


def test_presents_written_through_identity_fuse():
    def with_identities() -> ir.Model:
        model = exported()
        for index, value in enumerate(list(model.graph.outputs)):
            if value.name.startswith("present"):
                copy = ir.node("Identity", [value], name=f"copy_{value.name}")
                model.graph.append(copy)
                copy.outputs[0].name, value.name = value.name, f"{value.name}_concat"
                copy.outputs[0].type, copy.outputs[0].shape = value.type, value.shape
                model.graph.outputs[index] = copy.outputs[0]
        return model

    original, model = with_identities(), fused(with_identities())
    assert count(model, "Concat") < count(original, "Concat") and count(model, "GroupQueryAttention") == 2
    worst = max_differences(generate(original, PROMPTS["single"]), generate(model, PROMPTS["single"]))
    assert max(worst.values()) < 1e-4


def test_one_seqlens_computation_per_graph():
    model = fused(ir.load(FIXTURE))
    assert count(model, "ReduceSum") == 1
    nodes = gqa_nodes(model)
    assert len({id(n.inputs[5]) for n in nodes}) == 1 and len({id(n.inputs[6]) for n in nodes}) == 1
    attrs = nodes[0].attributes
    assert attrs["do_rotary"].as_int() == 0 and attrs["kv_num_heads"].as_int() == 2
    assert attrs["scale"].as_float() == pytest.approx(32**-0.5)


@pytest.mark.parametrize(
    ("arch", "attributes"),
    [
        ("mistral", {0: {"local_window_size": 4}, 1: {"local_window_size": 4}}),
        ("gemma2", {0: {"local_window_size": 4, "softcap": 50.0}, 1: {"softcap": 50.0}}),
    ],
)
def test_windows_and_softcap_carry_over(arch, attributes):
    model = fused(exported(arch))
    nodes = gqa_nodes(model)
    for i, node in enumerate(nodes):
        got = {k: node.attributes[k].value for k in ("local_window_size", "softcap") if k in node.attributes}
        assert got == attributes[i]


def test_fp16_export_fuses_and_matches():
    original = exported("qwen3", dtype="float16")
    model = fused(exported("qwen3", dtype="float16"))
    worst = max_differences(generate(original, PROMPTS["single"]), generate(model, PROMPTS["single"]))
    assert worst["logits"] < 2e-2 and worst["present"] < 2e-2, worst


ARCHS = ["llama", "qwen3", "mistral", "gemma2"]


@pytest.mark.parametrize(
    ("arch", "dtype"), [*((a, "float16") for a in ARCHS), ("llama", "bfloat16"), ("gemma2", "bfloat16")]
)
def test_fp8_conversion_of_half_precision_exports_type_checks(arch, dtype):
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as OrtNotImplemented

    model = exported(arch, dtype=dtype)
    optimize_model(model, fp8_kv_cache=True, scales={0: (0.05, 0.05), 1: (0.05, 0.05)})
    gqa = gqa_nodes(model)
    assert len(gqa) == 2 and {n.inputs[3].dtype for n in gqa} == {ir.DataType.FLOAT8E4M3FN}
    assert {n.inputs[0].dtype for n in gqa} == {
        ir.DataType.FLOAT16 if dtype == "float16" else ir.DataType.BFLOAT16
    }
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    with pytest.raises(OrtNotImplemented, match="NOT_IMPLEMENTED") as error:
        create_session(model)  # fp8 GQA has no CPU kernel (nor has bf16 MatMul)
    if dtype == "float16":
        assert "GroupQueryAttention" in str(error.value) and "float8e4m3fn" in str(error.value)


def test_optimize_model_without_cache_options_returns_a_float_gqa_model():
    """No target named: a float32 export runs on CPU, which has float32 GroupQueryAttention."""
    original = ir.load(FIXTURE)
    with pytest.warns(PaddingAssumptionWarning, match="a prompt padded anywhere"):
        model = optimize_model(ir.load(FIXTURE))
    gqa = gqa_nodes(model)
    assert len(gqa) == 3 and all(n.inputs[3].dtype == ir.DataType.FLOAT for n in gqa)
    worst = max_differences(generate(original, PROMPTS["single"]), generate(model, PROMPTS["single"]))
    assert worst["logits"] < 1e-4


def test_a_fusion_the_target_cannot_run_is_not_applied():
    """CUDA has no float32 GroupQueryAttention: fusing the float32 export for it would break it."""
    model = ir.load(FIXTURE)
    text = ir.to_onnx_text(model)
    with pytest.warns(KvCacheWarning) as said:
        optimize_model(model, ep="cuda")  # fusing only: no cache to compute around
    assert ir.to_onnx_text(model) == text
    assert [str(w.message) for w in said] == [  # nothing about a fusion that was not applied
        "Attention not fused for cuda: cuda's GroupQueryAttention takes queries of BFLOAT16, FLOAT16, the "
        "model's are FLOAT; export the model in a supported dtype."
    ]


def test_optimize_model_infers_cuda_for_a_half_precision_export():
    model = optimize_model(
        exported("llama", dtype="float16"),
        format="int8",
        scales={0: (0.05, 0.05), 1: (0.05, 0.05)},
    )
    gqa = gqa_nodes(model)
    assert len(gqa) == 2 and {n.inputs[3].dtype for n in gqa} == {ir.DataType.INT8}
    float32 = optimize_model(
        fused(exported("llama")), format="int4", scales={0: (0.05, 0.05), 1: (0.05, 0.05)}
    )
    assert {v.dtype for v in float32.graph.inputs if v.name.startswith("past")} == {ir.DataType.UINT8}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_integer_caches_run_on_cpu_for_every_shape(arch, fmt):
    float_model = fused(exported(arch))
    scales = calibrate_kv_cache(float_model, CALIBRATION, format=fmt, seq_len=128, progress=False)
    model = optimize_model(exported(arch), ep="cpu", format=fmt, scales=scales)
    assert {v.dtype for v in model.graph.inputs if v.name.startswith("past")} == {
        ir.DataType.INT8 if fmt == "int8" else ir.DataType.UINT8
    }
    relative = {"int8": 0.03, "int4": 0.3}[fmt]
    want, got = generate(float_model, PROMPTS["single"]), generate(model, PROMPTS["single"])
    for step, ((_, a), (_, b)) in enumerate(zip(want, got, strict=True)):
        assert np.all(np.isfinite(b["logits"]))
        error, top = np.abs(a["logits"] - b["logits"]).max(), np.abs(a["logits"]).max()
        if step == 0:  # the prompt attends through the float kernel (cache.prompt_path)
            assert error < 1e-5 * top
        else:  # each new token through the quantized one
            assert 0 < error < relative * top


@pytest.fixture(scope="module")
def float_gqa():
    return fused(ir.load(FIXTURE))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_calibrated_integer_caches_run_on_cpu(float_gqa, fmt, granularity):
    scales = calibrate_kv_cache(
        float_gqa, CALIBRATION, format=fmt, granularity=granularity, seq_len=128, progress=False
    )
    model = optimize_model(
        ir.load(FIXTURE),  # fused again inside, then quantized
        ep="cpu",
        format=fmt,
        granularity=granularity,
        scales=scales,
    )
    gqa = [s.node for s in find_gqa_sites(model) if s.wrapper is not None]  # the CPU's: prompt in float
    assert len(gqa) == 3 and {n.attributes["k_quant_type"].as_string() for n in gqa} == {granularity.upper()}
    ids = np.random.default_rng(1).integers(0, 512, 12)
    want, got = KvCacheRunner(float_gqa), KvCacheRunner(model)
    a, b = [want.prefill(ids)[0, -1]], [got.prefill(ids)[0, -1]]
    for token in (5, 17, 99):
        a.append(want.step(token)[0])
        b.append(got.step(token)[0])
    a, b = np.stack(a), np.stack(b)
    tolerance = {"int8": 0.05, "int4": 0.5}[fmt] * np.abs(a).max()
    assert np.abs(a - b).max() < tolerance
    assert np.abs(a - b).max() > 0  # the cache really is quantized


def causal_attention_without_cache() -> ir.Model:
    """An Attention with ``is_causal=1`` and no KV cache (an encoder or a no-cache export)."""
    f = ir.DataType.FLOAT
    q, k, v = (ir.val(n, f, ["batch", 4, "seq", 32]) for n in "qkv")
    node = ir.node("Attention", [q, k, v], {"is_causal": 1}, name="attention")
    node.outputs[0].name = "y"
    graph = ir.Graph([q, k, v], node.outputs, nodes=[node], opset_imports={"": 23})
    return ir.Model(graph, ir_version=10)


def window_attribute() -> ir.Model:
    """Opset 25's left_window_size on the export's Attention: counted from offset 0."""
    model = exported()
    model.opset_imports[""] = 25
    for node in model.graph:
        if node.op_type == "Attention":
            node.attributes["left_window_size"] = ir.AttrInt64("left_window_size", 3)
    return model


def attention_in_a_function() -> ir.Model:
    """The causal Attention above, called through a model-local function."""
    inner = causal_attention_without_cache()
    function = ir.Function("local", "attend", graph=inner.graph, attributes=[])
    f = ir.DataType.FLOAT
    q, k, v = (ir.val(n, f, ["batch", 4, "seq", 32]) for n in "qkv")
    call = ir.node("attend", [q, k, v], domain="local", name="call")
    call.outputs[0].name = "y"
    graph = ir.Graph([q, k, v], call.outputs, nodes=[call], opset_imports={"": 23, "local": 1})
    return ir.Model(graph, ir_version=10, functions=[function])


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: exported(exported=ExportStyle(mask="bidirectional")), "the mask .* is not causal"),
        (lambda: exported(exported=ExportStyle(mask="top_left")), r"causal diagonal is at key <= query \+ 0"),
        (lambda: exported(exported=ExportStyle(qk_matmul_output=0)), "mode 0"),
        (causal_attention_without_cache, "from a graph input, not from a KV cache"),
        (attention_in_a_function, "inside function attend"),
        (window_attribute, "neither causal, a window nor padding"),
    ],
    ids=[
        "bidirectional",
        "top_left_causal",
        "raw_scores_read",
        "no_cache",
        "in_a_function",
        "top_left_window",
    ],
)
def test_unprovable_attention_is_left_alone(make, reason):
    model = make()
    before = ir.to_proto(model).SerializeToString()
    with pytest.warns(KvCacheWarning, match=reason):
        result = AttentionFusionPass()(model)
    assert not result.modified and count(model, "GroupQueryAttention") == 0
    assert ir.to_proto(model).SerializeToString() == before


def test_models_without_attention_are_untouched():
    model = build_decoder(num_layers=2)
    before = ir.to_proto(model).SerializeToString()
    assert not AttentionFusionPass()(model).modified
    assert ir.to_proto(model).SerializeToString() == before


def test_the_cli_calibrates_converts_and_evaluates_an_export(tmp_path, capsys):
    from onnx_kvcache.cli.commands import main

    scales, out, ids = tmp_path / "scales.json", tmp_path / "int8.onnx", tmp_path / "ids.json"
    ids.write_text(json.dumps([[int(t) for t in seq] for seq in CALIBRATION]))
    source = FIXTURE.read_bytes()
    quick = ["--token-ids", str(ids), "--seq-len", "128"]
    assert main(["calibrate", str(FIXTURE), "--out", str(scales), "--format", "int8", *quick]) == 0
    assert main(["convert", str(FIXTURE), str(out), "--format", "int8", "--scales", str(scales)]) == 0
    assert "converted 3 GroupQueryAttention node(s)" in capsys.readouterr().out
    assert main(["evaluate", str(FIXTURE), str(out), *quick]) == 0
    assert "top-1 agreement" in capsys.readouterr().out
    assert FIXTURE.read_bytes() == source
    onnx.checker.check_model(onnx.load(out), full_check=True)
    model = ir.load(out)
    assert count(model, "Attention") == 0
    assert {v.dtype for v in model.graph.inputs if v.name.startswith("past")} == {ir.DataType.INT8}
    assert len(KvCacheRunner(out).generate([1, 2, 3], 3)) == 3


def test_fused_export_keeps_its_interface(float_gqa):
    original = ir.load(FIXTURE)
    for a, b in (
        (float_gqa.graph.inputs, original.graph.inputs),
        (float_gqa.graph.outputs, original.graph.outputs),
    ):
        assert [(v.name, v.dtype, v.shape) for v in a] == [(v.name, v.dtype, v.shape) for v in b]
    onnx.checker.check_model(ir.to_proto(float_gqa), full_check=True)


def test_convert_fuses_an_export_without_reading_weights(tmp_path, monkeypatch):
    from onnx_kvcache import convert_model

    ir.save(exported(), tmp_path / "model.onnx", external_data="model.onnx.data")

    def read(*args, **kwargs):
        raise AssertionError("a weight was read")

    for method in ("numpy", "tobytes", "__array__"):
        monkeypatch.setattr(ir.ExternalTensor, method, read)
    result = convert_model(
        tmp_path / "model.onnx",
        tmp_path / "int8.onnx",
        format="int8",
        scales={0: (0.1, 0.05), 1: (0.1, 0.05)},
    )
    assert result.converted and result.nodes == 2
    monkeypatch.undo()
    assert len(KvCacheRunner(tmp_path / "int8.onnx").generate([1, 2, 3], 3)) == 3


def test_batched_chunks_after_a_prompt_are_gqas_limit():
    """onnxruntime's GQA (without query_seqlens) takes multi-token steps after a prompt at batch 1 only."""
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    def chunk(model: ir.Model, batch: int) -> np.ndarray:
        session = create_session(model)
        caches = {v.name: np.zeros((batch, 2, 4, 32), np.float32) for v in model.graph.inputs[3:]}
        feeds = {
            "input_ids": np.ones((batch, 3), np.int64),
            "attention_mask": np.ones((batch, 7), np.int64),
            "position_ids": np.tile(np.arange(4, 7), (batch, 1)),
        }
        return session.run(["logits"], feeds | caches)[0]

    original, model = ir.load(FIXTURE), fused(ir.load(FIXTURE))
    np.testing.assert_allclose(chunk(model, 1), chunk(original, 1), atol=1e-4)
    chunk(original, 2)
    with pytest.raises(InvalidArgument, match="batch_size must be 1 when sequence_length > 1 and past"):
        chunk(model, 2)


def test_nonzero_mask_values_count_as_tokens_like_the_export():
    """The export reads any nonzero attention_mask entry as a token; so does the fused model."""
    mask = np.array([[1, 1, 2, 1, 1, 3, 1]])
    original = ir.load(FIXTURE)
    worst = max_differences(generate(original, mask), generate(fused(ir.load(FIXTURE)), mask))
    assert max(worst.values()) < 1e-4, worst


@pytest.mark.parametrize("scale", [float("nan"), 0.0, -0.1])
def test_a_scale_attention_and_gqa_read_differently_is_left_alone(scale):
    model = ir.load(FIXTURE)
    first = next(n for n in model.graph if n.op_type == "Attention")
    first.attributes["scale"] = ir.AttrFloat32("scale", scale)
    with pytest.warns(FusionSkippedWarning, match=r"left as they are .*scale="):
        AttentionFusionPass()(model)
    assert count(model, "Attention") == 1 and count(model, "GroupQueryAttention") == 2


def test_gqa_fusion_says_what_a_padding_mask_assumes():
    from onnx_kvcache import GqaFusionPass

    model = ir.load(FIXTURE)
    with pytest.warns(PaddingAssumptionWarning, match="a prompt padded anywhere.*paused row") as caught:
        fusion = GqaFusionPass()
        fusion(model)
    assert fusion.fused == 3 and fusion.refused == []
    assert not any("Sliding-window" in str(w.message) for w in caught)  # the export has no window


def test_gqa_fusion_warns_about_windows_under_right_padding():
    from onnx_kvcache import GqaFusionPass

    with pytest.warns(
        PaddingAssumptionWarning,
        match="paused row.*Sliding-window layers differ.*padding after their first token",
    ):
        GqaFusionPass()(exported("mistral"))


def test_a_partly_fused_export_is_not_converted_and_the_runner_says_why(tmp_path, capsys):
    from onnx_kvcache.cli.commands import main

    model = ir.load(FIXTURE)
    first = next(n for n in model.graph if n.op_type == "Attention")
    first.attributes["scale"] = ir.AttrFloat32("scale", float("nan"))  # onnxruntime: the default
    path = tmp_path / "partial.onnx"
    ir.save(model, path)
    assert main(["convert", str(path), str(tmp_path / "out.onnx"), "--format", "int8", "--ep", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "fused 2 layer(s) but left 1 unfused" in err and not (tmp_path / "out.onnx").exists()
    with pytest.raises(KvCacheError, match="Cannot run this export: attention fusion fused 2 layer"):
        KvCacheRunner(path)


def test_a_refused_conversion_of_an_export_says_only_why(tmp_path, capsys):
    """Nothing is written, so nothing about what the fused model would compute."""
    from onnx_kvcache.cli.commands import main

    out = tmp_path / "o.onnx"
    assert main(["convert", str(FIXTURE), str(out), "--format", "fp8", "--ep", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not converted for cpu" in err and "padding" not in err
    assert not out.exists()


def test_an_export_in_memory_is_fused_for_running_and_left_as_it_is():
    """KvCacheRunner (and so calibrate_kv_cache) fuse a copy, as they do a file."""
    export = ir.load(FIXTURE)
    text = ir.to_onnx_text(export)
    logits = KvCacheRunner(export).prefill([1, 2, 3])
    assert ir.to_onnx_text(export) == text
    np.testing.assert_allclose(logits, KvCacheRunner(FIXTURE).prefill([1, 2, 3]), atol=1e-6)
    scales = calibrate_kv_cache(export, CALIBRATION, format="int8", seq_len=128, progress=False)
    assert list(scales.layer_ids) == [0, 1, 2] and ir.to_onnx_text(export) == text


def test_a_refused_export_gets_the_fix_its_fused_graph_would_take(tmp_path, capsys):
    from onnx_kvcache.cli.commands import main

    assert main(["convert", str(FIXTURE), str(tmp_path / "o.onnx"), "--format", "fp8", "--ep", "cpu"]) == 1
    fix = "Fix: --ep cuda runs fp8, if the model will run there; cpu runs --format int8 or int4."
    assert fix in capsys.readouterr().err  # cuda: with the attention in float16


@pytest.mark.parametrize("layers", [2, 3])
def test_refused_attention_nodes_are_grouped_and_listed_under_verbose(layers, tmp_path, caplog):
    """One short warning with a count per reason; each node in the INFO log (convert -v)."""
    import logging

    model = ir.load(FIXTURE)
    nodes = [n for n in model.graph if n.op_type == "Attention"][:layers]
    for node in nodes:
        node.attributes["scale"] = ir.AttrFloat32("scale", float("nan"))
    with caplog.at_level(logging.INFO), pytest.warns(FusionSkippedWarning, match="left as they are") as said:
        AttentionFusionPass()(model)
    message = str(said[0].message)
    assert f"{layers} Attention node(s) left as they are" in message
    assert f"({layers}; first {nodes[0].name})" in message and nodes[-1].name not in message
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Left ")]
    assert [line.split(":")[0] for line in logged] == [f"Left {n.name}" for n in nodes]
