"""Converting files and genai folders: where weights go, path safety, atomic writes.

Every output, and the original after it, must load in onnx (external data included),
onnx-ir (every weight), onnxruntime and, for folders, onnxruntime-genai.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
import pathlib
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings
from contextlib import nullcontext

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheRunner, KvCacheWarning, __version__, convert_model
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import GenaiConfigWarning, SharedWeightsWarning, UnitScalesWarning
from onnx_kvcache.files import _atomic as file_io
from onnx_kvcache.files._atomic import TEMP_PREFIX
from onnx_kvcache.files.genai_folder import resolve_model_path
from onnx_kvcache.models.decoder import build_decoder, save_genai_folder

from conftest import og_generate

try:
    import onnxruntime_genai as og
except ImportError:  # the genai extra; CI installs it
    og = None

SCALES = {0: (0.05, 0.04), 1: (0.06, 0.05)}
PROMPT = list(b"The river town woke")


@pytest.fixture(autouse=True)
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture
def scale_file(tmp_path):
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.05, 0.05]}, "qmax": 128}))
    return path


# -- models as users have them --------------------------------------------------------


def save_external(folder: pathlib.Path, name="model.onnx", data=None, shard=None) -> pathlib.Path:
    """The bundled decoder with its weights in external data (``data``, maybe in a subfolder)."""
    data = data or f"{name}.data"
    (folder / data).parent.mkdir(parents=True, exist_ok=True)
    path = folder / name
    ir.save(
        build_decoder(num_layers=2, vocab_size=300),
        path,
        external_data=data,
        size_threshold_bytes=1024,
        max_shard_size_bytes=shard,
    )
    return path


def genai(folder: pathlib.Path, data="model.onnx.data", share_buffer=True) -> pathlib.Path:
    """An onnxruntime-genai folder (tokenizer included) as a CUDA-minded build might leave it."""
    save_genai_folder(folder, num_layers=2, vocab_size=300)
    if data != "model.onnx.data":
        (folder / "model.onnx.data").unlink()
        save_external(folder, "model.onnx", data)
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"]["past_present_share_buffer"] = share_buffer
    (folder / "genai_config.json").write_text(json.dumps(config, indent=4))
    return folder


LAYOUTS = {
    "file": lambda d: save_external(d),
    "file-subfolder": lambda d: save_external(d, data="weights/model.onnx.data"),
    "genai": lambda d: genai(d),
    "genai-subfolder": lambda d: genai(d, data="weights/model.onnx.data"),
}


def snapshot(folder: pathlib.Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def data_locations(model_file: pathlib.Path) -> set[str]:
    proto = onnx.load(model_file, load_external_data=False)
    return {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}


def data_files(path: pathlib.Path) -> list[pathlib.Path]:
    graph, _ = resolve_model_path(path)
    return [graph.parent / loc for loc in sorted(data_locations(graph))]


def assert_loads_everywhere(path: pathlib.Path, cache: ir.DataType, *, linked=False) -> None:
    """onnx.load with data, onnx-ir reading every weight, onnxruntime, onnxruntime-genai."""
    import onnxruntime as ort

    graph, config = resolve_model_path(path)
    if linked:  # what --weights link warns about: onnx and onnx-ir refuse both names
        with pytest.raises(onnx.checker.ValidationError, match=r"hard ?link"):
            onnx.load(graph)
        with pytest.raises(ValueError, match="hard link"):
            [v.const_value.numpy() for v in ir.load(graph).graph.initializers.values()]
    else:
        proto = onnx.load(graph)
        assert all(t.raw_data or t.float_data or t.int64_data for t in proto.graph.initializer)
        weights = [v.const_value.numpy() for v in ir.load(graph).graph.initializers.values()]
        assert len(weights) == len(proto.graph.initializer) and all(np.isfinite(w).all() for w in weights)
    ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    runner = KvCacheRunner(path)
    assert runner.cache_dtype == cache and np.isfinite(runner.prefill([1, 2, 3])).all()
    if config is not None and og is not None:
        assert len(og_generate(path, PROMPT, 4)) >= 1


def assert_no_temporary_entries(*folders: pathlib.Path) -> None:
    for folder in folders:
        if folder.is_dir():
            assert not [p for p in folder.rglob(f"{TEMP_PREFIX}*")], folder


# -- the matrix -----------------------------------------------------------------------

PLACEMENTS = ["beside", "elsewhere", "in-place", "copy", "link"]
# A folder converts to another folder or in place; "beside" is a placement of model files, so
# for a genai folder it is its model file converted beside itself (sharing the weights), with
# the folder, whose config still names the original, loading as before. The folder itself as
# INPUT with an OUTPUT inside it is refused: test_a_folder_is_never_converted_into_itself.
MATRIX = [(lay, pl) for lay in LAYOUTS for pl in PLACEMENTS]


@pytest.mark.parametrize(("layout", "placement"), MATRIX)
def test_every_output_and_its_original_load_everywhere(tmp_path, capsys, monkeypatch, layout, placement):
    src_dir = tmp_path / "in"
    src_dir.mkdir()
    made = LAYOUTS[layout](src_dir)
    is_folder = layout.startswith("genai")
    src = src_dir if is_folder else made
    graph = made if not is_folder else src_dir / "model.onnx"
    os.chmod(graph, 0o640)
    if is_folder:
        os.chmod(src_dir / "genai_config.json", 0o600)
    before = snapshot(src_dir)
    originals = {p: p.stat() for p in data_files(src)}
    graph_before = graph.stat()

    args = ["convert", str(src)]
    if placement == "beside":
        out = src_dir / "model.int8.onnx"
        args[1] = str(graph)  # a folder's model file, beside it
    elif placement == "in-place":
        out = src
        args.append("--in-place")
    else:
        out = tmp_path / "out" if is_folder else tmp_path / "out" / "m.onnx"
    if placement == "copy":
        monkeypatch.setenv(file_io.PLAIN_COPY_ENV, "1")
        if not is_folder:
            out = src_dir / "model.own.onnx"  # beside, but with its own copy of the data
        args += ["--weights", "copy"]
    if placement == "link":
        args += ["--weights", "link"]
    if placement != "in-place":
        args.insert(2, str(out))
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.05, 0.05]}, "qmax": 128}))
    assert main([*args, "--format", "int8", "--scales", str(scales)]) == 0
    stdout, stderr = capsys.readouterr()

    expected = {
        "beside": "model.onnx.data, shared with model.onnx (0 bytes)",  # its data, named as it is stored
        "in-place": "weights: unchanged",
        "copy": "weights: copied 1.9 MiB",
        "link": "weights: hard-linked 1.9 MiB (0 bytes written)",
        "elsewhere": "weights: cloned" if tmp_path_clones(tmp_path) else "weights: copied 1.9 MiB",
    }[placement]
    assert expected in stdout, stdout
    assert ("NEITHER model loads" in stderr) == (placement == "link")
    if placement != "in-place":  # the input's files never change
        assert {k: v for k, v in snapshot(src_dir).items() if k in before} == before

    linked = placement == "link"
    assert_loads_everywhere(out, ir.DataType.INT8, linked=linked)
    assert_loads_everywhere(
        src, ir.DataType.INT8 if placement == "in-place" else ir.DataType.FLOAT, linked=linked
    )
    for path in {*data_files(out), *data_files(src)}:
        assert path.stat().st_nlink == (2 if linked else 1), path
        assert not path.is_symlink()
    for path, st in originals.items():
        assert path.stat().st_ino == st.st_ino and path.stat().st_mtime_ns == st.st_mtime_ns

    kind = {"beside": "beside", "copy": "beside", "in-place": "in-place"}.get(placement, "elsewhere")
    mark = marker_of(out)  # what overwrite=True checks: every output says what wrote it, and how
    assert mark["placement"] == ("folder" if is_folder and placement not in ("in-place", "beside") else kind)
    assert (mark["version"], mark["format"], mark["granularity"]) == (__version__, "int8", "per_tensor")
    own_data = not is_folder and placement in ("elsewhere", "copy", "link")  # files it created
    assert mark["data"] == (sorted(data_locations(resolve_model_path(out)[0])) if own_data else [])
    assert placement == "in-place" or marker_of(src) is None
    new_graph, config = resolve_model_path(out)
    # in place, mode and owner are kept (another user's files: test_in_place_keeps_owner_group_and_mode)
    if placement == "in-place":
        st = new_graph.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (
            0o640,
            graph_before.st_uid,
            graph_before.st_gid,
        )
        if is_folder:
            assert stat.S_IMODE((src_dir / "genai_config.json").stat().st_mode) == 0o600
            assert new_graph.name == "model.int8.onnx" and not graph.exists()  # the config changed too
    else:  # new files: the umask's mode
        created = [p for p in (tmp_path / "out").rglob("*")] if (tmp_path / "out").exists() else []
        created += [new_graph, *(p for p in data_files(out) if p not in originals)]
        for p in created:
            assert stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644), p
    if config is not None:
        assert config["search"]["past_present_share_buffer"] is False  # int8 on cpu
    assert_no_temporary_entries(tmp_path)


def tmp_path_clones(tmp_path) -> bool:
    probe = tmp_path / "clone-probe"
    probe.write_bytes(b"x")
    try:
        return file_io.clone_file(probe, tmp_path / "clone-probe-2")
    finally:
        probe.unlink()
        (tmp_path / "clone-probe-2").unlink(missing_ok=True)


def owner_group_mode(path: pathlib.Path) -> tuple[int, int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to other users needs root")
@pytest.mark.parametrize("layout", ["file", "genai", "genai-config-fits"])
def test_in_place_keeps_owner_group_and_mode(tmp_path, capsys, scale_file, layout):
    """Files of a service account, converted in place by root, stay that account's, with their modes.

    The genai folder's graph gets a new name (its config changes too: the commit is the
    config's replacement) and must still carry the old graph's owner, group and mode.
    """
    if layout == "file":
        src = graph = save_external(tmp_path / "in")
    else:
        src = genai(tmp_path / "in", share_buffer=layout == "genai")  # True: the config changes
        graph = src / "model.onnx"
    config = tmp_path / "in" / "genai_config.json"
    os.chown(graph, 1234, 5678)
    os.chmod(graph, 0o640)
    if config.exists():
        os.chown(config, 4321, 8765)
        os.chmod(config, 0o604)
    data = graph.parent / "model.onnx.data"
    data_before = os.lstat(data)

    assert main(["convert", str(src), "--in-place", "--format", "int8", "--scales", str(scale_file)]) == 0
    capsys.readouterr()

    new_graph, new_config = resolve_model_path(src)
    renamed = layout == "genai"
    assert (new_graph.name == "model.int8.onnx") == renamed and graph.exists() == (not renamed)
    assert ir.load(new_graph).graph.inputs[2].dtype == ir.DataType.INT8  # it was converted
    assert owner_group_mode(new_graph) == (1234, 5678, 0o640)
    if config.exists():
        assert owner_group_mode(config) == (4321, 8765, 0o604)
        assert new_config["search"]["past_present_share_buffer"] is False
    after = os.lstat(data)
    assert (after.st_ino, after.st_uid, after.st_mode) == (
        data_before.st_ino,
        data_before.st_uid,
        data_before.st_mode,
    )
    assert_no_temporary_entries(tmp_path)


@pytest.mark.parametrize(
    ("output", "says"),
    [
        ("model.int8.onnx", "give the model file {g}/model.onnx as the input and an output in its folder"),
        ("model.onnx", "model.onnx is its model file: use --in-place to rewrite the folder"),
        ("sub/model.int8.onnx", "give the model file {g}/model.onnx as the input"),
        ("int8", "Choose another path."),
    ],
)
def test_a_folder_is_never_converted_into_itself(tmp_path, capsys, scale_file, output, says):
    """The {genai folder} x {beside} cell: a folder converts to another folder or in place.

    Converting it to a path inside itself is refused with the fix in one line; the fix it
    names (the model file beside itself) converts, and the folder still runs the original.
    """
    g = genai(tmp_path / "g")
    before = snapshot(g)
    args = ["--format", "int8", "--scales", str(scale_file)]
    assert main(["convert", str(g), str(g / output), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("onnx-kvcache: error:") and err.count("\n") == 1, err
    assert "is inside the input folder" in err and says.format(g=g) in err, err
    assert snapshot(g) == before and sorted(os.listdir(g)) == sorted(before)
    if output == "model.int8.onnx":
        assert main(["convert", str(g / "model.onnx"), str(g / output), *args]) == 0
        assert "weights: model.onnx.data, shared with model.onnx (0 bytes)" in capsys.readouterr().out
        assert resolve_model_path(g)[0] == g / "model.onnx"  # genai still runs the original
        assert_loads_everywhere(g, ir.DataType.FLOAT)
        assert_loads_everywhere(g / output, ir.DataType.INT8)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("layout", ["file", "genai"])
@pytest.mark.parametrize("terminal", ["tty", "tty --no-progress", "pipe"])
def test_copying_weights_draws_a_progress_bar_on_a_terminal(
    tmp_path, monkeypatch, scale_file, layout, terminal
):
    from tqdm import tqdm

    monkeypatch.setenv(file_io.PLAIN_COPY_ENV, "1")
    src = LAYOUTS[layout](tmp_path / "in")
    out = tmp_path / "out" if layout == "genai" else tmp_path / "out" / "m.onnx"
    total = sum(p.stat().st_size for p in (tmp_path / "in").rglob("*") if p.is_file() and p.suffix != ".onnx")
    total -= (tmp_path / "in" / "genai_config.json").stat().st_size if layout == "genai" else 0
    err = FakeTerminal() if terminal.startswith("tty") else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    flags = ["--no-progress"] if "--no-progress" in terminal else []
    args = ["convert", str(src), str(out), "--format", "int8", "--scales", str(scale_file), *flags]
    assert main(args) == 0
    shown = err.getvalue()
    if terminal == "tty":  # what was copied (every file but the graph and config), then cleared
        bar = f"weights:   0%|          | 0.00/{tqdm.format_sizeof(total, divisor=1024)}"
        assert bar in shown, shown
        assert shown.endswith("\r") and shown.rstrip("\r").endswith(" ")  # leave=False: the line is cleared
    else:
        assert "weights:" not in shown and "%|" not in shown, shown


def test_other_folder_gets_every_shard_under_its_own_names(tmp_path):
    src = save_external(tmp_path / "in", shard=600_000)
    shards = sorted(data_locations(src))
    assert len(shards) > 1
    result = convert_model(src, tmp_path / "out" / "m.onnx", format="int4", scales=SCALES)
    n = len(shards)
    names = [f"m.onnx-{i:05d}-of-{n:05d}.data" for i in range(1, n + 1)]
    assert sorted(data_locations(result.model_file)) == names == result.data_files
    assert sorted(os.listdir(tmp_path / "out")) == sorted(["m.onnx", *names])
    assert result.weight_bytes == sum((tmp_path / "in" / s).stat().st_size for s in shards)
    assert_loads_everywhere(result.model_file, ir.DataType.UINT8)


def test_inline_weights_stay_inline(tmp_path):
    src = tmp_path / "inline.onnx"
    ir.save(build_decoder(num_layers=2), src)
    result = convert_model(src, tmp_path / "out" / "inline.int8.onnx", format="int8", scales=SCALES)
    assert not data_locations(result.model_file) and os.listdir(tmp_path / "out") == ["inline.int8.onnx"]
    assert result.weights_summary() == "weights: inline in the graph"


def test_a_70b_sized_weight_in_a_sparse_file_is_never_read_and_stays_sparse(tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()

    def factory(name, shape, dtype):
        if name == "model.embed_tokens.weight":
            shape = (3 * 1024**3 // 2 // 128, 128)
        return ir.ExternalTensor(
            "weights.bin",
            0,
            int(np.prod(shape) * dtype.itemsize),
            dtype,
            shape=ir.Shape(shape),
            name=name,
            base_dir=folder,
        )

    with open(folder / "weights.bin", "wb") as f:
        f.truncate(3 * 1024**3)
    model = build_decoder(num_layers=2, dtype="float16", weight_factory=factory)
    (folder / "model.onnx").write_bytes(ir.to_proto(model).SerializeToString())
    with pytest.warns(UnitScalesWarning, match="unit scales"):
        result = convert_model(folder / "model.onnx", tmp_path / "out" / "model.onnx", format="fp8")
    assert result.target == "cuda" and result.target_source == "assumed: a float16 model"
    copy = tmp_path / "out" / "model.onnx.data"
    assert copy.stat().st_size == 3 * 1024**3 and file_io.allocated_bytes(copy) < 2**20
    assert result.weight_bytes_written == 0 and result.bytes_written < 1_000_000
    assert ir.load(result.model_file).graph.inputs[2].dtype == ir.DataType.FLOAT8E4M3FN


def test_in_place_without_a_config_change_keeps_the_file_name(tmp_path):
    src = genai(tmp_path / "g", share_buffer=False)
    config_before = (src / "genai_config.json").read_bytes()
    result = convert_model(src, in_place=True, format="int8", scales=SCALES)
    assert result.model_file == src / "model.onnx" and not result.notes
    assert (src / "genai_config.json").read_bytes() == config_before
    assert_loads_everywhere(src, ir.DataType.INT8)


def test_in_place_twice_alternates_nothing_and_leaves_no_stray_file(tmp_path):
    src = genai(tmp_path / "g")
    convert_model(src, in_place=True, format="int8", scales=SCALES)
    convert_model(src, in_place=True, format="int8", scales=SCALES, ep="cpu")  # scales update
    assert sorted(os.listdir(src)) == [
        "genai_config.json",
        "model.int8.onnx",
        "model.onnx.data",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_overwrite_replaces_exactly_the_previous_output(tmp_path, monkeypatch):
    monkeypatch.setenv(file_io.PLAIN_COPY_ENV, "1")
    src = save_external(tmp_path / "in")
    out = tmp_path / "out" / "m.onnx"
    convert_model(src, out, format="int8", scales=SCALES)
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(KvCacheError, match="overwrite=True"):
        convert_model(src, out, format="int8", scales=SCALES)
    second = convert_model(src, out, format="int4", scales=SCALES, overwrite=True)
    # the new data never replaced the old file under the old graph: it took a free name
    assert second.data_files == ["m.onnx.2.data"]
    assert sorted(os.listdir(tmp_path / "out")) == ["m.onnx", "m.onnx.2.data", "notes.txt"]
    assert_loads_everywhere(out, ir.DataType.UINT8)
    convert_model(src, out, format="int8", scales=SCALES, overwrite=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["m.onnx", "m.onnx.data", "notes.txt"]

    genai_src = genai(tmp_path / "g")
    (tmp_path / "gout").mkdir()
    (tmp_path / "gout" / "holiday.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(KvCacheError, match="not an output of onnx-kvcache"):
        convert_model(genai_src, tmp_path / "gout", format="int8", scales=SCALES, overwrite=True)
    assert (tmp_path / "gout" / "holiday.jpg").exists()
    convert_model(genai_src, tmp_path / "gout2", format="int8", scales=SCALES)
    convert_model(genai_src, tmp_path / "gout2", format="int4", scales=SCALES, overwrite=True)
    assert_loads_everywhere(tmp_path / "gout2", ir.DataType.UINT8)
    assert_no_temporary_entries(tmp_path)


def _copy_as(name):
    return lambda own: shutil.copy(own, own.parent / name)


def _linked_graph(own):  # a link in the folder to a graph elsewhere: loaded through it, it names our data
    shutil.copy(own, own.parent.parent / "elsewhere.onnx")
    (own.parent / "linked.onnx").symlink_to(own.parent.parent / "elsewhere.onnx")


NAMERS = {  # files that could be a graph naming the old output's data: it stays, and the run says why
    "sibling.onnx": _copy_as("sibling.onnx"),
    "model.own.onnx.bak": _copy_as("model.own.onnx.bak"),  # only lowercase *.onnx files were checked
    "backup.ONNX": _copy_as("backup.ONNX"),
    "backup": _copy_as("backup"),
    "linked.onnx": _linked_graph,
}
NOT_NAMERS = {  # files no tool loads as a graph naming it, so it goes
    "notes.txt": lambda own: (own.parent / "notes.txt").write_text("weights: model.own.onnx.data\n"),
    "other.onnx": lambda own: (own.parent / "other.onnx").write_bytes(NOT_LOADABLE + b"model.own.onnx.data"),
    "empty.onnx": lambda own: (own.parent / "empty.onnx").write_bytes(b""),
    "alias.onnx": lambda own: (own.parent / "alias.onnx").symlink_to("model.own.onnx"),  # the output itself
    "sub/model.own.onnx": lambda own: (own.parent / "sub").mkdir() or shutil.copy(own, own.parent / "sub"),
}


@pytest.mark.parametrize("neighbour", [*NAMERS, *NOT_NAMERS])
def test_overwrite_keeps_the_old_data_while_another_file_may_name_it_and_says_so(tmp_path, capsys, neighbour):
    """model.onnx.bak, backup.ONNX and the like used to lose their data file (only lowercase
    *.onnx files were checked), and a data file kept for a sibling was kept silently."""
    folder = tmp_path / "f"
    src = save_external(folder)
    own = folder / "model.own.onnx"
    convert_model(src, own, format="int8", scales=SCALES, weights="copy")
    (NAMERS | NOT_NAMERS)[neighbour](own)
    kept = neighbour in NAMERS
    args = ["convert", str(src), str(own), "--format", "int4", "--scales", str(_scales(tmp_path))]
    assert main([*args, "--overwrite"]) == 0  # shares model.onnx.data now
    out = capsys.readouterr().out.splitlines()
    assert (folder / "model.own.onnx.data").exists() == kept
    if kept:
        assert out[-2:] == [f"replaced {own}.", f"kept model.own.onnx.data: {neighbour} names it."], out
        graph = folder / neighbour
        onnx.load(graph)  # with its data
        onnxruntime_session(graph)
    else:
        assert out[-1] == f"replaced {own} and removed its own data file(s): model.own.onnx.data.", out
    assert_loads_everywhere(own, ir.DataType.UINT8)


def test_a_file_protobuf_cannot_parse_is_never_read_through(tmp_path, monkeypatch):
    """A weights file fails the wire-format check within a few bytes; one over 2 GiB is not opened."""
    from onnx_kvcache.files import _marker as previous

    folder = tmp_path / "f"
    src = save_external(folder)
    own = folder / "model.own.onnx"
    convert_model(src, own, format="int8", scales=SCALES, weights="copy")
    with open(folder / "huge.bin", "wb") as f:  # sparse: 3 GiB that occupy nothing
        f.truncate(3 * 2**30)
    (folder / "random.bin").write_bytes(np.random.default_rng(0).bytes(4 * MiB) + b"model.own.onnx.data")
    opened, read = [], []

    class Spy(io.FileIO):
        def __init__(self, path, mode="r"):
            opened.append(pathlib.Path(path).name)
            super().__init__(path, mode)

        def read(self, n=-1):
            data = super().read(n)
            if str(self.name).endswith("random.bin"):
                read.append(len(data))
            return data

    monkeypatch.setattr(previous, "open", Spy, raising=False)
    result = convert_model(src, own, format="int4", scales=SCALES, overwrite=True)
    assert "huge.bin" not in opened and "random.bin" in opened
    assert 0 < sum(read) < 64  # field headers only: the weights were not read through
    assert not (folder / "model.own.onnx.data").exists() and not any("kept" in n for n in result.notes)


def onnxruntime_session(graph):
    import onnxruntime as ort

    return ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])


# -- overwrite: a previous output of onnx-kvcache, nothing else -------------------------

MARKER = "onnx_kvcache.converted"
NOT_LOADABLE = b"not an ONNX model\n"  # no protobuf parser accepts it (wire type 6)


def marker_of(path: pathlib.Path) -> dict | None:
    graph, _ = resolve_model_path(path)
    props = {p.key: p.value for p in onnx.load(graph, load_external_data=False).metadata_props}
    return json.loads(props[MARKER]) if MARKER in props else None


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
    args = ["convert", str(src), str(out), "--format", "int8", "--scales", str(_scales(tmp_path))]
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
    args = ["convert", str(src), str(out), "--format", "int8", "--scales", str(_scales(tmp_path))]
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
    args = ["convert", str(src), str(out), "--format", "int4", "--scales", str(_scales(tmp_path))]
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
from onnx_kvcache.files import _atomic as _file_io
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
    scales = _scales(tmp_path)
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
        assert main([*argv, "--format", "int8", "--scales", str(_scales(tmp_path))]) == 2
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
    assert main(["convert", str(snap), str(out), "--format", "int8", "--scales", str(_scales(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "Hugging Face cache snapshot" in err and "--follow-symlinks" in err and err.count("\n") == 1
    assert not out.exists()
    args = ["convert", str(snap), str(out), "--format", "int8", "--scales", str(_scales(tmp_path))]
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
    args = ["convert", str(src), "--format", "int8", "--scales", str(_scales(tmp_path)), *flag]
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


def _scales(tmp_path) -> pathlib.Path:
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.05, 0.05]}, "qmax": 128}))
    return path


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
    assert main([*args, "--scales", str(_scales(tmp_path))]) == 2
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
            "a file the input uses",
        ),
        (lambda t: ["convert", f"{t}/parent/f/model.onnx", f"{t}/parent/f", "--overwrite"], "is a folder"),
        (
            lambda t: ["convert", f"{t}/parent/f/model.onnx", f"{t}/parent/notes.txt", "--overwrite"],
            ".onnx file",
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
    scales = ["--format", "int8", "--scales", str(_scales(tmp_path))]
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
    args += ["--scales", str(_scales(tmp_path))]
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
                str(_scales(tmp_path)),
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
    assert main([*args, "--scales", str(_scales(tmp_path))]) == 2
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
    text = capsys.readouterr().out
    assert "not eligible" in text and "head size 32" in text and "share one buffer" in text


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


# -- kill tests: SIGINT, SIGTERM, SIGKILL at random moments ----------------------------

MiB = 2**20
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
    _scales(folder.parent)
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
    assert json.loads((out / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is False


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
    _scales(folder.parent)
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
            assert name == "model.int8.onnx" and config["search"]["past_present_share_buffer"] is False
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


@pytest.mark.parametrize(("qmax", "fmt"), [(448.0, "fp8"), (128.0, "int8"), (8.0, "int4")])
def test_the_format_defaults_to_the_one_the_scales_were_made_for(tmp_path, qmax, fmt):
    path = tmp_path / "model.onnx"
    ir.save(build_decoder(num_layers=2, dtype="float16"), path)
    scales = tmp_path / "s.json"
    scales.write_text(
        json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.05, 0.05]}, "qmax": qmax})
    )
    result = convert_model(path, tmp_path / "out.onnx", scales=scales)
    assert result.format == fmt
    assert KvCacheRunner(result.model_file).bindings[0].format.name == fmt


@pytest.mark.parametrize(("ep", "share"), [("cuda", True), ("cpu", False), ("openvino", False)])
def test_past_present_share_buffer_follows_the_capability_table(tmp_path, ep, share):
    folder = save_genai_folder(tmp_path / "g", num_layers=2, vocab_size=300, dtype="float16")
    out = tmp_path / ep
    stale = ep == "openvino"  # no provider_options genai's builder writes for it: left, with a warning
    with (
        pytest.warns(GenaiConfigWarning, match="provider_options name cpu, not openvino")
        if stale
        else nullcontext()
    ):
        convert_model(folder, out, format="int8", scales={0: (0.1, 0.05), 1: (0.1, 0.05)}, ep=ep)
    assert json.loads((out / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is share


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (
            {"format": "fp8"},
            "not converted to fp8 per_tensor for cuda: cuda's GroupQueryAttention takes queries",
        ),
        ({"format": "fp8", "ep": "cuda"}, "cuda's GroupQueryAttention takes queries of"),
        ({"format": "fp8", "ep": "cpu"}, "KV cache not converted to fp8 per_tensor for cpu: cpu has no"),
    ],
)
def test_a_refused_conversion_warns_writes_nothing_and_raises_when_strict(tmp_path, kwargs, reason):
    from onnx_kvcache import NotConvertedWarning, build_decoder

    source = tmp_path / "m.onnx"
    ir.save(build_decoder(num_layers=1), source)  # float32: fp8 is CUDA's, which takes fp16/bf16
    with pytest.warns(NotConvertedWarning, match=reason):
        result = convert_model(source, tmp_path / "o.onnx", **kwargs)
    assert not result.converted and reason.split(": ")[-1] in " ".join(result.reasons)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    with pytest.raises(KvCacheError, match=reason):
        convert_model(source, tmp_path / "o.onnx", strict=True, **kwargs)


@pytest.mark.parametrize(("dtype", "fmt"), [("float32", "int8"), ("float16", "fp8")])
def test_without_a_format_or_scales_the_target_picks_the_format(tmp_path, dtype, fmt):
    from onnx_kvcache import build_decoder

    ir.save(build_decoder(num_layers=1, dtype=dtype), tmp_path / "m.onnx")
    if fmt == "int8":  # cpu runs int8, which needs calibrated scales
        with pytest.raises(KvCacheError, match="The int8 KV cache needs calibrated scales"):
            convert_model(tmp_path / "m.onnx", tmp_path / "o.onnx")
        result = convert_model(tmp_path / "m.onnx", tmp_path / "o.onnx", scales={0: (0.05, 0.05)})
    else:
        with pytest.warns(UnitScalesWarning, match="unit scales"):
            result = convert_model(tmp_path / "m.onnx", tmp_path / "o.onnx")
    assert result.converted and result.format == fmt


@pytest.mark.parametrize(
    ("provider", "first", "second", "ep", "options"),
    [
        ("cpu", "int8", "fp8", "cuda", [{"cuda": {}}]),  # [] would run the fp8 cache on CPU: fails
        ("cuda", "fp8", "int8", "cpu", []),  # the user asked for CPU: genai must not pick CUDA
        ("cpu", "int8", "int4", "cpu", []),  # the same provider: left as it was
    ],
)
def test_a_requantized_folders_provider_options_follow_the_ep_given(
    tmp_path, provider, first, second, ep, options
):
    from onnx_kvcache import KvCacheScales

    def scales(fmt: str) -> KvCacheScales:
        return KvCacheScales.from_mapping({0: (0.02, 0.03), 1: (0.025, 0.035)}, format=fmt)

    folder = save_genai_folder(tmp_path / "in", num_layers=2, provider=provider, dtype="float16")
    convert_model(folder, tmp_path / "first", format=first, scales=scales(first), ep=provider)
    with warnings.catch_warnings():  # int4 needs an int4 build, fp8 an SM 8.9 GPU: said, not tested here
        warnings.simplefilter("ignore", KvCacheWarning)
        result = convert_model(
            tmp_path / "first", tmp_path / "second", format=second, scales=scales(second), ep=ep
        )
    config = json.loads((tmp_path / "second" / "genai_config.json").read_text())
    assert config["model"]["decoder"]["session_options"]["provider_options"] == options
    assert any("provider_options now name" in n for n in result.notes) == (provider != ep)
    if ep == "cpu":
        og_generate(tmp_path / "second", [1, 2, 3], 2)  # og.Model loads and runs it on CPU


@pytest.mark.parametrize(("first", "second"), [("fp8", "int4"), ("int4", "int8"), ("int8", "int8")])
def test_in_place_requantizing_names_the_graph_after_its_new_format(tmp_path, first, second):
    """In place, a genai folder's graph is named after its format (the config names it), also
    when the config needs no other change (fp8 -> int4 on CUDA both share buffers)."""
    from onnx_kvcache import KvCacheScales

    folder = save_genai_folder(tmp_path / "in", num_layers=2, provider="cuda", dtype="float16")
    for fmt in (first, second):
        scales = KvCacheScales.from_mapping({0: (0.02, 0.03), 1: (0.025, 0.035)}, format=fmt)
        with warnings.catch_warnings():  # int4 needs an int4 build, fp8 an SM 8.9 GPU: said, not tested here
            warnings.simplefilter("ignore", KvCacheWarning)
            result = convert_model(folder, format=fmt, scales=scales, ep="cuda", in_place=True)
    config = json.loads((folder / "genai_config.json").read_text())
    assert result.model_file.name == config["model"]["decoder"]["filename"] == f"model.{second}.onnx"
    assert sorted(p.name for p in folder.glob("*.onnx")) == [f"model.{second}.onnx"]
    onnx.load(folder / f"model.{second}.onnx")


@pytest.mark.parametrize(
    ("layout", "hint"),
    [
        (
            {"onnx/model.onnx", "onnx/model_fp16.onnx"},
            r"its onnx/ subfolder .* holds model\.onnx, model_fp16\.onnx",
        ),
        ({"a.onnx", "b.onnx"}, r"with 2 \.onnx files \(a\.onnx, b\.onnx\)"),
    ],
    ids=["onnx_community", "two_at_the_root"],
)
def test_a_folder_without_one_model_names_the_files_it_found(tmp_path, layout, hint):
    from onnx_kvcache import build_decoder

    folder = tmp_path / "m"
    (folder / "onnx").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    for name in layout:
        ir.save(build_decoder(num_layers=1), folder / name)
    with pytest.raises(KvCacheError, match=hint):
        convert_model(folder, tmp_path / "out", format="int8", ep="cpu")
    assert not (tmp_path / "out").exists()
