"""What conversion refuses (paths, links, data files, configs), each refused before anything is written."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, convert_model
from onnx_kvcache.cli.commands import main
from onnx_kvcache.model_io import _atomic as file_io
from onnx_kvcache.model_io._atomic import TEMP_PREFIX

from conversion_cases import (
    LAYOUTS,
    SCALES,
    assert_loads_everywhere,
    genai,
    save_external,
    snapshot,
    umask022,  # noqa: F401  (an autouse fixture)
    unit_scales,
)

# -- what was found (issue 9): each of these passed silently before --------------------


def test_default_conversion_elsewhere_leaves_both_models_loadable_in_onnx(tmp_path):
    """It used to hard-link: onnx and onnx-ir then refused the output AND the original."""
    src = save_external(tmp_path / "in")
    result = convert_model(src, tmp_path / "out" / "m.onnx", format="int8", scales=SCALES)
    assert result.weights in ("copied", "cloned")
    for model in (src, result.model_file):
        onnx.load(model)
        [v.const_value.numpy() for v in ir.load(model).graph.initializers.values()]


def test_link_never_falls_back_to_a_symbolic_link(tmp_path, monkeypatch, capsys):
    src = save_external(tmp_path / "in")

    def cross_device(*args, **kwargs):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    args = ["convert", str(src), str(tmp_path / "out" / "m.onnx"), "--weights", "link", "--format", "int8"]
    assert main([*args, "--scales", str(unit_scales(tmp_path))]) == 2
    err = capsys.readouterr().err.splitlines()
    assert (
        err[-1].startswith("onnx-kvcache: error: Invalid cross-device link")
        and "nothing was written" in err[-1]
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        # 1. OUT a parent of IN, with --overwrite: used to delete IN and all of the parent
        (lambda t: ["convert", f"{t}/parent/g", f"{t}/parent", "--overwrite"], "contains the input folder"),
        (lambda t: ["convert", f"{t}/parent/g", f"{t}/parent/g/sub"], "inside the input folder"),
        (lambda t: ["convert", f"{t}/parent/g", f"{t}/parent/g", "--overwrite"], "is the input"),
        (lambda t: ["convert", f"{t}/parent/g", f"{t}/parent/g/model.onnx"], "inside the input folder"),
        (lambda t: ["convert", f"{t}/parent/f/model.onnx", f"{t}/parent/f/model.onnx"], "is the input"),
        # 3. OUT a data file of IN: used to replace the weights with the graph
        (
            lambda t: ["convert", f"{t}/parent/f/model.onnx", f"{t}/parent/f/model.onnx.data", "--overwrite"],
            "a file the input uses (its weights); name a .onnx file (e.g. model.int8.onnx).",
        ),
        (lambda t: ["convert", f"{t}/parent/f/model.onnx", f"{t}/parent/f", "--overwrite"], "is a folder"),
        (
            lambda t: ["convert", f"{t}/parent/f/model.onnx", f"{t}/parent/notes.txt", "--overwrite"],
            ".onnx file",
        ),
        (
            lambda t: ["convert", f"{t}/parent/f/model.onnx", f"{t}/parent/x.onnx.data"],
            "must be a .onnx file name (e.g. x.onnx).",
        ),
        (lambda t: ["convert", f"{t}/parent/g", f"{t}/parent/g.int8.onnx"], "looks like a file name"),
        (lambda t: ["convert", f"{t}/parent/g", f"{t}/parent/notes.txt", "--overwrite"], "is not a folder"),
    ],
)
def test_destructive_paths_are_refused_and_nothing_is_touched(tmp_path, capsys, make_args, message):
    parent = tmp_path / "parent"
    genai(parent / "g")
    save_external(parent / "f")
    (parent / "notes.txt").write_text("mine")
    (parent / "f" / "extra.txt").write_text("not a model file")
    scales = ["--format", "int8", "--scales", str(unit_scales(tmp_path))]
    before = snapshot(tmp_path)
    assert main([*make_args(tmp_path), *scales]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("onnx-kvcache: error:")
    assert snapshot(tmp_path) == before


def test_a_data_file_of_another_model_with_the_same_name_survives(tmp_path):
    """2. It used to be replaced silently: that other model then computed garbage."""
    src = save_external(tmp_path / "src")
    other = save_external(tmp_path / "other")  # also model.onnx + model.onnx.data
    before = snapshot(tmp_path / "other")
    result = convert_model(src, tmp_path / "other" / "model_int8.onnx", format="int8", scales=SCALES)
    assert snapshot(tmp_path / "other").items() >= before.items()
    assert result.data_files == ["model_int8.onnx.data"]
    assert_loads_everywhere(other, ir.DataType.FLOAT)
    assert_loads_everywhere(result.model_file, ir.DataType.INT8)


@pytest.mark.parametrize(
    "filename", ["../victim/model.onnx", "sub/../../victim/model.onnx", "/ABS/victim/model.onnx", ""]
)
@pytest.mark.parametrize("in_place", [True, False])
def test_genai_filename_outside_the_folder_is_refused(tmp_path, filename, in_place):
    """4. With --in-place it used to rewrite a model outside the folder."""
    victim = save_external(tmp_path / "victim")
    folder = genai(tmp_path / "g")
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = filename.replace("/ABS", str(tmp_path))
    (folder / "genai_config.json").write_text(json.dumps(config))
    before = snapshot(tmp_path)
    with pytest.raises(KvCacheError, match=r"outside the model's folder|must name a file"):
        convert_model(
            folder, None if in_place else tmp_path / "out", in_place=in_place, format="int8", scales=SCALES
        )
    assert snapshot(tmp_path) == before and victim.exists()


def test_a_decoder_symlinked_out_of_the_folder_is_refused_by_name(tmp_path):
    victim = save_external(tmp_path / "victim")
    folder = genai(tmp_path / "g")
    (folder / "model.onnx").unlink()
    (folder / "model.onnx").symlink_to(victim)
    before = snapshot(tmp_path)
    for kwargs in ({"in_place": True}, {"out_path": tmp_path / "out"}):
        with pytest.raises(KvCacheError, match=r"model.onnx is a symbolic link to .*victim"):
            convert_model(folder, format="int8", scales=SCALES, **kwargs)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("problem", ["missing", "folder", "truncated", "fifo"])
def test_missing_or_broken_data_files_are_refused(tmp_path, problem, capsys):
    """6. A missing data file used to give a dangling link and exit 0."""
    src = save_external(tmp_path / "in")
    data = tmp_path / "in" / "model.onnx.data"
    if problem == "missing":
        data.unlink()
    elif problem == "folder":
        data.unlink()
        data.mkdir()
    elif problem == "truncated":
        with open(data, "r+b") as f:
            f.truncate(1000)
    else:
        data.unlink()
        os.mkfifo(data)  # reading it would hang
    args = ["convert", str(src), str(tmp_path / "out" / "m.onnx"), "--format", "int8"]
    args += ["--scales", str(unit_scales(tmp_path))]
    before = snapshot(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert {"missing": "is missing", "folder": "is a folder", "truncated": "truncated", "fifo": "is a FIFO"}[
        problem
    ] in err
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_symlink_out_of_the_input_folder_is_refused_by_name_or_copied_with_the_flag(tmp_path):
    """7. Links were followed: any readable file outside the folder was copied into the output."""
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    folder = genai(tmp_path / "g")
    (folder / "notes.txt").symlink_to(secret)
    with pytest.raises(KvCacheError, match=r"notes.txt is a symbolic link to .*secret.txt, outside"):
        convert_model(folder, tmp_path / "out", format="int8", scales=SCALES)
    assert not (tmp_path / "out").exists()
    convert_model(folder, tmp_path / "out", format="int8", scales=SCALES, follow_symlinks=True)
    assert (tmp_path / "out" / "notes.txt").read_text() == "private"
    assert not (tmp_path / "out" / "notes.txt").is_symlink()
    (folder / "inner.json").symlink_to("tokenizer.json")  # inside the folder: fine, copied as a file
    (folder / "notes.txt").unlink()
    convert_model(folder, tmp_path / "out2", format="int8", scales=SCALES)
    assert not (tmp_path / "out2" / "inner.json").is_symlink()


def test_temporary_entries_of_a_killed_run_are_never_copied_and_are_swept(tmp_path):
    folder = genai(tmp_path / "g")
    (folder / f"{TEMP_PREFIX}1-dead").write_bytes(b"partial graph")
    (tmp_path / f"{TEMP_PREFIX}2-dead").mkdir()
    convert_model(folder, tmp_path / "out", format="int8", scales=SCALES)
    assert not list((tmp_path / "out").glob(f"{TEMP_PREFIX}*"))
    assert not (tmp_path / f"{TEMP_PREFIX}2-dead").exists()  # swept: the output's parent
    assert (folder / f"{TEMP_PREFIX}1-dead").exists()  # the input folder is only read
    convert_model(folder, in_place=True, format="int8", scales=SCALES)
    assert not (folder / f"{TEMP_PREFIX}1-dead").exists()


@pytest.mark.parametrize("layout", ["file", "genai"])
def test_failures_leave_nothing_behind(tmp_path, monkeypatch, layout):
    src = LAYOUTS[layout](tmp_path / "in")
    src = src if layout == "file" else tmp_path / "in"
    before = snapshot(tmp_path)
    real = file_io.copy_data
    calls = []

    def failing(source, dst, progress=None):
        calls.append(source)
        if len(calls) == 2 or layout == "file":
            raise OSError(28, "No space left on device", str(dst))
        return real(source, dst, progress=progress)

    monkeypatch.setattr(file_io, "copy_data", failing)
    monkeypatch.setattr(file_io, "clone_file", lambda a, b: False)
    out = tmp_path / "new" / "deeper" / ("out" if layout == "genai" else "m.onnx")
    with pytest.raises(OSError, match="No space"):
        convert_model(src, out, format="int8", scales=SCALES)
    assert snapshot(tmp_path) == before and not (tmp_path / "new").exists()  # created folders removed too


def test_an_unreadable_subfolder_fails_rather_than_going_missing(tmp_path, monkeypatch, capsys):
    folder = genai(tmp_path / "g")
    (folder / "extra").mkdir()
    real = os.scandir

    def scandir(path="."):
        if str(path).endswith("extra"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert (
        main(
            [
                "convert",
                str(folder),
                str(tmp_path / "out"),
                "--format",
                "int8",
                "--scales",
                str(unit_scales(tmp_path)),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "Permission denied" in err and "extra" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_free_space_is_checked_before_copying(tmp_path, monkeypatch, capsys):
    src = save_external(tmp_path / "in")
    monkeypatch.setattr(file_io, "clone_file", lambda a, b: False)
    monkeypatch.setattr(file_io, "free_bytes", lambda folder: 1000)
    args = ["convert", str(src), str(tmp_path / "out" / "m.onnx"), "--format", "int8"]
    assert main([*args, "--scales", str(unit_scales(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "needs 1.9 MiB" in err and "1000 bytes free" in err and "beside the input" in err
    assert not (tmp_path / "out").exists()


def test_bad_scales_write_nothing(tmp_path):
    src = genai(tmp_path / "in")
    with pytest.raises(KvCacheError, match=r"layer\(s\) \[1\]"):
        convert_model(src, tmp_path / "out", format="int8", scales={0: (0.1, 0.1)})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "sub/../../x.bin"])
def test_refuses_external_data_outside_the_folder(tmp_path, location):
    src = save_external(tmp_path / "in")
    proto = onnx.load(src, load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.external_data)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(proto, src)
    with pytest.raises(KvCacheError, match="outside the model's folder"):
        convert_model(src, tmp_path / "out" / "m.onnx", format="int8", scales=SCALES)
    assert not (tmp_path / "out").exists()
    assert main(["convert", str(src), str(tmp_path / "o.onnx"), "--format", "int8"]) == 2


def test_inspect_reads_folders_and_reports_context_bytes(tmp_path, capsys):
    src = genai(tmp_path / "in")
    convert_model(
        src,
        tmp_path / "out",
        format="int4",
        granularity="per_channel",
        scales={i: (np.full(64, 0.1), np.full(64, 0.2)) for i in range(2)},
    )
    assert main(["inspect", str(tmp_path / "out"), "--json", "--context", "1000", "--batch", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [layer["dtype"] for layer in doc["layers"]] == ["UINT8", "UINT8"]
    assert doc["layers"][0]["k_quant_type"] == "PER_CHANNEL" and doc["layers"][0]["bit_width"] == 4
    assert doc["bytes_per_token"] == 2 * 2 * 2 * 32 * 0.5 and doc["cache_bytes"] == 128 * 1000 * 2
    assert main(["inspect", str(tmp_path / "out"), "--ep", "cuda"]) == 0
    text = capsys.readouterr().out  # converted for the CPU: one shared buffer, as XQA needs
    assert "not eligible" in text and "head size 32" in text and "share one buffer" not in text
    config = json.loads((tmp_path / "out/genai_config.json").read_text())
    config["search"]["past_present_share_buffer"] = False
    (tmp_path / "out/genai_config.json").write_text(json.dumps(config))
    assert main(["inspect", str(tmp_path / "out"), "--ep", "cuda"]) == 0
    assert "share one buffer" in capsys.readouterr().out


def test_the_granularity_is_the_recorded_one_else_the_one_the_sizes_fit(tmp_path, monkeypatch, capsys):
    """A per-head row added to the table: 2 scales a layer are per head on this model (2 KV
    heads of 32), 64 per channel; nothing is guessed from sizes alone."""
    from onnx_kvcache import KvCacheScales
    from onnx_kvcache.cache.formats import SCALE_GRANULARITIES, ScaleGranularity

    monkeypatch.setitem(
        SCALE_GRANULARITIES, "per_head", ScaleGranularity("per_head", "PER_HEAD", True, False)
    )
    src = save_external(tmp_path)
    for size, want in ((1, "per_tensor"), (2, "per_head"), (64, "per_channel")):
        scales = {i: (np.full(size, 0.1), np.full(size, 0.2)) for i in range(2)}
        result = convert_model(src, tmp_path / f"{size}.onnx", format="int8", scales=scales, ep=None)
        assert result.granularity == want
        node = next(n for n in ir.load(tmp_path / f"{size}.onnx").graph if n.op_type == "GroupQueryAttention")
        assert node.attributes["k_quant_type"].value == SCALE_GRANULARITIES[want].quant_type
    with pytest.raises(
        KvCacheError, match=r"3 element\(s\) per cache.*\(per_tensor 1, per_channel 64, per_head 2\)"
    ):
        convert_model(
            src, tmp_path / "3.onnx", format="int8", scales={0: ([0.1] * 3,) * 2, 1: ([0.1] * 3,) * 2}
        )
    recorded = KvCacheScales.from_mapping(
        {i: ([0.1, 0.1], [0.2, 0.2]) for i in range(2)}, granularity="per_head"
    )
    recorded.save(tmp_path / "per_head.json")
    with pytest.raises(KvCacheError, match=r"The scales are per_head .*granularity='per_head'"):
        convert_model(src, tmp_path / "x.onnx", format="int8", granularity="per_channel", scales=recorded)
    argv = ["convert", str(src), str(tmp_path / "x.onnx"), "--format", "int8", "--granularity", "per_channel"]
    assert main([*argv, "--scales", str(tmp_path / "per_head.json")]) == 2
    assert "convert with --granularity per_head" in capsys.readouterr().err
    assert not (tmp_path / "3.onnx").exists() and not (tmp_path / "x.onnx").exists()
