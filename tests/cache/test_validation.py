"""The one validation (issue 29): every malformed model is one MalformedModelError naming the
node and the attribute; a graph out of topological order is sorted; real producers' files pass."""

from __future__ import annotations

import pathlib
import random
import warnings

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheQuantizationPass, KvCacheWarning
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.cache.validation import GRAPH_CHECKS, NODE_CHECKS, validate_model
from onnx_kvcache.errors import MalformedModelError
from onnx_kvcache.models.decoder import build_decoder

DATA = pathlib.Path(__file__).parent.parent / "data"


def gqa_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "GroupQueryAttention"]


def set_int(attr: str, value: int):
    def mutate(model: ir.Model) -> None:
        gqa_nodes(model)[1].attributes[attr] = ir.AttrInt64(attr, value)

    return mutate


def set_str(attr: str, value: str):
    def mutate(model: ir.Model) -> None:
        gqa_nodes(model)[1].attributes[attr] = ir.AttrString(attr, value)

    return mutate


def drop_input(slot: int):
    def mutate(model: ir.Model) -> None:
        gqa_nodes(model)[1].replace_input_with(slot, None)

    return mutate


def set_attr(attr: ir.Attr):
    def mutate(model: ir.Model) -> None:
        gqa_nodes(model)[1].attributes[attr.name] = attr

    return mutate


def set_past_shape(dims: list):
    def mutate(model: ir.Model) -> None:
        gqa_nodes(model)[1].inputs[3].shape = ir.Shape(dims)

    return mutate


def scale_of(dtype: np.dtype, size: int = 1, slot: int = 12, fill: float = 0.01):
    def mutate(model: ir.Model) -> None:
        node = gqa_nodes(model)[1]
        name = f"bad_scale_{slot}"
        value = ir.Value(name=name, const_value=ir.tensor(np.full(size, fill, dtype), name=name))
        value.dtype, value.shape = value.const_value.dtype, ir.Shape([size])
        model.graph.register_initializer(value)
        node.replace_input_with(slot, value)

    return mutate


def remove_a_node(model: ir.Model) -> None:
    """A node removed by hand (its readers left dangling), as a graph surgery tool does."""
    victim = next(n for n in model.graph if n.op_type == "MatMul")
    proto = ir.to_proto(model)
    names = {victim.name}
    kept = [n for n in proto.graph.node if n.name not in names]
    del proto.graph.node[:]
    proto.graph.node.extend(kept)
    loaded = ir.from_proto(proto)
    model.graph = loaded.graph


def remove_a_node_in_memory(model: ir.Model) -> None:
    """A node removed from the graph in memory (``Graph.remove(safe=False)``): its readers still
    hold its outputs, whose producer is in no graph (onnx-ir's clone calls them outer-scope)."""
    victim = next(n for n in model.graph if n.op_type == "MatMul")
    model.graph.remove(victim, safe=False)


#: mutant -> (mutation, quantized first, the words the message must hold)
MUTANTS = {
    "num_heads 0": (set_int("num_heads", 0), False, "GroupQueryAttention node .* has num_heads=0"),
    "num_heads -3": (set_int("num_heads", -3), False, "has num_heads=-3: a head count must be 1 or more"),
    "kv_num_heads 0": (set_int("kv_num_heads", 0), False, "has kv_num_heads=0"),
    "kv_num_heads -1": (set_int("kv_num_heads", -1), False, "has kv_num_heads=-1"),
    "not a multiple": (set_int("num_heads", 3), False, "num_heads must be a multiple of kv_num_heads"),
    "kv 4 of 4": (set_int("kv_num_heads", 4), False, "kv_num_heads=4"),
    "num_heads 8": (set_int("num_heads", 8), False, "num_heads=8"),
    "no past_value": (drop_input(4), False, "reads past_key but has no past_value input"),
    "no caches": (
        lambda m: (drop_input(3)(m), drop_input(4)(m)),
        False,
        "writes present_key 'present.1.key', an output of the graph, but has no past_key input",
    ),
    "float16 k_scale": (
        scale_of(np.float16),
        True,
        "has a float16 k_scale 'bad_scale_12': scales are float32",
    ),
    "float16 v_scale": (
        scale_of(np.float16, slot=13),
        True,
        "has a float16 v_scale 'bad_scale_13': scales are float32",
    ),
    "k_scale of 3": (scale_of(np.float32, 3), True, "k_scale 'bad_scale_12' of 3 element.*takes 1"),
    "no k_scale": (drop_input(12), True, "has k_quant_type=PER_TENSOR but no k_scale input"),
    "PER_BLOCK": (set_str("k_quant_type", "PER_BLOCK"), True, "has k_quant_type='PER_BLOCK'"),
    "bit width 5": (set_int("kv_cache_bit_width", 5), True, "has kv_cache_bit_width=5: expected one of 4, 8"),
    "dangling input": (remove_a_node, False, "reads '.*', which no node, graph input or initializer defines"),
    "removed producer": (
        remove_a_node_in_memory,
        False,
        "reads '.*', which no node, graph input or initializer defines",
    ),
    # found by a hostile review (rev29): each was a traceback, an output onnxruntime refuses, or a
    # model that loads and fails in its first run
    "float num_heads": (
        set_attr(ir.AttrFloat32("num_heads", 4.0)),
        False,
        "has num_heads of type FLOAT, where onnxruntime's schema takes INT",
    ),
    "string kv_num_heads": (
        set_attr(ir.AttrString("kv_num_heads", "2")),
        False,
        "kv_num_heads of type STRING",
    ),
    "int k_quant_type": (set_attr(ir.AttrInt64("k_quant_type", 1)), True, "k_quant_type of type INT"),
    "cache head size 16": (
        set_past_shape(["batch", 2, "past", 16]),
        False,
        "has heads of size 32 but its past_key 'past_key_values.1.key' holds 16 per head",
    ),
    "cache of rank 3": (set_past_shape(["batch", "past", 64]), False, "past_key .* of rank 3"),
    "int8 cache of 4 bits": (
        set_int("kv_cache_bit_width", 4),
        True,
        "has a quantized int8 cache and kv_cache_bit_width=4, which is no format's",
    ),
    "bit width on a float cache": (
        set_int("kv_cache_bit_width", 8),
        False,
        "has kv_cache_bit_width=8 but no quantized side",
    ),
    "zero k_scale": (
        scale_of(np.float32, fill=0.0),
        True,
        "k_scale 'bad_scale_12' holding 0.0: a scale is finite",
    ),
    "nan v_scale": (scale_of(np.float32, slot=13, fill=np.nan), True, "v_scale 'bad_scale_13' holding nan"),
    "negative k_scale": (scale_of(np.float32, fill=-0.5), True, "holding -0.5"),
}


def decoder(quantized: bool) -> ir.Model:
    model = build_decoder(num_layers=2, vocab_size=300)
    if quantized:
        KvCacheQuantizationPass("int8", scales={0: (0.02, 0.01), 1: (0.02, 0.01)})(model)
    return model


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_malformed_model_is_one_line_naming_the_node_and_the_attribute(mutant):
    mutate, quantized, words = MUTANTS[mutant]
    model = decoder(quantized)
    validate_model(model)  # as built: valid
    mutate(model)
    with pytest.raises(MalformedModelError, match=words) as caught:
        validate_model(model)
    message = str(caught.value)
    assert "\n" not in message and "malformed" in message
    assert isinstance(caught.value, KvCacheError)
    if mutant not in ("dangling input", "removed producer"):
        assert "/model/layers.1/attn/GroupQueryAttention" in message  # the node, by name


def test_the_widths_name_the_query_and_key_they_contradict():
    model = decoder(False)
    set_int("num_heads", 8)(model)
    with pytest.raises(
        MalformedModelError, match=r"query \(128 wide\) and key \(64 wide\) different head sizes"
    ):
        validate_model(model)


def test_a_cache_that_holds_other_heads_is_named():
    model = decoder(False)
    node = gqa_nodes(model)[0]
    node.inputs[3].shape = ir.Shape(["batch", 3, "past", 32])
    with pytest.raises(MalformedModelError, match=r"past_key 'past_key_values\.0\.key' holds 3 heads"):
        validate_model(model)


def shuffled(model: ir.Model, seed: int = 0) -> ir.Model:
    """The same graph, its nodes in a random order (as graph-surgery tools leave them)."""
    nodes = list(model.graph)
    random.Random(seed).shuffle(nodes)
    model.graph.remove(nodes, safe=False)
    model.graph.extend(nodes)
    return model


def test_an_unsorted_graph_is_sorted_in_place_and_its_order_found():
    model = shuffled(decoder(False))
    assert validate_model(model, sort=False) is False  # reading only: left as it is
    assert not _in_order(model)
    assert validate_model(model) is True
    assert _in_order(model)
    assert validate_model(model) is False  # sorted now: nothing to do
    model.graph.sort()
    ir.from_proto(ir.to_proto(model)).clone()  # clones (onnx-ir refuses unsorted graphs)


def _in_order(model: ir.Model) -> bool:
    seen: set[int] = set()
    for node in model.graph:
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and id(producer) not in seen:
                return False
        seen.add(id(node))
    return True


@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("cycle", ["two MatMuls", "a node reading its own output"])
def test_a_cycle_is_refused(cycle, sort):
    """A node reading its own output was taken as in order (and written); reading only
    (``sort=False``, inspect) refuses a cycle too: onnxruntime runs no cyclic graph."""
    model = decoder(False)
    nodes = [n for n in model.graph if n.op_type == "MatMul"]
    first, later = nodes[0], nodes[0] if cycle == "a node reading its own output" else nodes[3]
    first.replace_input_with(0, later.outputs[0])
    with pytest.raises(MalformedModelError, match="has a cycle"):
        validate_model(model, sort=sort)


def test_two_nodes_of_one_name_are_refused():
    """onnxruntime refuses "two nodes with same node name"; convert wrote such a graph."""
    model = decoder(False)
    first, second = [n for n in model.graph if n.op_type == "MatMul"][:2]
    second.name = first.name
    with pytest.raises(MalformedModelError, match=f"Two nodes of the graph are named '{first.name}'"):
        validate_model(model)


def test_attribute_types_are_onnxruntimes():
    from onnx_kvcache.cache.validation import ATTRIBUTE_TYPES

    ort = pytest.importorskip("onnxruntime")
    schemas = {
        s.name: s
        for s in ort.capi.onnxruntime_pybind11_state.get_all_operator_schema()
        if s.domain == "com.microsoft" and s.name in ("GroupQueryAttention", "PagedAttention")
    }
    assert set(schemas) == {"GroupQueryAttention", "PagedAttention"}
    for schema in schemas.values():
        for name, attr in schema.attributes.items():
            assert name in ATTRIBUTE_TYPES, (schema.name, name)
            assert ATTRIBUTE_TYPES[name].name == str(attr.type).split(".")[-1], (schema.name, name)


REAL = sorted(DATA.rglob("*.onnx"))  # the shared fixtures are copied here


@pytest.mark.parametrize("path", REAL, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_real_producers_files_pass(path):
    assert validate_model(ir.load(path)) is False


BUILDS = {
    "float32": {},
    "float16": {"dtype": "float16"},
    "qk norm": {"qk_norm": True},
    "window cache": {"sliding_window_layers": (0,), "sliding_window": 8, "sliding_window_cache": True},
    "no-cache layer": {"no_cache_layers": (1,)},
    "symbolic cache dim": {"symbolic_cache_dim": True},
    "paged": {"paged": True, "dtype": "float16"},
    "paged latent": {"paged": True, "dtype": "float16", "latent": True},
}


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize(
    ("fmt", "granularity"),
    [(None, None), ("int8", "per_tensor"), ("int4", "per_channel"), ("fp8", "per_channel")],
)
def test_every_builds_quantized_form_passes(build, fmt, granularity):
    model = build_decoder(num_layers=2, vocab_size=300, **BUILDS[build])
    if fmt is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KvCacheWarning)
            sites = find_attention_sites(model)
            n = {
                s.layer_id: s.kv_num_heads * s.head_size() if granularity == "per_channel" else 1
                for s in sites
            }
            scales = {i: (np.full(k, 0.02, np.float32), np.full(k, 0.01, np.float32)) for i, k in n.items()}
            KvCacheQuantizationPass(fmt, granularity, scales)(model)
    assert validate_model(model) is False


def test_every_check_is_documented():
    page = (pathlib.Path(__file__).parents[2] / "docs" / "validation.md").read_text()
    for check in (*GRAPH_CHECKS, *NODE_CHECKS):
        assert f"| {check.name} |" in page, check.name


# -- issue 37: what the installed onnxruntime loads; widths its projections tell ----------


def test_the_installed_onnxruntimes_row_is_what_it_loads():
    """RUNTIME_LIMITS' row for the installed onnxruntime agrees with a session of its own."""
    from onnx_kvcache.model_io import _sessions

    version = _sessions.installed_ort_version()
    limits = _sessions.RUNTIME_LIMITS.get(version)
    assert limits is not None, f"add onnxruntime {version}'s row to RUNTIME_LIMITS"
    assert _sessions._probed(limits.ir_version + 1, (("", 21),)) == (
        ("IR version", limits.ir_version + 1, limits.ir_version),
    )
    assert _sessions._probed(limits.ir_version, (("", 21),)) == ()
    for domain, newest in limits.opsets.items():
        opsets = {"": 21, domain: newest}
        assert _sessions._probed(10, tuple(sorted(opsets.items()))) == ()
        opsets[domain] = newest + 1
        assert _sessions._probed(10, tuple(sorted(opsets.items()))) == (
            (f"{domain or 'ai.onnx'} opset", newest + 1, newest),
        )


@pytest.mark.parametrize(
    ("ir_version", "opsets", "said"),
    [
        (99, {"": 21}, "its IR version is 99, and the installed onnxruntime"),
        (10, {"": 99}, "its ai.onnx opset is 99"),
        (10, {"": 21, "com.microsoft": 2}, "its com.microsoft opset is 2"),
        (10, {"": 21, "my.custom.domain": 7}, None),  # a domain onnxruntime does not know: any version
    ],
)
@pytest.mark.parametrize("probed", [False, True], ids=["table", "probe"])
def test_a_header_onnxruntime_refuses_is_refused(monkeypatch, ir_version, opsets, said, probed):
    from onnx_kvcache.model_io import _sessions

    if probed:  # a release without a row: the installed onnxruntime is asked
        monkeypatch.setattr(_sessions, "RUNTIME_LIMITS", {})
    model = build_decoder(num_layers=2)
    model.ir_version = ir_version
    model.opset_imports.update(opsets)
    if said is None:
        assert validate_model(model) is False
        return
    with pytest.raises(MalformedModelError, match=said):
        validate_model(model)


def test_a_head_count_its_projections_contradict_is_refused_without_shapes():
    """mobius records no shape on its packed QKV: the MatMul's weight tells the width."""
    model = ir.load(DATA / "producers" / "mobius" / "mobius-cpu-gqa" / "llama" / "model.onnx")
    node = gqa_nodes(model)[0]
    assert node.inputs[0].shape is None
    node.attributes["num_heads"] = ir.AttrInt64("num_heads", 2**40)
    with pytest.raises(MalformedModelError, match="which does not divide its query's width 128"):
        validate_model(model)
