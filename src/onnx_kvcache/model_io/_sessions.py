"""onnxruntime, imported lazily: the pass needs no runtime, running a model does.

onnxruntime's numpy interface takes and returns numpy's own types only (and fp8 E4M3 as
uint8): tensors of the types ml_dtypes adds (float8, bfloat16) go in and come out as
their bits (:func:`to_ort_value`, :func:`host_array`).
"""

from __future__ import annotations

__all__ = [
    "create_session",
    "external_data_dir",
    "fed_as_bits",
    "host_array",
    "import_onnxruntime",
    "installed_ort_version",
    "installed_version",
    "run_on_host",
    "to_ort_value",
]

import ctypes
import importlib.metadata
import os
from types import ModuleType
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError, missing_dependency


def import_onnxruntime() -> ModuleType:
    """The onnxruntime module, or an error naming the extra to install."""
    try:
        import onnxruntime
    except ImportError as e:
        raise missing_dependency(
            e,
            "onnxruntime is not installed. Install the CPU runtime with "
            "`pip install 'onnx-kvcache[cpu]'` or the CUDA one with "
            "`pip install 'onnx-kvcache[gpu]'` (never both).",
        ) from e
    return onnxruntime


_DISTRIBUTIONS = {
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "ort-nightly"),
    "openvino": ("openvino",),
}


def installed_version(runtime: str = "onnxruntime") -> str | None:
    """Version of an installed runtime (``onnxruntime`` in any wheel, ``openvino``), unimported."""
    for dist in _DISTRIBUTIONS.get(runtime, (runtime,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_ort_version() -> str | None:
    """Version of the installed onnxruntime wheel (CPU or GPU), without importing it."""
    return installed_version("onnxruntime")


def external_data_dir(model: ir.Model) -> str | None:
    """The folder an in-memory model's external tensors are read from, or None."""
    folders = {
        os.path.abspath(value.const_value.base_dir or ".")
        for value in model.graph.initializers.values()
        if isinstance(value.const_value, ir.ExternalTensor)
    }
    if len(folders) > 1:
        raise KvCacheError(
            f"The model's external data lies in several folders ({', '.join(sorted(folders))}); "
            "save it with its data in one folder first."
        )
    return folders.pop() if folders else None


def create_session(
    model: ir.Model | str | os.PathLike,
    providers: list[Any] | None = None,
    base_dir: str | os.PathLike | None = None,
    *,
    spinning: bool = True,
) -> Any:
    """An InferenceSession on ``providers`` (CPU by default) for a model or path.

    ``base_dir`` is the folder of an in-memory model's external data files (default: where
    its external tensors say they are), so that it loads from any working directory.
    ``spinning=False``: the intra-op threads sleep between parallel sections instead of
    spinning (for a few long runs, such as calibration's prefills: spinning buys them no
    latency and takes the cores from the work; measured 15% less CPU time on SmolLM2).
    """
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 4  # its errors reach the caller as exceptions: one line
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if base_dir is None and isinstance(model, ir.Model):
        base_dir = external_data_dir(model)
    if base_dir is not None:
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", os.fspath(base_dir)
        )
    providers = providers or ["CPUExecutionProvider"]
    if isinstance(model, ir.Model):
        data = ir.to_proto(model).SerializeToString()
        return ort.InferenceSession(data, options, providers=providers)
    return ort.InferenceSession(os.fspath(model), options, providers=providers)


def fed_as_bits(dtype: ir.DataType) -> bool:
    """onnxruntime takes no numpy array of a type numpy lacks (float8, bfloat16: ml_dtypes'
    types, which numpy marks as not built in): feed its bits."""
    return np.dtype(dtype.numpy()).isbuiltin != 1


def to_ort_value(array: np.ndarray, dtype: ir.DataType, device: str = "cpu") -> Any:
    """An OrtValue of element type ``dtype`` on ``device`` (float8/bf16 arrays as their bits)."""
    ort = import_onnxruntime()
    array = np.ascontiguousarray(array)
    if fed_as_bits(dtype):
        if device == "cpu":
            bits = np.dtype(f"u{np.dtype(dtype.numpy()).itemsize}")
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                array.view(bits), onnx_element_type=int(dtype)
            )
        if array.any():
            raise KvCacheError(f"Only fresh (all-zero) {dtype.name} caches are allocated on a device.")
        # Fresh caches: rows beyond the resident tokens are never read, so no zero fill.
        return ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), int(dtype), device, 0)
    return ort.OrtValue.ortvalue_from_numpy(array, device, 0)


def host_array(value: Any) -> np.ndarray:
    """A CPU OrtValue as a numpy array; types numpy lacks as their bits (fp8 as uint8)."""
    if isinstance(value, np.ndarray):
        return value
    dtype = ir.DataType(value.element_type())
    if not fed_as_bits(dtype) or value.device_name().lower() != "cpu":
        return value.numpy()
    raw = (ctypes.c_char * value.tensor_size_in_bytes()).from_address(value.data_ptr())
    bits = np.dtype(f"u{np.dtype(dtype.numpy()).itemsize}")
    return np.frombuffer(raw, bits).reshape(value.shape()).copy()


def run_on_host(session: Any, names: list[str], feeds: dict[str, Any]) -> list[np.ndarray]:
    """``session.run(names, feeds)`` on CPU whose outputs of any type come back as numpy
    arrays (:func:`host_array`); ``feeds`` are numpy arrays or OrtValues."""
    ort = import_onnxruntime()
    values = {
        name: feed
        if isinstance(feed, ort.OrtValue)
        else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feed))
        for name, feed in feeds.items()
    }
    return [host_array(value) for value in session.run_with_ort_values(names, values)]
