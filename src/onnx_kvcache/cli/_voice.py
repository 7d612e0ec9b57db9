"""The command's one voice on standard error: every line it says is ``onnx-kvcache: KIND: ...``.

=====================================  ===========  ==============================================
line                                   exit code    when
=====================================  ===========  ==============================================
``onnx-kvcache: error: MESSAGE``       2            bad input, or a read or write failed (nothing
                                                    was written); argparse's refusals too, after
                                                    the command's usage
``onnx-kvcache: not converted ...``    1            ``convert`` refused: the target cannot run the
                                                    cache, or the model has nothing to convert (a
                                                    refusal, not an error: the input is fine and
                                                    the line says what would convert it)
``onnx-kvcache: warning: MESSAGE``     (unchanged)  something the user should know; the command
                                                    goes on
``onnx-kvcache: stopped by SIGNAL; ``  128 + N      a signal; what was left
=====================================  ===========  ==============================================

Warnings come from three sources, all said here in one form: the library's warnings (a
:class:`~onnx_kvcache.errors.KvCacheWarning` each, or any other ``warnings.warn``), the
library's own logging at WARNING (``onnx_kvcache.*`` loggers), and the logging of the
libraries it runs (onnx-ir, onnxscript), which is shown only under ``-v``, with the INFO
messages, as ``LEVEL LOGGER: MESSAGE``.

Each kind of warning is said once per run: a warning of the same class (or logger) and the
same words but for its numbers (the same warning for another layer) is counted, and one line
at the end of the run says how many more there were; ``-v`` shows each.

Standard library only: the command imports this before onnx-ir.
"""

from __future__ import annotations

__all__ = ["PREFIX", "Voice", "line"]

import contextlib
import dataclasses
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

PREFIX = "onnx-kvcache"

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*(?:e[-+]?\d+)?%?")


def line(kind: str, text: str) -> str:
    """``onnx-kvcache: KIND: TEXT``: the form of every line the command says on stderr."""
    return f"{PREFIX}: {kind}: {text}"


@dataclasses.dataclass
class Voice:
    """One run's warnings: ``say`` writes one line to stderr, ``render`` puts a library
    message in the command's words; ``verbose`` (``-v``) says every warning and shows the
    other libraries' logging."""

    say: Callable[[str], None]
    render: Callable[[object], str] = str
    verbose: bool = False
    repeats: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    """Times each kind was said beyond the first, by (class or logger, words without numbers)."""
    first: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)

    def warning(self, message: object, kind: str) -> None:
        """Say ``message`` as a warning, unless one of its kind was said already this run."""
        text = self.render(message)
        key = (kind, _NUMBER.sub("#", text))
        if key in self.first and not self.verbose:
            self.repeats[key] = self.repeats.get(key, 0) + 1
            return
        self.first.setdefault(key, kind)
        self.say(line("warning", text))

    def show_warning(self, message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        """``warnings.showwarning``: a warning in the command's voice."""
        self.warning(message, category.__name__)

    def close(self) -> None:
        """One line per kind said more than once (``-v`` said each)."""
        for (kind, _), more in self.repeats.items():
            text = f"{more} more {kind} like the one above, for other values (-v shows each)"
            self.say(line("warning", text))
        self.repeats.clear()

    @contextlib.contextmanager
    def speaking(self) -> Iterator[None]:
        """For the run: warnings and logging in this voice; the summary of repeats at its end."""
        handler = _Handler(self)
        root = logging.getLogger()
        level = root.level
        root.addHandler(handler)
        root.setLevel(logging.INFO if self.verbose else logging.WARNING)
        shown = warnings.showwarning
        warnings.showwarning = self.show_warning
        try:
            yield
        finally:
            warnings.showwarning = shown
            root.removeHandler(handler)
            root.setLevel(level)
            with contextlib.suppress(OSError, ValueError):
                self.close()


class _Handler(logging.Handler):
    """Logging in the command's voice: the library's warnings as warnings; everything else
    (other libraries' warnings, INFO messages) only under ``-v``."""

    def __init__(self, voice: Voice) -> None:
        super().__init__(logging.DEBUG)
        self.voice = voice

    def emit(self, record: logging.LogRecord) -> None:
        try:
            ours = record.name == "onnx_kvcache" or record.name.startswith("onnx_kvcache.")
            if ours and record.levelno >= logging.WARNING:
                self.voice.warning(record.getMessage(), record.name)
            elif self.voice.verbose:
                self.voice.say(f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:  # a handler never raises into the code that logged
            self.handleError(record)
