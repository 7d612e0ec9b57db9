"""Signals: SIGINT, SIGTERM and SIGHUP become :class:`Interrupted`, so cleanup runs as for Ctrl-C.

Standard library only: the command installs these handlers before it imports anything
heavy (see :mod:`onnx_kvcache.cli._entry`). The rules:

* Inside :func:`signal_handlers`, the three signals raise :class:`Interrupted` (a
  ``KeyboardInterrupt``) where the program was, so ``finally`` blocks and temporary
  entries are cleaned up as for Ctrl-C.
* :func:`uninterrupted` holds them over a commit: a held signal is raised when the
  outermost block ends (normally or not). A block opened with ``completes=True`` marks
  the output complete once it ends normally; every later :class:`Interrupted` says so.
* An :class:`Interrupted` that Python cannot raise (the handler ran inside a weakref
  callback or ``__del__``, which swallow exceptions) is not lost: the signal is sent again.
* :data:`outcome` is what the files are like if the process stops now; the command sets
  it, and the entry point reports it for a signal that arrives after the command returned.
* Inside :func:`extension_imports_held` (the entry point's), every C extension module
  (onnx's, ml_dtypes', numpy's, onnxruntime's, ...) initializes with the three signals
  blocked (``pthread_sigmask``) and held as by :func:`uninterrupted`: a signal during its
  initialization is raised once it returns; the first one to arrive is the one raised (a
  collector thread takes them as they come: unblocked, the kernel would deliver them lowest
  number first). Raised inside it, from a Python handler that
  ran while the extension called back into Python, the exception reached C++ code that
  cannot unwind it: onnx's nanobind module then aborted (``terminate called after throwing
  an instance of 'nanobind::python_error'``, exit 134) or crashed (exit 139).
"""

from __future__ import annotations

__all__ = ["Interrupted", "extension_imports_held", "held", "outcome", "signal_handlers", "uninterrupted"]

import contextlib
import functools
import importlib.machinery
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP, raised where the program was.

    ``completed``: the output was complete when the signal arrived (it came during or
    after the commit, which finished first).
    """

    def __init__(self, signum: int, completed: bool = False) -> None:
        self.signum = signum
        self.completed = completed
        self.detail: str | None = None
        """What the CLI says about the files (set by whoever knows)."""
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


STARTED: float | None = None
"""``time.perf_counter()`` at the entry point's first line (the command's timer starts there)."""

outcome = "nothing was written"
"""What the files are like if the process stops now (the command keeps it current)."""

_defer_depth = 0
_pending: list[int] = []
_completed = False
HANDLED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def _on_signal(signum: int, frame: Any) -> None:
    if _defer_depth:
        _pending.append(signum)
        return
    raise Interrupted(signum, completed=_completed)


@contextlib.contextmanager
def signal_handlers() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` inside this block."""
    global _completed
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in HANDLED}
    unraisable = sys.unraisablehook
    sys.unraisablehook = functools.partial(_resend_unraisable, unraisable)
    _completed = False
    try:
        yield
    finally:
        sys.unraisablehook = unraisable
        for s, handler in previous.items():
            signal.signal(s, handler)
        _pending.clear()


def _resend_unraisable(previous: Callable[[Any], object], unraisable: Any) -> None:
    """An :class:`Interrupted` raised where Python ignores exceptions (a weakref callback,
    ``__del__``; it printed "Exception ignored in ..." and went on): the signal again, to be
    raised at the next line of ordinary code. A thread sends it 5 ms later: sent from here, the
    handler would run before this hook returns, and be ignored again (and if it lands in such
    code again, it comes back here)."""
    if isinstance(unraisable.exc_value, Interrupted) and hasattr(signal, "pthread_kill"):
        args = (threading.main_thread().ident, unraisable.exc_value.signum)
        again = threading.Timer(0.005, signal.pthread_kill, args)
        again.daemon = True
        again.start()
    else:
        previous(unraisable)


@contextlib.contextmanager
def uninterrupted(completes: bool = False) -> Iterator[None]:
    """Hold signals caught by :func:`signal_handlers` until the block ends.

    A held signal is raised when the outermost block ends: normally, as
    :class:`Interrupted` (``completed`` when ``completes``: the output is complete);
    by an exception, as :class:`Interrupted` raised from it (nothing was completed).
    """
    global _defer_depth, _completed
    _defer_depth += 1
    try:
        yield
    except BaseException as error:
        _defer_depth -= 1
        if not _defer_depth and _pending:
            signum = _pending[0]
            _pending.clear()
            if not isinstance(error, KeyboardInterrupt):
                raise Interrupted(signum, completed=_completed) from error
        raise
    _defer_depth -= 1
    if completes:
        _completed = True
    if not _defer_depth and _pending:
        signum = _pending[0]
        _pending.clear()
        raise Interrupted(signum, completed=_completed)


_held_depth = 0
_WAKE: int = getattr(signal, "SIGUSR2", 0)
"""Sent to the collector thread (blocked in it) to end it."""


def _collect() -> None:
    """The collector: with the signals blocked in every thread of ours, takes each signal sent
    to the process as it arrives, so they are held in the order they came (the kernel delivers
    blocked signals lowest number first once unblocked: SIGINT before an earlier SIGTERM)."""
    while (signum := signal.sigwait({*HANDLED, _WAKE})) != _WAKE:
        _pending.append(signum)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Over C code that must not be interrupted: the signals are blocked in this thread (a
    signal is not even delivered: no ``EINTR``, no Python handler inside it) and held as by
    :func:`uninterrupted` (one another thread received is not raised inside either), in the
    order they arrived (a collector thread, blocking them too, takes them as they come)."""
    global _held_depth
    with uninterrupted():
        if not _BLOCKABLE or threading.current_thread() is not threading.main_thread():
            yield
            return
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {*HANDLED, _WAKE})
        collector = None
        if not _held_depth and _WAKE:  # the thread inherits the mask
            collector = threading.Thread(target=_collect, name="onnx-kvcache signals", daemon=True)
            collector.start()
        _held_depth += 1
        try:
            yield
        finally:  # a blocked signal is delivered now, then raised as the block ends
            _held_depth -= 1
            if collector is not None and collector.ident is not None:
                signal.pthread_kill(collector.ident, _WAKE)
                collector.join()
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


_BLOCKABLE = hasattr(signal, "pthread_sigmask")


class _HeldExtensionLoader(importlib.machinery.ExtensionFileLoader):
    """An extension module's loader that initializes it :func:`held`."""

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        with held():  # single-phase initialization (PyInit_*) runs here
            return super().create_module(spec)

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        with held():  # multi-phase initialization runs here
            super().exec_module(module)


class _HeldExtensionFinder:
    """Finds what :class:`importlib.machinery.PathFinder` finds; extension modules get a
    :class:`_HeldExtensionLoader`."""

    @staticmethod
    def find_spec(name, path=None, target=None):  # type: ignore[no-untyped-def]
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and type(spec.loader) is importlib.machinery.ExtensionFileLoader:
            spec.loader = _HeldExtensionLoader(spec.loader.name, spec.loader.path)
        return spec

    @staticmethod
    def invalidate_caches() -> None:
        pass


@contextlib.contextmanager
def extension_imports_held() -> Iterator[None]:
    """Inside this block every C extension module found on ``sys.path`` initializes
    :func:`held` (a finder placed just before :class:`~importlib.machinery.PathFinder`)."""
    finder = _HeldExtensionFinder()
    path_finder = sys.meta_path.index(importlib.machinery.PathFinder)
    sys.meta_path.insert(path_finder, finder)  # type: ignore[arg-type]
    try:
        yield
    finally:
        sys.meta_path.remove(finder)  # type: ignore[arg-type]
