"""What attention reads Q, K and V through (issue 46): Casts to a tensor's own type read as the
identities they are, Casts between float types that GroupQueryAttention computes otherwise
refused by name, and K/V heads repeated by Tile regrouped (``_reads``).

The exports are the builder's ONNX ``Attention`` form (opset 23) with the Casts inserted where
exporters write them (TorchScript's GPT-J: ``q.to(torch.float32)`` and ``k.to(torch.float32)``
in a float32 model, the present cache itself such a Cast); each fused model runs against its
export on onnxruntime's CPU.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from surgery import PRODUCERS, insert_after

from decoding import PROMPTS, count, generate, max_differences
from onnx_kvcache import KvCacheWarning
from onnx_kvcache.passes.fusion._attention_facts import check_precision
from onnx_kvcache.passes.fusion._match import CacheLink
from onnx_kvcache.passes.fusion._reads import read_through, tiled_order
from onnx_kvcache.passes.fusion._symbolic import SymbolicEvaluator, Unprovable
from onnx_kvcache.passes.fusion.attention_fusion import AttentionFusionPass
from onnx_kvcache.passes.fusion.sdpa_fusion import DecomposedAttentionFusionPass

from builders.exported import build_decoder, exported_config

F16, F32 = ir.DataType.FLOAT16, ir.DataType.FLOAT


def exported(dtype: str = "float32") -> ir.Model:
    return build_decoder(exported_config("llama", num_layers=2, vocab_size=300, dtype=dtype))


def _attention_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "Attention"]


def _cast_inputs(model: ir.Model, slots: tuple[int, ...], to: ir.DataType, back: ir.DataType | None) -> None:
    """A Cast to ``to`` in front of each Attention's inputs ``slots``; ``back``: its output cast so."""
    for node in _attention_nodes(model):
        for slot in slots:
            source = node.inputs[slot]
            assert source is not None
            cast = ir.node("Cast", [source], {"to": to}, name=f"{node.name}/Cast_{slot}")
            cast.outputs[0].dtype = to
            model.graph.insert_before(node, cast)
            node.replace_input_with(slot, cast.outputs[0])
        if back is not None:
            insert_after(model, node.outputs[0], "Cast", name=f"{node.name}/Cast_back", to=back)


def _present_through_cast(model: ir.Model) -> None:
    """Each present key output a Cast to its own type of the concatenation, which attention reads
    (TorchScript's GPT-J: ``key = key.to(torch.float32)`` after the cache update)."""
    for index, output in enumerate(list(model.graph.outputs)):
        if not (output.name or "").endswith(".key"):
            continue
        concat = output.producer()
        assert concat is not None and concat.op_type == "Concat"
        name = output.name
        cast = ir.node("Cast", [output], {"to": F32}, name=f"{concat.name}/Cast")
        model.graph.insert_after(concat, cast)
        for user, slot in list(output.uses()):
            if user is not cast:
                user.replace_input_with(slot, cast.outputs[0])
        output.name, cast.outputs[0].name = f"{name}/concat", name
        cast.outputs[0].dtype, cast.outputs[0].shape = output.dtype, output.shape
        model.graph.outputs[index] = cast.outputs[0]


def exported_casts(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "Cast"]


def _same_type_casts() -> ir.Model:
    model = exported()
    _present_through_cast(model)
    _cast_inputs(model, (0, 1, 2), F32, None)
    return model


@pytest.mark.parametrize("prompt", ["single", "left_padded"])
def test_casts_to_the_type_a_tensor_has_are_identities(prompt):
    original, model = _same_type_casts(), _same_type_casts()
    assert AttentionFusionPass()(model).modified
    inserted = {n.name for n in exported_casts(original)} - {n.name for n in exported_casts(exported())}
    assert count(model, "GroupQueryAttention") == 2 and len(inserted) == 8
    assert not inserted & {n.name for n in exported_casts(model)}  # read as identities, removed
    # the present graph outputs are GQA's presents, not a Cast of them (the converter retypes them)
    presents = [v for v in model.graph.outputs if (v.name or "").startswith("present")]
    assert {v.producer().op_type for v in presents} == {"GroupQueryAttention"}
    assert [v.name for v in model.graph.outputs] == [v.name for v in original.graph.outputs]
    worst = max_differences(generate(original, PROMPTS[prompt]), generate(model, PROMPTS[prompt]))
    assert max(worst.values()) < 1e-4, worst


def test_an_attention_widened_to_float32_in_a_float16_model_is_refused_by_name():
    """Q, K and V of an fp16 model cast to float32 for attention: GQA multiplies the probabilities
    by V in float16, the export in float32."""
    model = exported("float16")
    _cast_inputs(model, (0, 1, 2), F32, F16)
    with pytest.warns(KvCacheWarning, match="V reaches attention widened from float16 to float32"):
        assert not AttentionFusionPass()(model).modified
    assert count(model, "GroupQueryAttention") == 0


@pytest.mark.parametrize("prompt", ["single", "left_padded"])
def test_a_float16_attention_that_widens_q_and_k_fuses_and_computes_as_the_export(prompt):
    """transformers 5's eager GPT-J in float16 (torch.onnx.export, opset 23): Q and K cast to
    float32 for the scores, the probabilities cast back to float16 for V, which is what
    GroupQueryAttention computes (onnxruntime's CPU kernel in float16; measured equal)."""
    path = PRODUCERS / "torch-tf5" / "dynamo-opset23-optimize-f16-eager" / "gptj" / "model.onnx"
    original, model = ir.load(path), ir.load(path)
    widening = [n for n in original.graph if n.op_type == "Cast" and n.attributes["to"].as_int() == F32]
    assert any(n.inputs[0].dtype == F16 for n in widening)
    assert DecomposedAttentionFusionPass()(model).modified and count(model, "GroupQueryAttention") == 2
    worst = max_differences(generate(original, PROMPTS[prompt]), generate(model, PROMPTS[prompt]))
    assert max(worst.values()) < 1e-2, worst


def test_a_narrowing_cast_in_front_of_attention_is_refused_naming_it():
    model = exported()
    for node in _attention_nodes(model):  # K rounded to float16 and widened back
        key = node.inputs[1]
        assert key is not None
        narrow = insert_after(model, key, "Cast", name=f"{node.name}/narrow", to=F16)
        narrow.outputs[0].dtype = F16
        insert_after(model, narrow.outputs[0], "Cast", name=f"{node.name}/widen", to=F32)
    with pytest.warns(KvCacheWarning, match="through Cast node '.*narrow' from float to float16"):
        assert not AttentionFusionPass()(model).modified


def _link(widened: ir.DataType | None) -> CacheLink:
    value = ir.val("v", F16, [1, 2, 3, 16])
    return CacheLink(value, value, value, 1, widened=widened)


@pytest.mark.parametrize(
    ("query", "key", "value", "refused"),
    [
        (None, None, None, None),
        (F16, F16, None, None),  # an fp16 model that upcasts its scores: GQA's computation
        (F16, F16, F16, "V reaches attention widened"),
        (None, F16, None, "Q reaches the scores in its own type and K widened from float16"),
        (F16, None, None, "Q reaches the scores widened from float16 to float32 and K in its own"),
    ],
)
def test_which_widening_casts_gqa_computes(query, key, value, refused):
    if refused is None:
        check_precision(query, _link(key), _link(value))
        return
    with pytest.raises(Unprovable, match=refused):
        check_precision(query, _link(key), _link(value))


def test_read_through_names_the_type_a_cast_widens_from():
    x = ir.val("x", F16, [1, 4, 3, 16])
    same = ir.node("Cast", [x], {"to": F16}, name="same")
    widen = ir.node("Cast", [same.outputs[0]], {"to": F32}, name="widen")
    copy = ir.node("Identity", [widen.outputs[0]], name="copy")
    ir.Graph([x], copy.outputs, nodes=[same, widen, copy], opset_imports={"": 23})
    chain: list[ir.Node] = []
    value, widened = read_through(SymbolicEvaluator(), copy.outputs[0], chain, "Q")
    assert value is x and widened == F16 and [n.name for n in chain] == ["copy", "widen", "same"]


@pytest.mark.parametrize(("heads", "kv_heads", "tiles"), [(4, 2, 2), (8, 2, 4), (12, 2, 3), (8, 2, 2)])
def test_the_tiled_order_gives_each_gqa_group_its_kv_head(heads, kv_heads, tiles):
    """Export head h reads KV head (h // m) mod kv_heads (m query heads per repeated head); at
    GQA's head p it is read by GQA's group p // (heads / kv_heads)."""
    order = tiled_order(heads, kv_heads, tiles)
    per = heads // (kv_heads * tiles)
    assert sorted(order) == list(range(heads))
    reads = (order // per) % kv_heads
    assert np.array_equal(reads, np.arange(heads) // (heads // kv_heads))
