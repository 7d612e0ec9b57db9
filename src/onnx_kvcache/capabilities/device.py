"""Device facts without heavy dependencies: the GPU's CUDA compute capability.

A listed CUDAExecutionProvider is not proof of a GPU (onnxruntime-gpu lists it on
machines without one), so the driver is asked directly.
"""

from __future__ import annotations

__all__ = ["NO_GPU", "cuda_compute_capability"]

import ctypes
import ctypes.util
import shutil
import subprocess

from onnx_kvcache.errors import Message, Param

#: Why ``check_device=True`` refuses a CUDA target on a machine without a GPU.
NO_GPU = Message(
    Param("check_device", True),
    ": no CUDA GPU found on this machine (without it, the check is left to the GPU that runs the model).",
)

_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


def _from_nvidia_smi(device: int) -> tuple[int, int] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=compute_cap", "--format=csv,noheader", f"--id={device}"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        major, minor = out.splitlines()[0].strip().split(".")
        return int(major), int(minor)
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None


def _from_driver(device: int) -> tuple[int, int] | None:
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    handle, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(handle), device) != 0:
        return None
    if (
        lib.cuDeviceGetAttribute(ctypes.byref(major), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle)
        != 0
    ):
        return None
    if (
        lib.cuDeviceGetAttribute(ctypes.byref(minor), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle)
        != 0
    ):
        return None
    return major.value, minor.value


def cuda_compute_capability(device: int = 0) -> tuple[int, int] | None:
    """``(major, minor)`` of CUDA device ``device``, or None when there is no GPU."""
    return _from_nvidia_smi(device) or _from_driver(device)
