"""Module paths of the 0.x layout, kept for one release: each imports its new module, with a warning.

``import onnx_kvcache.formats`` gives the module object of :mod:`onnx_kvcache.cache.formats` itself
(so a monkeypatch on either name reaches the same code), after a :class:`DeprecationWarning`
that names the new path. Standard library only, and light: the package installs the finder on
import, so the command's start-up pays for it (``importlib.abc`` alone costs 20-40 ms: the
finder and loader implement its protocols without subclassing it).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence

__all__ = ["MOVED_MODULES", "announce", "install", "moved"]

#: old module path -> new module path: the 0.x layout's public modules, and every module (private
#: ones too) moved since, so the folders rank as their imports run (tests/test_layering.py)
MOVED_MODULES: dict[str, str] = {
    "onnx_kvcache.formats": "onnx_kvcache.cache.formats",
    "onnx_kvcache.attention_ops": "onnx_kvcache.cache.operators",
    "onnx_kvcache.gqa": "onnx_kvcache.cache.sites",
    "onnx_kvcache.cache_layout": "onnx_kvcache.cache.layout",
    "onnx_kvcache.device": "onnx_kvcache.capabilities.device",
    "onnx_kvcache.doctor": "onnx_kvcache.runtime.doctor",
    "onnx_kvcache.calibration": "onnx_kvcache.calibrate.calibration",
    "onnx_kvcache.data": "onnx_kvcache.scales.data",
    "onnx_kvcache.passes.attention_fusion": "onnx_kvcache.passes.fusion.attention_fusion",
    "onnx_kvcache.passes.sdpa_fusion": "onnx_kvcache.passes.fusion.sdpa_fusion",
    "onnx_kvcache.passes.gqa_fusion": "onnx_kvcache.passes.fusion.gqa_fusion",
    "onnx_kvcache.optimize": "onnx_kvcache.pipeline.optimize",
    "onnx_kvcache.model_files": "onnx_kvcache.files.conversion",
    "onnx_kvcache.model_source": "onnx_kvcache.model_io.reading",
    "onnx_kvcache.genai_folder": "onnx_kvcache.model_io.genai_folder",
    "onnx_kvcache.runner": "onnx_kvcache.runtime.runner",
    "onnx_kvcache.evaluation": "onnx_kvcache.runtime.evaluation",
    "onnx_kvcache.decoder_config": "onnx_kvcache.models.config",
    "onnx_kvcache.demo_model": "onnx_kvcache.models.decoder",
    "onnx_kvcache.exported_decoder": "onnx_kvcache.models.exported",
    # moved so that each folder ranks as its imports run (tests/test_layering.py)
    "onnx_kvcache.files.reading": "onnx_kvcache.model_io.reading",
    "onnx_kvcache.files.genai_folder": "onnx_kvcache.model_io.genai_folder",
    "onnx_kvcache.files._marker": "onnx_kvcache.model_io._marker",
    "onnx_kvcache.files._atomic": "onnx_kvcache.model_io._atomic",
    "onnx_kvcache.files._inputs": "onnx_kvcache.model_io._inputs",
    "onnx_kvcache.files._outputs": "onnx_kvcache.model_io._outputs",
    "onnx_kvcache.runtime._sessions": "onnx_kvcache.model_io._sessions",
    "onnx_kvcache.capabilities.doctor": "onnx_kvcache.runtime.doctor",
    "onnx_kvcache.scales.calibration": "onnx_kvcache.calibrate.calibration",
    "onnx_kvcache.scales._clip_search": "onnx_kvcache.calibrate._clip_search",
    "onnx_kvcache.scales._attention_error": "onnx_kvcache.calibrate._attention_error",
}


def _importlib_frames() -> int:
    """The frames of importlib's own Python code (``importlib.import_module``) between the
    import system and the importing line: ``warnings`` skips only the frozen bootstrap's, so
    these are counted for the warning to name the caller's line."""
    frame: types.FrameType | None = sys._getframe(2)  # create_module's caller: the import system
    count = 0
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:  # skipped by warnings already
            frame = frame.f_back
        elif name == importlib.__file__:
            count += 1
            frame = frame.f_back
        else:
            break
    return count


def announce(old: str, new: str, stacklevel: int) -> None:
    """The :class:`DeprecationWarning` of a 0.x name; ``stacklevel`` as ``warnings.warn`` would
    take it where this is called."""
    message = f"{old} moved to {new}; the old path goes away in the next release"
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def moved(old: str, stacklevel: int) -> types.ModuleType:
    """The module ``old`` (a key of :data:`MOVED_MODULES`) now is, with its warning
    attributed ``stacklevel`` frames up (the caller's line)."""
    new = MOVED_MODULES[old]
    announce(old, new, stacklevel)
    return importlib.import_module(new)


class _Alias:
    """The loader of a moved path: the new module itself (``importlib.abc.Loader``'s protocol)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return moved(spec.name, stacklevel=3 + _importlib_frames())

    def exec_module(self, module: types.ModuleType) -> None:
        """The target module ran when it was imported."""


class _MovedFinder:
    """Finds the moved paths (``importlib.abc.MetaPathFinder``'s protocol)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias())  # type: ignore[arg-type]  # the protocol


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
