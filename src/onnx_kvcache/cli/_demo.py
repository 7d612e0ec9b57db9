"""``onnx-kvcache demo``: the whole story on the bundled decoder, on CPU, in seconds.

Build the decoder, calibrate scales, convert it to every cache format and
granularity, evaluate each against the original (fp8 through CPU emulation) and
print one table: the float32 baseline, then a row per variant, then a legend.
Scales are calibrated on the built-in corpus's calibration part and evaluated on its
evaluation part (held out, as ``calibrate`` and ``evaluate`` do by default), so the table
does not score the scales on the text they were measured on.
"""

from __future__ import annotations

__all__ = ["DEMO_VARIANTS", "run_demo"]

import dataclasses
import hashlib
import os
import pathlib
import tempfile
import time
from collections.abc import Callable, Mapping

import onnx_ir as ir
from tqdm import tqdm

from onnx_kvcache.cache.layout import inspect_kv_cache
from onnx_kvcache.cache.rotation import DEFAULT_ROTATIONS
from onnx_kvcache.calibrate.calibration import calibrate_kv_cache
from onnx_kvcache.errors import Message, Param
from onnx_kvcache.files.conversion import convert_model
from onnx_kvcache.model_io import CONVERTED, atomic_write_bytes, check_demo_folder, record_demo_folder
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.runtime.evaluation import EvaluationReport, evaluate_kv_cache
from onnx_kvcache.scales.data import corpus_byte_ids

#: (format, granularity, calibration method) shown by the demo.
DEMO_VARIANTS = (
    ("fp8", "per_tensor", "minmax"),
    ("fp8", "per_channel", "minmax"),
    ("int8", "per_tensor", "minmax"),
    ("int8", "per_channel", "minmax"),
    ("int4", "per_tensor", "mse"),
    ("int4", "per_channel", "mse"),
)

_HEADER = ("format", "granularity", "calib", "kernel rule", "B/token", "KL mean", "KL max", "top-1", "greedy")

#: Greedy tokens each evaluation generates and compares.
_NEW_TOKENS = 32


def run_demo(
    keep: str | os.PathLike | None = None, echo: Callable[[str], None] = print, *, progress: bool = True
) -> list[EvaluationReport]:
    """Run the demo; models are written to ``keep`` or a temporary folder.

    ``keep`` must be a new or empty folder, or one an earlier demo filled (its
    ``onnx-kvcache-demo.json`` lists every file there, unchanged): anything else is refused
    before any work. ``progress``: one progress bar on a terminal, cleared before the table
    is printed.
    """
    start = time.perf_counter()
    if keep is not None:
        check_demo_folder(keep)
    with tempfile.TemporaryDirectory(prefix="onnx-kvcache-demo-") as tmp:
        folder = pathlib.Path(keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        demo = _Demo(folder, keep is not None)
        baseline = _write_baseline(demo)
        info = inspect_kv_cache(ir.load(baseline))
        echo(
            Message(
                f"demo decoder: {len(info.layers)} GQA layers, float32 cache, random weights (its figures "
                "show the machinery, not a trained model's accuracy: docs/choosing-a-format.md has "
                "those); models ",
                _where(keep, folder),
            )
        )
        # what the decoder's byte-level tokenizer makes of the corpus: scales from one part,
        # scores on the other (held out)
        data = _DemoData([corpus_byte_ids("calibration")], [corpus_byte_ids("evaluation")])
        reports = _evaluate_variants(demo, baseline, data, progress)
        rows = [_HEADER, ("float32", "-", "-", "cpu (native)", f"{info.bytes_per_token:g}", *"----")]
        rows += [_row(variant, report) for variant, report in zip(DEMO_VARIANTS, reports)]
        _print_table(rows, reports, echo)
        echo(f"done in {time.perf_counter() - start:.1f}s")
    return reports


@dataclasses.dataclass(frozen=True)
class _DemoData:
    """The token windows the demo calibrates on, and the disjoint ones it evaluates on."""

    calibration: list[list[int]]
    evaluation: list[list[int]]


@dataclasses.dataclass(frozen=True)
class _Demo:
    """Where the demo writes, and whether it records the folder (a kept one)."""

    folder: pathlib.Path
    recorded: bool

    def record(self, pending: Mapping[str, str] | None = None) -> None:
        if self.recorded:
            record_demo_folder(self.folder, pending)


def _write_baseline(demo: _Demo) -> pathlib.Path:
    """The bundled decoder written as ``model.onnx``, recorded first when the folder is kept."""
    baseline = demo.folder / "model.onnx"
    graph = ir.to_proto(build_decoder()).SerializeToString()
    demo.record(
        {baseline.name: hashlib.sha256(graph).hexdigest()}
    )  # a stopped demo leaves a folder it accepts
    atomic_write_bytes(baseline, graph)
    return baseline


def _where(keep: str | os.PathLike | None, folder: pathlib.Path) -> str:
    if keep:
        return f"in {folder}"
    return Message("in a temporary folder (", Param("keep", placeholder="DIR"), " keeps them)")


def _evaluate_variants(
    demo: _Demo, baseline: pathlib.Path, data: _DemoData, progress: bool
) -> list[EvaluationReport]:
    """Each of :data:`DEMO_VARIANTS` calibrated, converted and evaluated, under one progress bar."""
    reports = []
    bar = tqdm(DEMO_VARIANTS, desc="demo", unit="model", leave=False, disable=None if progress else True)
    for fmt, granularity, method in bar:
        bar.set_postfix_str(f"{fmt} {granularity}")
        reports.append(_evaluate_variant(demo, baseline, data, fmt, granularity, method))
    bar.close()  # cleared: nothing is left above the table
    return reports


def _evaluate_variant(
    demo: _Demo, baseline: pathlib.Path, data: _DemoData, fmt: str, granularity: str, method: str
) -> EvaluationReport:
    scales = calibrate_kv_cache(
        baseline, data.calibration, format=fmt, granularity=granularity, method=method, progress=False
    )
    out = demo.folder / f"model.{fmt}.{granularity}.onnx"
    demo.record({out.name: CONVERTED})
    convert_model(
        baseline,
        out,
        format=fmt,
        granularity=granularity,
        scales=scales,
        overwrite=True,
        ep=None if fmt == "fp8" else "cpu",  # fp8 of a float32 model: evaluated through CPU emulation
        progress=False,
    )
    demo.record()
    return evaluate_kv_cache(baseline, out, data.evaluation, max_new_tokens=_NEW_TOKENS, progress=False)


def _row(variant: tuple[str, str, str], report: EvaluationReport) -> tuple[str, ...]:
    """One table row: the variant, its kernel rule and figures."""
    fmt, granularity, method = variant
    rotated = DEFAULT_ROTATIONS.get(fmt, "none") != "none"  # calibration's default, which convert follows
    return (
        fmt,
        granularity,
        method + ("+rot" if rotated else ""),
        report.kernel_rule.replace("onnxruntime CPU kernel", "native"),
        f"{report.candidate_bytes_per_token:g}",
        f"{report.kl_mean:.2e}",
        f"{report.kl_max:.2e}",
        f"{report.top1_agreement:.1%}",
        f"{report.greedy_match_share:.1%}",
    )


def _print_table(
    rows: list[tuple[str, ...]], reports: list[EvaluationReport], echo: Callable[[str], None]
) -> None:
    """The rows in aligned columns, then the legend."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    echo("")
    for row in rows:
        echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    echo("")
    echo(
        f"B/token: cache bytes per token; KL mean/max, top-1: next token vs float32 over "
        f"{reports[0].positions} positions; greedy: share of {_NEW_TOKENS} greedy tokens matching; "
        "+rot: the cache rotated (int4's default, docs/rotation.md)"
    )
    echo(
        "kernel rule: how this CPU computes the cache (cuda: CUDA's rule, emulated; prompt in float: a "
        "prompt attends through the float kernel, each new token through the quantized one); "
        "calibrated on the built-in corpus's calibration part, evaluated on its held-out evaluation "
        "part (byte-level ids)"
    )
