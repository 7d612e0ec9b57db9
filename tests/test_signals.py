"""_signals: a signal inside held C code is raised once it returns, never inside it."""

from __future__ import annotations

import importlib.machinery
import os
import signal
import sys
import threading

import pytest

from onnx_kvcache import _signals


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_held_is_blocked_then_raised_as_it_ends(signum):
    reached = []
    with _signals.signal_handlers(), pytest.raises(_signals.Interrupted) as caught, _signals.held():
        signal.pthread_kill(threading.main_thread().ident, signum)  # to this thread, which blocks it
        reached.append(signum in signal.sigpending())  # blocked: pending, not delivered
        reached.append(sum(range(10_000)))  # bytecode runs: no handler raises here
    assert reached == [True, sum(range(10_000))]
    assert caught.value.signum == signum and not caught.value.completed
    assert signum not in signal.sigpending()


def test_held_inside_uninterrupted_raises_when_the_outer_block_ends():
    steps = []
    with _signals.signal_handlers(), pytest.raises(_signals.Interrupted), _signals.uninterrupted():
        with _signals.held():
            # to this thread, which blocks it: a process-directed kill may go to a thread of
            # onnxruntime's pools (earlier tests' sessions) and come after the block ends
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        steps.append("after held")
    assert steps == ["after held"]


def test_extension_modules_load_held_inside_the_block_only():
    name = next(n for n in ("_decimal", "_bz2", "_lzma", "_sqlite3", "_curses") if n not in sys.modules)
    with _signals.extension_imports_held():
        finders = sys.meta_path.copy()
        spec = next(s for f in sys.meta_path if (s := f.find_spec(name, None)) is not None)
        source = next(s for f in sys.meta_path if (s := f.find_spec("json", None)) is not None)
    assert type(spec.loader) is _signals._HeldExtensionLoader
    assert isinstance(spec.loader, importlib.machinery.ExtensionFileLoader)  # what inspect, pkgutil see
    assert type(source.loader) is importlib.machinery.SourceFileLoader
    held = [type(f) for f in finders].index(_signals._HeldExtensionFinder)
    assert finders[held + 1] is importlib.machinery.PathFinder
    assert _signals._HeldExtensionFinder not in [type(f) for f in sys.meta_path]


def test_a_signal_python_swallows_in_a_weakref_callback_is_raised_after_it():
    """The handler ran inside importlib's module-lock callback: "Exception ignored in ...",
    and the command went on to exit 0 as if no signal had come."""
    import weakref

    class Thing:
        pass

    def callback(ref: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(10_000))  # the handler raises here, where Python ignores exceptions

    steps = []
    with _signals.signal_handlers(), pytest.raises(_signals.Interrupted) as caught:
        thing = Thing()
        ref = weakref.ref(thing, callback)
        del thing
        while len(steps) < 10**7:  # raised again here, once a thread sent it
            steps.append(0)
    assert ref() is None and caught.value.signum == signal.SIGTERM and len(steps) < 10**7


_IN_ORDER = """
import os, signal, sys, time
from onnx_kvcache import _signals
second = int(sys.argv[1])
try:
    with _signals.signal_handlers(), _signals.held():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        os.kill(os.getpid(), second)
        time.sleep(0.05)
except _signals.Interrupted as e:
    print(e.signum, sorted(signal.sigpending()))
"""


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGHUP])
def test_signals_held_are_reported_in_the_order_they_came(second):
    """SIGTERM, then SIGINT or SIGHUP 50 ms later, inside held (a process of one thread, as the
    command is while it imports): the kernel delivered them lowest number first once unblocked,
    so the later signal's code was the exit code."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", _IN_ORDER, str(int(second))], capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.split() == [str(int(signal.SIGTERM)), "[]"], proc.stderr
