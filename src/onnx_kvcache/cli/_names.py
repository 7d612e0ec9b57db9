"""The tables' row names, for the command's parser: standard library only.

The command parses its arguments, answers ``--help`` and refuses a bad value before it
imports onnx, onnx-ir and numpy, which the tables themselves need. These are the keys of
:data:`~onnx_kvcache.cache.formats.CACHE_FORMATS`, :data:`~onnx_kvcache.cache.formats.SCALE_GRANULARITIES`
and :data:`~onnx_kvcache.capabilities.table.EP_CAPABILITIES` (``tests/cli/test_commands.py`` checks that they
are, so a new row fails there until it is named here too).
"""

from __future__ import annotations

__all__ = ["EP_ALIASES", "FORMATS", "GRANULARITIES", "PROVIDERS", "ep_name"]

FORMATS = ("fp8", "int8", "int4")
GRANULARITIES = ("per_tensor", "per_channel")
#: ``--ep`` value -> onnxruntime's provider name ("" for a row of another runtime), the
#: capability table's rows but ``default``.
PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "dml": "DmlExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "openvino": "",
}
#: Other names users give a provider.
EP_ALIASES = {"directml": "dml", "gpu": "cuda"}
_ALIASES = {provider.lower(): name for name, provider in PROVIDERS.items() if provider} | EP_ALIASES


def ep_name(value: str) -> str:
    """A provider as the table names it: ``CUDAExecutionProvider`` -> ``cuda`` (lower case
    when it names no row, as ``capabilities.get_capabilities`` reads it)."""
    key = value.lower()
    return _ALIASES.get(key, key)
