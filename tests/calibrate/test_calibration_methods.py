"""The caches-only run (bit-identical scales), the attention method, scale files genai reads."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import onnx_ir as ir
import pytest
from calibration_cases import HEAD, KV, LAYERS, data, model  # noqa: F401  (fixtures)

import onnx_kvcache.calibrate.calibration as calibration_module
from onnx_kvcache import KvCacheQuantizationPass, calibrate_kv_cache, load_kv_cache_scale_file
from onnx_kvcache.cache.formats import SCALE_GRANULARITIES, get_format
from onnx_kvcache.calibrate.calibration import METHODS, rope_pair_norm
from onnx_kvcache.cli.commands import main
from onnx_kvcache.model_io._sessions import create_session
from onnx_kvcache.models.decoder import save_genai_folder
from onnx_kvcache.runtime.evaluation import kl_divergence

from builders.exported import build_decoder, exported_config

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


@pytest.mark.parametrize(
    ("fmt", "rotation", "method"),
    [
        ("int4", None, "mse"),  # int4 rotates keys and values by default
        ("int4", "keys", "mse"),
        ("int4", "none", "attention"),
        ("int8", None, "minmax"),
        ("int8", "keys_and_values", "minmax"),
        ("fp8", None, "minmax"),
    ],
)
def test_default_method_per_format_and_rotation(model, data, fmt, rotation, method):
    """The method by DEFAULT_METHODS' measured rows (docs/rotation.md): the rotation decides it."""
    scales = calibrate_kv_cache(model, data, format=fmt, rotation=rotation, progress=False)
    assert (scales.metadata["method"], scales.metadata["rotation"]) == (
        method,
        rotation or ("keys_and_values" if fmt == "int4" else "none"),
    )


def test_default_method_of_an_unrotatable_int4_cache_is_attention(data):
    """PagedAttention is not rotated, so its int4 default is the unrotated one (queries captured)."""
    paged = build_decoder(num_layers=LAYERS, vocab_size=300, paged=True)
    scales = calibrate_kv_cache(paged, data, format="int4", granularity="per_channel", progress=False)
    assert (scales.metadata["method"], scales.metadata["rotation"]) == ("attention", "none")


def test_attention_weights_match_the_nodes_attention(data):
    """The probabilities behind the weights are the node's own: its output is rebuilt from
    them and the present V to float32 rounding (rotary, both layouts)."""
    from onnx_kvcache import KvCacheRunner
    from onnx_kvcache.cache.sites import find_attention_sites
    from onnx_kvcache.calibrate.calibration import _rope, _rope_tables

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
    from onnx_kvcache.calibrate.calibration import _rope_tables, _rotated_anywhere

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
    assert ours.metadata == {"method": "minmax", "rotation": "none"}
    doc = load_scale_data(out, "model")
    assert doc["scales"]["k_scales"] == json.loads(out.read_text())["scales"]["k_scales"]
    size = ours.k[0].size
    made = builder(out, "model", LAYERS, size)
    np.testing.assert_array_equal(made["k1"].reshape(-1), ours.k[1])
    np.testing.assert_array_equal(made["v0"].reshape(-1), ours.v[0])
