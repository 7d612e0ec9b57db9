"""onnxruntime, imported lazily: the pass needs no runtime, running a model does.

onnxruntime's numpy interface takes and returns numpy's own types only (and fp8 E4M3 as
uint8): tensors of the types ml_dtypes adds (float8, bfloat16) go in and come out as
their bits (:func:`to_ort_value`, :func:`host_array`).
"""

from __future__ import annotations

__all__ = [
    "RUNTIME_LIMITS",
    "RuntimeLimits",
    "create_session",
    "external_data_dir",
    "fed_as_bits",
    "host_array",
    "import_onnxruntime",
    "installed_ort_version",
    "installed_version",
    "ort_error_text",
    "run_on_host",
    "to_ort_value",
    "unloadable_header",
]

import ctypes
import dataclasses
import functools
import importlib.metadata
import os
import re
from collections.abc import Mapping
from types import MappingProxyType, ModuleType
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError, MissingRuntimeError, missing_dependency


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


@dataclasses.dataclass(frozen=True)
class RuntimeLimits:
    """The newest IR version and opsets one onnxruntime release loads."""

    ir_version: int
    opsets: Mapping[str, int]
    """Per domain it knows (``""``: ai.onnx), the newest opset; a domain it does not know (a
    custom one) loads at any version."""


#: What each onnxruntime release loads, read from its own refusals (``Unsupported model IR
#: version: N, max supported IR version: M``; ``Current official support for domain D is till
#: opset M``); ``tests/cache/test_validation.py`` checks the installed release's row against
#: a session. A release without a row, or a model importing a domain its row lacks, is probed:
#: a session of an empty graph with the model's IR version and opsets (onnxruntime imported).
RUNTIME_LIMITS: Mapping[str, RuntimeLimits] = MappingProxyType(
    {
        "1.32.0": RuntimeLimits(
            14,
            MappingProxyType(
                {
                    "": 28,
                    "ai.onnx.ml": 5,
                    "com.microsoft": 1,
                    "com.microsoft.nchwc": 1,
                    "com.microsoft.experimental": 1,
                    "com.ms.internal.nhwc": 28,
                    "ai.onnx.training": 1,
                    "ai.onnx.preview.training": 1,
                    "org.pytorch.aten": 1,
                }
            ),
        ),
    }
)


def _past(ir_version: int, opsets: Mapping[str, int], limits: RuntimeLimits) -> list[tuple[str, int, int]]:
    """What ``limits`` do not load: (what, the model's, the newest loaded)."""
    found = [("IR version", ir_version, limits.ir_version)] if ir_version > limits.ir_version else []
    for domain, version in sorted(opsets.items()):
        newest = limits.opsets.get(domain)
        if newest is not None and version > newest:
            found.append((f"{domain or 'ai.onnx'} opset", version, newest))
    return found


_PROBE_REFUSALS = (
    (re.compile(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)"), "IR version"),
    (re.compile(r"Opset (\d+) is under development.* for domain (\S+) is till opset (\d+)", re.S), "opset"),
)


@functools.lru_cache(maxsize=32)
def _probed(ir_version: int, opsets: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int, int], ...]:
    """What the installed onnxruntime refuses of a model header, read from its refusal of an empty
    graph with that header (nothing it does not name: another failure is not the header's)."""
    import onnx

    ort = import_onnxruntime()
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    proto = onnx.helper.make_model(
        onnx.helper.make_graph([], "probe", [x], [x]),
        opset_imports=[onnx.helper.make_opsetid(domain, version) for domain, version in opsets],
    )
    proto.ir_version = ir_version
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own exception types
        text = str(e)
        for pattern, what in _PROBE_REFUSALS:
            found = pattern.search(text)
            if found is None:
                continue
            if what == "IR version":
                return (("IR version", int(found[1]), int(found[2])),)
            domain = found[2].rstrip(".")
            return ((f"{domain} opset", int(found[1]), int(found[3])),)
    return ()


def unloadable_header(ir_version: int, opsets: Mapping[str, int]) -> str | None:
    """Why the installed onnxruntime refuses a model of this IR version and these opsets (the
    newest it loads named), or None: it loads them, or no onnxruntime is installed."""
    version = installed_ort_version()
    if version is None:
        return None
    limits = RUNTIME_LIMITS.get(version)
    if limits is not None and all(domain in limits.opsets for domain in opsets if domain != "ai.onnx"):
        past = _past(ir_version, opsets, limits)
    else:
        try:
            past = list(_probed(ir_version, tuple(sorted(opsets.items()))))
        except MissingRuntimeError:  # installed but not importable: nothing to ask
            return None
    if not past:
        return None
    what, value, newest = past[0]
    return (
        f"its {what} is {value}, and the installed onnxruntime {version} loads at most {newest}: "
        f"it refuses the model, and would refuse a model written from it. Export the model for {what} "
        f"{newest} or below, or install an onnxruntime that loads it"
    )


#: Where onnxruntime's messages name its own source: ``/onnxruntime_src/.../model.cc:256 ``
#: (the build machine's path and line), then the C++ function's signature.
_ORT_SOURCE = re.compile(r"(?:/[\w.-]+)*/onnxruntime_src/\S+:\d+ ")
_ORT_STATUS = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")


def ort_error_text(error: BaseException) -> str:
    """onnxruntime's message without what only its developers read: the status prefix, the
    source file and line of its build machine, the C++ signature after it."""
    text = _ORT_STATUS.sub("", str(error).strip())
    while (found := _ORT_SOURCE.search(text)) is not None:
        rest, end = text[found.end() :], 0
        if "(" in rest.split(" ", 1)[0] or "::" in rest.split("(", 1)[0]:  # a signature follows
            depth, start = 0, rest.find("(")
            for i in range(start, len(rest)):
                depth += {"(": 1, ")": -1}.get(rest[i], 0)
                if depth == 0:
                    end = i + 1
                    break
            if rest[end : end + 6] == " const":
                end += 6
            if rest[end:].lstrip().startswith("[with ") and "]" in rest[end:]:  # a template's types
                end = rest.index("]", end) + 1
        head = text[: found.start()]
        text = head + (" " if head.endswith(":") else "") + rest[end:].lstrip()
    return text.strip()


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


#: ONNX's 4-bit types: two values a byte in an OrtValue (low nibble first), one a byte in numpy.
_NIBBLES = frozenset({ir.DataType.INT4, ir.DataType.UINT4})


def _nibble_value(array: np.ndarray, dtype: ir.DataType) -> Any:
    """A CPU OrtValue of a 4-bit type holding ``array``'s values, packed two a byte."""
    ort_value = import_onnxruntime().OrtValue
    value = ort_value.ortvalue_from_shape_and_type(list(array.shape), int(dtype), "cpu", 0)
    codes = np.asarray(array).astype(np.int8).reshape(-1).view(np.uint8) & 0x0F
    codes = np.concatenate([codes, np.zeros(codes.size % 2, np.uint8)])
    packed = np.ascontiguousarray(codes[0::2] | (codes[1::2] << 4))
    ctypes.memmove(value.data_ptr(), packed.ctypes.data, packed.nbytes)
    return value


def _nibble_array(raw: np.ndarray, shape: list[int], dtype: ir.DataType) -> np.ndarray:
    """The values of a 4-bit OrtValue's bytes ``raw``, one a numpy element (ml_dtypes' type)."""
    codes = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(-1)[: int(np.prod(shape))]
    values = (codes.astype(np.int8) ^ 8) - 8 if dtype == ir.DataType.INT4 else codes
    return values.astype(dtype.numpy()).reshape(shape)


def to_ort_value(array: np.ndarray, dtype: ir.DataType, device: str = "cpu") -> Any:
    """An OrtValue of element type ``dtype`` on ``device`` (float8/bf16 arrays as their bits,
    4-bit ones packed)."""
    ort = import_onnxruntime()
    array = np.ascontiguousarray(array)
    if dtype in _NIBBLES and device == "cpu":
        return _nibble_value(array, dtype)
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
    if dtype in _NIBBLES:
        return _nibble_array(np.frombuffer(raw, np.uint8), value.shape(), dtype)
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
