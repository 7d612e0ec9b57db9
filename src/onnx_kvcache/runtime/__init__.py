"""Running and evaluating converted models: the runner, evaluation, plots, ``doctor``.

The names other folders use are this package's public names, imported from their private
modules on first use (PEP 562)."""

from __future__ import annotations

__all__ = [
    "FEWER_WINDOWS",
    "MemoryEstimate",
    "WINDOW_BYTES",
    "check_plotting",
    "max_positions",
    "render_plot",
    "run_parts",
]

from onnx_kvcache._lazy import lazy_getattr

TYPE_CHECKING = False  # typing is not imported: importing the folder stays cheap

_EXPORTS = {  # where each name lives; imported on first use
    "onnx_kvcache.runtime._decoder_session": ("max_positions",),
    "onnx_kvcache.runtime._memory": (
        "FEWER_WINDOWS",
        "MemoryEstimate",
        "WINDOW_BYTES",
        "run_parts",
    ),
    "onnx_kvcache.runtime._plots": (
        "check_plotting",
        "render_plot",
    ),
}
__getattr__ = lazy_getattr(__name__, _EXPORTS)


if TYPE_CHECKING:
    from onnx_kvcache.runtime._decoder_session import max_positions
    from onnx_kvcache.runtime._memory import FEWER_WINDOWS, WINDOW_BYTES, MemoryEstimate, run_parts
    from onnx_kvcache.runtime._plots import check_plotting, render_plot
