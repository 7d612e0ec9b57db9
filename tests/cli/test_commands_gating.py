"""What the command converts, refuses and infers: targets, providers, exports, calibrate --out,
pipes, paged folders."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import onnx_ir as ir
import pytest

from onnx_kvcache.capabilities.table import EP_CAPABILITIES
from onnx_kvcache.cli.commands import build_parser, main
from onnx_kvcache.model_io import _atomic as file_io
from onnx_kvcache.models.decoder import save_genai_folder

from command_cases import fp16_model_file, model_file, scale_file  # noqa: F401  (fixtures)

# -- issue 10, item 5: convert refuses what nothing can run, inferring the target ------


def test_without_ep_the_target_is_inferred_and_gated(tmp_path, model_file, fp16_model_file, capsys):
    out, out32 = tmp_path / "o.onnx", tmp_path / "o32.onnx"
    # float32: CUDA computes the attention in float16
    assert main(["convert", str(model_file), str(out32), "--format", "fp8"]) == 0
    said = capsys.readouterr()
    assert "to fp8 per_tensor for cuda (assumed: fp8 caches run only on CUDA; --ep to choose)" in said.out
    warned = "onnx-kvcache: warning: cuda has no float32 GroupQueryAttention: the 2 attention layer(s)"
    assert warned in said.err
    assert out32.exists()
    assert main(["convert", str(fp16_model_file), str(out), "--format", "fp8"]) == 0
    stdout = capsys.readouterr().out
    assert "to fp8 per_tensor for cuda (assumed: a float16 model; --ep to choose)" in stdout
    assert (
        main(
            [
                "convert",
                str(model_file),
                str(tmp_path / "o8.onnx"),
                "--format",
                "int8",
                "--scales",
                str(scale_file(tmp_path)),
            ]
        )
        == 0
    )
    assert "for cpu (assumed: a float32 model" in capsys.readouterr().out
    assert (
        main(["convert", str(fp16_model_file), str(tmp_path / "x.onnx"), "--format", "fp8", "--ep", "cpu"])
        == 1
    )
    err = capsys.readouterr().err
    assert "not converted for cpu (--ep)" in err and err.count("\n") == 1


def test_genai_provider_options_name_the_target(tmp_path, capsys):
    folder = save_genai_folder(tmp_path / "g", num_layers=2, vocab_size=300)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["provider_options"] = [{"cuda": {"enable_cuda_graph": "0"}}]
    (folder / "genai_config.json").write_text(json.dumps(config))
    scales = str(scale_file(tmp_path))
    assert main(["convert", str(folder), str(tmp_path / "o"), "--format", "int8", "--scales", scales]) == 0
    said = capsys.readouterr()
    assert "for cuda (assumed: genai_config.json's provider_options name 'cuda'; --ep to choose)" in said.out
    assert "compute in float16" in said.err  # a float32 folder: CUDA takes no float32 query
    config["model"]["decoder"]["session_options"]["provider_options"] = [{"dml": {}}]
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert main(["convert", str(folder), str(tmp_path / "o2"), "--format", "int8", "--scales", scales]) == 1
    err = capsys.readouterr().err
    assert "for dml (assumed: genai_config.json's provider_options name 'dml'; --ep to choose)" in err
    assert "Fix: --ep cpu or cuda or openvino runs int8, if the model will run there" in err


def test_ep_takes_the_providers_of_the_capability_table(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["convert", "m.onnx", "o.onnx", "--ep", "tpu"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err
    # a new row needs its name in _names too: test_the_parsers_names_are_the_tables says so
    for ep in [n for n in EP_CAPABILITIES if n != "default"]:
        assert build_parser().parse_args(["convert", "m.onnx", "o.onnx", "--ep", ep.upper()]).ep == ep
    with pytest.raises(SystemExit):
        build_parser().parse_args(["convert", "m.onnx", "o.onnx", "--ep", "default"])


# -- issue 10, item 6: a model without GroupQueryAttention ----------------------------


def test_an_export_without_gqa_is_fused_then_converted(tmp_path, capsys):
    from exported_attention import exported_decoder

    src = tmp_path / "exported.onnx"
    ir.save(exported_decoder(), src)
    scales = tmp_path / "s.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.1], "v_scales": [0.1]}, "qmax": 128}))
    assert (
        main(["convert", str(src), str(tmp_path / "o.onnx"), "--format", "int8", "--scales", str(scales)])
        == 0
    )
    assert "converted 1 GroupQueryAttention node(s)" in capsys.readouterr().out


def test_a_model_with_nothing_to_convert_is_refused(tmp_path, capsys):
    x = ir.val("x", ir.DataType.FLOAT, [1, 4])
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 21}, name="mlp")
    node = ir.Node("", "Relu", [x], name="relu")
    graph.append(node)
    graph.outputs.append(node.outputs[0])
    node.outputs[0].name, node.outputs[0].dtype = "y", ir.DataType.FLOAT
    src = tmp_path / "mlp.onnx"
    ir.save(ir.Model(graph, ir_version=10), src)
    assert main(["convert", str(src), str(tmp_path / "o.onnx"), "--format", "int8"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no GroupQueryAttention or PagedAttention node" in err and "fusion" in err
    assert not (tmp_path / "o.onnx").exists()


def test_a_partial_conversion_is_refused_unless_allowed(tmp_path, capsys):
    """Issue 28, part 5: a cache another node reads would stay float32: exit 1, the layer named."""
    from conftest import gqa_model

    model = gqa_model(layers=2)
    past = next(v for v in model.graph.inputs if v.name == "past_key_values.1.value")
    tap = ir.Node("", "Neg", [past], name="tap")
    model.graph.append(tap)
    model.graph.outputs.append(tap.outputs[0])
    tap.outputs[0].name = "negated"
    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    ir.save(model, src)
    scales = tmp_path / "s.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.1, 0.1]}, "qmax": 128}))
    argv = ["convert", str(src), str(out), "--format", "int8", "--scales", str(scales)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "layer(s) 1 would keep float32 caches while the others become int8" in err
    assert "read by Neg node 'tap'" in err and err.rstrip().endswith("only with --allow-partial.")
    assert not out.exists()
    assert main([*argv, "--allow-partial"]) == 0
    assert "warning: Skipped GroupQueryAttention node(s) gqa.1" in capsys.readouterr().err
    types = {v.name: v.dtype for v in ir.load(out).graph.inputs}
    assert types["past_key_values.1.value"] == ir.DataType.FLOAT
    assert types["past_key_values.0.value"] == ir.DataType.INT8


# -- issue 9: calibrate --out, errors as one line --------------------------------------


def test_calibrate_checks_out_before_calibrating(tmp_path, monkeypatch, capsys):
    folder = save_genai_folder(tmp_path / "g", num_layers=2, vocab_size=300)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def must_not_run(*args, **kwargs):
        raise AssertionError("calibration ran before --out was checked")

    monkeypatch.setattr("onnx_kvcache.calibrate.calibration.calibrate_kv_cache", must_not_run)
    (tmp_path / "a_file").write_text("x")
    for out, message in [
        (folder / "model.onnx", "one of the input's files"),  # used to replace the model with JSON
        (folder / "genai_config.json", "one of the input's files"),
        (folder / "tokenizer.json", "one of the input's files"),
        (folder / "model.onnx.data", "one of the input's files"),
        (tmp_path, "is a folder"),
        (tmp_path / "a_file" / "s.json", "not a folder"),
    ]:
        assert main(["calibrate", str(folder), "--out", str(out), "--format", "int8"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_calibrate_replaces_its_own_scale_file(tmp_path, capsys):
    folder = save_genai_folder(tmp_path / "g", num_layers=2, vocab_size=300)
    out = tmp_path / "scales.json"
    argv = ["calibrate", str(folder), "--out", str(out), "--format", "int8", "--num-seqs", "1"]
    for _ in range(2):
        assert main([*argv, "--seq-len", "32", "--min-tokens", "32"]) == 0
    assert "scales" in json.loads(out.read_text())


def test_os_errors_are_one_line(tmp_path, model_file, monkeypatch, capsys):
    scales = str(scale_file(tmp_path))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "out"))

    monkeypatch.setattr(file_io, "TempFile", denied)
    assert (
        main(
            [
                "convert",
                str(model_file),
                str(tmp_path / "out" / "o.onnx"),
                "--format",
                "int8",
                "--scales",
                scales,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Permission denied" in err and "nothing was written" in err
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()

    folder = save_genai_folder(tmp_path / "g", num_layers=2, vocab_size=300)
    (folder / "genai_config.json").write_bytes(b'{"model": "caf\xe9"}')
    for argv in (["convert", str(folder), str(tmp_path / "o"), "--format", "int8"], ["inspect", str(folder)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not UTF-8" in err


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_a_closed_pipe_of_a_command_that_only_prints_is_silent(tmp_path, model_file, extra):
    """`inspect ... | head`: the reader had what it wanted; no error, no traceback, exit 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "onnx_kvcache", "inspect", str(model_file), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # like `| head` exiting before the output is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0  # README: a closed pipe is no error; inspect wrote no file
    assert err == ""


def test_a_closed_pipe_after_a_conversion_says_it_completed(tmp_path, model_file):
    out = tmp_path / "o.onnx"
    argv = ["convert", str(model_file), str(out), "--format", "int8", "--scales", str(scale_file(tmp_path))]
    proc = subprocess.Popen(
        [sys.executable, "-m", "onnx_kvcache", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and out.exists()  # the output is complete: a success
    assert err.count("\n") == 1 and f"broken pipe); the conversion completed ({out})" in err


def test_an_unwritable_destination_is_refused_before_any_work(tmp_path, model_file, monkeypatch, capsys):
    """Checked first: neither conversion nor calibration runs when the output cannot be written."""
    real_access = os.access
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if pathlib.Path(p) == ro else real_access(p, mode)
    )

    def must_not_run(*args, **kwargs):
        raise AssertionError("work started before the output was checked")

    monkeypatch.setattr("onnx_kvcache.pipeline.optimize.optimize_model", must_not_run)
    monkeypatch.setattr("onnx_kvcache.calibrate.calibration.calibrate_kv_cache", must_not_run)
    scales = str(scale_file(tmp_path))
    for argv in (
        ["convert", str(model_file), str(ro / "o.onnx"), "--format", "int8", "--scales", scales],
        ["convert", str(model_file), str(ro / "new" / "o.onnx"), "--format", "int8", "--scales", scales],
        ["calibrate", str(model_file), "--out", str(ro / "s.json")],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"Cannot write in {ro} (permission denied)" in err and err.count("\n") == 1
    assert list(ro.iterdir()) == []


def test_paged_genai_folder_converts_inspects_and_gates(tmp_path, capsys):
    from onnx_kvcache.models.decoder import save_genai_folder

    folder = save_genai_folder(tmp_path / "paged", num_layers=2, vocab_size=300, paged=True, dtype="float16")
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [[0.02] * 64] * 2, "v_scales": [[0.01] * 64] * 2}}))
    out = tmp_path / "paged-int8"
    assert main(["convert", str(folder), str(out), "--format", "int8", "--scales", str(scales)]) == 0
    assert "converted 2 PagedAttention node(s) to int8 per_channel" in capsys.readouterr().out
    assert main(["inspect", str(out), "--ep", "cuda"]) == 0
    text = capsys.readouterr().out
    assert "PagedAttention: cache [num_blocks, block_size, kv_num_heads, head_size]" in text
    assert "PER_CHANNEL/PER_CHANNEL" in text and "head size 32 is not one of (64, 128, 256)" in text
    assert (
        main(
            [
                "convert",
                str(folder),
                str(tmp_path / "cpu"),
                "--format",
                "int8",
                "--scales",
                str(scales),
                "--ep",
                "cpu",
            ]
        )
        == 1
    )
    assert "cpu has no PagedAttention kernel" in capsys.readouterr().err
    assert not (tmp_path / "cpu").exists()
    assert (
        main(["convert", str(folder), str(tmp_path / "i4"), "--format", "int4", "--scales", str(scales)]) == 0
    )
    assert capsys.readouterr().err.count("int4 KV-cache option") == 1  # said once


@pytest.mark.parametrize(
    ("option", "name", "message"),
    [
        ("--text", "ids.json", "would be read as token ids; give it as --token-ids"),
        ("--text", "ids.npy", "would be read as token ids"),
        ("--token-ids", "words.txt", "give text as --text"),
    ],
)
@pytest.mark.parametrize("command", ["calibrate", "evaluate"])
def test_the_data_option_says_what_the_file_is(tmp_path, model_file, capsys, option, name, message, command):
    (tmp_path / name).write_text("[1, 2, 3]")
    models = (
        [str(model_file), "--out", str(tmp_path / "s.json")]
        if command == "calibrate"
        else [str(model_file)] * 2
    )
    with pytest.raises(SystemExit) as exit_:
        main([command, *models, option, str(tmp_path / name)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


def test_ep_help_names_what_it_takes_and_means_it(capsys):
    """The rows with an onnxruntime provider take its name too; openvino is OpenVINO's own
    runtime, so onnxruntime's OpenVINOExecutionProvider is refused, as the help says."""
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    onnxruntime_rows = [n for n, row in EP_CAPABILITIES.items() if row.provider]
    assert f"where the model will run: {', '.join(onnxruntime_rows)} (or onnxruntime's name for one" in text
    assert "or openvino (OpenVINO's own runtime; onnxruntime's OpenVINOExecutionProvider is not a row" in text
    for name in onnxruntime_rows:
        provider = EP_CAPABILITIES[name].provider
        assert build_parser().parse_args(["convert", "m.onnx", "o.onnx", "--ep", provider]).ep == name
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["convert", "m.onnx", "o.onnx", "--ep", "OpenVINOExecutionProvider"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_fp8_for_openvino_is_refused_for_its_true_reason(tmp_path, model_file, capsys):
    """OpenVINO has a GroupQueryAttention kernel that compiles an fp8 cache: the refusal says why
    the row leaves fp8 out (its codes), not that there is no kernel."""
    out = tmp_path / "o.onnx"
    assert main(["convert", str(model_file), str(out), "--ep", "openvino", "--format", "fp8"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not out.exists()
    assert err.startswith(
        "onnx-kvcache: not converted for openvino (--ep): openvino does not list fp8: an fp8 cache compiles "
        "there, but its codes differ from onnxruntime's rule"
    )
    assert "no GroupQueryAttention kernel" not in err
    # cuda runs fp8 for this float32 model too, with its attention in float16
    assert "Fix: --ep cuda runs fp8, if the model will run there; openvino runs --format int8 or int4." in err


@pytest.mark.parametrize("name", ["CUDAExecutionProvider", "CUDA", "gpu"])
def test_ep_takes_onnxruntimes_provider_names_too(tmp_path, model_file, capsys, name):
    out = tmp_path / "o.onnx"
    assert main(["convert", str(model_file), str(out), "--format", "fp8", "--ep", name]) == 0
    assert "to fp8 per_tensor for cuda: " in capsys.readouterr().out  # the row of cuda
