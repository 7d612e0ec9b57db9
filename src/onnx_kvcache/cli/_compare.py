"""``onnx-kvcache compare``: both models' greedy continuations of a prompt, side by side, the
first divergence marked (:func:`~onnx_kvcache.runtime.continuations.compare_continuations`).

Imports the standard library at import time; the runner is imported when the command runs.
"""

from __future__ import annotations

__all__ = ["run"]

import argparse
from collections.abc import Callable

from onnx_kvcache.cli._output import _print
from onnx_kvcache.cli._shared import _given


def run(args: argparse.Namespace, words: Callable[[object], str]) -> int:
    """``compare``: the continuations printed (``words``: unused)."""
    from onnx_kvcache.runtime.continuations import compare_continuations

    shown = compare_continuations(
        args.baseline,
        args.candidate,
        args.prompt,
        **_given(args, "tokenizer", "max_new_tokens", "semantics"),
    )
    _print(shown.format_side_by_side())
    return 0
