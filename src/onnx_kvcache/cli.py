"""The ``onnx-kvcache`` command: convert, inspect, calibrate, evaluate, doctor, demo.

Bad input prints one line to stderr and exits 2; no traceback.
"""

from __future__ import annotations

__all__ = ["main"]

import argparse
import json
import logging
import pathlib
import sys
import time
import warnings
from collections.abc import Sequence

from onnx_kvcache import __version__
from onnx_kvcache.errors import KvCacheError, KvCacheWarning, MissingRuntimeError
from onnx_kvcache.formats import CACHE_FORMATS, GRANULARITIES
from onnx_kvcache.model_files import atomic_write_text


def _bounded(kind: type, low: float, *, inclusive: bool = True, high: float | None = None):  # type: ignore[no-untyped-def]
    """An argparse type: a ``kind`` number >= ``low`` (> when not inclusive), <= ``high``."""

    def parse(text: str):  # type: ignore[no-untyped-def]
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if (
            value != value
            or (value < low if inclusive else value <= low)
            or (high is not None and value > high)
        ):
            bound = (f">= {low}" if inclusive else f"> {low}") + (
                f" and <= {high}" if high is not None else ""
            )
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


_POSITIVE = _bounded(int, 1)
_NON_NEGATIVE = _bounded(int, 0)


def _add_format_args(p: argparse.ArgumentParser, granularity: str | None = "per_tensor") -> None:
    p.add_argument("--format", default="fp8", choices=list(CACHE_FORMATS), help="cache format")
    p.add_argument(
        "--granularity",
        default=granularity,
        choices=list(GRANULARITIES),
        help="scale granularity"
        + (" (default: the scale file's, else per_tensor)" if granularity is None else ""),
    )


def _add_data_args(p: argparse.ArgumentParser, whose: str) -> None:
    data = p.add_mutually_exclusive_group()
    data.add_argument("--text", help=f"text file (tokenized with {whose} or --tokenizer's tokenizer)")
    data.add_argument("--token-ids", help="token ids: JSON list(s) or .npy")
    p.add_argument("--tokenizer", help="tokenizer.json or its folder")


def _convert(args: argparse.Namespace) -> int:
    from onnx_kvcache.model_files import convert_model

    start = time.perf_counter()
    result = convert_model(
        args.input,
        args.output,
        format=args.format,
        granularity=args.granularity,
        scales=args.scales,
        shared_kv_scale=args.shared_kv_scale,
        weights=args.weights,
        in_place=args.in_place,
        overwrite=args.overwrite,
        ep=args.ep,
        strict=args.strict,
        check_device=args.check_device,
    )
    if not result.converted:
        print("onnx-kvcache: not converted: " + " ".join(result.reasons), file=sys.stderr)
        return 1
    links = f", {len(result.linked)} data file(s) linked" if result.linked else ""
    copies = f", {len(result.copied)} copied" if result.copied else ""
    nodes = ", ".join(f"{n} {op} node(s)" for op, n in result.ops.items()) or "no node"
    print(
        f"converted {nodes} to {args.format} "
        f"{result.granularity}: {result.model_file} ({result.bytes_written} bytes written"
        f"{links}{copies}) in {time.perf_counter() - start:.2f}s"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from onnx_kvcache.cache_layout import format_cache_table, inspect_kv_cache
    from onnx_kvcache.capabilities import fast_path_diagnostics
    from onnx_kvcache.model_files import load_model, resolve_model_path

    model = load_model(args.model)
    info = inspect_kv_cache(model)
    share = None
    _, config = resolve_model_path(args.model)
    if config is not None:
        share = config.get("search", {}).get("past_present_share_buffer")
    diagnostics = fast_path_diagnostics(model, share_buffer=share) if args.ep == "cuda" else None
    if args.json:
        doc = info.to_json(args.context, args.batch)
        if diagnostics is not None:
            doc["fast_path"] = [
                {"node": d.node, "layer_id": d.layer_id, "eligible": d.eligible, "reasons": list(d.reasons)}
                for d in diagnostics
            ]
        print(json.dumps(doc, indent=2))
        return 0
    if not info.layers:
        print("no GroupQueryAttention or PagedAttention node with a KV cache")
        return 0
    print(format_cache_table(info, args.context, args.batch))
    if diagnostics is not None:
        print("CUDA quantized decode fast path (XQA):")
        for d in diagnostics:
            verdict = "eligible" if d.eligible else "not eligible: " + "; ".join(d.reasons)
            print(f"  layer {d.layer_id}: {verdict}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from onnx_kvcache.calibration import calibrate_kv_cache, format_calibration_summary

    data = args.token_ids or args.text
    scales = calibrate_kv_cache(
        args.model,
        data,
        format=args.format,
        granularity=args.granularity,
        method=args.method,
        percentile=args.percentile,
        rope_envelope=not args.no_rope_envelope,
        margin=args.margin,
        seq_len=args.seq_len,
        num_seqs=args.num_seqs,
        tokenizer=args.tokenizer,
        min_tokens=args.min_tokens,
    )
    scales.save(args.out)
    print(format_calibration_summary(scales.stats))
    print(
        f"wrote {args.out} ({len(scales.layer_ids)} layers, {args.format} {args.granularity}, {args.method})"
    )
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from onnx_kvcache.evaluation import evaluate_kv_cache

    report = evaluate_kv_cache(
        args.baseline,
        args.candidate,
        args.token_ids or args.text,
        max_new_tokens=args.max_new_tokens,
        tokenizer=args.tokenizer,
        num_seqs=args.num_seqs,
        seq_len=args.seq_len,
        semantics=args.semantics,
    )
    print(report.format_table())
    if args.json:
        atomic_write_text(pathlib.Path(args.json), json.dumps(report.to_json(), indent=2) + "\n")
    if args.plot:
        from onnx_kvcache.plots import plot_evaluation

        plot_evaluation(report, args.plot)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from onnx_kvcache.doctor import run_doctor

    report = run_doctor(args.provider)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.format_table())
    for problem in report.disagreements:
        print(
            f"onnx-kvcache: the capability table disagrees with this onnxruntime: {problem}", file=sys.stderr
        )
    return 1 if report.disagreements else 0


def _demo(args: argparse.Namespace) -> int:
    from onnx_kvcache.demo import run_demo

    run_demo(keep=args.keep)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnx-kvcache",
        description="Quantize the KV cache of ONNX GroupQueryAttention and PagedAttention decoders.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert a model file or genai folder")
    p.add_argument("input")
    p.add_argument("output", nargs="?")
    _add_format_args(p, granularity=None)
    p.add_argument("--scales", help="scale file (onnxruntime-genai format)")
    p.add_argument("--shared-kv-scale", action="store_true", help="one tensor for k and v scales")
    p.add_argument("--ep", help="where the model will run (cpu, cuda, ...): gate on it")
    p.add_argument("--strict", action="store_true", help="fail when the target cannot run it")
    p.add_argument("--check-device", action="store_true", help="check this machine's GPU too")
    p.add_argument(
        "--weights",
        choices=["link", "copy"],
        default="link",
        help="external data in a new folder (default: link)",
    )
    p.add_argument("--in-place", action="store_true", help="rewrite INPUT itself (no OUTPUT)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT")
    p.set_defaults(func=_convert)

    p = sub.add_parser("inspect", help="show the KV cache of a model")
    p.add_argument("model")
    p.add_argument("--ep", help="cuda: also show fast-path (XQA) diagnostics")
    p.add_argument("--context", type=_POSITIVE, help="report cache bytes at this context length")
    p.add_argument("--batch", type=_POSITIVE, default=1, help="batch size for --context (default 1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("calibrate", help="measure KV-cache scales")
    p.add_argument("model")
    p.add_argument("--out", required=True, help="scale file to write (onnxruntime-genai format)")
    _add_format_args(p)
    p.add_argument("--method", default="minmax", choices=["minmax", "percentile", "mse"])
    p.add_argument(
        "--percentile",
        type=_bounded(float, 0, inclusive=False, high=100),
        default=99.99,
        help="for --method percentile (default 99.99)",
    )
    _add_data_args(p, "the model's")
    p.add_argument("--seq-len", type=_POSITIVE, default=512, help="window length (default 512)")
    p.add_argument("--num-seqs", type=_POSITIVE, help="use at most this many windows (default: all)")
    p.add_argument(
        "--min-tokens",
        type=_NON_NEGATIVE,
        default=256,
        help="refuse to calibrate on fewer tokens (default 256)",
    )
    p.add_argument(
        "--margin",
        type=_bounded(float, 0, inclusive=False),
        default=1.0,
        help="multiply thresholds (headroom, default 1.0)",
    )
    p.add_argument("--no-rope-envelope", action="store_true", help="raw K thresholds, no RoPE pair norm")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("evaluate", help="compare a converted model with its original")
    p.add_argument("baseline")
    p.add_argument("candidate")
    _add_data_args(p, "the baseline's")
    p.add_argument(
        "--max-new-tokens", type=_NON_NEGATIVE, default=64, help="greedy tokens to compare (default 64)"
    )
    p.add_argument("--num-seqs", type=_POSITIVE, default=4, help="sequences to evaluate (default 4)")
    p.add_argument("--seq-len", type=_POSITIVE, default=256, help="tokens per sequence (default 256)")
    p.add_argument(
        "--semantics",
        choices=["cuda", "cpu"],
        help="kernel rule the candidate's quantized cache follows on this CPU: cuda (first prompt "
        "attended unquantized) or cpu (default: the candidate's target provider)",
    )
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--plot", help="write a PNG (per-layer error, KL per position); needs matplotlib")
    p.set_defaults(func=_evaluate)

    p = sub.add_parser(
        "doctor", help="check the capability table against the installed onnxruntime (exit 1 on disagreement)"
    )
    p.add_argument(
        "--provider",
        action="append",
        help="onnxruntime provider to create sessions on (repeatable; default: every one listed)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_doctor)

    p = sub.add_parser("demo", help="convert and evaluate the bundled decoder")
    p.add_argument("--keep", help="keep the demo models in this folder")
    p.set_defaults(func=_demo)
    return parser


def _show_warning(message, category, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    print(f"onnx-kvcache: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("always", KvCacheWarning)
        warnings.showwarning = _show_warning
        try:
            return args.func(args)
        except (KvCacheError, FileNotFoundError, MissingRuntimeError, NotADirectoryError) as e:
            print(f"onnx-kvcache: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("onnx-kvcache: interrupted; nothing was written.", file=sys.stderr)
            return 130


if __name__ == "__main__":
    raise SystemExit(main())
