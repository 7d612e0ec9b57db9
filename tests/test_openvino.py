"""OpenVINO, a second runtime for the same files: converted int8/int4 models run there alike."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import qdq_models
from onnx_kvcache import KvCacheQuantizationPass, KvCacheRunner
from onnx_kvcache.cache.storage import find_qdq_caches
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.passes import QdqKvCachePass, StoredCacheRotationPass

ov = pytest.importorskip("openvino", reason="install the test extra (CI does)")

LAYERS = 2


def run_openvino(path, prompt, steps):
    """Prefill ``prompt`` then feed ``steps`` one at a time; yields (logits, caches) per call."""
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    caches = {
        i.get_any_name(): np.zeros(_empty_shape(i), i.get_element_type().to_dtype())
        for i in compiled.inputs
        if i.get_any_name().startswith("past_key_values.")
    }
    length = 0
    for ids in [prompt, *([t] for t in steps)]:
        ids = np.asarray([ids], np.int64)
        length += ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, length), np.int64), **caches}
        request.infer(feeds)
        outputs = {o.get_any_name(): request.get_tensor(o).data.copy() for o in compiled.outputs}
        caches = {name: outputs[name.replace("past_key_values", "present")] for name in caches}
        yield outputs["logits"], outputs


def _empty_shape(port):
    """``[1, kv_heads, 0, last]`` from a cache input's declared shape."""
    shape = port.get_partial_shape()
    return [1, shape[1].get_length(), 0, shape[3].get_length()]


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_openvino_stores_onnxruntimes_codes_and_computes_its_logits(tmp_path, fmt, granularity):
    model = build_decoder(num_layers=LAYERS, vocab_size=300)
    rng = np.random.default_rng(0)
    n = 1 if granularity == "per_tensor" else 64
    scales = {i: (rng.uniform(0.03, 0.06, n), rng.uniform(0.01, 0.03, n)) for i in range(LAYERS)}
    KvCacheQuantizationPass(fmt, granularity, scales)(model)
    ir.save(model, tmp_path / "model.onnx")
    prompt, steps = [5, 9, 13, 2, 77, 31], [8, 150, 3]
    runner = KvCacheRunner(tmp_path / "model.onnx")
    want = [runner.prefill(prompt)[0, -1]] + [runner.step(t)[0] for t in steps]
    got = list(run_openvino(tmp_path / "model.onnx", prompt, steps))
    for i, (logits, _) in enumerate(got):
        np.testing.assert_allclose(logits[0, -1], want[i], atol=1e-4, rtol=1e-4)
    _, last = got[-1]
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            np.testing.assert_array_equal(last[f"present.{layer}.{kind}"], runner.present(layer, kind))


def _run_stored(model, path):
    """OpenVINO's logits over qdq_models' prompt and steps for a model whose caches are stored
    through QuantizeLinear/DequantizeLinear (growing caches), and its last caches."""
    onnx.save(ir.to_proto(model), path)
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    caches = {c.past.name: c.present.name for c in find_qdq_caches(model.graph)}
    feeds = {
        i.get_any_name(): np.zeros(_empty_shape(i), i.get_element_type().to_dtype())
        for i in compiled.inputs
        if i.get_any_name() in caches
    }
    logits, past = [], 0
    for ids in [qdq_models.PROMPT, *([t] for t in qdq_models.DECODE)]:
        request.infer({**feeds, **qdq_models.positions(ids, past, static=False)})
        outputs = {o.get_any_name(): request.get_tensor(o).data.copy() for o in compiled.outputs}
        logits.append(outputs["logits"][0])
        feeds = {name: outputs[present] for name, present in caches.items()}
        past += len(ids)
    return logits, feeds


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_openvino_runs_an_int8_mla_cache_stored_through_qdq(tmp_path, granularity):
    """DeepSeek-V3's MLA export with int8 caches (storage="qdq"): OpenVINO's codes within one step
    of onnxruntime's (per channel: identical), its logits within 1e-3 of their largest."""
    model = qdq_models.load(qdq_models.MLA[0])
    scales = qdq_models.calibrate(model, "int8", granularity, 128.0)
    QdqKvCachePass("int8", granularity, scales)(model)
    want, seen = qdq_models.run(model, capture=True)
    got, last = _run_stored(model, tmp_path / "model.onnx")
    for name, codes in last.items():
        steps = np.abs(codes.astype(np.int32) - seen[name][-1].astype(np.int32))
        assert steps.max() <= (0 if granularity == "per_channel" else 1) and steps.mean() < 0.02
    for logits, ref in zip(got, want, strict=True):
        np.testing.assert_allclose(logits, ref, atol=1e-3 * np.abs(ref).max())


@pytest.mark.parametrize("rotation", ["keys", "keys_and_values"])
def test_openvino_runs_a_rotated_int8_cache_stored_through_qdq(tmp_path, rotation):
    """ONNX Attention holding its cache (mobius's default build), rotated then stored as int8
    per channel: OpenVINO's logits within 1e-3 of onnxruntime's largest."""
    model = qdq_models.load(qdq_models.OWN_CACHE[0])
    StoredCacheRotationPass(rotation)(model)
    scales = qdq_models.calibrate(model, "int8", "per_channel", 128.0, rotation)
    QdqKvCachePass("int8", "per_channel", scales)(model)
    want, _ = qdq_models.run(model)
    got, _ = _run_stored(model, tmp_path / "model.onnx")
    for logits, ref in zip(got, want, strict=True):
        np.testing.assert_allclose(logits, ref, atol=1e-3 * np.abs(ref).max())
