"""The command's options: what each command takes, its help and default, and the argparse
types that refuse a bad value in the user's spelling (``--ep``'s rows, bounded numbers, a text
file against a token-ids file). Rows of ``add_argument`` settings; :mod:`onnx_kvcache.cli.commands`
builds the parser from them.

Standard library and the tables' row names only: the command parses before importing onnx-ir.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
from collections.abc import Mapping
from typing import Any

from onnx_kvcache.cli._names import FORMATS as CACHE_FORMATS
from onnx_kvcache.cli._names import GRANULARITIES as SCALE_GRANULARITIES
from onnx_kvcache.cli._names import METHODS, PROVIDERS, ROTATIONS, SEMANTICS, STORAGES, WEIGHTS, ep_name


def ep_choices() -> list[str]:
    """``--ep`` values: every provider of the capability table."""
    return list(PROVIDERS)


def _bounded(kind: type, low: float, *, inclusive: bool = True, high: float | None = None):  # type: ignore[no-untyped-def]
    """An argparse type: a ``kind`` number >= ``low`` (> when not inclusive), <= ``high``."""

    def parse(text: str):  # type: ignore[no-untyped-def]
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if (
            not math.isfinite(value)
            or (value < low if inclusive else value <= low)
            or (high is not None and value > high)
        ):
            bound = (f">= {low}" if inclusive else f"> {low}") + (
                f" and <= {high}" if high is not None else ""
            )
            finite = "" if math.isfinite(value) else "a finite number "
            raise argparse.ArgumentTypeError(f"must be {finite}{bound}, got {text}")
        return value

    return parse


def _ep(text: str) -> str:
    """An ``--ep`` value: a table row, or onnxruntime's name for one; else why not, in the
    user's spelling."""
    name = ep_name(text)
    if name in PROVIDERS:
        return name
    rows = ", ".join(ep_choices())
    if name == "openvinoexecutionprovider":
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (onnxruntime's OpenVINOExecutionProvider is not a row of the "
            f"capability table: openvino is OpenVINO's own runtime); choose from {rows}"
        )
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (not a provider of the capability table); choose from {rows}, or "
        "onnxruntime's name for one (e.g. CUDAExecutionProvider)"
    )


_POSITIVE = _bounded(int, 1)
_NON_NEGATIVE = _bounded(int, 0)
_CONTEXT = _bounded(int, 1, high=2**31 - 1)  # GroupQueryAttention counts positions in int32
_BATCH = _bounded(int, 1, high=2**20)


_IDS_SUFFIXES = (".json", ".npy")


def _text_file(value: str) -> str:
    """A text file; ``.json``/``.npy`` files are read as token ids, so they are refused here."""
    if pathlib.Path(value).suffix in _IDS_SUFFIXES:
        raise argparse.ArgumentTypeError(f"{value} would be read as token ids; give it as --token-ids")
    return value


def _ids_file(value: str) -> str:
    if pathlib.Path(value).suffix not in _IDS_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"{value}: token ids come in a .json (a list of ids, or of lists) or .npy file; "
            "give text as --text"
        )
    return value


_MODEL = "a .onnx file or an onnxruntime-genai folder"


@dataclasses.dataclass(frozen=True)
class _Option:
    """One argument of a command: ``add_argument``'s names and settings; ``group`` names a
    mutually exclusive group of the command's."""

    names: tuple[str, ...]
    settings: Mapping[str, Any]
    group: str | None = None


def _option(*names: str, group: str | None = None, **settings: Any) -> _Option:
    return _Option(names, settings, group)


def _format_options(granularity: str | None = "per_tensor") -> tuple[_Option, ...]:
    default = (
        "the scale file's, else the first the target runs: fp8 on CUDA, int8 on CPU"
        if granularity is None
        else "the first its target runs, the target as convert infers it: fp8 on CUDA, int8 on CPU"
    )
    recorded = " (default: the one the scale file states, else the one its sizes fit, else per_tensor)"
    return (
        _option("--format", choices=list(CACHE_FORMATS), help=f"cache format (default: {default})"),
        _option(
            "--granularity",
            default=granularity,
            choices=list(SCALE_GRANULARITIES),
            help="scale granularity" + (recorded if granularity is None else ""),
        ),
    )


def _data_options(whose: str, default: str) -> tuple[_Option, ...]:
    return (
        _option(
            "--text",
            group="data",
            type=_text_file,
            metavar="FILE",
            help=f"text file, tokenized with {whose} or --tokenizer's tokenizer (default: {default})",
        ),
        _option(
            "--token-ids",
            group="data",
            type=_ids_file,
            metavar="FILE",
            help="token ids: a .json file (a list of ids, or of lists) or .npy (default: as for --text)",
        ),
        _option(
            "--tokenizer",
            metavar="PATH",
            help=f"tokenizer.json or its folder (default: the one in {whose} folder)",
        ),
    )


def _progress_option(what: str) -> _Option:
    help = f"no progress bar ({what} shows one on a terminal)"
    return _option("--no-progress", dest="progress", action="store_false", help=help)


def _overwrite_option(what: str) -> _Option:
    return _option(
        "--overwrite",
        action="store_true",
        help=f"replace {what} even if onnx-kvcache did not write it (or it was edited since); without "
        "it, only a file onnx-kvcache wrote (its onnx_kvcache.written record matches its content) is "
        "replaced. Never a folder, link, device, FIFO, ONNX model or input",
    )


_EP_RUNS = ", ".join(n for n in ep_choices() if PROVIDERS[n])

_CONVERT = (
    _option("input", metavar="INPUT", help=_MODEL),
    _option(
        "output",
        metavar="OUTPUT",
        nargs="?",
        help="the new .onnx file (a folder, for a folder INPUT); omitted with --in-place",
    ),
    *_format_options(granularity=None),
    _option(
        "--scales",
        metavar="FILE",
        help="scale file (onnxruntime-genai format; default: none, which fp8 takes as unit scales "
        "with a warning and int8/int4 refuse)",
    ),
    _option(
        "--rotation",
        choices=list(ROTATIONS),
        help="turn the cache by an orthonormal matrix before it is quantized (docs/rotation.md): the "
        "query and key, or the value too (default: the one the scale file records, as calibrate "
        "writes it; none for a file without one; a rotated model keeps its own). Scales calibrated "
        "for another rotation are refused",
    ),
    _option(
        "--shared-kv-scale",
        action="store_true",
        help="one tensor, max(k_scale, v_scale), for both scale inputs: what CUDA's decode fast path "
        "needs before onnxruntime 1.29; the smaller scale gets coarser (a warning says when > 2x)",
    ),
    _option(
        "--ep",
        type=_ep,
        choices=ep_choices(),
        help=f"where the model will run: {_EP_RUNS} "
        "(or onnxruntime's name for one, e.g. CUDAExecutionProvider), or openvino (OpenVINO's own "
        "runtime; onnxruntime's OpenVINOExecutionProvider is not a row, so it is refused); the "
        "conversion is refused when it cannot run there (default: inferred, docs/capabilities.md: a "
        "genai folder's provider, else cpu for float32 models and cuda for fp16/bf16)",
    ),
    _option("--check-device", action="store_true", help="check this machine's GPU too"),
    _option(
        "--storage",
        choices=list(STORAGES),
        default="auto",
        help="where the quantized cache is kept: auto, the attention kernel (GroupQueryAttention, "
        "PagedAttention); qdq, the model's own attention reads each cache through DequantizeLinear "
        "and its present leaves through QuantizeLinear, nothing fused (multi-head latent attention, "
        "static buffers; --format defaults to int8) (default: auto)",
    ),
    _option(
        "--allow-partial",
        action="store_true",
        help="convert the caches that can be when others would keep their type (a layer the fusion "
        "left unfused, a cache another node also reads); without it such a model is refused (exit 1, "
        "nothing written, the layers named)",
    ),
    _option(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run an export and its fused model side by side on onnxruntime's CPU before writing, and "
        "refuse when their logits differ (default: for weights up to 1 GiB; --no-verify: never)",
    ),
    _option(
        "--weights",
        choices=list(WEIGHTS),
        help="give OUTPUT its own data files: copy (a clone where the filesystem can, else a copy "
        "that keeps holes) or link (hard links: onnx.load, onnx.checker and onnx-ir, reading a weight, "
        "then refuse BOTH models until one is deleted; onnxruntime and onnxruntime-genai load them) "
        "(default: shared beside INPUT, copy in another folder)",
    ),
    _option(
        "--follow-symlinks",
        action="store_true",
        help="accept input files that link out of the model's folder (Hugging Face cache "
        "snapshots); a conversion elsewhere copies their content",
    ),
    _option("--in-place", action="store_true", help="rewrite INPUT itself, atomically (no OUTPUT)"),
    _option(
        "--overwrite",
        action="store_true",
        help="replace OUTPUT only if it is a previous output of onnx-kvcache: a file or folder whose "
        "model carries onnx_kvcache.converted metadata from a conversion to a new path (never one "
        "converted in place), a folder only while it holds nothing that conversion did not write; "
        "a file's own data files (those it created) go too unless another readable .onnx file beside "
        "it names them. Nothing else is replaced or removed; an empty OUTPUT folder needs no --overwrite",
    ),
    _progress_option("copying data files"),
)

_INSPECT = (
    _option("model", metavar="MODEL", help=_MODEL),
    _option(
        "--ep",
        type=_ep,
        choices=ep_choices(),
        help="where the model will run: cuda adds whether CUDA's quantized decode fast path (XQA) "
        "runs each layer (default: none, the cache only)",
    ),
    _option(
        "--context",
        metavar="N",
        type=_CONTEXT,
        help="also report the cache bytes at this context length (default: per token only)",
    ),
    _option("--batch", metavar="B", type=_BATCH, help="batch size for --context (default: 1)"),
    _option("--json", action="store_true", help="machine-readable output"),
)

_CALIBRATE = (
    _option("model", metavar="MODEL", help=f"the unquantized model: {_MODEL}"),
    _option("--out", metavar="FILE", required=True, help="scale file to write (onnxruntime-genai format)"),
    _overwrite_option("FILE"),
    *_format_options(),
    _option(
        "--method",
        choices=list(METHODS),
        help="threshold rule (default: int4 mse rotated, attention unrotated, mse where no attention "
        "node of ours gives queries; else minmax; see docs/calibration.md)",
    ),
    _option(
        "--percentile",
        metavar="P",
        type=_bounded(float, 0, inclusive=False, high=100),
        help="the percentile of |x| that --method percentile takes (default: 99.99)",
    ),
    *_data_options(
        "the model's",
        "the built-in corpus's calibration part with that tokenizer, else seeded random token ids",
    ),
    _option(
        "--seq-len",
        metavar="N",
        type=_POSITIVE,
        help="window length in tokens (default: 512, or the model's context when shorter)",
    ),
    _option("--num-seqs", metavar="N", type=_POSITIVE, help="use at most this many windows (default: all)"),
    _option(
        "--min-tokens",
        metavar="N",
        type=_NON_NEGATIVE,
        default=256,
        help="refuse to calibrate on fewer tokens",
    ),
    _option(
        "--margin",
        metavar="M",
        type=_bounded(float, 0, inclusive=False),
        default=1.0,
        help="headroom: multiply thresholds by this",
    ),
    _option(
        "--no-rope-envelope",
        dest="rope_envelope",
        action="store_false",
        help="raw K thresholds (default: the RoPE pair norm, which no rotation exceeds)",
    ),
    _option(
        "--rotation",
        choices=list(ROTATIONS),
        help="the rotated cache the scales are for (docs/rotation.md); recorded in the file, and "
        "convert rotates alike (default: keys_and_values for int4, else none)",
    ),
    _option(
        "--rope-positions",
        metavar="N",
        type=_POSITIVE,
        help="the longest context the scales must hold for: a rotated cache's keys (any method) "
        "and the attention methods' K search assume positions below N (default: the model's "
        "whole rotary table)",
    ),
    _progress_option("calibration"),
)

_EVALUATE = (
    _option("baseline", metavar="BASELINE", help=f"the original model: {_MODEL}"),
    _option("candidate", metavar="CANDIDATE", help=f"the converted model: {_MODEL}"),
    *_data_options(
        "the baseline's",
        "the built-in corpus's evaluation part with that tokenizer, else random token ids of another "
        "seed: both held out from calibrate's default data",
    ),
    _option(
        "--max-new-tokens",
        metavar="N",
        type=_NON_NEGATIVE,
        help="greedy tokens to compare (default: 64, or what the model's context leaves after the prompt)",
    ),
    _option("--num-seqs", metavar="N", type=_POSITIVE, default=4, help="sequences to evaluate"),
    _option(
        "--seq-len",
        metavar="N",
        type=_POSITIVE,
        help="tokens per sequence (default: 256, or the model's context + 1 when shorter)",
    ),
    _option(
        "--prompt-len",
        metavar="N",
        type=_POSITIVE,
        default=64,
        help="each sequence's prompt, fed in one call before its decode steps are scored one token a "
        "call (at most half the sequence)",
    ),
    _option(
        "--semantics",
        choices=list(SEMANTICS),
        help="kernel rule the candidate's quantized cache follows on this CPU: cuda (first prompt "
        "attended unquantized) or cpu (default: the rule of the candidate's target provider)",
    ),
    _option(
        "--speed-context",
        metavar="N",
        type=_NON_NEGATIVE,
        help="time both models' prefill of N tokens and decode after it, and give their caches' bytes "
        "there (default: 1024, or what the models' context holds; 0: not timed)",
    ),
    _option("--json", metavar="FILE", help="also write the report as JSON here (default: none)"),
    _option(
        "--plot",
        metavar="FILE",
        help="also write a PNG (per-layer error, KL per position), named *.png; needs matplotlib "
        "(default: none)",
    ),
    _overwrite_option("the --json or --plot FILE"),
    _progress_option("evaluation"),
)

_COMPARE = (
    _option("baseline", metavar="BASELINE", help=f"the original model: {_MODEL}"),
    _option("candidate", metavar="CANDIDATE", help=f"the converted model: {_MODEL}"),
    _option(
        "--prompt",
        metavar="TEXT",
        default="The capital of France is",
        help="the text both models continue, tokenized with the baseline's or --tokenizer's tokenizer",
    ),
    _option("--tokenizer", metavar="PATH", help="tokenizer.json or its folder (default: the baseline's)"),
    _option(
        "--max-new-tokens", metavar="N", type=_POSITIVE, default=32, help="greedy tokens each model adds"
    ),
    _option(
        "--semantics",
        choices=list(SEMANTICS),
        help="kernel rule the candidate's quantized cache follows on this CPU (default: its target's)",
    ),
)

_DOCTOR = (
    _option(
        "--ep",
        "--provider",
        dest="provider",
        metavar="P",
        action="append",
        help="provider to create sessions on, as the other commands' --ep: a table row (cpu, cuda, "
        "...) or onnxruntime's name (repeatable; default: every one this onnxruntime lists); exits "
        "1 when one is not present",
    ),
    _option("--json", action="store_true", help="machine-readable output"),
)

_DEMO = (
    _option(
        "--keep",
        metavar="DIR",
        help="write the demo models into this folder and keep them (default: a temporary folder)",
    ),
    _progress_option("the demo"),
)
