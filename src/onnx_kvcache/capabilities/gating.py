"""Gating: what the capability rows (:mod:`.rows`) say about one model on one provider.

Every failed requirement is a :class:`~onnx_kvcache.capabilities.refusals.Refusal` (a code, the
parameter it concerns, its text); :func:`infer_target` says where a model will run when the user
did not, :func:`default_format` the format to take there, :func:`conversion_warnings` what to tell
a user converting, :func:`fast_path_diagnostics` whether CUDA's decode fast path applies.
"""

from __future__ import annotations

__all__ = [
    "NO_ATTENTION",
    "FastPathReport",
    "SupportReport",
    "check_kv_cache_support",
    "conversion_warnings",
    "default_format",
    "fast_path_diagnostics",
    "infer_target",
    "storage_refusals",
]

import dataclasses
import re
from collections.abc import Mapping

import onnx_ir as ir

from onnx_kvcache.cache.formats import CACHE_FORMATS, get_format, get_granularity
from onnx_kvcache.cache.operators import GQA, AttentionOp, get_op
from onnx_kvcache.cache.rotation import get_rotation
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.capabilities.refusals import Parameter, Refusal, RefusalCode, texts
from onnx_kvcache.capabilities.rows import (
    CAPABILITIES,
    FAST_PATHS,
    STORAGE_CAPABILITIES,
    EpCapabilities,
    FormatSupport,
    get_capabilities,
)
from onnx_kvcache.errors import Message, Param, require_optional_flags
from onnx_kvcache.model_io import MARKER_KEY, converted_for, installed_ort_version, installed_version
from onnx_kvcache.model_io.genai_folder import provider_names
from onnx_kvcache.model_io.reading import ModelLike, as_model


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
    """Whether a cache format runs on a provider, and every refusal (a reason it does not)."""

    ep: str
    format: str
    granularity: str
    supported: bool
    refusals: tuple[Refusal, ...]
    warnings: tuple[str, ...] = ()
    """What to tell the user even when it runs (e.g. a build option the kernel needs)."""

    @property
    def reasons(self) -> tuple[str, ...]:
        """The refusals' texts."""
        return texts(self.refusals)

    def __bool__(self) -> bool:
        return self.supported


def _label(row: EpCapabilities, ep: str) -> str:
    return row.name if row.name != "default" else repr(ep)


def _unknown_provider(row: EpCapabilities, ep: str) -> Refusal:
    known = ", ".join(n for n in CAPABILITIES[row.op] if n != "default")
    return Refusal(
        RefusalCode.UNKNOWN_PROVIDER,
        Parameter.EP,
        f"{ep!r} is not in the capability table (known: {known}; `openvino` is OpenVINO's own "
        "runtime, not onnxruntime's OpenVINO provider), so no quantized cache is known to run there.",
    )


def _unlisted_format(row: EpCapabilities, ep: str, fmt_name: str) -> Refusal:
    others = [n for n, r in CAPABILITIES[row.op].items() if fmt_name in r.formats]
    runs = ", ".join(row.formats) or "none"
    what = f"no {row.op} kernel" if not row.has_kernel else f"no {row.op} kernel for an {fmt_name} cache"
    why = row.unlisted.get(fmt_name)  # its kernel takes it, but the row leaves it out
    said = f"does not list {fmt_name}: {why}" if why else f"has {what}"
    code = RefusalCode.NO_KERNEL if not row.has_kernel else RefusalCode.FORMAT_UNSUPPORTED
    where = ", ".join(others) or "no provider"
    text = f"{_label(row, ep)} {said} (its quantized caches: {runs}); {fmt_name} runs on {where}."
    return Refusal(code, Parameter.FORMAT, text)


def _format_refusals(
    row: EpCapabilities,
    ep: str,
    fmt_name: str,
    granularity: str,
    runtime_version: str | None,
    compute_capability: tuple[int, int] | None,
) -> list[Refusal]:
    support = row.formats.get(fmt_name)
    label = _label(row, ep)
    if row.name == "default":
        return [_unknown_provider(row, ep)]
    if support is None:
        return [_unlisted_format(row, ep, fmt_name)]
    found: list[Refusal] = []
    if granularity not in support.granularities:
        text = f"{label} runs {fmt_name} only {', '.join(sorted(support.granularities))}."
        found.append(Refusal(RefusalCode.GRANULARITY_UNSUPPORTED, Parameter.GRANULARITY, text))
    version = runtime_version if runtime_version is not None else installed_version(row.runtime)
    if version is not None and _version_tuple(version) < _version_tuple(support.min_version):
        text = (
            f"{row.runtime} {version} predates {support.min_version}, the first {row.runtime} known "
            f"to run an {fmt_name} cache on {label}; upgrade it."
        )
        found.append(Refusal(RefusalCode.RUNTIME_TOO_OLD, None, text))
    need = support.min_compute_capability
    if need is not None and compute_capability is not None and tuple(compute_capability) < need:
        text = (
            f"The GPU's compute capability {compute_capability[0]}.{compute_capability[1]} is "
            f"below {need[0]}.{need[1]}, which an {fmt_name} cache on {label} needs; use int8 "
            "or int4 on this GPU."
        )
        found.append(Refusal(RefusalCode.COMPUTE_CAPABILITY_TOO_LOW, Parameter.FORMAT, text))
    return found


def storage_refusals(
    ep: str, fmt_name: str, granularity: str, runtime_version: str | None = None
) -> tuple[Refusal, ...]:
    """Every refusal of a cache stored through QuantizeLinear/DequantizeLinear (``storage="qdq"``)
    on ``ep``: :data:`~.rows.STORAGE_CAPABILITIES` has no row for it, its row does not list the
    format or granularity, or the installed runtime predates the row's version."""
    key = get_capabilities(ep).name  # aliases resolved: CUDAExecutionProvider is cuda
    row = STORAGE_CAPABILITIES.get(key)
    listed = ", ".join(f"{n} ({', '.join(r.formats)})" for n, r in STORAGE_CAPABILITIES.items())
    if row is None or fmt_name not in row.formats:
        label = key if key != "default" else repr(ep)
        text = (
            f"{label} is not known to run an {fmt_name} cache stored through QuantizeLinear/"
            f"DequantizeLinear (known: {listed})."
        )
        return (Refusal(RefusalCode.FORMAT_UNSUPPORTED, Parameter.EP, text),)
    return tuple(_format_refusals(row, ep, fmt_name, granularity, runtime_version, None))


def _rotation_refusals(row: EpCapabilities, ep: str) -> list[Refusal]:
    """A rotated cache (:mod:`~onnx_kvcache.cache.rotation`) on ``row``: its operator must be
    GroupQueryAttention and the provider known to run the operators it adds."""
    if row.op != "GroupQueryAttention":
        text = f"a rotated cache is for GroupQueryAttention; this model's {row.op} caches take rotation none."
    elif row.rotation is None:
        text = (
            f"{_label(row, ep)} is not known to run the operators a rotated cache adds (com.microsoft "
            "RotaryEmbedding, MatMul); convert with rotation none."
        )
    else:
        return []
    return [Refusal(RefusalCode.ROTATION_UNSUPPORTED, Parameter.ROTATION, text)]


def _site_refusals(
    row: EpCapabilities,
    ep: str,
    sites: list[CacheSite],
    support: FormatSupport | None,
    fmt: str | None = None,
    runtime_version: str | None = None,
    rotated: bool = False,
) -> list[Refusal]:
    """What the model's own nodes of ``row``'s operator need that ``row`` lacks (``rotated``:
    the rotation moves q/k norms out of the nodes)."""
    label = _label(row, ep)
    mine = [s for s in sites if s.op.op_type == row.op]
    found = []
    with_norm = [s for s in mine if s.input("q_norm_weight") is not None and not rotated]
    if with_norm and not row.qk_norm:
        text = (
            f"{label}'s {row.op} rejects q/k norm weights, which "
            f"{len(with_norm)} node(s) of this model use; run it on cuda or webgpu."
        )
        found.append(Refusal(RefusalCode.QK_NORM_UNSUPPORTED, Parameter.EP, text))
    bad = sorted(
        {str(s.query_dtype) for s in mine if s.query_dtype is not None} - {str(t) for t in row.query_dtypes}
    )
    if bad and support is not None:
        text = (
            f"{label}'s {row.op} takes queries of "
            f"{', '.join(sorted(str(t) for t in row.query_dtypes))}, the model's are "
            f"{', '.join(bad)}; export the model in a supported dtype."
        )
        found.append(Refusal(RefusalCode.QUERY_DTYPE_UNSUPPORTED, Parameter.EP, text))
    chunked = [s for s in mine if s.op.op_type == GQA.op_type and s.input("query_seqlens") is not None]
    found += _query_seqlens_refusals(row, label, chunked, runtime_version)
    sunk = [s for s in mine if s.input("head_sink") is not None]
    found += _sink_refusals(row, label, sunk, fmt, runtime_version)
    multiple = support.window_cache_head_multiple if support is not None else 0
    windowed = [s for s in mine if multiple and _window_sized(s) and s.head_size() % multiple]
    if windowed:
        text = (
            f"{label}'s {row.op} runs a window-sized cache (sliding_window_cache=1, "
            f"{len(windowed)} node(s) of this model) in this format only with a head size that is a "
            f"multiple of {multiple}, the model's is {windowed[0].head_size()}."
        )
        found.append(Refusal(RefusalCode.FORMAT_UNSUPPORTED, Parameter.FORMAT, text))
    return found


def _query_seqlens_refusals(
    row: EpCapabilities, label: str, chunked: list[CacheSite], runtime_version: str | None
) -> list[Refusal]:
    """Nodes with ``query_seqlens`` (input 16) on a row whose kernel does not take it, or whose
    runtime predates it."""
    if not chunked or not row.has_kernel or row.name == "default":
        return []
    if not row.query_seqlens:
        takes = [n for n, r in CAPABILITIES[row.op].items() if r.query_seqlens]
        text = (
            f"{label}'s {row.op} rejects query_seqlens (input 16: each row's valid new tokens, what the "
            f"fusion writes for rolling window caches), which {len(chunked)} node(s) of this model use; "
            f"run it on {', '.join(takes)}."
        )
        return [Refusal(RefusalCode.INPUT_UNSUPPORTED, Parameter.EP, text)]
    return _too_old(row, row.query_seqlens, runtime_version, f"whose {row.op} takes query_seqlens (input 16)")


def _too_old(row: EpCapabilities, first: str, runtime_version: str | None, what: str) -> list[Refusal]:
    """A refusal when the row's runtime (``runtime_version``, else the installed one) predates
    ``first``, the first version ``what``."""
    version = runtime_version if runtime_version is not None else installed_version(row.runtime)
    if version is None or _version_tuple(version) >= _version_tuple(first):
        return []
    text = f"{row.runtime} {version} predates {first}, the first {row.runtime} {what}; upgrade it."
    return [Refusal(RefusalCode.RUNTIME_TOO_OLD, None, text)]


def _sink_refusals(
    row: EpCapabilities, label: str, sunk: list[CacheSite], fmt: str | None, runtime_version: str | None
) -> list[Refusal]:
    """Nodes with attention sinks (``head_sink``) on a row that does not honor them with ``fmt``
    (None: a float cache), or whose runtime predates them."""
    sinks = row.head_sink
    if not sunk or not row.has_kernel or row.name == "default":
        return []
    if sinks is not None and (fmt is None or fmt in sinks.formats):
        return _too_old(row, sinks.min_version, runtime_version, f"known to honor attention sinks on {label}")
    runs = [
        n
        for n, r in CAPABILITIES[row.op].items()
        if r.head_sink and (fmt is None or fmt in r.head_sink.formats)
    ]
    cache = f"an {fmt} cache" if fmt else "a float cache"
    text = (
        f"{label}'s {row.op} is not known to honor attention sinks (head_sink, gpt-oss's) with {cache}, "
        f"which {len(sunk)} node(s) of this model use; run it on {', '.join(runs) or 'no known provider'}."
    )
    return [Refusal(RefusalCode.HEAD_SINK_UNSUPPORTED, Parameter.EP, text)]


def _window_sized(site: CacheSite) -> bool:
    """The site keeps a window-sized cache (``sliding_window_cache=1`` with a window)."""
    return bool(site.int_attr("sliding_window_cache", 0)) and site.int_attr("local_window_size", -1) > 0


def _row_refusals(
    row: EpCapabilities,
    ep: str,
    fmt: str | None,
    granularity: str,
    runtime: tuple[str | None, tuple[int, int] | None],
) -> tuple[list[Refusal], FormatSupport | None]:
    """The refusals of one row for a format (``None``: a float cache), and the row's support."""
    if fmt is None:
        if row.has_kernel:
            return [], FormatSupport(frozenset(), "0")
        text = f"{_label(row, ep)} has no {row.op} kernel."
        return [Refusal(RefusalCode.NO_KERNEL, Parameter.EP, text)], None
    return _format_refusals(row, ep, fmt, granularity, *runtime), row.formats.get(fmt)


NO_ATTENTION = Refusal(
    RefusalCode.NO_ATTENTION,
    None,
    "The model has no GroupQueryAttention or PagedAttention node with a KV cache.",
)


def check_kv_cache_support(
    model: ModelLike | None,
    ep: str,
    format: str | None,
    granularity: str = "per_tensor",
    *,
    runtime_version: str | None = None,
    compute_capability: tuple[int, int] | None = None,
    op: str | AttentionOp = "GroupQueryAttention",
    rotation: str = "none",
) -> SupportReport:
    """Check every requirement of a quantized cache on ``ep``; one refusal per failure.

    Each attention operator in ``model`` is checked against its own rows (``op`` when no
    model is given). ``format=None`` checks a float cache: that the provider has the
    operator's kernel for the model's dtypes. ``runtime_version`` is the version of the row's
    runtime (onnxruntime, or openvino for the ``openvino`` row); it defaults to the installed
    one (unchecked when none is installed). ``compute_capability`` is checked only when given.
    ``rotation``: the cache will be rotated (:mod:`~onnx_kvcache.cache.rotation`): the row must
    run the operators that adds, and q/k norms move out of the nodes.
    """
    rotated = get_rotation(rotation).rotates
    fmt = get_format(format).name if format is not None else None
    granularity = get_granularity(granularity)
    sites = find_attention_sites(as_model(model)) if model is not None else []
    ops = _ops_in(sites) or [get_op(op)]
    refusals: list[Refusal] = []
    warnings: list[str] = []
    for row_op in ops:
        row = get_capabilities(ep, row_op)
        found, support = _row_refusals(row, ep, fmt, granularity, (runtime_version, compute_capability))
        if fmt is not None and support is not None and support.warning and not found:
            warnings.append(support.warning)
        refusals += [r for r in found if r not in refusals]
        if rotated and (model is None or any(s.op.op_type == row.op for s in sites)):
            refusals += _rotation_refusals(row, ep)
        if model is not None:
            refusals += _site_refusals(row, ep, sites, support, fmt, runtime_version, rotated)
    if model is not None and not sites:
        refusals.append(NO_ATTENTION)
    said = () if refusals else tuple(warnings)
    name = get_capabilities(ep, ops[0]).name
    return SupportReport(name, fmt or "none", granularity, not refusals, tuple(refusals), said)


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
    require_optional_flags(share_buffer=share_buffer)
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
