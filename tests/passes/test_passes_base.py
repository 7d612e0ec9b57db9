"""The contract every pass keeps (``passes/_base.py``), as onnx-ir's passes do.

A refusal is raised by ``requires()`` before anything changes, as the library's
:class:`KvCachePreconditionError` (a :class:`KvCacheError`); under an onnx-ir ``PassManager``
it is the cause of onnx-ir's ``PassError``. A warning names the user's line, however the pass
was called. ``modified`` says whether the model changed.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheQuantizationPass, KvCacheWarning, convert_model, optimize_model
from onnx_kvcache.errors import KvCachePreconditionError, NotConvertedWarning
from onnx_kvcache.passes import KvCacheEmulationPass, PagedAttentionReferencePass

from conftest import gqa_model, paged_model

KV, HEAD = 2, 16


def scales(layers: int, n: int = 1) -> dict:
    return {i: (np.full(n, 0.05, np.float32), np.full(n, 0.04, np.float32)) for i in range(layers)}


def fp8_model(layers: int = 2) -> ir.Model:
    model = gqa_model(layers=layers, kv_heads=KV, head=HEAD)
    KvCacheQuantizationPass("fp8", scales=scales(layers))(model)
    return model


def node(model: ir.Model, index: int) -> ir.Node:
    """The ``index``-th attention node of the main graph."""
    return [n for n in model.graph if n.domain == "com.microsoft"][index]


def drop_input(model: ir.Model, layer: int, slot: int) -> ir.Model:
    node(model, layer).replace_input_with(slot, None)
    return model


def set_attr(model: ir.Model, layer: int, attr: ir.Attr) -> ir.Model:
    node(model, layer).attributes[attr.name] = attr
    return model


def delete_attr(model: ir.Model, layer: int, name: str) -> ir.Model:
    del node(model, layer).attributes[name]
    return model


def other_format_in_layer_1() -> ir.Model:
    """Layer 0 float, layer 1 already int8."""
    model = gqa_model(layers=2, kv_heads=KV, head=HEAD)
    second = gqa_model(layers=2, kv_heads=KV, head=HEAD)
    KvCacheQuantizationPass("int8", scales=scales(2))(second)
    for slot in (3, 4):
        node(model, 1).inputs[slot].dtype = node(second, 1).inputs[slot].dtype
    for name in ("k_quant_type", "v_quant_type", "kv_cache_bit_width"):
        node(model, 1).attributes[name] = node(second, 1).attributes[name]
    return model


def frozen_layer_0(model: ir.Model) -> ir.Model:
    """Layer 0 reads a non-empty initializer as its key cache: skipped with a warning."""
    init = ir.Value(name="frozen", const_value=ir.tensor(np.ones((1, KV, 2, HEAD), np.float32)))
    model.graph.register_initializer(init)
    node(model, 0).replace_input_with(3, init)
    return model


def wrong_heads_in_layer_1() -> ir.Model:
    model = gqa_model(layers=2, kv_heads=KV, head=HEAD)
    node(model, 1).inputs[3].shape = ir.Shape(["batch", 3, "past", HEAD])
    return model


def no_shapes() -> ir.Model:
    model = gqa_model(layers=2, kv_heads=KV, head=HEAD)
    for value in model.graph.inputs:
        value.shape = None
    return model


def latent_with_a_read_value_output() -> ir.Model:
    """Layer 1 keeps one (LATENT) cache but declares a value-cache output that a graph output reads."""
    model = paged_model(layers=2, num_heads=4, kv_heads=1, head=32, latent=True, v_head=24)
    old = node(model, 1)
    extra = ir.val("present.1.value", old.outputs[1].dtype, old.outputs[1].shape)
    new = ir.Node(
        old.domain,
        old.op_type,
        old.inputs,
        attributes=list(old.attributes.values()),
        outputs=[ir.Value(name=f"{v.name}_new", type=v.type, shape=v.shape) for v in old.outputs] + [extra],
        name=old.name,
    )
    ir.convenience.replace_nodes_and_values(
        model.graph, old, [old], [new], list(old.outputs), list(new.outputs[:2])
    )
    model.graph.outputs.append(extra)
    return model


def old_opset(model: ir.Model, opset: int) -> ir.Model:
    model.opset_imports[""] = opset
    return model


#: (model, pass, message): each refused, in layer 1 where a layer is named (layer 0 converts).
REFUSALS: dict[str, tuple[Callable[[], ir.Model], Callable[[], ir.passes.PassBase], str]] = {
    "quantization/int8-without-scales": (
        lambda: gqa_model(layers=2),
        lambda: KvCacheQuantizationPass("int8"),
        "needs calibrated scales",
    ),
    "quantization/scales-miss-layer-1": (
        lambda: gqa_model(layers=2),
        lambda: KvCacheQuantizationPass("int8", scales=scales(1)),
        r"no entry for layer\(s\) \[1\]",
    ),
    "quantization/scale-size": (
        lambda: gqa_model(layers=2, kv_heads=KV, head=HEAD),
        lambda: KvCacheQuantizationPass("int8", "per_channel", scales(2)),
        "These scales are per tensor",
    ),
    "quantization/other-format-in-layer-1-without-its-scales": (  # requantized from its own
        other_format_in_layer_1,
        lambda: KvCacheQuantizationPass("fp8"),
        r"gqa\.1: its key cache is int8 per_tensor, but its k_scale has no scale input; give scales=",
    ),
    "quantization/skipped-layer-0-other-format-in-layer-1": (  # the skip warning is not given
        lambda: frozen_layer_0(other_format_in_layer_1()),
        lambda: KvCacheQuantizationPass("fp8"),
        r"gqa\.1: its key cache is int8 per_tensor, but its k_scale has no scale input",
    ),
    "quantization/heads-in-layer-1": (
        wrong_heads_in_layer_1,
        lambda: KvCacheQuantizationPass("int8", scales=scales(2)),
        r"gqa\.1: its key cache has 3 heads",
    ),
    "quantization/no-head-size": (  # raised by gqa.py as KvCacheError: requires() retypes it
        no_shapes,
        lambda: KvCacheQuantizationPass("int8", "per_channel", scales(2, KV * HEAD)),
        "Run shape inference",
    ),
    "quantization/malformed-layer-1": (  # raised by gqa.py too
        lambda: delete_attr(gqa_model(layers=2), 1, "kv_num_heads"),
        lambda: KvCacheQuantizationPass("int8", scales=scales(2)),
        r"gqa\.1 lacks num_heads or kv_num_heads",
    ),
    "emulation/no-cos-cache-in-layer-1": (
        lambda: drop_input(fp8_model(), 1, 7),
        lambda: KvCacheEmulationPass("cuda"),
        r"gqa\.1: it has no cos_cache \(input 7\)",
    ),
    "emulation/no-k-scale-in-layer-1": (
        lambda: drop_input(fp8_model(), 1, 12),
        lambda: KvCacheEmulationPass("cuda", quantized_io=True),
        r"gqa\.1: it has no k_scale \(input 12\)",
    ),
    "emulation/fp8-cache-without-quant-type": (
        lambda: set_attr(fp8_model(), 1, ir.AttrString("k_quant_type", "NONE")),
        lambda: KvCacheEmulationPass("cpu"),
        r"gqa\.1: its cache is fp8 but its k_quant_type is 'NONE'",
    ),
    "emulation/old-opset": (
        lambda: old_opset(fp8_model(), 18),
        lambda: KvCacheEmulationPass("cuda"),
        r"needs opset >= 19",
    ),
    "paged/no-cos-cache-in-layer-1": (
        lambda: drop_input(paged_model(layers=2), 1, 8),
        PagedAttentionReferencePass,
        r"paged\.1 on CPU: it has no cos_cache \(input 8\)",
    ),
    "paged/no-block-table-in-layer-1": (
        lambda: drop_input(paged_model(layers=2), 1, 7),
        PagedAttentionReferencePass,
        r"paged\.1 on CPU: it has no block_table",
    ),
    "paged/rotary-offset-in-layer-1": (
        lambda: set_attr(paged_model(layers=2), 1, ir.AttrInt64("rotary_offset", 4)),
        PagedAttentionReferencePass,
        r"paged\.1: rotary_offset 4 \+ rotary_dim 16 exceeds head_size 16",
    ),
    "paged/q-norm-alone-in-layer-1": (
        lambda: drop_input(paged_model(layers=2, qk_norm=True), 1, 13),
        PagedAttentionReferencePass,
        r"paged\.1: q_norm_weight and k_norm_weight come together",
    ),
    "paged/no-value-in-layer-1": (
        lambda: drop_input(paged_model(layers=2), 1, 2),
        PagedAttentionReferencePass,
        r"paged\.1 on CPU: it has no value \(input 2\)",
    ),
    "paged/latent-value-output-read-in-layer-1": (
        latent_with_a_read_value_output,
        PagedAttentionReferencePass,
        r"paged\.1 on CPU: its output 2 \('present\.1\.value'\) is read",
    ),
    "paged/kv-heads-in-layer-1": (
        lambda: set_attr(paged_model(layers=2), 1, ir.AttrInt64("kv_num_heads", 3)),
        PagedAttentionReferencePass,
        r"paged\.1: num_heads 4 is not a multiple of kv_num_heads 3",
    ),
    "paged/old-opset": (
        lambda: old_opset(paged_model(layers=2), 17),
        PagedAttentionReferencePass,
        r"needs opset >= 19",
    ),
}


def snapshot(model: ir.Model) -> tuple[int, bytes]:
    """Node count (the readable part of a failure) and the serialized model."""
    nodes = sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))
    return nodes, ir.to_proto(model).SerializeToString()


def causes(error: BaseException | None) -> list[BaseException]:
    chain = []
    while error is not None:
        chain.append(error)
        error = error.__cause__
    return chain


@pytest.fixture(params=list(REFUSALS))
def refusal(request):
    build, make_pass, match = REFUSALS[request.param]
    model = build()
    return model, make_pass(), match, snapshot(model)


def test_a_refusal_is_our_error_and_changes_nothing(refusal):
    model, pass_, match, before = refusal
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(KvCachePreconditionError, match=match) as info:
            pass_(model)
    assert isinstance(info.value, KvCacheError)
    assert snapshot(model) == before
    assert not record  # a refused run warns nothing


def test_requires_alone_raises_the_refusal(refusal):
    model, pass_, match, before = refusal
    with pytest.raises(KvCachePreconditionError, match=match):
        pass_.requires(model)
    assert snapshot(model) == before


def test_call_alone_checks_every_node_before_the_first_change(refusal):
    model, pass_, match, before = refusal
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        with pytest.raises(KvCacheError, match=match):
            pass_.call(model)
    assert snapshot(model) == before


@pytest.mark.parametrize("nested", [False, True])
def test_a_pass_manager_chains_our_error_as_the_cause(refusal, nested):
    model, pass_, match, before = refusal
    manager = ir.passes.PassManager([pass_])
    if nested:
        manager = ir.passes.PassManager([ir.passes.Sequential(manager)], steps=2)
    with pytest.raises(ir.passes.PassError) as info:
        manager(model)
    ours = [e for e in causes(info.value) if isinstance(e, KvCachePreconditionError)]
    assert len(ours) == 1
    assert ours[0] is causes(info.value)[-1]  # the root cause, nothing hidden beneath it
    assert re.search(match, str(ours[0]))
    assert snapshot(model) == before


# -- warnings name the caller's line -------------------------------------------------


def unit_scales_warnings(run: Callable[[], object]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run()
    return [w for w in record if issubclass(w.category, KvCacheWarning)]


CALLERS: dict[str, Callable[[ir.Model], object]] = {
    "direct": lambda model: KvCacheQuantizationPass("fp8")(model),
    "pass-manager": lambda model: ir.passes.PassManager([KvCacheQuantizationPass("fp8")])(model),
    "nested-managers": lambda model: ir.passes.PassManager(
        [ir.passes.Sequential(ir.passes.PassManager([KvCacheQuantizationPass("fp8")], steps=2))]
    )(model),
    "functionalized": lambda model: ir.passes.functionalize(KvCacheQuantizationPass("fp8"))(model),
    "optimize_model": lambda model: optimize_model(model, ep=None, format="fp8"),
}


@pytest.mark.parametrize("caller", list(CALLERS))
def test_a_warning_names_the_callers_line(caller):
    found = unit_scales_warnings(lambda: CALLERS[caller](gqa_model(layers=2)))
    assert [w.message.args[0][:33] for w in found] == ["No KV-cache scales given: using u"]
    assert found[0].filename == __file__


def test_a_skipped_node_is_warned_at_the_callers_line():
    model = frozen_layer_0(gqa_model(layers=2, kv_heads=KV, head=HEAD))
    found = unit_scales_warnings(
        lambda: ir.passes.PassManager([KvCacheQuantizationPass("int8", scales=scales(2))])(model)
    )
    assert len(found) == 1 and "non-empty initializer" in str(found[0].message)
    assert found[0].filename == __file__


def test_optimize_models_refusal_warning_names_the_callers_line():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        optimize_model(gqa_model(), ep="cpu", format="fp8")
    found = [w for w in record if issubclass(w.category, NotConvertedWarning)]
    assert len(found) == 1 and found[0].filename == __file__


def test_convert_models_warning_names_the_callers_line(tmp_path):
    source, target = tmp_path / "model.onnx", tmp_path / "fp8.onnx"
    ir.save(gqa_model(), source)
    found = unit_scales_warnings(lambda: convert_model(source, target, format="fp8", ep=None))
    assert found and {w.filename for w in found} == {__file__}
    assert target.exists()


# -- modified ----------------------------------------------------------------------

#: (model, pass) that rewrite the model once; a second run finds nothing to do.
REWRITES: dict[str, tuple[Callable[[], ir.Model], Callable[[], ir.passes.PassBase]]] = {
    "quantization": (lambda: gqa_model(layers=2), lambda: KvCacheQuantizationPass("int8", scales=scales(2))),
    "emulation": (fp8_model, lambda: KvCacheEmulationPass("cuda")),
    "emulation-quantized-io": (fp8_model, lambda: KvCacheEmulationPass("cuda", quantized_io=True)),
    "paged-reference": (lambda: paged_model(layers=2), PagedAttentionReferencePass),
}


@pytest.mark.parametrize("case", list(REWRITES))
def test_modified_is_true_once_then_false_with_nothing_changed(case):
    build, make_pass = REWRITES[case]
    model = build()
    before, names = snapshot(model), [v.name for v in model.graph.outputs]
    assert make_pass()(model).modified
    assert snapshot(model) != before
    assert [v.name for v in model.graph.outputs] == names
    after = snapshot(model)
    assert not make_pass()(model).modified
    assert snapshot(model) == after


@pytest.mark.parametrize(
    "make_pass",
    [
        lambda: KvCacheQuantizationPass("int8", scales=scales(2)),
        lambda: KvCacheEmulationPass("cuda"),
        PagedAttentionReferencePass,
    ],
    ids=["quantization", "emulation", "paged-reference"],
)
def test_a_model_without_attention_is_not_modified(make_pass):
    model = gqa_model()
    model.graph.remove(node(model, 0))
    model.graph.outputs.clear()
    before = snapshot(model)
    assert not make_pass()(model).modified
    assert snapshot(model) == before
