"""The onnx-kvcache command: its subcommands end to end, its help, its words for library messages."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.metadata
import io
import json
import pathlib
import re
import subprocess
import sys

import onnx_ir as ir
import pytest

from onnx_kvcache import convert_model
from onnx_kvcache.cli import _demo as demo
from onnx_kvcache.cli.commands import _wording, build_parser, main
from onnx_kvcache.errors import Function, KvCacheError, Message, Param, render
from onnx_kvcache.models.decoder import build_decoder, save_genai_folder
from onnx_kvcache.scales.data import builtin_corpus

from command_cases import fp16_model_file, model_file, scale_file  # noqa: F401  (fixtures)


@pytest.mark.parametrize("started_ago", [0.0, 100.0])
def test_convert_times_from_the_entry_points_first_line(
    tmp_path, model_file, monkeypatch, capsys, started_ago
):
    """The "in N s" timer started after the imports: it counts from the entry point now."""
    import time

    from onnx_kvcache import _signals

    monkeypatch.setattr(_signals, "STARTED", time.perf_counter() - started_ago if started_ago else None)
    argv = ["convert", str(model_file), str(tmp_path / "o.onnx"), "--format", "int8"]
    assert main([*argv, "--scales", str(scale_file(tmp_path))]) == 0
    seconds = float(re.search(r" in ([0-9.]+)s$", capsys.readouterr().out, re.M)[1])  # type: ignore[index]
    assert started_ago <= seconds < started_ago + 60
    assert _signals.STARTED is None  # consumed: a second command in the process times itself


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_convert_then_inspect(tmp_path, model_file, fp16_model_file, capsys, fmt):
    out = tmp_path / f"{fmt}.onnx"
    src = fp16_model_file if fmt == "fp8" else model_file  # fp8 runs on CUDA: fp16/bf16 queries
    assert main(["convert", str(src), str(out), "--format", fmt, "--scales", str(scale_file(tmp_path))]) == 0
    assert "converted 2 GroupQueryAttention node(s)" in capsys.readouterr().out
    assert main(["inspect", str(out), "--context", "4096"]) == 0
    text = capsys.readouterr().out
    assert "past_key_values.1.key" in text and "cache bytes per token" in text and "4096 tokens" in text
    assert main(["inspect", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["original_bytes_per_token"] / doc["bytes_per_token"] == {"fp8": 2, "int8": 4, "int4": 8}[fmt]


def test_fp8_without_scales_warns_on_stderr(tmp_path, fp16_model_file, capsys):
    assert main(["convert", str(fp16_model_file), str(tmp_path / "o.onnx")]) == 0
    assert "unit scales" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["convert", "{model}", "{tmp}/o.onnx", "--format", "int8"], "needs calibrated scales"),
        (["convert", "{empty}", "{tmp}/o.onnx", "--format", "int8"], "is empty (0 bytes)"),
        (["convert", "{text}", "{tmp}/o.onnx", "--format", "int8"], "ONNX model"),
        (["convert", "{model}", "{tmp}", "--format", "int8"], "is a folder"),
        (["convert", "{model}", "{tmp}/new/", "--format", "int8"], "name the output file"),
        (["calibrate", "{model}", "--out", "{model}"], "one of the input's files"),
        (["convert", "{model}", "{tmp}/o.onnx", "--scales", "{tmp}/missing.json"], "missing.json is missing"),
        (["convert", "{tmp}/nope.onnx", "{tmp}/o.onnx"], "does not exist"),
        (["convert", "{model}", "{model}"], "is the input"),
        (["convert", "{bad}", "{tmp}/o.onnx"], "not a readable ONNX model"),
        (["inspect", "{bad}"], "not a readable ONNX model"),
        (
            ["inspect", "{model}", "--batch", "4"],
            "--batch sizes the cache at --context N; give --context too",
        ),
        (
            ["calibrate", "{model}", "--out", "{tmp}/s.json", "--percentile", "99"],
            "--percentile applies to --method percentile, not the default method (int4: mse or attention, "
            "else minmax); add --method percentile",
        ),
        (
            ["calibrate", "{model}", "--out", "{tmp}/s.json", "--method", "mse", "--percentile", "99"],
            "--percentile applies to --method percentile, not --method mse",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, model_file, capsys, argv, message):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"definitely not protobuf \x00\xff")
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "notes.onnx").write_text("my notes, not a model\n")
    names = {"model": model_file, "tmp": tmp_path, "bad": bad}
    names |= {"empty": tmp_path / "empty.onnx", "text": tmp_path / "notes.onnx"}
    args = [a.format(**names) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o.onnx").exists()


#: What the command must not import before it has parsed its arguments and checked its inputs.


def test_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "onnx_kvcache", "--version"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.startswith("onnx-kvcache ")


class _Terminal(io.StringIO):
    """stderr as a terminal: progress bars draw on it."""

    def isatty(self) -> bool:
        return True


def _screen(text: str) -> list[str]:
    """What a terminal shows after ``text``: carriage returns overwrite the line."""
    lines = []
    for raw in text.split("\n"):
        line = ""
        for part in raw.split("\r"):
            line = part + line[len(part) :]
        lines.append(line.rstrip())
    return [line for line in lines if line]


def test_demo_table_legend_keep_and_no_leftover_bar(tmp_path, monkeypatch, capsys):
    """The whole demo runs in tests/test_docs.py (README's quickstart); two variants here."""
    monkeypatch.setattr(demo, "DEMO_VARIANTS", (demo.DEMO_VARIANTS[1], demo.DEMO_VARIANTS[3]))
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["demo", "--keep", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f"models in {tmp_path}")
    rows = [line.split() for line in lines if line.startswith(("float32", "fp8", "int8"))]
    assert [r[:2] for r in rows] == [["float32", "-"], ["fp8", "per_channel"], ["int8", "per_channel"]]
    assert rows[0][-5:] == ["2048", "-", "-", "-", "-"] and rows[2][-5] == "512"
    assert any(line.startswith("B/token: cache bytes per token; KL mean/max") for line in lines)
    assert (tmp_path / "model.int8.per_channel.onnx").is_file()
    assert "demo" in terminal.getvalue()  # a bar was drawn on the terminal ...
    assert _screen(terminal.getvalue()) == []  # ... and nothing of it is left above the table


def test_demo_evaluates_on_data_its_scales_never_saw(monkeypatch, capsys):
    """Scales from the corpus's calibration part, scores on its held-out evaluation part."""
    seen: dict[str, list[list[int]]] = {}

    def spy(name, real):
        def call(*args, **kwargs):
            seen[name] = next(arg for arg in args if isinstance(arg, list))  # the token windows
            return real(*args, **kwargs)

        monkeypatch.setattr(demo, name, call)

    spy("calibrate_kv_cache", demo.calibrate_kv_cache)
    spy("evaluate_kv_cache", demo.evaluate_kv_cache)
    monkeypatch.setattr(demo, "DEMO_VARIANTS", (demo.DEMO_VARIANTS[3],))
    assert main(["demo", "--no-progress"]) == 0
    calibrated, evaluated = (
        bytes(seen[name][0]).decode() for name in ("calibrate_kv_cache", "evaluate_kv_cache")
    )
    assert calibrated == builtin_corpus("calibration") and evaluated == builtin_corpus("evaluation")
    assert evaluated not in calibrated and calibrated not in evaluated
    assert "evaluated on its held-out evaluation part" in capsys.readouterr().out


def test_no_progress_draws_no_bar(tmp_path, model_file, monkeypatch):
    out = tmp_path / "s.json"
    argv = ["calibrate", str(model_file), "--out", str(out), "--format", "int8", "--seq-len", "64"]
    for extra, drawn in (([], True), (["--no-progress"], False)):
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main([*argv, "--num-seqs", "4", "--min-tokens", "64", *extra]) == 0
        assert ("calibrating: " in terminal.getvalue()) is drawn, extra  # the bar, not the warning
    assert build_parser().parse_args(["evaluate", "a", "b", "--no-progress"]).progress is False
    assert build_parser().parse_args(["convert", "a", "b", "--no-progress"]).progress is False


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("command", list(_subcommands()))
def test_help_shows_every_default_and_describes_every_argument(command):
    parser = _subcommands()[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        text = formatter._get_help_string(action)
        assert text, f"{command} {action.dest}: no help"
        if action.option_strings and action.nargs != 0 and not action.required:
            assert "default" in text, f"{command} {action.option_strings[-1]}: no default in {text!r}"
    assert "(default:" in parser.format_help() or command == "doctor"


def test_calibrate_help_names_its_defaults():
    text = " ".join(_subcommands()["calibrate"].format_help().split())
    for default in (
        "(default: the first its target runs, the target as convert infers it: fp8 on CUDA",
        "(default: per_tensor)",
        "(default: int4 mse rotated, attention unrotated, mse where no attention node of ours gives queries; "
        "else minmax",
        "(default: 512, or the model's context when shorter)",
    ):
        assert default in text


@pytest.mark.parametrize(
    "argv", [["-v", "inspect", "m.onnx"], ["inspect", "m.onnx", "-v"], ["inspect", "--verbose", "m.onnx"]]
)
def test_verbose_before_or_after_the_command(argv):
    assert build_parser().parse_args(argv).verbose is True
    assert getattr(build_parser().parse_args(["inspect", "m.onnx"]), "verbose", False) is False


def test_inspect_ep_takes_known_providers_only(capsys):
    assert build_parser().parse_args(["inspect", "m.onnx", "--ep", "CUDA"]).ep == "cuda"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["inspect", "m.onnx", "--ep", "cudaa"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("parts", "python", "cli"),
    [
        (("use ", Param("in_place", True), " to rewrite it."), "use in_place=True to", "use --in-place to"),
        (("pass ", Param("overwrite", True), " to"), "pass overwrite=True to", "pass --overwrite to"),
        (
            ("convert with ", Param("granularity", "per_channel"), "."),
            "convert with granularity='per_channel'.",
            "convert with --granularity per_channel.",
        ),
        (("(", Param("seq_len", placeholder="N"), ")"), "(seq_len=N)", "(--seq-len N)"),
        (("lower ", Param("min_tokens", placeholder="N")), "lower min_tokens=N", "lower --min-tokens N"),
        (
            (
                "Pass ",
                Param("scales", placeholder="PATH"),
                ", or measure them with ",
                Function("calibrate_kv_cache"),
                ".",
            ),
            "Pass scales=PATH, or measure them with calibrate_kv_cache().",
            "Pass --scales PATH, or measure them with onnx-kvcache calibrate.",
        ),
        (
            ("(an earlier ", Param("weights", "link"), "?)"),
            "(an earlier weights='link'?)",
            "(an earlier --weights link?)",
        ),
        ((Param("semantics", "cpu"), " on an fp8 cache"), "semantics='cpu' on an", "--semantics cpu on an"),
        (
            ("use ", Param("quantized_io", True), "."),
            "use quantized_io=True.",
            "use quantized_io=True.",
        ),  # no option
        ((Param("in_place", False),), "in_place=False", "in_place=False"),  # a value no option gives
        ((Param("progress", False),), "progress=False", "--no-progress"),  # store_false: the value it sets
        (("(", Param("verify", True), ")"), "(verify=True)", "(--verify)"),  # BooleanOptionalAction:
        (("(", Param("verify", False), ")"), "(verify=False)", "(--no-verify)"),  # the value's own flag
        (
            (Function("calibrate_kv_cache", (Param("format", "int4"), Param("method", "mse"))),),
            "calibrate_kv_cache(format='int4', method='mse')",
            "onnx-kvcache calibrate --format int4 --method mse",
        ),
    ],
)
def test_library_messages_in_the_commands_words(parts, python, cli):
    message = Message(*parts)
    assert python in message and python in str(KvCacheError(*parts))
    assert cli in render(message, _wording()) and cli in render(KvCacheError(*parts), _wording())


def test_errors_speak_cli_in_the_cli_and_python_in_python(tmp_path, model_file, capsys):
    convert_model(model_file, tmp_path / "taken.onnx", format="int8", scales=scale_file(tmp_path))
    cases = [
        ((model_file,), {}, "in_place=True", "--in-place"),
        (
            (model_file, tmp_path / "taken.onnx"),
            {"scales": scale_file(tmp_path)},
            "overwrite=True",
            "--overwrite",
        ),
        ((model_file, tmp_path / "o.onnx"), {}, "scales=PATH", "--scales PATH"),
    ]
    for args, kwargs, python, cli in cases:
        with pytest.raises(KvCacheError) as info:
            convert_model(*args, format="int8", **kwargs)
        assert python in str(info.value) and cli not in str(info.value)
        argv = ["convert", *map(str, args), "--format", "int8"]
        argv += ["--scales", str(kwargs["scales"])] if kwargs else []
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert cli in err and python not in err, err


#: Options of other programs the library runs (nvidia-smi), never ours.
_OPTION_IN_STRING = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?![\w=-])")


def test_library_messages_name_no_command_line_option():
    """Only the command speaks options: the modules of cli/ (its parser and dispatcher in
    commands.py, each command in its own module). The library outside it never names one; it
    names Python parameters (as errors.Param parts), which the command words as its options."""
    options = {o for p in _subcommands().values() for a in p._actions for o in a.option_strings}
    cli = pathlib.Path(main.__code__.co_filename).parent
    found = []
    for path in sorted(cli.parent.rglob("*.py")):
        if path.is_relative_to(cli):
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                found += [
                    f"{path.name}:{node.lineno} {o}"
                    for o in _OPTION_IN_STRING.findall(node.value)
                    if o in options
                ]
    assert not found


def test_the_cpu_extra_is_enough_to_calibrate_and_evaluate_a_genai_folder(tmp_path):
    """``pip install ".[cpu]"``: every distribution these commands import is in it (or the core)."""
    folder = save_genai_folder(tmp_path / "g", num_layers=2)  # has a tokenizer.json
    scales, out = tmp_path / "s.json", tmp_path / "g-int8"
    commands = [
        ["calibrate", folder, "--out", scales, "--format", "int8", "--seq-len", "64", "--num-seqs", "4"],
        ["convert", folder, out, "--scales", scales, "--format", "int8"],
        ["evaluate", folder, out, "--num-seqs", "1", "--seq-len", "32", "--max-new-tokens", "2"],
    ]
    script = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "from onnx_kvcache.cli.commands import main\n"
        f"for argv in {[[str(a) for a in c] for c in commands]!r}:\n"
        "    assert main([*argv, '--min-tokens', '64'] if argv[0] == 'calibrate' else argv) == 0, argv\n"
        "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before})))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    modules = set(result.stdout.splitlines()[-1].split()) - set(sys.stdlib_module_names)
    distributions = importlib.metadata.packages_distributions()
    imported = {_canonical(d) for m in modules for d in distributions.get(m, [])}
    assert "tokenizers" in imported and "onnxruntime" in imported
    from packaging.requirements import Requirement

    declared = [Requirement(r) for r in importlib.metadata.requires("onnx-kvcache") or []]
    core_and_cpu = [r.name for r in declared if r.marker is None or r.marker.evaluate({"extra": "cpu"})]
    allowed = _closure(core_and_cpu)
    assert imported - allowed - {"onnx-kvcache"} == set()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install, following installed metadata."""
    from packaging.requirements import Requirement

    found: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = _canonical(req.name)
        if name in found or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        found.add(name)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # not installed: not imported
            todo += [Requirement(r) for r in importlib.metadata.requires(req.name) or []]
    return found


def test_convert_takes_the_granularity_of_the_scale_file(tmp_path, model_file, capsys):
    scales = tmp_path / "pc.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [[0.1] * 64] * 2, "v_scales": [[0.2] * 64] * 2}}))
    out = tmp_path / "pc.onnx"
    assert main(["convert", str(model_file), str(out), "--format", "int8", "--scales", str(scales)]) == 0
    assert "int8 per_channel" in capsys.readouterr().out
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"][0]["k_quant_type"] == "PER_CHANNEL"
    args = ["convert", str(model_file), str(tmp_path / "x.onnx"), "--format", "int8", "--scales", str(scales)]
    assert main([*args, "--granularity", "per_tensor"]) == 0  # finer scales for one: their max, warned
    assert "merged into one per tensor, their max" in capsys.readouterr().err
    single = tmp_path / "pt.json"
    single.write_text(json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.2, 0.2]}}))
    args = ["convert", str(model_file), str(tmp_path / "y.onnx"), "--format", "int8", "--scales", str(single)]
    assert main([*args, "--granularity", "per_channel"]) == 2  # coarser scales for finer: an error
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
        ["calibrate", "{model}", "--out", "{tmp}/s.json", "--margin", "inf"],
        ["calibrate", "{model}", "--out", "{tmp}/s.json", "--margin=-inf"],
        ["calibrate", "{model}", "--out", "{tmp}/s.json", "--percentile", "inf"],
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
        ("int8", "float32", "cpu (onnxruntime CPU kernel, prompt in float)"),
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
    cpu = cpu[:-1] + ", prompt in float)" if rule.startswith("cpu") else cpu  # converted for the CPU
    assert f"kernel rule           {cpu}" in capsys.readouterr().out


# -- issue 32, item 2: inspect previews what convert does to an export -----------------------


@pytest.mark.parametrize(
    ("export", "ep", "line"),
    [
        (
            "export_llama_opset23.onnx",
            [],
            "convert for cpu (assumed: a float32 model; --ep to choose): int8 per_tensor, "
            "cache bytes per token 384",
        ),
        (
            "optimum_llama",
            ["--ep", "cuda"],
            "convert for cuda (--ep): fp8 per_tensor, cache bytes per token 384 (now 1536, 4.00x smaller); "
            "the attention computes in float16",
        ),
        (
            "optimum_llama",
            ["--ep", "dml"],
            "convert for dml (--ep) would refuse: KV cache not converted to fp8",
        ),
    ],
)
def test_inspect_previews_an_export_without_writing_it(capsys, export, ep, line):
    path = pathlib.Path(__file__).parents[1] / "data" / export
    graph = path / "model.onnx" if path.is_dir() else path
    before = graph.read_bytes()
    assert main(["inspect", str(path), *ep]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no GroupQueryAttention node yet: convert fuses 3 attention layer(s)")
    assert "past_key_values.2.key" in out and "cache bytes per token: 1536 (unquantized)" in out
    assert line in out
    assert graph.read_bytes() == before
    assert main(["inspect", str(path), *ep, "--json", "--context", "100"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["layers"]) == 3 and doc["cache_bytes"] == 153600
    assert doc["preview"]["fused_layers"] == 3 and (doc["preview"]["refused"] is None) == (
        "refuse" not in line
    )
    assert graph.read_bytes() == before


def test_inspect_of_an_export_that_does_not_fuse_says_why(tmp_path, capsys):
    model = ir.load(pathlib.Path(__file__).parents[1] / "data" / "export_llama_opset23.onnx")
    for node in model.graph:
        if node.op_type == "Attention":
            node.attributes["scale"] = ir.AttrFloat32("scale", float("nan"))
    ir.save(model, tmp_path / "m.onnx")
    assert main(["inspect", str(tmp_path / "m.onnx")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("exported attention (not fused): cache")  # the export's own caches
    refusal = [i for i, line in enumerate(lines) if line.startswith("convert would refuse: Not converted: ")]
    assert len(refusal) == 1 and "attention fusion fused nothing: 3 attention" in lines[refusal[0]]
    assert lines[refusal[0] + 1 :] == [line for line in lines if "storage qdq stores" in line]  # the way on


def test_inspect_says_what_the_cache_costs_at_the_models_context_and_in_time(tmp_path, capsys):
    """A float cache: what convert would make of it (bytes at the model's context, the prompt's
    speed on the CPU); a converted one: its own, and whether its prompt is at float speed."""
    from onnx_kvcache.cache.prompt_path import unwrap

    src = tmp_path / "model.onnx"
    ir.save(build_decoder(num_layers=2, vocab_size=300, max_position=512), src)
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert "cache at the model's context (512 tokens), batch 1: 0.5 MiB now, 0.1 MiB converted" in out
    assert "speed on cpu: a prompt at float speed" in out
    scales = tmp_path / "s.json"
    scales.write_text(
        json.dumps({"scales": {"k_scales": [0.05, 0.05], "v_scales": [0.05, 0.05]}, "qmax": 128})
    )
    out_file = tmp_path / "int8.onnx"
    assert main(["convert", str(src), str(out_file), "--format", "int8", "--scales", str(scales)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out_file)]) == 0
    assert "speed on cpu: a prompt at float speed" in capsys.readouterr().out
    plain = ir.load(out_file)
    assert unwrap(plain) == 2
    ir.save(plain, tmp_path / "plain.onnx")
    assert main(["inspect", str(tmp_path / "plain.onnx")]) == 0
    out = capsys.readouterr().out
    assert "a prompt through the quantized kernel" in out and "converting it again for cpu" in out
    assert main(["inspect", str(src), "--ep", "cuda"]) == 0
    assert "speed on" not in capsys.readouterr().out  # not measured here
