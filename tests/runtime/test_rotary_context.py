"""The context of builds whose RoPE tables are gathered by position (ONNX RotaryEmbedding fed a
``Gather`` of a constant cos/sin table, mobius's default and static builds): the runner,
calibrate and evaluate keep within the table's rows instead of failing inside onnxruntime."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheRunner, calibrate_kv_cache, evaluate_kv_cache
from onnx_kvcache.cli.commands import main
from onnx_kvcache.runtime import max_positions
from onnx_kvcache.runtime._decoder_session import DecoderSession

MOBIUS = pathlib.Path(__file__).parents[1] / "data" / "producers" / "mobius"
DEFAULT = sorted((MOBIUS / "mobius-default").glob("*/model.onnx"))
STATIC = sorted((MOBIUS / "mobius-static").glob("*/model.onnx"))
TABLE = 256  # the rows of these builds' cos/sin tables
ROWS = 64  # a static build's buffer rows


def _name(path: pathlib.Path) -> str:
    return f"{path.parent.parent.name}/{path.parent.name}"


def _ids(count: int, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(1, 128, count)]


@pytest.fixture
def runs(monkeypatch):
    """Every onnxruntime run of a runner's session, counted."""
    counted: list[int] = []
    run = DecoderSession.run

    def counting(self, *args, **kwargs):
        counted.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(DecoderSession, "run", counting)
    return counted


def test_every_build_is_here():
    assert len(DEFAULT) == 13 and len(STATIC) == 5


@pytest.mark.parametrize("path", DEFAULT + STATIC, ids=_name)
def test_the_gathered_rotary_table_is_the_context(path):
    assert max_positions(ir.load(path)) == TABLE


@pytest.mark.parametrize("path", DEFAULT + STATIC, ids=_name)
def test_the_runner_refuses_past_the_context_before_running(path, runs):
    limit = ROWS if path in STATIC else TABLE
    runner = KvCacheRunner(path)
    assert runner.max_positions == limit
    runner.prefill(_ids(limit))  # the whole context runs
    assert len(runs) == 1
    with pytest.raises(KvCacheError):
        runner.step(1)
    with pytest.raises(KvCacheError):
        runner.generate(_ids(limit - 10), 12)
    assert len(runs) == 1 and runner.length == limit
    assert len(runner.generate(_ids(limit - 10), 11, eos_token_id=None)) == 11


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_calibrate_by_default_fits_the_table(tmp_path, family):
    """The default window (512 tokens, or the model's context when shorter) is the table's 256."""
    path = MOBIUS / "mobius-default" / family / "model.onnx"
    data = [_ids(600, seed) for seed in range(2)]
    scales = calibrate_kv_cache(path, data, format="int4", progress=False, min_tokens=0)
    assert sorted(scales.layer_ids) == [0, 1]
    assert scales.metadata["seq_len"] == TABLE and scales.metadata["tokens"] == 2 * 600


def test_evaluate_by_default_fits_the_table():
    """The default window (256 tokens: 255 positions) and new tokens fit; a float model against
    itself loses nothing."""
    path = MOBIUS / "mobius-default" / "gpt_oss" / "model.onnx"
    report = evaluate_kv_cache(path, path, [_ids(600)], num_seqs=1, progress=False)
    assert report.tokens > 0 and report.kl_max < 1e-6 and report.greedy_match_share == 1.0


def test_the_command_calibrates_a_default_build(tmp_path):
    out = tmp_path / "x.json"
    args = ["calibrate", str(DEFAULT[0]), "--out", str(out), "--format", "int4", "--no-progress"]
    assert main([*args, "--num-seqs", "2"]) == 0
    assert out.is_file()


@pytest.mark.parametrize("path", DEFAULT + STATIC, ids=_name)
def test_longer_windows_are_refused_before_running(path, runs):
    limit = ROWS if path in STATIC else TABLE
    data = [_ids(2 * TABLE)]
    with pytest.raises(KvCacheError):
        calibrate_kv_cache(path, data, format="int8", seq_len=limit + 1, progress=False, min_tokens=0)
    with pytest.raises(KvCacheError):
        evaluate_kv_cache(path, path, data, seq_len=limit + 2, num_seqs=1, progress=False)
    assert not runs
