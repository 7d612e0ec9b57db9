"""Converting files and genai folders: where weights go, the load matrix, what the target decides.

Every output, and the original after it, must load in onnx (external data included),
onnx-ir (every weight), onnxruntime and, for folders, onnxruntime-genai.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import stat
import sys
import warnings
from contextlib import nullcontext

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheRunner, KvCacheWarning, __version__, convert_model
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import GenaiConfigWarning, UnitScalesWarning
from onnx_kvcache.model_io import _atomic as file_io
from onnx_kvcache.model_io.genai_folder import resolve_model_path
from onnx_kvcache.models.decoder import build_decoder, save_genai_folder

from conftest import og_generate
from conversion_cases import (
    LAYOUTS,
    NOT_LOADABLE,
    SCALES,
    MiB,
    assert_loads_everywhere,
    assert_no_temporary_entries,
    data_files,
    data_locations,
    genai,
    marker_of,
    save_external,
    scale_file,  # noqa: F401  (fixtures)
    snapshot,
    umask022,  # noqa: F401  (an autouse fixture)
    unit_scales,
)

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
        assert config["search"]["past_present_share_buffer"] is True  # int8 on cpu
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
        src = genai(tmp_path / "in", share_buffer=layout != "genai")  # False: the config changes
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
        assert new_config["search"]["past_present_share_buffer"] is True
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
    src = genai(tmp_path / "g", share_buffer=True)
    config_before = (src / "genai_config.json").read_bytes()
    result = convert_model(src, in_place=True, format="int8", scales=SCALES)
    assert result.model_file == src / "model.onnx"
    assert [n.split(":")[0] for n in result.notes] == ["prompt in float"]  # no config change said
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
    args = ["convert", str(src), str(own), "--format", "int4", "--scales", str(unit_scales(tmp_path))]
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
    from onnx_kvcache.model_io import _marker as previous

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


@pytest.mark.parametrize(("ep", "share"), [("cuda", True), ("cpu", True), ("openvino", False)])
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
        ({"format": "fp8", "ep": "cpu"}, "KV cache not converted to fp8 per_tensor for cpu: cpu has no"),
        ({"format": "int8", "ep": "dml"}, "KV cache not converted to int8 per_tensor for dml: dml has no"),
    ],
)
def test_a_refused_conversion_warns_writes_nothing_and_raises_when_strict(tmp_path, kwargs, reason):
    from onnx_kvcache.errors import NotConvertedWarning
    from onnx_kvcache.models.decoder import build_decoder

    source = tmp_path / "m.onnx"
    ir.save(build_decoder(num_layers=1), source)  # float32: fp8 is CUDA's, which takes fp16/bf16
    with pytest.warns(NotConvertedWarning, match=reason):
        result = convert_model(source, tmp_path / "o.onnx", **kwargs)
    assert not result.converted and reason.split(": ")[-1] in " ".join(result.reasons)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    with pytest.raises(KvCacheError, match=reason):
        convert_model(source, tmp_path / "o.onnx", strict=True, **kwargs)


@pytest.mark.parametrize("kwargs", [{"format": "fp8"}, {"format": "fp8", "ep": "cuda"}, {"ep": "cuda"}])
def test_a_float32_model_converts_to_fp8_for_cuda_with_its_attention_in_float16(tmp_path, kwargs):
    """CUDA has no float32 GroupQueryAttention: the attention computes in float16, one warning says so."""
    from onnx_kvcache import check_kv_cache_support
    from onnx_kvcache.errors import Float16AttentionWarning
    from onnx_kvcache.models.decoder import build_decoder

    source = tmp_path / "m.onnx"
    ir.save(build_decoder(num_layers=2), source)
    with pytest.warns(KvCacheWarning) as said:
        result = convert_model(source, tmp_path / "o.onnx", strict=True, **kwargs)
    assert result.converted and result.target == "cuda" and result.format == "fp8"
    assert [str(w.message).split(":")[0] for w in said if w.category is Float16AttentionWarning] == [
        "cuda has no float32 GroupQueryAttention"
    ]
    out = ir.load(tmp_path / "o.onnx")
    assert check_kv_cache_support(out, "cuda", "fp8").supported
    assert {v.dtype for v in out.graph.initializers.values() if v.name.startswith("model.")} == {
        ir.DataType.FLOAT
    }


@pytest.mark.parametrize(("dtype", "fmt"), [("float32", "int8"), ("float16", "fp8")])
def test_without_a_format_or_scales_the_target_picks_the_format(tmp_path, dtype, fmt):
    from onnx_kvcache.models.decoder import build_decoder

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
    if provider == "cpu" and ep == "cuda":  # review37: "(they named cpu)" after "names no provider"
        assert (
            "genai_config.json's provider_options now name cuda, the provider given (they named none: "
            "onnxruntime-genai's default, the CPU)."
        ) in result.notes
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
    from onnx_kvcache.models.decoder import build_decoder

    folder = tmp_path / "m"
    (folder / "onnx").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    for name in layout:
        ir.save(build_decoder(num_layers=1), folder / name)
    with pytest.raises(KvCacheError, match=hint):
        convert_model(folder, tmp_path / "out", format="int8", ep="cpu")
    assert not (tmp_path / "out").exists()
