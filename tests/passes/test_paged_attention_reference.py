"""The PagedAttention CPU reference (an ONNX rewrite) against the numpy reference of the op.

Three packed sequences of different lengths share a shuffled block pool; each case runs a
prefill, a decode step, a mixed chunk (sequences adding different token counts) and another
decode, in float32, and compares the rewrite's output and stored caches with
``tests/paged_reference.py`` at every step.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheQuantizationPass
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.model_io._sessions import create_session, to_ort_value
from onnx_kvcache.passes.paged_attention_reference import (
    PagedAttentionReferencePass,
    paged_attention_reference,
)

from conftest import paged_model
from paged_reference import paged_attention

STEPS = ([5, 17, 33], [1, 1, 1], [3, 1, 2], [1, 1, 1])
TOL = 1e-5


def _scales(fmt: str | None, granularity: str, kv: int, head: int, seed: int = 3) -> dict | None:
    """Scales a little above the data's range (|x| < ~4 after RoPE), varied per channel."""
    if fmt is None:
        return None
    qmax = get_format(fmt).qmax
    rng = np.random.default_rng(seed)
    n = 1 if granularity == "per_tensor" else kv * head
    k = (3.5 + rng.random(n)).astype(np.float32) / qmax
    v = (3.0 + rng.random(n)).astype(np.float32) / qmax
    return {0: (k, v)}


class Pool:
    """A block pool shared by ``len(STEPS[0])`` sequences, blocks handed out shuffled."""

    def __init__(self, block_size: int, caches: dict[str, tuple[tuple[int, ...], np.dtype]], seed: int = 0):
        totals = np.sum(STEPS, axis=0)
        per_seq = [int(-(-t // block_size)) for t in totals]
        self.width = max(per_seq) + 1  # one unmapped (-1) column past every sequence's need
        rng = np.random.default_rng(seed)
        order = rng.permutation(sum(per_seq) + 2)  # two blocks nobody owns
        self.table = np.full((len(totals), self.width), -1, np.int32)
        taken = 0
        for b, n in enumerate(per_seq):
            self.table[b, :n] = order[taken : taken + n]
            taken += n
        blocks = sum(per_seq) + 2
        self.caches = {
            name: np.zeros((blocks, block_size, *tail), dtype) for name, (tail, dtype) in caches.items()
        }
        self.past = np.zeros(len(totals), np.int32)


def run_case(
    model: ir.Model,
    block_size: int,
    fmt: str | None,
    scales: dict | None,
    *,
    tol: float = TOL,
    seed: int = 1,
    **ref,
) -> float:
    """Run STEPS through the rewritten ``model`` and the numpy reference; returns the worst error."""
    node = next(n for n in model.graph if n.op_type == "PagedAttention")
    heads, kv = node.attributes["num_heads"].as_int(), node.attributes["kv_num_heads"].as_int()
    inputs = {i: v for i, v in enumerate(node.inputs) if v is not None}
    latent = "kv_cache_layout" in node.attributes
    row = get_format(fmt) if fmt else None
    cache_dtype = row.numpy_dtype() if row else inputs[3].dtype.numpy()
    caches = {inputs[3].name: ((kv, inputs[3].shape[3]), cache_dtype)}
    if not latent:
        caches[inputs[4].name] = ((kv, inputs[4].shape[3]), cache_dtype)
    session = create_session(paged_attention_reference(model))
    pool = Pool(block_size, caches)
    rng = np.random.default_rng(seed)
    t_dtype = inputs[0].dtype.numpy()
    k_scale = v_scale = None
    if scales is not None:
        k_scale, v_scale = scales[0]
    cos = model.graph.initializers["cos_cache"].const_value.numpy() if 8 in inputs else None
    sin = model.graph.initializers["sin_cache"].const_value.numpy() if 9 in inputs else None
    sink = inputs[11].const_value.numpy() if 11 in inputs else None
    norms = (inputs[12].const_value.numpy(), inputs[13].const_value.numpy()) if 12 in inputs else None
    worst = 0.0
    for lengths in STEPS:
        tokens = int(sum(lengths))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        feeds: dict = {
            "cumulative_sequence_lengths": cu,
            "past_sequence_lengths": pool.past.copy(),
            "block_table": pool.table,
            "attention_metadata": np.array([max(lengths), int((pool.past + lengths).max()), 0], np.int32),
        }
        slots = None
        if 10 in inputs:  # explicit slots: the derived ones, with one token's write suppressed
            slots = []
            for b, n in enumerate(lengths):
                for i in range(n):
                    p = int(pool.past[b]) + i
                    slots.append(int(pool.table[b, p // block_size]) * block_size + p % block_size)
            slots = np.array(slots, np.int32)
            slots[tokens // 2] = -1
            feeds["slot_mapping"] = slots
        data = {}
        for slot in (0, 1, 2):
            if slot in inputs:
                width = inputs[slot].shape[1]
                data[slot] = rng.standard_normal((tokens, width)).astype(t_dtype)
                feeds[inputs[slot].name] = data[slot]
        for name, cache in pool.caches.items():
            feeds[name] = to_ort_value(cache, ir.DataType.FLOAT8E4M3FN) if fmt == "fp8" else cache
        out, *presents = session.run(None, feeds)
        expected, want_k, want_v = paged_attention(
            data[0],
            data.get(1),
            data.get(2),
            pool.caches[inputs[3].name],
            None if latent else pool.caches[inputs[4].name],
            cu,
            pool.past,
            pool.table,
            num_heads=heads,
            kv_heads=kv,
            fmt=fmt,
            k_scale=k_scale,
            v_scale=v_scale,
            cos=cos,
            sin=sin,
            head_sink=sink,
            qk_norm=norms,
            slot_mapping=slots,
            **ref,
        )
        assert out.shape == expected.shape
        worst = max(worst, float(np.abs(out.astype(np.float32) - expected).max()))
        np.testing.assert_allclose(out.astype(np.float32), expected, rtol=0, atol=tol)
        for present, want in zip(presents, (want_k, want_v)):
            got = np.asarray(present).view(want.dtype)
            if row is None:  # float caches: K after norm/RoPE as computed in float32
                np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=0, atol=tol)
            else:  # quantized caches: the very codes
                np.testing.assert_array_equal(got, want)
        for name, present in zip(pool.caches, presents):
            pool.caches[name] = np.asarray(present).view(pool.caches[name].dtype)
        pool.past = pool.past + np.array(lengths, np.int32)
    return worst


def converted(model: ir.Model, fmt: str | None, granularity: str, scales: dict | None) -> ir.Model:
    if fmt is not None:
        KvCacheQuantizationPass(fmt, granularity, scales)(model)
    return model


CACHE_CASES = [(None, "per_tensor")] + [
    (fmt, g) for fmt in ("fp8", "int8", "int4") for g in ("per_tensor", "per_channel")
]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("fmt", "granularity"), CACHE_CASES)
def test_every_cache_format_matches_the_numpy_reference(fmt, granularity, block_size):
    scales = _scales(fmt, granularity, 2, 16)
    model = converted(paged_model(), fmt, granularity, scales)
    run_case(model, block_size, fmt, scales)


FEATURES = {
    "packed-qkv": ({"packed_qkv": True}, {}),
    "interleaved-rope": ({"interleaved": True}, {"interleaved": True}),
    "qk-norm": ({"qk_norm": True}, {}),
    "head-sink": ({"head_sink": True}, {}),
    "softcap-scale": ({"attributes": {"softcap": 2.0, "scale": 0.3}}, {"softcap": 2.0, "scale": 0.3}),
    "window": ({"attributes": {"local_window_size": 7}}, {"window": 7}),
    "not-causal": ({"attributes": {"is_causal": 0}}, {"causal": False}),
    "slot-mapping": ({"slot_mapping": True}, {}),
    "no-rotary": ({"rotary": False}, {}),
    "mha": ({"num_heads": 2, "kv_heads": 2}, {}),
    "group-4": ({"num_heads": 8, "kv_heads": 2}, {}),
}


@pytest.mark.parametrize("fmt", [None, "int8", "int4"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features_match_the_numpy_reference(feature, fmt):
    build, ref = FEATURES[feature]
    kv = build.get("kv_heads", 2)
    scales = _scales(fmt, "per_channel", kv, 16)
    model = converted(paged_model(**build), fmt, "per_channel", scales)
    run_case(model, 16, fmt, scales, **ref)


@pytest.mark.parametrize(("fmt", "granularity"), CACHE_CASES)
def test_latent_cache_matches_the_numpy_reference(fmt, granularity):
    """One cache: V is its leading v_head_size channels, RoPE on the rest (rotary_offset)."""
    scales = _scales(fmt, granularity, 1, 32)
    if scales is not None:  # one cache, one scale (a V scale would be unused: the pass warns)
        scales = {0: (scales[0][0], scales[0][0])}
    model = converted(
        paged_model(num_heads=4, kv_heads=1, head=32, latent=True, v_head=24), fmt, granularity, scales
    )
    ref = {"latent": True, "v_head_size": 24, "rotary_offset": 24, "scale": float(1 / np.sqrt(32))}
    run_case(model, 16, fmt, scales, **ref)


def test_float16_model_matches_within_its_precision():
    model = paged_model(dtype=ir.DataType.FLOAT16)
    with pytest.raises(AssertionError):  # fp16 output rounding is far above the fp32 tolerance
        run_case(model, 16, None, None)
    assert run_case(model, 16, None, None, tol=2e-3) < 2e-3


def test_two_layers_share_the_step_facts():
    model = paged_model(layers=2)
    PagedAttentionReferencePass()(model)
    ranges = [n for n in model.graph if n.op_type == "Range"]
    # token ids once, then per node: context positions and query rows
    assert len(ranges) == 1 + 2 * 2


def test_no_paged_node_is_a_no_op(decoder):
    assert not PagedAttentionReferencePass()(decoder).modified


def test_low_opset_is_refused():
    model = paged_model()
    model.opset_imports[""] = 17
    with pytest.raises(ir.passes.PreconditionError, match="opset >= 19"):
        PagedAttentionReferencePass()(model)


def test_rotary_without_tables_is_an_error():
    model = paged_model()
    node = next(n for n in model.graph if n.op_type == "PagedAttention")
    node.replace_input_with(8, None)
    with pytest.raises(KvCacheError, match="no cos_cache"):
        PagedAttentionReferencePass()(model)
