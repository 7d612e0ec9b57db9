"""Bfloat16ToFloatPass: a bf16 decoder computed in float32 loads on the CPU, and running the
pass again (the emulation and the runner each apply it) changes nothing."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import Bfloat16ToFloatPass, KvCacheQuantizationPass
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.models.decoder import build_decoder


def _bf16_decoder(fmt):
    model = build_decoder(
        num_layers=1, hidden_size=64, num_heads=4, kv_num_heads=2, head_size=16, dtype="bfloat16"
    )
    if fmt is not None:
        scales = {0: (np.full(1, 0.05), np.full(1, 0.05))}
        KvCacheQuantizationPass(fmt, "per_tensor", scales)(model)
    return model


@pytest.mark.parametrize("fmt", [None, "int8"])
@pytest.mark.parametrize("runs", [1, 2, 3])
def test_the_pass_is_idempotent(fmt, runs):
    model = _bf16_decoder(fmt)
    results = [Bfloat16ToFloatPass()(model) for _ in range(runs)]
    assert results[0].modified and not any(r.modified for r in results[1:])
    names = collections.Counter(n.name for n in model.graph)
    assert [name for name, n in names.items() if n > 1] == []
    bf16 = [v for v in model.graph.initializers.values() if v.dtype == ir.DataType.BFLOAT16]
    assert bf16 and all(len(list(v.uses())) == 1 for v in bf16)  # one Cast each, however many runs
    assert all(v.dtype != ir.DataType.BFLOAT16 for v in [*model.graph.inputs, *model.graph.outputs])
    create_session(model, ["CPUExecutionProvider"])  # the CPU provider loads it
