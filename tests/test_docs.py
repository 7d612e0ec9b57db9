"""README.md and docs/*.md run: every Python block and shell command, on models built here.

Each page runs top to bottom in its own temporary folder, so a block may use what an earlier
block of the page wrote. A block may declare what it needs in an HTML comment on the line
right above its fence (docs/index.md, "The docs are tested"):

    <!-- docs-test: DIRECTIVE -->        or   <!-- docs-test:
                                              DIRECTIVE
                                              DIRECTIVE
                                              -->

    setup: PYTHON               run first, in the page's folder; the names it assigns are the
                                block's globals (``block`` holds the block's text); the
                                lines after it that are no directive continue it
    not run: REASON             the block is not run (test_what_is_not_run lists it)
    not run "PREFIX": REASON    commands starting with PREFIX are not run (listed too)
    substitute "OLD" -> "NEW"   run the block with OLD replaced (smaller arguments)
    output of: COMMAND          an output block: its lines appear, in order, in what COMMAND
                                printed (``the commands above``: the page's commands so far)
    figures within: N%          numbers of an output block may differ by N% (machine noise)

In a ``console`` block, ``$ `` lines are commands and the others what they print. In a
Python block each statement runs on its own, and a trailing comment is checked when it
states a result: ``# raises`` (the statement must raise), ``# warns ...`` (it must emit a
KvCacheWarning, of the class it names if it names one; nothing else may), or a literal
(``# 256.0``, ``# [1,1,32] None False``,
``# "cuda (emulated on CPU)"``: what it prints or evaluates to, up to a `` (`` remark; ``...``
elides).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import io
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import tempfile
import warnings
from typing import Any

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import calibrate_kv_cache, convert_model
from onnx_kvcache.cli.commands import build_parser, main
from onnx_kvcache.errors import WARNINGS, KvCacheWarning
from onnx_kvcache.models.decoder import byte_level_tokenizer, save_genai_folder

from builders.exported import ExportStyle, build_decoder, exported_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Every block or command the suite does not run, and why: a new one is a deliberate edit here.
#: Keys: (page, the command prefix, the command of an output block, or what the block calls).
#: docs/rotation.md's 512-token table: each format rotated and not (benchmarks/real_model.py rows)
ROTATION_ROWS = (
    "int4:per_channel:ours:attention",
    "int4:per_channel:ours:attention:keys",
    "int4:per_channel:ours:attention:keys_and_values",
    "int4:per_tensor:ours:attention",
    "int4:per_tensor:ours:attention:keys_and_values",
    "int8:per_channel:ours:minmax",
    "int8:per_channel:ours:minmax:keys_and_values",
    "fp8:per_tensor:ours:minmax",
    "fp8:per_tensor:ours:minmax:keys_and_values",
)
#: its 512-token table of int4 methods on rotated caches
MSE_ROWS = (
    "int4:per_channel:ours:mse:keys_and_values",
    "int4:per_channel:ours:mse:keys",
    "int4:per_tensor:ours:mse:keys_and_values",
    "int4:per_channel:ours:attention:keys_and_values",
)
#: its table by position to 8k
BY_POSITION_ROWS = (
    "int4:per_channel:ours:attention:keys_and_values",
    "int4:per_tensor:ours:attention:keys_and_values",
    "int4:per_channel:ours:mse:keys_and_values",
    "int4:per_channel:ours:attention:keys",
    "int4:per_channel:ours:minmax:keys_and_values",
    "int4:per_channel:ours:attention_search:keys_and_values",
    "int4:per_channel:ours:attention",
    "int4:per_tensor:ours:attention",
    "int4:per_tensor:ours:mse:keys_and_values",
    "int4:per_channel:ours:mse:keys",
)
NOT_RUN = {
    ("README.md", "pip install"): "CI installs the package (.ci/run) before it runs the suite",
    ("README.md", "python -m pytest"): "the test suite itself, which runs this",
    ("docs/exporting.md", "torch.onnx.export"): "needs torch, transformers and a model download",
    ("docs/choosing-a-format.md", "python benchmarks/evaluate.py"): "a benchmark: timings of that machine",
    ("docs/choosing-a-format.md", "python benchmarks/evaluate.py --real-model CACHE --rounds 5"): (
        "a benchmark: needs the real model (pip install gguf) and timings of that machine"
    ),
    ("docs/calibration.md", "python benchmarks/real_model.py"): (
        "a benchmark: downloads a model from PyPI and takes tens of minutes"
    ),
    ("docs/calibration.md", "python benchmarks/int4_sensitivity.py"): (
        "a benchmark: needs benchmarks/real_model.py's model and takes tens of minutes"
    ),
    ("docs/calibration.md", "python benchmarks/int4_sensitivity.py --scales FILE"): (
        "a benchmark: needs benchmarks/real_model.py's model and takes tens of minutes"
    ),
    ("docs/warnings.md", "filterwarnings = ["): (
        "pytest settings, not a program; tests/test_warnings.py checks this project's"
    ),
    ("docs/calibration.md", "python benchmarks/attention_error.py"): (
        "a benchmark: needs the model benchmarks/real_model.py downloads and builds"
    ),
    ("docs/rotation.md", "python benchmarks/real_model.py --rows " + " ".join(ROTATION_ROWS)): (
        "a benchmark: needs the real model and takes tens of minutes"
    ),
    ("docs/rotation.md", "python benchmarks/real_model.py --rows " + " ".join(MSE_ROWS)): (
        "a benchmark: needs the real model and takes tens of minutes"
    ),
    (
        "docs/rotation.md",
        "python benchmarks/real_model.py --by-position 8192 --rows " + " ".join(BY_POSITION_ROWS),
    ): ("a benchmark: needs the real model and takes about an hour"),
    ("docs/rotation.md", "python benchmarks/rotation_speed.py"): (
        "a benchmark: builds a 30-layer decoder three times and takes minutes"
    ),
    ("docs/capabilities.md", "pip install"): "installs onnxruntime-gpu and this package on the GPU machine",
    ("docs/capabilities.md", "python benchmarks/cuda_check.py"): (
        "needs a CUDA GPU (tests/test_cuda_check.py runs its dry run, preflight, models and CPU side)"
    ),
}

SHELLS = ("bash", "sh", "console")
OUTPUTS = ("", "text")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
COMMENT = re.compile(r"<!-- docs-test:(.*)-->\n", re.S)
DIRECTIVE = re.compile(
    r"""(?P<key>setup|not\ run|substitute|output\ of|figures\ within)
        (?:\s+"(?P<arg>[^"]*)"(?:\s*->\s*"(?P<new>[^"]*)")?)?
        \s*(?::\s*(?P<value>.*))?$""",
    re.X,
)


@dataclasses.dataclass
class Block:
    page: pathlib.Path
    line: int
    lang: str
    text: str
    setup: list[str] = dataclasses.field(default_factory=list)
    not_run: str | None = None
    skip_commands: dict[str, str] = dataclasses.field(default_factory=dict)
    substitutions: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    output_of: str | None = None
    tolerance: float = 0.0

    @property
    def where(self) -> str:
        return f"{page_id(self.page)}:{self.line}"

    @property
    def code(self) -> str:
        text = self.text
        for old, new in self.substitutions:
            assert old in text, f"{self.where}: substitute {old!r}: not in the block"
            text = text.replace(old, new)
        return text


def parse_directives(block: Block, comment: str) -> None:
    key = None
    for raw in comment.strip().splitlines():
        line = raw.strip()
        if not line:
            continue
        m = DIRECTIVE.match(line)
        if m is None and key == "setup":  # the setup goes on
            block.setup[-1] += "\n" + line
            continue
        assert m, f"{block.where}: unknown docs-test directive {line!r}"
        key, arg, new, value = m["key"], m["arg"], m["new"], (m["value"] or "").strip()
        if key == "setup":
            block.setup.append(value)
        elif key == "not run" and arg is None:
            block.not_run = value
        elif key == "not run":
            block.skip_commands[arg] = value
        elif key == "substitute":
            assert arg is not None and new is not None, f'{block.where}: substitute "OLD" -> "NEW"'
            block.substitutions.append((arg, new))
        elif key == "output of":
            block.output_of = value
        else:
            block.tolerance = float(value.rstrip("%")) / 100
        assert key in ("substitute", "setup") or value, f"{block.where}: {key} needs a value ({line!r})"


def blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()]
        block = Block(page, before.count("\n") + 1, m[1], m[2])
        comment = COMMENT.fullmatch(before[before.rfind("<!-- docs-test:") :])
        if comment and "-->" not in comment[1]:
            parse_directives(block, comment[1])
        found.append(block)
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]


def page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


# --- running -------------------------------------------------------------------------------


def write_tokenizer(path: str = "tokenizer.json") -> None:
    """The bundled decoder's byte-level tokenizer.json."""
    pathlib.Path(path).write_text(json.dumps(byte_level_tokenizer()))


SETUP_NAMES: dict[str, Any] = {
    "build_decoder": build_decoder,
    "calibrate_kv_cache": calibrate_kv_cache,
    "convert_model": convert_model,
    "exported_config": exported_config,
    "ExportStyle": ExportStyle,
    "ir": ir,
    "json": json,
    "np": np,
    "pathlib": pathlib,
    "save_genai_folder": save_genai_folder,
    "shutil": shutil,
    "write_tokenizer": write_tokenizer,
    "TEST_EXPORT": ROOT / "tests" / "data" / "export_llama_opset23.onnx",
}

#: Output of commands named by ``output of:``, shared by pages (their output needs no files).
_OUTPUT_CACHE: dict[str, str] = {}


def run_setup(block: Block) -> dict[str, Any]:
    names = dict(SETUP_NAMES, block=block.text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the setup is not the page: its warnings are not the reader's
        for code in block.setup:
            exec(compile(code, f"{block.where} setup", "exec"), names)
    return {k: v for k, v in names.items() if k not in SETUP_NAMES and k not in ("block", "__builtins__")}


def run_command(argv: list[str]) -> tuple[int, str, str]:
    """Run one command: ``onnx-kvcache`` in this process, anything else as a subprocess."""
    if argv[0] == "onnx-kvcache":
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv[1:])
            except SystemExit as e:  # argparse
                code = e.code if isinstance(e.code, int) else 2
        return code, out.getvalue(), err.getvalue()
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout, result.stderr


def shell_commands(block: Block) -> list[str]:
    """The block's commands (``&&`` chains split), comments dropped."""
    lines = block.code.replace("\\\n", " ").splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands = []
    for line in lines:
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(shlex.join(words[:cut]))
            words = words[cut + 1 :]
    return commands


def skipped_by(block: Block, command: str) -> str | None:
    for prefix, reason in block.skip_commands.items():
        if command.startswith(prefix):
            return reason
    return None


def _number(token: str) -> float | None:
    try:
        return float(token.rstrip("%,").replace(",", ""))
    except ValueError:
        return None


def line_matches(doc: str, out: str, tolerance: float) -> bool:
    """Same words; numbers equal, or within ``tolerance`` (relative)."""
    a, b = doc.split(), out.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        nx, ny = _number(x), _number(y)
        if nx is None or ny is None or x.endswith("%") != y.endswith("%"):
            return False
        if abs(nx - ny) > tolerance * max(abs(nx), abs(ny)):
            return False
    return True


def check_output(block: Block, output: str, command: str, shown: list[str]) -> None:
    """Every line ``shown`` appears in ``output``, in order."""
    lines = [line for line in output.splitlines() if line.strip()]
    at = 0
    for doc in (line for line in shown if line.strip()):
        while at < len(lines) and not line_matches(doc, lines[at], block.tolerance):
            at += 1
        assert at < len(lines), (
            f"{block.where}: the page says {doc!r}, which `{command}` does not print "
            f"(or not in this order). It printed:\n{output}"
        )
        at += 1


def _expected(comment: str) -> str | None:
    """The result a trailing comment states, or None when the comment is prose."""
    comment = comment.strip()
    if comment and comment[0] in "\"'":
        end = comment.find(comment[0], 1)
        return comment[1:end] if end > 0 else None
    if not re.match(r"(-?\d|[\[{(]|(True|False|None)\b)", comment):
        return None
    return comment if comment[0] == "(" else comment.split(" (")[0]


def _same(expected: str, actual: str) -> bool:
    squeeze = lambda s: re.sub(r"\s+", "", s)  # noqa: E731
    pattern = ".*".join(re.escape(part) for part in squeeze(expected).split("..."))
    return re.fullmatch(pattern, squeeze(actual), re.S) is not None


def run_python(block: Block, names: dict[str, Any]) -> str:
    source = block.code
    tree = ast.parse(source)
    lines = source.splitlines()
    printed = io.StringIO()
    namespace = dict(names, __name__="__docs__")
    for stmt in tree.body:
        end = stmt.end_lineno or stmt.lineno
        comment = lines[end - 1].partition("  # ")[2]
        where = f"{page_id(block.page)}:{block.line + end}"
        out = io.StringIO()
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
            warnings.simplefilter("always")
            value: Any = None
            try:
                if isinstance(stmt, ast.Expr):
                    value = eval(compile(ast.Expression(stmt.value), where, "eval"), namespace)
                else:
                    exec(compile(ast.Module([stmt], []), where, "exec"), namespace)
            except Exception as e:
                if comment.startswith("raises"):
                    continue
                raise AssertionError(f"{where}: {type(e).__name__}: {e}") from e
        printed.write(out.getvalue())
        assert not comment.startswith("raises"), f"{where}: the page says it raises; it did not"
        ours = [w for w in caught if issubclass(w.category, KvCacheWarning)]
        if comment.startswith("warns"):
            assert ours, f"{where}: the page says it warns; it did not"
            named = [c for c in WARNINGS if c.__name__ in comment.split()[1:2]]  # "# warns ClassName ..."
            said = [w.category.__name__ for w in ours]
            assert not named or named[0].__name__ in said, (
                f"{where}: the page says {named[0].__name__}: {said}"
            )
        else:
            assert not ours, f"{where}: warns, and the page does not say so: {ours[0].message}"
        expected = _expected(comment)
        if expected is not None:
            call = stmt.value if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) else None
            if call is not None and getattr(call.func, "id", "") == "print":
                actual = out.getvalue().strip()
            else:
                actual = value if isinstance(value, str) else repr(value)
            assert _same(expected, actual), f"{where}: the page says {expected!r}, got {actual!r}"
    return printed.getvalue()


def _exporting_quantized(folder: pathlib.Path) -> None:
    """exporting.md: the fused export's caches are stored as the page says."""
    dtypes = {
        name: {v.dtype for v in ir.load(folder / name).graph.inputs if v.name.startswith("past")}
        for name in ("model.fp8.onnx", "model.int8.onnx", "model.int8-cli.onnx")
    }
    assert dtypes == {
        "model.fp8.onnx": {ir.DataType.FLOAT8E4M3FN},
        "model.int8.onnx": {ir.DataType.INT8},
        "model.int8-cli.onnx": {ir.DataType.INT8},
    }


#: What a page's result must be, beyond running: checks run after the page.
AFTER_PAGE = {"docs/exporting.md": _exporting_quantized}


def run_page(page: pathlib.Path) -> None:
    """Run ``page`` in the current folder."""
    history: list[tuple[str, str]] = []  # (command, output) of the page so far
    for block in blocks(page):
        if block.not_run is not None:
            continue
        names = run_setup(block)
        if block.lang == "python":
            history.append((f"python block at line {block.line}", run_python(block, names)))
        elif block.lang in SHELLS:
            ran = []
            for command in shell_commands(block):
                if skipped_by(block, command):
                    continue
                code, out, err = run_command(shlex.split(command))
                assert code == 0, f"{block.where}: `{command}` exited {code}:\n{out}{err}"
                ran.append((command, out))
                _OUTPUT_CACHE.setdefault(command, out)
            history += ran
            if block.lang == "console":  # the lines after a `$ ` command are what it prints
                shown = [line for line in block.code.splitlines() if not line.startswith("$ ")]
                check_output(block, "".join(out for _, out in ran), "the commands", shown)
        elif block.lang == "json":
            json.loads(block.text)
        elif block.output_of == "the commands above":
            check_output(block, "".join(out for _, out in history), block.output_of, block.text.splitlines())
        elif block.output_of:
            command = block.output_of
            if command not in _OUTPUT_CACHE:
                code, out, err = run_command(shlex.split(command))
                assert code == 0, f"{block.where}: `{command}` exited {code}:\n{out}{err}"
                _OUTPUT_CACHE[command] = out
            check_output(block, _OUTPUT_CACHE[command], command, block.text.splitlines())


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / ".tmp"))  # the pages' mkdtemp(), cleaned up
    run_page(page)
    if page_id(page) in AFTER_PAGE:
        AFTER_PAGE[page_id(page)](tmp_path)


CONVENTION = """
<!-- docs-test: setup: save_genai_folder("g", num_layers=1); ids = [1, 2] -->
```python
import pathlib

print(sorted(p.name for p in pathlib.Path("g").iterdir())[:2])  # ['genai_config.json', 'model.onnx']
ids  # [1, 2]
int("x")  # raises
```

<!-- docs-test:
substitute "--seq-len 512" -> "--seq-len 64"
not run "pip install": installed already
-->
```console
$ pip install onnx-kvcache
$ onnx-kvcache calibrate g --out s.json --format int8 --seq-len 512 --num-seqs 2 --min-tokens 64
wrote s.json (1 layers, int8 per_tensor, method minmax)
```

<!-- docs-test:
output of: the commands above
figures within: 50%
-->
```text
layer   k thresh     k scale    k clip   v thresh     v scale    v clip
```
"""


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("", ""), None),
        (("ids  # [1, 2]", "ids  # [1, 3]"), "the page says '[1, 3]', got '[1, 2]'"),
        (('int("x")  # raises', 'int("7")  # raises'), "says it raises; it did not"),
        (("--num-seqs 2", "--num-seqs 0"), "exited 2"),
        (("\nwrote s.json (1 layers", "\nwrote s.json (2 layers"), "does not print"),  # console output
        (("v scale    v clip", "v scale    v clipped"), "does not print"),  # an output block
        (("50%", "x"), "could not convert"),
    ],
)
def test_the_convention(tmp_path, monkeypatch, change, message):
    """The harness itself: a page that uses every directive runs; each mistake in it is caught."""
    monkeypatch.chdir(tmp_path)
    page = tmp_path / "page.md"
    old, new = change
    page.write_text(CONVENTION.replace(old, new, 1) if old else CONVENTION)
    if message is None:
        run_page(page)
        assert (tmp_path / "s.json").is_file()
    else:
        with pytest.raises((AssertionError, ValueError), match=re.escape(message)):
            run_page(page)


# --- what every block declares -------------------------------------------------------------


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda b: b.where)
def test_every_block_runs_or_says_why_not(block):
    if block.not_run is not None:
        return
    if block.lang in OUTPUTS:
        assert block.output_of, f"{block.where}: an output block names its command (output of: ...)"
    else:
        assert block.lang in ("python", "json", *SHELLS), f"{block.where}: cannot run ```{block.lang}"
    if block.lang in SHELLS:
        for command in shell_commands(block):
            if not skipped_by(block, command):
                assert shlex.split(command)[0] in ("onnx-kvcache", "cp"), f"{block.where}: {command}"


def test_what_is_not_run():
    found = {}
    for block in ALL_BLOCKS:
        page = page_id(block.page)
        if block.not_run is not None:
            what = block.output_of or next((k[1] for k in NOT_RUN if k[0] == page and k[1] in block.text), "")
            found[(page, what)] = block.not_run
        commands = shell_commands(block) if block.lang in SHELLS else []
        for prefix, reason in block.skip_commands.items():
            assert any(c.startswith(prefix) for c in commands), f"{block.where}: no command {prefix!r}"
            found[(page, prefix)] = reason
    assert found == NOT_RUN


def test_the_index_links_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in PAGES[1:]:
        assert page.name == "index.md" or f"]({page.name})" in index, page.name


def test_directives_sit_above_a_fence():
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"^<!-- docs-test:.*?-->\n", text, re.S | re.M):  # indented: an example
            assert text[m.end() :].startswith("```"), f"{page_id(page)}: {m[0]!r} is not above a fence"


# --- commands named in the prose -------------------------------------------------------------


def _commands() -> dict[str, set[str]]:
    parser = build_parser()
    top = {s for a in parser._actions for s in a.option_strings}
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": top} | {
        name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()
    }


def _spans(page: pathlib.Path) -> list[str]:
    prose = FENCE.sub("", page.read_text())
    return [s.replace("\\|", "|") for s in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose)]


OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
#: Options of other tools that the pages name.
FOREIGN_OPTIONS = {
    "--extra_options": "onnxruntime-genai's model builder",
    "--kv-cache-scale-file": "mobius's builder",
    "--features": "mobius build",
}


def _benchmark_options() -> dict[str, set[str]]:
    return {
        f"benchmarks/{p.name}": set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", p.read_text()))
        for p in (ROOT / "benchmarks").glob("*.py")
    }


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_commands_in_the_prose_exist(page):
    commands, benchmarks = _commands(), _benchmark_options()
    every = set().union(*commands.values(), *benchmarks.values())
    for span in _spans(page):
        words = span.split()
        if words[0] == "onnx-kvcache" and len(words) > 1:
            name = "" if words[1].startswith("-") else words[1]
            if name.isupper():  # onnx-kvcache COMMAND --help
                known = every
            else:
                assert name in commands, f"{page_id(page)}: `{span}`: no command {name!r}"
                known = commands[name] | commands[""]
            for option in OPTION.findall(span):
                assert option in known, f"{page_id(page)}: `{span}`: no option {option}"
        elif re.match(r"(python )?benchmarks/\w", span):
            script = words[1] if words[0] == "python" else words[0]
            assert script in benchmarks, f"{page_id(page)}: `{span}`: no {script}"
            for option in OPTION.findall(span):
                assert option in benchmarks[script], f"{page_id(page)}: `{span}`: {script} has no {option}"
        elif span.startswith("--"):
            option = OPTION.match(span)[1]  # type: ignore[index]
            assert option in every or option in FOREIGN_OPTIONS, f"{page_id(page)}: `{span}`: no such option"


def test_the_command_table_lists_every_option():
    """docs/commands.md's table (the README's until issue 32) names every option of every command."""
    rows = {}
    for span in _spans(ROOT / "docs" / "commands.md"):
        words = span.split()
        if words[0] == "onnx-kvcache" and len(words) > 1 and not words[1].startswith("-"):
            rows.setdefault(words[1], span)  # the table comes first
    commands = _commands()
    assert set(rows) >= set(commands) - {""}
    for name, options in commands.items():
        if name:
            listed = set(OPTION.findall(rows[name]))
            missing = {o for o in options - listed if o.startswith("--")} - {"--help", "--verbose"}
            assert not missing, f"docs/commands.md's row for {name} does not list {sorted(missing)}"


def test_the_module_map_lists_every_module():
    """docs/index.md's "Where things live" names each module of the package once."""
    text = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    named = {
        m for m in re.findall(r"`((?:\w+/)*\w+\.py)`", section) if not m.startswith(("tests/", "tools/"))
    }
    package = ROOT / "src" / "onnx_kvcache"
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py")}
    modules -= {m for m in modules if m.endswith("/__init__.py")}  # a folder's line names its package
    assert named >= modules, f"not in the module map: {sorted(modules - named)}"
    assert named <= modules, f"in the module map but not in the package: {sorted(named - modules)}"
