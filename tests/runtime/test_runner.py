"""KvCacheRunner: I/O discovery, caches of every format, decode, generation, IO binding."""

from __future__ import annotations

import pathlib
import warnings

import numpy as np
import onnx_ir as ir
import pytest

import onnx_kvcache.runtime._decoder_session as session_module
from onnx_kvcache import KvCacheError, KvCacheQuantizationPass, KvCacheRunner, KvCacheWarning
from onnx_kvcache.models.decoder import save_genai_folder
from onnx_kvcache.runtime.runner import discover_cache_bindings

from builders.exported import build_decoder

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

    from onnx_kvcache.models.decoder import save_genai_folder

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
    from builders.exported import exported_config

    path = tmp_path / "export.onnx"
    ir.save(build_decoder(exported_config("llama", num_layers=2, vocab_size=300)), path)
    source = path.read_bytes()
    runner = KvCacheRunner(path)
    assert [b.past for b in runner.bindings][:2] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert len(runner.generate([1, 2, 3], 4)) == 4
    assert path.read_bytes() == source


def test_a_bfloat16_export_runs_on_cpu_once_fused():
    from onnx_kvcache.passes.fusion.attention_fusion import AttentionFusionPass

    from builders.exported import exported_config

    model = build_decoder(exported_config("llama", num_layers=1, dtype="bfloat16", vocab_size=300))
    AttentionFusionPass()(model)
    assert len(KvCacheRunner(model).generate([1, 2, 3], 3)) == 3


# -- paged decoders (PagedAttention through the CPU reference) ------------------------


def paged_pair(fmt, granularity="per_tensor", **kwargs):
    """The GQA decoder and its paged twin (same weights), converted alike."""
    models = [
        build_decoder(num_layers=LAYERS, vocab_size=300, paged=paged, **kwargs) for paged in (False, True)
    ]
    if fmt is not None:
        n = 1 if granularity == "per_tensor" else 64
        big = 16 if fmt == "int4" else 1  # int4's 16 levels need a wider step
        scales = {i: (np.full(n, k * big), np.full(n, v * big)) for i, (k, v) in SCALES.items()}
        for model in models:
            KvCacheQuantizationPass(fmt, granularity, scales)(model)
    return models


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_decoder_computes_what_the_gqa_decoder_does(fmt, granularity):
    """The CPU reference against onnxruntime's CPU GQA kernel (int8/int4), whose rule is also
    quantize-before-attend: same cache codes, logits within 1e-4 (measured ~1e-5)."""
    a, b = twin_runners(*paged_pair(fmt, granularity))
    decode_alike(a, b, fmt)
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            np.testing.assert_allclose(
                b.cache_values(layer, kind), a.cache_values(layer, kind), rtol=1e-5, atol=1e-5
            )
    assert "PagedAttention CPU reference" in b.kernel_rule or fmt is None


def twin_runners(gqa: ir.Model, paged: ir.Model) -> tuple[KvCacheRunner, KvCacheRunner]:
    """The GQA twin under the CPU rule (the paged kernels' rule), the paged one as it runs."""
    with warnings.catch_warnings():  # fp8 under the CPU rule warns: it is the paged kernels' rule
        warnings.simplefilter("ignore", KvCacheWarning)
        return KvCacheRunner(gqa, semantics="cpu"), KvCacheRunner(paged)


def decode_alike(a: KvCacheRunner, b: KvCacheRunner, fmt: str | None) -> None:
    """Prefill and three steps give the same logits (1e-4), and a quantized cache the very
    codes: the paged pool's rows gathered in BNSH order."""
    ids = (np.arange(37) * 7 + 3) % 300
    np.testing.assert_allclose(b.prefill(ids), a.prefill(ids), atol=1e-4)
    for token in (5, 6, 7):
        np.testing.assert_allclose(b.step(token), a.step(token), atol=1e-4)
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            if fmt is not None:
                pool, want = b.present(layer, kind), a.present(layer, kind)
                assert pool.dtype == want.dtype
                rows = pool.reshape(-1, *pool.shape[2:])[b.pool.rows(0)]
                np.testing.assert_array_equal(rows.transpose(1, 0, 2)[None], want)


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_a_bfloat16_paged_decoder_computes_what_its_gqa_twin_does(fmt, granularity):
    """bf16 has no CPU kernels: both twins compute in float32 (bf16 weights widen exactly), the
    paged one through the CPU reference; same cache codes, logits within 1e-4 (measured ~1e-5)."""
    gqa, paged = paged_pair(fmt, granularity, dtype="bfloat16")
    assert all(v.dtype == ir.DataType.BFLOAT16 for v in paged.graph.outputs if "logits" in v.name)
    a, b = twin_runners(gqa, paged)
    assert b.emulated and b.kernel_rule.startswith("PagedAttention CPU reference")
    session_io = [*b.model.graph.inputs, *b.model.graph.outputs]
    assert not any(v.dtype == ir.DataType.BFLOAT16 for v in session_io)
    decode_alike(a, b, fmt)


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_a_latent_paged_decoder_keeps_one_cache_a_layer(fmt, granularity):
    """LATENT (MLA) layers: one cache each, written and read back by the CPU reference. Layer 0
    sees the float model's K, so its codes are the float cache quantized by the tests' codec;
    every phase quantizes before attending, so decode steps give one prefill's logits."""
    from onnx_kvcache import calibrate_kv_cache

    import codec

    config = {"num_layers": LAYERS, "vocab_size": 300, "paged": True, "latent": True, "head_size": 32}
    base, cand = build_decoder(**config), build_decoder(**config)
    ids = (np.arange(40) * 13 + 2) % 300
    scales = calibrate_kv_cache(
        base, [ids.tolist()], format=fmt, granularity=granularity, progress=False, min_tokens=0
    )
    KvCacheQuantizationPass(fmt, granularity, scales)(cand)
    float_runner, stepped, whole = KvCacheRunner(base), KvCacheRunner(cand), KvCacheRunner(cand)
    assert [(b.layer_id, b.kind) for b in stepped.bindings] == [(i, "key") for i in range(LAYERS)]
    float_runner.prefill(ids[:36])
    want = whole.prefill(ids)[0]
    np.testing.assert_allclose(stepped.prefill(ids[:36])[0], want[:36], rtol=0, atol=1e-5)
    for i in range(36, 40):
        float_runner.step(int(ids[i]))
        np.testing.assert_allclose(stepped.step(int(ids[i]))[0], want[i], rtol=0, atol=1e-5)
    pool = stepped.present(0, "key")
    codes = pool.reshape(-1, *pool.shape[2:])[stepped.pool.rows(0)].transpose(1, 0, 2)[None]
    scale = stepped.bindings[0].scale
    np.testing.assert_array_equal(codes, codec.quantize(fmt, float_runner.cache_values(0, "key"), scale))
    assert float_runner.cache_nbytes() == stepped.cache_nbytes() * (8 if fmt == "int4" else 4)  # float32


@pytest.mark.parametrize("fmt", [None, "int8", "fp8"])
def test_packed_ragged_batches_equal_sequences_run_alone(fmt):
    """Continuous batching: three sequences of different lengths in one call, then steps
    where one sequence adds nothing, give each sequence the logits it gets alone."""
    _, paged = paged_pair(fmt)
    batch = KvCacheRunner(paged, block_size=16)
    prompts = [np.arange(1, 6), np.arange(20, 43), np.arange(50, 90)]
    steps = [([7], [], [9, 10, 11]), ([12], [13], [14])]
    got = [batch.forward_packed(prompts)]
    got += [batch.forward_packed(step) for step in steps]
    assert batch.pool.lengths == [7, 24, 44] and batch.length == 44
    assert len({tuple(row[row >= 0] // 1) for row in batch.pool.table()}) == 3
    for b, prompt in enumerate(prompts):
        alone = KvCacheRunner(paged, block_size=32)
        want = [alone.forward(prompt)[0]]
        for step in steps:
            want.append(alone.forward(step[b])[0] if step[b] else np.zeros((0, 300), np.float32))
        for have, expect in zip(got, want):
            np.testing.assert_allclose(have[b], expect, atol=1e-4)
        np.testing.assert_allclose(
            batch.cache_values(0, "key")[b, :, : alone.length], alone.cache_values(0, "key")[0], atol=1e-5
        )


def test_paged_pool_grows_and_reports_its_layout():
    _, paged = paged_pair("int4")
    runner = KvCacheRunner(paged)
    assert runner.block_size == 16 and runner.pool.num_blocks == 0
    runner.prefill(np.arange(1, 41))  # 40 tokens: 3 blocks
    pool = runner.present(0, "key")
    assert pool.dtype == np.uint8 and pool.shape[1:] == (16, 2, 16) and pool.shape[0] >= 3
    for _ in range(30):
        runner.step(3)
    assert runner.pool.num_blocks >= 5 and runner.cache_values(1, "value").shape == (1, 2, 70, 32)
    assert runner.cache_nbytes() == 2 * LAYERS * runner.pool.num_blocks * 16 * 2 * 16


def test_paged_io_binding_on_cpu_equals_plain_feeds():
    _, paged = paged_pair("fp8")
    plain, bound = KvCacheRunner(paged, io_binding=False), KvCacheRunner(paged, io_binding=True)
    np.testing.assert_array_equal(plain.prefill(np.arange(1, 20)), bound.prefill(np.arange(1, 20)))
    np.testing.assert_array_equal(plain.step(4), bound.step(4))


def test_block_size_comes_from_the_model_the_caller_or_the_genai_config(tmp_path):
    from onnx_kvcache.models.decoder import save_genai_folder

    folder = save_genai_folder(
        tmp_path / "paged", num_layers=1, vocab_size=300, paged=True, paged_block_size=32
    )
    assert KvCacheRunner(folder).block_size == 32
    assert KvCacheRunner(folder, block_size=64).block_size == 64
    _, paged = paged_pair(None)
    assert KvCacheRunner(paged).block_size == 16
    for name in ("past_key_values.0.key", "past_key_values.0.value"):
        value = next(v for v in paged.graph.inputs if v.name == name)
        value.shape = ir.Shape(["num_blocks", 32, 2, 32])
    assert KvCacheRunner(paged).block_size == 32
    with pytest.raises(KvCacheError, match="fix block_size 32"):
        KvCacheRunner(paged, block_size=16)


@pytest.mark.parametrize("bad", [8, 24, 0])
def test_block_size_follows_onnxruntimes_rule(bad):
    _, paged = paged_pair(None)
    with pytest.raises(KvCacheError, match="power of two and at least 16"):
        KvCacheRunner(paged, block_size=bad)


def test_layers_with_different_block_sizes_are_refused():
    _, paged = paged_pair(None)
    for value in paged.graph.inputs:
        if value.name.startswith("past_key_values.0."):
            value.shape = ir.Shape(["num_blocks", 16, 2, 32])
        elif value.name.startswith("past_key_values.1."):
            value.shape = ir.Shape(["num_blocks", 32, 2, 32])
    with pytest.raises(KvCacheError, match=r"different block sizes \[16, 32\]"):
        KvCacheRunner(paged)


def test_slot_mapping_input_is_fed_the_derived_slots():
    _, plain = paged_pair("int8")
    _, mapped = paged_pair("int8")
    slots = ir.val("slot_mapping", ir.DataType.INT32, ["num_tokens"])
    mapped.graph.inputs.append(slots)
    for node in mapped.graph:
        if node.op_type == "PagedAttention":
            node.replace_input_with(10, slots)
    a, b = KvCacheRunner(plain), KvCacheRunner(mapped)
    np.testing.assert_array_equal(a.prefill(np.arange(1, 30)), b.prefill(np.arange(1, 30)))
    np.testing.assert_array_equal(a.step(3), b.step(3))


def test_paged_lengths_must_be_graph_inputs():
    _, paged = paged_pair(None)
    table = next(v for v in paged.graph.inputs if v.name == "block_table")
    copy = ir.node("Identity", [table], num_outputs=1)
    paged.graph.insert_before(next(iter(paged.graph)), copy)
    for node in paged.graph:
        if node.op_type == "PagedAttention":
            node.replace_input_with(7, copy.outputs[0])
    with pytest.raises(KvCacheError, match=r"block_table from .* not a graph input"):
        KvCacheRunner(paged)


def test_forward_packed_needs_a_paged_decoder():
    with pytest.raises(KvCacheError, match="paged decoder"):
        KvCacheRunner(model_for(None)).forward_packed([[1, 2]])


def test_layers_with_their_own_block_table_are_refused():
    _, paged = paged_pair(None)
    windowed = ir.val("block_table_windowed", ir.DataType.INT32, ["batch_size", "max_num_blocks_windowed"])
    paged.graph.inputs.append(windowed)
    node = [n for n in paged.graph if n.op_type == "PagedAttention"][1]
    node.replace_input_with(7, windowed)
    with pytest.raises(KvCacheError, match="windowed paged layers"):
        KvCacheRunner(paged)


@pytest.mark.parametrize(
    ("provider", "hint"),
    [
        ("CUDAExecutionProvider", "install onnxruntime-gpu"),
        ("TpuExecutionProvider", "give one of those"),
        (("TensorrtExecutionProvider", {}), "give one of those"),
    ],
)
def test_a_provider_onnxruntime_lacks_is_an_error_not_a_fallback(provider, hint):
    with pytest.raises(KvCacheError, match=f"is not available here.*CPUExecutionProvider.*{hint}"):
        KvCacheRunner(build_decoder(num_layers=1), providers=[provider])


def test_generate_refuses_a_negative_token_count():
    runner = KvCacheRunner(build_decoder(num_layers=1))
    assert runner.generate([1, 2, 3], 0) == []
    with pytest.raises(KvCacheError, match="max_new_tokens must be >= 0, got -1"):
        runner.generate([1, 2, 3], -1)


@pytest.mark.parametrize(("ids", "rows"), [([[1, 2, 3], [4, 5, 6]], 2), (np.ones((3, 2), np.int64), 3)])
def test_generate_takes_one_sequence_and_says_so_before_running(ids, rows, monkeypatch):
    runner = KvCacheRunner(build_decoder(num_layers=1))
    assert len(runner.generate([[1, 2, 3]], 2)) == 2  # [1, seq] is one sequence
    monkeypatch.setattr(runner, "prefill", lambda ids: pytest.fail("prefill ran before the check"))
    with pytest.raises(KvCacheError, match=f"generate decodes one sequence, got {rows}.*prefill"):
        runner.generate(ids, 3)


def test_a_model_that_is_no_decoder_is_named_so():
    x = ir.val("x", ir.DataType.FLOAT, [2])
    relu = ir.node("Relu", [x])
    relu.outputs[0].name, relu.outputs[0].dtype = "y", ir.DataType.FLOAT
    model = ir.Model(ir.Graph([x], relu.outputs, nodes=[relu], opset_imports={"": 21}), ir_version=10)
    with pytest.raises(KvCacheError, match="no GroupQueryAttention or PagedAttention node with a KV cache"):
        KvCacheRunner(model)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("io_binding", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_a_caches_only_runner_fills_the_caches_a_full_forward_does(fmt, io_binding, paged):
    model = paged_pair(fmt)[1] if paged else model_for(fmt, "per_channel")
    full = KvCacheRunner(model, io_binding=io_binding)
    only = KvCacheRunner(model, io_binding=io_binding, caches_only=True)
    assert (only.logits_name, only.vocab_size) == (full.logits_name, full.vocab_size) == ("logits", 300)
    for ids in ([[5, 6, 7, 8, 9]], [[10]], [[11, 12]]):  # a prefill, then steps through the cache
        full.forward(ids)
        assert only.fill(ids) is None
    assert only.length == full.length == 8
    for b in full.bindings:
        np.testing.assert_array_equal(only.present(b.layer_id, b.kind), full.present(b.layer_id, b.kind))


def test_the_caches_only_graph_ends_at_the_last_cache():
    """No LM head, final norm, last o_proj or MLP: only what a present output depends on."""
    model = model_for(None)
    before = ir.to_onnx_text(model)
    runner = KvCacheRunner(model, caches_only=True)
    assert ir.to_onnx_text(model) == before  # the caller's model is not pruned
    pruned = runner.model
    assert [v.name for v in pruned.graph.outputs] == [b.present for b in runner.bindings]
    assert [o.name for o in runner.session.get_outputs()] == [b.present for b in runner.bindings]
    assert "lm_head.weight" not in pruned.graph.initializers
    nodes = list(model.graph)
    last = max(i for i, n in enumerate(nodes) if n.op_type == "GroupQueryAttention")
    assert [n.name for n in pruned.graph] == [n.name for n in nodes[: last + 1]]  # every one before it
    assert {n.name for n in nodes[last + 1 :]} >= {"lm_head/MatMul", "model.layers.1.mlp.down_proj/MatMul"}


@pytest.mark.parametrize("call", ["forward", "prefill", "step", "generate"])
def test_a_caches_only_runner_computes_no_logits(call):
    runner = KvCacheRunner(model_for("int8"), caches_only=True)
    args = {"forward": ([[1, 2]],), "prefill": ([1, 2],), "step": (3,), "generate": ([1, 2], 2)}[call]
    with pytest.raises(KvCacheError, match=r"caches_only=True.*use fill\(ids\)"):
        getattr(runner, call)(*args)
    assert runner.length == 0


def test_a_caches_only_paged_runner_refuses_forward_packed():
    runner = KvCacheRunner(paged_pair("int8")[1], caches_only=True)
    with pytest.raises(KvCacheError, match="computes no logits"):
        runner.forward_packed([[1, 2], [3]])


@pytest.mark.parametrize(
    ("make", "caches_only", "from_file"),
    [
        (lambda tmp: save_genai_folder(tmp / "m", num_layers=1, vocab_size=300), False, True),
        (lambda tmp: save_genai_folder(tmp / "m", num_layers=1, vocab_size=300), True, False),
        (
            lambda tmp: save_genai_folder(tmp / "m", num_layers=1, vocab_size=300, dtype="bfloat16"),
            False,
            False,
        ),
        (lambda tmp: build_decoder(num_layers=1, vocab_size=300), False, False),
    ],
    ids=["file", "pruned", "prepared_for_cpu", "in_memory"],
)
def test_a_session_reads_the_model_file_when_it_runs_the_files_graph(
    tmp_path, monkeypatch, make, caches_only, from_file
):
    """onnxruntime reads the file itself unless the graph it runs differs from the file's
    (pruned, prepared for CPU) or there is no file; the pruned graph's external data is
    found from any working directory. A caches-only session's threads do not spin."""
    model = make(tmp_path)
    before = sorted((f.name, f.stat().st_mtime_ns) for f in tmp_path.rglob("*"))
    seen = []
    real = session_module.create_session

    def spy(model, providers=None, base_dir=None, **options):
        seen.append(model)
        assert options == {"spinning": not caches_only}
        return real(model, providers, base_dir, **options)

    monkeypatch.setattr(session_module, "create_session", spy)
    monkeypatch.chdir(tmp_path.parent)
    runner = KvCacheRunner(model, caches_only=caches_only)
    (given,) = seen
    assert isinstance(given, pathlib.Path) == from_file
    if from_file:
        assert given == tmp_path / "m" / "model.onnx"
    runner.fill([1, 2, 3])
    assert runner.cache_values(0, "key").shape == (1, 2, 3, 32)
    assert sorted((f.name, f.stat().st_mtime_ns) for f in tmp_path.rglob("*")) == before  # nothing written


ROLLING = (
    pathlib.Path(__file__).parents[1]
    / "data"
    / "producers"
    / "torch-tf5"
    / "dynamo-opset23-optimize-rollingcache"
)


@pytest.mark.parametrize("command", ["calibrate", "evaluate"])
def test_an_export_that_does_not_fuse_is_refused_with_the_fusions_reason(tmp_path, capsys, command):
    """calibrate and evaluate fuse an export in memory; one that fuses in part (a rolling window
    cache beside a full one) is refused in the one line convert says, not with a warning and
    advice to fuse it first (which would fail the same way). One that fuses nothing but whose
    caches the runner feeds as exported (MLA) runs: tests/runtime/test_static_cache.py."""
    from onnx_kvcache.cli.commands import main

    exported = ir.load(ROLLING / "cohere2" / "model.onnx")
    for value in exported.graph.inputs:  # every past declared 2 rows: the window layer stays unfused
        if value.name.startswith("past_key_values") and value.shape is not None:
            value.shape = ir.Shape([*value.shape[:2], 2, value.shape[3]])
    ir.save(exported, tmp_path / "model.onnx")
    model = str(tmp_path / "model.onnx")
    args = {
        "calibrate": ["calibrate", model, "--out", str(tmp_path / "s.json"), "--format", "int8"],
        "evaluate": ["evaluate", model, model, "--num-seqs", "1", "--seq-len", "16"],
    }[command]
    assert main([*args, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "attention fusion fused 1 layer(s) but left 1 unfused" in err and "rolling window cache" in err
    assert not (tmp_path / "s.json").exists()


def test_an_export_whose_fusion_leaves_the_graph_out_of_order_runs():
    """transformers 5.24's TorchScript export: after fusing, Shape nodes reading a present come
    before the GroupQueryAttention that writes it; the calibration session's clone of the graph
    needs it sorted (before: onnx-ir's RuntimeError, a traceback from calibrate)."""
    from onnx_kvcache import calibrate_kv_cache

    path = (
        pathlib.Path(__file__).parents[1]
        / "data"
        / "producers"
        / "torch-tf5"
        / "torchscript-opset18"
        / "llama"
    )
    source = (path / "model.onnx").read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        assert len(KvCacheRunner(path / "model.onnx").generate([1, 72, 101, 108], 3)) == 3
        scales = calibrate_kv_cache(
            path / "model.onnx", format="int8", seq_len=32, num_seqs=8, progress=False
        )
    assert sorted(scales.layer_ids) == [0, 1]
    assert (path / "model.onnx").read_bytes() == source
