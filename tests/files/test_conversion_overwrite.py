"""overwrite=True: replacing a previous output of onnx-kvcache, and nothing else."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys

import onnx
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, convert_model
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import SharedWeightsWarning
from onnx_kvcache.model_io import _atomic as file_io
from onnx_kvcache.model_io.genai_folder import resolve_model_path

from conversion_cases import (
    LAYOUTS,
    MARKER,
    NOT_LOADABLE,
    SCALES,
    assert_loads_everywhere,
    assert_no_temporary_entries,
    data_files,
    data_locations,
    genai,
    marker_of,
    save_external,
    snapshot,
    umask022,  # noqa: F401  (an autouse fixture)
    unit_scales,
)

# -- overwrite: a previous output of onnx-kvcache, nothing else -------------------------


@pytest.mark.parametrize("neighbour", ["none", "not-loadable", "empty"])
@pytest.mark.parametrize("placement", ["elsewhere", "beside-copy", "shards"])
def test_repeated_overwrite_leaves_one_output_and_its_own_data(tmp_path, placement, neighbour):
    """Each run used to leave one more copy of the weights (OUT.2.data, OUT.3.data, ...) when the
    folder held a .onnx file that no tool can load."""
    src = save_external(tmp_path / "in", shard=600_000 if placement == "shards" else None)
    folder = src.parent if placement == "beside-copy" else tmp_path / "lk"
    folder.mkdir(exist_ok=True)
    (folder / "out.onnx.data").write_text("x\n")  # not the output's: never removed
    if neighbour != "none":
        (folder / "other.onnx").write_bytes(NOT_LOADABLE if neighbour == "not-loadable" else b"")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    out = folder / "out.onnx"
    for _ in range(3):
        result = convert_model(src, out, format="int8", scales=SCALES, weights="copy", overwrite=True)
        assert sorted(os.listdir(folder)) == sorted([*before, "out.onnx", *result.data_files])
        assert marker_of(out)["data"] == result.data_files == sorted(data_locations(out))
    assert {name: (folder / name).read_bytes() for name in before} == before
    assert_loads_everywhere(out, ir.DataType.INT8)
    assert_no_temporary_entries(tmp_path)


RACES = {
    # the other run commits between this run's check and its write: this one used to fail
    # with a traceback ending in AssertionError: .../model.onnx.data
    "done-before-our-write": "changed since this run checked it",
    # the other run starts while this one copies: it stops before copying anything
    "starts-while-we-copy": "is being replaced by another run",
}


@pytest.mark.parametrize("race", RACES)
@pytest.mark.parametrize("layout", ["file", "genai"])
def test_concurrent_overwrites_of_one_output_are_one_line_each(tmp_path, capsys, monkeypatch, race, layout):
    from onnx_kvcache.files import conversion as model_files

    src = genai(tmp_path / "in") if layout == "genai" else save_external(tmp_path / "in")
    out = tmp_path / ("out" if layout == "genai" else "out/model.onnx")
    convert_model(src, out, format="int8", scales=SCALES)
    other, started = [], []

    def other_run():
        started.append(True)  # once: the other run goes through the same patched functions
        try:
            other.append(convert_model(src, out, format="int4", scales=SCALES, overwrite=True))
        except KvCacheError as e:
            other.append(e)

    writer = "_write_folder" if layout == "genai" else "_write_file"
    real_write, real_copy = getattr(model_files, writer), file_io.copy_data
    if race == "done-before-our-write":

        def write(*args, **kwargs):
            if not started:
                other_run()
            return real_write(*args, **kwargs)

        monkeypatch.setattr(model_files, writer, write)
    else:
        monkeypatch.setenv(file_io.PLAIN_COPY_ENV, "1")

        def copy(*args, **kwargs):
            if not started:
                other_run()
            return real_copy(*args, **kwargs)

        monkeypatch.setattr(file_io, "copy_data", copy)
    args = ["convert", str(src), str(out), "--format", "int8", "--scales", str(unit_scales(tmp_path))]
    code = main([*args, "--overwrite"])
    err = capsys.readouterr().err
    if race == "done-before-our-write":  # the other run won; this one wrote nothing
        assert code == 2 and err.count("\n") == 1 and RACES[race] in err and "nothing was written" in err, err
        assert marker_of(out)["format"] == "int4"
    else:  # this run won; the other stopped at once
        assert code == 0 and isinstance(other[0], KvCacheError) and RACES[race] in str(other[0])
        assert marker_of(out)["format"] == "int8"
    graph, _ = resolve_model_path(out)
    assert sorted(os.listdir(graph.parent)) == sorted(
        os.listdir(tmp_path / "in") if layout == "genai" else ["model.onnx", *data_locations(graph)]
    )
    assert_loads_everywhere(out, ir.DataType.UINT8 if race == "done-before-our-write" else ir.DataType.INT8)
    assert_no_temporary_entries(tmp_path)


def test_a_data_file_removed_meanwhile_is_no_error(tmp_path):
    """What the race came down to: an old data file gone before the journal was written."""
    src = save_external(tmp_path / "in")
    out = tmp_path / "out" / "model.onnx"
    convert_model(src, out, format="int8", scales=SCALES)
    real = file_io.publish_as_one

    def publish(*args, remove_after=(), **kwargs):
        for p in remove_after:
            p.unlink()
        return real(*args, remove_after=remove_after, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(file_io, "publish_as_one", publish)
        convert_model(src, out, format="int4", scales=SCALES, overwrite=True)
    assert sorted(os.listdir(out.parent)) == ["model.onnx", "model.onnx.2.data"]
    assert_loads_everywhere(out, ir.DataType.UINT8)


@pytest.mark.parametrize("placement", ["beside", "elsewhere", "beside-copy", "folder"])
def test_a_replaced_output_always_says_so_in_one_line(tmp_path, capsys, placement):
    """An output that owned no data file (beside: shared weights) was replaced without a word."""
    src = genai(tmp_path / "in") if placement == "folder" else save_external(tmp_path / "in")
    out = {
        "beside": tmp_path / "in" / "m.int8.onnx",
        "beside-copy": tmp_path / "in" / "m.int8.onnx",
        "elsewhere": tmp_path / "out" / "m.onnx",
        "folder": tmp_path / "out",
    }[placement]
    args = ["convert", str(src), str(out), "--format", "int8", "--scales", str(unit_scales(tmp_path))]
    args += ["--weights", "copy"] if placement == "beside-copy" else []
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--overwrite"]) == 0
    replaced = [line for line in capsys.readouterr().out.splitlines() if line.startswith("replaced")]
    removed = {"elsewhere": "m.onnx.data", "beside-copy": "m.int8.onnx.data"}.get(placement)
    assert replaced == [
        f"replaced {out}" + (f" and removed its own data file(s): {removed}." if removed else ".")
    ]


@pytest.fixture
def tmpfs(tmp_path):
    """A folder that is its own mount (tmpfs); mounting needs root, as on CI's containers."""
    folder = tmp_path / "mnt"
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)]
    if subprocess.run(mount, check=False, capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("layout", ["genai", "file"])
def test_overwrite_refuses_a_mount_point_before_copying_anything(tmp_path, capsys, tmpfs, layout):
    """It staged the new folder beside the mount, copied everything, then failed with EBUSY."""
    src = genai(tmp_path / "in") if layout == "genai" else save_external(tmp_path / "in")
    out = tmpfs if layout == "genai" else tmpfs / "m.onnx"
    if layout == "file":  # a mounted file: bind-mount one over the output
        convert_model(src, tmp_path / "x" / "m.onnx", format="int8", scales=SCALES)
        out.touch()
        subprocess.run(["mount", "--bind", str(tmp_path / "x" / "m.onnx"), str(out)], check=True)
    else:
        convert_model(src, out, format="int8", scales=SCALES)  # filled in place: an empty mount point
    before = snapshot(tmp_path)
    args = ["convert", str(src), str(out), "--format", "int4", "--scales", str(unit_scales(tmp_path))]
    try:
        assert main([*args, "--overwrite"]) == 2
        after = {k: v for k, v in snapshot(tmp_path).items() if k != "scales.json"}
    finally:
        if layout == "file":
            subprocess.run(["umount", str(out)], check=True)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"Output {out} is a mount point, which cannot be replaced" in err, err
    assert ("empty it yourself" in err) == (layout == "genai")
    assert after == before
    assert_no_temporary_entries(tmp_path)


def test_mount_points_are_recognised(tmp_path, monkeypatch):
    assert file_io.is_mount_point("/") and not file_io.is_mount_point(tmp_path)
    if sys.platform == "linux":
        assert file_io.is_mount_point("/proc")
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(tmp_path / "m") or real(p))
    (tmp_path / "m").mkdir()
    assert file_io.is_mount_point(tmp_path / "m")


def _other_group() -> int:
    """A group this process may give its files other than its own (any, as root)."""
    others = [g for g in os.getgroups() if g != os.getegid()]
    return 1 if os.geteuid() == 0 else (others[0] if others else os.getegid())


MODES = {  # output, how it was locked down, what each entry of the new one must have
    "file-0600": ("file", 0o600, 0o600),
    "beside-copy-0640": ("beside", 0o640, 0o640),
    "folder-0700": ("folder", 0o700, None),
    "folder-2770": ("folder", 0o2770, None),  # a team folder: set-group-ID, group only
}


@pytest.mark.parametrize("case", MODES)
def test_a_replaced_output_keeps_its_mode_owner_and_group(tmp_path, case):
    """--overwrite used to give the new output the umask's mode: 0755 / 0644, setgid lost."""
    kind, mode, file_mode = MODES[case]
    group = _other_group()
    if kind == "folder":
        src = genai(tmp_path / "in")
        out = tmp_path / "out"
    else:
        src = save_external(tmp_path / "in")
        out = tmp_path / ("out/m.onnx" if kind == "file" else "in/m.int8.onnx")
    convert_model(src, out, format="int8", scales=SCALES, weights="copy")
    if kind == "folder":  # as a team folder is: every entry in its group
        for p in [out, *out.rglob("*")]:
            os.chown(p, -1, group)
        os.chmod(out, mode)
        os.chmod(out / "model.onnx.data", 0o660)  # an entry the new folder has too keeps its mode
        (out / "tokenizer_config.json").unlink()  # one it has not: the folder's group all the same
    else:
        os.chown(out, -1, group)
        os.chmod(out, mode)
    originals = [*(tmp_path / "in").rglob("*")] if kind == "folder" else [src, *data_files(src)]
    inputs = {p: (p.stat().st_mode, p.stat().st_gid) for p in originals}
    result = convert_model(src, out, format="int4", scales=SCALES, weights="copy", overwrite=True)
    st = out.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, group), (oct(st.st_mode), st.st_gid)
    if kind == "folder":
        assert stat.S_IMODE((out / "model.onnx.data").stat().st_mode) == 0o660
        for p in out.rglob("*"):  # created in a set-group-ID folder: its group, as the kernel gives it
            assert p.stat().st_gid == group or not mode & stat.S_ISGID, p
        assert (out / "tokenizer_config.json").exists()
    else:
        for name in result.data_files:  # new data files take the replaced model file's mode
            data = out.parent / name
            assert (stat.S_IMODE(data.stat().st_mode), data.stat().st_gid) == (file_mode, group), name
    assert {p: (p.stat().st_mode, p.stat().st_gid) for p in originals} == inputs
    assert_loads_everywhere(out, ir.DataType.UINT8)


def test_a_replaced_output_of_another_user_keeps_its_mode(tmp_path, monkeypatch):
    """Where the owner cannot be kept (not root), the mode still is and the group where we may."""
    src = save_external(tmp_path / "in")
    out = tmp_path / "out" / "m.onnx"
    convert_model(src, out, format="int8", scales=SCALES)
    os.chmod(out, 0o640)

    def refuse(fd, uid, gid):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", refuse)
    convert_model(src, out, format="int4", scales=SCALES, overwrite=True)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert stat.S_IMODE((out.parent / "m.onnx.2.data").stat().st_mode) == 0o640


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("layout", ["genai", "genai-subfolder", "file-subfolder"])
def test_an_empty_output_folder_is_filled_and_kept(tmp_path, layout, overwrite):
    """It used to be refused: 'exists; pass overwrite', then 'not a model folder'."""
    LAYOUTS[layout](tmp_path / "in")
    out = tmp_path / "empty"
    out.mkdir()
    os.chmod(out, 0o750)
    inode = out.stat().st_ino
    result = convert_model(tmp_path / "in", out, format="int8", scales=SCALES, overwrite=overwrite)
    assert out.stat().st_ino == inode and stat.S_IMODE(out.stat().st_mode) == 0o750  # the same folder
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == sorted(
        p.relative_to(tmp_path / "in") for p in (tmp_path / "in").rglob("*")
    )
    assert not [n for n in result.notes if "replaced" in n]
    assert marker_of(out)["placement"] == "folder"
    assert_loads_everywhere(out, ir.DataType.INT8)
    assert_no_temporary_entries(tmp_path)


_KILL_AFTER = """
import os, sys
from onnx_kvcache import convert_model
from onnx_kvcache.model_io import _atomic as _file_io
real, calls = _file_io.rename_noreplace, []
def rename(src, dst):
    if len(calls) == int(sys.argv[3]):
        os.kill(os.getpid(), 9)
    calls.append(dst)
    real(src, dst)
_file_io.rename_noreplace = rename
convert_model(sys.argv[1], sys.argv[2], format="int8", scales={0: (0.1, 0.1), 1: (0.1, 0.1)})
"""


@pytest.mark.parametrize("after", [0, 2, 4])
@pytest.mark.parametrize("how", ["interrupted", "SIGKILL"])
def test_a_stopped_fill_leaves_the_folder_empty_or_to_the_next_run(tmp_path, monkeypatch, how, after):
    """A genai folder is filled by 4 renames, then genai_config.json's (the commit)."""
    src = genai(tmp_path / "in")
    out = tmp_path / "empty"
    out.mkdir()
    if how == "SIGKILL":
        proc = subprocess.run([sys.executable, "-c", _KILL_AFTER, src, out, str(after)], check=False)
        assert proc.returncode == -9
        assert not (out / "genai_config.json").exists()  # never a loadable partial folder
    else:
        real, calls = file_io.rename_noreplace, []

        def rename(a, b):
            if len(calls) == after:
                raise KeyboardInterrupt
            calls.append(b)
            real(a, b)

        monkeypatch.setattr(file_io, "rename_noreplace", rename)
        with pytest.raises(KeyboardInterrupt):
            convert_model(src, out, format="int8", scales=SCALES)
        assert os.listdir(out) == []
        monkeypatch.undo()
    convert_model(src, out, format="int8", scales=SCALES)  # the next run settles a killed one first
    assert sorted(os.listdir(out)) == sorted(os.listdir(src))
    assert_loads_everywhere(out, ir.DataType.INT8)
    assert_no_temporary_entries(tmp_path)


def test_a_folder_that_stops_being_empty_is_left_alone(tmp_path, monkeypatch):
    src = genai(tmp_path / "in")
    out = tmp_path / "empty"
    out.mkdir()
    real = file_io.write_new_file

    def meanwhile(path, data, like=None):
        if not (out / "theirs.txt").exists():
            (out / "theirs.txt").write_text("theirs")
        real(path, data, like=like)

    monkeypatch.setattr(file_io, "write_new_file", meanwhile)
    with pytest.raises(KvCacheError, match="no longer empty"):
        convert_model(src, out, format="int8", scales=SCALES)
    assert os.listdir(out) == ["theirs.txt"] and (out / "theirs.txt").read_text() == "theirs"


def _converted(src, out=None, **kwargs):
    """``src`` converted to ``out`` (or in place); the output."""
    convert_model(src, out, format="int8", scales=SCALES, in_place=out is None, **kwargs)
    return out or src


NOT_OURS = "is not an output of onnx-kvcache"
OVERWRITE_REFUSED = {  # input, output, what the one line says
    "original-folder": lambda t: (t / "g2", genai(t / "phi4"), f"{NOT_OURS} (its model model.onnx has no"),
    "original-decoder": lambda t: (  # another folder's original model
        t / "f2/model.onnx",
        genai(t / "g") / "model.onnx",
        f"{NOT_OURS} (it has no {MARKER} metadata)",
    ),
    "notes-folder": lambda t: (  # notes and a .onnx file no tool loads
        t / "g2",
        _notes_folder(t / "stuff2"),
        f"{NOT_OURS} (its model x.onnx is not a readable ONNX model)",
    ),
    # converted in place: the user's only copy of that model
    "in-place-file": lambda t: (
        t / "f2/model.onnx",
        _converted(save_external(t / "f3")),
        "converted in place",
    ),
    "in-place-folder": lambda t: (t / "g2", _converted(genai(t / "g3")), "converted in place"),
    # a previous output holding a file added since
    "added-file": lambda t: (t / "g2", _added(_converted(t / "g2", t / "gout")), "notes.txt, which"),
    # the model of a converted folder; a folder holding a converted model file
    "folder-decoder": lambda t: (
        t / "f2/model.onnx",
        _converted(t / "g2", t / "gout") / "model.onnx",
        "a folder onnx-kvcache converted; replacing that file alone",
    ),
    "file-as-folder": lambda t: (
        t / "g2",
        _converted(t / "f2/model.onnx", t / "fo/model.onnx").parent,
        "was not converted as a folder",
    ),
}


def _notes_folder(folder):
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "x.onnx").write_bytes(NOT_LOADABLE)
    return folder


def _added(out):
    (out / "notes.txt").write_text("mine")
    return out


@pytest.mark.parametrize("case", OVERWRITE_REFUSED)
def test_overwrite_replaces_only_a_previous_output(tmp_path, capsys, case):
    """Each of these used to be replaced (and notes.txt deleted)."""
    genai(tmp_path / "g2")
    save_external(tmp_path / "f2")
    scales = unit_scales(tmp_path)
    src, out, message = OVERWRITE_REFUSED[case](tmp_path)
    before = snapshot(tmp_path)
    for flag in (["--overwrite"], []):
        assert main(["convert", str(src), str(out), *flag, "--format", "int8", "--scales", str(scales)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert "choose another output path" in err.lower() or "move" in err, err
        assert "instead, or" not in err, err  # one fix after another, not run together
        assert "--overwrite" not in err, err  # overwrite would not help
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "make_args",
    [
        lambda t: (t / "g/model.onnx", t / "g"),  # a folder output that is the input's folder
        lambda t: (t / "f/model.onnx", t / "f/model"),  # model.onnx, the input, is the obvious fix
        lambda t: (t / "f/model.onnx", f"{t}/f/"),
        # a folder onnx-kvcache converted: a file of ours in it would block its --overwrite
        lambda t: (t / "f/model.onnx", _converted(t / "g", t / "go")),
    ],
)
def test_a_suggested_output_never_names_the_input_or_its_files(tmp_path, make_args):
    genai(tmp_path / "g")
    save_external(tmp_path / "f")
    src, out = make_args(tmp_path)
    with pytest.raises(KvCacheError, match=r"e\.g\. ") as info:
        convert_model(src, out, format="int8", scales=SCALES, overwrite=True)
    suggestion = pathlib.Path(re.search(r"e\.g\. ([^),]+)[),]", str(info.value))[1])
    suggestion = suggestion if suggestion.is_absolute() else pathlib.Path(out).parent / suggestion
    assert suggestion.suffix == ".onnx" and not os.path.lexists(suggestion), info.value
    assert not _is_within_path(suggestion, tmp_path / "go"), info.value
    convert_model(src, suggestion, format="int8", scales=SCALES)  # and it works


def _is_within_path(path, folder):
    return folder == path or folder in path.parents


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.__setitem__("search", []), "search is not a JSON object"),
        (lambda c: c["model"]["decoder"].__setitem__("session_options", "cuda"), "session_options is not"),
        (lambda c: c.__setitem__("model", [1]), "cannot read model.decoder.filename"),
        (lambda c: c["model"]["decoder"].__setitem__("filename", "."), "which is a folder"),
        (lambda c: c["model"]["decoder"].__setitem__("filename", "C:\\m\\model.onnx"), "outside the model"),
        (lambda c: c["model"].__setitem__("vision", {"filename": "../../x.onnx"}), "model.vision.filename"),
    ],
)
def test_weird_genai_configs_are_one_line(tmp_path, capsys, edit, message):
    folder = genai(tmp_path / "g")
    config = json.loads((folder / "genai_config.json").read_text())
    edit(config)
    (folder / "genai_config.json").write_text(json.dumps(config))
    before = snapshot(tmp_path)
    for argv in (["convert", str(folder), str(tmp_path / "o")], ["convert", str(folder), "--in-place"]):
        assert main([*argv, "--format", "int8", "--scales", str(unit_scales(tmp_path))]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert {k: v for k, v in snapshot(tmp_path).items() if k != "scales.json"} == before


def test_weights_kept_in_the_model_file_itself_are_refused(tmp_path):
    src = save_external(tmp_path / "in")
    proto = onnx.load(src, load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.external_data)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = "model.onnx"
    onnx.save(proto, src)
    with pytest.raises(KvCacheError, match="which is the model file"):
        convert_model(src, in_place=True, format="int8", scales=SCALES)


def test_an_input_with_hard_linked_data_is_warned_about(tmp_path):
    src = save_external(tmp_path / "in")
    os.link(tmp_path / "in" / "model.onnx.data", tmp_path / "elsewhere.data")
    with pytest.warns(SharedWeightsWarning, match="more than one hard link"):
        convert_model(src, tmp_path / "out" / "m.onnx", format="int8", scales=SCALES)
    assert (tmp_path / "out" / "m.onnx.data").stat().st_nlink == 1  # the copy is clean
    onnx.load(tmp_path / "out" / "m.onnx")


def test_hugging_face_snapshot_needs_the_flag_and_is_then_copied(tmp_path, capsys):
    original = genai(tmp_path / "original")
    cache = tmp_path / "hub" / "models--org--m"
    (cache / "blobs").mkdir(parents=True)
    snap = cache / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(original.iterdir())):
        shutil.copy(f, cache / "blobs" / f"sha{i}")
        (snap / f.name).symlink_to(f"../../blobs/sha{i}")
    out = tmp_path / "out"
    assert (
        main(["convert", str(snap), str(out), "--format", "int8", "--scales", str(unit_scales(tmp_path))])
        == 2
    )
    err = capsys.readouterr().err
    assert "Hugging Face cache snapshot" in err and "--follow-symlinks" in err and err.count("\n") == 1
    assert not out.exists()
    args = ["convert", str(snap), str(out), "--format", "int8", "--scales", str(unit_scales(tmp_path))]
    assert main([*args, "--follow-symlinks"]) == 0
    assert not [p for p in out.rglob("*") if p.is_symlink()]
    assert_loads_everywhere(out, ir.DataType.INT8)
    assert all(p.is_symlink() for p in snap.iterdir())


@pytest.mark.parametrize("where", ["outside-with-the-flag", "inside"])
def test_beside_an_input_whose_data_files_are_links_is_refused_with_the_fix(tmp_path, capsys, where):
    """The output shared the links: onnx refuses linked data, onnxruntime links out of the
    folder, so it loaded nowhere, silently."""
    src = save_external(tmp_path / "in")
    data = tmp_path / "in" / "model.onnx.data"
    target = tmp_path / "blobs" / "sha1" if where != "inside" else tmp_path / "in" / "blob"
    target.parent.mkdir(exist_ok=True)
    data.rename(target)
    data.symlink_to(target)
    flag = ["--follow-symlinks"] if where != "inside" else []
    args = ["convert", str(src), "--format", "int8", "--scales", str(unit_scales(tmp_path)), *flag]
    before = snapshot(tmp_path)
    assert main([*args[:2], str(tmp_path / "in" / "m.int8.onnx"), *args[2:]]) == 2
    err = capsys.readouterr().err
    assert "model.onnx.data is a symbolic link" in err and "Convert into another folder" in err, err
    assert err.count("\n") == 1 and snapshot(tmp_path) == before
    fixes = [(tmp_path / "out" / "m.onnx", []), (tmp_path / "in" / "m.own.onnx", ["--weights", "copy"])]
    for out, extra in fixes:
        assert main([*args[:2], str(out), *args[2:], *extra]) == 0  # the fixes: the content is copied
        assert not any(p.is_symlink() for p in data_files(out))
        assert_loads_everywhere(out, ir.DataType.INT8)


@pytest.mark.parametrize("victim_size", [18, 3_000_000])
def test_a_crafted_marker_never_removes_a_file_the_graph_does_not_fill(tmp_path, capsys, victim_size):
    """A replaced output's marker named an unrelated 18-byte file as its own data file, its graph
    declaring megabytes of tensors in it: --overwrite removed the file. A data file is removed
    only when its size fits the bytes the graph's own tensors span in it."""
    src = save_external(tmp_path / "in")
    out = tmp_path / "out" / "model.onnx"
    convert_model(src, out, format="int8", scales=SCALES)
    victim = out.parent / "notes.bin"
    victim.write_bytes(b"x" * victim_size)
    proto = onnx.load(out, load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = victim.name
    props = {p.key: p for p in proto.metadata_props}
    doc = json.loads(props[MARKER].value)
    doc["data"] = [victim.name]
    props[MARKER].value = json.dumps(doc)
    onnx.save(proto, out)
    args = ["convert", str(src), str(out), "--format", "int4", "--scales", str(unit_scales(tmp_path))]
    assert main([*args, "--overwrite"]) == 0
    assert victim.read_bytes() == b"x" * victim_size
    said = capsys.readouterr().out
    assert "kept notes.bin: " in said
    assert not [line for line in said.splitlines() if "removed" in line and "notes.bin" in line]
    assert_loads_everywhere(out, ir.DataType.UINT8)
