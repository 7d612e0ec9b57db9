"""The onnx-kvcache command: exit codes, one-line errors, and the demo."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx_ir as ir
import pytest

from onnx_kvcache.cli import main
from onnx_kvcache.demo_model import build_decoder


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.onnx"
    ir.save(build_decoder(num_layers=2), path)
    return path


def scale_file(tmp_path, layers=2):
    path = tmp_path / "scales.json"
    path.write_text(
        json.dumps({"scales": {"k_scales": [0.1] * layers, "v_scales": [0.05] * layers}, "qmax": 128})
    )
    return path


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_convert_then_inspect(tmp_path, model_file, capsys, fmt):
    out = tmp_path / f"{fmt}.onnx"
    assert (
        main(["convert", str(model_file), str(out), "--format", fmt, "--scales", str(scale_file(tmp_path))])
        == 0
    )
    assert "converted 2 GroupQueryAttention node(s)" in capsys.readouterr().out
    assert main(["inspect", str(out), "--context", "4096"]) == 0
    text = capsys.readouterr().out
    assert "past_key_values.1.key" in text and "cache bytes per token" in text and "4096 tokens" in text
    assert main(["inspect", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["original_bytes_per_token"] / doc["bytes_per_token"] == (8 if fmt == "int4" else 4)


def test_fp8_without_scales_warns_on_stderr(tmp_path, model_file, capsys):
    assert main(["convert", str(model_file), str(tmp_path / "o.onnx")]) == 0
    assert "unit scales" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["convert", "{model}", "{tmp}/o.onnx", "--format", "int8"], "needs calibrated scales"),
        (["convert", "{model}", "{tmp}/o.onnx", "--scales", "{tmp}/missing.json"], "does not exist"),
        (["convert", "{tmp}/nope.onnx", "{tmp}/o.onnx"], "does not exist"),
        (["convert", "{model}", "{model}"], "is the input"),
        (["convert", "{bad}", "{tmp}/o.onnx"], "not a readable ONNX model"),
        (["inspect", "{bad}"], "not a readable ONNX model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, model_file, capsys, argv, message):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"definitely not protobuf \x00\xff")
    args = [a.format(model=model_file, tmp=tmp_path, bad=bad) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o.onnx").exists()


def test_module_entry_point_and_demo(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "onnx_kvcache", "demo", "--keep", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = result.stdout.splitlines()
    table = [line for line in lines if line.startswith(("fp8", "int8", "int4"))]
    assert len(table) == 6
    by_name = {tuple(line.split()[:2]): line for line in table}
    assert "512" in by_name[("int8", "per_tensor")] and "256" in by_name[("int4", "per_channel")]
    assert (tmp_path / "model.int8.per_channel.onnx").is_file()


def test_convert_takes_the_granularity_of_the_scale_file(tmp_path, model_file, capsys):
    scales = tmp_path / "pc.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [[0.1] * 64] * 2, "v_scales": [[0.2] * 64] * 2}}))
    out = tmp_path / "pc.onnx"
    assert main(["convert", str(model_file), str(out), "--format", "int8", "--scales", str(scales)]) == 0
    assert "int8 per_channel" in capsys.readouterr().out
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"][0]["k_quant_type"] == "PER_CHANNEL"
    args = ["convert", str(model_file), str(tmp_path / "x.onnx"), "--format", "int8", "--scales", str(scales)]
    assert main([*args, "--granularity", "per_tensor"]) == 2  # explicit and contradicting: an error
    assert "element" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{model}", "--context", "-5"],
        ["inspect", "{model}", "--batch", "0"],
        ["calibrate", "{model}", "--out", "{tmp}/s.json", "--num-seqs", "0"],
        ["calibrate", "{model}", "--out", "{tmp}/s.json", "--num-seqs", "-1"],
        ["calibrate", "{model}", "--out", "{tmp}/s.json", "--seq-len", "0"],
        ["calibrate", "{model}", "--out", "{tmp}/s.json", "--percentile", "101"],
        ["calibrate", "{model}", "--out", "{tmp}/s.json", "--margin", "0"],
        ["calibrate", "{model}", "--out", "{tmp}/s.json", "--min-tokens", "-3"],
        ["evaluate", "{model}", "{model}", "--max-new-tokens", "-1"],
        ["evaluate", "{model}", "{model}", "--num-seqs", "nan"],
    ],
)
def test_numeric_options_are_range_checked(tmp_path, model_file, capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(model=model_file, tmp=tmp_path) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "must be" in err or "expected a number" in err
    assert not (tmp_path / "s.json").exists()


def test_calibrating_three_tokens_is_refused(tmp_path, model_file, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3]")
    argv = ["calibrate", str(model_file), "--out", str(tmp_path / "s.json"), "--token-ids", str(ids)]
    assert main(argv) == 2
    assert "has 3 token(s)" in capsys.readouterr().err and not (tmp_path / "s.json").exists()
    assert main([*argv, "--min-tokens", "0", "--format", "int8"]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["tokens"] == 3


@pytest.mark.parametrize(
    ("fmt", "dtype", "rule"),
    [
        ("int8", "float32", "cpu (onnxruntime CPU kernel)"),
        ("int8", "float16", "cuda (emulated on CPU)"),  # an fp16 model targets CUDA
        ("fp8", "float16", "cuda (emulated on CPU)"),
    ],
)
def test_evaluate_states_the_kernel_rule_of_the_target(tmp_path, capsys, fmt, dtype, rule):
    model_file = tmp_path / "model.onnx"
    ir.save(build_decoder(num_layers=2, dtype=dtype), model_file)
    out = tmp_path / f"{fmt}.onnx"
    assert (
        main(["convert", str(model_file), str(out), "--format", fmt, "--scales", str(scale_file(tmp_path))])
        == 0
    )
    argv = [
        "evaluate",
        str(model_file),
        str(out),
        "--num-seqs",
        "1",
        "--seq-len",
        "16",
        "--max-new-tokens",
        "2",
    ]
    assert main(argv) == 0
    assert f"kernel rule           {rule}" in capsys.readouterr().out
    assert main([*argv, "--semantics", "cpu"]) == 0
    cpu = "cpu (emulated on CPU)" if fmt == "fp8" else "cpu (onnxruntime CPU kernel)"
    assert f"kernel rule           {cpu}" in capsys.readouterr().out


def test_paged_genai_folder_converts_inspects_and_gates(tmp_path, capsys):
    from onnx_kvcache.demo_model import save_genai_folder

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
    assert "int4 KV-cache option" in capsys.readouterr().err
