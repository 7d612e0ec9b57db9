"""The decoder, token data and direct prefill the calibration tests share."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.models.decoder import build_decoder

LAYERS, KV, HEAD = 2, 2, 32


@pytest.fixture(scope="module")
def model():
    return build_decoder(num_layers=LAYERS, vocab_size=300)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    return [list(rng.integers(0, 300, n)) for n in (300, 125, 200)]


def presents(model, data):
    """Prefill each sequence with onnxruntime directly: {(layer, kind): [kv, S, hd] arrays}."""
    session = create_session(model)
    out: dict = {}
    for seq in data:
        ids = np.asarray(seq, np.int64)[None]
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for i in range(LAYERS):
            for kind in ("key", "value"):
                feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, KV, 0, HEAD), np.float32)
        names = [f"present.{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")]
        for name, value in zip(names, session.run(names, feeds)):
            _, layer, kind = name.split(".")
            out.setdefault((int(layer), kind), []).append(value[0])
    return out
