"""KvCacheQuantizationPass on models whose caches are quantized already: requantization.

Every cell of {GroupQueryAttention, PagedAttention} x {fp8, int8, int4} x {per_tensor,
per_channel} converts to every other cell. The result must be the very graph a direct
conversion of the float model gives with the same scales (graphs, initializers and
attributes compared structurally), with the scales given or, without them, with the node's
own scales retargeted (the same thresholds: a scale file of them retargeted by qmax, per
channel to per tensor by their max, per tensor to per channel broadcast). It must run where
the target runs: int8/int4 GQA on onnxruntime's CPU kernel, fp8 GQA fails session creation
only with NOT_IMPLEMENTED, paged caches through the project's PagedAttention CPU reference.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from test_kv_cache_quantization import _function_model
from test_kv_cache_quantization_paged import _genai_kv_cache_variant, scale_file
from test_paged_attention_reference import run_case

from onnx_kvcache import (
    KvCacheError,
    KvCacheQuantizationPass,
    KvCacheRunner,
    KvCacheScales,
    KvCacheWarning,
    convert_model,
    optimize_model,
)
from onnx_kvcache.cache.formats import get_format, scale_granularity
from onnx_kvcache.cache.layout import inspect_kv_cache
from onnx_kvcache.cache.operators import op_of
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import (
    NotConvertedWarning,
    RuntimeSupportWarning,
    ScalesAdjustedWarning,
    UnitScalesWarning,
)
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.model_io.genai_folder import resolve_model_path
from onnx_kvcache.models.decoder import build_decoder, save_genai_folder
from onnx_kvcache.passes import PromptFloatAttentionPass

from conftest import (
    CPU_FORMATS,
    FORMATS,
    GRANULARITIES,
    gqa_model,
    og_generate,
    paged_model,
    reference_step,
    run_gqa_steps,
)
from genai_builder import builder_quantized_paged
from genai_builder import structure as genai_structure

LAYERS, KV, HEAD = 2, 2, 16
BUILDERS: dict[str, Callable[..., ir.Model]] = {
    "gqa": lambda layers=LAYERS, **kw: gqa_model(layers=layers, kv_heads=KV, head=HEAD, **kw),
    "paged": lambda layers=LAYERS, **kw: paged_model(layers=layers, kv_heads=KV, head=HEAD, **kw),
}
CELLS = list(itertools.product(FORMATS, GRANULARITIES))
PAIRS = [(a, b) for a in CELLS for b in CELLS if a != b]


def pair_id(pair) -> str:
    (f1, g1), (f2, g2) = pair
    return f"{f1}-{g1}-to-{f2}-{g2}"


def scales(fmt: str, granularity: str, seed: int, layers: int = LAYERS) -> KvCacheScales:
    """Scales of thresholds 2.5..4 (the data's range), varied per layer and channel."""
    rng = np.random.default_rng(seed)
    n = scale_granularity(granularity).size(KV, HEAD)
    qmax = get_format(fmt).qmax
    pairs = {
        i: tuple((rng.uniform(2.5, 4.0, n) / qmax).astype(np.float32) for _ in "kv") for i in range(layers)
    }
    return KvCacheScales.from_mapping(pairs, format=fmt, granularity=granularity)


def quantized(op: str, fmt: str, granularity: str, seed: int = 0, layers: int = LAYERS, **kw) -> ir.Model:
    model = BUILDERS[op](layers, **kw)
    KvCacheQuantizationPass(fmt, granularity, scales(fmt, granularity, seed, layers))(model)
    return model


def structure(model: ir.Model | ir.Graph) -> dict:
    """Everything a graph is: its inputs, outputs, initializers (values too), and nodes with
    their inputs, outputs and attributes (tensors by value, subgraphs by their structure)."""

    def io(values) -> list:
        return [(v.name, v.dtype, None if v.shape is None else tuple(map(str, v.shape))) for v in values]

    def value(a: ir.Attr) -> object:
        if a.type == ir.AttributeType.TENSOR:
            return (a.value.dtype, tuple(a.value.shape), a.value.numpy().tobytes())
        return structure(a.value) if a.type == ir.AttributeType.GRAPH else a.value

    graph = model.graph if isinstance(model, ir.Model) else model
    return {
        "inputs": io(graph.inputs),
        "outputs": io(graph.outputs),
        "initializers": {
            name: (v.dtype, tuple(v.shape), v.const_value.numpy().tobytes())
            for name, v in graph.initializers.items()
        },
        "nodes": [
            (
                n.name,
                n.domain,
                n.op_type,
                [None if v is None else v.name for v in n.inputs],
                [v.name for v in n.outputs],
                {name: (a.type, value(a)) for name, a in n.attributes.items()},
            )
            for n in graph
        ],
    }


def own_scales_as_file(model: ir.Model, to: str) -> KvCacheScales:
    """The model's scales as a scale file of their format would give them, in granularity ``to``:
    per channel -> per tensor by their max, per tensor -> per channel repeated."""
    k, v, fmt = {}, {}, None
    for node in model.graph:
        op = op_of(node)
        if op is None:
            continue
        layer = int(node.name.split(".")[-1])
        fmt = get_format("int4" if node.inputs[3].dtype == ir.DataType.UINT8 else node.inputs[3].dtype.name)
        for table, side in ((k, op.key), (v, op.value)):
            own = node.inputs[op.slot(side.scale)].const_value.numpy().reshape(-1)
            n = scale_granularity(to).size(KV, HEAD)
            table[layer] = np.full(n, own.max(), np.float32) if n != own.size else own
    return KvCacheScales(k, v, format=fmt.name, granularity=to)  # type: ignore[union-attr]


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("op", list(BUILDERS))
def test_requantized_with_scales_equals_the_direct_conversion(op, pair):
    (f1, g1), (f2, g2) = pair
    model = quantized(op, f1, g1)
    target = scales(f2, g2, seed=1)
    assert KvCacheQuantizationPass(f2, g2, target)(model).modified
    direct = BUILDERS[op]()
    KvCacheQuantizationPass(f2, g2, target)(direct)
    assert structure(model) == structure(direct)
    assert not KvCacheQuantizationPass(f2, g2, target)(model).modified  # converted: no change


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("op", list(BUILDERS))
def test_requantized_with_its_own_scales_keeps_their_thresholds(op, pair):
    (f1, g1), (f2, g2) = pair
    model = quantized(op, f1, g1)
    expected = own_scales_as_file(model, g2)
    if g1 != g2:
        said = "merged into one, their max" if g2 == "per_tensor" else "repeated for every channel"
        with pytest.warns(ScalesAdjustedWarning, match=rf"Layer\(s\) \[0, 1\] requantized to {g2} .*{said}"):
            KvCacheQuantizationPass(f2, g2)(model)
    else:
        KvCacheQuantizationPass(f2, g2)(model)  # no warning: the thresholds are the same
    direct = BUILDERS[op]()
    KvCacheQuantizationPass(f2, g2, expected)(direct)  # the pass retargets the file by qmax
    assert structure(model) == structure(direct)
    node = next(iter(model.graph))
    got = node.inputs[op_of(node).slot("k_scale")].const_value.numpy().reshape(-1)
    threshold = expected.k[0] * get_format(f1).qmax
    np.testing.assert_allclose(got * get_format(f2).qmax, threshold, rtol=1e-6)


def test_granularity_defaults_to_the_models_own():
    """int8 per channel -> int4 without a granularity: per channel still (KVCacheVariant's case)."""
    model = quantized("paged", "int8", "per_channel")
    KvCacheQuantizationPass("int4")(model)
    direct = BUILDERS["paged"]()
    own = own_scales_as_file(quantized("paged", "int8", "per_channel"), "per_channel")
    KvCacheQuantizationPass("int4", "per_channel", own)(direct)
    assert structure(model) == structure(direct)


RUN_PAIRS = [pair for pair in PAIRS if pair[1][0] in CPU_FORMATS]


@pytest.mark.parametrize("pair", RUN_PAIRS, ids=pair_id)
def test_requantized_gqa_runs_on_the_cpu_kernel(pair):
    """int8/int4 on onnxruntime's CPU kernel == the quantized reference, prefill and decode."""
    (f1, g1), (f2, g2) = pair
    model = quantized("gqa", f1, g1, layers=1)
    want = scales(f2, g2, seed=2, layers=1)
    KvCacheQuantizationPass(f2, g2, want)(model)
    row, (k_scale, v_scale) = get_format(f2), want.for_layer(0)
    for feeds, (out, present_k, present_v) in run_gqa_steps(create_session(model), model, [5, 1, 1]):
        _, want_k, _ = reference_step(model, feeds, row, k_scale, v_scale)
        assert present_k.dtype == row.numpy_dtype() and present_k.shape == want_k.shape
        expected, _, _ = reference_step(model, feeds, row, k_scale, v_scale, stored=(present_k, present_v))
        np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("pair", [pair for pair in PAIRS if pair[1][0] == "fp8"], ids=pair_id)
def test_requantized_fp8_gqa_type_checks_on_cpu(pair):
    """CPU has no fp8 GQA kernel: session creation fails with NOT_IMPLEMENTED, nothing else."""
    (f1, g1), (f2, g2) = pair
    model = quantized("gqa", f1, g1, layers=1)
    KvCacheQuantizationPass(f2, g2, scales(f2, g2, seed=2, layers=1))(model)
    with pytest.raises(
        Exception, match="NOT_IMPLEMENTED : Could not find an implementation for GroupQueryAttention"
    ):
        create_session(model)


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_requantized_paged_runs_through_the_cpu_reference(pair):
    """No CPU PagedAttention kernel: the project's reference pass runs it, against numpy; the
    real operator's session (float16: its schema's T) fails with NOT_IMPLEMENTED only."""
    (f1, g1), (f2, g2) = pair
    want = scales(f2, g2, seed=2, layers=1)
    half = quantized("paged", f1, g1, layers=1, dtype=ir.DataType.FLOAT16)
    KvCacheQuantizationPass(f2, g2, want)(half)
    with pytest.raises(
        Exception, match="NOT_IMPLEMENTED : Could not find an implementation for PagedAttention"
    ):
        create_session(half)
    model = quantized("paged", f1, g1, layers=1)
    KvCacheQuantizationPass(f2, g2, want)(model)
    run_case(model, 16, f2, {0: want.for_layer(0)})


# -- files, folders and the CLI ---------------------------------------------------------

FOLDER_SCALES = {0: (0.05, 0.04), 1: (0.06, 0.05)}
KV_FOLDER, HEAD_FOLDER = 2, 32  # the demo decoder's


def loaded(path) -> ir.Model:
    return ir.load(resolve_model_path(path)[0])


def graph_of(path) -> dict:
    """The structure of a converted model, its marker metadata aside (it names the placement)."""
    return structure(loaded(path))


#: (first format, its target), (second format, its target), share_buffer after, model dtype
FOLDER_CASES = {
    "cpu-int8-to-int4": (("int8", "cpu"), ("int4", "cpu"), True, "float32"),
    "cpu-int4-to-int8": (("int4", "cpu"), ("int8", "cpu"), True, "float32"),
    "cuda-int8-to-fp8": (("int8", "cuda"), ("fp8", "cuda"), True, "float16"),
    "cpu-int8-to-cuda-fp8": (("int8", "cpu"), ("fp8", "cuda"), True, "float16"),  # config changes
}


@pytest.mark.parametrize("placement", ["in-place", "beside", "folder"])
@pytest.mark.parametrize("case", list(FOLDER_CASES))
def test_convert_model_requantizes_a_genai_folder(tmp_path, case, placement):
    """The in-place, beside and folder placements as for float models; share_buffer follows the target."""
    (first, first_ep), (second, ep), share, dtype = FOLDER_CASES[case]
    src = save_genai_folder(tmp_path / "src", num_layers=2, vocab_size=300, dtype=dtype, provider=first_ep)
    convert_model(src, in_place=True, format=first, scales=FOLDER_SCALES, ep=first_ep)
    direct = save_genai_folder(
        tmp_path / "direct", num_layers=2, vocab_size=300, dtype=dtype, provider=first_ep
    )
    convert_model(direct, tmp_path / "want", format=second, scales=FOLDER_SCALES, ep=ep)
    graph = resolve_model_path(src)[0]
    into = {
        "in-place": (src, None),
        "beside": (graph, src / "model.requantized.onnx"),
        "folder": (src, tmp_path / "out"),
    }
    given, out = into[placement]
    result = convert_model(given, out, format=second, scales=FOLDER_SCALES, ep=ep, in_place=out is None)
    assert result.converted and result.format == second and result.nodes == 2
    written = out or src
    assert graph_of(written) == graph_of(tmp_path / "want")
    if placement != "beside":
        config = json.loads((written / "genai_config.json").read_text())
        assert config["search"]["past_present_share_buffer"] is share
    for folder, fmt in [(written, second), *([] if out is None else [(src, first)])]:  # the source after
        model_file = resolve_model_path(folder)[0]
        onnx.load(model_file)  # with its data
        assert all(v.const_value.numpy() is not None for v in ir.load(model_file).graph.initializers.values())
        if (ep if folder is written else first_ep) == "cpu":  # onnxruntime and onnxruntime-genai run it
            runner = KvCacheRunner(folder)
            assert (
                runner.cache_dtype == get_format(fmt).dtype and np.isfinite(runner.prefill([1, 2, 3])).all()
            )
            if folder.is_dir():  # a graph beside the folder's own: genai runs the folder's
                assert len(og_generate(folder, [1, 2, 3], 3)) >= 1


def test_convert_without_a_format_keeps_the_models_and_requantizes_its_granularity(tmp_path):

    src = save_genai_folder(tmp_path / "src", num_layers=2, vocab_size=300)
    convert_model(src, in_place=True, format="int4", scales=FOLDER_SCALES, ep="cpu")
    with pytest.warns(
        NotConvertedWarning, match=r"model\.int4\.onnx is already int4 per_tensor: nothing to convert"
    ):
        same = convert_model(src, tmp_path / "same")  # already int4 per tensor: nothing written
    assert not same.converted and not (tmp_path / "same").exists()
    with pytest.warns(ScalesAdjustedWarning, match="repeated for every channel"):
        result = convert_model(src, tmp_path / "out", granularity="per_channel")
    assert (result.format, result.granularity, result.target) == ("int4", "per_channel", "cpu")
    info = inspect_kv_cache(loaded(tmp_path / "out"))
    assert {(layer.k_quant_type, layer.bit_width, layer.dtype) for layer in info.layers} == {
        ("PER_CHANNEL", 4, "UINT8")
    }
    assert [len(layer.k_scale) for layer in info.layers] == [KV_FOLDER * HEAD_FOLDER] * 2
    assert info.layers[0].k_scale == [pytest.approx(0.05)] * (KV_FOLDER * HEAD_FOLDER)


def test_cli_convert_requantizes(tmp_path, capsys):

    src = save_genai_folder(tmp_path / "src", num_layers=2, vocab_size=300)
    convert_model(src, in_place=True, format="int8", scales=FOLDER_SCALES, ep="cpu")
    assert main(["convert", str(src), str(tmp_path / "out"), "--format", "int4"]) == 0
    assert "converted 2" in capsys.readouterr().out
    direct = save_genai_folder(tmp_path / "direct", num_layers=2, vocab_size=300)
    as_int8 = KvCacheScales.from_mapping(FOLDER_SCALES, format="int8")  # its own scales: x 128 / 8
    convert_model(direct, tmp_path / "want", format="int4", scales=as_int8, ep="cpu")
    assert graph_of(tmp_path / "out") == graph_of(tmp_path / "want")
    assert main(["inspect", str(tmp_path / "out")]) == 0
    assert "PER_TENSOR" in capsys.readouterr().out


def test_optimize_model_requantizes():

    model = quantized("gqa", "int8", "per_channel")
    want = scales("int4", "per_channel", seed=3)
    optimize_model(model, ep="cpu", format="int4", scales=want)
    direct = BUILDERS["gqa"]()
    KvCacheQuantizationPass("int4", "per_channel", want)(direct)
    PromptFloatAttentionPass()(direct)  # the CPU's: the prompt through the float kernel
    assert structure(model) == structure(direct)


# -- onnxruntime-genai's KVCacheVariant -------------------------------------------------


@pytest.mark.parametrize("given", ["scale-file", "own-scales"])
@pytest.mark.parametrize(("source", "target"), [("int8", "int4"), ("int4", "int8")])
def test_matches_genai_kv_cache_variant_beside_the_source(tmp_path, source, target, given):
    """genai 0.18's KVCacheVariant rewrites a per-channel paged graph beside its weights; our
    conversion of the same file beside it gives the same cache types, attributes and scales,
    from the scale file it reads or, without one, from the source's own scales."""
    pytest.importorskip("onnxruntime_genai")

    folder = tmp_path / "paged"
    folder.mkdir()
    calibrated = scale_file(tmp_path, "per_channel", "int8", head=32)  # one int8 calibration: qmax 128
    float_model = build_decoder(num_layers=2, vocab_size=300, dtype="float16", paged=True, head_size=32)
    src = builder_quantized_paged(float_model, source, "per_channel", calibrated)
    ir.save(src, folder / "model.onnx", external_data="model.onnx.data")
    _genai_kv_cache_variant()(f"{target}_per_channel").create(
        folder / "model.onnx", folder / "variant.onnx", calibrated
    )
    int4_build = "onnxruntime_USE_INT4_KV_CACHE" if target == "int4" else None
    with pytest.warns(RuntimeSupportWarning, match=int4_build) if int4_build else contextlib.nullcontext():
        result = convert_model(
            folder / "model.onnx",
            folder / f"model.{target}.onnx",
            format=target,
            scales=calibrated if given == "scale-file" else None,
        )
    assert (result.placement, result.granularity, result.target) == ("beside", "per_channel", "cuda")
    theirs, ours = ir.load(folder / "variant.onnx"), ir.load(folder / f"model.{target}.onnx")
    mine, genai = genai_structure(ours), genai_structure(theirs)
    assert mine["io"] == genai["io"]
    assert mine["nodes"].keys() == genai["nodes"].keys() and len(mine["nodes"]) == 2
    for name, node in mine["nodes"].items():
        assert node == genai["nodes"][name]  # attributes, every input, scale values by value
    proto = onnx.load(folder / f"model.{target}.onnx", load_external_data=False)
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"model.onnx.data"}  # beside: the source's weights, shared


# -- shapes of models beyond the matrix -------------------------------------------------


def kv_sharing(layers: int = LAYERS) -> ir.Model:
    """Layer 1 reads layer 0's present as its past (cross-layer KV sharing): one cache."""
    model = BUILDERS["gqa"](layers)
    a, b = list(model.graph)
    for slot, out in ((3, 1), (4, 2)):
        old = b.inputs[slot]
        b.replace_input_with(slot, a.outputs[out])
        model.graph.inputs.remove(old)
    return model


def latent(layers: int = LAYERS) -> ir.Model:
    return paged_model(layers=layers, num_heads=4, kv_heads=1, head=32, latent=True, v_head=24)


SHAPES: dict[str, tuple[Callable[[], ir.Model], int, int]] = {  # builder, kv heads, head size
    "kv-sharing": (kv_sharing, KV, HEAD),
    "latent": (latent, 1, 32),
    "float16-gqa": (
        lambda: gqa_model(layers=LAYERS, kv_heads=KV, head=HEAD, dtype=ir.DataType.FLOAT16),
        KV,
        HEAD,
    ),
    "packed-qkv-paged": (
        lambda: paged_model(layers=LAYERS, kv_heads=KV, head=HEAD, packed_qkv=True),
        KV,
        HEAD,
    ),
}


def shape_scales(
    fmt: str, granularity: str, kv: int, head: int, seed: int, layers: int = LAYERS
) -> KvCacheScales:
    rng = np.random.default_rng(seed)
    n = scale_granularity(granularity).size(kv, head)
    same = [rng.uniform(0.01, 0.03, n).astype(np.float32) for _ in range(layers)]  # K = V: LATENT's too
    return KvCacheScales.from_mapping(
        {i: (a, a) for i, a in enumerate(same)}, format=fmt, granularity=granularity
    )


@pytest.mark.parametrize(
    "pair",
    [(("int8", "per_channel"), ("int4", "per_channel")), (("int4", "per_tensor"), ("fp8", "per_tensor"))],
    ids=pair_id,
)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_other_shapes_requantize_as_they_convert(shape, pair):
    (f1, g1), (f2, g2) = pair
    build, kv, head = SHAPES[shape]
    model = build()
    layers = len({s.layer_id for s in find_attention_sites(model)})  # KV sharing: one cache, one layer
    KvCacheQuantizationPass(f1, g1, shape_scales(f1, g1, kv, head, 0, layers))(model)
    target = shape_scales(f2, g2, kv, head, 1, layers)
    KvCacheQuantizationPass(f2, g2, target)(model)
    direct = build()
    KvCacheQuantizationPass(f2, g2, target)(direct)
    assert structure(model) == structure(direct)


def test_one_scale_tensor_for_k_and_v_is_requantized_into_two():
    """A source converted with shared_kv_scale: requantized without it, each cache its own."""
    model = BUILDERS["gqa"]()
    KvCacheQuantizationPass("int8", "per_tensor", scales("int8", "per_tensor", 0), shared_kv_scale=True)(
        model
    )
    target = scales("int4", "per_tensor", 1)
    KvCacheQuantizationPass("int4", "per_tensor", target)(model)
    direct = BUILDERS["gqa"]()
    KvCacheQuantizationPass("int4", "per_tensor", target)(direct)
    assert structure(model) == structure(direct)


@pytest.mark.parametrize("target", ["int8", "int4"])
def test_unit_fp8_scales_warn_when_retargeted_to_an_integer_format(target):
    model = BUILDERS["gqa"]()
    with pytest.warns(UnitScalesWarning, match="unit scales"):
        KvCacheQuantizationPass("fp8")(model)  # never calibrated
    with pytest.warns(UnitScalesWarning, match=r"Layer\(s\) \[0, 1\] had unit fp8 scales .*threshold 448"):
        KvCacheQuantizationPass(target)(model)
    k = next(iter(model.graph)).inputs[12].const_value.numpy()
    np.testing.assert_array_equal(k, [448 / get_format(target).qmax])


@pytest.mark.parametrize("op", list(BUILDERS))
def test_genai_per_token_caches_are_refused_not_requantized(op):
    """genai 0.18's *_per_token scheme (scales as cache inputs) is no format of this library."""
    model = quantized(op, "int8", "per_tensor")
    for node in model.graph:
        for name in ("k_quant_type", "v_quant_type"):
            node.attributes[name] = ir.AttrString(name, "PER_TOKEN")
    text = ir.to_onnx_text(model)
    with pytest.raises(KvCacheError, match=r"\(int8, per_token\) in a format onnx-kvcache does not know"):
        KvCacheQuantizationPass("int4", "per_tensor", scales("int4", "per_tensor", 1))(model)
    assert ir.to_onnx_text(model) == text


def test_inspect_describes_a_requantized_model():
    model = quantized("paged", "int8", "per_channel")
    with pytest.warns(ScalesAdjustedWarning, match="merged into one"):
        KvCacheQuantizationPass("int4", "per_tensor")(model)
    info = inspect_kv_cache(model)
    assert [(lay.dtype, lay.bit_width, lay.k_quant_type, len(lay.k_scale)) for lay in info.layers] == [
        ("UINT8", 4, "PER_TENSOR", 1)
    ] * LAYERS
    assert info.layers[0].shape[3] == HEAD // 2
    assert info.bytes_per_token == LAYERS * 2 * KV * HEAD * 0.5


def test_optimize_model_keeps_an_already_quantized_models_format():
    model = quantized("gqa", "int8", "per_tensor")
    with pytest.warns(ScalesAdjustedWarning, match="repeated for every channel"):
        optimize_model(model, ep="cpu", granularity="per_channel")
    direct = BUILDERS["gqa"]()
    KvCacheQuantizationPass(
        "int8", "per_channel", own_scales_as_file(quantized("gqa", "int8", "per_tensor"), "per_channel")
    )(direct)
    PromptFloatAttentionPass()(direct)  # the CPU's: the prompt through the float kernel
    assert structure(model) == structure(direct)
    with pytest.raises(KvCacheError, match="name its format"):  # a float model has none to keep
        optimize_model(BUILDERS["gqa"](), ep="cpu", granularity="per_channel")


@pytest.mark.parametrize(("first", "second"), [("int8", "int4"), ("fp8", "int8"), ("int4", "int8")])
def test_gqa_in_a_function_requantizes_and_runs(first, second):
    """The node and its scale Constants live in a model-local function: requantized there, from
    its own scales, it computes what the direct conversion computes. Unpacking int4 needs the
    head size, which nothing in this function's shapeless body tells: refused, unchanged."""
    model = _function_model()
    KvCacheQuantizationPass(first, scales={0: (0.05, 0.04)})(model)
    if get_format(first).packed:
        text = ir.to_onnx_text(model)
        with pytest.raises(KvCacheError, match=r"Cannot tell the head size.*Run shape inference"):
            KvCacheQuantizationPass(second)(model)
        assert ir.to_onnx_text(model) == text
        return
    KvCacheQuantizationPass(second)(model)
    factor = np.float32(get_format(first).qmax / get_format(second).qmax)
    reference = gqa_model()
    KvCacheQuantizationPass(second, scales={0: (np.float32(0.05) * factor, np.float32(0.04) * factor)})(
        reference
    )
    function = next(iter(model.functions.values()))
    constants = [n for n in function if n.op_type == "Constant" and n.outputs[0].name.endswith("_scale")]
    assert len(constants) == 2  # updated in place, none left behind
    got = list(run_gqa_steps(create_session(model), reference, [3, 1]))
    want = list(run_gqa_steps(create_session(reference), reference, [3, 1]))
    for (_, a), (_, b) in zip(got, want):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_an_fp8_cache_means_cuda_only_while_fp8_is_what_is_asked(tmp_path):
    from onnx_kvcache.capabilities.table import infer_target

    model = quantized("gqa", "fp8", "per_tensor")
    assert infer_target(model)[0] == infer_target(model, format="fp8")[0] == "cuda"
    assert infer_target(model, format="int8") == ("cpu", "a float32 model")
    ir.save(model, tmp_path / "fp8.onnx")
    result = convert_model(tmp_path / "fp8.onnx", tmp_path / "int8.onnx", format="int8")  # its own scales
    assert (result.converted, result.target, result.target_source) == (
        True,
        "cpu",
        "assumed: a float32 model",
    )


# -- a hostile review's findings (issue 21, requantize) ------------------------------------


def _without_value_info(model: ir.Model) -> ir.Model:
    """As a TorchScript export: no shape on any value a node computes (graph outputs aside),
    nor on the attention's query/key/value (graph inputs here, computed in a real decoder)."""
    outputs = {id(v) for v in model.graph.outputs}
    for node in model.graph:
        for value in node.outputs:
            if id(value) not in outputs:
                value.shape = None
        if op_of(node) is not None:
            for value in node.inputs[:3]:
                if value is not None:
                    value.shape = None
    return model


@pytest.mark.parametrize("target", ["int8", "fp8"])
@pytest.mark.parametrize("op", list(BUILDERS))
def test_a_packed_cache_without_value_info_takes_the_head_size_from_its_per_channel_scale(op, target):
    model = _without_value_info(quantized(op, "int4", "per_channel"))
    KvCacheQuantizationPass(target, "per_channel")(model)
    caches = [v for v in model.graph.inputs if v.name.startswith("past_key_values")]
    assert caches and all(v.shape[3] == HEAD and v.dtype == get_format(target).dtype for v in caches)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("op", list(BUILDERS))
def test_shared_kv_scale_applies_to_a_model_already_in_the_format(op, fmt):
    model = quantized(op, fmt, "per_tensor")
    before = [(n.inputs[op_of(n).slot("k_scale")], n.inputs[op_of(n).slot("v_scale")]) for n in model.graph]
    before = [(k.const_value.numpy(), v.const_value.numpy()) for k, v in before if k is not None]
    KvCacheQuantizationPass(fmt, "per_tensor", shared_kv_scale=True)(model)
    nodes = [n for n in model.graph if op_of(n) is not None]
    assert len(nodes) == LAYERS
    for node, (k, v) in zip(nodes, before):
        row = op_of(node)
        assert node.inputs[row.slot("k_scale")] is node.inputs[row.slot("v_scale")]
        np.testing.assert_array_equal(node.inputs[row.slot("k_scale")].const_value.numpy(), np.maximum(k, v))


def _scales_as_graph_inputs(model: ir.Model) -> ir.Model:
    """Every k/v scale fed at run time: a graph input in place of the constant."""
    for node in list(model.graph):
        row = op_of(node)
        if row is None:
            continue
        for name in ("k_scale", "v_scale"):
            old = node.inputs[row.slot(name)]
            value = ir.Value(name=f"{old.name}_input", type=ir.TensorType(ir.DataType.FLOAT), shape=old.shape)
            model.graph.inputs.append(value)
            node.replace_input_with(row.slot(name), value)
            model.graph.initializers.pop(old.name)
    return model


@pytest.mark.parametrize("target", ["int8", "int4"])
def test_scales_given_replace_scale_graph_inputs_and_remove_them(tmp_path, target):
    model = _scales_as_graph_inputs(quantized("gqa", "int8", "per_tensor"))
    KvCacheQuantizationPass(target, "per_tensor", scales(target, "per_tensor", 3))(model)
    assert [v.name for v in model.graph.inputs if "scale" in v.name] == []
    ir.save(model, tmp_path / "model.onnx")
    session = create_session(tmp_path / "model.onnx")
    assert not any("scale" in i.name for i in session.get_inputs())


def test_the_cli_names_scales_for_a_scale_read_at_run_time(tmp_path, capsys):
    ir.save(_scales_as_graph_inputs(quantized("gqa", "int8", "per_tensor")), tmp_path / "model.onnx")
    argv = ["convert", str(tmp_path / "model.onnx"), str(tmp_path / "out.onnx"), "--format", "int4"]
    assert main([*argv, "--ep", "cpu"]) != 0
    err = capsys.readouterr().err
    assert "not a constant; give --scales PATH (a scale file)" in err and "scales=" not in err


@pytest.mark.parametrize(("source", "target"), [("int8", "int4"), ("int4", "int8"), ("int8", "fp8")])
def test_genai_scale_initializers_keep_their_names(tmp_path, source, target):
    """Replaced in place, the builder's ``model.layers.{i}.attn.k_scale`` keep their names, so
    genai's KVCacheVariant still reads the output."""
    pytest.importorskip("onnxruntime_genai")
    calibrated = scale_file(tmp_path, "per_channel", "int8", head=32)
    float_model = build_decoder(num_layers=2, vocab_size=300, dtype="float16", paged=True, head_size=32)
    model = builder_quantized_paged(float_model, source, "per_channel", calibrated)
    KvCacheQuantizationPass(target, "per_channel")(model)
    names = {f"model.layers.{i}.attn.{kind}_scale" for i in range(2) for kind in "kv"}
    scale_inputs = {n.inputs[s].name for n in model.graph if op_of(n) for s in (14, 15)}
    assert scale_inputs == names and names <= set(model.graph.initializers)
    if target != "fp8":
        ir.save(model, tmp_path / "model.onnx")
        back = "int8" if target == "int4" else "int4"
        _genai_kv_cache_variant()(f"{back}_per_channel").create(
            tmp_path / "model.onnx", tmp_path / "variant.onnx", calibrated
        )


@pytest.mark.parametrize("method", ["mse", "minmax"])
@pytest.mark.parametrize("source", ["float", "int4"])
def test_mse_thresholds_moved_to_another_format_warn(tmp_path, source, method):
    """mse chose its thresholds for int4's 16 levels: as int8 scales they clip far more than
    int8 needs (a scale file records the method; a converted model's marker too)."""
    import dataclasses

    given = dataclasses.replace(scales("int4", "per_channel", 0), metadata={"method": method})
    given.save(tmp_path / "s.json")
    model = BUILDERS["gqa"]() if source == "float" else quantized("gqa", "int4", "per_channel")
    mse = method == "mse"
    expected = "mse thresholds chosen for int4"
    with pytest.warns(ScalesAdjustedWarning, match=expected) if mse else warnings_as_errors():
        KvCacheQuantizationPass("int8", scales=str(tmp_path / "s.json"))(model)
    ir.save(BUILDERS["gqa"](), tmp_path / "model.onnx")
    convert_model(tmp_path / "model.onnx", tmp_path / "int4.onnx", scales=tmp_path / "s.json", ep="cpu")
    with pytest.warns(ScalesAdjustedWarning, match="mse thresholds") if mse else warnings_as_errors():
        convert_model(tmp_path / "int4.onnx", tmp_path / "int8.onnx", format="int8", ep="cpu")


@contextlib.contextmanager
def warnings_as_errors():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", KvCacheWarning)
        yield


@pytest.mark.parametrize("op", list(BUILDERS))
@pytest.mark.parametrize("given", ["own", "scale-file", "scales"])
def test_per_channel_scales_for_a_per_tensor_cache_merge_by_their_max_with_a_warning(tmp_path, op, given):
    """A node's own per-channel scales and per-channel scales given are treated alike."""
    per_channel = scales("int8", "per_channel", 4)
    per_channel.save(tmp_path / "s.json")
    model = quantized(op, "int8", "per_channel", seed=4) if given == "own" else BUILDERS[op]()
    argument = {"own": None, "scale-file": str(tmp_path / "s.json"), "scales": per_channel}[given]
    with pytest.warns(ScalesAdjustedWarning, match=r"Layer\(s\) \[0, 1\].*merged into one.*their max"):
        KvCacheQuantizationPass("int8", "per_tensor", argument)(model)
    direct = BUILDERS[op]()
    merged = {i: (k.max(), v.max()) for i, (k, v) in ((i, per_channel.for_layer(i)) for i in range(LAYERS))}
    KvCacheQuantizationPass("int8", "per_tensor", merged)(direct)
    assert structure(model) == structure(direct)


@pytest.mark.parametrize("target", ["per_tensor", "per_channel"])
def test_mixed_granularity_caches_warn_for_the_side_that_changes(target):
    """K per channel, V per tensor: whichever target, one side's scales change granularity."""
    model = quantized("gqa", "int8", "per_channel")
    for node in model.graph:
        if op_of(node) is not None:
            node.attributes["v_quant_type"] = ir.AttrString("v_quant_type", "PER_TENSOR")
            v = node.inputs[13]
            v.const_value = ir.tensor(np.array([v.const_value.numpy().max()], np.float32), name=v.name)
            v.shape = ir.Shape([1])
    with pytest.warns(ScalesAdjustedWarning, match=rf"Layer\(s\) \[0, 1\] requantized to {target}"):
        KvCacheQuantizationPass("int4", target)(model)


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (
            ["--format", "int4"],
            0,
            "requantized from int8 per_tensor with its own scales (x 128/8: the same thresholds).",
        ),
        (["--granularity", "per_channel"], 0, "(x 128/128: the same thresholds; per_tensor -> per_channel)"),
        (
            ["--format", "int4", "--scales", "{scales}"],
            0,
            "requantized from int8 per_tensor with the scales given.",
        ),
        # in place, the config changed (past and present share one buffer): a new graph name
        ([], 1, "model.int8.onnx is already int8 per_tensor: nothing to convert."),
        (["--format", "int8"], 1, "model.int8.onnx is already int8 per_tensor: nothing to convert."),
    ],
)
def test_the_cli_says_what_requantizing_did(tmp_path, capsys, argv, code, says):
    src = save_genai_folder(tmp_path / "src", num_layers=2, vocab_size=300)
    convert_model(src, in_place=True, format="int8", scales=FOLDER_SCALES, ep="cpu")
    KvCacheScales.from_mapping(FOLDER_SCALES, format="int8").save(tmp_path / "s.json")
    argv = [a.format(scales=tmp_path / "s.json") for a in argv]
    assert main(["convert", str(src), str(tmp_path / "out"), *argv]) == code
    out, err = capsys.readouterr()
    assert says in (out if code == 0 else err)
    assert (tmp_path / "out").exists() is (code == 0)  # nothing to convert: nothing copied
