"""An export folder (optimum-cli's: model.onnx, config.json, generation_config.json, tokenizer
files) converted into an onnxruntime-genai folder that onnxruntime-genai runs; the special
tokens the runner takes from such a folder."""

from __future__ import annotations

import json
import pathlib
import shutil
import warnings

import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheRunner, calibrate_kv_cache, convert_model
from onnx_kvcache.errors import GenaiConfigWarning, KvCacheError
from onnx_kvcache.files._export_folder import (
    ExportConfig,
    NoGenaiConfig,
    genai_config_for_export,
    read_export_config,
)
from onnx_kvcache.model_io._marker import check_replaceable_folder
from onnx_kvcache.scales.data import builtin_corpus

from conftest import og_generate

OPTIMUM = pathlib.Path(__file__).parents[1] / "data" / "optimum_llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _write_tokenizer(folder: pathlib.Path) -> None:
    """A byte-level BPE tokenizer of the export's 512 ids (<unk> 0, <s> 1, </s> 2, as its
    config.json says), trained with the tokenizers library, with the files optimum writes."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([builtin_corpus()], trainer)
    assert tok.get_vocab_size() == 512 and tok.token_to_id("</s>") == 2
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048, **special})
    )
    (folder / "special_tokens_map.json").write_text(json.dumps(special))


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """tests/data/optimum_llama with a tokenizer, as optimum-cli writes the folder."""
    folder = tmp_path_factory.mktemp("optimum") / "llama"
    shutil.copytree(OPTIMUM, folder)
    _write_tokenizer(folder)
    return folder


def _prompt(folder: pathlib.Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode("the boats went out").ids


def _convert(export: pathlib.Path, out: pathlib.Path, fmt: str, granularity: str, scales_of=None, **kwargs):
    """``export`` converted to ``out`` with scales calibrated on it (or on ``scales_of``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights' calibration data, the padding note
        scales = calibrate_kv_cache(scales_of or export, format=fmt, granularity=granularity, progress=False)
    return convert_model(export, out, format=fmt, granularity=granularity, scales=scales, ep="cpu", **kwargs)


@pytest.mark.parametrize(
    ("fmt", "granularity"), [("int8", "per_tensor"), ("int8", "per_channel"), ("int4", "per_channel")]
)
def test_a_converted_export_generates_in_onnxruntime_genai_as_the_runner(export, tmp_path, fmt, granularity):
    og = pytest.importorskip("onnxruntime_genai", reason="install the genai extra (CI does)")
    out = tmp_path / "genai"
    result = _convert(export, out, fmt, granularity)
    assert result.converted and result.nodes == 3
    assert any("genai_config.json written from config.json" in n for n in result.notes)
    for name in (*TOKENIZER_FILES, "config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (export / name).read_bytes()
    prompt = _prompt(export)
    assert [int(t) for t in og.Tokenizer(og.Model(str(out))).encode("the boats went out")] == prompt
    tokens = og_generate(out, prompt, 12)
    runner = KvCacheRunner(out)
    assert runner.eos_token_ids == {2}
    expected = runner.generate(prompt, 12)
    expected = expected[:-1] if expected and expected[-1] == 2 else expected  # genai leaves EOS out
    assert len(tokens) >= 4 and tokens == expected


def test_the_genai_config_is_made_from_the_graph_and_the_exports_configs(export, tmp_path):
    out = tmp_path / "genai"
    _convert(export, out, "int8", "per_tensor")
    config = json.loads((out / "genai_config.json").read_text())
    model, decoder = config["model"], config["model"]["decoder"]
    assert {k: model[k] for k in ("type", "context_length", "vocab_size", "bos_token_id")} == {
        "type": "llama",
        "context_length": 2048,  # max_position_embeddings
        "vocab_size": 512,
        "bos_token_id": 1,
    }
    assert (model["eos_token_id"], model["pad_token_id"]) == (2, 2)  # no pad id: the builder's eos
    assert decoder["filename"] == "model.onnx" and decoder["session_options"]["provider_options"] == []
    heads = ("head_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers")
    assert [decoder[k] for k in heads] == [32, 128, 4, 2, 3]
    assert decoder["inputs"] == {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "position_ids": "position_ids",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    assert decoder["outputs"] == {
        "logits": "logits",
        "present_key_names": "present.%d.key",
        "present_value_names": "present.%d.value",
    }
    search = config["search"]
    assert search["past_present_share_buffer"] is True  # a quantized cache on the CPU: one buffer
    assert (search["max_length"], search["do_sample"], search["num_beams"]) == (2048, False, 1)
    check_replaceable_folder(out)  # the marker lists genai_config.json: overwrite may replace it
    again = _convert(export, out, "int8", "per_channel", overwrite=True)
    assert again.converted and (out / "genai_config.json").exists()


OPTIMUM_CLI = pathlib.Path(__file__).parents[1] / "data" / "producers" / "optimum" / "optimum-cli"


@pytest.mark.parametrize(("family", "shares"), [("gemma2", False), ("gpt_oss", False), ("mistral", True)])
def test_an_export_counting_positions_from_its_cache_gets_no_shared_buffer(tmp_path, family, shares):
    """optimum's gemma2 and gpt-oss have no position_ids: they count positions from the past's
    length (Shape of past_key_values.0.key), which a shared buffer holds at the context's length.
    Their genai folders get separate buffers, and genai's tokens are the runner's; mistral's
    (position_ids given) shares one."""
    pytest.importorskip("onnxruntime_genai", reason="install the genai extra (CI does)")
    folder = tmp_path / family
    shutil.copytree(OPTIMUM_CLI / family, folder)
    out = tmp_path / "genai"
    assert _convert(folder, out, "int8", "per_tensor").converted
    assert (
        json.loads((out / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is shares
    )
    prompt = [1, 72, 101, 108, 108, 111, 33, 5, 9, 17, 23]
    tokens, expected = og_generate(out, prompt, 10), KvCacheRunner(out).generate(prompt, 10)
    assert len(tokens) >= 4 and tokens == expected[: len(tokens)]


def test_a_rolling_window_export_runs_in_onnxruntime_genai_as_the_runner(export, tmp_path):
    """transformers 5.x's rolling window cache (every layer keeps its last W - 1 tokens), fused into
    window-sized caches: genai_config.json names them, genai allocates and shares them, and genai's
    tokens are the runner's, past the window."""
    pytest.importorskip("onnxruntime_genai", reason="install the genai extra (CI does)")
    from builders.exported import ExportStyle, build_decoder, exported_config

    folder = tmp_path / "mistral"
    shutil.copytree(export, folder)
    style = ExportStyle(window_cache="cropped")
    config = exported_config("mistral", num_layers=2, vocab_size=512, sliding_window=4, exported=style)
    ir.save(build_decoder(config), folder / "model.onnx")
    out = tmp_path / "genai"
    assert _convert(folder, out, "int8", "per_tensor").converted
    decoder = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    assert decoder["sliding_window"] == {
        "cache_slack": 0,
        "layers": [0, 1],
        "slide_inputs": False,
        "slide_key_value_cache": False,
        "window_size": 4,
    }
    assert json.loads((out / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is True
    prompt = _prompt(export) * 3  # past the window of 4
    tokens = og_generate(out, prompt, 8)
    expected = KvCacheRunner(out).generate(prompt, 8)
    expected = expected[:-1] if expected and expected[-1] == 2 else expected
    assert len(tokens) >= 4 and tokens == expected


PRODUCERS = pathlib.Path(__file__).parents[1] / "data" / "producers"


@pytest.mark.parametrize(
    "family",
    [
        "torch-tf5/dynamo-opset23-optimize-rollingcache/gemma2",
        "torch-tf5/dynamo-opset23-optimize-rollingcache/qwen2_window",
    ],
)
def test_a_mixed_rolling_export_runs_in_onnxruntime_genai_as_the_runner(export, tmp_path, family):
    """The oracle's transformers 5.x exports whose window layers (W = 4, rolling caches) alternate
    with full ones over one declared past length, in an export folder (the folder's config.json
    sized to them), converted to int8: genai_config.json names the window layer alone, and
    onnxruntime-genai's tokens are the runner's, past the window."""
    pytest.importorskip("onnxruntime_genai", reason="install the genai extra (CI does)")
    folder = tmp_path / "export"
    shutil.copytree(export, folder)
    shutil.copy(PRODUCERS / family / "model.onnx", folder / "model.onnx")
    config = json.loads((folder / "config.json").read_text())
    config |= {"head_dim": 16, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2}
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": 128}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fusion's padding note, random calibration tokens
        model = ir.load(folder / "model.onnx")
        scales = calibrate_kv_cache(model, format="int8", num_seqs=4, seq_len=64, progress=False)
        result = convert_model(folder, tmp_path / "genai", format="int8", scales=scales, ep="cpu")
    assert result.converted and result.verified
    window = json.loads((tmp_path / "genai" / "genai_config.json").read_text())["model"]["decoder"]
    assert window["sliding_window"]["layers"] == ([1] if family.endswith("qwen2_window") else [0])
    prompt = [1, 72, 101, 108, 108, 111, 33]  # ids of the oracle's prompt, past the window of 4
    tokens = og_generate(tmp_path / "genai", prompt, 8)
    expected = KvCacheRunner(tmp_path / "genai").generate(prompt, 8)
    expected = expected[:-1] if expected and expected[-1] == 2 else expected
    assert len(tokens) >= 4 and tokens == expected


def _with_input(model: ir.Model, name: str) -> ir.Model:
    value = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch_size"]))
    model.graph.inputs.append(value)
    return model


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda folder: _edit_model(folder, "token_type_ids"), "its input 'token_type_ids' is not one"),
        (lambda folder: _edit_config(folder, max_position_embeddings=None), "gives no context length"),
        (
            lambda folder: _edit_config(folder, eos_token_id=None, generation=False, tokenizer=False),
            "end-of-seq",
        ),
    ],
    ids=["unknown-input", "no-context", "no-eos"],
)
def test_an_export_genai_cannot_drive_converts_with_one_warning(export, tmp_path, change, reason):
    folder = tmp_path / "export"
    shutil.copytree(export, folder)
    change(folder)
    with pytest.warns(GenaiConfigWarning) as caught:
        result = _convert(folder, tmp_path / "out", "int8", "per_tensor", scales_of=export)
    said = [str(w.message) for w in caught if issubclass(w.category, GenaiConfigWarning)]
    assert len(said) == 1 and reason in said[0] and said[0].startswith("no genai_config.json written in out")
    assert "\n" not in said[0]
    assert result.converted and not (tmp_path / "out" / "genai_config.json").exists()
    assert (tmp_path / "out" / "tokenizer.json").exists()


def _edit_model(folder: pathlib.Path, name: str) -> None:
    model = ir.load(folder / "model.onnx")
    ir.save(_with_input(model, name), folder / "model.onnx")


def _edit_config(folder: pathlib.Path, *, generation: bool = True, tokenizer: bool = True, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in (config | changes).items() if v is not None}))
    if not generation:
        (folder / "generation_config.json").unlink()
    if not tokenizer:  # its files naming an end-of-sequence token
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            (folder / name).unlink()


@pytest.mark.parametrize("where", ["tokenizer.json", "added_tokens_decoder", "special_tokens_map.json"])
def test_an_eos_only_the_tokenizer_names_is_read_there(export, tmp_path, where):
    """Issue 37: config.json and generation_config.json without eos_token_id, the tokenizer naming
    </s>: the folder once got no genai_config.json, and the runner stopped at no end token."""
    folder = tmp_path / "export"
    shutil.copytree(export, folder)
    _edit_config(folder, eos_token_id=None, generation=False)
    if where == "added_tokens_decoder":  # transformers' tokenizer_config.json gives the id itself
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["added_tokens_decoder"] = {"2": {"content": "</s>", "special": True}}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        (folder / "tokenizer.json").unlink()
    elif where == "special_tokens_map.json":
        (folder / "tokenizer_config.json").unlink()
    result = _convert(folder, tmp_path / "out", "int8", "per_tensor", scales_of=export)
    config = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    assert result.converted and config["model"]["eos_token_id"] == 2 == config["model"]["pad_token_id"]
    assert KvCacheRunner(folder / "model.onnx").eos_token_ids == {2}


def test_a_folder_without_config_json_gets_no_genai_config_no_warning_and_a_note(tmp_path):
    """review37: the summary said nothing of the genai_config.json a folder output lacked."""
    folder = tmp_path / "export"
    folder.mkdir()
    shutil.copy(OPTIMUM / "model.onnx", folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenaiConfigWarning)
        result = _convert(folder, tmp_path / "out", "int8", "per_tensor")
    assert result.converted and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.onnx"]
    assert (
        "no genai_config.json written: export has no config.json (transformers' model config) to write "
        "it from, so onnxruntime-genai cannot run out; to have one, put the model's config.json beside "
        "the input and convert again."
    ) in result.notes


def test_a_file_output_and_an_in_place_conversion_write_no_genai_config(export, tmp_path):
    out = _convert(
        export / "model.onnx", tmp_path / "model.int8.onnx", "int8", "per_tensor", scales_of=export
    )
    assert out.converted and not (tmp_path / "genai_config.json").exists()
    folder = tmp_path / "export"
    shutil.copytree(export, folder)
    result = _convert(folder, None, "int8", "per_tensor", scales_of=export, in_place=True)
    assert result.converted and not (folder / "genai_config.json").exists()


@pytest.mark.parametrize(
    ("generation", "config", "eos", "pad", "bos"),
    [
        ({"eos_token_id": 2}, {"eos_token_id": 7, "bos_token_id": 1}, (2,), None, 1),
        ({}, {"eos_token_id": [128001, 128009], "pad_token_id": 0}, (128001, 128009), 0, None),
        ({"eos_token_id": [5, 6], "pad_token_id": 3}, {"pad_token_id": 9}, (5, 6), 3, None),
        ({"eos_token_id": None}, {"eos_token_id": 4}, (4,), None, None),
        ({"eos_token_id": True, "pad_token_id": -1}, {}, (), None, None),
    ],
)
def test_special_tokens_come_from_generation_config_then_config_json(generation, config, eos, pad, bos):
    export = ExportConfig(config, generation)
    assert (export.eos_token_ids, export.pad_token_id, export.bos_token_id) == (eos, pad, bos)


@pytest.mark.parametrize(
    ("files", "eos", "pad"),
    [
        ({}, {2}, None),  # the fixture: generation_config.json says 2
        ({"generation_config.json": {"eos_token_id": [2, 5], "pad_token_id": 0}}, {2, 5}, 0),
        ({"generation_config.json": None, "config.json": {"eos_token_id": 3, "pad_token_id": 1}}, {3}, 1),
    ],
)
def test_the_runner_on_an_export_folder_takes_its_eos_and_pad_ids(tmp_path, files, eos, pad):
    folder = tmp_path / "export"
    shutil.copytree(OPTIMUM, folder)
    for name, doc in files.items():
        if doc is None:
            (folder / name).unlink()
        else:
            (folder / name).write_text(json.dumps(json.loads((OPTIMUM / name).read_text()) | doc))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fusion's padding note
        runner = KvCacheRunner(folder)
        by_file = KvCacheRunner(folder / "model.onnx")
    assert (runner.eos_token_ids, runner.pad_token_id) == (eos, pad)
    assert (by_file.eos_token_ids, by_file.pad_token_id) == (eos, pad)
    assert runner.eos_token_id == min(eos)


def test_a_config_json_that_is_no_object_is_one_error(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(KvCacheError, match=r"config.json is not a JSON object"):
        read_export_config(tmp_path)
    assert read_export_config(tmp_path / "nowhere") is None


@pytest.fixture(scope="module")
def fused():
    """The fixture's graph with its attention fused (what a conversion writes genai_config for)."""
    from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass

    model = ir.load(OPTIMUM / "model.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the padding note
        GqaFusionPass()(model)
    return model


def _genai_config(model: ir.Model, export: ExportConfig, **kwargs) -> dict:
    options = {"share_buffer": False, "provider_options": []} | kwargs
    return genai_config_for_export(model, "model.onnx", export, **options)


def test_cache_names_that_are_no_numbered_pattern_are_a_reason(fused):
    model = fused.clone()
    model.graph.inputs[3].name = "past_key_values.7.key"  # layer 0's key named as layer 7's
    with pytest.raises(NoGenaiConfig, match="not numbered 0, 1, 2"):
        _genai_config(model, read_export_config(OPTIMUM))


@pytest.mark.parametrize(
    ("generation", "expected"),
    [
        ({}, {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "num_beams": 1}),
        (
            {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20},
            {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.9, "num_beams": 1},
        ),
        (  # values of another type are not taken: transformers' defaults stand
            {"do_sample": 1, "temperature": "0.6", "top_k": 2.5, "num_beams": True, "top_p": 1},
            {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1, "num_beams": 1},
        ),
    ],
)
def test_search_options_come_from_generation_config(fused, generation, expected):
    config = json.loads((OPTIMUM / "config.json").read_text())
    search = _genai_config(fused, ExportConfig(config, generation | {"eos_token_id": 2}))["search"]
    assert {k: search[k] for k in expected} == expected
    assert search["max_length"] == 2048 and search["past_present_share_buffer"] is False


@pytest.mark.parametrize(
    ("model_type", "written"),
    [("llama", "llama"), ("qwen3", "qwen3"), ("olmo2", "decoder"), (None, "decoder")],
)
def test_the_model_type_is_one_onnxruntime_genai_knows(fused, model_type, written):
    config = json.loads((OPTIMUM / "config.json").read_text()) | {"model_type": model_type}
    genai = _genai_config(fused, ExportConfig(config, {}), share_buffer=True, provider_options=[{"cuda": {}}])
    assert genai["model"]["type"] == written
    assert genai["search"]["past_present_share_buffer"] is True
    assert genai["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {}}]
