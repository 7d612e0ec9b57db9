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
    """A public name, read from its private module at each use (PEP 562): imported on first
    use, never copied here, so ``monkeypatch.setattr(<private module>, name, ...)`` reaches
    every caller that says ``folder.name``."""
    import importlib

    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from onnx_kvcache.files._export_folder import read_export_config
