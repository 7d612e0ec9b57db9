"""``onnx-kvcache convert``: run ``convert_model`` with the command's arguments, say what it
wrote, or, refused, why not and what would convert the model (another ``--ep`` or
``--format``, read from the graph as convert would decide).

Imports the standard library and the package's light modules at import time; the conversion
and the capability table are imported when the command runs.
"""

from __future__ import annotations

__all__ = ["run"]

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from onnx_kvcache._signals import Interrupted
from onnx_kvcache.cli._names import FORMATS as CACHE_FORMATS
from onnx_kvcache.cli._names import PROVIDERS
from onnx_kvcache.cli._output import _describe_os_error, _print, _printable
from onnx_kvcache.cli._shared import _given
from onnx_kvcache.errors import KvCacheError, NotConvertedWarning
from onnx_kvcache.model_io import format_bytes

if TYPE_CHECKING:
    from onnx_kvcache.files.conversion import ConvertResult


def run(args: argparse.Namespace, words: Callable[[object], str]) -> int:
    """``convert``: exit 0 converted, 1 refused (why, and what would convert it, on stderr)."""
    result = _converted(args)
    source = "--ep" if result.target_source == "given" else result.target_source
    if not result.converted:
        return _not_converted(args, result, source, words)
    args.done = f"the conversion completed ({result.model_file})"
    target = f" for {result.target}" if result.target else ""
    if result.target and source != "--ep":
        target += f" ({source}; --ep to choose)"
    nodes = ", ".join(f"{n} {op} node(s)" for op, n in result.ops.items()) or "no node"
    if result.fused:
        nodes += f" (fused from the export's {result.fused} attention layer(s))"
    turned = "" if result.rotation == "none" else f", rotated ({result.rotation})"
    _print(
        f"converted {nodes} to {result.format} {result.granularity}{turned}"
        f"{target}: {_printable(str(result.model_file))} ({format_bytes(result.bytes_written)} written) in "
        f"{time.perf_counter() - args.started:.2f}s"  # from the entry point's first line: imports count
    )
    _print(result.weights_summary())
    if args.scales:
        method = f"method {result.method}" if result.method else "no method recorded"
        _print(f"scales: {args.scales} ({method})")
    for note in result.notes:
        _print(words(note))
    return 0


def _converted(args: argparse.Namespace) -> ConvertResult:
    """``convert_model`` with the command's arguments; a failed read or write says what it left."""
    what = "nothing was written" + ("" if args.in_place else f" and {args.input} is unchanged")
    try:
        from onnx_kvcache.files.conversion import convert_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotConvertedWarning)  # said below, with the fixes
            result = convert_model(
                args.input,
                args.output,
                ep=args.ep or "auto",
                progress=None if args.progress else False,
                **_given(
                    args,
                    "format",
                    "granularity",
                    "scales",
                    "shared_kv_scale",
                    "weights",
                    "in_place",
                    "overwrite",
                    "check_device",
                    "follow_symlinks",
                    "allow_partial",
                    "rotation",
                    "verify",
                    "storage",
                ),
            )
    except KvCacheError:  # also a FileNotFoundError for a missing input: its message says it
        raise
    except OSError as e:
        raise KvCacheError(f"{_describe_os_error(e)}; {what}.") from None
    except Interrupted as e:
        e.detail = f"the output is complete: {args.output or args.input}" if e.completed else what
        raise
    return result


def _not_converted(
    args: argparse.Namespace, result: ConvertResult, source: str, words: Callable[[object], str]
) -> int:
    """Why not, on stderr, with what would convert it: exit 1."""
    line = " ".join(map(words, result.reasons))
    if result.target is None:
        _print(f"onnx-kvcache: not converted: {line}", file=sys.stderr)
        return 1
    chosen = source if source == "--ep" else f"{source}; --ep to choose"
    fixes = "" if args.storage == "qdq" else _convert_fixes(args.input, result)  # its rows: the reasons
    _print(f"onnx-kvcache: not converted for {result.target} ({chosen}): {line}{fixes}", file=sys.stderr)
    return 1


def _convert_fixes(model_path: str, result: ConvertResult) -> str:
    """What would convert ``model_path``: the providers that run the format, the formats the
    target runs (read from the graph; none when neither helps)."""
    from onnx_kvcache.capabilities.refusals import RefusalCode
    from onnx_kvcache.capabilities.table import check_kv_cache_support
    from onnx_kvcache.model_io.reading import load_model
    from onnx_kvcache.pipeline.decision import adaptation_for, fuse_unless_attention

    if any(r.code in (RefusalCode.NO_CUDA_DEVICE, RefusalCode.PARTIAL_CONVERSION) for r in result.refusals):
        return ""  # no other provider or format helps
    model = fuse_unless_attention(load_model(model_path)).model  # an export: judge what it fuses to

    def runs(ep: str, fmt: str) -> bool:  # as convert would decide: with an adaptation's pass
        refusals = check_kv_cache_support(model, ep, fmt, result.granularity).refusals
        row = adaptation_for(model, ep, refusals)
        return not [r for r in refusals if row is None or r.code != row.cures]

    fixes = []
    providers = [ep for ep in PROVIDERS if ep != result.target and runs(ep, result.format)]
    if providers:
        fixes.append(f"--ep {' or '.join(providers)} runs {result.format}, if the model will run there")
    formats = [f for f in CACHE_FORMATS if f != result.format and runs(result.target or "", f)]
    if formats:
        fixes.append(f"{result.target} runs --format {' or '.join(formats)}")
    if not fixes:  # neither another provider nor another format alone: both
        for ep in (ep for ep in PROVIDERS if ep != result.target):
            others = [f for f in CACHE_FORMATS if runs(ep, f)]
            if others:
                fixes.append(f"--ep {ep} --format {' or '.join(others)}, if the model will run there")
                break
    return f" Fix: {'; '.join(fixes)}." if fixes else ""
