"""The tables' row names, for the command's parser: standard library only.

The command parses its arguments, answers ``--help`` and refuses a bad value before it
imports onnx, onnx-ir and numpy, which the tables themselves need. These are the keys of
:data:`~onnx_kvcache.cache.formats.CACHE_FORMATS`, :data:`~onnx_kvcache.cache.formats.SCALE_GRANULARITIES`,
:data:`~onnx_kvcache.capabilities.table.EP_CAPABILITIES` and
:data:`~onnx_kvcache.calibrate.calibration.CALIBRATION_METHODS`,
:data:`~onnx_kvcache.cache.rotation.ROTATIONS`, :data:`~onnx_kvcache.pipeline.storage_decision.STORAGES`,
the kernel rules of
:data:`~onnx_kvcache.passes.kv_cache_emulation.SEMANTICS` and the ``WeightsMode`` values
(``tests/cli/test_commands.py`` and ``tests/cli/test_names.py`` check that they are, so a new row fails
there until it is named here too).
"""

from __future__ import annotations

__all__ = [
    "EP_ALIASES",
    "FORMATS",
    "GRANULARITIES",
    "METHODS",
    "PROVIDERS",
    "ROTATIONS",
    "SEMANTICS",
    "STORAGES",
    "WEIGHTS",
    "ep_name",
]

FORMATS = ("fp8", "int8", "int4")
GRANULARITIES = ("per_tensor", "per_channel")
METHODS = ("minmax", "percentile", "mse", "attention", "attention_search")
SEMANTICS = ("cuda", "cpu")
ROTATIONS = ("none", "keys", "keys_and_values")
STORAGES = ("auto", "qdq")
WEIGHTS = ("copy", "link")
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
