"""``onnx-kvcache demo``: the whole story on the bundled decoder, on CPU, in seconds.

Build the decoder, calibrate scales, convert it to every cache format and
granularity, evaluate each against the original (fp8 through CPU emulation) and
print one table: the float32 baseline, then a row per variant, then a legend.
"""

from __future__ import annotations

__all__ = ["DEMO_VARIANTS", "run_demo"]

import hashlib
import os
import pathlib
import tempfile
import time
from collections.abc import Callable

import onnx_ir as ir
from tqdm import tqdm

from onnx_kvcache.cache.layout import inspect_kv_cache
from onnx_kvcache.errors import Message, Param
from onnx_kvcache.files._atomic import atomic_write_bytes
from onnx_kvcache.files._outputs import CONVERTED, check_demo_folder, record_demo_folder
from onnx_kvcache.files.conversion import convert_model
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.runtime.evaluation import EvaluationReport, evaluate_kv_cache
from onnx_kvcache.scales.calibration import calibrate_kv_cache
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
        baseline = folder / "model.onnx"
        graph = ir.to_proto(build_decoder()).SerializeToString()
        if keep is not None:  # recorded first: a demo stopped at any point leaves a folder it accepts
            record_demo_folder(folder, {baseline.name: hashlib.sha256(graph).hexdigest()})
        atomic_write_bytes(baseline, graph)
        info = inspect_kv_cache(ir.load(baseline))
        where = (
            f"in {folder}"
            if keep
            else Message("in a temporary folder (", Param("keep", placeholder="DIR"), " keeps them)")
        )
        echo(Message(f"demo decoder: {len(info.layers)} GQA layers, float32 cache; models ", where))
        corpus = [corpus_byte_ids()]  # what the decoder's byte-level tokenizer makes of the corpus
        rows = [_HEADER, ("float32", "-", "-", "cpu (native)", f"{info.bytes_per_token:g}", *"----")]
        reports = []
        bar = tqdm(DEMO_VARIANTS, desc="demo", unit="model", leave=False, disable=None if progress else True)
        for fmt, granularity, method in bar:
            bar.set_postfix_str(f"{fmt} {granularity}")
            scales = calibrate_kv_cache(
                baseline, corpus, format=fmt, granularity=granularity, method=method, progress=False
            )
            out = folder / f"model.{fmt}.{granularity}.onnx"
            if keep is not None:
                record_demo_folder(folder, {out.name: CONVERTED})
            convert_model(
                baseline,
                out,
                format=fmt,
                granularity=granularity,
                scales=scales,
                overwrite=True,
                ep=None,  # fp8 of a float32 model, for evaluation through CPU emulation
                progress=False,
            )
            if keep is not None:
                record_demo_folder(folder)
            report = evaluate_kv_cache(baseline, out, corpus, max_new_tokens=_NEW_TOKENS, progress=False)
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
        bar.close()  # cleared: nothing is left above the table
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        echo("")
        for row in rows:
            echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        echo("")
        echo(
            f"B/token: cache bytes per token; KL mean/max, top-1: next token vs float32 over "
            f"{reports[0].positions} positions; greedy: share of {_NEW_TOKENS} greedy tokens matching"
        )
        echo(
            "kernel rule: how this CPU computes the cache (cuda: CUDA's rule, emulated); calibrated and "
            "evaluated on the built-in corpus (byte-level ids)"
        )
        echo(f"done in {time.perf_counter() - start:.1f}s")
    return reports
