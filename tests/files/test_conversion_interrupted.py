"""Conversions stopped by SIGINT, SIGTERM or SIGKILL at random moments: no partial output, the
original intact."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_kvcache import convert_model
from onnx_kvcache.model_io import _atomic as file_io
from onnx_kvcache.model_io._atomic import TEMP_PREFIX
from onnx_kvcache.models.decoder import build_decoder

from conversion_cases import (
    MiB,
    genai,
    umask022,  # noqa: F401  (an autouse fixture)
    unit_scales,
)

# -- kill tests: SIGINT, SIGTERM, SIGKILL at random moments ----------------------------

KILLS = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]


def _start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "onnx_kvcache", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _kill_at_random(proc: subprocess.Popen, watch: pathlib.Path, delay: float, after_temp: bool) -> tuple:
    """Send the signal ``delay`` s after start, or after a temporary entry appears in ``watch``."""
    start = time.monotonic()
    if after_temp:
        while proc.poll() is None and time.monotonic() - start < 60:
            if any(n.startswith(TEMP_PREFIX) for n in os.listdir(watch)):
                break
            time.sleep(0.002)
    time.sleep(delay)
    return proc


def _moment(rng: random.Random, i: int) -> dict:
    """Trial 0: as soon as the first temporary entry appears (so that one trial is always
    stopped mid-write, however fast the machine); trial 1: at a random moment after it;
    trial 2: at a random moment from start."""
    if i == 2:
        return {"after_temp": False, "delay": rng.uniform(0.5, 2.0)}
    return {"after_temp": True, "delay": 0.0 if i == 0 else rng.uniform(0.0, 0.6)}


def _run_trials(trials, signum):
    """Start every trial at once; each is signalled by its own thread; (rc, stderr) per trial."""
    procs = [_start(*t["argv"], env=t.get("env")) for t in trials]

    def one(i):
        t = trials[i]
        _kill_at_random(procs[i], t["watch"], t["delay"], t["after_temp"])
        if procs[i].poll() is None:
            procs[i].send_signal(signum)
        _, err = procs[i].communicate(timeout=120)
        return procs[i].returncode, err

    with concurrent.futures.ThreadPoolExecutor(len(trials)) as pool:
        return list(pool.map(one, range(len(trials))))


def _check_exit(signum, rc, err) -> bool:
    """The exit of a signalled run; True when the signal stopped it."""
    if rc == 0:
        return False
    if signum == signal.SIGKILL:
        assert rc == -9
    elif rc == 128 + signum:  # our handler: cleanup ran, one line
        assert err.count("\n") == 1 and f"stopped by {signal.Signals(signum).name}" in err, err
    else:  # arrived before the handlers were installed (interpreter start): nothing written yet
        assert rc in (-signum, 1), (rc, err)
    return True


@pytest.fixture(scope="module")
def big_genai(tmp_path_factory):
    """A genai folder whose data file holds 256 MiB (random bytes after the weights)."""
    folder = genai(tmp_path_factory.mktemp("big") / "g")
    rng = np.random.default_rng(0)
    with open(folder / "model.onnx.data", "ab") as f:
        for _ in range(8):
            f.write(rng.bytes(32 * MiB))
    unit_scales(folder.parent)
    return folder, {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


@pytest.mark.parametrize("signum", KILLS, ids=lambda s: signal.Signals(s).name)
def test_a_killed_folder_conversion_leaves_no_partial_output(big_genai, tmp_path, signum):
    src, hashes = big_genai
    stats = {p: file_io.file_identity(p) for p in src.iterdir()}
    rng = random.Random(f"folder-{signum}")
    trials = []
    for i in range(3):
        parent = tmp_path / f"t{i}"
        parent.mkdir()
        argv = ["convert", str(src), str(parent / "out"), "--format", "int8", "--scales"]
        trials.append(
            {
                "argv": [*argv, str(src.parent / "scales.json"), "--overwrite"],
                "env": {file_io.PLAIN_COPY_ENV: "1"},  # a real byte copy, not a clone
                "watch": parent,
                **_moment(rng, i),
            }
        )
    results = _run_trials(trials, signum)
    stopped = 0
    for trial, (rc, err) in zip(trials, results):
        stopped += _check_exit(signum, rc, err)
        parent, out = trial["watch"], trial["watch"] / "out"
        assert {p: file_io.file_identity(p) for p in src.iterdir()} == stats  # the input untouched
        if out.exists():  # complete, or not there at all
            _assert_complete_folder(src, out)
        assert [p.name for p in parent.iterdir() if p.name != "out"] == [] or signum == signal.SIGKILL
        convert_model(src, out, format="int8", scales=src.parent / "scales.json", overwrite=True)  # next run
        assert os.listdir(parent) == ["out"]  # no temporary entry left
        _assert_complete_folder(src, out)
    assert stopped >= 1
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in src.iterdir()} == hashes


def _assert_complete_folder(src: pathlib.Path, out: pathlib.Path) -> None:
    assert sorted(os.listdir(out)) == sorted(os.listdir(src))
    assert (out / "model.onnx.data").stat().st_size == (src / "model.onnx.data").stat().st_size
    assert ir.load(out / "model.onnx").graph.inputs[2].dtype == ir.DataType.INT8
    onnx.load(out / "model.onnx")  # with its data
    assert json.loads((out / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is True


@pytest.fixture(scope="module")
def big_inline_genai(tmp_path_factory):
    """A genai folder whose graph itself is ~64 MiB (weights inline), so writing it takes time."""
    folder = genai(tmp_path_factory.mktemp("biginline") / "g")  # share_buffer true: the config changes
    model = build_decoder(num_layers=2, vocab_size=300)
    pad = np.random.default_rng(1).standard_normal(16 * MiB, np.float32)
    value = ir.Value(name="padding", const_value=ir.tensor(pad, name="padding"))
    model.graph.register_initializer(value)
    (folder / "model.onnx.data").unlink()
    ir.save(model, folder / "model.onnx")
    unit_scales(folder.parent)
    return folder


@pytest.mark.parametrize("signum", KILLS, ids=lambda s: signal.Signals(s).name)
def test_a_killed_in_place_conversion_leaves_the_old_or_the_new_model(big_inline_genai, tmp_path, signum):
    rng = random.Random(f"in-place-{signum}")
    old_config = (big_inline_genai / "genai_config.json").read_bytes()
    old_graph = hashlib.sha256((big_inline_genai / "model.onnx").read_bytes()).hexdigest()
    trials = []
    for i in range(3):
        folder = tmp_path / f"t{i}" / "g"
        shutil.copytree(big_inline_genai, folder)
        trials.append(
            {
                "argv": [
                    "convert",
                    str(folder),
                    "--in-place",
                    "--format",
                    "int8",
                    "--scales",
                    str(big_inline_genai.parent / "scales.json"),
                ],
                "watch": folder,
                **_moment(rng, i),
            }
        )
    results = _run_trials(trials, signum)
    stopped = 0
    for trial, (rc, err) in zip(trials, results):
        stopped += _check_exit(signum, rc, err)
        folder = trial["watch"]
        config = json.loads((folder / "genai_config.json").read_text())
        name = config["model"]["decoder"]["filename"]
        if name == "model.onnx":  # fully old: the original bytes
            assert (folder / "genai_config.json").read_bytes() == old_config
            assert hashlib.sha256((folder / "model.onnx").read_bytes()).hexdigest() == old_graph
            assert not (folder / "model.int8.onnx").exists() or signum == signal.SIGKILL
        else:  # fully new, as onnxruntime-genai would load it
            assert name == "model.int8.onnx" and config["search"]["past_present_share_buffer"] is True
            assert ir.load(folder / name).graph.inputs[2].dtype == ir.DataType.INT8
        if signum != signal.SIGKILL:
            assert not [n for n in os.listdir(folder) if n.startswith(TEMP_PREFIX)]
        convert_model(folder, in_place=True, format="int8", scales=big_inline_genai.parent / "scales.json")
        assert sorted(os.listdir(folder)) == [
            "genai_config.json",
            "model.int8.onnx",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    assert stopped >= 1
