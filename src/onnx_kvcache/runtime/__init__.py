"""Running and evaluating converted models: the runner, evaluation, plots, ``doctor``.

The names other folders use are this package's public names, imported from their private
modules on first use (PEP 562)."""

from __future__ import annotations

__all__ = [
    "FEWER_WINDOWS",
    "MemoryEstimate",
    "WINDOW_BYTES",
    "check_plotting",
    "render_plot",
    "run_parts",
]

TYPE_CHECKING = False  # typing is not imported: importing the folder stays cheap

_EXPORTS = {  # where each name lives; imported on first use
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
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> object:
    """A public name, read from its private module at each use (PEP 562): imported on first
    use, never copied here, so ``monkeypatch.setattr(<private module>, name, ...)`` reaches
    every caller that says ``folder.name``."""
    import importlib

    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from onnx_kvcache.runtime._memory import FEWER_WINDOWS, WINDOW_BYTES, MemoryEstimate, run_parts
    from onnx_kvcache.runtime._plots import check_plotting, render_plot
