"""The ``onnx-kvcache`` command: convert, inspect, calibrate, evaluate, compare, doctor, demo.

Exit codes: 0 done; 1 conversion refused (the target cannot run the result, some caches
would keep their type, or the model has nothing to convert: ``onnx-kvcache: not converted
...``); 2 bad input or a failed read/write (one line on stderr, ``onnx-kvcache: error: ...``,
no traceback); 128 + N when stopped by signal N (130 Ctrl-C, 143 SIGTERM). Outputs are
atomic, so an error or a signal leaves no partial output. Every warning is one
``onnx-kvcache: warning: ...`` line, once per kind (:mod:`onnx_kvcache.cli._voice`).

Start-up: this module imports the standard library and the package's light modules only
(tests/cli/test_commands.py keeps it so), and so do the commands' own modules it imports. It
parses the arguments, answers ``--help`` and ``--version``, refuses a bad value and checks the
input paths before a command imports onnx, onnx-ir, numpy (and ml_dtypes) or onnxruntime,
which take most of a second.

This module is the parser and the dispatcher: the parser built from the options' rows
(:mod:`onnx_kvcache.cli._options`), the library messages in the command's words, the checks
before the imports, the failures and signals. Each command runs in its own module
(``_convert``, ``_inspect``, ``_calibrate``, ``_evaluate``, ``_compare``; ``doctor`` and ``demo`` here, a few
lines each), printing through :mod:`onnx_kvcache.cli._output`.
"""

from __future__ import annotations

__all__ = ["main"]

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import signal
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from onnx_kvcache import _signals
from onnx_kvcache._signals import signal_handlers
from onnx_kvcache._version import __version__
from onnx_kvcache.cli import _calibrate, _compare, _convert, _evaluate, _inspect, _voice
from onnx_kvcache.cli._names import PROVIDERS, ep_name
from onnx_kvcache.cli._options import (
    _CALIBRATE,
    _COMPARE,
    _CONVERT,
    _DEMO,
    _DOCTOR,
    _EVALUATE,
    _INSPECT,
    _Option,
)
from onnx_kvcache.cli._output import (
    _describe_os_error,
    _flush_stdout,
    _print,
    _reserve_standard_streams,
    _say,
    _silence_stdout,
    _StdoutFailed,
)
from onnx_kvcache.errors import (
    Function,
    KvCacheError,
    KvCacheWarning,
    MissingRuntimeError,
    Param,
    Wording,
    render,
)
from onnx_kvcache.model_io import check_input_file, tokenizer_file
from onnx_kvcache.model_io.genai_folder import resolve_model_path


class _Parser(argparse.ArgumentParser):
    """argparse, with two changes. An unknown option is named at once, in its own command's
    usage: argparse first says a required argument is missing (``--bogus`` alone: "required:
    COMMAND"), or leaves it to the top-level parser, whose usage is not the command's. And its
    ``--help``/``--version`` text is flushed and a failure raised (argparse drops it:
    ``--version > /dev/full`` would exit 0 with nothing written)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        words = sys.argv[1:] if args is None else list(args)
        commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        value = False  # the word is an option's value ("--margin -inf")
        for word in words:
            if value:
                value = False
                continue
            if word == "--" or word in commands:  # the rest is positional, or the command's
                break
            if word.startswith("-") and len(word) > 1:
                if not self._known_option(word):
                    self.error(f"unrecognized arguments: {word}")
                action = self._option_string_actions.get(word)
                value = action is not None and action.nargs != 0
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        """The usage, then the refusal in the command's one voice (``onnx-kvcache: error:``), exit 2."""
        self.print_usage(sys.stderr)
        self.exit(2, _voice.line("error", f"{message} (see {self.prog} --help)") + "\n")

    def _known_option(self, word: str) -> bool:
        if self._negative_number_matcher.match(word):  # type: ignore[attr-defined]
            return True
        name = word.split("=", 1)[0]
        if name in self._option_string_actions or word[:2] in self._option_string_actions:
            return True
        return name.startswith("--") and any(o.startswith(name) for o in self._option_string_actions)

    def _print_message(self, message: str, file: Any = None) -> None:
        if not message:
            return
        stream = file or sys.stderr
        if stream is not sys.stdout:
            with contextlib.suppress(OSError, AttributeError):
                stream.write(message)
            return
        try:
            stream.write(message)
            stream.flush()
        except OSError as e:
            raise _StdoutFailed(e) from e


class _HelpFormatter(argparse.HelpFormatter):
    """Every option shows its default: appended to the help unless the help states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        flag = action.nargs == 0  # --in-place, --no-progress: off unless given
        if (
            "default" in text
            or flag
            or not action.option_strings
            or action.default in (None, argparse.SUPPRESS)
        ):
            return text
        return text + " (default: %(default)s)"


@dataclasses.dataclass(frozen=True)
class _CommandWording(Wording):
    """The command's words for a library message: a parameter as the option that sets it
    (``in_place=True``: ``--in-place``; a flag only for the value it sets, else as Python
    says it), a function as the command that does the same."""

    options: Mapping[str, argparse.Action] = dataclasses.field(default_factory=dict)
    commands: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def param(self, param: Param) -> str:
        action = self.options.get(param.name)
        if action is None:
            return super().param(param)
        flag = action.option_strings[-1]
        if isinstance(action, argparse.BooleanOptionalAction) and isinstance(param.value, bool):
            return action.option_strings[0 if param.value else -1]  # --verify / --no-verify
        if action.nargs == 0:  # store_true / store_false: only the value that sets it
            return flag if param.value is (not action.default) else super().param(param)
        if param.bare:
            return flag
        return f"{flag} {param.value if param.placeholder is None else param.placeholder}"

    def function(self, function: Function) -> str:
        command = self.commands.get(function.name)
        if command is None:
            return super().function(function)
        return " ".join([f"onnx-kvcache {command}", *map(self.param, function.args)])


@functools.cache
def _wording() -> _CommandWording:
    """Every command's options by the Python parameter they set, and the commands by the
    library function each runs (:data:`_COMMANDS`)."""
    options: dict[str, argparse.Action] = {}
    parsers = [build_parser()]
    while parsers:
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings and action.option_strings[-1].startswith("--"):
                options.setdefault(action.dest, action)
    return _CommandWording(options=options, commands={c.function: c.name for c in _COMMANDS if c.function})


def _words(said: object) -> str:
    """A library error, warning or message in the command's words."""
    return render(said, _wording())


def _doctor(args: argparse.Namespace, words: Callable[[object], str]) -> int:
    """``doctor``: the table checked against this onnxruntime; exit 1 when they disagree."""
    from onnx_kvcache.runtime.doctor import run_doctor

    report = run_doctor(args.provider)
    if args.json:
        _print(json.dumps(report.to_json(), indent=2))
    else:
        _print(report.format_table())
    for problem in report.disagreements:
        _print(
            f"onnx-kvcache: the capability table disagrees with this onnxruntime: {problem}", file=sys.stderr
        )
    if args.provider and report.absent:  # asked for by name, not checked with a session
        for absent in report.absent:
            _print(f"onnx-kvcache: no session checks on {absent}", file=sys.stderr)
        return 1
    return 1 if report.disagreements else 0


def _demo(args: argparse.Namespace, words: Callable[[object], str]) -> int:
    """``demo``: the bundled decoder converted and evaluated, one table printed."""
    from onnx_kvcache.cli._demo import run_demo

    try:
        run_demo(args.keep, lambda line: _print(words(line)), progress=args.progress)
    except KeyboardInterrupt as e:
        kept = args.keep and os.path.isdir(args.keep) and any(os.scandir(args.keep))
        if kept and getattr(e, "detail", None) is None:  # each model is whole; the record lists them
            e.detail = (  # type: ignore[attr-defined]
                f"the models written so far stay in {args.keep}, listed in its record (demo --keep "
                f"{args.keep} runs again there)"
            )
        raise
    if args.keep:
        args.done = f"the demo completed (models in {args.keep})"
    return 0


@dataclasses.dataclass(frozen=True)
class _Command:
    """A command: its help, what runs it, its options, and the library function that does the
    same (a library message naming that function names the command instead)."""

    name: str
    summary: str
    description: str
    run: Callable[[argparse.Namespace, Callable[[object], str]], int]
    """Runs the command: the arguments, and the words a library message is said in."""
    options: tuple[_Option, ...]
    function: str | None = None


#: The commands, in the order ``--help`` lists them.
_COMMANDS = (
    _Command(
        "convert",
        "convert a model file or genai folder to a quantized KV cache",
        "Weights are never rewritten: beside INPUT (same folder) the new graph shares its data files; "
        "in another folder they are cloned where the filesystem can, else copied. Exit codes: 0 done, "
        "1 conversion refused (see the message), 2 bad input or a failed write (nothing written).",
        _convert.run,
        _CONVERT,
        "convert_model",
    ),
    _Command(
        "inspect",
        "show the KV cache of a model",
        "Reads the graph only, never a weight.",
        _inspect.run,
        _INSPECT,
        "inspect_kv_cache",
    ),
    _Command(
        "calibrate",
        "measure KV-cache scales",
        "Runs the unquantized model on CPU over token windows and writes one scale per layer (or "
        "per channel) for K and V.",
        _calibrate.run,
        _CALIBRATE,
        "calibrate_kv_cache",
    ),
    _Command(
        "evaluate",
        "compare a converted model with its original",
        "Runs both on the same tokens on CPU (quantized caches the CPU cannot run are emulated) and "
        "reports KL divergence, top-1 and greedy agreement, and the per-layer cache error.",
        _evaluate.run,
        _EVALUATE,
        "evaluate_kv_cache",
    ),
    _Command(
        "compare",
        "show both models' continuations of a prompt side by side",
        "Each model decodes greedily from the prompt, one token a call, on CPU (the candidate under "
        "its target's kernel rule, as evaluate); prints what both generated, then each one's text "
        "from the first token that differs.",
        _compare.run,
        _COMPARE,
        "compare_continuations",
    ),
    _Command(
        "doctor",
        "check the capability table against the installed onnxruntime",
        "Reads its operator schemas and creates a session per provider row and cache; exits 1 when "
        "anything disagrees.",
        _doctor,
        _DOCTOR,
        "run_doctor",
    ),
    _Command(
        "demo",
        "convert and evaluate the bundled decoder",
        "Builds a small 4-layer decoder, calibrates, converts it to every format and granularity, "
        "evaluates each on CPU and prints one table.",
        _demo,
        _DEMO,
    ),
)

_VERBOSE = "log what each step does (INFO messages on stderr)"


def build_parser() -> argparse.ArgumentParser:
    """The command's parser: one subparser per :data:`_COMMANDS` row."""
    parser: argparse.ArgumentParser = _Parser(
        prog="onnx-kvcache",
        description="Quantize the KV cache of ONNX GroupQueryAttention and PagedAttention decoders.",
        epilog="Every command has --help, with the default of each option.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    common = _Parser(add_help=False)  # -v also after the command
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in _COMMANDS:
        p = sub.add_parser(
            command.name,
            help=command.summary,
            description=f"{command.summary[0].upper()}{command.summary[1:]}. {command.description}".strip(),
            parents=[common],
            formatter_class=_HelpFormatter,
        )
        groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
        for option in command.options:
            where = p if option.group is None else groups.get(option.group)
            if where is None:
                where = groups[option.group] = p.add_mutually_exclusive_group()  # type: ignore[index]
            where.add_argument(*option.names, **option.settings)
        p.set_defaults(func=command.run)
    return parser


#: Arguments that name a model, read before any command imports onnx-ir: each must resolve.
_MODEL_ARGUMENTS = ("input", "model", "baseline", "candidate")
#: Arguments that name another input file: ``check_input_file``'s words for each, as the
#: library's reader says them (the library checks each again as it reads it).
_FILE_ARGUMENTS: dict[str, dict[str, str]] = {
    "scales": {"what": "Scale file", "fix": "give the path of a JSON scale file"},
    "text": {"what": "Data file", "missing": "does not exist"},
    "token_ids": {"what": "Data file", "missing": "does not exist"},
}


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse a combination of arguments before anything heavy is imported."""
    command = getattr(args, "command", None)
    if command == "inspect" and args.batch is not None and args.context is None:
        raise KvCacheError("--batch sizes the cache at --context N; give --context too.")
    if command == "calibrate" and args.percentile is not None and args.method != "percentile":
        if args.method is None:  # the default depends on the format and rotation (docs/calibration.md)
            raise KvCacheError(
                "--percentile applies to --method percentile, not the default method (int4: mse or "
                "attention, else minmax); add --method percentile."
            )
        raise KvCacheError(f"--percentile applies to --method percentile, not --method {args.method}.")
    if command == "convert":
        same = args.output is not None and os.path.realpath(args.output) == os.path.realpath(args.input)
        if args.in_place and args.output is not None and not same:
            raise KvCacheError("Give either an output path or --in-place, not both.")
        if not args.in_place and args.output is None:
            raise KvCacheError("Give an output path, or --in-place to rewrite the input.")
        if not args.in_place and same:
            raise KvCacheError(f"Output {args.output} is the input; use --in-place to rewrite it.")


def check_inputs(args: argparse.Namespace) -> None:
    """Refuse a bad combination of arguments, a missing input or one that is no regular file
    (a folder, FIFO, device, dangling link, link loop) before the command imports onnx-ir,
    numpy or onnxruntime (the library checks each again as it reads it)."""
    _check_arguments(args)
    for name in _MODEL_ARGUMENTS:
        if getattr(args, name, None) is not None:
            resolve_model_path(getattr(args, name))
    for name, words in _FILE_ARGUMENTS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        check_input_file(pathlib.Path(value), **words)  # type: ignore[arg-type]
    if getattr(args, "tokenizer", None) is not None:
        tokenizer_file(args.tokenizer)  # a tokenizer.json or its folder (no hub id is downloaded)
    if getattr(args, "command", None) == "doctor":
        for provider in args.provider or ():
            _check_provider(provider)


def _check_provider(name: str) -> None:
    """A ``doctor --provider`` value that is neither a table row nor an onnxruntime provider
    name (they all end in ExecutionProvider), refused before onnxruntime is imported."""
    if ep_name(name) in PROVIDERS or name.endswith("ExecutionProvider"):
        return
    rows = ", ".join(sorted(n for n, provider in PROVIDERS.items() if provider))
    raise KvCacheError(
        f"Unknown execution provider {name!r}: give a row name ({rows}) or an onnxruntime provider "
        "name (CPUExecutionProvider, CUDAExecutionProvider, ...)."
    )


def _error(message: object) -> None:
    _say(_voice.line("error", _words(message)))


_FILE_OPTIONS = ("output", "out", "json", "plot", "keep")
"""Options naming a file or folder a command writes (``doctor --json`` is a flag: stdout)."""


def _writes_files(args: argparse.Namespace | None) -> bool:
    return any(isinstance(getattr(args, name, None), str) for name in _FILE_OPTIONS)


def _stdout_failed(args: argparse.Namespace | None, error: OSError) -> int:
    """Printing failed. A closed pipe (``| head``) is the reader's choice: exit 0, with one
    warning naming what was written when the command wrote files. Any other failure (a
    full disk) lost output: exit 0 with a warning when the command's files were complete
    by then, else 2 (the command's only output was lost, or its files were not written)."""
    _silence_stdout()
    done = getattr(args, "done", None)
    broken = isinstance(error, BrokenPipeError)
    why = (
        "the output pipe was closed early (broken pipe)"
        if broken
        else f"could not write to standard output ({_describe_os_error(error)})"
    )
    if done:
        _say(f"onnx-kvcache: warning: {why}; {done}.")
        return 0
    if broken and not _writes_files(args):
        return 0
    _error(f"{why}.")
    return 2


@dataclasses.dataclass
class _Run:
    """What the handlers of a failure need: the arguments once parsed, and whether the
    command itself started (until then nothing was written)."""

    args: argparse.Namespace | None = None
    started: bool = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code. SIGINT, SIGTERM and SIGHUP are handled from the first
    line to the last (one line, exit 128 + N): see :mod:`onnx_kvcache.cli._entry` for the rest."""
    run = _Run()
    _reserve_standard_streams()
    with warnings.catch_warnings(), signal_handlers():
        code = _handled(run, argv)
        _signals.outcome = getattr(run.args, "done", None) or (
            "the command had finished" if code == 0 else "nothing was written"
        )
        return code


def _handled(run: _Run, argv: Sequence[str] | None) -> int:
    """:func:`_run`'s exit code; a failure is one line on stderr and its code."""
    try:
        return _run(run, argv)
    except (KvCacheError, MissingRuntimeError) as e:
        _error(e)
        return 2
    except KeyboardInterrupt as e:  # Interrupted for SIGTERM and SIGHUP
        return _stopped(run, e)
    except _StdoutFailed as e:
        return _stdout_failed(run.args, e.error)
    except OSError as e:
        if getattr(run.args, "done", None) or isinstance(e, BrokenPipeError):
            return _stdout_failed(run.args, e)
        _error(_describe_os_error(e) + ".")
        return 2
    except UnicodeDecodeError as e:
        _error(f"a file is not UTF-8 text ({e}).")
        return 2


def _run(run: _Run, argv: Sequence[str] | None) -> int:
    """Parse, check the inputs, import onnx-ir with signals held, run the command."""
    run.args = args = build_parser().parse_args(argv)
    args.started = _signals.STARTED or time.perf_counter()  # the entry point's, once
    _signals.STARTED = None
    warnings.simplefilter("always", KvCacheWarning)  # the voice says each kind once
    with _voice.Voice(_say, _words, verbose=getattr(args, "verbose", False)).speaking():
        check_inputs(args)
        with _signals.held():  # onnx-ir, onnx, numpy, ml_dtypes: a signal waits for their C code
            import onnx_ir  # noqa: F401
        run.started = True
        code: int = args.func(args, _words)
        _flush_stdout()
    return code


def _stopped(run: _Run, e: KeyboardInterrupt) -> int:
    """Stopped by a signal: one line saying what was left, exit 128 + N."""
    signum = getattr(e, "signum", signal.SIGINT)
    detail = getattr(e, "detail", None) or getattr(run.args, "done", None)
    if detail is None:
        detail = "no partial output was left" if run.started else "nothing was written"
    _say(f"onnx-kvcache: stopped by {signal.Signals(signum).name}; {detail}.")
    return 128 + signum


if __name__ == "__main__":
    raise SystemExit(main())
