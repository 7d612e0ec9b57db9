"""Masks of positions counted by CumSum(attention_mask) (mobius's gemma3, granite, olmo2, smollm3).

mobius's default build of these families writes an ONNX ``Attention`` holding its own cache
with a mask made from token positions: ``c = CumSum(attention_mask)``, query ``i`` at
``c[b, width - S + i]``, key ``j`` at ``c[b, j]``; key ``j`` seen when ``c_q >= c_k`` AND
``attention_mask[b, j]`` (and for sliding layers ``c_q - c_k < W``). Small graphs of that
construct fuse into GroupQueryAttention and compute as onnxruntime's ``Attention`` does (every
valid query's output, each row's real tokens' cache entries) over left, right and middle
padding, with prefills past the window; each near miss is refused with its rule.
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


def counted_attention(
    *,
    window: int | None = None,
    compare: str = "GreaterOrEqual",
    offset: int = 0,
    padding: bool = True,
    windowed: str = "query - key",
    reverse: bool = False,
    mask_width: str = "past_seq_len + seq_len",
) -> ir.Model:
    """A 3-D ``Attention`` holding its cache, its mask as mobius writes it (``mask_width`` named
    apart from the cache's ``past + seq``). Near misses: ``compare`` (Greater: a query does not
    see itself), ``offset`` (the query's position read that many columns early), ``padding``
    False (the valid keys not masked), ``windowed`` ``key - query`` (a window the wrong way),
    ``reverse`` (a CumSum from the end)."""
    q = ir.val("q", F, ["batch", "seq", HEADS * HEAD])
    k, v = (ir.val(n, F, ["batch", "seq", KV_HEADS * HEAD]) for n in "kv")
    mask = ir.val("attention_mask", ir.DataType.INT64, ["batch", mask_width])
    past = [ir.val(f"past_{n}", F, ["batch", KV_HEADS, "past", HEAD]) for n in ("key", "value")]
    nodes: list[ir.Node] = []
    one, two = _const(nodes, np.array([1], np.int64)), _const(nodes, np.array([2], np.int64))
    counted = _op(nodes, "CumSum", [mask, _const(nodes, np.array(1, np.int64))], reverse=int(reverse))
    width = _op(nodes, "Shape", [mask], start=1, end=2)
    seq = _op(nodes, "Shape", [q], start=1, end=2)
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
        [q, k, v, mask, *past], list(attention.outputs), nodes=nodes, opset_imports={"": 24}, name="counted"
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
