"""calibrate_kv_cache: thresholds as defined, envelope, data sources, files, accuracy."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import onnx_ir as ir
import pytest

import onnx_kvcache.scales.calibration as calibration_module
from onnx_kvcache import (
    DecoderConfig,
    KvCacheError,
    KvCacheQuantizationPass,
    KvCacheWarning,
    build_decoder,
    calibrate_kv_cache,
    load_kv_cache_scale_file,
)
from onnx_kvcache.cache.formats import SCALE_GRANULARITIES, get_format
from onnx_kvcache.cli.commands import main
from onnx_kvcache.models.decoder import byte_level_tokenizer, save_genai_folder
from onnx_kvcache.models.exported import exported_config
from onnx_kvcache.runtime._sessions import create_session
from onnx_kvcache.runtime.evaluation import evaluate_kv_cache, kl_divergence
from onnx_kvcache.scales.calibration import METHODS, _Reservoir, _thresholds, rope_pair_norm

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


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_minmax_is_amax_over_qmax(model, data, fmt, granularity):
    scales = calibrate_kv_cache(
        model, data, format=fmt, granularity=granularity, method="minmax", rope_envelope=False, progress=False
    )
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


def test_token_id_files_and_cli(tmp_path, model, data, capsys):
    path = tmp_path / "model.onnx"
    ir.save(model, path)
    (tmp_path / "ids.json").write_text(json.dumps([[int(x) for x in s] for s in data]))
    np.save(tmp_path / "ids.npy", np.asarray(data[0], np.int64))
    for ids in ("ids.json", "ids.npy"):
        out = tmp_path / f"{ids}.scales.json"
        assert (
            main(
                [
                    "calibrate",
                    str(path),
                    "--out",
                    str(out),
                    "--token-ids",
                    str(tmp_path / ids),
                    "--format",
                    "int8",
                    "--seq-len",
                    "16",
                ]
            )
            == 0
        )
        assert load_kv_cache_scale_file(out).layer_ids == (0, 1)
    assert "k clip" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text('{"not": "ids"}')
    assert (
        main(
            [
                "calibrate",
                str(path),
                "--out",
                str(tmp_path / "x.json"),
                "--token-ids",
                str(tmp_path / "bad.json"),
            ]
        )
        == 2
    )
    assert not (tmp_path / "x.json").exists()


def test_text_with_a_tokenizer(tmp_path, model):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(299)} | {"[UNK]": 299}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text.txt").write_text(" ".join(f"w{i % 50}" for i in range(300)))
    scales = calibrate_kv_cache(
        model, tmp_path / "text.txt", tokenizer=tmp_path / "tokenizer.json", progress=False
    )
    assert scales.metadata["tokens"] == 300
    assert scales.metadata["data"] == f"text from text.txt, tokenizer {tmp_path / 'tokenizer.json'}"


def test_builtin_corpus_through_the_folders_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from onnx_kvcache.models.decoder import save_genai_folder
    from onnx_kvcache.scales.data import corpus_byte_ids

    folder = save_genai_folder(tmp_path / "demo", num_layers=2)
    scales = calibrate_kv_cache(folder, format="int8", progress=False)
    assert scales.metadata["tokens"] == len(corpus_byte_ids())  # the byte-level tokenizer's ids


def test_without_a_tokenizer_random_tokens_warn_and_are_recorded(model):
    with pytest.warns(KvCacheWarning, match="No tokenizer found: calibrating on seeded random token ids"):
        scales = calibrate_kv_cache(model, format="int8", seq_len=32, progress=False)
    assert scales.metadata["tokens"] == 8 * 32
    assert scales.metadata["data"] == "seeded random token ids (no tokenizer)"


@pytest.mark.parametrize(
    ("data", "kwargs", "message"),
    [
        ([[1, 2, 3]], {}, r"has 3 token\(s\) \(given token ids\); scales need at least 256"),
        (None, {"num_seqs": 0}, "num_seqs must be >= 1"),
        (None, {"num_seqs": -1}, "num_seqs must be >= 1"),
        ("empty.txt", {}, "holds no tokens"),
    ],
)
def test_too_little_data_is_an_error(tmp_path, model, data, kwargs, message):
    pytest.importorskip("tokenizers")
    if data == "empty.txt":
        (tmp_path / "empty.txt").write_text("")
        (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer()))
        kwargs["tokenizer"] = tmp_path / "tokenizer.json"
        data = tmp_path / "empty.txt"
    with pytest.raises(KvCacheError, match=message):
        calibrate_kv_cache(model, data, progress=False, **kwargs)


def test_text_without_a_tokenizer_is_an_error(tmp_path, model):
    (tmp_path / "t.txt").write_text("some text")
    with pytest.raises(KvCacheError, match="needs a tokenizer"):
        calibrate_kv_cache(model, tmp_path / "t.txt", progress=False)


def test_a_margin_that_breaks_the_scales_is_caught(model, data):
    with pytest.raises(KvCacheError, match=r"overflow float32.*use a margin near 1"):
        calibrate_kv_cache(model, data, format="int8", margin=1e300, progress=False)
    with pytest.warns(KvCacheWarning, match=r"clip 100.0% of layer .* beyond .* check margin=1e-50"):
        calibrate_kv_cache(model, data, format="int8", margin=1e-50, progress=False)


def test_a_tokenizer_file_that_is_not_one_is_an_error(tmp_path, model):
    pytest.importorskip("tokenizers")
    (tmp_path / "notes.txt").write_text("plain words")
    with pytest.raises(KvCacheError, match=r"is not a tokenizers tokenizer\.json"):
        calibrate_kv_cache(model, tmp_path / "notes.txt", tokenizer=tmp_path / "notes.txt", progress=False)


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
    scales = calibrate_kv_cache(
        model, data, format=fmt, granularity=granularity, method="minmax", rope_envelope=False, progress=False
    )
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
    scales = calibrate_kv_cache(model, data, format=fmt, method="minmax", progress=False)
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
    from onnx_kvcache.scales.calibration import format_calibration_summary

    text = format_calibration_summary(calibrate_kv_cache(model, data, format="int8", progress=False).stats)
    legend = text.splitlines()[-1]
    assert "127/128" in legend and "7/8" in legend and "onnxruntime-genai" in legend and len(legend) <= 100


def test_envelope_covers_rotary_applied_outside_gqa(data):
    """Fused exports keep RotaryEmbedding in front of GQA (do_rotary=0): K is rotated all the same."""
    from onnx_kvcache.models.exported import exported_config
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
    from onnx_kvcache.models.decoder import save_genai_folder

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


SMALL = {"num_layers": LAYERS, "vocab_size": 300}
PRUNED_DECODERS = {
    "in_memory": lambda tmp: build_decoder(**SMALL),
    "genai_folder_external_data": lambda tmp: save_genai_folder(tmp / "genai", **SMALL),
    "sliding_window_cache": lambda tmp: build_decoder(
        **SMALL, sliding_window_layers=(1,), sliding_window=16, sliding_window_cache=True
    ),
    "no_cache_layer": lambda tmp: build_decoder(**SMALL, no_cache_layers=(0,)),
    "paged": lambda tmp: build_decoder(**SMALL, paged=True),
    "fp16_fused_qk_norm": lambda tmp: build_decoder(**SMALL, dtype="float16", qk_norm=True),
    "bfloat16": lambda tmp: build_decoder(**SMALL, dtype="bfloat16"),
    "export_file_fused_in_memory": lambda tmp: _saved(
        build_decoder(exported_config("llama", **SMALL)), tmp / "export" / "model.onnx"
    ),
}
SETTINGS = [
    (fmt, granularity, method)
    for fmt in ("fp8", "int8", "int4")
    for granularity in SCALE_GRANULARITIES
    for method in METHODS
    if not (calibration_module.CALIBRATION_METHODS[method].clip_search and get_format(fmt).is_float)
]


def _saved(model, path):
    path.parent.mkdir()
    ir.save(model, path, external_data=path.name + ".data")
    return path


def _calibrate_all(model, data):
    """Every format x granularity x method: {setting: (k, v, thresholds and clips per layer)}."""
    out = {}
    for fmt, granularity, method in SETTINGS:
        scales = calibrate_kv_cache(
            model, data, format=fmt, granularity=granularity, method=method, progress=False, min_tokens=0
        )
        out[fmt, granularity, method] = [
            (s.layer_id, s.k_scale, s.v_scale, s.k_threshold, s.v_threshold, s.k_clip, s.v_clip)
            for s in scales.stats
        ]
    return out


@pytest.mark.parametrize("name", PRUNED_DECODERS)
def test_the_caches_only_run_gives_the_full_graphs_scales_bit_for_bit(tmp_path, monkeypatch, name):
    """Calibration runs the graph pruned to its present outputs, windows of one length
    batched; every method, format and granularity yields exactly the scales (and thresholds,
    clip fractions) of the whole graph run one window at a time."""
    rng = np.random.default_rng(5)
    data = [list(rng.integers(0, 300, n)) for n in (128, 128, 128, 100, 128, 64)]  # runs of 3, 1, 1, 1
    assert [len(r) for r in calibration_module._runs(data, calibration_module.TOKENS_PER_RUN)] == [3, 1, 1, 1]
    model = PRUNED_DECODERS[name](tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # external data resolves from the model's folder, not the cwd
    runners = []
    real = calibration_module.KvCacheRunner

    def spy(model, providers, caches_only=False, **options):
        runners.append(real(model, providers, caches_only=caches_only, **options))
        return runners[-1]

    monkeypatch.setattr(calibration_module, "KvCacheRunner", spy)
    pruned = _calibrate_all(model, data)
    assert runners and all(
        r.caches_only and r.logits_name not in {o.name for o in r.session.get_outputs()} for r in runners
    )
    monkeypatch.setattr(
        calibration_module,
        "KvCacheRunner",
        lambda model, providers, caches_only, **options: real(model, providers, **options),
    )
    monkeypatch.setattr(calibration_module, "TOKENS_PER_RUN", 1)  # one window a run
    full = _calibrate_all(model, data)
    assert pruned.keys() == full.keys()
    for setting, layers in full.items():
        assert len(pruned[setting]) == len(layers) > 0, setting
        for got, want in zip(pruned[setting], layers):
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} {setting}")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_attention_method_weighs_rows_by_the_attention_they_get(model, data, fmt, granularity):
    """Scales of the right shape, no larger than minmax's, recorded as the method; the
    weights kept beside the samples are positive and, for V, the same across a head."""
    scales = calibrate_kv_cache(
        model, data, format=fmt, granularity=granularity, method="attention", progress=False
    )
    minmax = calibrate_kv_cache(
        model, data, format=fmt, granularity=granularity, method="minmax", progress=False
    )
    assert scales.metadata["method"] == "attention"
    for layer in minmax.layer_ids:
        for ours, ref in zip(scales.for_layer(layer), minmax.for_layer(layer)):
            assert ours.shape == ref.shape and np.all(ours > 0) and np.all(ours <= ref * (1 + 1e-6))


@pytest.mark.parametrize(("fmt", "method"), [("int4", "attention"), ("int8", "minmax"), ("fp8", "minmax")])
def test_default_method_per_format(model, data, fmt, method):
    assert calibrate_kv_cache(model, data, format=fmt, progress=False).metadata["method"] == method


def test_attention_weights_match_the_nodes_attention(data):
    """The probabilities behind the weights are the node's own: its output is rebuilt from
    them and the present V to float32 rounding (rotary, both layouts)."""
    from onnx_kvcache import KvCacheRunner
    from onnx_kvcache.cache.sites import find_attention_sites
    from onnx_kvcache.scales.calibration import _rope, _rope_tables

    for interleaved in (False, True):
        m = build_decoder(num_layers=LAYERS, vocab_size=300, rotary_interleaved=interleaved)
        sites = {s.layer_id: s for s in find_attention_sites(m)}
        runner = KvCacheRunner(m, capture_queries=True)
        ids = np.asarray(data[0][:40], np.int64)[None]
        runner.forward(ids)
        outputs = [s.node.outputs[0] for s in sites.values()]
        m.graph.outputs.extend(outputs)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for i in sites:
            for kind in ("key", "value"):
                feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, KV, 0, HEAD), np.float32)
        expected = create_session(m).run([o.name for o in outputs], feeds)
        for layer, site in sites.items():
            q = _rope(runner.query(layer)[0][0], *_rope_tables(site, 40), interleaved)
            k, v = runner.cache_values(layer, "key")[0], runner.cache_values(layer, "value")[0]
            group = q.shape[1] // KV
            scores = np.einsum("shd,htd->hst", q, np.repeat(k, group, axis=0)) / np.sqrt(HEAD)
            scores[:, np.triu(np.ones((40, 40), bool), 1)] = -np.inf
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out = np.einsum("hst,htd->shd", p, np.repeat(v, group, axis=0)).reshape(40, -1)
            np.testing.assert_allclose(out, expected[layer][0], atol=1e-5)


def test_attention_beats_mse_where_channels_matter_unequally():
    """int4 per tensor on the bundled decoder (outlier K channels): mse weighs every channel's
    error alike, attention by the query energy that turns it into score error. Measured: the
    teacher-forced KL to the float cache on held-out text is lower with attention's scales."""
    from onnx_kvcache import KvCacheRunner
    from onnx_kvcache.scales.data import corpus_byte_ids

    ids = corpus_byte_ids()
    calibration = [ids[i * 256 : (i + 1) * 256] for i in range(6)]
    held_out = [ids[2000 + i * 256 : 2000 + (i + 1) * 256] for i in range(4)]

    def logits(m: ir.Model) -> np.ndarray:
        runner = KvCacheRunner(m)
        out = []
        for w in held_out:
            runner.reset(1)
            chunks = [runner.forward(np.asarray(w[i : i + 32])[None])[0] for i in range(0, 256, 32)]
            out.append(np.concatenate(chunks)[32:])  # each chunk attends over the quantized cache
        return np.concatenate(out)

    base = build_decoder()
    reference = logits(base)
    kl = {}
    for method in ("mse", "attention"):
        scales = calibrate_kv_cache(base, calibration, format="int4", method=method, progress=False)
        converted = build_decoder()
        KvCacheQuantizationPass("int4", "per_tensor", scales)(converted)
        kl[method] = float(kl_divergence(reference, logits(converted)).mean())
    assert kl["attention"] < kl["mse"], kl


@pytest.mark.parametrize("interleaved", [False, True])
def test_keys_rotated_anywhere_keep_their_envelope(interleaved):
    """attention's K samples: the window's keys moved to random positions of the rotary table.
    Rotation keeps every pair's norm, so the envelope (what the scales must hold) is unchanged
    while the values themselves move."""
    from onnx_kvcache.cache.sites import find_attention_sites
    from onnx_kvcache.scales.calibration import _rope_tables, _rotated_anywhere

    site = find_attention_sites(build_decoder(num_layers=1, rotary_interleaved=interleaved))[0]
    tables = _rope_tables(site)
    assert tables is not None and tables[0].shape == (4096, HEAD // 2)
    x = np.random.default_rng(0).standard_normal((KV, 64, HEAD)).astype(np.float32)
    moved = _rotated_anywhere(x, tables, interleaved, np.random.default_rng(1))
    envelope = rope_pair_norm(x, interleaved=interleaved)
    np.testing.assert_allclose(rope_pair_norm(moved, interleaved=interleaved), envelope, rtol=1e-4, atol=1e-5)
    assert np.all(moved <= envelope * (1 + 1e-4) + 1e-5) and not np.allclose(moved, np.abs(x), atol=1e-2)


def _genai_scale_readers():
    """onnxruntime-genai's two readers of a scale file, run from its installed source: the
    model builder's ``Model.make_kv_cache_scale_initializers`` (its module imports torch, so
    the method's own code is compiled alone) and ``KVCacheVariant.load_scale_data``."""
    import ast
    import importlib
    import os
    import sys
    import types

    import onnxruntime_genai.models as models

    folder = os.path.dirname(models.__file__)
    source = pathlib.Path(folder, "builders", "base.py").read_text(encoding="utf-8")
    method = next(
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.name == "make_kv_cache_scale_initializers"
    )
    namespace: dict = {"json": json, "os": os, "np": np}
    exec(compile(ast.Module([method], []), "base.py", "exec"), namespace)

    def builder(path, stem: str, layers: int, size: int) -> dict:
        made: dict = {}
        fake = types.SimpleNamespace(
            kv_cache_attrs={"quant_mode": "PER_CHANNEL" if size > 1 else "PER_TENSOR", "scales_path": path},
            num_kv_heads=KV,
            head_size=size // KV if size > 1 else HEAD,
            filename=f"{stem}.onnx",
            num_layers=layers,
            use_paged_attention=False,
            input_names={"past_key_values.key": dict.fromkeys(range(layers))},
            get_kv_cache_calibration_factor=lambda qmax: 1.0 if qmax is None else qmax / 128.0,
            get_kv_cache_scale_names=lambda i: (f"k{i}", f"v{i}"),
            make_initializer=lambda array, name: made.__setitem__(name, array),
        )
        namespace["make_kv_cache_scale_initializers"](fake)
        return made

    sys.path.insert(0, folder)
    try:
        variant = importlib.import_module("kv_cache_variant").KVCacheVariant("int8_per_channel")
    finally:
        sys.path.remove(folder)
    return builder, variant.load_scale_data


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("given", ["folder", "file"])
def test_a_calibrated_scale_file_loads_in_genais_readers(tmp_path, model, granularity, given):
    """Its provenance names no top-level key genai reads as a model file's section: genai looks
    up the model file's stem ("model" for model.onnx), so a "model" key broke both readers."""
    pytest.importorskip("onnxruntime_genai")
    builder, load_scale_data = _genai_scale_readers()
    folder = tmp_path / "model"
    folder.mkdir()
    ir.save(model, folder / "model.onnx")
    out = tmp_path / "s.json"
    argv = ["calibrate", str(folder if given == "folder" else folder / "model.onnx"), "--out", str(out)]
    quick = ["--format", "int8", "--granularity", granularity, "--seq-len", "64", "--num-seqs", "4"]
    assert main([*argv, *quick, "--min-tokens", "64", "--no-progress"]) == 0
    ours = load_kv_cache_scale_file(out)
    assert ours.metadata == {"method": "minmax"}
    doc = load_scale_data(out, "model")
    assert doc["scales"]["k_scales"] == json.loads(out.read_text())["scales"]["k_scales"]
    size = ours.k[0].size
    made = builder(out, "model", LAYERS, size)
    np.testing.assert_array_equal(made["k1"].reshape(-1), ours.k[1])
    np.testing.assert_array_equal(made["v0"].reshape(-1), ours.v[0])


@pytest.mark.parametrize(("fmt", "noted"), [("fp8", False), ("int8", True), ("int4", True)])
def test_the_integer_rounding_note_is_printed_for_integer_formats_only(tmp_path, model, capsys, fmt, noted):
    ir.save(model, tmp_path / "model.onnx")
    argv = ["calibrate", str(tmp_path / "model.onnx"), "--out", str(tmp_path / "s.json"), "--format", fmt]
    assert main([*argv, "--seq-len", "64", "--num-seqs", "4", "--min-tokens", "64", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "k clip" in out and ("minmax clips int8/int4" in out) is noted


@pytest.mark.parametrize(
    ("kind", "message"),
    [("folder", "is a folder"), ("fifo", "is a FIFO"), ("dangling", "broken symbolic link")],
)
@pytest.mark.parametrize("argument", ["data", "tokenizer"])
def test_data_and_tokenizer_files_are_checked_before_the_model_loads(
    tmp_path, monkeypatch, kind, message, argument
):
    """A FIFO or folder given as the data or tokenizer cost the whole model load first."""
    path = tmp_path / "given.txt"
    if kind == "folder":
        path.mkdir()
        (path / "tokenizer.json").mkdir()  # a tokenizer folder whose tokenizer.json is a folder
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(tmp_path / "nowhere")

    def no_runner(*args, **kwargs):
        raise AssertionError("the model was loaded before the input files were checked")

    monkeypatch.setattr(calibration_module, "KvCacheRunner", no_runner)
    with pytest.raises(KvCacheError, match=message):
        calibrate_kv_cache(tmp_path / "model.onnx", **{argument: str(path)})


@pytest.mark.parametrize("margin", [float("inf"), float("nan")])
def test_a_non_finite_margin_is_refused(margin):
    with pytest.raises(KvCacheError, match="margin must be > 0 and finite"):
        calibrate_kv_cache("model.onnx", margin=margin)
