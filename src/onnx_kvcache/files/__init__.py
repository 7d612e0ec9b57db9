"""Files: converting models, files and onnxruntime-genai folders (reading and writing: ``model_io``).

The names other folders use are this package's public names, imported from their private
modules on first use (PEP 562)."""

from __future__ import annotations

__all__ = [
    "read_export_config",
]

TYPE_CHECKING = False  # typing is not imported: importing the folder stays cheap

_EXPORTS = {  # where each name lives; imported on first use
    "onnx_kvcache.files._export_folder": ("read_export_config",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> object:
    """A public name, imported from its private module on first use (PEP 562)."""
    import importlib

    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from onnx_kvcache.files._export_folder import read_export_config
