"""calibrate_kv_cache(rope_positions=N): the envelope's K search assumes contexts of N positions."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx_ir as ir
import pytest
from calibration_cases import data, model  # noqa: F401  (fixtures)

import onnx_kvcache.calibrate.calibration as calibration_module
from onnx_kvcache import KvCacheError, calibrate_kv_cache, load_kv_cache_scale_file
from onnx_kvcache.cli.commands import main


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_positions_bounds_where_the_search_moves_keys(interleaved):
    """``rope_positions=1`` moves every key to position 0: its values before RoPE."""
    rng = np.random.default_rng(2)
    length, kv, head = 6, 2, 8
    angles = np.arange(16)[:, None] * rng.uniform(0.1, 1.0, head // 2)[None]
    tables = (np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
    raw = rng.normal(size=(length, kv, head)).astype(np.float32)
    stored = calibration_module._rope(raw, tables[0][:length], tables[1][:length], interleaved)
    moved = calibration_module._rotated_anywhere(
        stored.transpose(1, 0, 2), tables, interleaved, np.random.default_rng(0), 1
    )
    np.testing.assert_allclose(moved, np.abs(raw).transpose(1, 0, 2), atol=1e-5)
    anywhere = calibration_module._rotated_anywhere(
        stored.transpose(1, 0, 2), tables, interleaved, np.random.default_rng(0)
    )
    assert not np.allclose(anywhere, np.abs(raw).transpose(1, 0, 2), atol=1e-3)


@pytest.mark.parametrize(
    "settings",
    [
        dict(method="attention"),
        dict(method="mse", rotation="keys_and_values"),  # int4's default: a rotated key is sampled moved
        dict(rotation="keys"),
    ],
)
def test_rope_positions_is_recorded_and_moves_only_k(model, data, settings):
    kwargs = dict(format="int4", granularity="per_channel", progress=False, min_tokens=0, **settings)
    scales = calibrate_kv_cache(model, data, rope_positions=64, **kwargs)
    default = calibrate_kv_cache(model, data, **kwargs)
    assert scales.metadata["rope_positions"] == 64
    assert "rope_positions" not in default.metadata  # recorded only when given
    layer = scales.layer_ids[0]
    assert not np.array_equal(scales.for_layer(layer)[0], default.for_layer(layer)[0])
    np.testing.assert_array_equal(scales.for_layer(layer)[1], default.for_layer(layer)[1])


@pytest.mark.parametrize("positions", [0, -3])
def test_rope_positions_below_one_is_refused(model, data, positions):
    with pytest.raises(KvCacheError, match="rope_positions must be >= 1"):
        calibrate_kv_cache(model, data, format="int4", rope_positions=positions, progress=False, min_tokens=0)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        (dict(format="int8"), "method='minmax' of an unrotated cache never reads it"),  # int8's default
        (
            dict(format="int4", method="mse", rotation="none"),
            "method='mse' of an unrotated cache never reads it",
        ),
        (dict(format="int4", rope_envelope=False), "the RoPE envelope is off (rope_envelope=False)"),
    ],
)
def test_rope_positions_that_change_nothing_are_refused(model, data, kwargs, said):
    """Issue 37: with the default method the scales were the same for 2, 64 and 100000, yet the
    file recorded the value and convert warned of keys clipped past it."""
    with pytest.raises(KvCacheError, match=re.escape(said)):
        calibrate_kv_cache(model, data, rope_positions=64, progress=False, min_tokens=0, **kwargs)


def test_cli_rope_positions_reaches_the_scales(tmp_path, model, data):
    path = tmp_path / "model.onnx"
    ir.save(model, path)
    (tmp_path / "ids.json").write_text(json.dumps([[int(x) for x in s] for s in data]))
    out = tmp_path / "scales.json"
    args = ["calibrate", str(path), "--out", str(out), "--token-ids", str(tmp_path / "ids.json")]
    assert main([*args, "--format", "int4", "--rope-positions", "64", "--min-tokens", "0"]) == 0
    saved = json.loads(out.read_text())
    expected = calibrate_kv_cache(model, data, format="int4", rope_positions=64, progress=False, min_tokens=0)
    layer = expected.layer_ids[0]
    np.testing.assert_allclose(
        load_kv_cache_scale_file(out, format="int4").for_layer(layer)[0], expected.for_layer(layer)[0]
    )
    assert "rope_positions" in json.dumps(saved)


def test_the_help_and_docs_say_a_rotated_cache_reads_rope_positions_with_any_method(capsys):
    import pathlib

    from onnx_kvcache.cli.commands import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["calibrate", "--help"])
    assert "a rotated cache's keys (any method)" in " ".join(capsys.readouterr().out.split())
    doc = " ".join((pathlib.Path(__file__).parents[2] / "docs/calibration.md").read_text().split())
    assert "A rotated cache ([rotation.md](rotation.md)) reads it with every method" in doc


def test_rope_positions_past_the_rotary_table_is_refused(model, data):
    """Keys cannot move past the table: the scales would be the whole table's, recording more."""
    from onnx_kvcache import KvCacheRunner

    table = KvCacheRunner(model).max_positions
    assert table is not None
    kwargs = dict(format="int4", granularity="per_channel", progress=False, min_tokens=0)
    with pytest.raises(
        KvCacheError, match=re.escape(f"rope_positions={table + 1} is past the model's rotary")
    ):
        calibrate_kv_cache(model, data, rope_positions=table + 1, **kwargs)
    assert calibrate_kv_cache(model, data, rope_positions=table, **kwargs).metadata["rope_positions"] == table
