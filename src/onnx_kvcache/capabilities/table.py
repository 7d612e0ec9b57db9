"""Who can run what: one frozen row per attention operator and execution provider.

A row lists the query dtypes the provider's kernel for the operator takes and, per cache
format, the granularities it runs, the first version of its runtime that has it
(onnxruntime for its execution providers; OpenVINO, a second runtime for the same files,
for its row), where the hardware matters the minimum CUDA compute capability, whether the
fact was run here or is documented only, and what a user must be told at conversion.
Gating, ``optimize_model``, the doctor and the docs page all read :data:`CAPABILITIES`
(:data:`EP_CAPABILITIES` is its GroupQueryAttention table); the decode fast path's
requirements are rows of :data:`FAST_PATHS`. Adding a provider or an operator is adding rows.
"""

from __future__ import annotations

__all__ = [
    "CAPABILITIES",
    "EP_CAPABILITIES",
    "FAST_PATHS",
    "EpCapabilities",
    "FastPathReport",
    "FastPathRule",
    "FormatSupport",
    "PAGED_CAPABILITIES",
    "SupportReport",
    "check_kv_cache_support",
    "conversion_warnings",
    "default_format",
    "fast_path_diagnostics",
    "get_capabilities",
    "infer_target",
    "render_capability_table",
]

import dataclasses
import re
from collections.abc import Mapping
from typing import Literal

import onnx_ir as ir

from onnx_kvcache.cache.formats import CACHE_FORMATS, get_format, get_granularity
from onnx_kvcache.cache.operators import GQA, PAGED, AttentionOp, get_op
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.errors import Message, Param, require_type
from onnx_kvcache.files._marker import MARKER_KEY, converted_for
from onnx_kvcache.files.genai_folder import provider_names
from onnx_kvcache.files.reading import ModelLike, as_model
from onnx_kvcache.runtime._sessions import installed_ort_version, installed_version

_BOTH = frozenset({"per_tensor", "per_channel"})

Evidence = Literal["run here", "documented"]


@dataclasses.dataclass(frozen=True)
class FormatSupport:
    """One cache format on one provider."""

    granularities: frozenset[str]
    min_version: str
    """First version of the row's runtime that runs it."""
    min_compute_capability: tuple[int, int] | None = None
    evidence: Evidence = "documented"
    """``run here``: onnx-kvcache's tests run it on this kind of machine; ``documented``: read
    from the runtime's sources and notes, never run here (``onnx-kvcache doctor`` says what
    this machine proves)."""
    note: str = ""
    """What is unsettled about the row (e.g. an earlier version that may already have it)."""
    warning: str = ""
    """Said when converting to this format for this provider (e.g. a build option it needs)."""


@dataclasses.dataclass(frozen=True)
class EpCapabilities:
    """What one execution provider's kernel for one attention operator runs."""

    name: str
    provider: str
    query_dtypes: frozenset[ir.DataType]
    """Query dtypes the kernel takes; empty when the provider has no kernel for the operator."""
    formats: Mapping[str, FormatSupport]
    note: str = ""
    qk_norm: bool = False
    """Takes q/k norm weights (GQA inputs 14/15, PagedAttention 12/13; Qwen3-style)."""
    runtime: str = "onnxruntime"
    """The package that runs it: ``onnxruntime`` (an execution provider) or ``openvino``."""
    share_buffer: bool = False
    """A quantized cache's past and present can share one buffer (onnxruntime-genai's
    ``search.past_present_share_buffer``, which the model builder sets for CUDA only)."""
    op: str = GQA.op_type
    """The attention operator of the row."""
    unlisted: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Formats its kernel takes that the row does not list, and why (said when refusing them)."""

    @property
    def has_kernel(self) -> bool:
        return bool(self.query_dtypes)


_CPU_T = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16})
_CUDA_T = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_RUN: Evidence = "run here"

_GQA_ROWS = (
    EpCapabilities(
        "cpu",
        "CPUExecutionProvider",
        _CPU_T,
        {
            "int8": FormatSupport(_BOTH, "1.27", evidence=_RUN),
            "int4": FormatSupport(_BOTH, "1.27", evidence=_RUN),
        },
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
    EpCapabilities("dml", "DmlExecutionProvider", frozenset({ir.DataType.FLOAT16, ir.DataType.FLOAT}), {}),
    EpCapabilities(
        "webgpu",
        "WebGpuExecutionProvider",
        frozenset({ir.DataType.FLOAT16, ir.DataType.FLOAT}),
        {},
        "Quantizes caches only through its kvCacheQuantizationBits EP option, inside float tensors.",
        qk_norm=True,
    ),
    EpCapabilities(
        "openvino",
        "",
        frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16}),
        {
            "int8": FormatSupport(_BOTH, "2026.4", evidence=_RUN),
            "int4": FormatSupport(_BOTH, "2026.4", evidence=_RUN),
        },
        "OpenVINO's own runtime (ONNX frontend): int8/int4 caches store onnxruntime's codes. "
        "Whether 2026.3 runs them is unsettled. fp8 compiles, but its codes differ from "
        "onnxruntime's rule (one fp8 step in 0.3% of values, measured on 2026.4.1): not listed.",
        runtime="openvino",
        unlisted={
            "fp8": "an fp8 cache compiles there, but its codes differ from onnxruntime's rule (one "
            "fp8 step in 0.3% of values, measured on 2026.4.1), so it would not compute what "
            "onnx-kvcache calibrates and evaluates"
        },
    ),
    EpCapabilities("default", "", frozenset(), {}, "Unknown provider: no quantized cache known."),
)

_PAGED_1_29 = "1.29 may already have it (its release notes leave it unclear; unproven)."
_PAGED_ROWS = (
    EpCapabilities(
        "cpu",
        "CPUExecutionProvider",
        frozenset(),
        {},
        "No PagedAttention kernel at all, float caches included (session creation fails with "
        "NOT_IMPLEMENTED): evaluate through the CPU reference (PagedAttentionReferencePass).",
        op=PAGED.op_type,
    ),
    EpCapabilities(
        "cuda",
        "CUDAExecutionProvider",
        _CUDA_T,
        {
            "fp8": FormatSupport(_BOTH, "1.30", note="No SM gate on the portable path. " + _PAGED_1_29),
            "int8": FormatSupport(_BOTH, "1.30", note=_PAGED_1_29),
            "int4": FormatSupport(
                _BOTH,
                "1.30",
                note="Only in builds with the int4 KV option.",
                warning="PagedAttention decodes int4 caches only in onnxruntime builds compiled with the "
                "int4 KV-cache option (onnxruntime_USE_INT4_KV_CACHE, off by default): check that your "
                "onnxruntime-gpu has it, or use int8.",
            ),
        },
        "fp16/bf16 queries; continuous batching (genai's use_paged_attention builds).",
        qk_norm=True,
        share_buffer=True,
        op=PAGED.op_type,
    ),
    EpCapabilities(
        "dml", "DmlExecutionProvider", frozenset(), {}, "No PagedAttention kernel known.", op=PAGED.op_type
    ),
    EpCapabilities(
        "webgpu",
        "WebGpuExecutionProvider",
        frozenset({ir.DataType.FLOAT16}),
        {},
        "Runs float caches only: its PagedAttention rejects quantized caches.",
        qk_norm=True,
        op=PAGED.op_type,
    ),
    EpCapabilities(
        "openvino",
        "",
        frozenset(),
        {},
        "No conversion rule for com.microsoft::PagedAttention in its ONNX frontend (measured on 2026.4.1).",
        runtime="openvino",
        op=PAGED.op_type,
    ),
    EpCapabilities(
        "default", "", frozenset(), {}, "Unknown provider: no quantized cache known.", op=PAGED.op_type
    ),
)

#: ``{op_type: {row name: row}}`` for every attention operator.
CAPABILITIES: dict[str, dict[str, EpCapabilities]] = {
    GQA.op_type: {row.name: row for row in _GQA_ROWS},
    PAGED.op_type: {row.name: row for row in _PAGED_ROWS},
}
#: GroupQueryAttention's rows (the table older callers read).
EP_CAPABILITIES: dict[str, EpCapabilities] = CAPABILITIES[GQA.op_type]
#: PagedAttention's rows.
PAGED_CAPABILITIES: dict[str, EpCapabilities] = CAPABILITIES[PAGED.op_type]

_ALIASES = {row.provider.lower(): name for name, row in EP_CAPABILITIES.items() if row.provider}
_ALIASES |= {"directml": "dml", "gpu": "cuda"}


def get_capabilities(ep: str, op: str | AttentionOp = "GroupQueryAttention") -> EpCapabilities:
    """The row for ``ep`` (``cpu``, ``CUDAExecutionProvider``, ...) and the attention operator
    ``op`` (a row of :data:`~onnx_kvcache.cache.operators.ATTENTION_OPS` or its op type;
    GroupQueryAttention by default); unknown providers -> ``default``."""
    require_type(ep, str, "The execution provider", "a name (cpu, cuda, CUDAExecutionProvider, ...)")
    table = CAPABILITIES[get_op(op).op_type]
    key = str(ep).lower()
    key = _ALIASES.get(key, key)
    return table.get(key, table["default"])


def _ops_in(sites: list[CacheSite]) -> list[AttentionOp]:
    return list(dict.fromkeys(s.op for s in sites))


def infer_target(
    model: ir.Model | None, genai_config: Mapping | None = None, format: str | None = None
) -> tuple[str, str]:
    """Where a model will run when the user did not say: ``(row name, why)``.

    An fp8 cache (unless ``format`` names another, to requantize it to), or an operator
    without a CPU kernel (PagedAttention), means ``cuda``: they run nowhere else. A model
    ``convert_model`` gated on a provider records it (its ``onnx_kvcache.converted``
    metadata): that provider. An onnxruntime-genai config decides
    next: the first known provider of its ``provider_options``, or ``cpu`` when it names none
    (genai's default). A bare model: fp16/bf16 queries mean ``cuda`` (without attention to
    go by, the dtype of its float inputs and outputs); else an fp8 ``format`` asked for
    means ``cuda``, and float32 ``cpu``.
    """
    sites = find_attention_sites(model) if model is not None else []
    for op in _ops_in(sites):
        if not get_capabilities("cpu", op).has_kernel:
            return "cuda", f"{op.op_type} has no CPU kernel (CUDA runs its quantized caches)"
    fp8 = any(s.cache_format is not None and s.cache_format.is_float for s in sites)
    if fp8 and (format is None or get_format(format).is_float):  # unless requantized to another
        return "cuda", "its fp8 cache runs only on CUDA"
    recorded = converted_for(model.metadata_props) if model is not None else None
    if recorded is not None and get_capabilities(recorded).name != "default":
        return get_capabilities(recorded).name, f"converted for {recorded} (its {MARKER_KEY} metadata)"
    if genai_config is not None:
        providers = provider_names(genai_config)
        for name in providers:
            row = get_capabilities(name)
            if row.name != "default":
                return row.name, f"genai_config.json's provider_options name {name!r}"
        if providers:
            unknown = ", ".join(repr(n) for n in providers)
            return "cpu", (
                f"genai_config.json's provider_options name {unknown}, which is no provider onnx-kvcache "
                "knows, so it assumes CPU"
            )
        return "cpu", "genai_config.json names no provider, so onnxruntime-genai runs it on CPU"
    dtypes = {s.query_dtype for s in sites if s.query_dtype is not None}
    if not dtypes and model is not None:  # e.g. an export whose attention did not fuse
        io = [*model.graph.inputs, *model.graph.outputs]
        dtypes = {v.dtype for v in io if v.dtype in _ATTENTION_DTYPES}
    if dtypes & {ir.DataType.FLOAT16, ir.DataType.BFLOAT16}:
        names = "/".join(sorted(t.name.lower() for t in dtypes))
        return "cuda", f"a {names} model"
    if format is not None and get_format(format).is_float:
        return "cuda", f"{get_format(format).name} caches run only on CUDA"
    return "cpu", "a float32 model" if dtypes else "no float dtype to go by"


_ATTENTION_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def default_format(model: ir.Model | None, target: str, granularity: str = "per_tensor") -> str | None:
    """The cache format to take for ``target`` when none is named: the first row of
    :data:`~onnx_kvcache.cache.formats.CACHE_FORMATS` (fp8, int8, int4) that ``target`` runs for
    ``model``; None when it runs no quantized cache. Runtime versions are not checked here
    (the conversion's gate checks them)."""
    for name in CACHE_FORMATS:
        if check_kv_cache_support(model, target, name, granularity, runtime_version="9999").supported:
            return name
    return None


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
    warnings: tuple[str, ...] = ()
    """What to tell the user even when it runs (e.g. a build option the kernel needs)."""

    def __bool__(self) -> bool:
        return self.supported


def _format_reasons(
    row: EpCapabilities,
    ep: str,
    fmt_name: str,
    granularity: str,
    runtime_version: str | None,
    compute_capability: tuple[int, int] | None,
) -> list[str]:
    reasons: list[str] = []
    support = row.formats.get(fmt_name)
    label = row.name if row.name != "default" else repr(ep)
    if row.name == "default":
        known = ", ".join(n for n in CAPABILITIES[row.op] if n != "default")
        reasons.append(
            f"{ep!r} is not in the capability table (known: {known}; `openvino` is OpenVINO's own "
            "runtime, not onnxruntime's OpenVINO provider), so no quantized cache is known to run there."
        )
        return reasons
    if support is None:
        table = CAPABILITIES[row.op]
        others = [n for n, r in table.items() if fmt_name in r.formats]
        runs = ", ".join(row.formats) or "none"
        what = f"no {row.op} kernel" if not row.has_kernel else f"no {row.op} kernel for an {fmt_name} cache"
        why = row.unlisted.get(fmt_name)  # its kernel takes it, but the row leaves it out
        said = f"does not list {fmt_name}: {why}" if why else f"has {what}"
        reasons.append(
            f"{label} {said} (its quantized caches: {runs}); {fmt_name} runs on "
            f"{', '.join(others) or 'no provider'}."
        )
        return reasons
    if granularity not in support.granularities:
        reasons.append(f"{label} runs {fmt_name} only {', '.join(sorted(support.granularities))}.")
    version = runtime_version if runtime_version is not None else installed_version(row.runtime)
    if version is not None and _version_tuple(version) < _version_tuple(support.min_version):
        reasons.append(
            f"{row.runtime} {version} predates {support.min_version}, the first {row.runtime} known "
            f"to run an {fmt_name} cache on {label}; upgrade it."
        )
    need = support.min_compute_capability
    if need is not None and compute_capability is not None and tuple(compute_capability) < need:
        reasons.append(
            f"The GPU's compute capability {compute_capability[0]}.{compute_capability[1]} is "
            f"below {need[0]}.{need[1]}, which an {fmt_name} cache on {label} needs; use int8 "
            "or int4 on this GPU."
        )
    return reasons


def check_kv_cache_support(
    model: ModelLike | None,
    ep: str,
    format: str | None,
    granularity: str = "per_tensor",
    *,
    runtime_version: str | None = None,
    compute_capability: tuple[int, int] | None = None,
    op: str | AttentionOp = "GroupQueryAttention",
) -> SupportReport:
    """Check every requirement of a quantized cache on ``ep``; one reason per failure.

    Each attention operator in ``model`` is checked against its own rows (``op`` when no
    model is given). ``format=None`` checks a float cache: that the provider has the
    operator's kernel for the model's dtypes. ``runtime_version`` is the version of the row's
    runtime (onnxruntime, or openvino for the ``openvino`` row); it defaults to the installed
    one (unchecked when none is installed). ``compute_capability`` is checked only when given.
    """
    fmt = get_format(format) if format is not None else None
    granularity = get_granularity(granularity)
    sites = find_attention_sites(as_model(model)) if model is not None else []
    ops = _ops_in(sites) or [get_op(op)]
    reasons: list[str] = []
    warnings: list[str] = []
    name = get_capabilities(ep, ops[0]).name
    for row_op in ops:
        row = get_capabilities(ep, row_op)
        if fmt is None:
            found = (
                []
                if row.has_kernel
                else [f"{row.name if row.name != 'default' else repr(ep)} has no {row.op} kernel."]
            )
            support = None if not row.has_kernel else FormatSupport(frozenset(), "0")
        else:
            found = _format_reasons(row, ep, fmt.name, granularity, runtime_version, compute_capability)
            support = row.formats.get(fmt.name)
            if support is not None and support.warning and not found:
                warnings.append(support.warning)
        reasons += [r for r in found if r not in reasons]
        if model is None:
            continue
        label = row.name if row.name != "default" else repr(ep)
        mine = [s for s in sites if s.op is row_op]
        with_norm = [s for s in mine if s.input("q_norm_weight") is not None]
        if with_norm and not row.qk_norm:
            reasons.append(
                f"{label}'s {row.op} rejects q/k norm weights, which "
                f"{len(with_norm)} node(s) of this model use; run it on cuda or webgpu."
            )
        bad = sorted(
            {str(s.query_dtype) for s in mine if s.query_dtype is not None}
            - {str(t) for t in row.query_dtypes}
        )
        if bad and support is not None:
            reasons.append(
                f"{label}'s {row.op} takes queries of "
                f"{', '.join(sorted(str(t) for t in row.query_dtypes))}, the model's are "
                f"{', '.join(bad)}; export the model in a supported dtype."
            )
    if model is not None and not sites:
        reasons.append("The model has no GroupQueryAttention or PagedAttention node with a KV cache.")
    said = () if reasons else tuple(warnings)
    return SupportReport(name, fmt.name if fmt else "none", granularity, not reasons, tuple(reasons), said)


def conversion_warnings(model: ir.Model | None, format: str, ep: str | None = None) -> list[str]:
    """What to tell a user converting ``model`` to ``format``: the warnings of the rows of
    ``ep`` (or, with no target, of every provider that runs it) for the model's operators."""
    fmt = get_format(format)
    ops = _ops_in(find_attention_sites(model)) if model is not None else [GQA]
    found: list[str] = []
    for op in ops:
        rows = [get_capabilities(ep, op)] if ep else list(CAPABILITIES[op.op_type].values())
        for row in rows:
            support = row.formats.get(fmt.name)
            if support is not None and support.warning and support.warning not in found:
                found.append(support.warning)
    return found


@dataclasses.dataclass(frozen=True)
class FastPathRule:
    """What CUDA's quantized decode kernel (XQA) needs for one operator."""

    op: str
    head_sizes: tuple[int, ...]
    group_sizes: tuple[int, ...]
    """Allowed num_heads / kv_num_heads for a quantized cache."""
    formats: tuple[str, ...]
    """Quantized formats it reads."""
    min_compute_capability: tuple[int, int] | None = None
    needs_shared_buffer: bool = False
    """Past and present must be one buffer (GQA; paged caches always are)."""
    one_scale_tensor_before: str | None = None
    """Before this onnxruntime, k_scale and v_scale must be one tensor."""
    note: str = ""


FAST_PATHS: dict[str, FastPathRule] = {
    rule.op: rule
    for rule in (
        FastPathRule(
            GQA.op_type,
            (64, 128, 256),
            (4, 8, 16, 32),
            ("fp8", "int8"),
            needs_shared_buffer=True,
            one_scale_tensor_before="1.29",
            note="fp8 needs SM 8.9+ (the format's gate); int4 never takes XQA.",
        ),
        FastPathRule(
            PAGED.op_type,
            (64, 128, 256),
            (4, 6, 8, 16, 32),
            ("fp8", "int8"),
            min_compute_capability=(8, 0),
            note="Documented, not run here; no XQA path is documented for int4 paged caches.",
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class FastPathReport:
    """Whether CUDA's quantized decode fast path (XQA) can apply to one attention node."""

    node: str
    layer_id: int
    eligible: bool
    reasons: tuple[str, ...]
    op: str = GQA.op_type


def _shares_buffer(site: CacheSite) -> bool:
    past, present = site.past_key, site.present_key
    return bool(
        past is not None
        and present is not None
        and past.shape is not None
        and present.shape is not None
        and len(past.shape) > 2
        and len(present.shape) > 2
        and past.shape[2] == present.shape[2]
    )


def fast_path_diagnostics(
    model: ModelLike,
    *,
    ort_version: str | None = None,
    share_buffer: bool | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> list[FastPathReport]:
    """Per attention node: can CUDA's XQA decode kernel run it, and if not, why.

    The rules are :data:`FAST_PATHS`' rows. XQA needs a decode step (one new token per
    sequence, a runtime property not checked here), a listed head size, for a quantized cache
    a listed format and group size (num_heads / kv_num_heads); for GQA past and present sharing
    one buffer (``share_buffer``, e.g. genai's ``past_present_share_buffer``; inferred from the
    cache shapes when not given) and before onnxruntime 1.29 one tensor for k_scale and
    v_scale; for PagedAttention SM 8.0+ (checked when ``compute_capability`` is given).
    """
    version = ort_version if ort_version is not None else installed_ort_version()
    reports = []
    for site in find_attention_sites(as_model(model)):
        rule = FAST_PATHS[site.op.op_type]
        reasons = []
        fmt = site.cache_format
        quantized = fmt is not None
        head = site.head_size()  # the format's row says whether the cache is packed
        if head not in rule.head_sizes:
            reasons.append(f"head size {head} is not one of {rule.head_sizes}")
        group = site.num_heads // max(site.kv_num_heads, 1)
        if quantized and group not in rule.group_sizes:
            reasons.append(f"group size {group} (num_heads / kv_num_heads) is not one of {rule.group_sizes}")
        if fmt is not None and fmt.name not in rule.formats:
            reasons.append(f"XQA reads {'/'.join(rule.formats)} caches, not {fmt.name}")
        need = rule.min_compute_capability
        if need is not None and compute_capability is not None and tuple(compute_capability) < need:
            reasons.append(
                "the GPU's compute capability {}.{} is below {}.{}".format(*compute_capability, *need)
            )
        if rule.needs_shared_buffer:
            shared = share_buffer if share_buffer is not None else _shares_buffer(site)
            if not shared:
                reasons.append("past and present caches do not share one buffer")
        before = rule.one_scale_tensor_before
        if quantized and before and version is not None and _version_tuple(version) < _version_tuple(before):
            k = site.input("k_scale")
            if k is None or k is not site.input("v_scale"):
                reasons.append(
                    Message(
                        f"onnxruntime {version} < {before} needs k_scale and v_scale to be one tensor "
                        "(convert with ",
                        Param("shared_kv_scale", True),
                        ")",
                    )
                )
        reports.append(FastPathReport(site.name, site.layer_id, not reasons, tuple(reasons), site.op.op_type))
    return reports


def _format_cell(row: EpCapabilities, name: str) -> str:
    support = row.formats.get(name)
    if support is None:
        return "no"
    runtime = "ORT" if row.runtime == "onnxruntime" else row.runtime
    cell = f"{runtime} >= {support.min_version}, " + " + ".join(sorted(support.granularities))
    if support.min_compute_capability:
        cell += ", SM {}.{}+".format(*support.min_compute_capability)
    cell += f" ({support.evidence})"
    if support.note:
        cell += f"; {support.note}"
    if support.warning:
        cell += " Warns at conversion."
    return cell


def render_capability_table() -> str:
    """The capability tables (one per operator) and the fast-path rules, as Markdown."""

    lines: list[str] = []
    for op_type, table in CAPABILITIES.items():
        if lines:
            lines.append("")
        lines += [
            f"**{op_type}**",
            "",
            "| provider | query dtypes | q/k norm | " + " | ".join(CACHE_FORMATS) + " | note |",
            "|---|---|---|" + "---|" * len(CACHE_FORMATS) + "---|",
        ]
        for row in table.values():
            cells = [_format_cell(row, name) for name in CACHE_FORMATS]
            dtypes = ", ".join(sorted(t.name.lower() for t in row.query_dtypes)) or "- (no kernel)"
            label = f"`{row.name}` ({row.provider})" if row.provider else f"`{row.name}`"
            norm = "yes" if row.qk_norm else "no"
            lines.append(f"| {label} | {dtypes} | {norm} | " + " | ".join(cells) + f" | {row.note} |")
    lines += [
        "",
        "**CUDA decode fast path (XQA)**",
        "",
        "| operator | head sizes | group sizes (quantized) | formats | GPU | other | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for rule in FAST_PATHS.values():
        other = []
        if rule.needs_shared_buffer:
            other.append("past and present share one buffer")
        if rule.one_scale_tensor_before:
            other.append(f"one k/v scale tensor before ORT {rule.one_scale_tensor_before}")
        gpu = "SM {}.{}+".format(*rule.min_compute_capability) if rule.min_compute_capability else "-"
        heads, groups = ", ".join(map(str, rule.head_sizes)), ", ".join(map(str, rule.group_sizes))
        lines.append(
            f"| {rule.op} | {heads} | {groups} | {', '.join(rule.formats)} | {gpu} | "
            f"{'; '.join(other) or '-'} | {rule.note} |"
        )
    return "\n".join(lines)
