"""Plots of an evaluation: per-layer cache error and KL divergence per position."""

from __future__ import annotations

__all__ = ["plot_evaluation"]

import os

from onnx_kvcache.errors import MissingRuntimeError
from onnx_kvcache.evaluation import EvaluationReport


def plot_evaluation(report: EvaluationReport, path: str | os.PathLike) -> None:
    """Write a PNG with per-layer K/V cache error and mean KL per position."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingRuntimeError("Plots need matplotlib: pip install 'onnx-kvcache[plot]'.") from e
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
