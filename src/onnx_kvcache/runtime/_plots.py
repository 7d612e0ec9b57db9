"""Plots of an evaluation: per-layer cache error and KL divergence per position."""

from __future__ import annotations

__all__ = ["check_plotting", "plot_evaluation", "render_plot"]

import io
import os
from collections.abc import Iterable
from typing import Any

from onnx_kvcache._version import __version__
from onnx_kvcache.errors import missing_dependency
from onnx_kvcache.model_io import check_output, stamp_png, write_output
from onnx_kvcache.runtime.evaluation import EvaluationReport


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise missing_dependency(e, "Plots need matplotlib: pip install 'onnx-kvcache[plot]'.") from e
    return plt


def check_plotting(
    path: str | os.PathLike, *, overwrite: bool = False, inputs: Iterable[os.PathLike | str] = ()
) -> Any:
    """Refuse, before an evaluation, a plot that could not be written: no matplotlib, a name
    that is not ``.png``, or a path the output rules (:mod:`onnx_kvcache.model_io._outputs`) refuse.
    The identity of the file it would replace (None: a new file), as ``check_output`` gives it."""
    seen = check_output(path, "plot", overwrite=overwrite, inputs=inputs)
    _pyplot()
    return seen


def plot_evaluation(
    report: EvaluationReport,
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    inputs: Iterable[os.PathLike | str] = (),
) -> None:
    """Write a PNG with per-layer K/V cache error and mean KL per position (atomically, by
    the rules of :mod:`onnx_kvcache.model_io._outputs`)."""
    check_output(path, "plot", overwrite=overwrite, inputs=inputs)
    write_output(path, render_plot(report), "plot", overwrite=overwrite, inputs=inputs)


def render_plot(report: EvaluationReport) -> bytes:
    """The PNG :func:`plot_evaluation` writes, stamped as ours."""
    plt = _pyplot()
    layers = sorted(report.layer_errors)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    width = 0.4
    left.bar([i - width / 2 for i in layers], [report.layer_errors[i][0] for i in layers], width, label="K")
    left.bar([i + width / 2 for i in layers], [report.layer_errors[i][1] for i in layers], width, label="V")
    left.set(xlabel="layer", ylabel="relative L2 error", title="cache reconstruction error", xticks=layers)
    left.legend()
    right.plot(range(len(report.kl_per_position)), report.kl_per_position)
    positive = any(k > 0 for k in report.kl_per_position)  # a model against itself: all zero
    right.set(
        xlabel="position (teacher-forced)",
        ylabel="KL(baseline || candidate), nats",
        title="next-token KL per position",
        yscale="log" if positive else "linear",
    )
    fig.suptitle(
        f"{report.candidate_format}: KL mean {report.kl_mean:.2e}, top-1 {report.top1_agreement:.1%}"
    )
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, metadata={"Software": f"onnx-kvcache {__version__}"})
    plt.close(fig)
    return stamp_png(buffer.getvalue())
