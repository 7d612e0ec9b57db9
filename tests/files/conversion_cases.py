"""The models, layouts and checks the conversion tests share (users' layouts, loading everywhere)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheRunner
from onnx_kvcache.model_io._atomic import TEMP_PREFIX
from onnx_kvcache.model_io.genai_folder import resolve_model_path
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


def genai(folder: pathlib.Path, data="model.onnx.data", share_buffer=False) -> pathlib.Path:
    """An onnxruntime-genai folder (tokenizer included) as genai's builder leaves a CPU build
    (past and present apart: converting it for the CPU changes its config)."""
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


MARKER = "onnx_kvcache.converted"
NOT_LOADABLE = b"not an ONNX model\n"  # no protobuf parser accepts it (wire type 6)


def marker_of(path: pathlib.Path) -> dict | None:
    graph, _ = resolve_model_path(path)
    props = {p.key: p.value for p in onnx.load(graph, load_external_data=False).metadata_props}
    return json.loads(props[MARKER]) if MARKER in props else None


def unit_scales(tmp_path) -> pathlib.Path:
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.05, 0.05]}, "qmax": 128}))
    return path


MiB = 2**20
