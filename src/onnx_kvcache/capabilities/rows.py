"""Who can run what: one frozen row per attention operator and execution provider.

A row lists the query dtypes the provider's kernel for the operator takes and, per cache
format, the granularities it runs, the first version of its runtime that has it
(onnxruntime for its execution providers; OpenVINO, a second runtime for the same files,
for its row), where the hardware matters the minimum CUDA compute capability, whether the
fact was run here or is documented only, and what a user must be told at conversion.
Gating (:mod:`.gating`), ``optimize_model``, the doctor and the docs page (:mod:`.rendering`)
all read :data:`CAPABILITIES` (:data:`EP_CAPABILITIES` is its GroupQueryAttention table); the
decode fast path's requirements are rows of :data:`FAST_PATHS`. Adding a provider or an
operator is adding rows. Only rows here: nothing reads a model.
"""

from __future__ import annotations

__all__ = [
    "CAPABILITIES",
    "EP_CAPABILITIES",
    "FAST_PATHS",
    "EpCapabilities",
    "FastPathRule",
    "FormatSupport",
    "PAGED_CAPABILITIES",
    "STORAGE_CAPABILITIES",
    "SinkSupport",
    "get_capabilities",
]

import dataclasses
from collections.abc import Mapping
from typing import Literal

import onnx_ir as ir

from onnx_kvcache.cache.operators import GQA, PAGED, AttentionOp, get_op
from onnx_kvcache.errors import require_type

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
    window_cache_head_multiple: int = 0
    """A window-sized cache (GQA's ``sliding_window_cache=1``, genai's builder for Gemma-2's
    window layers) runs only with a head size that is a multiple of this (0: any)."""
    prompt_in_float: bool = False
    """Multi-token calls (the prompt) attend through the float kernel, the cache stored by the
    quantized kernel's rule (:class:`~onnx_kvcache.passes.PromptFloatAttentionPass`):
    the provider's quantized kernel is several times slower than its float kernel on a prompt."""


@dataclasses.dataclass(frozen=True)
class SinkSupport:
    """Attention sinks (``head_sink``, gpt-oss: one logit per query head in the softmax's
    denominator) on one provider's kernel."""

    min_version: str
    """First version of the row's runtime whose kernel honors them (a float cache)."""
    formats: frozenset[str]
    """The quantized cache formats it honors them with."""
    evidence: Evidence = "documented"
    note: str = ""


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
    ``search.past_present_share_buffer``; the model builder sets it for CUDA only, and it holds
    on the CPU too, where every decode step otherwise copies the cache)."""
    op: str = GQA.op_type
    """The attention operator of the row."""
    unlisted: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Formats its kernel takes that the row does not list, and why (said when refusing them)."""
    rotation: Evidence | None = None
    """Runs the operators a rotated cache adds before the attention node (com.microsoft
    ``RotaryEmbedding`` where RoPE moves out of it, ``MatMul``, ``Reshape``, ``Split``, and
    for q/k norms ``ReduceMean``, ``Sqrt``, ``Div``): how that is known; None: not known to
    (a rotated cache is refused there)."""
    head_sink: SinkSupport | None = None
    """Attention sinks (GQA and PagedAttention input 11); None: not known to be honored."""
    query_seqlens: str = ""
    """First version of the runtime whose GQA takes ``query_seqlens`` (input 16: each row's valid
    new tokens; the fusion writes it for rolling window caches), "" for none (its schema says other
    providers must reject a node with it)."""

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
            # prompt_in_float: the quantized kernel's prefill took 2.7x (int8) and 3.4x (int4) the
            # float kernel's at 4,000 tokens on SmolLM2-135M, 1.0x through the float kernel
            # (onnxruntime 1.32, benchmarks/cpu_prefill.md)
            "int8": FormatSupport(_BOTH, "1.27", evidence=_RUN, prompt_in_float=True),
            # onnxruntime 1.32 at run time: "sliding_window_cache: head_size (16) must be a
            # multiple of 32 for a 4-bit KV cache" (tests/capabilities/test_gating.py runs it)
            "int4": FormatSupport(
                _BOTH, "1.27", evidence=_RUN, window_cache_head_multiple=32, prompt_in_float=True
            ),
        },
        "No fp8 kernel and no q/k norm inputs: evaluate either through emulation.",
        # onnxruntime 1.32 + onnxruntime-genai 0.18 (benchmarks/genai_share_buffer_check.py on
        # SmolLM2-135M int8/int4): the same logits, bit for bit, with past and present in one
        # buffer, for batch 1, a left-padded batch of 2 and beam search; decode then copies no cache
        share_buffer=True,
        rotation=_RUN,
        query_seqlens="1.32",
        head_sink=SinkSupport(
            "1.23",
            frozenset({"int8", "int4"}),
            evidence=_RUN,
            note="onnxruntime PR 25269 (1.23); run here (1.32: float, int8 and int4 caches, float32 "
            "and float16 queries, windows and window-sized caches, against numpy)",
        ),
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
        rotation="documented",
        query_seqlens="1.32",
        head_sink=SinkSupport(
            "1.23",
            frozenset({"fp8", "int8", "int4"}),
            note="flash attention's path (SM 8.0+, onnxruntime PR 25432, 1.23), quantized caches "
            "through it (1.25+); the decode fast path (XQA) is skipped for nodes with sinks (smooth "
            "softmax); older GPUs' memory-efficient path unsettled. Read from the sources, not run here",
        ),
    ),
    EpCapabilities("dml", "DmlExecutionProvider", frozenset({ir.DataType.FLOAT16, ir.DataType.FLOAT}), {}),
    EpCapabilities(
        "webgpu",
        "WebGpuExecutionProvider",
        frozenset({ir.DataType.FLOAT16, ir.DataType.FLOAT}),
        {},
        "Quantizes caches only through its kvCacheQuantizationBits EP option, inside float tensors.",
        qk_norm=True,
        head_sink=SinkSupport(
            "1.25",
            frozenset(),
            note="its flash attention takes them since onnxruntime PR 27410 (merged February 2026: "
            "1.25 is the first release after it, unsettled)",
        ),
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
        "onnxruntime's rule (one fp8 step in 0.3% of values, measured on 2026.4.1): not listed. "
        "Its GroupQueryAttention takes 16 inputs at most (no query_seqlens) and no softcap "
        "(2026.4.1).",
        runtime="openvino",
        rotation=_RUN,
        head_sink=SinkSupport(
            "2026.4",
            frozenset({"int8", "int4"}),
            evidence=_RUN,
            note="run here (2026.4.1: float, int8 and int4 caches, against numpy)",
        ),
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
        head_sink=SinkSupport(
            "1.30",
            frozenset({"fp8", "int8", "int4"}),
            note="onnxruntime PR 29912, with its quantized caches (" + _PAGED_1_29 + ")",
        ),
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

#: ``storage="qdq"``: which provider runs a cache stored through QuantizeLinear/DequantizeLinear
#: (:class:`~onnx_kvcache.passes.QdqKvCachePass`): the operators of the format's type at the
#: model's opset (int8 10, fp8 19, int4 21) and, for int8, TensorScatter and Concat on int8; the
#: attention is the model's own. A provider without a row is refused.
STORAGE_CAPABILITIES: dict[str, EpCapabilities] = {
    row.name: row
    for row in (
        EpCapabilities(
            "cpu",
            "CPUExecutionProvider",
            _CPU_T,
            {
                name: FormatSupport(
                    _BOTH,
                    "1.32",
                    evidence=_RUN,
                    note="tests/passes/test_qdq_kv_cache.py; earlier versions unsettled",
                )
                for name in ("fp8", "int8", "int4")
            },
            "fp8 and int4 have no TensorScatter kernel and Concat's schema lacks them: their static "
            "buffers and MLA caches are dequantized and quantized again whole, each step.",
            op="QuantizeLinear",
        ),
        EpCapabilities(
            "openvino",
            "",
            frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16}),
            {
                "int8": FormatSupport(
                    _BOTH,
                    "2026.4",
                    evidence=_RUN,
                    note="2026.4.1, DeepSeek-V3's MLA export (tests/test_openvino.py): codes identical "
                    "per channel, a few one step off per tensor, logits within 1e-3 of their largest; static "
                    "builds do not load there (no TensorScatter rule), float or not",
                ),
            },
            "fp8 and int4 not run here.",
            runtime="openvino",
            op="QuantizeLinear",
        ),
    )
}

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
