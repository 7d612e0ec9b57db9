"""Converting files and genai folders: no weight copies, links, atomic writes, safety."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheRunner, KvCacheWarning, convert_model
from onnx_kvcache.cli import main
from onnx_kvcache.demo_model import build_decoder

SCALES = {0: (0.05, 0.04), 1: (0.06, 0.05)}


def save_external(folder: pathlib.Path, name="model.onnx", shard: int | None = None) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    ir.save(
        build_decoder(num_layers=2),
        path,
        external_data=f"{name}.data",
        size_threshold_bytes=1024,
        max_shard_size_bytes=shard,
    )
    return path


def genai_folder(folder: pathlib.Path, filename="decoder.onnx") -> pathlib.Path:
    save_external(folder, filename)
    config = {
        "model": {"decoder": {"filename": filename, "num_hidden_layers": 2}},
        "search": {"past_present_share_buffer": True, "max_length": 64},
    }
    (folder / "genai_config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def data_locations(model_file: pathlib.Path) -> set[str]:
    proto = onnx.load(model_file, load_external_data=False)
    return {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}


def test_beside_the_input_reuses_the_data_file(tmp_path):
    src = save_external(tmp_path)
    before = snapshot(tmp_path)
    result = convert_model(src, tmp_path / "model.int8.onnx", format="int8", scales=SCALES)
    assert data_locations(result.model_file) == {"model.onnx.data"}
    assert result.bytes_written == result.model_file.stat().st_size < 100_000
    assert not result.linked and not result.copied
    assert {k: v for k, v in snapshot(tmp_path).items() if k in before} == before
    runner = KvCacheRunner(result.model_file)
    assert np.isfinite(runner.prefill([1, 2, 3])).all() and runner.cache_dtype == ir.DataType.INT8


@pytest.mark.parametrize("mode", ["link", "copy"])
def test_other_folder_links_or_copies_every_shard(tmp_path, mode):
    src = save_external(tmp_path / "in", shard=600_000)
    shards = data_locations(src)
    assert len(shards) > 1
    result = convert_model(src, tmp_path / "out" / "m.onnx", format="int4", scales=SCALES, weights=mode)
    assert data_locations(result.model_file) == shards
    for name in shards:
        a, b = (tmp_path / "in" / name).stat(), (tmp_path / "out" / name).stat()
        assert (a.st_ino == b.st_ino) == (mode == "link")
    assert result.bytes_written == result.model_file.stat().st_size + (
        sum((tmp_path / "in" / n).stat().st_size for n in shards) if mode == "copy" else 0
    )
    KvCacheRunner(result.model_file).prefill([5, 6])


def test_link_falls_back_to_symlink(tmp_path, monkeypatch):
    src = save_external(tmp_path / "in")

    def no_hardlinks(*args, **kwargs):
        raise OSError("cross-device link")

    monkeypatch.setattr(os, "link", no_hardlinks)
    result = convert_model(src, tmp_path / "out" / "m.onnx", format="int8", scales=SCALES)
    assert (tmp_path / "out" / "model.onnx.data").is_symlink() and result.linked


def test_genai_folder_round_trip(tmp_path):
    src = genai_folder(tmp_path / "in")
    before = snapshot(src)
    result = convert_model(src, tmp_path / "out", format="int8", scales=SCALES)
    out = tmp_path / "out"
    assert result.model_file == out / "decoder.onnx"
    assert sorted(snapshot(out)) == sorted(before)
    config = json.loads((out / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is False and config["search"]["max_length"] == 64
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert snapshot(src) == before
    runner = KvCacheRunner(out)
    assert runner.cache_dtype == ir.DataType.INT8 and runner.generate([1, 2, 3], 4)


def test_genai_folder_for_cuda_keeps_buffer_sharing(tmp_path):
    src = genai_folder(tmp_path / "in")
    convert_model(src, tmp_path / "out", format="fp8", scales=SCALES)
    assert json.loads((tmp_path / "out" / "genai_config.json").read_text())["search"][
        "past_present_share_buffer"
    ]


def test_in_place_and_output_rules(tmp_path):
    src = genai_folder(tmp_path / "in")
    with pytest.raises(KvCacheError, match="is the input"):
        convert_model(src, src, format="int8", scales=SCALES)
    (tmp_path / "taken").mkdir()
    with pytest.raises(KvCacheError, match="--overwrite"):
        convert_model(src, tmp_path / "taken", format="int8", scales=SCALES)
    convert_model(src, tmp_path / "taken", format="int8", scales=SCALES, overwrite=True)
    assert (tmp_path / "taken" / "decoder.onnx").is_file()
    data_before = (src / "decoder.onnx.data").read_bytes()
    convert_model(src, in_place=True, format="int8", scales=SCALES, ep="cpu")
    assert ir.load(src / "decoder.onnx").graph.inputs[2].dtype == ir.DataType.INT8
    assert (src / "decoder.onnx.data").read_bytes() == data_before
    assert json.loads((src / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is False


@pytest.mark.filterwarnings("ignore::onnx_kvcache.errors.KvCacheWarning")
def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    import shutil

    src = genai_folder(tmp_path / "in")
    before = snapshot(tmp_path)
    real_copy = shutil.copy2
    calls = []

    def failing_copy(a, b, *args, **kwargs):
        calls.append(a)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_copy(a, b, *args, **kwargs)

    monkeypatch.setattr(shutil, "copy2", failing_copy)
    with pytest.raises(OSError, match="No space"):
        convert_model(src, tmp_path / "out", format="int8", scales=SCALES)
    assert snapshot(tmp_path) == before and not list(tmp_path.glob(".out*"))


def test_failure_writing_the_model_file_leaves_nothing(tmp_path, monkeypatch):
    src = save_external(tmp_path / "in")
    before = snapshot(tmp_path)
    real_replace = os.replace

    def failing_replace(a, b):
        if str(b).endswith("m.onnx"):
            raise KeyboardInterrupt
        return real_replace(a, b)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(KeyboardInterrupt):
        convert_model(src, tmp_path / "in" / "m.onnx", format="int8", scales=SCALES)
    assert snapshot(tmp_path) == before


def test_bad_scales_write_nothing(tmp_path):
    src = genai_folder(tmp_path / "in")
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


def test_inline_weights_stay_inline(tmp_path):
    src = tmp_path / "inline.onnx"
    ir.save(build_decoder(num_layers=2), src)
    result = convert_model(src, tmp_path / "out" / "inline.int8.onnx", format="int8", scales=SCALES)
    assert not data_locations(result.model_file) and sorted(os.listdir(tmp_path / "out")) == [
        "inline.int8.onnx"
    ]


def test_larger_than_2gib_external_data_is_never_read(tmp_path):
    """A 3 GiB weight in a sparse file: the conversion writes only the graph."""
    folder = tmp_path / "big"

    def factory(name, shape, dtype):
        if name == "model.embed_tokens.weight":
            shape = (3 * 1024**3 // 2 // 128, 128)
        return ir.ExternalTensor(
            "weights.bin",
            offset=0,
            length=int(np.prod(shape) * dtype.itemsize),
            dtype=dtype,
            shape=ir.Shape(shape),
            name=name,
            base_dir=folder,
        )

    folder.mkdir()
    with open(folder / "weights.bin", "wb") as f:
        f.truncate(3 * 1024**3)
    model = build_decoder(num_layers=2, dtype="float16", weight_factory=factory)
    (folder / "model.onnx").write_bytes(ir.to_proto(model).SerializeToString())
    with pytest.warns(KvCacheWarning, match="unit scales"):
        result = convert_model(folder / "model.onnx", tmp_path / "out" / "model.onnx", format="fp8")
    assert result.bytes_written < 1_000_000
    assert (tmp_path / "out" / "weights.bin").stat().st_ino == (folder / "weights.bin").stat().st_ino
    assert ir.load(result.model_file).graph.inputs[2].dtype == ir.DataType.FLOAT8E4M3FN


def test_inspect_reads_folders_and_reports_context_bytes(tmp_path, capsys):
    src = genai_folder(tmp_path / "in")
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


def test_when_no_link_works_the_error_suggests_copy(tmp_path, monkeypatch):
    src = save_external(tmp_path / "in")

    def refuse(*args, **kwargs):
        raise OSError("operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    monkeypatch.setattr(os, "symlink", refuse)
    with pytest.raises(KvCacheError, match="--weights copy"):
        convert_model(src, tmp_path / "out" / "m.onnx", format="int8", scales=SCALES)
    assert not (tmp_path / "out" / "m.onnx").exists() and not list((tmp_path / "out").glob("*"))


@pytest.mark.parametrize(("extra", "code", "message"), [([], 1, "not converted"), (["--strict"], 2, "error")])
def test_cli_gating_writes_nothing(tmp_path, capsys, extra, code, message):
    src = save_external(tmp_path / "in")
    out = tmp_path / "out.onnx"
    assert main(["convert", str(src), str(out), "--format", "fp8", "--ep", "cpu", *extra]) == code
    err = capsys.readouterr().err
    assert message in err and "no GroupQueryAttention kernel for a fp8 cache" in err
    assert not out.exists()


def test_failure_after_linking_data_elsewhere_leaves_nothing(tmp_path, monkeypatch):
    src = save_external(tmp_path / "in", shard=600_000)
    (tmp_path / "out").mkdir()
    real_replace = os.replace

    def fail_on_model(a, b):
        if str(b).endswith("m.onnx"):
            raise OSError(28, "No space left on device")
        return real_replace(a, b)

    monkeypatch.setattr(os, "replace", fail_on_model)
    with pytest.raises(OSError, match="No space"):
        convert_model(src, tmp_path / "out" / "m.onnx", format="int8", scales=SCALES)
    assert list((tmp_path / "out").iterdir()) == []
