"""CachedAttentionFusionPass: the ONNX Attention operator holding its own cache -> GroupQueryAttention.

The oracle is mobius's default build (``tests/data/mobius_llama_default``: opset 24, 3-D Q/K/V,
``past_key``/``past_value`` inside the operator, a boolean mask from ``attention_mask``,
``is_causal=1``), run by onnxruntime's own ``Attention`` kernel against its fused form over a
7-token prefill and 3 decode steps: logits and each row's real tokens' cache entries (GQA holds
a row's valid tokens compacted, :func:`decoding.max_differences`). Then it converts to int8
that onnxruntime's CPU kernel runs and to fp8 that the CUDA-rule emulation evaluates. Small
onnx_ir graphs pin the operator's other attributes (4-D, softcap, scale, a 0/-inf mask, the
softmax output) against onnxruntime's ``Attention``, and each refusal. The static-cache build
(``tests/data/mobius_llama_static``) is refused with what it is.
"""

from __future__ import annotations

import json
import pathlib
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from decoding import PROMPTS, count, generate, max_differences
from onnx_kvcache import KvCacheRunner, KvCacheWarning, calibrate_kv_cache, convert_model, optimize_model
from onnx_kvcache.errors import FusionSkippedWarning, NotConvertedWarning
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.passes.fusion.attention_fusion import AttentionFusionPass
from onnx_kvcache.passes.fusion.cached_attention_fusion import CachedAttentionFusionPass
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass

from conftest import gqa_nodes

DATA = pathlib.Path(__file__).parents[2] / "data"
DEFAULT = DATA / "mobius_llama_default" / "model.onnx"
STATIC = DATA / "mobius_llama_static" / "model.onnx"
VOCAB = 256
CALIBRATION = [list(np.random.default_rng(7).integers(0, VOCAB, 128)) for _ in range(2)]
"""256 token ids (the calibration minimum)."""
EXACT = 1e-4


def fused(model: ir.Model) -> ir.Model:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)  # the padding assumption, said elsewhere
        result = GqaFusionPass()(model)
    assert result.modified and not result.report.refusals
    return result.model


@pytest.fixture(scope="module")
def float_gqa() -> ir.Model:
    return fused(ir.load(DEFAULT))


@pytest.mark.parametrize("prompt", ["single", "left_padded", "right_padded", "middle_padded", "empty_row"])
def test_mobius_default_build_fuses_and_computes_as_the_export(float_gqa, prompt):
    original = ir.load(DEFAULT)
    assert count(float_gqa, "Attention") == 0 and count(float_gqa, "GroupQueryAttention") == 2
    worst = max_differences(generate(original, PROMPTS[prompt]), generate(float_gqa, PROMPTS[prompt]))
    assert max(worst.values()) < EXACT, worst


def test_mobius_default_build_keeps_its_interface(float_gqa):
    original = ir.load(DEFAULT)
    for a, b in (
        (float_gqa.graph.inputs, original.graph.inputs),
        (float_gqa.graph.outputs, original.graph.outputs),
    ):
        assert [(v.name, v.dtype, v.shape) for v in a] == [(v.name, v.dtype, v.shape) for v in b]
    gqa = gqa_nodes(float_gqa)
    assert {(n.attributes["num_heads"].as_int(), n.attributes["kv_num_heads"].as_int()) for n in gqa} == {
        (4, 2)
    }
    assert {n.attributes["scale"].as_float() for n in gqa} == {0.125}
    assert count(float_gqa, "ReduceSum") == 1 and count(float_gqa, "Pad") == 1  # once per graph


@pytest.fixture(scope="module")
def int8_scales(float_gqa):
    return calibrate_kv_cache(float_gqa, CALIBRATION, format="int8", seq_len=128, progress=False)


@pytest.mark.parametrize("prompt", ["single", "left_padded"])
def test_mobius_default_build_converts_to_int8_the_cpu_kernel_runs(tmp_path, float_gqa, int8_scales, prompt):
    out = tmp_path / "int8.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        result = convert_model(DEFAULT, out, format="int8", ep="cpu", scales=int8_scales)
    assert result.converted and result.nodes == 2
    onnx.checker.check_model(onnx.load(out), full_check=True)
    model = ir.load(out)
    assert {v.dtype for v in model.graph.inputs if v.name.startswith("past")} == {ir.DataType.INT8}
    want, got = generate(float_gqa, PROMPTS[prompt]), generate(model, PROMPTS[prompt])
    for step, ((mask, a), (_, b)) in enumerate(zip(want, got, strict=True)):
        rows = mask[:, -a["logits"].shape[1] :].astype(bool)
        diff = np.abs(a["logits"] - b["logits"])[rows]
        assert np.isfinite(b["logits"][rows]).all()
        top = np.abs(a["logits"]).max()
        # the prompt attends through the float kernel (cache.prompt_path), each new token not
        assert diff.max() < 1e-5 * top if step == 0 else 0 < diff.max() < 0.05 * top


def test_mobius_default_build_converts_to_fp8_the_cuda_rule_evaluates(float_gqa):
    scales = calibrate_kv_cache(float_gqa, CALIBRATION, format="fp8", seq_len=128, progress=False)
    model = ir.load(DEFAULT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        optimize_model(model, ep=None, fp8_kv_cache=True, scales=scales)
    assert {v.dtype for v in model.graph.inputs if v.name.startswith("past")} == {ir.DataType.FLOAT8E4M3FN}
    runner, reference = KvCacheRunner(model, semantics="cuda"), KvCacheRunner(float_gqa)
    assert runner.emulated
    ids = np.random.default_rng(1).integers(0, VOCAB, 7)
    a, b = [reference.prefill(ids)[0, -1]], [runner.prefill(ids)[0, -1]]
    for token in (5, 17, 99):
        a.append(reference.step(token)[0])
        b.append(runner.step(token)[0])
    a, b = np.stack(a), np.stack(b)
    assert np.isfinite(b).all() and 0 < np.abs(a - b).max() < 0.1 * np.abs(a).max()


def test_the_cli_calibrates_and_converts_the_mobius_default_build(tmp_path, capsys):
    from onnx_kvcache.cli.commands import main

    scales, out, ids = tmp_path / "scales.json", tmp_path / "int8.onnx", tmp_path / "ids.json"
    ids.write_text(json.dumps([[int(t) for t in seq] for seq in CALIBRATION]))
    quick = ["--token-ids", str(ids), "--seq-len", "128", "--no-progress"]
    assert main(["calibrate", str(DEFAULT), "--out", str(scales), "--format", "int8", *quick]) == 0
    argv = ["convert", str(DEFAULT), str(out), "--format", "int8", "--ep", "cpu", "--scales", str(scales)]
    assert main(argv) == 0
    assert "converted 2 GroupQueryAttention node(s)" in capsys.readouterr().out
    assert len(KvCacheRunner(out).generate([1, 2, 3], 3)) == 3


STATIC_REASON = (
    "static cache written by TensorScatter at write_indices: attention reads the whole fixed buffer"
)


def test_the_static_cache_build_is_refused_naming_what_it_is(tmp_path, capsys):
    from onnx_kvcache.cli.commands import main

    out, scales = tmp_path / "int8.onnx", tmp_path / "scales.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.1, 0.1]}}))
    argv = ["convert", str(STATIC), str(out), "--format", "int8", "--ep", "cpu", "--scales", str(scales)]
    assert main(argv) == 1
    said = capsys.readouterr().err.strip()
    assert STATIC_REASON in said and "key_cache.0 [batch, 512, 128]" in said and "nonpad_kv_seqlen" in said
    assert "past_key" not in said and "past_value" not in said and len(said.splitlines()) == 1
    assert not out.exists()


def test_the_static_cache_build_is_left_as_it_is():
    model = ir.load(STATIC)
    before = ir.to_onnx_text(model)
    with pytest.warns(FusionSkippedWarning, match="static cache written by TensorScatter"):
        result = GqaFusionPass()(model)
    assert not result.modified and ir.to_onnx_text(model) == before
    assert len(result.report.refusals) == 2


# Small graphs: one Attention holding its cache, fed Q/K/V directly.

F = ir.DataType.FLOAT
BATCH, HEADS, KV_HEADS, HEAD = 2, 4, 2, 16


def cached_attention(
    *,
    rank: int = 3,
    mask: str = "bool",
    mask_width: str = "total",
    head: int = HEAD,
    attributes: dict | None = None,
    probs: bool = False,
    nonpad: bool = False,
    past_value: bool = True,
) -> ir.Model:
    """An ``Attention`` with ``past_key``/``past_value`` inside, as mobius writes it.

    ``mask``: ``bool`` (Cast of attention_mask), ``additive`` (Where(mask, 0, -inf)),
    ``float_input`` (a float graph input), ``none``.
    """
    if rank == 3:
        q = ir.val("q", F, ["batch", "seq", HEADS * head])
        k, v = (ir.val(n, F, ["batch", "seq", KV_HEADS * head]) for n in "kv")
    else:
        q = ir.val("q", F, ["batch", HEADS, "seq", head])
        k, v = (ir.val(n, F, ["batch", KV_HEADS, "seq", head]) for n in "kv")
    past = [ir.val(f"past_{n}", F, ["batch", KV_HEADS, "past", head]) for n in ("key", "value")]
    inputs, nodes = [q, k, v], []
    attn_mask = None
    if mask == "float_input":
        attn_mask = ir.val("bias", F, ["batch", 1, "seq", "past + seq"])
        inputs.append(attn_mask)
    elif mask != "none":
        padding = ir.val("attention_mask", ir.DataType.INT64, ["batch", mask_width])
        inputs.append(padding)
        # as mobius: Expand(Unsqueeze(Cast(mask)), [batch, seq, columns]), then the head axis
        axes = ir.node("Constant", [], {"value": ir.tensor(np.array([1], np.int64))}, name="axes")
        cast = ir.node("Cast", [padding], {"to": ir.DataType.BOOL}, name="cast")
        rows = ir.node("Unsqueeze", [cast.outputs[0], axes.outputs[0]], name="rows")
        seq = 1 if rank == 3 else 2
        dims = [
            ir.node("Shape", [q], {"start": 0, "end": 1}, name="batch"),
            ir.node("Shape", [q], {"start": seq, "end": seq + 1}, name="seq"),
            ir.node("Shape", [padding], {"start": 1, "end": 2}, name="columns"),
        ]
        shape = ir.node("Concat", [d.outputs[0] for d in dims], {"axis": 0}, name="shape")
        expand = ir.node("Expand", [rows.outputs[0], shape.outputs[0]], name="expand")
        heads = ir.node("Unsqueeze", [expand.outputs[0], axes.outputs[0]], name="heads")
        nodes += [axes, cast, rows, *dims, shape, expand, heads]
        attn_mask = heads.outputs[0]
        if mask == "additive":
            zero = ir.node("Constant", [], {"value": ir.tensor(np.array(0.0, np.float32))}, name="zero")
            low = ir.node("Constant", [], {"value": ir.tensor(np.array(-np.inf, np.float32))}, name="low")
            where = ir.node("Where", [attn_mask, zero.outputs[0], low.outputs[0]], name="where")
            nodes += [zero, low, where]
            attn_mask = where.outputs[0]
    inputs += past if past_value else past[:1]
    lengths = None
    if nonpad:
        lengths = ir.val("nonpad_kv_seqlen", ir.DataType.INT64, ["batch"])
        inputs.append(lengths)
    attrs = {"is_causal": 1} | ({"q_num_heads": HEADS, "kv_num_heads": KV_HEADS} if rank == 3 else {})
    attrs |= attributes or {}
    node = ir.node(
        "Attention",
        [q, k, v, attn_mask, past[0], past[1] if past_value else None, lengths],
        attrs,
        num_outputs=4 if probs else 3,
        name="attention",
    )
    nodes.append(node)
    outputs = list(node.outputs)
    for value, name in zip(outputs, ("y", "present_key", "present_value", "probs")):
        value.name, value.dtype = name, F
    graph = ir.Graph(inputs, outputs, nodes=nodes, opset_imports={"": 24}, name="cached_attention")
    return ir.Model(graph, ir_version=10)


def run_steps(model: ir.Model, steps=(7, 1, 1, 1), seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A prefill then decode steps with random Q/K/V, the presents fed back."""
    session = create_session(model)
    names = {i.name for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    rank = len(model.graph.inputs[0].shape)
    rng = np.random.default_rng(seed)
    head = model.graph.inputs[0].shape[-1] // (HEADS if rank == 3 else 1)
    past = {
        n: np.zeros((BATCH, KV_HEADS, 0, head), np.float32) for n in ("past_key", "past_value") if n in names
    }
    history, total = [], 0
    for seq in steps:
        total += seq
        if rank == 3:
            shapes = {"q": (BATCH, seq, HEADS * head), "k": (BATCH, seq, KV_HEADS * head)}
            shapes["v"] = shapes["k"]
        else:
            shapes = {"q": (BATCH, HEADS, seq, head), "k": (BATCH, KV_HEADS, seq, head)}
            shapes["v"] = shapes["k"]
        feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()} | past
        if "attention_mask" in names:
            feeds["attention_mask"] = np.ones((BATCH, total), np.int64)
        if "bias" in names:
            feeds["bias"] = np.zeros((BATCH, 1, seq, total), np.float32)
        result = dict(zip(outputs, session.run(None, feeds)))
        history.append(result)
        past = {n: result[n.replace("past", "present")] for n in past}
    return history


FUSES = {
    "3d_bool_mask_fitted": {},
    "3d_mask_width_past_plus_seq": {"mask_width": "past + seq"},
    "4d": {"rank": 4},
    "softcap": {"attributes": {"softcap": 2.0}},
    "scale": {"attributes": {"scale": 0.3}},
    "default_scale": {"attributes": {}},
    "additive_mask": {"mask": "additive"},
    "causal_without_mask": {"mask": "none"},
    "softmax_output_read": {"probs": True, "attributes": {"qk_matmul_output_mode": 3}},
}


@pytest.mark.parametrize("case", FUSES)
def test_small_cached_attention_fuses_and_matches_onnxruntimes_attention(case):
    original = cached_attention(**FUSES[case])
    model = cached_attention(**FUSES[case])
    result = CachedAttentionFusionPass()(model)
    assert result.report.fused == 1 and not result.report.refusals
    assert count(model, "Attention") == 0 and count(model, "GroupQueryAttention") == 1
    assert not AttentionFusionPass()(cached_attention(**FUSES[case])).report.refusals  # not its candidate
    for want, got in zip(run_steps(original), run_steps(model)):
        assert want.keys() == got.keys()
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=EXACT, rtol=0, err_msg=name)


def spec_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The operator's specification for 3-D Q/K/V, no past, is_causal=1, a boolean [batch, columns]
    mask padded with -inf (False) to the key count; default scale."""
    batch, seq, _ = q.shape
    qh = q.reshape(batch, seq, HEADS, HEAD).transpose(0, 2, 1, 3)
    kh, vh = (
        np.repeat(x.reshape(batch, seq, KV_HEADS, HEAD).transpose(0, 2, 1, 3), 2, axis=1) for x in (k, v)
    )
    scores = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(HEAD)
    keys = np.zeros((batch, seq), bool)
    keys[:, : mask.shape[1]] = mask.astype(bool)
    allowed = np.tril(np.ones((seq, seq), bool))[None, None] & keys[:, None, None, :]
    scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return (weights @ vh).transpose(0, 2, 1, 3).reshape(batch, seq, HEADS * HEAD)


def test_the_fitted_mask_reads_a_shorter_mask_as_the_specification_does():
    """A mask with fewer key columns than the cache: the specification pads it with -inf
    (onnxruntime's Attention refuses it; the fused node computes the specification)."""
    model = cached_attention()
    CachedAttentionFusionPass()(model)
    rng = np.random.default_rng(3)
    feeds = {
        "q": rng.standard_normal((BATCH, 5, HEADS * HEAD)).astype(np.float32),
        "k": rng.standard_normal((BATCH, 5, KV_HEADS * HEAD)).astype(np.float32),
        "v": rng.standard_normal((BATCH, 5, KV_HEADS * HEAD)).astype(np.float32),
        "attention_mask": np.ones((BATCH, 3), np.int64),  # keys 3, 4 masked
        "past_key": np.zeros((BATCH, KV_HEADS, 0, HEAD), np.float32),
        "past_value": np.zeros((BATCH, KV_HEADS, 0, HEAD), np.float32),
    }
    got = create_session(model).run(["y"], feeds)[0]
    want = spec_attention(feeds["q"], feeds["k"], feeds["v"], feeds["attention_mask"])
    np.testing.assert_allclose(got[:, :3], want[:, :3], atol=EXACT, rtol=0)  # the valid queries


def _with_reader(model: ir.Model, name: str) -> ir.Model:
    value = next(v for v in [*model.graph.inputs, *model.graph.outputs] if v.name == name)
    reader = ir.node("ReduceSum", [value], name="reader")
    model.graph.append(reader)
    reader.outputs[0].name, reader.outputs[0].dtype = "read", F
    model.graph.outputs.append(reader.outputs[0])
    return model


def _not_output(model: ir.Model, name: str) -> ir.Model:
    model.graph.outputs.remove(next(v for v in model.graph.outputs if v.name == name))
    return model


def _static(model: ir.Model) -> ir.Model:
    """K/V written into fixed buffers by TensorScatter, the cache inputs 4/5 dropped."""
    graph = model.graph
    node = next(n for n in graph if n.op_type == "Attention")
    at = ir.val("write_indices", ir.DataType.INT64, ["batch"])
    lengths = ir.val("nonpad_kv_seqlen", ir.DataType.INT64, ["batch"])
    graph.inputs.extend([at, lengths])
    for index, name in ((1, "key"), (2, "value")):
        buffer = ir.val(f"{name}_cache", F, ["batch", 32, KV_HEADS * HEAD])
        graph.inputs.append(buffer)
        scatter = ir.node(
            "TensorScatter", [buffer, node.inputs[index], at], {"axis": 1}, name=f"scatter_{name}"
        )
        graph.insert_before(node, scatter)
        node.replace_input_with(index, scatter.outputs[0])
    node.replace_input_with(4, None)
    node.replace_input_with(5, None)
    node.replace_input_with(6, lengths)
    for value in list(graph.outputs)[1:]:
        graph.outputs.remove(value)
    return model


REFUSALS = {
    "read_scores_mode_0": (lambda: cached_attention(probs=True), "qk_matmul_output (mode 0) is read"),
    "float_mask_input": (
        lambda: cached_attention(mask="float_input"),
        "attn_mask 'bias' is not a provable causal/padding mask: ",
    ),
    "not_causal": (
        lambda: cached_attention(mask="none", attributes={"is_causal": 0}),
        "is_causal=0 without a mask is not causal",
    ),
    "nonpad_with_past": (
        lambda: cached_attention(nonpad=True),
        "combines past_key/past_value with nonpad_kv_seqlen",
    ),
    "only_past_key": (lambda: cached_attention(past_value=False), "only one of past_key and past_value"),
    "present_read_elsewhere": (
        lambda: _with_reader(cached_attention(), "present_key"),
        "the cache 'present_key' is also read by ReduceSum",
    ),
    "past_read_elsewhere": (
        lambda: _with_reader(cached_attention(), "past_value"),
        "the cache 'past_value' is also read by ReduceSum",
    ),
    "present_not_an_output": (
        lambda: _not_output(cached_attention(), "present_value"),
        "present of past_value 'past_value' is not a graph output",
    ),
    "head_size": (
        lambda: cached_attention(head=12),
        "head size 12: GroupQueryAttention needs a multiple of 8",
    ),
    "half_softmax": (
        lambda: cached_attention(attributes={"softmax_precision": int(ir.DataType.FLOAT16)}),
        "softmax_precision=10",
    ),
    "zero_scale": (lambda: cached_attention(attributes={"scale": 0.0}), "scale=0.0"),
    "static_cache": (
        lambda: _static(cached_attention()),
        "static cache written by TensorScatter at write_indices",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_each_unprovable_cached_attention_is_refused_with_its_reason(case):
    make, reason = REFUSALS[case]
    model = make()
    before = ir.to_onnx_text(model)
    with pytest.warns(FusionSkippedWarning, match="Attention node\\(s\\) left as they are"):
        result = CachedAttentionFusionPass()(model)
    assert not result.modified and ir.to_onnx_text(model) == before
    (refusal,) = result.report.refusals
    assert reason in refusal.text and "\n" not in refusal.text
    if case == "static_cache":
        assert "past_key" not in refusal.text and "nonpad_kv_seqlen" in refusal.text


def test_convert_refuses_an_unfused_cached_attention_writing_nothing(tmp_path):
    source = tmp_path / "model.onnx"
    ir.save(cached_attention(probs=True), source)
    out = tmp_path / "int8.onnx"
    with pytest.warns(NotConvertedWarning, match="qk_matmul_output \\(mode 0\\) is read"):
        result = convert_model(source, out, format="int8", ep="cpu", scales={0: (0.1, 0.1)})
    assert not result.converted and not out.exists()
