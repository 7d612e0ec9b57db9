"""calibrate_kv_cache: thresholds, the RoPE envelope, clipping, the sites it calibrates, its files."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from calibration_cases import HEAD, KV, LAYERS, data, model, presents  # noqa: F401  (fixtures)

from onnx_kvcache import KvCacheError, KvCacheQuantizationPass, calibrate_kv_cache, load_kv_cache_scale_file
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.calibrate.calibration import _Reservoir, _thresholds, rope_pair_norm
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.models.decoder import DecoderConfig, save_genai_folder
from onnx_kvcache.runtime.evaluation import evaluate_kv_cache

from builders.exported import build_decoder, exported_config


def _plain_minmax(model, data, fmt, granularity):
    """minmax scales of the values the cache holds as the model computes them (int4 rotates
    by default: here not; no RoPE envelope)."""
    return calibrate_kv_cache(
        model,
        data,
        format=fmt,
        granularity=granularity,
        method="minmax",
        rope_envelope=False,
        rotation="none",
        progress=False,
    )


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_minmax_is_amax_over_qmax(model, data, fmt, granularity):
    scales = _plain_minmax(model, data, fmt, granularity)
    qmax = get_format(fmt).qmax
    for (layer, kind), arrays in presents(model, data).items():
        amax = np.max([np.abs(a).max(axis=1).reshape(-1) for a in arrays], axis=0)  # per channel, h-major
        want = np.array([amax.max()]) if granularity == "per_tensor" else amax
        got = scales.for_layer(layer)[0 if kind == "key" else 1]
        assert got.shape == ((1,) if granularity == "per_tensor" else (KV * HEAD,))
        np.testing.assert_allclose(got, want / qmax, rtol=1e-6)


def test_envelope_takes_rotation_invariant_pair_norms(model, data):
    scales = calibrate_kv_cache(model, data, format="int8", granularity="per_channel", progress=False)
    raw = calibrate_kv_cache(
        model, data, format="int8", granularity="per_channel", rope_envelope=False, progress=False
    )
    for (layer, kind), arrays in presents(model, data).items():
        if kind != "key":
            np.testing.assert_array_equal(scales.v[layer], raw.v[layer])
            continue
        x = np.concatenate(arrays, axis=1)
        half = HEAD // 2
        norm = np.sqrt(x[..., :half] ** 2 + x[..., half:] ** 2).max(axis=1)  # [kv, half]
        want = np.concatenate([norm, norm], axis=-1).reshape(-1) / 128
        np.testing.assert_allclose(scales.k[layer], want, rtol=1e-5)
        assert np.all(scales.k[layer] >= raw.k[layer] * (1 - 1e-6))
        assert scales.k[layer].max() > raw.k[layer].max() or np.allclose(scales.k[layer], raw.k[layer])


@pytest.mark.parametrize("interleaved", [False, True])
def test_pair_norm_is_invariant_under_rotation(interleaved):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8))
    theta = rng.uniform(0, 2 * np.pi, 4)
    c, s = np.cos(theta), np.sin(theta)
    y = x.copy()
    if interleaved:
        a, b = x[:, 0::2], x[:, 1::2]
        y[:, 0::2], y[:, 1::2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[:, :4], x[:, 4:]
        y[:, :4], y[:, 4:] = a * c - b * s, b * c + a * s
    np.testing.assert_allclose(
        rope_pair_norm(x, interleaved=interleaved), rope_pair_norm(y, interleaved=interleaved), rtol=1e-6
    )


def test_planted_outlier_moves_minmax_not_percentile():
    rng = np.random.default_rng(1)
    rows = np.abs(rng.standard_normal((20000, 4))).astype(np.float32)
    fmt = get_format("int8")
    clean, spiked = _Reservoir(4, 30_000, rng), _Reservoir(4, 30_000, rng)
    clean.add(rows)
    spiked.add(np.concatenate([rows, np.full((1, 4), 500.0, np.float32)]))
    for method, moved in (("minmax", True), ("percentile", False)):
        a = _thresholds(clean, method, 99.0, fmt, "per_channel")
        b = _thresholds(spiked, method, 99.0, fmt, "per_channel")
        assert (b > 10 * a).all() == moved
        if not moved:
            np.testing.assert_allclose(a, b, rtol=0.01)


def test_mse_clips_gaussian_tails_harder_with_fewer_levels():
    rng = np.random.default_rng(2)
    rows = np.abs(rng.standard_normal((20000, 3))).astype(np.float32)
    res = _Reservoir(3, 100_000, rng)
    res.add(rows)
    thr = {f: _thresholds(res, "mse", 99.99, get_format(f), "per_channel") for f in ("int8", "int4")}
    assert np.all(thr["int8"] <= res.amax) and np.all(thr["int4"] < 0.8 * res.amax)
    assert np.all(thr["int4"] < thr["int8"])  # fewer levels: clip harder
    assert _thresholds(res, "mse", 99.99, get_format("int4"), "per_tensor").shape == (1,)


def test_reservoir_memory_is_bounded():
    rng = np.random.default_rng(0)
    res = _Reservoir(8, 64, rng)
    for _ in range(100):
        res.add(rng.standard_normal((50, 8)).astype(np.float32))
    assert res.rows.shape == (64, 8) and res.seen == 5000


def _algorithm_r(capacity, batches, seed):
    """The reservoir row by row (one draw per row past the capacity, in order)."""
    rng, kept, seen = np.random.default_rng(seed), [], 0
    for rows in batches:
        for row in rows:
            if len(kept) < capacity:
                kept.append(row)
            elif (j := int(rng.integers(0, seen + 1))) < capacity:
                kept[j] = row
            seen += 1
    return np.asarray(kept), rng.integers(0, 2**62)


@pytest.mark.parametrize(
    ("capacity", "sizes"), [(64, [50] * 40), (5, [300, 1, 7]), (100, [100, 100]), (3, [1] * 50)]
)
def test_the_reservoir_keeps_the_rows_algorithm_r_keeps(capacity, sizes):
    """Vectorized, the reservoir draws what the row-by-row loop draws: the same sample, and the
    generator left in the same state (the next layer's draws follow it)."""
    data = np.random.default_rng(1)
    batches = [data.standard_normal((n, 4)).astype(np.float32) for n in sizes]
    res = _Reservoir(4, capacity, np.random.default_rng(9))
    for rows in batches:
        res.add(rows)
    want, next_draw = _algorithm_r(capacity, batches, 9)
    np.testing.assert_array_equal(res.rows, want)
    assert res.rng.integers(0, 2**62) == next_draw and res.seen == sum(sizes)


def test_sample_budget_keeps_percentiles_close(model, data):
    full = calibrate_kv_cache(model, data, method="percentile", percentile=99.0, progress=False)
    small = calibrate_kv_cache(
        model, data, method="percentile", percentile=99.0, sample_budget=4096, progress=False
    )
    for layer in full.layer_ids:
        np.testing.assert_allclose(small.k[layer], full.k[layer], rtol=0.25)


def test_margin_scales_linearly(model, data):
    a = calibrate_kv_cache(model, data, format="int8", progress=False)
    b = calibrate_kv_cache(model, data, format="int8", margin=1.5, progress=False)
    np.testing.assert_allclose(b.k[0], a.k[0] * 1.5, rtol=1e-6)


def test_windows_and_num_seqs(model, data):
    scales = calibrate_kv_cache(model, data, seq_len=128, num_seqs=5, progress=False)
    assert scales.metadata["num_seqs"] == 5 and scales.metadata["tokens"] == (128 + 128 + 44) + (125 + 128)
    assert scales.metadata["data"] == "given token ids"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"format": "fp8", "method": "mse"}, "integer formats"),
        ({"format": "fp8", "method": "attention"}, "integer formats"),
        ({"method": "kmeans"}, "Unknown calibration method"),
        ({"percentile": 0}, "percentile"),
        ({"margin": -1}, "margin"),
    ],
)
def test_bad_arguments(model, data, kwargs, message):
    with pytest.raises(KvCacheError, match=message):
        calibrate_kv_cache(model, data, progress=False, **kwargs)


def test_quantized_model_is_refused(model, data):
    quantized = build_decoder(num_layers=LAYERS, vocab_size=300)
    KvCacheQuantizationPass("int8", scales={0: (0.1, 0.1), 1: (0.1, 0.1)})(quantized)
    with pytest.raises(KvCacheError, match="already quantized"):
        calibrate_kv_cache(quantized, data, progress=False)


def test_non_finite_outputs_raise(data):
    broken = build_decoder(num_layers=LAYERS, vocab_size=300)
    weight = broken.graph.initializers["model.layers.0.attn.v_proj.weight"]
    array = weight.const_value.numpy().copy()
    array[0, 0] = np.nan
    weight.const_value = ir.tensor(array, name=weight.name)
    with pytest.raises(KvCacheError, match="non-finite"):
        calibrate_kv_cache(broken, data, progress=False)


def test_sliding_window_layers_are_calibrated_on_every_row():
    """A long prefill evicts rows from a window-sized cache; the kernel quantized them all."""
    options = {"num_layers": 2, "vocab_size": 300, "sliding_window_layers": (1,), "sliding_window": 16}
    windowed = build_decoder(**options, sliding_window_cache=True)
    seq = list(np.random.default_rng(0).integers(0, 300, 48))
    scales = calibrate_kv_cache(
        windowed, [seq], format="int8", rope_envelope=False, progress=False, min_tokens=len(seq)
    )
    full_cache = build_decoder(**options)  # same weights; layer 1 keeps all 48 rows
    values = presents(full_cache, [seq])[(1, "value")][0]
    assert values.shape[1] == 48
    np.testing.assert_allclose(scales.v[1], np.abs(values).max() / 128, rtol=1e-6)
    session = create_session(windowed)  # ...whereas the window itself holds 16
    ids = np.asarray(seq, np.int64)[None]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i, length in ((0, 0), (1, 16)):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, KV, length, HEAD), np.float32)
    assert session.run(["present.1.value"], feeds)[0].shape[2] == 16


@pytest.mark.parametrize("total", [10, 20, 37, 40, 41])
def test_resident_rows_match_the_kernels_eviction(total):
    """Capacity 20, window 16: rows [0, L) hold the last L positions, L from the formula."""
    from onnx_kvcache import KvCacheRunner

    options = {"num_layers": 2, "vocab_size": 300, "sliding_window_layers": (1,), "sliding_window": 16}
    windowed = KvCacheRunner(build_decoder(**options, sliding_window_cache=True))
    full = KvCacheRunner(build_decoder(**options))
    seq = list(np.random.default_rng(1).integers(0, 300, total))
    windowed.reset(1, min_capacity=20)
    windowed.forward(np.asarray(seq)[None])
    full.prefill(seq)
    binding = next(b for b in windowed.bindings if b.layer_id == 1 and b.kind == "key")
    resident = binding.resident_rows(total, 20)
    assert min(total, 16) <= resident <= min(total, 20)
    got, want = windowed.present(1, "key")[:, :, :resident], full.present(1, "key")[:, :, total - resident :]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_layers_without_cache_are_skipped_in_layer_ids(tmp_path, data):
    model = build_decoder(num_layers=4, vocab_size=300, no_cache_layers=(1,))
    scales = calibrate_kv_cache(model, data, format="int8", progress=False)
    assert scales.layer_ids == (0, 2, 3)
    scales.save(tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["layer_ids"] == [0, 2, 3]
    KvCacheQuantizationPass("int8", scales=load_kv_cache_scale_file(tmp_path / "s.json"))(model)


def test_saved_file_records_provenance(tmp_path, model, data):
    scales = calibrate_kv_cache(
        model, data, format="int4", granularity="per_channel", method="mse", progress=False
    )
    scales.save(tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    assert (doc["format"], doc["granularity"], doc["method"], doc["qmax"]) == (
        "int4",
        "per_channel",
        "mse",
        8.0,
    )
    again = load_kv_cache_scale_file(tmp_path / "s.json")
    np.testing.assert_array_equal(again.k[1], scales.k[1])


def test_calibrated_int8_tracks_the_original_far_better_than_bad_scales(model, data):
    good = calibrate_kv_cache(model, data, format="int8", granularity="per_channel", progress=False)
    bad = {i: (good.k[i] * 0.02, good.v[i] * 0.02) for i in good.layer_ids}  # saturates
    reports = {}
    for name, scales in (("good", good), ("bad", bad)):
        candidate = build_decoder(num_layers=LAYERS, vocab_size=300)
        KvCacheQuantizationPass("int8", "per_channel", scales)(candidate)
        reports[name] = evaluate_kv_cache(model, candidate, data, max_new_tokens=0, prompt_len=8)
    assert reports["good"].kl_mean * 20 < reports["bad"].kl_mean
    assert reports["good"].top1_agreement > reports["bad"].top1_agreement


def test_fp8_minmax_clips_nothing(model, data):
    """threshold / 448 * 448 may round a float32 ulp below the threshold: not a clip."""
    scales = calibrate_kv_cache(model, data, format="fp8", granularity="per_channel", progress=False)
    assert all(s.k_clip == 0 and s.v_clip == 0 for s in scales.stats)


def _rows(arrays) -> np.ndarray:
    """[kv, S, hd] arrays -> [tokens, kv*hd] rows, as a scale covers them (h-major)."""
    x = np.concatenate(arrays, axis=1)
    return x.transpose(1, 0, 2).reshape(x.shape[1], -1)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_integer_minmax_clips_exactly_the_values_the_kernel_stores_a_step_short(
    model, data, fmt, granularity
):
    """genai's convention: scale = amax / 128 (int4: / 8), top code 127 (7), bottom -128 (-8).

    A value is clipped when the cache reads it back with more than rounding error (half a
    step), which under minmax happens to positive values above 127.5 (7.5) steps only: a
    small clip fraction, not zero where a scale's largest value is positive.
    """
    f = get_format(fmt)
    scales = _plain_minmax(model, data, fmt, granularity)
    seen = presents(model, data)
    clipped_somewhere = False
    for s in scales.stats:
        for kind, clip, scale in (("key", s.k_clip, s.k_scale), ("value", s.v_clip, s.v_scale)):
            rows = _rows(seen[(s.layer_id, kind)])
            step = np.repeat(scale, rows.shape[1] // scale.size)
            error = np.abs(f.levels(rows, step) - rows.astype(np.float64) / step)  # in steps
            want = float((error > 0.5 + 1e-5).mean())  # 1e-5: float32's 1/scale, not a clip
            assert clip == pytest.approx(want, abs=0.5 / rows.size), (s.layer_id, kind)  # the same values
            assert clip < 0.01  # within half a step of amax: a sliver
            clipped_somewhere |= clip > 0
    assert clipped_somewhere  # int8/int4 minmax: the summary's clip column is not all zero


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_largest_value_is_stored_at_the_top_code(model, data, fmt):
    """What the summary's legend says, by onnxruntime's own kernel: calibrate, convert, prefill
    the sequence holding layer 0's largest V; its code is the top one (127, int4 7), read back
    as 127/128 (7/8) of itself. Layer 0's V depends on the tokens only, not on the cache."""
    f = get_format(fmt)
    scales = calibrate_kv_cache(model, data, format=fmt, method="minmax", rotation="none", progress=False)
    seen = presents(model, data)[(0, "value")]
    seq = int(np.argmax([a.max() for a in seen]))
    assert seen[seq].max() == max(np.abs(a).max() for a in seen)  # positive here: the case to show
    quantized = build_decoder(num_layers=LAYERS, vocab_size=300)
    KvCacheQuantizationPass(fmt, scales=scales)(quantized)
    session = create_session(quantized)
    ids = np.asarray(data[seq], np.int64)[None]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in range(LAYERS):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, KV, 0, f.packed_dim(HEAD)), f.numpy_dtype())
    (stored,) = session.run(["present.0.value"], feeds)
    scale = scales.v[0]
    h, s, d = np.unravel_index(np.argmax(seen[seq]), seen[seq].shape)
    back = f.dequantize(stored, scale, HEAD)[0]
    top = f.qmax_stored / f.qmax  # 127/128, 7/8
    assert back[h, s, d] == np.float32(f.qmax_stored) * scale[0]
    np.testing.assert_allclose(back[h, s, d], top * seen[seq][h, s, d], rtol=1e-6)
    assert back.max() == back[h, s, d]  # the top code, and no value above it


def test_the_summary_says_why_integer_minmax_clips(model, data):
    from onnx_kvcache.calibrate.calibration import format_calibration_summary

    text = format_calibration_summary(calibrate_kv_cache(model, data, format="int8", progress=False).stats)
    legend = text.splitlines()[-1]
    assert "127/128" in legend and "7/8" in legend and "onnxruntime-genai" in legend and len(legend) <= 100


def test_envelope_covers_rotary_applied_outside_gqa(data):
    """Fused exports keep RotaryEmbedding in front of GQA (do_rotary=0): K is rotated all the same."""
    from onnx_kvcache.passes.fusion.attention_fusion import AttentionFusionPass

    model = build_decoder(exported_config("llama", num_layers=LAYERS, vocab_size=300))
    AttentionFusionPass()(model)
    kwargs = {"format": "int8", "granularity": "per_channel", "progress": False}
    scales = calibrate_kv_cache(model, data, **kwargs)
    raw = calibrate_kv_cache(model, data, rope_envelope=False, **kwargs)
    for layer in range(LAYERS):
        np.testing.assert_array_equal(scales.v[layer], raw.v[layer])
        k, half = scales.k[layer].reshape(KV, HEAD), HEAD // 2
        np.testing.assert_array_equal(k[:, :half], k[:, half:])  # one threshold per rotation pair
        assert (
            np.all(scales.k[layer] >= raw.k[layer] * (1 - 1e-6))
            and scales.k[layer].max() > raw.k[layer].max()
        )


@pytest.mark.parametrize(
    ("fmt", "granularity", "method"), [("int8", "per_channel", "minmax"), ("fp8", "per_tensor", "percentile")]
)
def test_paged_decoder_calibrates_like_its_gqa_twin(data, fmt, granularity, method):
    """Same weights, one through the PagedAttention CPU reference: the same scales."""
    kwargs = {"format": fmt, "granularity": granularity, "method": method, "progress": False, "min_tokens": 0}
    gqa = calibrate_kv_cache(build_decoder(num_layers=LAYERS, vocab_size=300), data, **kwargs)
    paged = calibrate_kv_cache(build_decoder(num_layers=LAYERS, vocab_size=300, paged=True), data, **kwargs)
    assert paged.layer_ids == gqa.layer_ids
    for layer in gqa.layer_ids:
        for got, want in zip(paged.for_layer(layer), gqa.for_layer(layer)):
            np.testing.assert_allclose(got, want, rtol=1e-5)


def test_latent_cache_calibrates_one_scale_for_k_and_v(data):
    model = build_decoder(num_layers=LAYERS, vocab_size=300, paged=True, latent=True, head_size=HEAD)
    scales = calibrate_kv_cache(
        model, data, format="int8", granularity="per_channel", progress=False, min_tokens=0
    )
    for layer in scales.layer_ids:
        k, v = scales.for_layer(layer)
        assert k.size == HEAD  # kv_num_heads is 1
        np.testing.assert_array_equal(k, v)
    KvCacheQuantizationPass("int8", "per_channel", scales)(model)  # the scales fit the model


def test_rope_envelope_covers_an_offset_rotary_range():
    x = np.zeros((1, 1, 32), np.float32)
    x[..., 24], x[..., 28] = 3.0, 4.0  # a RoPE pair at offset 24, rotary dim 8 (half 4)
    x[..., 0] = -2.0  # not rotated: copied through
    out = rope_pair_norm(x, interleaved=False, rotary_dim=8, rotary_offset=24)
    assert out[..., 24] == out[..., 28] == 5.0 and out[..., 0] == 2.0 and out[..., 25] == 0.0


@pytest.mark.parametrize(("dtype", "fmt"), [("float32", "int8"), ("float16", "fp8")])
def test_the_default_format_is_the_one_the_models_target_runs(dtype, fmt):
    model = build_decoder(DecoderConfig(num_layers=1, vocab_size=300, dtype=dtype))
    ids = [list(np.random.default_rng(0).integers(0, 300, 64))]
    scales = calibrate_kv_cache(model, ids, progress=False, min_tokens=64)
    assert scales.format == fmt and scales.qmax == get_format(fmt).qmax


def test_a_target_that_runs_no_quantized_cache_needs_a_format(tmp_path):

    folder = save_genai_folder(tmp_path / "dml", num_layers=1, vocab_size=300, dtype="float16")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["provider_options"] = [{"dml": {}}]
    (folder / "genai_config.json").write_text(json.dumps(config))
    ids = [list(range(64))]
    with pytest.raises(
        KvCacheError, match=r"target, dml \(genai_config.json's provider_options.*format='int8'"
    ):
        calibrate_kv_cache(folder, ids, progress=False, min_tokens=64)
    scales = calibrate_kv_cache(folder, ids, format="int8", progress=False, min_tokens=64)
    assert scales.format == "int8" and "format_for" not in scales.metadata


def test_the_default_window_fits_a_context_shorter_than_it():
    """A genai folder of context 256 was refused by calibrate's own default (--seq-len 512,
    "give at most 256"); the default now shortens to the context, a given length is checked."""
    short = build_decoder(num_layers=2, vocab_size=300, max_position=48)
    ids = [list(np.random.default_rng(4).integers(0, 300, 300))]
    scales = calibrate_kv_cache(short, ids, format="int8", progress=False)
    assert scales.metadata["seq_len"] == 48 and scales.metadata["tokens"] == 300
    with pytest.raises(
        KvCacheError, match=r"^seq_len=100 feeds 100 positions, .* give at most seq_len=48\.$"
    ):
        calibrate_kv_cache(short, ids, format="int8", seq_len=100, progress=False)


def test_granularity_none_is_the_default_as_elsewhere(model, data):
    """optimize_model, convert_model and the pass take granularity=None; calibration too."""
    default = calibrate_kv_cache(model, data, format="int8", method="minmax", progress=False)
    none = calibrate_kv_cache(model, data, format="int8", method="minmax", granularity=None, progress=False)
    assert none.granularity == default.granularity == "per_tensor"
    np.testing.assert_array_equal(none.k[0], default.k[0])


def test_a_model_without_a_cache_is_said_to_have_none():
    """Issue 45 row 7: not a word about targets and formats."""
    from onnx_kvcache.models.decoder import build_decoder as bundled

    model = bundled(num_layers=2, no_cache_layers=(0, 1))
    with pytest.raises(KvCacheError, match=r"^The model has no KV cache .*: nothing to calibrate\.$"):
        calibrate_kv_cache(model, [[1, 2, 3] * 30], progress=False)
