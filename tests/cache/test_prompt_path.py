"""A quantized node wrapped so that its prompt attends through the float kernel: the site is the
wrapped node, with its wrapper's outputs; undoing it gives back the quantized node, byte for byte
in onnxruntime; the passes that rewrite attention nodes start from it undone."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheRunner, KvCacheWarning, convert_model, optimize_model
from onnx_kvcache.cache.prompt_path import WRAPPED_SUFFIX, unwrap, wrapped_node
from onnx_kvcache.cache.sites import find_gqa_sites
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.passes import PromptFloatAttentionPass
from onnx_kvcache.passes.kv_cache_emulation import emulate_kv_cache
from onnx_kvcache.runtime._scoring import call_pattern

from conftest import CPU_FORMATS, GRANULARITIES, quantized_decoder

LAYERS = 2


_quantized = quantized_decoder


def _wrapped(fmt: str, granularity: str = "per_tensor") -> ir.Model:
    model = _quantized(fmt, granularity)
    PromptFloatAttentionPass()(model)
    return model


def _outputs(model: ir.Model, ids: np.ndarray) -> dict[str, np.ndarray]:
    sess = create_session(model)
    types = {"tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(float)": np.float32}
    feeds = {
        i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), types[i.type])
        for i in sess.get_inputs()
        if i.name.startswith("past_key_values")
    }
    feeds |= {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", CPU_FORMATS)
def test_the_site_is_the_wrapped_node_with_its_wrappers_outputs(fmt, granularity):
    plain, model = _quantized(fmt, granularity), _wrapped(fmt, granularity)
    sites, before = find_gqa_sites(model), find_gqa_sites(plain)
    assert len(sites) == LAYERS and all(s.wrapper is not None for s in sites)
    assert [s.layer_id for s in sites] == [s.layer_id for s in before]
    for site, old in zip(sites, before, strict=True):
        assert site.past_key is not None and site.past_key.is_graph_input()
        assert site.present_key is not None and site.present_key.is_graph_output()
        assert site.present_key.name == old.present_key.name  # the caller's name
        assert site.node.outputs[1].name == f"{old.present_key.name}{WRAPPED_SUFFIX}"
        assert (site.cache_format, site.granularity) == (old.cache_format, old.granularity)


@pytest.mark.parametrize("fmt", CPU_FORMATS)
def test_unwrap_gives_back_the_quantized_node(fmt):
    plain, model = _quantized(fmt, "per_channel"), _wrapped(fmt, "per_channel")
    assert unwrap(model) == LAYERS and unwrap(model) == 0
    assert [n.op_type for n in model.graph] == [n.op_type for n in plain.graph]
    assert [v.name for v in model.graph.outputs] == [v.name for v in plain.graph.outputs]
    ids = np.random.default_rng(0).integers(0, 300, (1, 16), dtype=np.int64)
    got, want = _outputs(model, ids), _outputs(plain, ids)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)


def test_an_if_of_another_shape_is_not_a_wrapper():
    model = _wrapped("int8")
    wrapper = next(n for n in model.graph if n.op_type == "If")
    assert wrapped_node(wrapper) is not None
    other = wrapper.attributes["else_branch"].value
    other.append(ir.node("Identity", [other.outputs[0]], name="extra"))  # two nodes in the branch
    assert wrapped_node(wrapper) is None
    assert sum(1 for s in find_gqa_sites(model, with_cache_only=False) if s.wrapper is not None) == LAYERS - 1


def test_a_packed_cache_below_opset_18_is_left_in_the_quantized_kernel():
    model = _quantized("int4", opset=17)
    wrap = PromptFloatAttentionPass()
    assert not wrap(model).modified
    assert len(wrap.skipped) == LAYERS and all("opset 18" in why for why in wrap.skipped.values())
    int8 = _quantized("int8", opset=17)
    assert PromptFloatAttentionPass()(int8).modified  # int8 needs no unpacking


@pytest.mark.parametrize("fmt", CPU_FORMATS)
def test_convert_for_the_cpu_wraps_and_for_no_target_does_not(fmt, tmp_path):
    src, scales = tmp_path / "model.onnx", {layer: (0.05, 0.05) for layer in range(LAYERS)}
    ir.save(build_decoder(num_layers=LAYERS, vocab_size=300), src)
    convert_model(src, tmp_path / "cpu.onnx", format=fmt, scales=scales, ep="cpu", progress=False)
    convert_model(src, tmp_path / "none.onnx", format=fmt, scales=scales, ep=None, progress=False)
    cpu, none = (find_gqa_sites(ir.load(tmp_path / f"{n}.onnx")) for n in ("cpu", "none"))
    assert [s.wrapper is not None for s in cpu] == [True] * LAYERS
    assert [s.wrapper is not None for s in none] == [False] * LAYERS


def test_converting_a_wrapped_model_again_rewrites_the_quantized_node():
    model = _wrapped("int8", "per_channel")
    optimize_model(model, ep="cpu", format="int4", granularity="per_channel")
    sites = find_gqa_sites(model)
    assert all(s.wrapper is not None and s.cache_bit_width == 4 for s in sites)
    assert sum(1 for n in model.graph if n.op_type == "If") == LAYERS  # not wrapped twice
    ids = np.random.default_rng(1).integers(0, 300, (1, 9), dtype=np.int64)
    assert np.all(np.isfinite(_outputs(model, ids)["logits"]))


def test_the_runner_runs_the_prompt_in_float_and_steps_in_the_quantized_kernel():
    float_model, model, plain = (
        build_decoder(num_layers=LAYERS, vocab_size=300),
        _wrapped("int8"),
        _quantized("int8"),
    )
    ids = np.random.default_rng(2).integers(0, 300, 12)
    runners = [KvCacheRunner(m) for m in (float_model, model, plain)]
    prompts = [r.prefill(ids)[0] for r in runners]
    np.testing.assert_allclose(prompts[1], prompts[0], rtol=0, atol=1e-5)
    assert np.abs(prompts[2] - prompts[0]).max() > 1e-3  # the quantized kernel's prompt is not float's
    wrapped = runners[1]
    assert "prompt in float" in wrapped.kernel_rule
    assert not call_pattern(wrapped).whole_window  # evaluate scores a token a call
    steps = [r.step(7)[0] for r in runners[1:]]
    assert np.abs(steps[0] - steps[1]).max() > 0  # a step reads a cache stored from float K/V


def test_the_emulation_runs_the_node_as_it_is():
    model = _wrapped("int8")
    emulated, plain = emulate_kv_cache(model, "cuda"), emulate_kv_cache(_quantized("int8"), "cuda")
    assert not any(n.op_type == "If" for n in emulated.graph)
    assert [n.op_type for n in emulated.graph] == [n.op_type for n in plain.graph]
    assert len(find_gqa_sites(model)) == LAYERS and find_gqa_sites(model)[0].wrapper is not None  # unchanged


def test_a_model_as_asked_but_for_its_prompt_converts_to_the_wrapped_form(tmp_path):
    """A model converted before ``convert`` wrapped (or by another tool): asked for its own
    format for the CPU, it is wrapped; once wrapped, it is as asked."""
    src = tmp_path / "plain.onnx"
    ir.save(_quantized("int8"), src)
    result = convert_model(src, tmp_path / "wrapped.onnx", format="int8", ep="cpu", progress=False)
    assert result.converted
    assert all(s.wrapper is not None for s in find_gqa_sites(ir.load(tmp_path / "wrapped.onnx")))
    with pytest.warns(KvCacheWarning, match="already"):
        again = convert_model(tmp_path / "wrapped.onnx", tmp_path / "again.onnx", format="int8", ep="cpu")
    assert not again.converted and not (tmp_path / "again.onnx").exists()


@pytest.mark.parametrize("fmt", CPU_FORMATS)
def test_the_wrapped_model_passes_onnxs_full_check(fmt, tmp_path):
    """Both branches and the If declare every output's type, also where the export declared
    none for the attention's output (onnx's If inference compares them)."""
    import onnx

    model = _quantized(fmt)
    for site in find_gqa_sites(model):
        site.node.outputs[0].type = None  # as exports leave it
        site.node.outputs[0].shape = None
    PromptFloatAttentionPass()(model)
    ir.save(model, tmp_path / "m.onnx")
    onnx.checker.check_model(onnx.load(tmp_path / "m.onnx"), full_check=True)
    onnx.shape_inference.infer_shapes(onnx.load(tmp_path / "m.onnx"), strict_mode=True)


def test_convert_says_how_many_layers_it_wrapped(tmp_path, capsys):
    """The line describes what was written: a CPU int8 output's layers, none for CUDA's fp8."""
    from onnx_kvcache.cli.commands import main

    src = tmp_path / "model.onnx"
    ir.save(build_decoder(num_layers=LAYERS, vocab_size=300, dtype="float16"), src)
    scales = tmp_path / "s.json"
    scales.write_text('{"scales": {"k_scales": [0.05, 0.05], "v_scales": [0.05, 0.05]}, "qmax": 128}')
    argv = ["convert", str(src), str(tmp_path / "cpu.onnx"), "--scales", str(scales), "--format", "int8"]
    assert main([*argv, "--ep", "cpu"]) == 0
    assert f"prompt in float: in {LAYERS} layer(s)" in capsys.readouterr().out
    again = ["convert", str(tmp_path / "cpu.onnx"), str(tmp_path / "fp8.onnx"), "--format", "fp8"]
    assert main([*again, "--ep", "cuda"]) == 0
    assert "prompt in float" not in capsys.readouterr().out


def test_a_node_that_outputs_its_probabilities_is_left_alone():
    """The If carries three outputs; a node with a fourth (``qk_output``) keeps the quantized kernel."""
    model = _quantized("int8")
    old = find_gqa_sites(model)[0].node
    attrs = {k: a.value for k, a in old.attributes.items()} | {"qk_output": 2}
    new = ir.node(old.op_type, list(old.inputs), attrs, domain=old.domain, num_outputs=4, name=old.name)
    model.graph.insert_before(old, new)
    names = [o.name for o in old.outputs]
    ir.convenience.replace_all_uses_with(list(old.outputs), list(new.outputs)[:3], replace_graph_outputs=True)
    model.graph.remove(old, safe=True)
    for value, name in zip(new.outputs, [*names, "probs"], strict=True):
        value.name = name
    model.graph.outputs.append(new.outputs[3])
    wrap = PromptFloatAttentionPass()
    assert wrap.wrappable(model) == LAYERS - 1
    wrap(model)
    assert list(wrap.skipped.values()) == ["it outputs its attention scores or probabilities (qk_output)"]
    assert [s.wrapper is not None for s in find_gqa_sites(model)] == [False, True]
