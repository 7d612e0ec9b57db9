"""The command parses and refuses before importing onnx, onnx-ir or numpy; its parser is the tables'."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import onnx_ir as ir
import pytest

from onnx_kvcache.cli.commands import build_parser
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.models.decoder import build_decoder

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
_HUB_ID = (
    "Tokenizer meta-llama/Llama-3.2-1B does not exist; give a local tokenizer.json or a folder holding "
    "one (hub ids are not downloaded)."
)


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
        ([*_CALIBRATE, "--tokenizer", "meta-llama/Llama-3.2-1B"], _HUB_ID),
        (["evaluate", "{model}", "{model}", "--tokenizer", "meta-llama/Llama-3.2-1B"], _HUB_ID),
        ([*_CALIBRATE, "--tokenizer", "{tmp}/dir.txt"], "tokenizer.json does not exist; give a local"),
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
