"""``onnx-kvcache demo``: the whole story on the bundled decoder, on CPU, in seconds.

Build the decoder, calibrate scales, convert it to every cache format and
granularity, evaluate each against the original (fp8 through CPU emulation) and
print one table.
"""

from __future__ import annotations

__all__ = ["DEMO_VARIANTS", "run_demo"]

import pathlib
import tempfile
import time
from collections.abc import Callable

import onnx_ir as ir

from onnx_kvcache.cache_layout import inspect_kv_cache
from onnx_kvcache.calibration import calibrate_kv_cache
from onnx_kvcache.data import corpus_byte_ids
from onnx_kvcache.demo_model import build_decoder
from onnx_kvcache.evaluation import EvaluationReport, evaluate_kv_cache
from onnx_kvcache.model_files import convert_model

#: (format, granularity, calibration method) shown by the demo.
DEMO_VARIANTS = (
    ("fp8", "per_tensor", "minmax"),
    ("fp8", "per_channel", "minmax"),
    ("int8", "per_tensor", "minmax"),
    ("int8", "per_channel", "minmax"),
    ("int4", "per_tensor", "mse"),
    ("int4", "per_channel", "mse"),
)


def run_demo(keep: str | None = None, echo: Callable[[str], None] = print) -> list[EvaluationReport]:
    """Run the demo; models are written to ``keep`` or a temporary folder."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="onnx-kvcache-demo-") as tmp:
        folder = pathlib.Path(keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        baseline = folder / "model.onnx"
        ir.save(build_decoder(), baseline)
        info = inspect_kv_cache(ir.load(baseline))
        echo(
            f"demo decoder: {len(info.layers)} GQA layers, float32 cache "
            f"{info.bytes_per_token:g} bytes/token -> {baseline}"
        )
        corpus = [corpus_byte_ids()]  # what the decoder's byte-level tokenizer makes of the corpus
        rows = [
            (
                "format",
                "granularity",
                "calib",
                "kernel rule",
                "B/token",
                "KL mean",
                "KL max",
                "top-1",
                "greedy",
            )
        ]
        reports = []
        for fmt, granularity, method in DEMO_VARIANTS:
            scales = calibrate_kv_cache(
                baseline, corpus, format=fmt, granularity=granularity, method=method, progress=False
            )
            out = folder / f"model.{fmt}.{granularity}.onnx"
            convert_model(
                baseline, out, format=fmt, granularity=granularity, scales=scales, overwrite=True, ep=None
            )  # ep=None: fp8 of a float32 model, for evaluation through CPU emulation
            report = evaluate_kv_cache(baseline, out, corpus, max_new_tokens=32)
            reports.append(report)
            rows.append(
                (
                    fmt,
                    granularity,
                    method,
                    report.kernel_rule.replace("onnxruntime CPU kernel", "native"),
                    f"{report.candidate_bytes_per_token:g}",
                    f"{report.kl_mean:.2e}",
                    f"{report.kl_max:.2e}",
                    f"{report.top1_agreement:.1%}",
                    f"{report.greedy_match_share:.1%}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        echo("")
        for row in rows:
            echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        echo("")
        echo(
            f"calibrated and evaluated on the built-in corpus (byte-level ids); "
            f"{reports[0].positions} teacher-forced positions each"
        )
        echo(f"done in {time.perf_counter() - start:.1f}s" + (f"; models kept in {folder}" if keep else ""))
    return reports
