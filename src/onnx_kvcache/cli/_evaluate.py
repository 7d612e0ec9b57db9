"""``onnx-kvcache evaluate``: compare a converted model with its original on the same tokens,
print the report, and write it as JSON and a plot when asked (both checked before the run,
published together after it).

Imports the standard library and the package's light modules at import time; evaluation
(onnxruntime, numpy) and plotting are imported when the command runs.
"""

from __future__ import annotations

__all__ = ["run"]

import argparse
import pathlib
from collections.abc import Callable

from onnx_kvcache.cli._output import _print
from onnx_kvcache.cli._shared import _given, _model_inputs, _write_completely, _wrote
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.model_io import check_output, same_output, stamp_json

#: The options passed to ``evaluate_kv_cache`` as its parameters of the same name.
_LIBRARY_OPTIONS = (
    *("max_new_tokens", "tokenizer", "num_seqs", "seq_len", "prompt_len", "semantics"),
    *("speed_context", "progress"),
)


def run(args: argparse.Namespace, words: Callable[[object], str]) -> int:
    """``evaluate``: the report printed, and written as asked (``words``: unused)."""
    from onnx_kvcache.runtime.evaluation import evaluate_kv_cache

    inputs = [
        *_model_inputs(args.baseline, args.text, args.token_ids, args.tokenizer),
        *_model_inputs(args.candidate),
    ]
    seen = []  # another evaluate to these outputs that finished first is never replaced silently
    if args.json:
        seen.append(check_output(args.json, "report", overwrite=args.overwrite, inputs=inputs))
    if args.plot:
        from onnx_kvcache.runtime import check_plotting

        seen.append(check_plotting(args.plot, overwrite=args.overwrite, inputs=inputs))
    if args.json and args.plot and same_output(args.json, args.plot):
        raise KvCacheError(f"--json {args.json} and --plot {args.plot} name one file; name two files.")
    report = evaluate_kv_cache(
        args.baseline,
        args.candidate,
        args.token_ids or args.text,
        **_given(args, *_LIBRARY_OPTIONS),
    )
    outputs: list[tuple[str, bytes, str]] = []
    if args.json:
        outputs.append((args.json, stamp_json(report.to_json(), "report"), "report"))
    if args.plot:
        from onnx_kvcache.runtime import render_plot

        outputs.append((args.plot, render_plot(report), "plot"))
    replaced: list[pathlib.Path] = []
    if outputs:
        names = ", ".join(path for path, _, _ in outputs)
        replaced = _write_completely(
            args, outputs, f"the evaluation completed ({names} written)", inputs, seen
        )
    _print(report.format_table())
    if outputs:
        _print("; ".join(f"{_wrote(path, replaced)} ({kind})" for path, _, kind in outputs))
    return 0
