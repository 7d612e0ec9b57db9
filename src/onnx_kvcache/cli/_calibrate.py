"""``onnx-kvcache calibrate``: measure the scales, write the scale file (never over an input,
nor over a file another run wrote meanwhile), and say what was measured and written.

Imports the standard library and the package's light modules at import time; calibration
(onnxruntime, numpy) is imported when the command runs.
"""

from __future__ import annotations

__all__ = ["run"]

import argparse
import pathlib
from collections.abc import Callable
from typing import Any

from onnx_kvcache.cli._output import _print
from onnx_kvcache.cli._shared import _given, _model_inputs, _write_completely, _wrote
from onnx_kvcache.model_io import check_output, stamp_json


def run(args: argparse.Namespace, words: Callable[[object], str]) -> int:
    """``calibrate``: the scale file written, its summary printed (``words``: unused)."""
    from onnx_kvcache.calibrate.calibration import calibrate_kv_cache, format_calibration_summary

    data = args.token_ids or args.text
    inputs = _model_inputs(args.model, args.text, args.token_ids, args.tokenizer)
    seen = check_output(args.out, "scales", overwrite=args.overwrite, inputs=inputs)
    scales = calibrate_kv_cache(
        args.model,
        data,
        percentile=99.99 if args.percentile is None else args.percentile,
        **_given(
            args,
            "format",
            "granularity",
            "method",
            "rope_envelope",
            "rope_positions",
            "rotation",
            "margin",
            "seq_len",
            "num_seqs",
            "tokenizer",
            "min_tokens",
            "progress",
        ),
    )
    method = scales.metadata["method"]
    replaced = _write_completely(
        args,
        [(args.out, stamp_json(scales.to_json(), "scales"), "scales")],
        f"the scale file was written ({args.out})",
        inputs,
        [seen],  # another calibrate to this --out that finished first is never replaced silently
    )
    _print(format_calibration_summary(scales.stats, scales.format, method))
    _print(_calibrated(args.out, replaced, scales))
    return 0


def _calibrated(out: str, replaced: list[pathlib.Path], scales: Any) -> str:
    """The last line of ``calibrate``: what was written, its layers, format and method."""
    chosen = scales.metadata.get("format_for")
    target = f" for {chosen}; --format to choose" if chosen else ""
    rotation = scales.metadata.get("rotation", "none")
    turned = "" if rotation == "none" else f", rotation {rotation}"
    return (
        f"{_wrote(out, replaced)} ({len(scales.layer_ids)} layers, {scales.format} {scales.granularity}, "
        f"method {scales.metadata['method']}{turned}){target}"
    )
