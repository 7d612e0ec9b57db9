"""The command's one voice on stderr: every warning as ``onnx-kvcache: warning:``, once per
kind; errors as ``onnx-kvcache: error:``; summaries that name the method and say "replaced"."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_kvcache.cli.commands import main
from onnx_kvcache.models.decoder import build_decoder

from command_cases import model_file, scale_file  # noqa: F401  (fixtures)

WARNING = "onnx-kvcache: warning: "


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def test_the_librarys_logging_warning_is_a_warning_line(tmp_path, model_file, capsys):
    """Scales made for int4, converted to int8: said by ``onnx_kvcache.scales.files``'s logger."""
    path = tmp_path / "int4.json"
    path.write_text(json.dumps({"scales": {"k_scales": [0.5, 0.5], "v_scales": [0.2, 0.2]}, "qmax": 8.0}))
    argv = ["convert", str(model_file), str(tmp_path / "o.onnx"), "--format", "int8", "--scales", str(path)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert lines(err) == [
        f"{WARNING}The scales were made for int4 (qmax 8) and are retargeted to int8 (qmax 128): each "
        "scale times 0.0625, the same thresholds."
    ]


@pytest.fixture
def nameless_initializer(tmp_path):
    """A model onnx-ir reads with a ``WARNING onnx_ir.serde`` log line (an unnamed initializer)."""
    proto = ir.to_proto(build_decoder(num_layers=2))
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(1, np.float32), name=""))
    path = tmp_path / "odd.onnx"
    onnx.save(proto, path)
    return path


def test_other_libraries_logging_shows_only_under_verbose(nameless_initializer, capsys):
    assert main(["inspect", str(nameless_initializer)]) == 0
    out, err = capsys.readouterr()
    assert "past_key_values.1.key" in out and err == ""
    assert main(["-v", "inspect", str(nameless_initializer)]) == 0
    err = capsys.readouterr().err
    assert "WARNING onnx_ir.serde: Initializer tensor must have a name" in err
    assert not any(line.startswith("WARNING onnx_kvcache") for line in lines(err))


@pytest.mark.parametrize("verbose", [False, True])
def test_a_kind_of_warning_is_said_once_per_run(tmp_path, model_file, capsys, verbose):
    """A tiny margin clips every layer: one ClippingWarning each; the first is said, then a count."""
    argv = ["calibrate", str(model_file), "--out", str(tmp_path / "s.json"), "--format", "int8"]
    argv += ["--margin", "1e-6", "--seq-len", "64", "--min-tokens", "64", "--no-progress"]
    assert main(["-v", *argv] if verbose else argv) == 0
    said = [line for line in lines(capsys.readouterr().err) if line.startswith(WARNING)]
    clipping = [line for line in said if "of layer" in line]
    random_ids = [line for line in said if "No tokenizer found" in line]
    assert len(random_ids) == 1 and "Give the model's tokenizer (--tokenizer PATH: " in random_ids[0]
    if verbose:
        assert [line.split("of layer ")[1][:1] for line in clipping] == ["0", "1"]
    else:
        assert len(clipping) == 1 and "of layer 0's" in clipping[0]
        more = "1 more ClippingWarning like the one above, for other values (-v shows each)"
        assert said[-1] == f"{WARNING}{more}"


def test_an_exports_padding_warning_is_one_short_line(tmp_path, capsys):
    export = pathlib.Path(__file__).parents[1] / "data" / "export_llama_opset23.onnx"
    scales = scale_file(tmp_path, layers=3)
    argv = ["convert", str(export), str(tmp_path / "o.onnx"), "--format", "int8", "--scales", str(scales)]
    assert main(argv) == 0
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith(f"{WARNING}fused attention: a prompt padded anywhere")
    assert len(err[0]) < 240


@pytest.mark.parametrize(
    ("fmt", "method", "noted"),
    [("int4", None, False), ("int4", "minmax", True), ("int8", None, True), ("int8", "mse", False)],
)
def test_the_minmax_note_only_for_minmax(tmp_path, model_file, capsys, fmt, method, noted):
    argv = ["calibrate", str(model_file), "--out", str(tmp_path / "s.json"), "--format", fmt]
    argv += ["--seq-len", "64", "--num-seqs", "4", "--min-tokens", "64", "--no-progress"]
    assert main(argv + (["--method", method] if method else [])) == 0
    out = capsys.readouterr().out
    assert ("minmax clips int8/int4" in out) is noted
    used = method or "mse"  # a rotated int4 cache's default
    if fmt == "int8" and method is None:
        used = "minmax"
    rotated = ", rotation keys_and_values" if fmt == "int4" else ""  # int4's default rotation
    assert (
        lines(out)[-1] == f"wrote {tmp_path / 's.json'} (2 layers, {fmt} per_tensor, method {used}{rotated})"
    )


def test_summaries_say_replaced_when_they_replace(tmp_path, model_file, capsys):
    out = tmp_path / "s.json"
    argv = ["calibrate", str(model_file), "--out", str(out), "--format", "int8", "--seq-len", "64"]
    argv += ["--min-tokens", "64", "--no-progress"]
    for said in ("wrote", "replaced"):
        assert main(argv) == 0
        assert lines(capsys.readouterr().out)[-1].startswith(f"{said} {out} (2 layers")
    converted = tmp_path / "o.onnx"
    for said in ("", f"replaced {converted}."):
        assert main(["convert", str(model_file), str(converted), "--scales", str(out), "--overwrite"]) == 0
        stdout = lines(capsys.readouterr().out)
        assert stdout[2] == f"scales: {out} (method minmax)"
        assert (stdout[-1] == said) if said else not any(line.startswith("replaced") for line in stdout)
    report = tmp_path / "r.json"
    evaluate = ["evaluate", str(model_file), str(converted), "--json", str(report), "--max-new-tokens", "0"]
    evaluate += ["--num-seqs", "1", "--seq-len", "16", "--no-progress"]
    for said in ("wrote", "replaced"):
        assert main(evaluate) == 0
        assert lines(capsys.readouterr().out)[-1] == f"{said} {report} (report)"


@pytest.mark.parametrize(
    "argv",
    [["--bogus"], ["convert", "--bogus", "m.onnx"], ["calibrate", "m.onnx"], ["convert", "--format", "int2"]],
)
def test_argument_errors_speak_in_the_same_voice(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = lines(capsys.readouterr().err)
    assert err[0].startswith("usage: onnx-kvcache")
    assert err[-1].startswith("onnx-kvcache: error: ") and err[-1].endswith(" --help)")


def test_a_refusal_is_not_converted_and_exit_1(tmp_path, model_file, capsys):
    """Not an error (the input is fine): its own form, exit 1."""
    argv = ["convert", str(model_file), str(tmp_path / "o.onnx"), "--format", "fp8", "--ep", "cpu"]
    assert main(argv) == 1
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("onnx-kvcache: not converted for cpu (--ep): ")
    assert not (tmp_path / "o.onnx").exists()
