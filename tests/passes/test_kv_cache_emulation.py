"""Quantized KV caches emulated on CPU: the CUDA and CPU kernel rules, checked against numpy."""

from __future__ import annotations

import logging
import warnings

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheQuantizationPass, KvCacheRunner
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.errors import KvCacheError, KvCacheWarning
from onnx_kvcache.model_io._sessions import create_session, to_ort_value
from onnx_kvcache.passes.kv_cache_emulation import (
    KvCacheEmulationPass,
    emulate_kv_cache,
    get_semantics,
)

from builders.exported import build_decoder
from conftest import FORMATS, GRANULARITIES, gqa_model, reference_step, run_gqa_steps

SEMANTICS = ["cuda", "cpu"]
STEPS = [6, 3, 1, 1]  # first prompt, a prompt chunk with a past, two decode steps


def quantized_model(fmt, granularity, *, heads=4, kv=2, head=16, scale=None, seed=5, **kwargs):
    """One GQA node with a ``fmt`` cache and random scales around ``scale`` (per level)."""
    model = gqa_model(num_heads=heads, kv_heads=kv, head=head, **kwargs)
    row = get_format(fmt)
    rng = np.random.default_rng(seed)
    n = 1 if granularity == "per_tensor" else kv * head
    base = scale if scale is not None else 3.0 / row.qmax
    k = (base * rng.uniform(0.5, 1.5, n)).astype(np.float32)
    v = (base * rng.uniform(0.5, 1.5, n)).astype(np.float32)
    KvCacheQuantizationPass(fmt, granularity, {0: (k, v)})(model)
    return model, k, v


def bnsh(scale, kv, head):
    return scale.reshape(1, 1, 1, 1) if scale.size == 1 else scale.reshape(1, kv, 1, head)


def stored(row, cache, scale, kv, head, quantized_io):
    """The stored codes of a cache as the session returned it (float: dequantized values)."""
    holds_values = not quantized_io and np.asarray(cache).dtype.kind == "f"
    return row.quantize(cache, bnsh(scale, kv, head)) if holds_values else cache


def assert_codes_close(row, got, want, scale, kv, head):
    """Equal codes but for rare one-step ties (RoPE rounds in another order than numpy)."""
    s4 = bnsh(scale, kv, head)
    a, b = row.dequantize(got, s4, head) / s4, row.dequantize(want, s4, head) / s4
    step = np.maximum(np.abs(b) * 2.0**-3, 2.0**-9) if row.is_float else np.ones_like(b)
    assert np.all(np.abs(a - b) <= step * 1.001)
    assert np.mean(a != b) < 0.01


@pytest.mark.parametrize("quantized_io", [False, True])
@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_emulation_matches_the_kernel_rule(fmt, granularity, semantics, quantized_io):
    """First prompt, a chunk with a past, decode: stored codes and outputs follow the rule."""
    kv, head = 2, 16
    row = get_format(fmt)
    model, k_scale, v_scale = quantized_model(fmt, granularity)
    session = create_session(emulate_kv_cache(model, semantics, quantized_io=quantized_io))
    for feeds, (out, pk, pv) in run_gqa_steps(session, model, STEPS):
        past = {
            "past_k": stored(row, feeds["past_k"], k_scale, kv, head, quantized_io),
            "past_v": stored(row, feeds["past_v"], v_scale, kv, head, quantized_io),
        }
        feeds = {**feeds, **past}
        _, want_k, want_v = reference_step(model, feeds, row, k_scale, v_scale, semantics=semantics)
        got_k = stored(row, pk, k_scale, kv, head, quantized_io)
        got_v = stored(row, pv, v_scale, kv, head, quantized_io)
        assert got_k.dtype == want_k.dtype and got_k.shape == want_k.shape
        assert_codes_close(row, got_k, want_k, k_scale, kv, head)
        assert_codes_close(row, got_v, want_v, v_scale, kv, head)
        if pk.dtype.kind == "f":  # a float cache holds exactly the dequantized codes
            np.testing.assert_array_equal(pk, row.dequantize(got_k, bnsh(k_scale, kv, head), head))
        want, _, _ = reference_step(
            model, feeds, row, k_scale, v_scale, stored=(got_k, got_v), semantics=semantics
        )
        np.testing.assert_allclose(out, want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_sinks_join_the_softmax_under_either_rule(fmt, semantics):
    """head_sink (gpt-oss): the emulated node (and the CPU kernel, which runs int8/int4 under its
    own rule natively) adds each head's sink to the softmax's denominator, as the reference does."""
    row = get_format(fmt)
    model, k_scale, v_scale = quantized_model(fmt, "per_tensor", head_sink=True)
    session = create_session(emulate_kv_cache(model, semantics))
    for feeds, (out, pk, pv) in run_gqa_steps(session, model, STEPS):
        past = {
            "past_k": stored(row, feeds["past_k"], k_scale, 2, 16, False),
            "past_v": stored(row, feeds["past_v"], v_scale, 2, 16, False),
        }
        codes = (stored(row, pk, k_scale, 2, 16, False), stored(row, pv, v_scale, 2, 16, False))
        want, _, _ = reference_step(
            model, {**feeds, **past}, row, k_scale, v_scale, stored=codes, semantics=semantics
        )
        unsunk, _, _ = reference_step(
            gqa_model(), {**feeds, **past}, row, k_scale, v_scale, stored=codes, semantics=semantics
        )
        np.testing.assert_allclose(out, want, atol=3e-5, rtol=3e-5)
        assert np.abs(out - unsunk).max() > 1e-2  # the sinks matter here


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_float_cache_io_equals_stored_cache_io(fmt, semantics):
    """The fast path (float caches holding values) computes what the stored-format path does."""
    model, k_scale, _ = quantized_model(fmt, "per_channel")
    fast = create_session(emulate_kv_cache(model, semantics))
    exact = create_session(emulate_kv_cache(model, semantics, quantized_io=True))
    row = get_format(fmt)
    pairs = zip(run_gqa_steps(fast, model, STEPS), run_gqa_steps(exact, model, STEPS))
    for (_, (out_f, pk_f, _)), (_, (out_e, pk_e, _)) in pairs:
        np.testing.assert_allclose(out_f, out_e, atol=1e-6, rtol=1e-6)
        np.testing.assert_array_equal(stored(row, pk_f, k_scale, 2, 16, False), pk_e)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_first_prompt_attends_in_full_precision_and_later_chunks_do_not(fmt):
    """On keys that saturate, the two rules differ: each phase must follow CUDA's."""
    row = get_format(fmt)
    model, k_scale, v_scale = quantized_model(fmt, "per_tensor", scale=0.5 / row.qmax)
    cuda = create_session(emulate_kv_cache(model, "cuda", quantized_io=True))
    (first, (first_out, pk, pv)), (chunk, (chunk_out, _, _)) = run_gqa_steps(cuda, model, [5, 3], scale=2.0)
    full, _, _ = reference_step(model, {**first, **_as_float(first, row)}, None)  # float K/V read
    quantized, _, _ = reference_step(model, first, row, k_scale, v_scale, semantics="cpu")
    np.testing.assert_allclose(first_out, full, atol=3e-5, rtol=3e-5)
    assert np.abs(first_out - quantized).max() > 1e-2  # the test can tell the rules apart
    want, _, _ = reference_step(model, chunk, row, k_scale, v_scale, semantics="cuda")
    np.testing.assert_allclose(chunk_out, want, atol=3e-5, rtol=3e-5)
    past = {"past_k": row.dequantize(pk, k_scale, 16), "past_v": row.dequantize(pv, v_scale, 16)}
    unquantized, _, _ = reference_step(model, {**chunk, **past}, None)  # new tokens read raw
    assert np.abs(chunk_out - unquantized).max() > 1e-2


def _as_float(feeds, row):
    """Empty past caches as float tensors (a float-cache reference reads them)."""
    return {name: np.zeros((*feeds[name].shape[:3], 16), np.float32) for name in ("past_k", "past_v")}


@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT, ir.DataType.FLOAT16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("heads", "kv"), [(4, 2), (8, 2), (4, 4)])
def test_rope_layouts_groups_and_dtypes(interleaved, dtype, heads, kv):
    model, k_scale, v_scale = quantized_model(
        "fp8", "per_channel", heads=heads, kv=kv, dtype=dtype, interleaved=interleaved
    )
    row = get_format("fp8")
    session = create_session(emulate_kv_cache(model, "cuda", quantized_io=True))
    tol = 4e-3 if dtype == ir.DataType.FLOAT16 else 3e-5
    for feeds, (out, pk, pv) in run_gqa_steps(session, model, STEPS):
        want, _, _ = reference_step(model, feeds, row, k_scale, v_scale, stored=(pk, pv), semantics="cuda")
        np.testing.assert_allclose(out.astype(np.float32), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("quantized_io", [False, True])
@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_values_past_the_range_saturate_never_nan(fmt, semantics, quantized_io):
    """Saturated codes, and outputs that follow the rule (CUDA's first prompt reads raw K/V)."""
    row = get_format(fmt)
    model, k_scale, v_scale = quantized_model(fmt, "per_tensor", scale=1e-3)
    session = create_session(emulate_kv_cache(model, semantics, quantized_io=quantized_io))
    steps = run_gqa_steps(session, model, [4, 2, 1], scale=3.0)  # |x| / scale up to ~10^4
    for feeds, (out, pk, pv) in steps:
        codes = [stored(row, c, s, 2, 16, quantized_io) for c, s in ((pk, k_scale), (pv, v_scale))]
        for cache, scale in zip(codes, (k_scale, v_scale)):
            values = row.dequantize(cache, scale, 16) / scale
            assert np.isfinite(values).all() and np.abs(values).max() == max(
                -row.qmin_stored, row.qmax_stored
            )
        assert np.isfinite(out).all()
        past = {
            "past_k": stored(row, feeds["past_k"], k_scale, 2, 16, quantized_io),
            "past_v": stored(row, feeds["past_v"], v_scale, 2, 16, quantized_io),
        }
        want, _, _ = reference_step(
            model, {**feeds, **past}, row, k_scale, v_scale, stored=tuple(codes), semantics=semantics
        )
        np.testing.assert_allclose(out, want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("fmt", [None, *FORMATS])
def test_qk_norm_inputs_are_applied_before_rope(fmt, semantics):
    """Inputs 14/15, which the CPU kernel rejects, run in every cache format and rule."""
    if fmt is None:
        model, k_scale, v_scale, row = gqa_model(qk_norm=True), None, None, None
    else:
        model, k_scale, v_scale = quantized_model(fmt, "per_tensor", qk_norm=True)
        row = get_format(fmt)
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    norms = (node.inputs[14].const_value.numpy(), node.inputs[15].const_value.numpy())
    session = create_session(emulate_kv_cache(model, semantics, quantized_io=True))
    for feeds, (out, pk, pv) in run_gqa_steps(session, model, [3, 2, 1]):
        want, want_k, _ = reference_step(
            model,
            feeds,
            row,
            k_scale,
            v_scale,
            stored=(pk, pv) if row else None,
            qk_norm=norms,
            semantics=semantics,
        )
        np.testing.assert_allclose(out, want, atol=3e-5, rtol=3e-5)
        if row is None:
            np.testing.assert_allclose(pk, want_k, atol=3e-5, rtol=3e-5)


def test_packed_qkv_equals_separate_inputs():
    packed, _, _ = quantized_model("fp8", "per_channel", packed_qkv=True)
    separate, _, _ = quantized_model("fp8", "per_channel")
    s_packed, s_sep = (create_session(emulate_kv_cache(m, quantized_io=True)) for m in (packed, separate))
    for feeds, (out, pk, pv) in run_gqa_steps(s_sep, separate, [4, 1]):
        packed_feeds = {
            "qkv.0": np.concatenate([feeds["q"], feeds["k"], feeds["v"]], axis=-1),
            "past_key_values.0.key": _fp8(feeds["past_k"]),
            "past_key_values.0.value": _fp8(feeds["past_v"]),
            "seqlens_k": np.array([feeds["past_k"].shape[2] + feeds["q"].shape[1] - 1], np.int32),
            "total_sequence_length": np.array(feeds["past_k"].shape[2] + feeds["q"].shape[1], np.int32),
        }
        got = s_packed.run(None, packed_feeds)
        np.testing.assert_array_equal(got[0], out)
        np.testing.assert_array_equal(got[1], pk)
        np.testing.assert_array_equal(got[2], pv)


def _fp8(array):
    return to_ort_value(array, ir.DataType.FLOAT8E4M3FN)


@pytest.mark.parametrize("fmt", FORMATS)
def test_io_types_and_the_input_model(fmt):
    """Stored-format I/O keeps the graph's types; float I/O declares the query dtype, unpacked."""
    model, _, _ = quantized_model(fmt, "per_tensor")
    text = ir.to_onnx_text(model)
    exact = emulate_kv_cache(model, "cuda", quantized_io=True)
    fast = emulate_kv_cache(model, "cuda")
    assert ir.to_onnx_text(model) == text
    assert [v.dtype for v in exact.graph.inputs] == [v.dtype for v in model.graph.inputs]
    assert [v.dtype for v in exact.graph.outputs] == [v.dtype for v in model.graph.outputs]
    caches = [
        v for v in (*fast.graph.inputs, *fast.graph.outputs) if "key_values" in v.name or "present" in v.name
    ]
    assert caches and all(v.dtype == ir.DataType.FLOAT and v.shape[3] == 16 for v in caches)
    for emulated in (exact, fast):
        assert not any(
            n.op_type == "GroupQueryAttention" and "k_quant_type" in n.attributes for n in emulated.graph
        )
        assert not KvCacheEmulationPass("cuda")(emulated).modified


def test_native_cpu_kernels_are_left_alone():
    model, _, _ = quantized_model("int8", "per_tensor")
    assert not KvCacheEmulationPass("cpu")(model).modified
    assert not KvCacheEmulationPass("cuda")(gqa_model()).modified
    with pytest.raises(KvCacheError, match="Unknown kernel semantics 'gpu'"):
        get_semantics("gpu")


def test_an_opset_too_old_for_fp8_casts_fails_before_any_change():
    model, _, _ = quantized_model("fp8", "per_tensor")
    model.opset_imports[""] = 18
    text = ir.to_onnx_text(model)
    with pytest.raises(KvCacheError, match="needs opset >= 19"):
        KvCacheEmulationPass("cuda")(model)
    assert ir.to_onnx_text(model) == text


def test_query_seqlens_shift_rotary_positions():
    """Right-padded chunk: rows [0, Q) are at positions seqlens_k + 1 - Q + s."""
    model, _, _ = quantized_model("fp8", "per_tensor", scale=0.01)
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    qs = ir.val("query_seqlens", ir.DataType.INT32, ["batch"])
    model.graph.inputs.append(qs)
    node.resize_inputs(17)
    node.replace_input_with(16, qs)
    emulated = create_session(emulate_kv_cache(model, "cpu", quantized_io=True))
    plain, _, _ = quantized_model("fp8", "per_tensor", scale=0.01)
    reference = create_session(emulate_kv_cache(plain, "cpu", quantized_io=True))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, n)).astype(np.float32) for n in (64, 32, 32))
    empty = _fp8(np.zeros((1, 2, 0, 16), np.uint8))
    common = {"past_key_values.0.key": empty, "past_key_values.0.value": empty}
    padded = emulated.run(
        None,
        {
            **common,
            "query.0": q,
            "key.0": k,
            "value.0": v,
            "seqlens_k": np.array([2], np.int32),
            "total_sequence_length": np.array(4, np.int32),
            "query_seqlens": np.array([3], np.int32),
        },
    )
    unpadded = reference.run(
        None,
        {
            **common,
            "query.0": q[:, :3],
            "key.0": k[:, :3],
            "value.0": v[:, :3],
            "seqlens_k": np.array([2], np.int32),
            "total_sequence_length": np.array(3, np.int32),
        },
    )
    np.testing.assert_allclose(padded[0][:, :3], unpadded[0], atol=1e-6)
    np.testing.assert_array_equal(padded[1][:, :, :3], unpadded[1])


@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_matches_the_float_kernel(interleaved):
    """The numpy reference used above agrees with onnxruntime's float-cache GQA."""
    model = gqa_model(interleaved=interleaved)
    for feeds, (out, pk, _) in run_gqa_steps(create_session(model), model, [5, 1, 1]):
        want, want_k, _ = reference_step(model, feeds, None)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(pk, want_k, atol=2e-5, rtol=2e-5)


def test_cpu_kernel_rejects_qk_norm_which_emulation_runs():
    """Why the capability table says cpu has no q/k norm, and why emulation helps."""
    model = gqa_model(qk_norm=True)
    with pytest.raises(Exception, match="q_norm_weight / k_norm_weight inputs are not supported"):
        next(run_gqa_steps(create_session(model), model, [2]))


def test_runner_emulates_fp8_on_cpu_with_the_cuda_rule_and_says_so(caplog):
    model = build_decoder(num_layers=2, vocab_size=300)
    KvCacheQuantizationPass("fp8", scales={0: (0.02, 0.01), 1: (0.02, 0.01)})(model)
    with caplog.at_level(logging.INFO, logger="onnx_kvcache"):
        runner = KvCacheRunner(model)
    assert runner.emulated and runner.semantics == "cuda"
    assert runner.kernel_rule == "cuda (emulated on CPU)"
    assert any("cuda kernel's rule" in r.getMessage() for r in caplog.records)
    logits = runner.prefill([1, 2, 3])
    assert np.isfinite(logits).all() and runner.present(0, "key").dtype == np.uint8
    exact = KvCacheRunner(model, quantized_io=True)
    np.testing.assert_allclose(exact.prefill([1, 2, 3]), logits, atol=1e-5)
    np.testing.assert_array_equal(exact.present(0, "key"), runner.present(0, "key"))
    values = runner.present(1, "value").view(ml_dtypes.float8_e4m3fn).astype(np.float32) * 0.01
    np.testing.assert_allclose(runner.cache_values(1, "value"), values, rtol=1e-6)


FAST_PATH_TOLERANCE = 1e-6
"""Fast path vs exact emulation, absolute on logits (|logits| ~ 10-20; measured: bit-equal)."""

# cuda: every format is emulated; cpu: the CPU kernel would run int8/int4 itself, so those
# decoders have q/k norm fused (inputs 14/15, which only the emulation runs).
FAST_PATH_CASES = [
    (fmt, granularity, semantics, dtype)
    for semantics, dtype in (("cuda", "float32"), ("cuda", "float16"), ("cpu", "float32"))
    for fmt in FORMATS
    for granularity in GRANULARITIES
    if dtype == "float32" or granularity == "per_channel"
]


@pytest.mark.parametrize(("fmt", "granularity", "semantics", "dtype"), FAST_PATH_CASES)
def test_fast_path_logits_equal_the_exact_emulation_at_every_step(fmt, granularity, semantics, dtype):
    """A whole decoder: first prompt, a prompt chunk with a past, decode steps. The fast path
    (float caches holding dequantized values, only new tokens quantized) gives the exact
    emulation's logits (whole cache converted every step) to FAST_PATH_TOLERANCE, and the same
    stored codes."""
    layers = 2
    model = build_decoder(num_layers=layers, vocab_size=300, dtype=dtype, qk_norm=semantics == "cpu")
    n = 1 if granularity == "per_tensor" else 64
    big = 16.0 if fmt == "int4" else 1.0  # int4's 16 levels need a wider step
    scales = {i: (np.full(n, 0.05 * big), np.full(n, 0.02 * big)) for i in range(layers)}
    unquantized = build_decoder(num_layers=layers, vocab_size=300, dtype=dtype, qk_norm=semantics == "cpu")
    KvCacheQuantizationPass(fmt, granularity, scales)(model)
    with warnings.catch_warnings():  # fp8 under the CPU rule: no kernel does that, it warns
        warnings.simplefilter("ignore", KvCacheWarning)
        fast = KvCacheRunner(model, semantics=semantics)
        exact = KvCacheRunner(model, semantics=semantics, quantized_io=True)
    float_cache = KvCacheRunner(unquantized)
    assert fast.emulated and exact.emulated
    assert all(b.holds_values for b in fast.bindings) and not any(b.holds_values for b in exact.bindings)
    ids = (np.arange(16) * 37 + 11) % 300
    calls = [("prefill", ids[:7]), ("forward", ids[7:11])] + [("step", int(t)) for t in ids[11:]]
    for i, (call, arg) in enumerate(calls):
        got, want, plain = (getattr(r, call)(arg) for r in (fast, exact, float_cache))
        np.testing.assert_allclose(got, want, rtol=0, atol=FAST_PATH_TOLERANCE, err_msg=f"call {i}: {call}")
        assert i == 0 or np.abs(got - plain).max() > 1e-3  # later calls read the quantized cache
        for layer in range(layers):
            for kind in ("key", "value"):
                np.testing.assert_array_equal(fast.present(layer, kind), exact.present(layer, kind))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_runner_takes_the_cpu_kernel_or_cudas_rule_for_integer_caches(fmt):
    model = build_decoder(num_layers=2, vocab_size=300)
    KvCacheQuantizationPass(fmt, scales={0: (0.05, 0.02), 1: (0.05, 0.02)})(model)
    native, cuda = KvCacheRunner(model), KvCacheRunner(model, semantics="cuda")
    assert not native.emulated and native.kernel_rule == "cpu (onnxruntime CPU kernel)"
    assert cuda.emulated and cuda.kernel_rule == "cuda (emulated on CPU)"
    ids = [5, 6, 7, 8, 9]
    a, b = native.prefill(ids), cuda.prefill(ids)
    assert not np.allclose(a, b, atol=1e-4)  # CUDA's first prompt reads unquantized K/V
    # Layer 0 stores the same codes; later layers see the attention outputs that differ.
    np.testing.assert_array_equal(native.present(0, "key"), cuda.present(0, "key"))
    native.step(3), cuda.step(3)
    np.testing.assert_array_equal(native.present(0, "value"), cuda.present(0, "value"))
    cpu = KvCacheRunner(model, semantics="cpu")
    assert not cpu.emulated


def test_a_qwen3_style_decoder_runs_through_emulation():
    """16-input GQA (q/k norm): no CPU kernel at all, yet float and fp8 models run."""
    model = build_decoder(num_layers=2, vocab_size=300, qk_norm=True)
    assert len(next(n for n in model.graph if n.op_type == "GroupQueryAttention").inputs) == 16
    assert len(KvCacheRunner(model).generate([1, 2, 3], 4)) == 4
    KvCacheQuantizationPass("fp8", scales={0: (0.05, 0.02), 1: (0.05, 0.02)})(model)
    assert len(KvCacheRunner(model).generate([1, 2, 3], 4)) == 4


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_a_right_padded_batch_on_the_first_prompt_rotates_from_position_zero(semantics):
    """The kernel's first prompt uses positions 0..S-1 for every row, whatever seqlens_k says."""
    model, _, _ = quantized_model("fp8", "per_tensor", scale=0.01)
    session = create_session(emulate_kv_cache(model, semantics, quantized_io=True))
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 5, n)).astype(np.float32) for n in (64, 32, 32))
    empty = _fp8(np.zeros((2, 2, 0, 16), np.uint8))
    feeds = {"query.0": q, "key.0": k, "value.0": v, "past_key_values.0.key": empty}
    feeds |= {"past_key_values.0.value": empty, "total_sequence_length": np.array(5, np.int32)}
    batched = session.run(None, {**feeds, "seqlens_k": np.array([4, 2], np.int32)})  # row 1: 3 tokens
    single = session.run(
        None,
        {
            **{name: x[1:, :3] for name, x in (("query.0", q), ("key.0", k), ("value.0", v))},
            "past_key_values.0.key": _fp8(np.zeros((1, 2, 0, 16), np.uint8)),
            "past_key_values.0.value": _fp8(np.zeros((1, 2, 0, 16), np.uint8)),
            "seqlens_k": np.array([2], np.int32),
            "total_sequence_length": np.array(3, np.int32),
        },
    )
    np.testing.assert_allclose(batched[0][1:, :3], single[0], atol=1e-5)
    np.testing.assert_array_equal(batched[1][1:, :, :3], single[1])


def test_qk_norm_emulation_needs_opset_18_and_the_runner_says_so():
    model = build_decoder(num_layers=1, vocab_size=300, qk_norm=True)
    model.opset_imports[""] = 17
    with pytest.raises(KvCacheError, match=r"needs opset >= 18 \(ReduceMean with axes as an input"):
        KvCacheRunner(model)


@pytest.mark.parametrize(
    ("opset", "runs"), [(18, True), (17, False)], ids=["opset18_raised", "opset17_refused"]
)
def test_an_opset_18_export_with_an_fp8_cache_runs_emulated(opset, runs):
    """TorchScript exports are opset 18: the copy the runner emulates imports 19 (exact), the
    model keeps its own; below 18 the raise would change operators, so it is refused. (The
    model is relabelled after fusing: an opset-18 export relabelled 17 reads ReduceMean's axes
    as an input, which opset 17 does not define, and the fusion refuses it as malformed.)"""
    from onnx_kvcache import optimize_model

    from builders.exported import exported_config

    model = build_decoder(exported_config("optimum-llama", num_layers=2, vocab_size=300))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        optimize_model(
            model,
            ep=None,
            fp8_kv_cache=True,
            scales={0: (0.05, 0.05), 1: (0.05, 0.05)},
        )
    assert model.graph.inputs[3].dtype == ir.DataType.FLOAT8E4M3FN
    model.opset_imports[""] = opset
    if not runs:
        with pytest.raises(KvCacheError, match="needs opset >= 19"):
            KvCacheRunner(model, semantics="cuda")
        return
    emulated = emulate_kv_cache(model, "cuda")
    assert emulated.opset_imports[""] == 19 and model.opset_imports[""] == 18
    logits = KvCacheRunner(model, semantics="cuda").prefill([1, 2, 3, 4])
    assert np.isfinite(logits).all() and logits.shape[-1] == 300


def _seqlens_keepdims(model: ir.Model) -> ir.Model:
    """``model`` with seqlens_k computed as mobius's gemma2/gemma3 builds do: ``[batch, 1]``."""
    nodes = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    seqlens = nodes[0].inputs[5]
    unsqueeze = ir.node(
        "Unsqueeze",
        [seqlens, ir.Value(name="axes_1", const_value=ir.tensor(np.array([1], np.int64), name="axes_1"))],
        name="seqlens_keepdims",
    )
    axes = unsqueeze.inputs[1]
    axes.dtype, axes.shape = ir.DataType.INT64, ir.Shape([1])
    model.graph.register_initializer(axes)
    model.graph.insert_after(seqlens.producer(), unsqueeze)
    kept = unsqueeze.outputs[0]
    kept.name, kept.dtype, kept.shape = "seqlens_k_2d", ir.DataType.INT32, ir.Shape(["batch", 1])
    for node in nodes:
        node.replace_input_with(5, kept)
    return model


@pytest.mark.filterwarnings("ignore::onnx_kvcache.errors.MeasurementWarning")  # fp8 under the cpu rule
@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_seqlens_k_of_shape_batch_by_1_is_emulated_as_the_kernels_read_it(fmt, semantics):
    """mobius's gemma2/gemma3 GQA builds feed seqlens_k ``[batch, 1]`` (ReduceSum keepdims), which
    onnxruntime's kernels accept: the emulation reads it as ``[batch]``, the same logits."""
    scales = {0: (0.02, 0.01), 1: (0.02, 0.01)}
    flat, kept = (build_decoder(num_layers=2, vocab_size=300) for _ in range(2))
    _seqlens_keepdims(kept)
    gqa = next(n for n in kept.graph if n.op_type == "GroupQueryAttention")
    assert gqa.inputs[5].shape == ir.Shape(["batch", 1])
    native = KvCacheRunner(kept.clone())  # the float kernel takes [batch, 1]
    assert np.isfinite(native.prefill([1, 2, 3])).all()
    for model in (flat, kept):
        KvCacheQuantizationPass(fmt, scales=scales)(model)
    want, got = (KvCacheRunner(m, semantics=semantics) for m in (flat, kept))
    assert got.emulated == (semantics == "cuda" or fmt == "fp8")  # else the CPU kernel runs it
    np.testing.assert_array_equal(got.prefill([5, 6, 7, 8]), want.prefill([5, 6, 7, 8]))
    for token in (9, 10):
        np.testing.assert_array_equal(got.step(token), want.step(token))
