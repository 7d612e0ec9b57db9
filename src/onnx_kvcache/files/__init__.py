"""Files: converting models, files and onnxruntime-genai folders (reading and writing: ``model_io``).

The names other folders use are this package's public names, imported from their private
modules on first use (PEP 562)."""

from __future__ import annotations

__all__ = [
    "read_export_config",
]

from onnx_kvcache._lazy import lazy_getattr

TYPE_CHECKING = False  # typing is not imported: importing the folder stays cheap

_EXPORTS = {  # where each name lives; imported on first use
    "onnx_kvcache.files._export_folder": ("read_export_config",),
}
__getattr__ = lazy_getattr(__name__, _EXPORTS)


if TYPE_CHECKING:
    from onnx_kvcache.files._export_folder import read_export_config
