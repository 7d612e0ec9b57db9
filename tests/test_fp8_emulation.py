"""FP8 KV cache emulated on CPU: the GPU kernel's rule, checked against numpy."""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheQuantizationPass, KvCacheRunner, build_decoder
from onnx_kvcache.formats import get_format
from onnx_kvcache.passes.fp8_emulation import Fp8KvCacheEmulationPass, emulate_fp8_kv_cache
from onnx_kvcache.runtime import create_session

from conftest import gqa_model, reference_step, run_gqa_steps

FP8 = get_format("fp8")


def fp8_model(granularity, *, heads=4, kv=2, head=16, dtype=ir.DataType.FLOAT, scale=0.01, **kwargs):
    model = gqa_model(num_heads=heads, kv_heads=kv, head=head, dtype=dtype, **kwargs)
    rng = np.random.default_rng(5)
    n = 1 if granularity == "per_tensor" else kv * head
    k = (scale * rng.uniform(0.5, 1.5, n)).astype(np.float32)
    v = (scale * rng.uniform(0.5, 1.5, n)).astype(np.float32)
    KvCacheQuantizationPass("fp8", granularity, {0: (k, v)})(model)
    return model, k, v


def codes_close(got, want, scale, kv, head):
    """Stored fp8 codes: equal but for rare one-ulp rounding ties."""
    s4 = scale.reshape(-1, 1) if scale.size == 1 else scale.reshape(1, kv, 1, head)
    a = FP8.dequantize(got, s4, head) / s4
    b = FP8.dequantize(want, s4, head) / s4
    ulp = np.maximum(np.abs(b) * 2.0**-3, 2.0**-9)  # e4m3: 3 mantissa bits, subnormal step 2^-9
    assert np.all(np.abs(a - b) <= ulp * 1.001)
    return float(np.mean(a != b))


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT, ir.DataType.FLOAT16])
@pytest.mark.parametrize(("heads", "kv"), [(4, 2), (8, 2), (4, 4)])
def test_emulation_matches_the_kernel_rule(granularity, interleaved, dtype, heads, kv):
    head = 16
    model, k_scale, v_scale = fp8_model(
        granularity, heads=heads, kv=kv, head=head, dtype=dtype, interleaved=interleaved
    )
    emulated = emulate_fp8_kv_cache(model)
    session = create_session(emulated)
    tol = 4e-3 if dtype == ir.DataType.FLOAT16 else 3e-5
    for feeds, (out, pk, pv) in run_gqa_steps(session, model, [6, 1, 1, 1]):
        _, want_k, want_v = reference_step(model, feeds, FP8, k_scale, v_scale)
        assert pk.dtype == np.uint8 and pk.shape == want_k.shape
        flips = codes_close(pk, want_k, k_scale, kv, head) + codes_close(pv, want_v, v_scale, kv, head)
        assert flips < (0.02 if dtype == ir.DataType.FLOAT16 else 0.002)
        want, _, _ = reference_step(model, feeds, FP8, k_scale, v_scale, stored=(pk, pv))
        np.testing.assert_allclose(out.astype(np.float32), want, atol=tol, rtol=tol)


def test_current_tokens_are_read_dequantized():
    """A float-precision read of the new tokens would differ from the emulation's output."""
    model, _, _ = fp8_model("per_tensor", scale=0.05)
    session = create_session(emulate_fp8_kv_cache(model))
    feeds, (out, _, _) = next(run_gqa_steps(session, model, [5]))
    float_read, _, _ = reference_step(
        model,
        {**feeds, "past_k": feeds["past_k"].astype(np.float32), "past_v": feeds["past_v"].astype(np.float32)},
        None,
    )
    assert np.abs(out - float_read).max() > 1e-3


def test_values_past_448_saturate_never_nan():
    model, _, _ = fp8_model("per_tensor", scale=1e-3)
    session = create_session(emulate_fp8_kv_cache(model))
    for _, (out, pk, pv) in run_gqa_steps(session, model, [4, 1], scale=3.0):  # |x| / scale up to ~10^4
        values = pk.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        assert np.isfinite(values).all() and np.abs(values).max() == 448.0
        assert np.isfinite(pv.view(ml_dtypes.float8_e4m3fn).astype(np.float32)).all()
        assert np.isfinite(out).all()


def test_qk_norm_inputs_are_applied_before_rope():
    model, k_scale, v_scale = fp8_model("per_tensor", qk_norm=True)
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    norms = (node.inputs[14].const_value.numpy(), node.inputs[15].const_value.numpy())
    session = create_session(emulate_fp8_kv_cache(model))
    for feeds, (out, pk, pv) in run_gqa_steps(session, model, [3, 1]):
        want, _, _ = reference_step(model, feeds, FP8, k_scale, v_scale, stored=(pk, pv), qk_norm=norms)
        np.testing.assert_allclose(out, want, atol=3e-5, rtol=3e-5)


def test_packed_qkv_equals_separate_inputs():
    packed, _, _ = fp8_model("per_channel", packed_qkv=True)
    separate, _, _ = fp8_model("per_channel")
    s_packed, s_sep = (
        create_session(emulate_fp8_kv_cache(packed)),
        create_session(emulate_fp8_kv_cache(separate)),
    )
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
    from onnx_kvcache.runtime import to_ort_value

    return to_ort_value(array, ir.DataType.FLOAT8E4M3FN)


def test_io_types_are_kept_and_the_input_is_not_modified():
    model, _, _ = fp8_model("per_tensor")
    text = ir.to_onnx_text(model)
    emulated = emulate_fp8_kv_cache(model)
    assert ir.to_onnx_text(model) == text
    assert [v.dtype for v in emulated.graph.inputs] == [v.dtype for v in model.graph.inputs]
    assert [v.dtype for v in emulated.graph.outputs] == [v.dtype for v in model.graph.outputs]
    assert not any(
        n.op_type == "GroupQueryAttention" and "k_quant_type" in n.attributes for n in emulated.graph
    )
    assert not Fp8KvCacheEmulationPass()(emulated).modified


def test_runner_emulates_fp8_on_cpu_and_says_so(caplog):
    model = build_decoder(num_layers=2, vocab_size=300)
    KvCacheQuantizationPass("fp8", scales={0: (0.02, 0.01), 1: (0.02, 0.01)})(model)
    with caplog.at_level(logging.INFO, logger="onnx_kvcache"):
        runner = KvCacheRunner(model)
    assert runner.emulated and any("emulation" in r.getMessage() for r in caplog.records)
    logits = runner.prefill([1, 2, 3])
    assert np.isfinite(logits).all() and runner.present(0, "key").dtype == np.uint8


@pytest.mark.parametrize("qk_norm", [False])  # the CPU kernel rejects q/k norm (see below)
@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_matches_the_float_kernel(qk_norm, interleaved):
    """The numpy reference used above agrees with onnxruntime's float-cache GQA."""
    model = gqa_model(qk_norm=qk_norm, interleaved=interleaved)
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    norms = (node.inputs[14].const_value.numpy(), node.inputs[15].const_value.numpy()) if qk_norm else None
    for feeds, (out, pk, _) in run_gqa_steps(create_session(model), model, [5, 1, 1]):
        want, want_k, _ = reference_step(model, feeds, None, qk_norm=norms)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(pk, want_k, atol=2e-5, rtol=2e-5)


def test_cpu_kernel_rejects_qk_norm_which_emulation_runs():
    """Why the capability table says cpu has no q/k norm, and why emulation helps."""
    model = gqa_model(qk_norm=True)
    session = create_session(model)
    with pytest.raises(Exception, match="q_norm_weight / k_norm_weight inputs are not supported"):
        next(run_gqa_steps(session, model, [2]))


def test_query_seqlens_shift_rotary_positions():
    """Right-padded chunk: rows [0, Q) are at positions seqlens_k + 1 - Q + s."""
    model, _, _ = fp8_model("per_tensor")
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    qs = ir.val("query_seqlens", ir.DataType.INT32, ["batch"])
    model.graph.inputs.append(qs)
    node.resize_inputs(17)
    node.replace_input_with(16, qs)
    emulated = create_session(emulate_fp8_kv_cache(model))
    plain, _, _ = fp8_model("per_tensor")
    reference = create_session(emulate_fp8_kv_cache(plain))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, n)).astype(np.float32) for n in (64, 32, 32))
    empty = _fp8(np.zeros((1, 2, 0, 16), np.uint8))
    padded = emulated.run(
        None,
        {
            "query.0": q,
            "key.0": k,
            "value.0": v,
            "past_key_values.0.key": empty,
            "past_key_values.0.value": empty,
            "seqlens_k": np.array([2], np.int32),
            "total_sequence_length": np.array(4, np.int32),
            "query_seqlens": np.array([3], np.int32),
        },
    )
    unpadded = reference.run(
        None,
        {
            "query.0": q[:, :3],
            "key.0": k[:, :3],
            "value.0": v[:, :3],
            "past_key_values.0.key": empty,
            "past_key_values.0.value": empty,
            "seqlens_k": np.array([2], np.int32),
            "total_sequence_length": np.array(3, np.int32),
        },
    )
    np.testing.assert_allclose(padded[0][:, :3], unpadded[0], atol=1e-6)
    np.testing.assert_array_equal(padded[1][:, :, :3], unpadded[1])


def test_a_qwen3_style_decoder_runs_fp8_through_emulation():
    """16-input GQA (q/k norm): no CPU kernel at all, yet the emulated fp8 model runs."""
    model = build_decoder(num_layers=2, vocab_size=300, qk_norm=True)
    assert len(next(n for n in model.graph if n.op_type == "GroupQueryAttention").inputs) == 16
    KvCacheQuantizationPass("fp8", scales={0: (0.05, 0.02), 1: (0.05, 0.02)})(model)
    tokens = KvCacheRunner(model).generate([1, 2, 3], 4)
    assert len(tokens) == 4
