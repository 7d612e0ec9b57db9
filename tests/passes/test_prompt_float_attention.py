"""The draft PromptFloatAttentionPass (issue 43) on onnxruntime's CPU kernel: a multi-token
call attends through the float kernel and stores the cache by the quantized kernel's rule; a
one-token call is the quantized node's, byte for byte."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.passes import PromptFloatAttentionPass

from conftest import CPU_FORMATS, GRANULARITIES, quantized_decoder

_TYPES = {"tensor(float)": np.float32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8}


def _decoder() -> ir.Model:
    return build_decoder(num_layers=2, vocab_size=300)


_quantized = quantized_decoder


def _run(sess, ids: np.ndarray, past: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    if past is None:
        past = {
            i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), _TYPES[i.type])
            for i in sess.get_inputs()
            if i.name.startswith("past_key_values")
        }
    total = ids.shape[1] + next(iter(past.values())).shape[2]
    names = [o.name for o in sess.get_outputs()]
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64), **past}
    return dict(zip(names, sess.run(names, feeds), strict=True))


def _past(out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k.replace("present.", "past_key_values."): v for k, v in out.items() if k.startswith("present.")}


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", CPU_FORMATS)
def test_prompt_attends_in_float_and_decode_is_unchanged(fmt, granularity):
    quantized = _quantized(fmt, granularity)
    rewritten = _quantized(fmt, granularity)
    result = PromptFloatAttentionPass()(rewritten)
    assert result.modified
    assert [n.op_type for n in rewritten.graph if n.op_type in ("If", "GroupQueryAttention")] == ["If", "If"]
    fl, qu, rw = (create_session(m) for m in (_decoder(), quantized, rewritten))
    ids = np.random.default_rng(0).integers(0, 300, (1, 29), dtype=np.int64)
    prompt, chunk, step = ids[:, :20], ids[:, 20:28], ids[:, 28:]

    f0, q0, r0 = _run(fl, prompt), _run(qu, prompt), _run(rw, prompt)
    # the prompt attends as the float model does
    np.testing.assert_allclose(r0["logits"], f0["logits"], rtol=0, atol=1e-5)
    # layer 0's K/V do not depend on attention: stored by the kernel's own rule
    for name in ("present.0.key", "present.0.value"):
        np.testing.assert_array_equal(r0[name], q0[name])

    past = _past(q0)
    r1 = _run(rw, chunk, past)
    for name, value in past.items():  # quantize(dequantize(q)) == q
        np.testing.assert_array_equal(r1[name.replace("past_key_values.", "present.")][:, :, :20], value)

    q2, r2 = _run(qu, step, past), _run(rw, step, past)
    for name in q2:
        np.testing.assert_array_equal(r2[name], q2[name])


def test_leaves_a_float_model_alone():
    model = _decoder()
    assert not PromptFloatAttentionPass()(model).modified
