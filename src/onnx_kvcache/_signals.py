"""Signals: SIGINT, SIGTERM and SIGHUP become :class:`Interrupted`, so cleanup runs as for Ctrl-C.

Standard library only: the command installs these handlers before it imports anything
heavy (see :mod:`onnx_kvcache._entry`). The rules:

* Inside :func:`signal_handlers`, the three signals raise :class:`Interrupted` (a
  ``KeyboardInterrupt``) where the program was, so ``finally`` blocks and temporary
  entries are cleaned up as for Ctrl-C.
* :func:`uninterrupted` holds them over a commit: a held signal is raised when the
  outermost block ends (normally or not). A block opened with ``completes=True`` marks
  the output complete once it ends normally; every later :class:`Interrupted` says so.
* :data:`outcome` is what the files are like if the process stops now; the command sets
  it, and the entry point reports it for a signal that arrives after the command returned.
"""

from __future__ import annotations

__all__ = ["Interrupted", "outcome", "signal_handlers", "uninterrupted"]

import contextlib
import signal
import threading
from collections.abc import Iterator
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
    _completed = False
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _pending.clear()


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
