"""KvCacheRunner: I/O discovery, caches of every format, decode, generation, IO binding."""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheQuantizationPass, KvCacheRunner, KvCacheWarning, build_decoder
from onnx_kvcache.runner import discover_cache_bindings

LAYERS = 2
SCALES = {i: (0.05, 0.02) for i in range(LAYERS)}
FORMATS = [None, "fp8", "int8", "int4"]


def model_for(fmt, granularity="per_tensor", **kwargs):
    model = build_decoder(num_layers=LAYERS, vocab_size=300, **kwargs)
    if fmt is not None:
        scales = SCALES
        if granularity == "per_channel":
            scales = {i: (np.full(64, k), np.full(64, v)) for i, (k, v) in SCALES.items()}
        KvCacheQuantizationPass(fmt, granularity, scales)(model)
    return model


@pytest.mark.parametrize("fmt", FORMATS)
def test_caches_have_the_model_dtype_and_shape(fmt):
    runner = KvCacheRunner(model_for(fmt))
    dtype = {None: np.float32, "fp8": np.uint8, "int8": np.int8, "int4": np.uint8}[fmt]
    last = 16 if fmt == "int4" else 32
    for b in runner.bindings:
        assert runner.present(b.layer_id, b.kind).shape == (1, 2, 0, last)
    logits = runner.prefill([1, 2, 3, 4])
    assert logits.shape == (1, 4, 300) and runner.length == 4
    for b in runner.bindings:
        cache = runner.present(b.layer_id, b.kind)
        assert cache.dtype == dtype and cache.shape == (1, 2, 4, last)
        assert runner.cache_values(b.layer_id, b.kind).shape == (1, 2, 4, 32)
    itemsize = 4 if fmt is None else 1
    caches = 2 * LAYERS  # k and v per layer
    assert runner.cache_nbytes() == caches * (1 * 2 * 4 * last) * itemsize
    assert runner.step(5).shape == (1, 300) and runner.length == 5


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_steps_equal_one_prefill(fmt):
    """Tokens fed one a step see the cache they left: logits match a single prefill.

    Under the CPU kernel's rule a prompt reads its own tokens quantized, as decode steps do
    (CUDA's first prompt reads them unquantized: see test_kv_cache_emulation).
    """
    ids = [3, 14, 15, 92, 65, 35]
    with warnings.catch_warnings():  # fp8 under the CPU rule warns that no kernel does that
        warnings.simplefilter("ignore", KvCacheWarning)
        a, b = (KvCacheRunner(model_for(fmt), semantics="cpu") for _ in range(2))
    full = a.prefill(ids)[0]
    b.prefill(ids[:2])
    stepped = [b.step(t)[0] for t in ids[2:]]
    tol = 1e-4 if fmt is None else 5e-2  # quantized: prefill reads its own new tokens the same way
    np.testing.assert_allclose(np.stack(stepped), full[2:], atol=tol)


@pytest.mark.parametrize("fmt", FORMATS)
def test_generate_is_greedy(fmt):
    runner = KvCacheRunner(model_for(fmt))
    tokens = runner.generate([7, 8, 9], 5)
    check = KvCacheRunner(model_for(fmt))
    logits = check.prefill([7, 8, 9])[0, -1]
    want = []
    for _ in range(5):
        want.append(int(np.argmax(logits)))
        logits = check.step(want[-1])[0]
    assert tokens == want and runner.length == 3 + 4


@pytest.mark.parametrize("fmt", FORMATS)
def test_io_binding_equals_plain_feeds(fmt):
    plain = KvCacheRunner(model_for(fmt), io_binding=False)
    bound = KvCacheRunner(model_for(fmt), io_binding=True)
    np.testing.assert_array_equal(plain.prefill([1, 2, 3]), bound.prefill([1, 2, 3]))
    np.testing.assert_array_equal(plain.step(4), bound.step(4))
    for b in plain.bindings:
        np.testing.assert_array_equal(plain.cache_array(b.past), bound.cache_array(b.past))
    assert plain.cache_nbytes() == bound.cache_nbytes()


def test_batch_of_sequences():
    runner = KvCacheRunner(model_for("int8"))
    logits = runner.prefill(np.array([[1, 2, 3], [4, 5, 6]]))
    assert logits.shape == (2, 3, 300) and runner.cache_array(runner.bindings[0].past).shape[0] == 2
    assert runner.step([7, 8]).shape == (2, 300)


def test_window_sized_caches():
    model = model_for("int8", sliding_window_layers=(1,), sliding_window=8, sliding_window_cache=True)
    runner = KvCacheRunner(model)
    capacities = {b.layer_id: b.capacity for b in runner.bindings}
    assert capacities == {0: None, 1: 8}
    runner.prefill(list(range(20)))
    assert runner.present(1, "key").shape[2] == 8 and runner.present(0, "key").shape[2] == 20
    runner.step(3)
    assert runner.present(1, "value").shape[2] == 8


def test_other_cache_names_are_paired_through_the_gqa_nodes():
    model = model_for("int4")
    for value in (*model.graph.inputs, *model.graph.outputs):
        if value.name.startswith("past_key_values."):
            _, layer, kind = value.name.split(".")
            value.name = f"past_{kind}_{layer}"
        elif value.name.startswith("present."):
            _, layer, kind = value.name.split(".")
            value.name = f"present_{kind}_{layer}"
    bindings = discover_cache_bindings(model)
    assert [(b.layer_id, b.kind, b.past, b.present) for b in bindings[:2]] == [
        (0, "key", "past_key_0", "present_key_0"),
        (0, "value", "past_value_0", "present_value_0"),
    ]
    assert KvCacheRunner(model).generate([1, 2], 3)


def test_a_model_without_input_ids_is_an_error():
    model = model_for(None)
    model.graph.inputs[0].name = "tokens_in"
    with pytest.raises(KvCacheError, match="no input_ids"):
        KvCacheRunner(model)


def test_runner_does_not_modify_the_given_model():
    model = model_for("fp8")
    text = ir.to_onnx_text(model)
    KvCacheRunner(model).prefill([1])
    assert ir.to_onnx_text(model) == text


def test_generation_stops_at_eos():
    runner = KvCacheRunner(model_for("int8"))
    free = runner.generate([7, 8, 9], 6, eos_token_id=None)
    stopped = runner.generate([7, 8, 9], 6, eos_token_id=free[2])
    assert stopped == free[: free.index(free[2]) + 1]


def test_a_context_keeps_its_batch_size():
    runner = KvCacheRunner(model_for("int8"))
    runner.prefill(np.array([[1, 2, 3], [4, 5, 6]]))
    with pytest.raises(KvCacheError, match="holds 2 sequence"):
        runner.step(5)
    assert runner.length == 3 and runner.step([5, 6]).shape == (2, 300)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "non-empty"),
        ([[]], "non-empty"),
        ([-1], r"in \[0, 300\)"),
        ([300], r"in \[0, 300\)"),
        ([3.7], "integers"),
    ],
)
def test_token_ids_are_checked(ids, message):
    with pytest.raises(KvCacheError, match=message):
        KvCacheRunner(model_for(None)).prefill(ids)


def test_contexts_past_the_rotary_tables_are_refused():
    runner = KvCacheRunner(model_for(None, max_position=16))
    runner.prefill(list(range(12)))
    with pytest.raises(KvCacheError, match="exceed the 16 positions"):
        runner.forward(list(range(5)))


def test_every_listed_eos_token_stops_generation(tmp_path):
    import json

    from onnx_kvcache.demo_model import save_genai_folder

    folder = save_genai_folder(tmp_path / "g", num_layers=2, vocab_size=300)
    free = KvCacheRunner(folder).generate([7, 8, 9], 6, eos_token_id=None)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = [257, free[2]]
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert KvCacheRunner(folder).generate([7, 8, 9], 6) == free[:3]


def test_a_cache_kind_is_key_or_value():
    with pytest.raises(KvCacheError, match="'key' or 'value', got 'k'"):
        KvCacheRunner(model_for("int8")).present(0, "k")


def test_an_export_file_is_fused_in_memory(tmp_path):
    from onnx_kvcache.exported_decoder import exported_config

    path = tmp_path / "export.onnx"
    ir.save(build_decoder(exported_config("llama", num_layers=2, vocab_size=300)), path)
    source = path.read_bytes()
    runner = KvCacheRunner(path)
    assert [b.past for b in runner.bindings][:2] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert len(runner.generate([1, 2, 3], 4)) == 4
    assert path.read_bytes() == source


def test_a_bfloat16_export_runs_on_cpu_once_fused():
    from onnx_kvcache.exported_decoder import exported_config
    from onnx_kvcache.passes.attention_fusion import AttentionFusionPass

    model = build_decoder(exported_config("llama", num_layers=1, dtype="bfloat16", vocab_size=300))
    AttentionFusionPass()(model)
    assert len(KvCacheRunner(model).generate([1, 2, 3], 3)) == 3
