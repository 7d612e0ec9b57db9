"""The ``onnx-kvcache`` executable (and ``python -m onnx_kvcache``): signals from start to exit.

The handlers of :mod:`onnx_kvcache._signals` are installed before the command is imported
(its module is light: it parses the arguments before it imports onnx-ir, onnx and numpy,
which take most of a second); C extension modules initialize with the signals held
(:func:`~onnx_kvcache._signals.extension_imports_held`), so a Ctrl-C or SIGTERM while they
load is one line too, once they have loaded. Once the command has returned, a signal can change nothing on
disk: it prints one line saying what the command left and exits 128 + N at once. The
process then flushes its output, runs its exit functions and leaves with ``os._exit``,
skipping the interpreter's teardown (~0.15 s of freeing modules), during which Python
has already restored the default handlers: a signal there would kill the process
without a word although its output is complete.

Signal handling starts here, never on importing the package: this module's first lines
record a signal (``_signal``, built in, so before anything is imported); :func:`main` then
reports it as one line. The console script (``from onnx_kvcache.cli._entry import main``)
runs ``onnx_kvcache/__init__.py`` and ``onnx_kvcache/cli/__init__.py`` first; both import
nothing (the package's names load on first use), so the record starts microseconds after
the script's import line. Only what runs before it is not covered: the interpreter's own
start, ``site``, the script's ``import re, sys`` and the import system finding these three
files (about 25 ms on an idle machine, several times that under load; ``python -m
onnx_kvcache`` adds runpy): a signal then stops the process as any Python program (Ctrl-C
prints a ``KeyboardInterrupt`` traceback, exit 130 without a word; SIGTERM, exit 143
without a word), and nothing is written by then.
"""

import _signal  # first: ``from __future__`` would import a module before the record
import time

_STARTED = time.perf_counter()
_EARLY: list[int] = []
"""Signals received before :func:`main` installed its handlers."""


def _record(signum: int, frame: object) -> None:
    _EARLY.append(signum)


for _name in ("SIGINT", "SIGTERM", "SIGHUP"):
    if hasattr(_signal, _name):
        _signal.signal(getattr(_signal, _name), _record)

import atexit  # noqa: E402  (the lines above come first: they are what makes a signal one line)
import contextlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import onnx_kvcache._signals as _signals  # noqa: E402

_signals.STARTED = _STARTED


def _stopped(error: KeyboardInterrupt) -> int:
    """One line for a signal the command did not report itself; the exit code."""
    for s in _signals.HANDLED:  # a second Ctrl-C changes nothing now
        signal.signal(s, signal.SIG_IGN)
    signum = getattr(error, "signum", signal.SIGINT)
    print(f"onnx-kvcache: stopped by {signal.Signals(signum).name}; {_signals.outcome}.", file=sys.stderr)
    return 128 + signum


def _after_the_command(signum: int, frame: Any) -> None:
    """A signal once the command has returned: say what it left, and exit now."""
    with contextlib.suppress(Exception):  # a flush this interrupted cannot be re-entered
        sys.stdout.flush()
    name = signal.Signals(signum).name
    os.write(2, f"onnx-kvcache: stopped by {name} as it exited; {_signals.outcome}.\n".encode())
    os._exit(128 + signum)


def _exit_code(done: SystemExit) -> int:
    if done.code is None or isinstance(done.code, int):
        return done.code or 0
    print(done.code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()


def main() -> int:
    """Run the command under the handlers; never returns (``os._exit`` with its code)."""
    with _signals.signal_handlers(), _signals.extension_imports_held():
        try:
            if _EARLY:  # before the handlers: as if it came now
                raise _signals.Interrupted(_EARLY[0])
            from onnx_kvcache.cli.commands import main as command

            code = command()
            for s in _signals.HANDLED:
                signal.signal(s, _after_the_command)
        except SystemExit as done:  # argparse: --help, --version, a command line it cannot parse
            code = _exit_code(done)
        except KeyboardInterrupt as error:  # while importing, or just as the command returned
            code = _stopped(error)
        for s in _signals.HANDLED:
            if signal.getsignal(s) is not signal.SIG_IGN:
                signal.signal(s, _after_the_command)
        file_io = sys.modules.get("onnx_kvcache.model_io._atomic")  # loaded only if the command wrote
        if file_io is not None:
            file_io.close_temporary_entries()
        _flush()
        atexit._run_exitfuncs()
        _flush()
        os._exit(code)
