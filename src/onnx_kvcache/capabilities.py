"""Who can run what: one frozen row per execution provider.

A row lists the query dtypes the provider's GroupQueryAttention kernel takes and,
per cache format, the granularities it runs, the first version of its runtime that has
it (onnxruntime for its execution providers; OpenVINO, a second runtime for the same
files, for its row) and, where the hardware matters, the minimum CUDA compute
capability. Gating, ``optimize_model`` and the docs page all read
:data:`EP_CAPABILITIES`; adding a provider is adding a row.
"""

from __future__ import annotations

__all__ = [
    "EP_CAPABILITIES",
    "EpCapabilities",
    "FastPathReport",
    "FormatSupport",
    "SupportReport",
    "check_kv_cache_support",
    "fast_path_diagnostics",
    "get_capabilities",
    "infer_target",
    "render_capability_table",
]

import dataclasses
import re
from collections.abc import Mapping

import onnx_ir as ir

from onnx_kvcache.formats import get_format, get_granularity
from onnx_kvcache.gqa import K_SCALE, Q_NORM, V_SCALE, find_gqa_sites
from onnx_kvcache.runtime import installed_ort_version, installed_version

_BOTH = frozenset({"per_tensor", "per_channel"})


@dataclasses.dataclass(frozen=True)
class FormatSupport:
    """One cache format on one provider."""

    granularities: frozenset[str]
    min_version: str
    """First version of the row's runtime that runs it."""
    min_compute_capability: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class EpCapabilities:
    """What one execution provider's GroupQueryAttention runs."""

    name: str
    provider: str
    query_dtypes: frozenset[ir.DataType]
    formats: Mapping[str, FormatSupport]
    note: str = ""
    qk_norm: bool = False
    """Takes q/k norm weights (GQA inputs 14/15, Qwen3-style)."""
    runtime: str = "onnxruntime"
    """The package that runs it: ``onnxruntime`` (an execution provider) or ``openvino``."""
    share_buffer: bool = False
    """A quantized cache's past and present can share one buffer (onnxruntime-genai's
    ``search.past_present_share_buffer``, which the model builder sets for CUDA only)."""


_CPU_T = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16})
_CUDA_T = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})

EP_CAPABILITIES: dict[str, EpCapabilities] = {
    row.name: row
    for row in (
        EpCapabilities(
            "cpu",
            "CPUExecutionProvider",
            _CPU_T,
            {"int8": FormatSupport(_BOTH, "1.27"), "int4": FormatSupport(_BOTH, "1.27")},
            "No fp8 kernel and no q/k norm inputs: evaluate either through emulation.",
        ),
        EpCapabilities(
            "cuda",
            "CUDAExecutionProvider",
            _CUDA_T,
            {
                "fp8": FormatSupport(_BOTH, "1.25", (8, 9)),
                "int8": FormatSupport(_BOTH, "1.25"),
                "int4": FormatSupport(_BOTH, "1.25"),
            },
            "No float32 GQA; fp8 needs SM 8.9+ (Ada, Hopper, Blackwell).",
            qk_norm=True,
            share_buffer=True,
        ),
        EpCapabilities(
            "dml", "DmlExecutionProvider", frozenset({ir.DataType.FLOAT16, ir.DataType.FLOAT}), {}
        ),
        EpCapabilities(
            "webgpu",
            "WebGpuExecutionProvider",
            frozenset({ir.DataType.FLOAT16, ir.DataType.FLOAT}),
            {},
            qk_norm=True,
        ),
        EpCapabilities(
            "openvino",
            "",
            frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16}),
            {"int8": FormatSupport(_BOTH, "2026.4"), "int4": FormatSupport(_BOTH, "2026.4")},
            "OpenVINO's own runtime (ONNX frontend): int8/int4 caches store onnxruntime's codes. "
            "Whether 2026.3 runs them is unsettled. fp8 compiles, but its codes differ from "
            "onnxruntime's rule (one fp8 step in 0.3% of values, measured on 2026.4.1): not listed.",
            runtime="openvino",
        ),
        EpCapabilities("default", "", frozenset(), {}, "Unknown provider: no quantized cache known."),
    )
}

_ALIASES = {row.provider.lower(): name for name, row in EP_CAPABILITIES.items() if row.provider}
_ALIASES |= {"directml": "dml", "gpu": "cuda"}


def get_capabilities(ep: str) -> EpCapabilities:
    """The row for ``ep`` (``cpu``, ``CUDAExecutionProvider``, ...); unknown -> ``default``."""
    key = str(ep).lower()
    key = _ALIASES.get(key, key)
    return EP_CAPABILITIES.get(key, EP_CAPABILITIES["default"])


def infer_target(model: ir.Model | None, genai_config: Mapping | None = None) -> tuple[str, str]:
    """Where a model will run when the user did not say: ``(row name, why)``.

    An fp8 cache runs only on ``cuda``. An onnxruntime-genai config decides next: the first
    known provider of its ``provider_options``, or ``cpu`` when it names none (genai's
    default). A bare model: fp16/bf16 queries mean ``cuda``, float32 ``cpu``.
    """
    sites = find_gqa_sites(model) if model is not None else []
    if any(s.cache_format is not None and s.cache_format.is_float for s in sites):
        return "cuda", "its fp8 cache runs only on CUDA"
    if genai_config is not None:
        decoder = genai_config.get("model", {}).get("decoder", {})
        options = (
            decoder.get("session_options", {}).get("provider_options", [])
            if isinstance(decoder, dict)
            else []
        )
        for entry in options if isinstance(options, list) else []:
            for name in entry if isinstance(entry, dict) else ():
                row = get_capabilities(name)
                if row.name != "default":
                    return row.name, f"genai_config.json's provider_options name {name!r}"
        return "cpu", "genai_config.json names no provider, so onnxruntime-genai runs it on CPU"
    dtypes = {s.query_dtype for s in sites if s.query_dtype is not None}
    if dtypes & {ir.DataType.FLOAT16, ir.DataType.BFLOAT16}:
        names = "/".join(sorted(t.name.lower() for t in dtypes))
        return "cuda", f"a {names} model"
    return "cpu", "a float32 model" if dtypes else "no GroupQueryAttention dtype to go by"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


@dataclasses.dataclass(frozen=True)
class SupportReport:
    """Whether a cache format runs on a provider, and every reason it does not."""

    ep: str
    format: str
    granularity: str
    supported: bool
    reasons: tuple[str, ...]

    def __bool__(self) -> bool:
        return self.supported


def check_kv_cache_support(
    model: ir.Model | None,
    ep: str,
    format: str,
    granularity: str = "per_tensor",
    *,
    runtime_version: str | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> SupportReport:
    """Check every requirement of a quantized cache on ``ep``; one reason per failure.

    ``runtime_version`` is the version of the row's runtime (onnxruntime, or openvino for
    the ``openvino`` row); it defaults to the installed one (unchecked when none is
    installed). ``compute_capability`` is checked only when given.
    """
    fmt = get_format(format)
    granularity = get_granularity(granularity)
    row = get_capabilities(ep)
    reasons: list[str] = []
    support = row.formats.get(fmt.name)
    label = row.name if row.name != "default" else repr(ep)
    if row.name == "default":
        known = ", ".join(n for n in EP_CAPABILITIES if n != "default")
        reasons.append(
            f"{ep!r} is not in the capability table (known: {known}; `openvino` is OpenVINO's own "
            "runtime, not onnxruntime's OpenVINO provider), so no quantized cache is known to run there."
        )
    elif support is None:
        runs = ", ".join(row.formats) or "none"
        others = [n for n, r in EP_CAPABILITIES.items() if fmt.name in r.formats]
        reasons.append(
            f"{label} has no GroupQueryAttention kernel for an {fmt.name} cache (its quantized "
            f"caches: {runs}); {fmt.name} runs on {', '.join(others) or 'no provider'}."
        )
    else:
        if granularity not in support.granularities:
            reasons.append(f"{label} runs {fmt.name} only {', '.join(sorted(support.granularities))}.")
        version = runtime_version if runtime_version is not None else installed_version(row.runtime)
        if version is not None and _version_tuple(version) < _version_tuple(support.min_version):
            reasons.append(
                f"{row.runtime} {version} predates {support.min_version}, the first {row.runtime} known "
                f"to run an {fmt.name} cache on {label}; upgrade it."
            )
        need = support.min_compute_capability
        if need is not None and compute_capability is not None and tuple(compute_capability) < need:
            reasons.append(
                f"The GPU's compute capability {compute_capability[0]}.{compute_capability[1]} is "
                f"below {need[0]}.{need[1]}, which an {fmt.name} cache on {label} needs; use int8 "
                "or int4 on this GPU."
            )
    if model is not None:
        sites = find_gqa_sites(model)
        if not sites:
            reasons.append("The model has no GroupQueryAttention node with a KV cache.")
        bad = sorted(
            {str(s.query_dtype) for s in sites if s.query_dtype is not None}
            - {str(t) for t in row.query_dtypes}
        )
        with_norm = [s for s in sites if s.input(Q_NORM) is not None]
        if with_norm and not row.qk_norm:
            reasons.append(
                f"{label}'s GroupQueryAttention rejects q/k norm weights (inputs 14/15), which "
                f"{len(with_norm)} node(s) of this model use; run it on cuda or webgpu."
            )
        if bad and support is not None:
            reasons.append(
                f"{label}'s GroupQueryAttention takes queries of "
                f"{', '.join(sorted(str(t) for t in row.query_dtypes))}, the model's are "
                f"{', '.join(bad)}; export the model in a supported dtype."
            )
    return SupportReport(row.name, fmt.name, granularity, not reasons, tuple(reasons))


@dataclasses.dataclass(frozen=True)
class FastPathReport:
    """Whether CUDA's quantized decode fast path (XQA) can apply to one GQA node."""

    node: str
    layer_id: int
    eligible: bool
    reasons: tuple[str, ...]


_XQA_HEAD_SIZES = (64, 128, 256)
_XQA_GROUP_SIZES = (4, 8, 16, 32)


def fast_path_diagnostics(
    model: ir.Model,
    *,
    ort_version: str | None = None,
    share_buffer: bool | None = None,
) -> list[FastPathReport]:
    """Per GQA node: can CUDA's XQA decode kernel run it, and if not, why.

    XQA needs a decode step (seq_len 1, a runtime property not checked here), head
    size 64/128/256, for a quantized cache a group size (num_heads / kv_num_heads) of
    4/8/16/32, past and present sharing one buffer (``share_buffer``, e.g. genai's
    ``past_present_share_buffer``; inferred from the cache shapes when not given),
    and before onnxruntime 1.29 one tensor for k_scale and v_scale.
    """
    version = ort_version if ort_version is not None else installed_ort_version()
    reports = []
    for site in find_gqa_sites(model):
        reasons = []
        quantized = site.str_attr("k_quant_type", "NONE") != "NONE"
        head = site.head_size(cache_is_packed=site.cache_dtype == ir.DataType.UINT8)
        if head not in _XQA_HEAD_SIZES:
            reasons.append(f"head size {head} is not one of {_XQA_HEAD_SIZES}")
        group = site.num_heads // max(site.kv_num_heads, 1)
        if quantized and group not in _XQA_GROUP_SIZES:
            reasons.append(f"group size {group} (num_heads / kv_num_heads) is not one of {_XQA_GROUP_SIZES}")
        shared = share_buffer
        if shared is None:
            past, present = site.past_key, site.present_key
            shared = bool(
                past is not None
                and present is not None
                and past.shape is not None
                and present.shape is not None
                and len(past.shape) > 2
                and len(present.shape) > 2
                and past.shape[2] == present.shape[2]
            )
        if not shared:
            reasons.append("past and present caches do not share one buffer")
        if quantized and version is not None and _version_tuple(version) < (1, 29):
            k = site.input(K_SCALE)
            if k is None or k is not site.input(V_SCALE):
                reasons.append(
                    f"onnxruntime {version} < 1.29 needs k_scale and v_scale to be one tensor "
                    "(convert with --shared-kv-scale)"
                )
        reports.append(FastPathReport(site.name, site.layer_id, not reasons, tuple(reasons)))
    return reports


def render_capability_table() -> str:
    """The capability table as Markdown, rendered from :data:`EP_CAPABILITIES`."""
    from onnx_kvcache.formats import CACHE_FORMATS

    lines = [
        "| provider | query dtypes | q/k norm | " + " | ".join(CACHE_FORMATS) + " | note |",
        "|---|---|---|" + "---|" * len(CACHE_FORMATS) + "---|",
    ]
    for row in EP_CAPABILITIES.values():
        cells = []
        for name in CACHE_FORMATS:
            support = row.formats.get(name)
            if support is None:
                cells.append("no")
                continue
            runtime = "ORT" if row.runtime == "onnxruntime" else row.runtime
            cell = f"{runtime} >= {support.min_version}, " + " + ".join(sorted(support.granularities))
            if support.min_compute_capability:
                cell += ", SM {}.{}+".format(*support.min_compute_capability)
            cells.append(cell)
        dtypes = ", ".join(sorted(t.name.lower() for t in row.query_dtypes)) or "-"
        label = f"`{row.name}` ({row.provider})" if row.provider else f"`{row.name}`"
        norm = "yes" if row.qk_norm else "no"
        lines.append(f"| {label} | {dtypes} | {norm} | " + " | ".join(cells) + f" | {row.note} |")
    return "\n".join(lines)
