"""The runner on caches the graph's I/O names: mobius's static buffers and an MLA export's own.

Each producer file runs through :class:`KvCacheRunner` in its own convention (fixed buffers,
``write_indices`` and ``nonpad_kv_seqlen``; or growing pasts and ``attention_mask``), and its
logits equal a loop that feeds onnxruntime by hand.
"""

from __future__ import annotations

import pathlib

import numpy as np
import onnxruntime as ort
import pytest

from onnx_kvcache import KvCacheError, KvCacheRunner
from onnx_kvcache.runtime.evaluation import evaluate_kv_cache

PRODUCERS = pathlib.Path(__file__).parents[1] / "data" / "producers"
STATIC = [PRODUCERS / "mobius" / "mobius-static" / f for f in ("llama", "mistral", "phi3", "qwen2", "qwen3")]
MLA = PRODUCERS / "torch-tf5" / "dynamo-opset23-optimize" / "deepseek_v3"
PROMPT = [1, 72, 101, 108, 108, 111, 33]
DECODE = [32, 72, 105]


def _static_feeds(session: ort.InferenceSession, ids: list[int], past: int) -> dict[str, np.ndarray]:
    total = past + len(ids)
    return {
        "input_ids": np.array([ids], np.int64),
        "position_ids": np.arange(past, total, dtype=np.int64)[None],
        "write_indices": np.array([past], np.int64),
        "nonpad_kv_seqlen": np.array([total], np.int64),
    }


def _exported_feeds(session: ort.InferenceSession, ids: list[int], past: int) -> dict[str, np.ndarray]:
    total = past + len(ids)
    return {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, total), np.int64),
        "position_ids": np.arange(past, total, dtype=np.int64)[None],
    }


def hand_fed(folder: pathlib.Path, static: bool, dtype: type = np.float32) -> list[np.ndarray]:
    """The prompt's logits, then each decode step's, from onnxruntime fed by hand (caches of
    ``dtype``, empty or zero-filled)."""
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    caches = [i for i in session.get_inputs() if "cache" in i.name or "past" in i.name]
    outputs = [o.name for o in session.get_outputs()]
    present = {
        c.name: ("updated_" + c.name if static else c.name.replace("past_key_values", "present"))
        for c in caches
    }
    state = {
        c.name: np.zeros([1, *c.shape[1:]] if static else [1, c.shape[1], 0, c.shape[3]], dtype)
        for c in caches
    }
    found, past = [], 0
    for ids in [PROMPT, *([t] for t in DECODE)]:
        feeds = (_static_feeds if static else _exported_feeds)(session, ids, past) | state
        results = dict(zip(outputs, session.run(outputs, feeds)))
        state = {name: results[present[name]] for name in state}
        found.append(results["logits"][0, -1])
        past += len(ids)
    return found


def by_runner(folder: pathlib.Path, **options) -> list[np.ndarray]:
    runner = KvCacheRunner(folder / "model.onnx", **options)
    found = [runner.prefill(PROMPT)[0, -1]]
    found += [runner.step(token)[0] for token in DECODE]
    return found


@pytest.mark.parametrize("folder", STATIC, ids=lambda p: p.name)
@pytest.mark.parametrize("io_binding", [False, True])
def test_static_buffers_run_in_their_convention(folder, io_binding):
    """write_indices at each row's past, nonpad_kv_seqlen its length after the call; bound
    buffers are written in place, and give the same logits."""
    expected = hand_fed(folder, static=True)
    found = by_runner(folder, io_binding=io_binding)
    np.testing.assert_allclose(np.stack(found), np.stack(expected), atol=1e-5, rtol=0)


def test_an_mla_export_runs_as_exported():
    """Keys of head size 32 and values of 16: no GroupQueryAttention computes it, so the
    runner feeds the export's own caches."""
    runner = KvCacheRunner(MLA / "model.onnx")
    assert {(b.kind, b.head_size) for b in runner.bindings} == {("key", 32), ("value", 16)}
    np.testing.assert_allclose(
        np.stack(by_runner(MLA)), np.stack(hand_fed(MLA, static=False)), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("folder", [STATIC[0], MLA], ids=["static", "mla"])
def test_cache_values_are_the_written_rows(folder):
    runner = KvCacheRunner(folder / "model.onnx")
    runner.prefill(PROMPT)
    runner.step(DECODE[0])
    key, value = runner.cache_values(0, "key"), runner.cache_values(0, "value")
    assert key.shape[2] == value.shape[2] == len(PROMPT) + 1
    assert np.abs(key[:, :, -1]).max() > 0  # the step's own row is there


def test_static_buffers_bound_the_context():
    runner = KvCacheRunner(STATIC[0] / "model.onnx")
    assert runner.max_positions == 64  # the buffers' rows
    runner.prefill(list(range(1, 61)))
    with pytest.raises(KvCacheError):
        runner.forward([[1, 2, 3, 4, 5]])


@pytest.mark.parametrize("folder", [STATIC[0], MLA], ids=["static", "mla"])
def test_evaluate_of_a_float_model_against_itself_is_exact(folder):
    path = folder / "model.onnx"
    report = evaluate_kv_cache(path, path, num_seqs=2, seq_len=24, prompt_len=8, progress=False)
    assert report.kl_max == 0.0
    assert report.top1_agreement == 1.0
    assert report.baseline_bytes_per_token == report.candidate_bytes_per_token > 0


@pytest.mark.parametrize("folder", [STATIC[0], MLA], ids=["static", "mla"])
def test_an_int8_qdq_cache_runs_as_a_hand_fed_loop_of_its_codes(folder, tmp_path):
    """convert's storage-quantized cache: the runner feeds int8 buffers (or pasts), keeps the
    codes the model returns, and its logits equal onnxruntime fed those codes by hand."""
    import onnx_ir as ir

    from onnx_kvcache.passes import QdqKvCachePass
    from onnx_kvcache.scales.files import KvCacheScales

    model = ir.load(folder / "model.onnx")
    bindings = KvCacheRunner(model).bindings
    width = {b.kind: b.kv_num_heads * b.head_size for b in bindings}  # MLA: K 32, V 16
    layers = {b.layer_id for b in bindings}
    scales = KvCacheScales(
        {i: np.full(width["key"], 0.05, np.float32) for i in layers},
        {i: np.full(width["value"], 0.04, np.float32) for i in layers},
        format="int8",
        granularity="per_channel",
    )
    QdqKvCachePass("int8", "per_channel", scales)(model)
    ir.save(model, tmp_path / "model.onnx", external_data="model.onnx.data")
    runner = KvCacheRunner(tmp_path / "model.onnx")
    assert {(b.dtype, b.format.name if b.format else None) for b in runner.bindings} == {
        (ir.DataType.INT8, "int8")
    }
    found = by_runner(tmp_path)
    np.testing.assert_allclose(
        np.stack(found), np.stack(hand_fed_int8(tmp_path, folder is not MLA)), atol=1e-5, rtol=0
    )
    runner.prefill(PROMPT)
    assert np.abs(runner.cache_values(0, "key")).max() > 0


def hand_fed_int8(folder: pathlib.Path, static: bool) -> list[np.ndarray]:
    """``hand_fed`` of a model whose caches are int8 codes."""
    return hand_fed(folder, static, np.int8)
