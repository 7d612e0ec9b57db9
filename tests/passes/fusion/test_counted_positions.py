"""Masks of positions counted by CumSum(attention_mask) (mobius's gemma3, granite, olmo2, smollm3, gpt-oss).

mobius's default build of these families writes an ONNX ``Attention`` holding its own cache
with a mask made from token positions: ``c = CumSum(attention_mask)``, query ``i`` at
``c[b, width - S + i]``, key ``j`` at ``c[b, j]``; key ``j`` seen when ``c_q >= c_k`` AND
``attention_mask[b, j]`` (and for sliding layers ``c_q - c_k < W``). Small graphs of that
construct fuse into GroupQueryAttention and compute as onnxruntime's ``Attention`` does (every
valid query's output, each row's real tokens' cache entries) over left, right and middle
padding, with prefills past the window; each near miss is refused with its rule. mobius's
gpt-oss writes the same mask into decomposed attention (``MatMul``/``Softmax``, for its sinks),
added to scores ``past + seq`` wide: the mask's own width, named apart, is tied to that.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheWarning
from onnx_kvcache.errors import FusionSkippedWarning
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.passes.fusion.cached_attention_fusion import CachedAttentionFusionPass
from onnx_kvcache.passes.fusion.sdpa_fusion import DecomposedAttentionFusionPass

F = ir.DataType.FLOAT
HEADS, KV_HEADS, HEAD = 4, 2, 16
EXACT = 1e-4


def _const(nodes: list[ir.Node], array: np.ndarray) -> ir.Value:
    node = ir.node("Constant", [], {"value": ir.tensor(array)})
    nodes.append(node)
    return node.outputs[0]


def _op(nodes: list[ir.Node], op: str, inputs: list, **attrs) -> ir.Value:
    node = ir.node(op, inputs, attrs)
    nodes.append(node)
    return node.outputs[0]


def _inputs_and_mask(nodes: list[ir.Node], mask_width: str, mask: dict) -> tuple:
    """Both builders' inputs (q, k, v, attention_mask, the pasts) and the counted mask."""
    q = ir.val("q", F, ["batch", "seq", HEADS * HEAD])
    k, v = (ir.val(n, F, ["batch", "seq", KV_HEADS * HEAD]) for n in "kv")
    padding = ir.val("attention_mask", ir.DataType.INT64, ["batch", mask_width])
    past = [ir.val(f"past_{n}", F, ["batch", KV_HEADS, "past", HEAD]) for n in ("key", "value")]
    seq = _op(nodes, "Shape", [q], start=1, end=2)
    attn_mask = _counted_mask(nodes, padding, seq, mask_width, **mask)  # type: ignore[arg-type]
    return q, k, v, padding, past, attn_mask


def counted_attention(*, mask_width: str = "past_seq_len + seq_len", **mask: object) -> ir.Model:
    """A 3-D ``Attention`` holding its cache, its mask as mobius writes it (``mask_width`` named
    apart from the cache's ``past + seq``; ``mask``: :func:`_counted_mask`'s window and near misses)."""
    nodes: list[ir.Node] = []
    q, k, v, padding, past, attn_mask = _inputs_and_mask(nodes, mask_width, mask)
    attention = ir.node(
        "Attention",
        [q, k, v, attn_mask, *past],
        {"is_causal": 1, "q_num_heads": HEADS, "kv_num_heads": KV_HEADS},
        num_outputs=3,
        name="attention",
    )
    nodes.append(attention)
    for value, name in zip(attention.outputs, ("y", "present_key", "present_value")):
        value.name, value.dtype = name, F
    graph = ir.Graph(
        [q, k, v, padding, *past],
        list(attention.outputs),
        nodes=nodes,
        opset_imports={"": 24},
        name="counted",
    )
    return ir.Model(graph, ir_version=10)


def _counted_mask(
    nodes: list[ir.Node],
    mask: ir.Value,
    seq: ir.Value,
    mask_width: str,
    *,
    window: int | None = None,
    compare: str = "GreaterOrEqual",
    offset: int = 0,
    padding: bool = True,
    windowed: str = "query - key",
    reverse: bool = False,
) -> ir.Value:
    """The additive ``[batch, 1, seq, width]`` mask mobius makes from ``c = CumSum(mask)``. Near
    misses: ``compare`` (Greater: a query does not see itself), ``offset`` (the query's position
    read that many columns early), ``padding`` False (the valid keys not masked), ``windowed``
    ``key - query`` (a window the wrong way), ``reverse`` (a CumSum from the end)."""
    one, two = _const(nodes, np.array([1], np.int64)), _const(nodes, np.array([2], np.int64))
    counted = _op(nodes, "CumSum", [mask, _const(nodes, np.array(1, np.int64))], reverse=int(reverse))
    width = _op(nodes, "Shape", [mask], start=1, end=2)
    start = _op(nodes, "Sub", [width, seq])
    if offset:
        start = _op(nodes, "Sub", [start, _const(nodes, np.array([offset], np.int64))])
    queries = _op(nodes, "Unsqueeze", [_op(nodes, "Slice", [counted, start, width, one]), two])
    keys = _op(nodes, "Unsqueeze", [counted, one])
    allowed = _op(nodes, compare, [queries, keys])
    if window is not None:
        apart = [queries, keys] if windowed == "query - key" else [keys, queries]
        near = _op(nodes, "Less", [_op(nodes, "Sub", apart), _const(nodes, np.array(window, np.int64))])
        allowed = _op(nodes, "And", [allowed, near])
    if padding:
        valid = _op(nodes, "Cast", [_op(nodes, "Unsqueeze", [mask, one])], to=ir.DataType.BOOL)
        allowed = _op(nodes, "And", [valid, allowed])
    low = np.array(np.finfo(np.float32).min, np.float32)
    additive = _op(nodes, "Where", [allowed, _const(nodes, np.array(0.0, np.float32)), _const(nodes, low)])
    attn_mask = _op(nodes, "Unsqueeze", [additive, one])
    attn_mask.dtype, attn_mask.shape = F, ir.Shape(["batch", 1, "_d1", mask_width])  # as mobius
    return attn_mask


def counted_decomposed(*, mask_width: str = "past_seq_len + seq_len", **mask: object) -> ir.Model:
    """:func:`counted_attention`'s model written out as mobius writes gpt-oss's attention: Q/K/V
    to heads, ``Concat(past, new)`` as the presents, ``repeat_kv``, ``MatMul``/``Softmax`` with
    the mask added to the scores (``past + seq`` columns; the mask ``mask_width``)."""
    nodes: list[ir.Node] = []
    q, k, v, padding, past, attn_mask = _inputs_and_mask(nodes, mask_width, mask)

    def heads(x: ir.Value, count: int) -> ir.Value:
        split = _op(nodes, "Reshape", [x, _const(nodes, np.array([0, 0, count, HEAD], np.int64))])
        return _op(nodes, "Transpose", [split], perm=[0, 2, 1, 3])

    presents = [_op(nodes, "Concat", [p, heads(x, KV_HEADS)], axis=2) for p, x in zip(past, (k, v))]
    batch, length = (
        _op(nodes, "Shape", [q], start=0, end=1),
        _op(nodes, "Shape", [presents[0]], start=2, end=3),
    )
    group = [
        _const(nodes, np.array([KV_HEADS, HEADS // KV_HEADS], np.int64)),
        _const(nodes, np.array([HEAD])),
    ]
    wide = _op(nodes, "Concat", [batch, group[0], length, group[1]], axis=0)
    flat = _op(nodes, "Concat", [batch, _const(nodes, np.array([HEADS])), length, group[1]], axis=0)
    two = _const(nodes, np.array([2], np.int64))
    key, value = (
        _op(nodes, "Reshape", [_op(nodes, "Expand", [_op(nodes, "Unsqueeze", [x, two]), wide]), flat])
        for x in presents
    )
    scores = _op(nodes, "MatMul", [heads(q, HEADS), _op(nodes, "Transpose", [key], perm=[0, 1, 3, 2])])
    scaled = _op(nodes, "Mul", [scores, _const(nodes, np.array(HEAD**-0.5, np.float32))])
    probs = _op(nodes, "Softmax", [_op(nodes, "Add", [scaled, attn_mask])], axis=-1)
    out = _op(nodes, "Transpose", [_op(nodes, "MatMul", [probs, value])], perm=[0, 2, 1, 3])
    y = _op(nodes, "Reshape", [out, _const(nodes, np.array([0, 0, HEADS * HEAD], np.int64))])
    for value_, name in zip((y, *presents), ("y", "present_key", "present_value")):
        value_.name, value_.dtype = name, F
    graph = ir.Graph(
        [q, k, v, padding, *past], [y, *presents], nodes=nodes, opset_imports={"": 24}, name="decomposed"
    )
    return ir.Model(graph, ir_version=10)


def fuse(model: ir.Model) -> ir.Model:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        result = CachedAttentionFusionPass()(model)
    assert result.report.fused == 1 and not result.report.refusals
    return model


def run(model: ir.Model, prompt: np.ndarray, steps: int = 4, seed: int = 0) -> list[tuple]:
    """A prefill of ``prompt`` (its attention mask) then decode steps, random Q/K/V."""
    session = create_session(model)
    rng = np.random.default_rng(seed)
    batch = prompt.shape[0]
    past = {n: np.zeros((batch, KV_HEADS, 0, HEAD), np.float32) for n in ("past_key", "past_value")}
    mask, history = prompt, []
    for step in range(steps + 1):
        seq = prompt.shape[1] if step == 0 else 1
        feeds = {
            "q": rng.standard_normal((batch, seq, HEADS * HEAD)).astype(np.float32),
            "k": rng.standard_normal((batch, seq, KV_HEADS * HEAD)).astype(np.float32),
            "v": rng.standard_normal((batch, seq, KV_HEADS * HEAD)).astype(np.float32),
            "attention_mask": mask,
        } | past
        y, key, value = session.run(None, feeds)
        history.append((mask, y, key, value))
        past = {"past_key": key, "past_value": value}
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
    return history


def differences(want: list[tuple], got: list[tuple]) -> float:
    """Largest difference over valid queries' outputs and each row's real cache entries (the
    export keeps them at their padded columns, the fused cache compacted at its start)."""
    worst = 0.0
    for (mask, y0, k0, v0), (_, y1, k1, v1) in zip(want, got):
        rows = mask[:, -y0.shape[1] :].astype(bool)
        worst = max(worst, float(np.abs(y0 - y1)[rows].max(initial=0.0)))
        for r, valid in enumerate(mask.astype(bool)):
            for a, b in ((k0, k1), (v0, v1)):
                worst = max(worst, float(np.abs(a[r][:, valid] - b[r][:, : valid.sum()]).max(initial=0.0)))
    return worst


PROMPTS = {
    "single": np.ones((1, 7), np.int64),
    "left_padded": np.array([[1] * 7, [0] * 3 + [1] * 4]),
    "right_padded": np.array([[1] * 7, [1] * 4 + [0] * 3]),
    "middle_padded": np.array([[1] * 9, [1, 1, 0, 0, 1, 0, 1, 1, 1]]),
    "past_the_window": np.ones((1, 9), np.int64),
    "left_padded_past_the_window": np.array([[1] * 10, [0] * 4 + [1] * 6]),
}


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_counted_positions_fuse_and_compute_as_onnxruntimes_attention(window, prompt):
    fused = fuse(counted_attention(window=window))
    gqa = [n for n in fused.graph if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 1 and not any(n.op_type == "Attention" for n in fused.graph)
    window_attr = gqa[0].attributes.get("local_window_size")
    assert (window_attr.as_int() if window_attr is not None else None) == window
    want, got = run(counted_attention(window=window), PROMPTS[prompt]), run(fused, PROMPTS[prompt])
    assert differences(want, got) < EXACT


@pytest.mark.parametrize("prompt", ["left_padded", "middle_padded"])
def test_a_mask_declared_past_plus_seq_wide_needs_no_tie(prompt):
    fused = fuse(counted_attention(window=3, mask_width="past + seq"))
    want = run(counted_attention(window=3, mask_width="past + seq"), PROMPTS[prompt])
    assert differences(want, run(fused, PROMPTS[prompt])) < EXACT


def test_a_counted_window_is_not_reported_as_differing_under_padding():
    """The window counts valid tokens, as GQA's does over its compacted cache: no window warning."""
    model = counted_attention(window=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        result = CachedAttentionFusionPass()(model)
    assert result.report.padded == 1 and result.report.padded_windows == 0


NEAR_MISSES = {
    "strict_comparison": (
        {"compare": "Greater"},
        "reads counted positions other than the query's (at key past + query) against the key's",
    ),
    "query_position_early": ({"offset": 1}, "token positions counted by CumSum of attention_mask"),
    "window_the_wrong_way": (
        {"window": 3, "windowed": "key - query"},
        "reads counted positions other than the query's (at key past + query) against the key's",
    ),
    "valid_keys_not_masked": (
        {"padding": False},
        "compares positions counted by CumSum of attention_mask but masks the keys of no padding input",
    ),
    "reverse_cumsum": ({"reverse": True}, "token positions counted by CumSum of attention_mask"),
}


@pytest.mark.parametrize("case", NEAR_MISSES)
def test_each_near_miss_of_counted_positions_is_refused(case):
    attributes, reason = NEAR_MISSES[case]
    model = counted_attention(**attributes)
    before = ir.to_onnx_text(model)
    with pytest.warns(FusionSkippedWarning, match="Attention node\\(s\\) left as they are"):
        result = CachedAttentionFusionPass()(model)
    assert not result.modified and ir.to_onnx_text(model) == before
    (refusal,) = result.report.refusals
    assert reason in refusal.text and "\n" not in refusal.text


@pytest.mark.parametrize("case", ["strict_comparison", "window_the_wrong_way"])
def test_the_near_misses_compute_otherwise(case):
    """Each refused near miss does compute something else than the fused form would."""
    model = counted_attention(**NEAR_MISSES[case][0])
    reference = counted_attention(window=3 if case == "window_the_wrong_way" else None)
    prompt = PROMPTS["left_padded"]
    assert differences(run(reference, prompt), run(model, prompt)) > 1e-2


# ---- the same mask in decomposed attention (mobius's gpt-oss) ----


def fuse_decomposed(model: ir.Model) -> ir.Model:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        result = DecomposedAttentionFusionPass()(model)
    assert result.report.fused == 1 and not result.report.refusals, result.report.refusals
    return model


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_counted_positions_in_decomposed_attention_fuse_with_the_width_tied(window, prompt):
    """The mask is ``past_seq_len + seq_len`` wide, the scores ``past + seq``: the tie proves it
    and the fused model computes as the export over left, right and middle padding."""
    fused = fuse_decomposed(counted_decomposed(window=window))
    (gqa,) = [n for n in fused.graph if n.op_type == "GroupQueryAttention"]
    assert not any(n.op_type == "Softmax" for n in fused.graph)
    window_attr = gqa.attributes.get("local_window_size")
    assert (window_attr.as_int() if window_attr is not None else None) == window
    want, got = run(counted_decomposed(window=window), PROMPTS[prompt]), run(fused, PROMPTS[prompt])
    assert differences(want, got) < EXACT


@pytest.mark.parametrize(
    ("attributes", "reason"),
    [
        # seq columns read as a mask cut to min(width, past + seq) (transformers 4.x's), whose counted
        # positions then miss the query's
        ({"mask_width": "seq"}, "reads counted positions other than the query's"),
        ({"mask_width": "past + seq + 1"}, "the mask has past + seq + 1 key columns, the cache past + seq"),
        ({"offset": 1}, "token positions counted by CumSum of attention_mask"),
        ({"window": 3, "windowed": "key - query"}, "reads counted positions other than the query's"),
    ],
)
def test_a_decomposed_counted_mask_that_the_tie_does_not_prove_is_refused(attributes, reason):
    """A width no name can be tied to ``past + seq`` (no free name, or one column more), and the
    near misses of a tied mask, are refused with their rule and leave the model unchanged."""
    model = counted_decomposed(**attributes)
    before = ir.to_onnx_text(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        result = DecomposedAttentionFusionPass()(model)
    assert not result.modified and ir.to_onnx_text(model) == before
    (refusal,) = result.report.refusals
    assert reason in refusal.text, refusal.text
