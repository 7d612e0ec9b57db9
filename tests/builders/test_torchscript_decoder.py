"""TorchScript (optimum / onnx-community) exports: the builder's form, fused and converted.

The builder's ``optimum-*`` presets write what ``optimum-cli export onnx`` writes (see
``tests/data/optimum_llama``, a real one): opset 18, no value_info, masks built with
ConstantOfShape/Where/Expand, rotary and repeat_kv written out. Every layer must fuse
into GroupQueryAttention and compute what the export computes.
"""

from __future__ import annotations

import collections
import json
import logging
import pathlib
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from decoding import PROMPTS, count, generate, max_differences
from onnx_kvcache import GqaFusionPass, KvCacheWarning, optimize_model
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import FusionSkippedWarning
from onnx_kvcache.model_io._sessions import create_session

from builders.exported import EXPORT_PRESETS, build_decoder, exported_config
from conftest import gqa_nodes

FIXTURE = pathlib.Path(__file__).parents[1] / "data" / "optimum_llama" / "model.onnx"
FAMILIES = ["optimum-llama", "optimum-qwen2", "optimum-mistral", "optimum-phi3", "optimum-gemma2"]
WINDOWED = {"optimum-mistral", "optimum-gemma2"}
SCENARIOS = {
    "single": PROMPTS["single"],  # prefill 7 + 3 decode steps
    "left_padded": PROMPTS["left_padded"],
    "right_padded": PROMPTS["right_padded"],
    "longer_than_window": np.ones((1, 70), np.int64),  # window 64
}


def export(name: str, **overrides) -> ir.Model:
    """The shared optimum export, or a builder preset (2 layers, window 64)."""
    if name == "fixture":
        return ir.load(FIXTURE)
    settings = {"num_layers": 2, "vocab_size": 300, "sliding_window": 64} | overrides
    return build_decoder(exported_config(name, **settings))


def layers(model: ir.Model) -> int:
    return sum(1 for v in model.graph.inputs if v.name.endswith(".key"))


def fused(model: ir.Model, **options) -> ir.Model:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)  # what a padding mask assumes
        return optimize_model(model, **options)


def scenarios(name: str) -> list[str]:
    """Right padding under a window is what GQA and the export count differently (documented)."""
    return [s for s in SCENARIOS if not (s == "right_padded" and name in WINDOWED)]


def test_the_builder_writes_what_optimum_writes():
    real = ir.load(FIXTURE)
    model = build_decoder(exported_config("optimum-llama", num_layers=3, vocab_size=512))

    def signature(values):
        return [(v.name, v.dtype, str(v.shape)) for v in values]

    assert signature(model.graph.inputs) == signature(real.graph.inputs)
    assert signature(model.graph.outputs) == signature(real.graph.outputs)
    ops = {n.op_type for n in model.graph}
    assert ops == {n.op_type for n in real.graph} - {"Identity"}  # optimum's tied-weight copies
    assert model.opset_imports == real.opset_imports == {"": 18}
    io = {*model.graph.inputs, *model.graph.outputs}
    assert all(v.shape is None and v.type is None for n in model.graph for v in n.outputs if v not in io)


@pytest.mark.parametrize(
    ("name", "ops"),
    [
        ("optimum-qwen2", {"Add": 3 * 2}),  # q/k/v biases
        ("optimum-phi3", {"Slice": 5 * 2}),  # qkv split in three, gate/up in two
        ("optimum-gemma2", {"Tanh": 2 + 1}),  # soft-capped attention and logits (and GELU)
        ("optimum-llama-q4", {"MatMulNBits": 7 * 2 + 1}),
        ("optimum-llama-quantized", {"MatMulInteger": 7 * 2 + 1, "DynamicQuantizeLinear": 7 * 2 + 1}),
    ],
)
def test_family_variations_are_written(name, ops):
    base = collections.Counter(n.op_type for n in export("optimum-llama").graph)
    model = collections.Counter(n.op_type for n in export(name).graph)
    for op_type, extra in ops.items():
        assert model[op_type] - base[op_type] >= extra


@pytest.mark.parametrize(
    ("name", "scenario"),
    [(n, s) for n in ["fixture", *FAMILIES, "optimum-llama-q4"] for s in scenarios(n)],
)
def test_every_layer_fuses_and_computes_what_the_export_computes(name, scenario):
    original, model = export(name), fused(export(name))
    assert count(model, "GroupQueryAttention") == layers(original) and count(model, "Softmax") == 0
    worst = max_differences(generate(original, SCENARIOS[scenario]), generate(model, SCENARIOS[scenario]))
    assert max(worst.values()) < 1e-4, worst


@pytest.mark.parametrize("scenario", ["single", "longer_than_window"])
def test_the_int8_weight_export_fuses_and_matches_one_row(scenario):
    """model_quantized.onnx quantizes activations per tensor over the whole batch, so a batch's
    padding rows (which GQA computes differently) move every row's scale: one row is exact."""
    original, model = export("optimum-llama-quantized"), fused(export("optimum-llama-quantized"))
    assert count(model, "GroupQueryAttention") == 2
    worst = max_differences(generate(original, SCENARIOS[scenario]), generate(model, SCENARIOS[scenario]))
    assert max(worst.values()) < 1e-4, worst


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", [*FAMILIES, "optimum-llama-q4"])
def test_half_precision_exports_fuse_to_half_precision_attention(name, dtype):
    from onnx_kvcache.passes.bfloat16_to_float import Bfloat16ToFloatPass

    original, model = (
        export(name, dtype=dtype),
        fused(export(name, dtype=dtype), ep=None),
    )
    gqa = gqa_nodes(model)
    assert len(gqa) == 2 and {n.inputs[0].dtype for n in gqa} == {getattr(ir.DataType, dtype.upper())}
    if dtype == "bfloat16":  # the CPU has no bf16 kernels: both compute in float32, as the runner does
        Bfloat16ToFloatPass()(original)
        Bfloat16ToFloatPass()(model)
    worst = max_differences(generate(original, PROMPTS["single"]), generate(model, PROMPTS["single"]))
    assert max(worst.values()) < 1e-2, worst  # fp16 rounding: the two compute in different orders


def test_softcap_scale_and_windows_come_from_the_graph():
    model = fused(export("optimum-gemma2", num_layers=3))
    gqa = gqa_nodes(model)
    got = [
        {k: a.value for k, a in n.attributes.items() if k in ("scale", "softcap", "local_window_size")}
        for n in gqa
    ]
    assert [g.pop("local_window_size", None) for g in got] == [64, None, 64]  # layers 0 and 2 slide
    assert got == [{"scale": pytest.approx(48**-0.5), "softcap": pytest.approx(50.0)}] * 3


@pytest.mark.parametrize("name", ["fixture", *FAMILIES, "optimum-llama-q4", "optimum-llama-quantized"])
def test_convert_int8_for_cpu_runs_the_steps(name, tmp_path, capsys):
    src, out = tmp_path / "model.onnx", tmp_path / "int8.onnx"
    ir.save(export(name), src)
    n = layers(ir.load(src))
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.1] * n, "v_scales": [0.1] * n}, "qmax": 128}))
    argv = ["convert", str(src), str(out), "--format", "int8", "--ep", "cpu", "--scales", str(scales)]
    assert main(argv) == 0
    assert (
        f"converted {n} GroupQueryAttention node(s) (fused from the export's {n}" in capsys.readouterr().out
    )
    model = ir.load(out)
    assert {n.inputs[3].dtype for n in gqa_nodes(model)} == {ir.DataType.INT8}
    for scenario in ("single", "left_padded", "longer_than_window"):
        for mask, result in generate(model, SCENARIOS[scenario]):
            assert np.all(np.isfinite(result["logits"]))
            assert result["present.0.key"].shape[2] == mask.shape[1]


@pytest.mark.parametrize("name", [*FAMILIES, "optimum-llama-q4"])
def test_fp16_exports_convert_to_fp8_for_cuda_and_type_check(name):
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as OrtNotImplemented

    model = fused(
        export(name, dtype="float16"),
        ep="cuda",
        fp8_kv_cache=True,
        scales={0: (0.05, 0.05), 1: (0.05, 0.05)},
    )
    gqa = gqa_nodes(model)
    assert len(gqa) == 2 and {n.inputs[3].dtype for n in gqa} == {ir.DataType.FLOAT8E4M3FN}
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    with pytest.raises(OrtNotImplemented, match="NOT_IMPLEMENTED") as error:
        create_session(model)  # fp8 GQA has no CPU kernel
    assert "GroupQueryAttention" in str(error.value)


def unguarded(name: str = "optimum-llama") -> ir.Model:
    """Each NaN guard fills 0.5: the softmax output is then not what GQA gives."""
    model = export(name)
    half = ir.Value(name="half", const_value=ir.tensor(np.array([0.5], np.float32)))
    half.dtype, half.shape = ir.DataType.FLOAT, ir.Shape([1])
    model.graph.register_initializer(half)
    for node in model.graph:
        guard = node.inputs[0].producer() if node.op_type == "Where" else None
        if guard is not None and guard.op_type == "IsNaN":
            node.replace_input_with(1, half)
    return model


def test_a_refusal_is_one_line_grouped_with_counts():
    model = unguarded()
    with pytest.warns(KvCacheWarning) as said:
        GqaFusionPass()(model)
    (message,) = [str(w.message) for w in said]
    assert message.startswith("2 decomposed attention(s) left as they are not provably GroupQueryAttention")
    assert message.count("not a NaN guard") == 1 and "(2; first /MatMul_" in message


def test_convert_refuses_in_one_line_and_lists_each_node_under_verbose(tmp_path, capsys, caplog):
    src = tmp_path / "model.onnx"
    ir.save(unguarded(), src)
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.1] * 2, "v_scales": [0.1] * 2}, "qmax": 128}))
    argv = ["convert", str(src), str(tmp_path / "o.onnx"), "--format", "int8", "--scales", str(scales)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    refusal = [line for line in err if "not provably" in line]
    assert len(refusal) == 1 and "(2; first " in refusal[0] and "-v lists each node" in refusal[0]
    assert not (tmp_path / "o.onnx").exists()
    caplog.set_level(logging.INFO)  # what -v shows (INFO records on stderr)
    assert main([*argv, "-v"]) == 1
    each = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Left /MatMul_")]
    assert len(each) == 2 and all("not a NaN guard" in m for m in each)


def test_a_padding_lookup_of_the_wrong_width_is_refused():
    """Gather(Flatten(mask), b * width + j) reads mask[b, j] only with the mask's own width."""
    model = export("optimum-llama")
    flatten = next(n for n in model.graph if n.op_type == "Flatten")
    ((gather, _),) = flatten.outputs[0].uses()
    index = gather.inputs[1].producer()
    mul = next(
        v.producer() for v in index.inputs if v.producer() is not None and v.producer().op_type == "Mul"
    )
    seven = ir.Value(name="seven", const_value=ir.tensor(np.array([7], np.int64)))
    seven.dtype, seven.shape = ir.DataType.INT64, ir.Shape([1])
    model.graph.register_initializer(seven)
    mul.replace_input_with(1, seven)
    fusion = GqaFusionPass()
    with pytest.warns(FusionSkippedWarning, match="2 decomposed attention"):
        fusion(model)
    assert fusion.fused == 0 and count(model, "GroupQueryAttention") == 0


def test_presets_list_the_torchscript_forms():
    assert {"optimum-llama-q4", "optimum-llama-quantized", *FAMILIES} <= set(EXPORT_PRESETS)


def test_what_a_form_does_not_write_is_refused():
    from onnx_kvcache import KvCacheError

    from builders.exported import ExportStyle

    with pytest.raises(KvCacheError, match="TorchScript form: set exporter='torchscript'"):
        build_decoder(exported_config("llama", exported=ExportStyle(fused_qkv=True)))
    with pytest.raises(KvCacheError, match="does not write qk_norm"):
        build_decoder(exported_config("optimum-llama", qk_norm=True))
    with pytest.raises(KvCacheError, match="int8 needs dtype float32"):
        build_decoder(exported_config("optimum-llama-quantized", dtype="float16"))
