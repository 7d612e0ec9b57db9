"""The onnx-kvcache command: exit codes, one-line errors, and the demo."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.metadata
import io
import json
import os
import pathlib
import re
import subprocess
import sys

import onnx_ir as ir
import pytest

from onnx_kvcache import convert_model
from onnx_kvcache.capabilities.table import EP_CAPABILITIES
from onnx_kvcache.cli import _demo as demo
from onnx_kvcache.cli.commands import _wording, build_parser, main
from onnx_kvcache.errors import Function, KvCacheError, Message, Param, render
from onnx_kvcache.files import _atomic as file_io
from onnx_kvcache.models.decoder import build_decoder, save_genai_folder


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


@pytest.fixture
def fp16_model_file(tmp_path):
    path = tmp_path / "model16.onnx"
    ir.save(build_decoder(num_layers=2, dtype="float16"), path)
    return path


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
            "--percentile applies to --method percentile, not --method minmax",
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
HEAVY = ("onnx", "onnx_ir", "onnxscript", "onnxruntime", "numpy", "ml_dtypes", "sympy", "google")

_RECORD_IMPORTS = """
import atexit, sys
record, *argv = sys.argv[1:]
sys.argv = ["onnx-kvcache", *argv]
heavy = set(HEAVY)
write = lambda: open(record, "w").write(" ".join(sorted(heavy & {m.split(".")[0] for m in sys.modules})))
atexit.register(write)
from onnx_kvcache.cli._entry import main
main()
""".replace("HEAVY", repr(HEAVY))


def _run_recording_imports(tmp_path, argv):
    """The command run as its console script on a 1-layer model; the heavy modules it imported."""
    model = tmp_path / "m" / "model.onnx"
    model.parent.mkdir()
    ir.save(build_decoder(num_layers=1), model)
    record = tmp_path / "imported.txt"
    args = [a.format(model=model, tmp=tmp_path) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-c", _RECORD_IMPORTS, str(record), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, set(record.read_text().split())


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["--version"], 0),
        (["--bogus"], 2),
        (["convert", "--help"], 0),
        (["inspect", "{model}", "--ep", "tpu"], 2),
        (["calibrate", "{model}", "--out", "{tmp}/s.json", "--seq-len", "0"], 2),
        (["inspect", "{tmp}/missing.onnx"], 2),
        (["convert", "{model}", "{tmp}/o.onnx", "--scales", "{tmp}/missing.json"], 2),
        (["evaluate", "{model}", "{model}", "--text", "{tmp}/missing.txt"], 2),
        (["calibrate", "{tmp}", "--out", "{tmp}/s.json"], 2),  # a folder without genai_config.json
        (["inspect", "{model}"], 0),  # the control: a command that reads a model imports them
    ],
)
def test_the_command_answers_and_refuses_before_importing_onnx_or_numpy(tmp_path, argv, code):
    """--help, --version and a mistyped flag took 2.2 s: the CLI imported onnx-ir (and with it
    onnx, numpy and ml_dtypes 0.7's 1.3 s extension) before it parsed its arguments."""
    proc, imported = _run_recording_imports(tmp_path, argv)
    assert proc.returncode == code, proc.stderr
    last = proc.stderr.splitlines()[-1] if code else "onnx-kvcache"
    assert "Traceback" not in proc.stderr and last.startswith("onnx-kvcache"), proc.stderr
    if argv == ["inspect", "{model}"]:
        assert {"onnx_ir", "numpy", "ml_dtypes"} <= imported
    else:
        assert imported == set(), f"{argv}: imported {imported}"


def _not_regular_files(tmp: pathlib.Path) -> None:
    """A folder, a FIFO, a dangling link and a link loop under ``tmp``, with every suffix."""
    for suffix in (".txt", ".json", ".npy"):
        (tmp / f"dir{suffix}").mkdir()
        os.mkfifo(tmp / f"fifo{suffix}")
        (tmp / f"dangling{suffix}").symlink_to(tmp / "nowhere")
        (tmp / f"loop{suffix}").symlink_to(tmp / f"loop{suffix}")
    (tmp / "tokdir").mkdir()
    os.mkfifo(tmp / "tokdir" / "tokenizer.json")


_CALIBRATE = ["calibrate", "{model}", "--out", "{tmp}/s.json"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "{model}", "--batch", "2"], "give --context too"),
        ([*_CALIBRATE, "--percentile", "99"], "--percentile applies to --method percentile"),
        ([*_CALIBRATE, "--method", "mse", "--percentile", "99"], "not --method mse"),
        ([*_CALIBRATE, "--text", "{tmp}/dir.txt"], "is a folder"),
        ([*_CALIBRATE, "--text", "{tmp}/fifo.txt"], "is a FIFO"),
        ([*_CALIBRATE, "--text", "{tmp}/dangling.txt"], "broken symbolic link"),
        ([*_CALIBRATE, "--token-ids", "{tmp}/loop.json"], "symbolic link loop"),
        ([*_CALIBRATE, "--token-ids", "{tmp}/fifo.npy"], "is a FIFO"),
        ([*_CALIBRATE, "--tokenizer", "{tmp}/fifo.json"], "is a FIFO"),
        ([*_CALIBRATE, "--tokenizer", "{tmp}/tokdir"], "is a FIFO"),
        ([*_CALIBRATE, "--tokenizer", "/dev/null"], "is a character device"),
        (["evaluate", "{model}", "{model}", "--text", "{tmp}/dir.txt"], "is a folder"),
        (["convert", "{model}", "{tmp}/o.onnx", "--scales", "{tmp}/dir.json"], "is a folder"),
        (["convert", "{model}", "{tmp}/o.onnx", "--scales", "{tmp}/fifo.json"], "is a FIFO"),
        (["convert", "{model}", "{tmp}/o.onnx", "--scales", "/dev/null"], "is a character device"),
        (["convert", "{model}", "{tmp}/o.onnx", "--scales", "{tmp}/dangling.json"], "broken symbolic"),
        (["convert", "{model}", "{tmp}/o.onnx", "--scales", "{tmp}/loop.json"], "symbolic link loop"),
        (["convert", "{model}"], "Give an output path, or --in-place"),
        (["convert", "{model}", "{tmp}/o.onnx", "--in-place"], "not both"),
        (["convert", "{model}", "{model}"], "is the input; use --in-place"),
        (["doctor", "--provider", "tpu"], "Unknown execution provider 'tpu'"),
    ],
)
def test_bad_arguments_are_refused_before_importing_onnx_or_numpy(tmp_path, argv, message):
    """The review found each refused only after onnx-ir, numpy (and for calibrate the whole model
    in onnxruntime, for doctor onnxruntime) had been imported or loaded."""
    _not_regular_files(tmp_path)
    proc, imported = _run_recording_imports(tmp_path, argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert imported == set(), proc.stderr
    assert not (tmp_path / "s.json").exists() and not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize(
    ("argv", "usage", "named"),
    [
        (["--bogus"], "usage: onnx-kvcache [", "--bogus"),
        (["inspect", "--bogus"], "usage: onnx-kvcache inspect", "--bogus"),
        (["inspect", "m.onnx", "--bogus"], "usage: onnx-kvcache inspect", "--bogus"),
        (["convert", "--frmat", "int8", "x"], "usage: onnx-kvcache convert", "--frmat"),
        (
            ["-v", "calibrate", "m.onnx", "--out=s.json", "--bogus=1"],
            "usage: onnx-kvcache calibrate",
            "--bogus=1",
        ),
    ],
)
def test_an_unknown_option_is_named_in_its_commands_usage(capsys, argv, usage, named):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith(usage) and f"unrecognized arguments: {named}" in err, err


@pytest.mark.parametrize(
    "argv", [["inspect", "m.onnx", "--cont", "4", "-v"], ["-v", "inspect", "--", "-m.onnx"]]
)
def test_known_options_abbreviations_and_positionals_after_dashes_still_parse(argv):
    build_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("given", "reason"),
    [
        ("OpenVINOExecutionProvider", "OpenVINO's own runtime"),
        ("TensorrtExecutionProvider", "not a provider of the capability table"),
        ("tpu", "not a provider of the capability table"),
    ],
)
def test_a_refused_ep_is_echoed_as_given_with_the_reason(capsys, given, reason):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["convert", "m.onnx", "o.onnx", "--ep", given])
    err = capsys.readouterr().err
    assert f"invalid choice: {given!r}" in err and reason in err, err


def test_importing_the_package_and_the_command_is_cheap():
    """``import onnx_kvcache`` (names on first use), its command's module and its errors."""
    code = (
        "import sys, onnx_kvcache, onnx_kvcache.cli.commands, onnx_kvcache.errors\n"
        "from onnx_kvcache import KvCacheError, MissingRuntimeError, __version__\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_the_parsers_names_are_the_tables():
    """The parser's choices come from _names (standard library); the tables are the truth."""
    from onnx_kvcache.cache.formats import CACHE_FORMATS, SCALE_GRANULARITIES
    from onnx_kvcache.capabilities.table import CAPABILITIES, get_capabilities
    from onnx_kvcache.cli import _names

    assert tuple(CACHE_FORMATS) == _names.FORMATS
    assert tuple(SCALE_GRANULARITIES) == _names.GRANULARITIES
    for table in CAPABILITIES.values():
        assert {name: row.provider for name, row in table.items() if name != "default"} == _names.PROVIDERS
    for given in [*_names.PROVIDERS, *(p for p in _names.PROVIDERS.values() if p), *_names.EP_ALIASES, "TPU"]:
        row = get_capabilities(given)
        assert _names.ep_name(given) == (row.name if row.name != "default" else given.lower()), given


def test_errors_keep_their_classes_without_onnx_ir_imported():
    """KvCachePreconditionError (onnx-ir's PreconditionError) is made on first use: one class."""
    import pickle

    from onnx_kvcache import errors

    error = errors.KvCachePreconditionError("no")
    assert isinstance(error, ir.passes.PreconditionError) and isinstance(error, KvCacheError)
    assert errors.KvCachePreconditionError is pickle.loads(pickle.dumps(errors.KvCachePreconditionError))
    assert type(pickle.loads(pickle.dumps(error))) is errors.KvCachePreconditionError


def test_importing_the_module_entry_point_runs_nothing():
    """``import onnx_kvcache.__main__`` printed the usage and left with os._exit."""
    result = subprocess.run(
        [sys.executable, "-c", "import onnx_kvcache.__main__; print('imported')"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "imported\n", "")


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
        "(default: attention for int4, else minmax",
        "(default: 512)",
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
    """Only cli/commands.py speaks options; the library names Python parameters (as errors.Param parts)."""
    options = {o for p in _subcommands().values() for a in p._actions for o in a.option_strings}
    commands = pathlib.Path(main.__code__.co_filename)
    found = []
    for path in sorted(commands.parents[1].rglob("*.py")):
        if path == commands:
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


# -- issue 10, item 5: convert refuses what nothing can run, inferring the target ------


def test_without_ep_the_target_is_inferred_and_gated(tmp_path, model_file, fp16_model_file, capsys):
    out = tmp_path / "o.onnx"
    assert main(["convert", str(model_file), str(out), "--format", "fp8"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("onnx-kvcache: not converted for cuda")
    assert "(assumed: fp8 caches run only on CUDA; --ep to choose)" in err
    assert "Fix: --ep cpu --format int8 or int4, if the model will run there." in err
    assert not out.exists()
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
    assert main(["convert", str(folder), str(tmp_path / "o"), "--format", "int8", "--scales", scales]) == 1
    err = capsys.readouterr().err
    assert "for cuda (assumed: genai_config.json's provider_options name 'cuda'; --ep to choose)" in err
    assert "FLOAT" in err and "Fix: --ep cpu or openvino runs int8, if the model will run there" in err


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


# -- issue 9: calibrate --out, errors as one line --------------------------------------


def test_calibrate_checks_out_before_calibrating(tmp_path, monkeypatch, capsys):
    folder = save_genai_folder(tmp_path / "g", num_layers=2, vocab_size=300)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def must_not_run(*args, **kwargs):
        raise AssertionError("calibration ran before --out was checked")

    monkeypatch.setattr("onnx_kvcache.scales.calibration.calibrate_kv_cache", must_not_run)
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
    monkeypatch.setattr("onnx_kvcache.scales.calibration.calibrate_kv_cache", must_not_run)
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
    assert "no GroupQueryAttention kernel" not in err and "Fix: openvino runs --format int8 or int4." in err


@pytest.mark.parametrize("name", ["CUDAExecutionProvider", "CUDA", "gpu"])
def test_ep_takes_onnxruntimes_provider_names_too(tmp_path, model_file, capsys, name):
    out = tmp_path / "o.onnx"
    assert main(["convert", str(model_file), str(out), "--format", "fp8", "--ep", name]) == 1
    assert "not converted for cuda (--ep)" in capsys.readouterr().err  # float32: CUDA has no kernel
