"""The CUDA check: onnxruntime's CUDA kernels against the CUDA-rule emulation, and what a
quantized cache buys. One script, one device call, a few minutes.

    pip install onnxruntime-gpu && pip install .   # on the GPU machine, from this repository
    python benchmarks/cuda_check.py [--quick] [--json cuda_check.json] [--overwrite]
    python benchmarks/cuda_check.py --dry-run      # the plan, on any machine

1. **Preflight.** Prints the GPU, its compute capability, the driver and onnxruntime versions;
   without a CUDA GPU or a working CUDAExecutionProvider (onnxruntime-gpu lists it on
   machines without a GPU: a session must run and a tensor be allocated on the device) it
   exits 2 with one line naming what is missing and how to install it.
2. **Kernel vs emulation.** Builds the bundled decoder (4 layers, 8 query / 2 KV heads) in
   float16 and bfloat16 with head sizes 64 and 128, and an onnxruntime-genai folder (fp16,
   converted with ``convert_model`` as a user does); converts each to fp8, int8 and int4,
   per tensor and per channel where the capability table's CUDA row lists them, with scales
   calibrated on CPU (a bf16 model calibrates through its float32 computation). Each runs on
   CUDAExecutionProvider alone (``session.disable_cpu_ep_fallback``; if onnxruntime refuses
   that, the run goes on and the nodes placed on CPU are listed), a 256-token prefill then
   64 teacher-forced decode steps, batch 1 and 4, in two cache layouts: *growing* (present =
   past + new, a new tensor each step) and *shared* (past and present one preallocated
   buffer, as onnxruntime-genai's ``past_present_share_buffer``, the layout CUDA's XQA decode
   kernel needs). The profile of the first two runs says where every node ran: each
   attention node must be on CUDA. Every step's logits are compared with the same model under
   the CUDA-rule emulation on CPU (``KvCacheEmulationPass``; batch 1 is row 0 of batch 4):
   max absolute and relative error, top-1 agreement; in the growing layout, the stored cache
   codes too.
3. **What the cache buys.** A decoder with Llama-3-8B-shaped layers (hidden 4096, 32 query /
   8 KV heads of 128, MLP 14336; 4 layers, 32000-token vocabulary, tiled random weights in an
   external data file) converted to fp8, int8 and int4 per tensor beside its float16 cache:
   decode tokens/s and device memory in use at contexts of 4k, 16k and 64k tokens, batch 1
   and 8, shared-buffer layout (the cache is preallocated and its rows are not computed:
   decode speed does not depend on their values).
4. **The capability table on this device.** Every (operator, format, granularity) the table's
   CUDA rows describe is set against what ran here (the runs above; a PagedAttention decoder
   per format when the schema has PagedAttention, compared with its CPU reference), for this
   onnxruntime version and compute capability; ``onnx-kvcache doctor``'s session checks are
   added. Contradictions are listed.

What the kernel's own arithmetic explains (the bound each step is held to):

- float cache: ``2 * L * eps * max|logit|`` (``L`` layers, ``eps`` the unit roundoff of the
  model's dtype: 2^-11 fp16, 2^-8 bf16): accumulating in another order (flash attention's
  blockwise softmax against a naive one, fp16 accumulators, fused kernels) rounds each
  layer's residual stream and the logits about one more or one fewer time;
- quantized cache: that bound, or the float cache's own difference on this device when
  larger, plus twice the quantization error the emulation shows at that step (quantized
  against float cache, both on CPU): a value within rounding noise of a code boundary (a
  tie, or fp16 pre-rounding) may take the neighbouring code, one step off instead of at most
  half a step, which at most doubles the quantization error where it happens;
- stored codes: at most one step apart, and no more of them than rounding noise can move
  across a boundary (``2 * L * eps`` times each code's distance in steps from zero, summed).

Anything beyond is flagged (``FLAG``): a rule the emulation gets wrong (scale meaning,
rounding, clamping, which tokens are attended before quantization), or a kernel bug.

The JSON report is written after each phase (``"complete": false`` until the last), so a run
stopped by a time limit or Ctrl-C keeps what ended. Exit status: 0 nothing flagged, 1 a run
flagged or failed or a table contradiction, 2 this machine or ``--json`` cannot run it (one
line), 130 interrupted (Ctrl-C, or SIGTERM: the working files are removed).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: Exit status of a machine that cannot run the check (as the CLI's bad input).
NO_DEVICE = 2
EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
GRANULARITIES = ("per_tensor", "per_channel")
FORMATS = ("fp8", "int8", "int4")
_CUDA = "CUDAExecutionProvider"
_CPU = "CPUExecutionProvider"


# --- the plan --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One decoder of the kernel-vs-emulation phase."""

    name: str
    dtype: str
    head_size: int
    genai: bool = False
    num_layers: int = 4
    num_heads: int = 8
    kv_num_heads: int = 2
    vocab_size: int = 512

    def overrides(self, max_position: int) -> dict[str, Any]:
        hidden = self.num_heads * self.head_size
        return {
            "num_layers": self.num_layers,
            "hidden_size": hidden,
            "num_heads": self.num_heads,
            "kv_num_heads": self.kv_num_heads,
            "head_size": self.head_size,
            "intermediate_size": 2 * hidden,
            "vocab_size": self.vocab_size,
            "max_position": max_position,
            "dtype": self.dtype,
            "symbolic_cache_dim": self.genai,
        }


@dataclasses.dataclass(frozen=True)
class Variant:
    """A cache: float (``fmt`` None) or a format and granularity, rotated or not
    (docs/rotation.md: the operators a rotation adds must run on the device too)."""

    fmt: str | None
    granularity: str = "per_tensor"
    rotation: str = "none"

    @property
    def label(self) -> str:
        if self.fmt is None:
            return "float"
        return f"{self.fmt} {self.granularity}" + ("" if self.rotation == "none" else f" +{self.rotation}")

    @property
    def cell(self) -> str:
        """The capability cell's granularity, a rotated cache's rotation after a ``+``."""
        return self.granularity + ("" if self.rotation == "none" else f"+{self.rotation}")


@dataclasses.dataclass(frozen=True)
class SpeedSpec:
    """The decoder of the speed phase (Llama-3-8B-shaped layers)."""

    num_layers: int = 4
    hidden_size: int = 4096
    num_heads: int = 32
    kv_num_heads: int = 8
    head_size: int = 128
    intermediate_size: int = 14336
    vocab_size: int = 32000


@dataclasses.dataclass(frozen=True)
class Plan:
    models: tuple[ModelSpec, ...]
    variants: dict[str, tuple[Variant, ...]]
    """Per model name, the caches it is converted to (float first)."""
    batches: tuple[int, ...]
    layouts: tuple[str, ...]
    prompt_len: int
    decode_steps: int
    speed: SpeedSpec
    speed_variants: tuple[Variant, ...]
    contexts: tuple[int, ...]
    speed_batches: tuple[int, ...]
    speed_steps: int
    paged: bool


#: The rotated caches the check adds (calibration's default for int4: keys and values turned).
ROTATED = (("int4", "keys_and_values"),)


def cuda_variants(granularities: Sequence[str] = GRANULARITIES) -> tuple[Variant, ...]:
    """Float, then every format x granularity the capability table's CUDA GQA row lists
    (unrotated), then :data:`ROTATED`'s formats rotated, at the last of ``granularities``,
    where the row runs a rotated cache."""
    from onnx_kvcache.capabilities.table import get_capabilities

    row = get_capabilities("cuda")
    found = [Variant(None)]
    for fmt in FORMATS:
        support = row.formats.get(fmt)
        if support is not None:
            found += [Variant(fmt, g) for g in granularities if g in support.granularities]
    for fmt, rotation in ROTATED if row.rotation else ():
        support = row.formats.get(fmt)
        if support is not None and granularities[-1] in support.granularities:
            found.append(Variant(fmt, granularities[-1], rotation))
    return tuple(found)


def make_plan(quick: bool = False) -> Plan:
    """What the check runs: ``quick`` fits 2 minutes, the default 5 (H100/H200)."""
    every = cuda_variants()
    models: tuple[ModelSpec, ...]
    if quick:
        models = (
            ModelSpec("fp16-h128", "float16", 128),
            ModelSpec("bf16-h64", "bfloat16", 64),
            ModelSpec("genai-fp16-h64", "float16", 64, genai=True),
        )
        some = tuple(v for v in every if v.fmt is None or v.granularity == "per_channel")
        variants = {m.name: some for m in models}
        variants["bf16-h64"] = every
        return Plan(
            models,
            variants,
            (1, 4),
            ("growing", "shared"),
            256,
            16,
            SpeedSpec(),
            cuda_variants(("per_tensor",)),
            (4096, 16384),
            (1, 8),
            8,
            True,
        )
    models = (
        ModelSpec("fp16-h64", "float16", 64),
        ModelSpec("fp16-h128", "float16", 128),
        ModelSpec("bf16-h64", "bfloat16", 64),
        ModelSpec("bf16-h128", "bfloat16", 128),
        ModelSpec("genai-fp16-h128", "float16", 128, genai=True),
    )
    return Plan(
        models,
        {m.name: every for m in models},
        (1, 4),
        ("growing", "shared"),
        256,
        64,
        SpeedSpec(),
        cuda_variants(("per_tensor",)),
        (4096, 16384, 65536),
        (1, 8),
        16,
        True,
    )


def describe(plan: Plan) -> str:
    """The plan in words: models, formats, what is compared (``--dry-run``)."""
    lines = [
        "cuda_check plan",
        "1. preflight: GPU, compute capability, driver, onnxruntime; CUDA session + allocation",
    ]
    lines.append(
        f"2. kernel vs CUDA-rule emulation: {plan.prompt_len}-token prefill + "
        f"{plan.decode_steps} decode steps, "
        f"batch {' and '.join(map(str, plan.batches))}, layouts {', '.join(plan.layouts)}"
    )
    for m in plan.models:
        kind = "onnxruntime-genai folder (convert_model)" if m.genai else "bundled decoder"
        caches = ", ".join(v.label for v in plan.variants[m.name])
        lines.append(
            f"   {m.name}: {kind}, {m.dtype}, {m.num_layers} layers, {m.num_heads}/{m.kv_num_heads} heads "
            f"of {m.head_size}; caches: {caches}"
        )
    lines.append(
        "   compared per step: max |logit diff|, relative, top-1 agreement; stored codes (growing layout)"
    )
    lines.append(
        "   against: fp16/bf16 rounding bound (float); + 2x the emulated quantization error (quantized)"
    )
    s = plan.speed
    lines.append(
        f"3. speed: {s.num_layers} layers of hidden {s.hidden_size}, {s.num_heads}/{s.kv_num_heads} heads of "
        f"{s.head_size}, MLP {s.intermediate_size}, vocab {s.vocab_size}, float16; caches "
        f"{', '.join(v.label for v in plan.speed_variants)}; contexts "
        f"{', '.join(f'{c // 1024}k' for c in plan.contexts)}, batch "
        f"{' and '.join(map(str, plan.speed_batches))}; {plan.speed_steps} timed decode steps; "
        "tokens/s and device memory in use"
    )
    paged = "PagedAttention decoder per format vs its CPU reference, " if plan.paged else ""
    lines.append(f"4. capability table: {paged}every CUDA row's cell vs what ran, doctor's session checks")
    return "\n".join(lines)


# --- preflight -------------------------------------------------------------------------------


@dataclasses.dataclass
class DeviceInfo:
    gpu: str | None = None
    compute_capability: tuple[int, int] | None = None
    driver: str | None = None
    ort_version: str | None = None
    ort_package: str | None = None

    def line(self) -> str:
        cc = "{}.{}".format(*self.compute_capability) if self.compute_capability else "?"
        ort = f"{self.ort_package} {self.ort_version}" if self.ort_version else "onnxruntime not installed"
        return f"GPU: {self.gpu or 'none found'}; compute capability {cc}; driver {self.driver or '?'}; {ort}"


def _gpu_query(fields: str, *formats: str) -> str | None:
    """GPU 0's first CSV line of ``nvidia-smi --query-gpu=fields`` (None: no nvidia-smi, or it
    failed)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={fields}", f"--format={','.join(('csv', 'noheader', *formats))}", "--id=0"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        return out.splitlines()[0]
    except (subprocess.SubprocessError, OSError, IndexError):
        return None


def _nvidia_smi() -> tuple[str, tuple[int, int] | None, str] | None:
    line = _gpu_query("name,compute_cap,driver_version")
    if line is None:
        return None
    try:
        name, cap, driver = (part.strip() for part in line.split(","))
        major, minor = cap.split(".")
        return name, (int(major), int(minor)), driver
    except ValueError:
        return None


def _libcuda() -> tuple[str, tuple[int, int] | None, str] | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    except OSError:
        return None
    device, version = ctypes.c_int(), ctypes.c_int()
    if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(device), 0) != 0:
        return None
    name = ctypes.create_string_buffer(256)
    lib.cuDeviceGetName(name, 256, device)
    lib.cuDriverGetVersion(ctypes.byref(version))
    from onnx_kvcache.capabilities.device import cuda_compute_capability

    v = version.value
    return (
        name.value.decode(errors="replace"),
        cuda_compute_capability(),
        f"CUDA {v // 1000}.{v % 1000 // 10}",
    )


def device_info() -> DeviceInfo:
    """What this machine has: the GPU (nvidia-smi, else the driver library) and onnxruntime."""
    from onnx_kvcache.model_io._sessions import installed_ort_version

    info = DeviceInfo()
    found = _nvidia_smi() or _libcuda()
    if found is not None:
        info.gpu, info.compute_capability, info.driver = found
    info.ort_version = installed_ort_version()
    if info.ort_version is not None:
        import importlib.metadata

        for dist in ("onnxruntime-gpu", "onnxruntime", "ort-nightly-gpu", "ort-nightly"):
            try:
                importlib.metadata.version(dist)
                info.ort_package = dist
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return info


def _tiny_cuda_run() -> str | None:
    """None when a session runs on CUDAExecutionProvider alone and a tensor lives on the
    device; else what failed, in one line."""
    import onnx_ir as ir

    from onnx_kvcache.model_io._sessions import import_onnxruntime

    ort = import_onnxruntime()
    x = ir.val("x", ir.DataType.FLOAT16, [4])
    y = ir.Value(name="y")
    graph = ir.Graph([x], [y], nodes=[ir.Node("", "Add", [x, x], outputs=[y])], opset_imports={"": 21})
    y.dtype, y.shape = ir.DataType.FLOAT16, ir.Shape([4])
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        data = ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()
        session = ort.InferenceSession(data, options, providers=[_CUDA])
        if _CUDA not in session.get_providers():
            return f"the session fell back to {session.get_providers()}"
        value = ort.OrtValue.ortvalue_from_numpy(np.ones(4, np.float16), "cuda", 0)
        binding = session.io_binding()
        binding.bind_ortvalue_input("x", value)
        binding.bind_output("y", "cuda")
        session.run_with_iobinding(binding)
        if float(binding.get_outputs()[0].numpy()[0]) != 2.0:
            return "a CUDA session computed 1 + 1 != 2"
    except Exception as error:  # onnxruntime raises several unrelated types
        return str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    return None


def missing(
    info: DeviceInfo, providers: Sequence[str] | None, cuda_run: Callable[[], str | None]
) -> str | None:
    """The one line saying what this machine lacks for the check, or None."""
    if info.ort_version is None:
        return (
            "onnxruntime is not installed: pip install onnxruntime-gpu (never beside onnxruntime), "
            "then pip install ."
        )
    if providers is not None and _CUDA not in providers and info.gpu is None:
        return (
            f"no CUDA GPU (nvidia-smi and the driver library find none) and {info.ort_package} "
            f"{info.ort_version} has no CUDAExecutionProvider: on a machine with an NVIDIA GPU and its "
            "driver, pip uninstall -y onnxruntime && pip install onnxruntime-gpu"
        )
    if providers is not None and _CUDA not in providers:
        return (
            f"{info.ort_package} {info.ort_version} has no CUDAExecutionProvider: "
            "pip uninstall -y onnxruntime && pip install onnxruntime-gpu"
        )
    if info.gpu is None:
        return (
            "no CUDA GPU: nvidia-smi and the driver library (libcuda) find none; run on a machine with an "
            "NVIDIA GPU and its driver (onnxruntime-gpu lists CUDAExecutionProvider without one)"
        )
    failed = cuda_run()
    if failed is not None:
        return (
            f"CUDAExecutionProvider does not run here ({failed}); install the CUDA 12 and cuDNN 9 libraries "
            "(pip install 'onnxruntime-gpu[cuda,cudnn]') and a driver that supports them"
        )
    return None


def preflight(echo: Callable[[str], None] = print) -> DeviceInfo:
    """Print what the machine has; exit 2 with one line when it cannot run the check."""
    info = device_info()
    echo(info.line())
    providers = None
    if info.ort_version is not None:
        try:
            import onnxruntime

            providers = list(onnxruntime.get_available_providers())
        except ImportError:
            info.ort_version = None
    problem = missing(info, providers, _tiny_cuda_run)
    if problem is not None:
        print(f"cuda_check: {problem}", file=sys.stderr)
        raise SystemExit(NO_DEVICE)
    return info


# --- running a decoder on one device -----------------------------------------------------------


def _host_float(value: Any) -> np.ndarray:
    """A CPU OrtValue (or array) of any float type as float32."""
    import ml_dtypes
    import onnx_ir as ir

    from onnx_kvcache.model_io._sessions import host_array

    array = host_array(value)
    if not isinstance(value, np.ndarray) and ir.DataType(value.element_type()) == ir.DataType.BFLOAT16:
        array = array.view(ml_dtypes.bfloat16)
    return np.asarray(array, np.float32)


@dataclasses.dataclass
class Placement:
    """Where the profiled runs placed the nodes."""

    fallback_disabled: bool
    note: str
    attention: dict[str, str]
    """Attention node -> provider."""
    on_cpu: dict[str, int]
    """op type -> nodes of it placed on the CPU."""
    rotation: dict[str, str] = dataclasses.field(default_factory=dict)
    """A rotated cache's added compute nodes (RotaryEmbedding, the MatMuls by ``H``) -> provider."""

    def attention_on(self, provider: str) -> bool:
        """Every attention node, and every node a rotation adds, ran on ``provider``."""
        return (
            bool(self.attention)
            and all(p == provider for p in self.attention.values())
            and all(p == provider for p in self.rotation.values())
        )


def read_placement(profile: str | os.PathLike, fallback_disabled: bool, note: str) -> Placement:
    """Node placement from an onnxruntime profile (its ``Node`` events name the provider)."""
    events = json.loads(pathlib.Path(profile).read_text())
    attention: dict[str, str] = {}
    rotation: dict[str, str] = {}
    on_cpu: dict[str, int] = {}
    seen: set[str] = set()
    for event in events:
        args = event.get("args") or {}
        name = str(event.get("name", ""))
        if event.get("cat") != "Node" or not name.endswith("_kernel_time") or "provider" not in args:
            continue
        node, op = name.removesuffix("_kernel_time"), args.get("op_name", "?")
        if op in ("GroupQueryAttention", "PagedAttention"):
            attention[node] = args["provider"]
        if op == "RotaryEmbedding" or (op == "MatMul" and "/rotation/" in node):
            rotation[node] = args["provider"]
        if args["provider"] == _CPU and node not in seen:
            on_cpu[op] = on_cpu.get(op, 0) + 1
        seen.add(node)
    return Placement(fallback_disabled, note, attention, on_cpu, rotation)


@dataclasses.dataclass
class Run:
    """Logits of every step (``[S + 1]`` arrays ``[B, V]``: the prompt's last position, then
    each decode step), the stored caches at the end (growing layout), the seconds taken."""

    logits: list[np.ndarray]
    codes: dict[tuple[int, str], np.ndarray] | None
    seconds: float


class DeviceDecoder:
    """A dense GQA decoder on one provider alone, its caches bound on the device.

    ``device`` is ``cuda`` (CUDAExecutionProvider, CPU fallback disabled when onnxruntime
    accepts it) or ``cpu`` (the same code on the CPU kernel: what the tests run).
    """

    def __init__(
        self,
        model: Any,
        device: str,
        base_dir: str | os.PathLike | None = None,
        profile_dir: str | None = None,
    ) -> None:
        import onnx_ir as ir

        from onnx_kvcache.model_io._sessions import external_data_dir, import_onnxruntime
        from onnx_kvcache.runtime._cache import discover_cache_bindings
        from onnx_kvcache.runtime._decoder_session import logits_output

        self.ort = import_onnxruntime()
        self.device = device
        self.bindings = discover_cache_bindings(model)
        self.logits_name = logits_output(model)[0]
        self.cache_dtype = {b.past: b.dtype for b in self.bindings}
        base = base_dir or external_data_dir(model)
        data = ir.to_proto(model).SerializeToString()
        self.profiling = profile_dir is not None
        disable = device == "cuda"
        note = ""
        try:
            self.session = self._session(data, base, profile_dir, disable)
        except Exception as error:  # onnxruntime raises several unrelated types
            if not disable or "fallback" not in str(error).lower():
                raise
            note = str(error).strip().splitlines()[0][:200]
            self.session = self._session(data, base, profile_dir, False)
            disable = False
        self.fallback_disabled, self.fallback_note = disable, note
        self.placement: Placement | None = None
        self.zero_note = ""

    def _session(self, data: bytes, base: Any, profile_dir: str | None, disable: bool) -> Any:
        options = self.ort.SessionOptions()
        options.log_severity_level = 3
        if base is not None:
            options.add_session_config_entry(
                "session.model_external_initializers_file_folder_path", os.fspath(base)
            )
        if disable:
            options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        if profile_dir is not None:
            options.enable_profiling = True
            options.profile_file_prefix = os.path.join(profile_dir, "cuda_check")
        providers = [_CUDA] if self.device == "cuda" else [_CPU]
        return self.ort.InferenceSession(data, options, providers=providers)

    def empty(self, binding: Any, batch: int, length: int, zero: bool = True) -> Any:
        """A cache OrtValue ``[batch, kv, length, last_dim]`` on the device, all zeros as
        onnxruntime-genai allocates its caches (a shared buffer's rows beyond the context are
        then zeros, not leftover bits: an fp8 NaN there would flag a kernel that reads them
        harmlessly in genai); ``zero=False``: left as allocated (the speed phase)."""
        from onnx_kvcache.model_io._sessions import fed_as_bits, to_ort_value

        shape = (batch, binding.kv_num_heads, length, binding.last_dim)
        if self.device == "cuda" and (fed_as_bits(binding.dtype) or not zero):
            value = self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), int(binding.dtype), "cuda", 0)
            if zero and not fill_zeros(self.ort, value, shape, binding.dtype):
                self.zero_note = "caches not zeroed (this onnxruntime copies no tensor to the device)"
            return value
        return to_ort_value(np.zeros(shape, binding.dtype.numpy()), binding.dtype, self.device)

    def step(
        self, ids: np.ndarray, total: int, caches: dict[str, Any], shared: bool, to_host: bool
    ) -> list[Any]:
        """One run: ``ids`` ``[B, S]`` at a context of ``total`` tokens; returns the logits
        and, unless ``shared``, the presents (on the host when ``to_host``)."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids, np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((ids.shape[0], total), np.int64))
        for b in self.bindings:
            binding.bind_ortvalue_input(b.past, caches[b.past])
        binding.bind_output(self.logits_name, "cpu")
        for b in self.bindings:
            if shared:
                binding.bind_ortvalue_output(b.present, caches[b.past])
            else:
                binding.bind_output(b.present, "cpu" if to_host else self.device)
        self.session.run_with_iobinding(binding)
        return list(binding.get_outputs())

    def run(self, prompt: np.ndarray, decode: np.ndarray, shared: bool, keep_codes: bool = False) -> Run:
        """A prefill of ``prompt`` ``[B, T]`` then one decode step per column of ``decode``."""
        from onnx_kvcache.model_io._sessions import host_array

        batch, length = prompt.shape
        capacity = length + decode.shape[1] if shared else 0
        caches = {b.past: self.empty(b, batch, capacity) for b in self.bindings}
        chunks = [prompt] + [decode[:, i : i + 1] for i in range(decode.shape[1])]
        logits, total, codes = [], 0, None
        start = time.perf_counter()
        for i, ids in enumerate(chunks):
            total += ids.shape[1]
            last = i == len(chunks) - 1
            outputs = self.step(ids, total, caches, shared, to_host=last and keep_codes)
            logits.append(_host_float(outputs[0])[:, -1])
            if not shared:
                caches = {b.past: out for b, out in zip(self.bindings, outputs[1:])}
            if self.profiling and i == 1:  # the prefill and a decode step
                self.placement = read_placement(
                    self.session.end_profiling(), self.fallback_disabled, self.fallback_note
                )
                self.profiling = False
        seconds = time.perf_counter() - start
        if keep_codes and not shared:
            codes = {(b.layer_id, b.kind): host_array(caches[b.past]) for b in self.bindings}
        return Run(logits, codes, seconds)


def fill_zeros(ort: Any, value: Any, shape: Sequence[int], dtype: Any) -> bool:
    """Copy an all-zero host tensor of ``dtype`` into ``value`` (any device): whether it was
    done (``OrtValue.update_inplace`` of an OrtValue, else ``onnxruntime.copy_tensors``)."""
    from onnx_kvcache.model_io._sessions import to_ort_value

    host = to_ort_value(np.zeros(tuple(shape), dtype.numpy()), dtype, "cpu")
    try:
        value.update_inplace(host)
        return True
    except Exception:  # older onnxruntime: numpy sources only (no fp8/bf16 numpy type)
        pass
    try:
        ort.copy_tensors([host], [value])
        return True
    except Exception:  # not in this onnxruntime, or no transfer between these devices
        return False


# --- the CPU reference -------------------------------------------------------------------------


def emulated(model: Any, rule: str) -> Any:
    """A copy of ``model`` in which every quantized GQA node runs as the ``rule`` kernel
    computes it (``KvCacheEmulationPass``, forced onto int8/int4 nodes under the cpu rule too,
    whose own kernel would otherwise run), bf16 computed in float32."""
    from onnx_kvcache.cache.sites import find_gqa_sites
    from onnx_kvcache.passes.bfloat16_to_float import Bfloat16ToFloatPass
    from onnx_kvcache.passes.kv_cache_emulation import KvCacheEmulationPass, needs_emulation

    class Forced(KvCacheEmulationPass):
        def sites(self, model: Any) -> list:
            return [
                s
                for s in find_gqa_sites(model)
                if s.cache_format is not None or needs_emulation(s, self.semantics)
            ]

    copy = model.clone()
    Bfloat16ToFloatPass()(copy)
    Forced(rule)(copy)
    return copy


def reference_run(model: Any, rule: str, prompt: np.ndarray, decode: np.ndarray) -> Run:
    """``model`` under ``rule``'s emulation on CPU: logits of every step and the stored codes
    (the emulated caches hold dequantized values, requantized with the model's scales)."""
    from onnx_kvcache import KvCacheRunner
    from onnx_kvcache.runtime._cache import discover_cache_bindings

    start = time.perf_counter()
    runner = KvCacheRunner(emulated(model, rule), providers=_CPU, semantics=rule)
    logits = [runner.prefill(prompt)[:, -1]]
    for i in range(decode.shape[1]):
        logits.append(runner.step(decode[:, i].tolist()))
    codes = {}
    for b in discover_cache_bindings(model):
        values = runner.cache_values(b.layer_id, b.kind)
        codes[(b.layer_id, b.kind)] = (
            values if b.format is None or b.scale is None else b.format.quantize(values, b.scale)
        )
    return Run(logits, codes, time.perf_counter() - start)


# --- comparing ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    """One kernel run against its reference."""

    model: str
    cache: str
    batch: int
    layout: str
    max_abs: float
    max_rel: float
    top1: float
    worst_ratio: float
    """max over steps of |diff| / bound (<= 1: explained)."""
    flagged_steps: list[int]
    code_diff_fraction: float | None = None
    code_max_steps: float | None = None
    code_expected_fraction: float | None = None
    code_flag: bool = False
    placement_ok: bool | None = None
    note: str = ""

    @property
    def flagged(self) -> bool:
        return bool(self.flagged_steps) or self.code_flag or self.placement_ok is False

    def verdict(self) -> str:
        return "FLAG" if self.flagged else "ok"


def step_errors(
    kernel: Sequence[np.ndarray], reference: Sequence[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Per step, max |kernel - reference| and max |reference|."""
    diff = np.array([float(np.abs(k - r).max()) for k, r in zip(kernel, reference)])
    scale = np.array([float(np.abs(r).max()) for r in reference])
    return diff, scale


def float_bound(scale: np.ndarray, dtype: str, num_layers: int) -> np.ndarray:
    """What reordered fp16/bf16 arithmetic explains: ``2 * L * eps * max|logit|``."""
    return 2 * num_layers * EPS[dtype] * scale


def quantized_bound(
    float_part: np.ndarray, float_floor: np.ndarray | None, quant_error: np.ndarray
) -> np.ndarray:
    """The float bound (or the float cache's measured difference, when larger) plus twice
    the emulated quantization error of the step."""
    base = float_part if float_floor is None else np.maximum(float_part, float_floor)
    return base + 2 * quant_error


def code_levels(fmt: Any, codes: np.ndarray, head_size: int) -> np.ndarray:
    """Stored codes as signed step positions: integers for int8/int4, the ordinal of the
    fp8 value (sign and magnitude bits) for fp8."""
    if fmt.is_float:
        bits = np.asarray(codes).view(np.uint8).astype(np.int32)
        return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F).astype(np.float64)
    return fmt.dequantize(codes, np.ones(1, np.float32), head_size).astype(np.float64)


def compare_codes(
    fmt: Any, kernel: np.ndarray, reference: np.ndarray, head_size: int, dtype: str, num_layers: int
) -> tuple[float, float, float, bool]:
    """Fraction of codes that differ, the largest difference in steps, the fraction rounding
    noise explains, and whether to flag (a difference over one step, or too many)."""
    a, b = code_levels(fmt, kernel, head_size), code_levels(fmt, reference, head_size)
    steps = np.abs(a - b)
    fraction = float(np.mean(steps > 0))
    # A code moves when noise of relative size 2*L*eps carries its value across a boundary:
    # the chance grows with its distance from zero in steps (fp8: the mantissa's 8..16).
    magnitude = np.minimum(np.abs(b), 16.0) if fmt.is_float else np.abs(b)
    expected = float(np.mean(np.minimum(1.0, 2 * num_layers * EPS[dtype] * (magnitude + 1))))
    worst = float(steps.max()) if steps.size else 0.0
    return fraction, worst, expected, worst > 1 or fraction > 2 * expected + 1e-3


def compare(
    kernel: Run,
    reference: Run,
    *,
    model: ModelSpec,
    variant: Variant,
    batch: int,
    layout: str,
    float_reference: Run | None = None,
    float_floor: np.ndarray | None = None,
    fmt: Any = None,
    placement: Placement | None = None,
    provider: str = _CUDA,
) -> Comparison:
    """Judge one kernel run against the reference (rows ``[:batch]``); see the module."""
    ref = [r[:batch] for r in reference.logits]
    diff, scale = step_errors(kernel.logits, ref)
    bound = float_bound(scale, model.dtype, model.num_layers)
    if variant.fmt is not None and float_reference is not None:
        quant_error, _ = step_errors(ref, [r[:batch] for r in float_reference.logits])
        bound = quantized_bound(bound, float_floor, quant_error)
    ratio = diff / np.maximum(bound, 1e-30)
    top1 = float(np.mean([np.mean(k.argmax(-1) == r.argmax(-1)) for k, r in zip(kernel.logits, ref)]))
    result = Comparison(
        model.name,
        variant.label,
        batch,
        layout,
        float(diff.max()),
        float((diff / np.maximum(scale, 1e-30)).max()),
        top1,
        float(ratio.max()),
        [int(i) for i in np.nonzero(ratio > 1)[0]],
    )
    if kernel.codes is not None and reference.codes is not None and fmt is not None:
        worst = (0.0, 0.0, 0.0, False)
        for key, codes in kernel.codes.items():
            found = compare_codes(
                fmt, codes, reference.codes[key][:batch], model.head_size, model.dtype, model.num_layers
            )
            worst = tuple(max(x, y) for x, y in zip(worst, found))  # type: ignore[assignment]
        result.code_diff_fraction, result.code_max_steps, result.code_expected_fraction = worst[:3]
        result.code_flag = bool(worst[3])
    if placement is not None:
        result.placement_ok = placement.attention_on(provider)
        if placement.on_cpu and provider != _CPU:
            result.note = "on CPU: " + ", ".join(f"{n} {op}" for op, n in sorted(placement.on_cpu.items()))
    return result


# --- the kernel-vs-emulation phase ---------------------------------------------------------------


def token_batches(
    batch: int, prompt_len: int, decode_steps: int, vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """``batch`` windows of the bundled corpus (byte ids): prompts and the teacher-forced
    decode tokens that follow them."""
    from onnx_kvcache.scales.data import corpus_byte_ids

    ids = np.asarray(corpus_byte_ids(), np.int64) % vocab
    span = prompt_len + decode_steps
    rows = np.stack([ids[i * 997 % (len(ids) - span) :][:span] for i in range(batch)])
    return rows[:, :prompt_len], rows[:, prompt_len:]


def build_model(spec: ModelSpec, max_position: int, folder: pathlib.Path | None = None) -> tuple[Any, Any]:
    """The float model and the folder its file lives in (genai: a saved folder, else None)."""
    from onnx_kvcache.models.decoder import build_decoder, save_genai_folder

    if not spec.genai:
        return build_decoder(**spec.overrides(max_position)), None
    assert folder is not None
    path = save_genai_folder(folder / spec.name, provider="cuda", **spec.overrides(max_position))
    config = json.loads((path / "genai_config.json").read_text())
    config["search"]["past_present_share_buffer"] = True  # what genai runs CUDA with
    (path / "genai_config.json").write_text(json.dumps(config, indent=4) + "\n")
    return None, path


def calibration_scales(model: Any, variant: Variant) -> Any:
    """Scales measured on CPU from the float model (minmax; int4: mse, as the demo)."""
    from onnx_kvcache import calibrate_kv_cache
    from onnx_kvcache.scales.data import corpus_byte_ids

    method = "mse" if variant.fmt == "int4" else "minmax"
    data = [corpus_byte_ids()[:1024]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate_kv_cache(
            model,
            data,
            format=variant.fmt,
            granularity=variant.granularity,
            method=method,
            seq_len=256,
            progress=False,
            rotation=variant.rotation,
        )


def converted(
    spec: ModelSpec, model: Any, folder: Any, variant: Variant, work: pathlib.Path
) -> tuple[Any, Any]:
    """``(model, base_dir)`` of ``variant``: the pass on a copy, or for a genai folder
    ``convert_model`` into a new folder (the user's path), loaded back."""
    import onnx_ir as ir

    from onnx_kvcache import KvCacheQuantizationPass, convert_model
    from onnx_kvcache.passes.kv_cache_rotation import KvCacheRotationPass

    source = model if folder is None else ir.load(folder / "model.onnx")
    if variant.fmt is None:
        return source, folder
    scales = calibration_scales(folder if folder is not None else model, variant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if folder is None:
            copy = model.clone()
            KvCacheRotationPass(variant.rotation)(copy)  # convert_model follows the scales' record
            KvCacheQuantizationPass(variant.fmt, variant.granularity, scales)(copy)
            return copy, None
        out = work / f"{spec.name}-{variant.fmt}-{variant.granularity}"
        convert_model(
            folder, out, format=variant.fmt, granularity=variant.granularity, scales=scales, ep="cuda"
        )
    return ir.load(out / "model.onnx"), out


def _ran(ran: dict[tuple[str, str, str], str], key: tuple[str, str, str], what: str) -> None:
    """Record what a cell did on the device: "ran" once any run of it ran, else its first
    failure (a layout that fails beside one that runs is a failure row, not a refusal)."""
    if what == "ran" or key not in ran:
        ran[key] = what


def kernel_phase(
    plan: Plan,
    device: str,
    work: pathlib.Path,
    rule: str = "cuda",
    echo: Callable[[str], None] = print,
    failures: list[str] | None = None,
) -> tuple[list[Comparison], dict[tuple[str, str, str], str]]:
    """Every model x cache x batch x layout on ``device`` against the ``rule`` emulation.

    Returns the comparisons and what ran on the device: ``(op, format, granularity) ->
    "ran"`` or its failure. Every failure, the CPU side's included (which says nothing
    about the device, so it is not in what ran), is appended to ``failures`` as a line.
    """
    failures = [] if failures is None else failures

    def failed(line: str) -> None:
        failures.append(line)
        echo(f"  {line}")

    from onnx_kvcache.cache.formats import get_format

    results: list[Comparison] = []
    ran: dict[tuple[str, str, str], str] = {}
    big = max(plan.batches)
    work = pathlib.Path(tempfile.mkdtemp(dir=work, prefix="kernel-"))
    for spec in plan.models:
        prompt, decode = token_batches(big, plan.prompt_len, plan.decode_steps, spec.vocab_size)
        model, folder = build_model(spec, max(1024, plan.prompt_len + plan.decode_steps + 64), work)
        float_ref: Run | None = None
        floors: dict[tuple[int, str], np.ndarray] = {}
        for variant in plan.variants[spec.name]:
            key = ("GroupQueryAttention", variant.fmt or "float", variant.cell)
            try:
                qmodel, base = converted(spec, model, folder, variant, work)
                reference = reference_run(qmodel, rule, prompt, decode)
            except Exception as error:
                failed(f"{spec.name} {variant.label}: CPU side not prepared: {_one_line(error)}")
                continue
            if variant.fmt is None:
                float_ref = reference
            fmt = get_format(variant.fmt) if variant.fmt else None
            for layout in plan.layouts:
                try:
                    profile = tempfile.mkdtemp(dir=work)
                    decoder = DeviceDecoder(qmodel, device, base, profile_dir=profile)
                except Exception as error:
                    _ran(ran, key, f"session failed: {_one_line(error)}")
                    failed(f"{spec.name} {variant.label} {layout}: session failed: {_one_line(error)}")
                    continue
                for batch in plan.batches:
                    try:
                        run = decoder.run(prompt[:batch], decode[:batch], layout == "shared", keep_codes=True)
                    except Exception as error:
                        _ran(ran, key, f"run failed: {_one_line(error)}")
                        failed(
                            f"{spec.name} {variant.label} {layout} b{batch}: run failed: {_one_line(error)}"
                        )
                        continue
                    _ran(ran, key, "ran")
                    floor = floors.get((batch, layout)) if variant.fmt else None
                    found = compare(
                        run,
                        reference,
                        model=spec,
                        variant=variant,
                        batch=batch,
                        layout=layout,
                        float_reference=float_ref,
                        float_floor=floor,
                        fmt=fmt,
                        placement=decoder.placement,
                        provider=_CUDA if device == "cuda" else _CPU,
                    )
                    if decoder.zero_note:
                        found.note = "; ".join(filter(None, (found.note, decoder.zero_note)))
                    if variant.fmt is None:
                        ref = [r[:batch] for r in reference.logits]
                        floors[(batch, layout)] = step_errors(run.logits, ref)[0]
                    results.append(found)
                    echo(_row_text(found))
    return results, ran


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


# --- PagedAttention ------------------------------------------------------------------------------


def paged_phase(
    plan: Plan,
    device: str,
    rule_providers: Sequence[str] = (_CUDA,),
    echo: Callable[[str], None] = print,
    failures: list[str] | None = None,
) -> tuple[list[Comparison], dict[tuple[str, str, str], str]]:
    """A PagedAttention decoder (fp16, head 64) per format on ``rule_providers`` against its
    CPU reference (``PagedAttentionReferencePass``: every paged kernel quantizes before
    attending), batch 1, through ``KvCacheRunner`` (CPU fallback not disabled there)."""
    from onnx_kvcache import KvCacheQuantizationPass, KvCacheRunner
    from onnx_kvcache.models.decoder import build_decoder

    spec = ModelSpec("paged-fp16-h64", "float16", 64)
    prompt, decode = token_batches(1, plan.prompt_len, min(plan.decode_steps, 16), spec.vocab_size)
    base = build_decoder(paged=True, **spec.overrides(plan.prompt_len + plan.decode_steps + 64))
    results, ran = [], {}
    float_ref = None
    for variant in plan.variants[plan.models[0].name]:
        key = ("PagedAttention", variant.fmt or "float", variant.granularity)
        model = base.clone()
        if variant.fmt is not None:
            n = 1 if variant.granularity == "per_tensor" else spec.kv_num_heads * spec.head_size
            scale = {"fp8": 0.02, "int8": 0.08, "int4": 1.2}[variant.fmt]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                KvCacheQuantizationPass(
                    variant.fmt,
                    variant.granularity,
                    {i: (np.full(n, scale), np.full(n, scale)) for i in range(spec.num_layers)},
                )(model)
        runs = []
        for side, providers in (("CPU reference", [_CPU]), ("device", list(rule_providers))):
            try:
                runner = KvCacheRunner(model, providers=providers)
                start = time.perf_counter()
                logits = [runner.prefill(prompt)[:, -1]] + [
                    runner.step(decode[:, i].tolist()) for i in range(decode.shape[1])
                ]
                runs.append(Run(logits, None, time.perf_counter() - start))
            except Exception as error:
                if side == "device":  # the CPU side's failure says nothing about the device
                    ran[key] = f"failed: {_one_line(error)}"
                line = f"{spec.name} {variant.label}: {side} failed: {_one_line(error)}"
                echo(f"  {line}")
                if failures is not None:
                    failures.append(line)
                break
        if len(runs) < 2:
            continue
        ran[key] = "ran"
        if variant.fmt is None:
            float_ref = runs[0]
        found = compare(
            runs[1], runs[0], model=spec, variant=variant, batch=1, layout="paged", float_reference=float_ref
        )
        results.append(found)
        echo(_row_text(found))
    return results, ran


# --- the speed phase ------------------------------------------------------------------------------


def _tiled_weights(seed: int = 0) -> Callable[[str, tuple[int, ...], Any], Any]:
    """A weight factory: a tiled random block (fast for billions of values), scaled like
    the builder's (1/sqrt(fan in)); norms are ones."""
    import onnx_ir as ir

    block = np.random.default_rng(seed).standard_normal(1 << 20).astype(np.float32)

    def make(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        if len(shape) == 1:
            values = np.ones(shape, np.float32)
        else:
            gain = 1.0 if "embed" in name else 1.0 / np.sqrt(shape[0])
            values = np.resize(block * gain, shape)
        return ir.tensor(values.astype(dtype.numpy()), name=name)

    return make


def speed_models(
    spec: SpeedSpec, variants: Sequence[Variant], max_position: int, folder: pathlib.Path
) -> dict[str, pathlib.Path]:
    """The float16 model saved once (weights in ``model.onnx.data``), and beside it one graph
    per quantized variant (``convert_model``: the graph only, sharing the weights)."""
    import onnx_ir as ir

    from onnx_kvcache import convert_model
    from onnx_kvcache.models.decoder import build_decoder
    from onnx_kvcache.scales.files import KvCacheScales

    fields = dataclasses.asdict(spec)
    model = build_decoder(
        weight_factory=_tiled_weights(),
        dtype="float16",
        max_position=max_position,
        outlier_channels=0,
        **fields,
    )
    base = folder / "model.onnx"
    ir.save(model, base, external_data="model.onnx.data")
    paths = {}
    for v in variants:
        if v.fmt is None:
            paths[v.label] = base
            continue
        n = 1 if v.granularity == "per_tensor" else spec.kv_num_heads * spec.head_size
        scale = {"fp8": 0.02, "int8": 0.08, "int4": 1.2}[v.fmt]
        k = {i: np.full(n, scale, np.float32) for i in range(spec.num_layers)}
        scales = KvCacheScales(k, k, format=v.fmt, metadata={"rotation": v.rotation})
        out = folder / f"model.{v.fmt}.{v.cell}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            convert_model(base, out, format=v.fmt, granularity=v.granularity, scales=scales, ep="cuda")
        paths[v.label] = out
    return paths


def device_memory_mib() -> float | None:
    """Memory in use on GPU 0 (nvidia-smi), or None."""
    line = _gpu_query("memory.used", "nounits")
    try:
        return None if line is None else float(line)
    except ValueError:
        return None


@dataclasses.dataclass
class SpeedRow:
    cache: str
    context: int
    batch: int
    tokens_per_s: float | None
    cache_mib: float
    device_mib: float | None
    error: str = ""


def decode_speed(
    decoder: DeviceDecoder,
    context: int,
    batch: int,
    steps: int,
    warmup: int = 2,
    memory: Callable[[], float | None] = device_memory_mib,
) -> tuple[float, float, float | None]:
    """Decode tokens/s at ``context`` past tokens (shared-buffer caches, rows unwritten),
    the caches' MiB, and the device memory in use after the timed steps."""
    capacity = context + warmup + steps
    caches = {b.past: decoder.empty(b, batch, capacity, zero=False) for b in decoder.bindings}
    nbytes = sum(b.nbytes((batch, b.kv_num_heads, capacity)) for b in decoder.bindings)
    ids = np.ones((batch, 1), np.int64)
    for i in range(warmup):
        decoder.step(ids, context + i + 1, caches, shared=True, to_host=False)
    start = time.perf_counter()
    for i in range(steps):
        decoder.step(ids, context + warmup + i + 1, caches, shared=True, to_host=False)
    rate = batch * steps / (time.perf_counter() - start)
    used = memory()
    del caches
    return rate, nbytes / 2**20, used


def speed_phase(
    plan: Plan, device: str, work: pathlib.Path, echo: Callable[[str], None] = print
) -> list[SpeedRow]:
    """Tokens/s and memory per cache x context x batch (smallest caches first)."""
    max_position = max(plan.contexts) + plan.speed_steps + 8
    rows: list[SpeedRow] = []
    grid = sorted(((c, b) for c in plan.contexts for b in plan.speed_batches), key=lambda cb: cb[0] * cb[1])
    try:
        paths = speed_models(plan.speed, plan.speed_variants, max_position, work)
    except Exception as error:  # building or converting: every row says so
        found = f"model not built: {_one_line(error)}"
        echo(f"  {found}")
        return [SpeedRow(v.label, c, b, None, 0.0, None, found) for v in plan.speed_variants for c, b in grid]
    for v in plan.speed_variants:
        import onnx_ir as ir

        try:
            decoder = DeviceDecoder(ir.load(paths[v.label]), device, paths[v.label].parent)
        except Exception as error:
            rows += [
                SpeedRow(v.label, c, b, None, 0.0, None, f"session: {_one_line(error)}") for c, b in grid
            ]
            continue
        for context, batch in grid:
            try:
                rate, mib, used = decode_speed(decoder, context, batch, plan.speed_steps)
                rows.append(SpeedRow(v.label, context, batch, rate, mib, used))
            except Exception as error:
                rows.append(SpeedRow(v.label, context, batch, None, 0.0, None, _one_line(error)))
            echo(_speed_text(rows[-1]))
        del decoder
    return rows


# --- the capability table ------------------------------------------------------------------------


@dataclasses.dataclass
class Claim:
    op: str
    cache: str
    table: str
    observed: str
    contradiction: bool


def capability_claims(
    ran: dict[tuple[str, str, str], str], ort_version: str | None, cc: tuple[int, int] | None
) -> list[Claim]:
    """Each table cell of the CUDA rows against what ran here (only cells something ran for)."""
    from onnx_kvcache import check_kv_cache_support

    claims = []
    for (op, fmt, cell), observed in sorted(ran.items()):
        granularity, _, rotation = cell.partition("+")  # a rotated cache's cell: per_channel+keys...
        report = check_kv_cache_support(
            None,
            "cuda",
            None if fmt == "float" else fmt,
            granularity,
            runtime_version=ort_version,
            compute_capability=cc,
            op=op,
            rotation=rotation or "none",
        )
        says = "runs" if report.supported else "refused: " + "; ".join(report.reasons)[:160]
        did = observed == "ran"
        claims.append(
            Claim(
                op,
                f"{fmt} {cell.replace('+', ' +')}" if fmt != "float" else "float",
                says,
                observed,
                did != report.supported,
            )
        )
    return claims


# --- output ------------------------------------------------------------------------------------


_HEADER = (
    f"{'model':<16} {'cache':<20} {'B':>2} {'layout':<8} {'max abs':>9} {'max rel':>9} {'top-1':>6} "
    f"{'/bound':>7} {'codes':>14}  verdict"
)


def _row_text(c: Comparison) -> str:
    codes = "-" if c.code_diff_fraction is None else f"{c.code_diff_fraction:.2%}/{c.code_max_steps:g}st"
    text = (
        f"{c.model:<16} {c.cache:<20} {c.batch:>2} {c.layout:<8} {c.max_abs:9.2e} {c.max_rel:9.2e} "
        f"{c.top1:6.1%} {c.worst_ratio:7.2f} {codes:>14}  {c.verdict()}"
    )
    if c.flagged_steps:
        text += f" (steps {c.flagged_steps[:6]}{'...' if len(c.flagged_steps) > 6 else ''})"
    if c.placement_ok is False:
        text += " (attention or rotation nodes not all on CUDA)"
    return text + (f" [{c.note}]" if c.note else "")


def _speed_text(r: SpeedRow) -> str:
    rate = f"{r.tokens_per_s:9.1f}" if r.tokens_per_s is not None else f"{'-':>9}"
    used = f"{r.device_mib:9.0f}" if r.device_mib is not None else f"{'-':>9}"
    context = f"{r.context // 1024}k" if r.context % 1024 == 0 else str(r.context)
    return f"{r.cache:<20} {context:>5} {r.batch:>3} {rate} {r.cache_mib:10.2f} {used}  {r.error}"


class Phases:
    """Each phase's wall time, printed as it ends."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo = echo
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> Any:
        phases = self

        class Timer:
            def __enter__(self) -> None:
                phases.echo(f"== {name}")
                self.start = time.perf_counter()

            def __exit__(self, *exc: object) -> None:
                phases.seconds[name] = round(time.perf_counter() - self.start, 2)
                phases.echo(f"   ({name}: {phases.seconds[name]:.1f} s)")

        return Timer()


def summary(
    comparisons: Sequence[Comparison],
    speed: Sequence[SpeedRow],
    claims: Sequence[Claim],
    failures: Sequence[str] = (),
) -> str:
    """The one table of the check: every comparison, every failure, every speed row, every
    contradiction."""
    lines = [
        "kernel vs CUDA-rule emulation (max over steps; /bound <= 1: explained by the kernel's arithmetic)"
    ]
    lines += [_HEADER] + [_row_text(c) for c in comparisons]
    lines.append(f"{sum(c.flagged for c in comparisons)} of {len(comparisons)} runs flagged")
    if failures:
        lines.append(f"{len(failures)} failed (no comparison):")
        lines += [f"  FAILED {line}" for line in failures]
    if speed:
        lines.append("decode speed (shared-buffer caches; dev MiB: nvidia-smi's memory in use on the GPU)")
        lines.append(f"{'cache':<20} {'ctx':>5} {'B':>3} {'tok/s':>9} {'cache MiB':>10} {'dev MiB':>9}")
        lines += [_speed_text(r) for r in speed]
    contradictions = [c for c in claims if c.contradiction]
    lines.append(f"capability table: {len(claims)} cells checked, {len(contradictions)} contradictions")
    lines += [f"  CONTRADICTION {c.op} {c.cache}: table {c.table}; here {c.observed}" for c in contradictions]
    return "\n".join(lines)


def report(
    info: DeviceInfo,
    plan: Plan,
    phases: dict[str, float],
    comparisons: Sequence[Comparison],
    speed: Sequence[SpeedRow],
    claims: Sequence[Claim],
    doctor: Sequence[str],
    quick: bool,
    failures: Sequence[str] = (),
    complete: bool = True,
) -> dict[str, Any]:
    """The JSON document of a run (``complete`` False: written after a phase, the later
    phases not run yet)."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "mode": "quick" if quick else "default",
        "complete": complete,
        "device": dataclasses.asdict(info),
        "plan": describe(plan).splitlines(),
        "phases_s": phases,
        "comparisons": [dataclasses.asdict(c) | {"verdict": c.verdict()} for c in comparisons],
        "failures": list(failures),
        "speed": [dataclasses.asdict(r) for r in speed],
        "capabilities": [dataclasses.asdict(c) for c in claims],
        "doctor_disagreements": list(doctor),
    }


def _words(error: BaseException) -> str:
    """A library error in this script's words (``--overwrite``, not ``overwrite=True``)."""
    from onnx_kvcache.errors import Param, Wording, render

    class Flags(Wording):
        def param(self, param: Param) -> str:
            flag = "--" + param.name.replace("_", "-")
            return flag if param.value is True else super().param(param)

    return render(error, Flags())


class Reporter:
    """Writes the JSON report (guarded, atomic) after each phase, so that a run stopped by a
    time limit or Ctrl-C leaves the phases that ended; when ``path`` cannot be written at
    the end of minutes of work, the report goes to a new file in the temporary folder and
    the line saying so names it."""

    def __init__(self, path: str, overwrite: bool) -> None:
        self.path, self.overwrite = path, overwrite
        self.written: str | None = None
        self.failed: str | None = None

    def write(self, doc: dict[str, Any]) -> None:
        from onnx_kvcache.errors import KvCacheError
        from onnx_kvcache.model_io._outputs import stamp_json, write_output

        data = stamp_json(doc, "report")
        try:
            write_output(self.path, data, "report", overwrite=self.overwrite)
        except (KvCacheError, OSError) as error:
            why = _words(error) if isinstance(error, KvCacheError) else (error.strerror or str(error))
            fallback = os.path.join(tempfile.mkdtemp(prefix="cuda-check-"), "cuda_check.json")
            write_output(fallback, data, "report")
            self.failed = f"cannot write {self.path} ({why.rstrip('.')}); the report is in {fallback}"
            print(f"cuda_check: {self.failed}", file=sys.stderr)
            self.path, self.overwrite = fallback, False
        self.written = self.path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="The CUDA check: kernels vs emulation, and what the cache buys. "
        "Exit status: 0 nothing flagged, 1 something flagged or failed, 2 this machine or an "
        "argument cannot run it (one line says why), 130 interrupted (Ctrl-C or SIGTERM)."
    )
    parser.add_argument("--quick", action="store_true", help="fewer models and contexts (under 2 minutes)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (any machine)")
    parser.add_argument(
        "--json",
        default="cuda_check.json",
        help="where to write the report, after each phase (default: %(default)s)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a --json file onnx-kvcache did not write"
    )
    parser.add_argument("--skip-speed", action="store_true", help="leave out the speed phase")
    args = parser.parse_args(argv)
    plan = make_plan(args.quick)
    if args.dry_run:
        print(describe(plan))
        return 0
    from onnx_kvcache.errors import KvCacheError

    reporter = Reporter(args.json, args.overwrite)

    def terminated(signum: int, frame: Any) -> None:  # a time limit's SIGTERM: as Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        return _check(args, plan, reporter)
    except KvCacheError as error:  # the --json file, refused before any work
        print(f"cuda_check: {_words(error)}", file=sys.stderr)
        return NO_DEVICE
    except KeyboardInterrupt:
        kept = f"the phases that ended are in {reporter.written}" if reporter.written else "no report written"
        print(f"cuda_check: interrupted; {kept}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check(args: argparse.Namespace, plan: Plan, reporter: Reporter) -> int:
    from onnx_kvcache.model_io._outputs import check_output

    check_output(args.json, "report", overwrite=args.overwrite)  # refused before minutes of work
    info = preflight()
    warnings.simplefilter("ignore")
    phases = Phases(print)
    comparisons: list[Comparison] = []
    failures: list[str] = []
    speed: list[SpeedRow] = []
    ran: dict[tuple[str, str, str], str] = {}

    def save(complete: bool = False, claims: Sequence[Claim] = (), doctor: Sequence[str] = ()) -> None:
        doc = report(
            info, plan, phases.seconds, comparisons, speed, claims, doctor, args.quick, failures, complete
        )
        reporter.write(doc)

    with tempfile.TemporaryDirectory(prefix="cuda-check-") as tmp:
        work = pathlib.Path(tmp)
        with phases("kernel vs emulation"):
            print(_HEADER)
            found, ran = kernel_phase(plan, "cuda", work, failures=failures)
            comparisons += found
        save()
        if plan.paged:
            with phases("PagedAttention vs its CPU reference"):
                paged, paged_ran = paged_phase(plan, "cuda", failures=failures)
            comparisons += paged
            ran |= paged_ran
            save()
        if not args.skip_speed:
            with phases("decode speed"):
                speed += speed_phase(plan, "cuda", work)
            save()
    with phases("capability table"):
        from onnx_kvcache.runtime.doctor import run_doctor

        claims = capability_claims(ran, info.ort_version, info.compute_capability)
        doctor = run_doctor(["cuda"]).disagreements
    print(summary(comparisons, speed, claims, failures))
    for line in doctor:
        print(f"  doctor: {line}")
    save(True, claims, doctor)
    print(f"wrote {reporter.written}; total {sum(phases.seconds.values()):.1f} s")
    if reporter.failed:
        return NO_DEVICE
    bad = any(c.flagged for c in comparisons) or any(c.contradiction for c in claims) or failures
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
