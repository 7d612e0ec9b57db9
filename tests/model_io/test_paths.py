"""Paths checked before any work: the folder an output is written in, a model file that is a
symbolic link (issue 45, rows 8 and 12)."""

from __future__ import annotations

import errno
import os
import tempfile

import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, convert_model, load_model
from onnx_kvcache.cli.commands import main
from onnx_kvcache.model_io import check_writable_folder
from onnx_kvcache.model_io._paths import PROBE_PREFIX
from onnx_kvcache.models.decoder import build_decoder


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("paths") / "model.onnx"
    ir.save(build_decoder(num_layers=2, vocab_size=300), path)
    return path


def _refusing(monkeypatch, folder):
    """``folder`` refuses new files as a pseudo file system does (root passes ``os.access``)."""
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.samefile(dir, folder):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def test_a_folder_that_refuses_the_write_is_named(tmp_path, monkeypatch):
    _refusing(monkeypatch, tmp_path)
    with pytest.raises(KvCacheError, match=rf"^Cannot write in {tmp_path} \(operation not permitted\)\.$"):
        check_writable_folder(tmp_path / "new" / "deeper")
    assert not list(tmp_path.iterdir())


def test_the_probe_leaves_nothing(tmp_path):
    check_writable_folder(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(PROBE_PREFIX)]


@pytest.mark.parametrize("command", ["calibrate", "convert"])
def test_calibrate_and_convert_refuse_before_any_work(model_file, tmp_path, monkeypatch, capsys, command):
    out = tmp_path / "out"
    out.mkdir()
    _refusing(monkeypatch, out)
    ran = []
    monkeypatch.setattr("onnx_kvcache.runtime.runner.KvCacheRunner.__init__", lambda *a, **k: ran.append(1))
    argv = {
        "calibrate": ["calibrate", str(model_file), "--out", str(out / "s.json"), "--format", "int8"],
        "convert": [
            "convert",
            str(model_file),
            str(out / "m.onnx"),
            "--format",
            "int8",
            "--scales",
            "x.json",
        ],
    }[command]
    if command == "convert":
        (tmp_path / "x.json").write_text(
            '{"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.1, 0.1]}, "qmax": 128}'
        )
        argv[-1] = str(tmp_path / "x.json")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"Cannot write in {out} (operation not permitted)" in err and not ran
    assert not list(out.iterdir())


def test_a_pseudo_file_system_is_refused_naming_it(model_file, capsys):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no procfs on this system")  # the monkeypatched tests above hold everywhere
    assert main(["calibrate", str(model_file), "--out", "/proc/s.json", "--format", "int8"]) == 2
    assert "Cannot write in /proc (" in capsys.readouterr().err
    with pytest.raises(KvCacheError, match=r"^Cannot write in /proc \("):
        convert_model(model_file, "/proc/m.onnx", format="int8", scales={0: (0.1, 0.1), 1: (0.1, 0.1)})


def test_a_link_whose_data_lies_beside_its_target_names_both(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").mkdir()
    ir.save(
        build_decoder(num_layers=2, vocab_size=300),
        tmp_path / "real/model.onnx",
        external_data="model.onnx.data",
    )
    os.symlink("../real/model.onnx", tmp_path / "link/model.onnx")
    link, real = tmp_path / "link/model.onnx", tmp_path / "real/model.onnx"
    with pytest.raises(KvCacheError, match=rf"{link} is a symbolic link to {real}: .*Give {real} itself"):
        load_model(link)
    assert main(["inspect", str(link)]) == 2
    load_model(real)  # the target itself loads


def test_a_hard_linked_data_file_is_one_line_where_a_weight_is_read(tmp_path, capsys):
    """onnx-ir refuses to read a data file with more than one hard link (a --weights link
    conversion makes them); a command that reads a weight says so in one line."""
    from onnx_kvcache.models.decoder import save_genai_folder

    save_genai_folder(tmp_path / "g", num_layers=2)
    os.link(tmp_path / "g/model.onnx.data", tmp_path / "second-link.data")
    argv = ["calibrate", str(tmp_path / "g"), "--out", str(tmp_path / "s.json"), "--format", "int4"]
    assert main([*argv, "--num-seqs", "1", "--min-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"its data file {tmp_path / 'g/model.onnx.data'} has 2 hard links" in err


def test_a_folder_that_exists_but_takes_no_files_is_said_to(model_file):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no procfs on this system")
    with pytest.raises(KvCacheError, match=r"^Cannot write in /proc \(it takes no new files\)\.$"):
        check_writable_folder("/proc/out")
