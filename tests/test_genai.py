"""The bundled decoder as an onnxruntime-genai folder, converted and run by onnxruntime-genai."""

from __future__ import annotations

import json
import pathlib

import pytest

from onnx_kvcache import KvCacheRunner, calibrate_kv_cache, convert_model, inspect_kv_cache
from onnx_kvcache.errors import RuntimeSupportWarning
from onnx_kvcache.models.decoder import save_genai_folder

from conftest import og_generate

og = pytest.importorskip("onnxruntime_genai", reason="install the genai extra (CI does)")

PROMPT = list(b"The river town woke before the sun.")


def runner_generate(folder, prompt, n):
    """The runner's greedy tokens; onnxruntime-genai leaves a final EOS out of its sequence."""
    tokens = KvCacheRunner(folder).generate(prompt, n)
    return tokens[:-1] if tokens and tokens[-1] == 257 else tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_genai_folder(tmp_path_factory.mktemp("genai") / "demo", num_layers=2)


def test_folder_tokenizer_matches_the_byte_fallback(folder):
    tokenizer = og.Tokenizer(og.Model(str(folder)))
    assert [int(t) for t in tokenizer.encode("héllo")] == list("héllo".encode())
    config = json.loads((folder / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == "model.onnx"


@pytest.mark.parametrize(
    ("fmt", "granularity", "rotation"),
    [
        ("int8", "per_tensor", "none"),
        ("int8", "per_channel", "keys"),
        ("int4", "per_channel", None),  # int4's default: keys_and_values
        ("int4", "per_tensor", "none"),
    ],
)
def test_converted_folder_generates_like_the_runner(folder, tmp_path, fmt, granularity, rotation):
    scales = calibrate_kv_cache(
        folder, format=fmt, granularity=granularity, method="minmax", rotation=rotation, progress=False
    )
    out = tmp_path / f"{fmt}-{granularity}"
    result = convert_model(folder, out, format=fmt, granularity=granularity, scales=scales)
    assert result.rotation == (rotation or "keys_and_values")  # as the scales record
    assert {layer.rotation for layer in inspect_kv_cache(out).layers} == {result.rotation}
    assert json.loads((out / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is True
    tokens = og_generate(out, PROMPT, 16)  # past and present in one buffer, as genai binds them
    assert len(tokens) >= 4 and tokens == runner_generate(out, PROMPT, 16)


def test_a_genai_builder_folder_rotated_generates_like_the_runner(tmp_path):
    """genai's own build (RoPE inside GroupQueryAttention), rotated and quantized to int4."""
    source = pathlib.Path(__file__).parent / "data/producers/genai-builder/genai-builder-cpu-fp32/llama"
    data = [[(7 * i + 3 * j) % 128 for j in range(64)] for i in range(6)]
    scales = calibrate_kv_cache(
        source, data, format="int4", granularity="per_channel", seq_len=64, progress=False
    )
    out = tmp_path / "rotated"
    assert convert_model(source, out, scales=scales).rotation == "keys_and_values"
    prompt = [1, 72, 101, 108, 108, 111, 33]
    tokens = og_generate(out, prompt, 12)
    assert len(tokens) >= 4 and tokens == runner_generate(out, prompt, 12)


def test_original_folder_generates_like_the_runner(folder):
    tokens = og_generate(folder, PROMPT, 16)
    assert len(tokens) >= 4 and tokens == runner_generate(folder, PROMPT, 16)


@pytest.fixture(scope="module")
def paged_folder(tmp_path_factory):
    return save_genai_folder(
        tmp_path_factory.mktemp("paged") / "demo", num_layers=2, paged=True, dtype="float16"
    )


@pytest.mark.parametrize(
    ("fmt", "granularity"), [("fp8", "per_tensor"), ("int8", "per_channel"), ("int4", "per_channel")]
)
def test_paged_folders_load_everywhere_they_can_on_cpu(paged_folder, tmp_path, fmt, granularity):
    """onnx, onnx-ir and onnxruntime-genai read the paged folder and its conversion; genai and
    onnxruntime stop only at PagedAttention, which has no CPU kernel."""
    import onnx
    import onnx_ir as ir

    from onnx_kvcache.model_io._sessions import create_session

    scales = calibrate_kv_cache(paged_folder, format=fmt, granularity=granularity, progress=False)
    out = tmp_path / "converted"
    kwargs = {
        "format": fmt,
        "granularity": granularity,
        "scales": scales,
        "weights": "copy",
    }  # onnx refuses hard links
    if fmt == "int4":
        with pytest.warns(RuntimeSupportWarning, match="int4 KV-cache option"):
            convert_model(paged_folder, out, **kwargs)
    else:
        convert_model(paged_folder, out, **kwargs)
    config = json.loads((out / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is True  # paged caches are updated in place
    assert config["engine"]["dynamic_batching"]["block_size"] == 16
    for folder in (paged_folder, out):
        onnx.checker.check_model(onnx.load(folder / "model.onnx"))
        loaded = ir.load(folder / "model.onnx")
        assert all(v.const_value.numpy() is not None for v in loaded.graph.initializers.values())
        with pytest.raises(Exception, match="implementation for PagedAttention"):
            create_session(folder / "model.onnx")
        config = og.Config(str(folder))
        config.clear_providers()
        with pytest.raises(Exception, match="implementation for PagedAttention"):
            og.Model(config)


GENAI_GEMMA2 = (
    pathlib.Path(__file__).parent
    / "data"
    / "producers"
    / "genai-builder"
    / "genai-builder-cpu-fp32"
    / "gemma2"
)


@pytest.mark.parametrize("ep", ["cpu", None])
def test_a_window_sized_cache_keeps_sharing_its_buffer_so_genai_runs_it(tmp_path, ep):
    """genai's builder writes Gemma-2's window layers with sliding_window_cache=1; onnxruntime-
    genai allocates such a cache window-sized only when past and present share one buffer, and
    otherwise feeds an empty past that GroupQueryAttention refuses ("KV cache capacity (0) must be
    at least local_window_size (4)"). The converted folder keeps sharing, and generates as the
    runner does."""
    out = tmp_path / "int8"
    scales = {0: (0.03, 0.03), 1: (0.03, 0.03)}
    convert_model(GENAI_GEMMA2, out, format="int8", scales=scales, **({"ep": ep} if ep else {}))
    assert json.loads((out / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is True
    prompt = [1, 72, 101, 108, 108, 111, 33]  # 7 tokens: past the 4-token window
    tokens = og_generate(out, prompt, 6)
    assert len(tokens) == 6 and tokens == KvCacheRunner(out).generate(prompt, 6)
