"""What ``convert`` would do to a model, decided on a copy: ``inspect``'s preview of an export.

An export has no GroupQueryAttention node until its attention is fused, so its cache cannot be
read from the graph as it is. :func:`preview_conversion` takes :mod:`~onnx_kvcache.pipeline.decision`'s
decision for ``convert_model`` (no format named: the target's first) on a clone of the graph: the
fusion (:func:`~onnx_kvcache.pipeline.decision.fuse_unless_attention`), the target, the format and
granularity it would take, and the refusal ``convert`` would print. Nothing is quantized and the
model given is never changed (nor is any file written); weights are not read.
"""

from __future__ import annotations

__all__ = ["Preview", "StoragePreview", "preview_conversion", "speed_line"]

import dataclasses
from collections.abc import Mapping
from typing import Any

import onnx_ir as ir

from onnx_kvcache.cache.layout import CacheModelInfo, inspect_kv_cache
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.cache.storage import find_qdq_caches, storage_bytes_per_token, stored_format
from onnx_kvcache.model_io.reading import check_defined
from onnx_kvcache.pipeline.decision import AUTO, Decision, Entry, Request, decide
from onnx_kvcache.pipeline.storage_decision import QDQ


@dataclasses.dataclass(frozen=True)
class StoragePreview:
    """What ``convert_model(storage="qdq")`` would do to a model whose caches its own attention
    holds (:func:`~onnx_kvcache.cache.storage.find_qdq_caches`)."""

    caches: int
    stored: str | None
    """The format they are stored in already (None: float)."""
    format: str | None
    """The format they would be stored in (int8 unless named; None: refused)."""
    bytes_per_token: float | None
    bytes_per_token_after: float | None
    refusal: object | None

    def to_json(self, render: Any = str) -> dict[str, Any]:
        doc = {k: v for k, v in dataclasses.asdict(self).items() if k != "refusal"}
        return doc | {"refused": None if self.refusal is None else render(self.refusal)}


@dataclasses.dataclass(frozen=True)
class Preview:
    """``convert_model``'s decision for a model, taken on its copy."""

    fused: int
    """Attention layers the fusion turned into GroupQueryAttention (0: none, or no fusion ran)."""
    cache: CacheModelInfo
    """The cache of the fused copy (float, as converting would find it)."""
    target: str | None
    target_source: str
    """``"given"``, or how the target was inferred."""
    format: str | None
    granularity: str
    bytes_per_token_after: float | None
    """Cache bytes per token once converted (None: refused)."""
    refusal: object | None
    """What ``convert`` would say instead of converting (a :class:`~onnx_kvcache.errors.Message`)."""
    float16_attention: bool = False
    """The attention would compute in float16 (a float32 model for CUDA)."""
    storage: StoragePreview | None = None
    """Where nothing fuses and the model's own attention holds its caches: ``storage="qdq"``'s."""

    def to_json(self, render: Any = str) -> dict[str, Any]:
        """The preview as ``inspect --json`` gives it (``render``: a message to text)."""
        return {
            "fused_layers": self.fused,
            "target": self.target,
            "target_source": self.target_source,
            "format": self.format,
            "granularity": self.granularity,
            "bytes_per_token_after": self.bytes_per_token_after,
            "float16_attention": self.float16_attention,
            "refused": None if self.refusal is None else render(self.refusal),
            "storage": None if self.storage is None else self.storage.to_json(render),
        }


#: What a converted cache costs in time on the CPU, by format and whether its prompt runs through
#: the float kernel: SmolLM2-135M in onnxruntime-genai 0.18 (onnxruntime 1.32), its prefill and
#: decode against the float32 folder's at 1,000 to 8,000 tokens (docs/choosing-a-format.md#speed-on-the-cpu).
_MEASURED = {
    ("int8", True): "0.99x to 1.00x float32's prefill time and 1.15x to 1.91x its decode speed",
    ("int4", True): "1.04x to 1.08x float32's prefill time and 1.11x to 1.80x its decode speed",
    ("int8", False): "2.7x float32's prefill time at 4,000 tokens, 3.5x at 8,000",
    ("int4", False): "3.3x float32's prefill time at 4,000 tokens",
}
_HOW = {
    True: "a prompt at float speed (it attends through the float kernel), decode reading {ratio} fewer "
    "cache bytes",
    False: "a prompt through the quantized kernel, whose time grows with the prompt's square faster "
    "than the float kernel's",
}


def speed_line(target: str | None, fmt: str | None, prompt_in_float: bool, ratio: float) -> str | None:
    """What a cache in ``fmt`` costs in time on ``target``, as ``inspect`` says it (None: a
    float cache, or a provider or format not measured here)."""
    measured = _MEASURED.get((fmt or "", prompt_in_float)) if target == "cpu" else None
    if measured is None:
        return None
    how = _HOW[prompt_in_float].format(ratio=f"{ratio:.0f}x")
    return f"speed on {target}: {how}; measured on SmolLM2-135M at 1,000 to 8,000 tokens: {measured}"


def _bytes_after(decision: Decision) -> float | None:
    """Cache bytes per token of the decided model once in the decided format."""
    if not decision.converted or decision.format is None:
        return None
    fmt = decision.format
    sites = {id(s.past_key): s for s in find_attention_sites(decision.model)}.values()
    return sum(len(s.sides) * s.kv_num_heads * s.head_size() * fmt.bytes_per_value() for s in sites)


def preview_conversion(
    model: ir.Model, ep: str | None = None, genai_config: Mapping[str, Any] | None = None
) -> Preview:
    """What ``convert_model(model, ep=ep)`` would decide, on a copy of ``model``'s graph."""
    check_defined(model.graph)
    request = Request(
        model.clone(), Entry.CONVERT, target=ep or AUTO, genai_config=genai_config, verify=False
    )  # a preview reads no weights: the fusion is verified when converting
    decision = decide(request)
    storage = None if decision.fusion.fused else _storage_preview(request)
    refusal = decision.message if decision.refusals else None
    return Preview(
        fused=decision.fusion.fused,
        cache=inspect_kv_cache(decision.model),
        target=decision.target,
        target_source=decision.why or ("given" if decision.target is not None else ""),
        format=decision.format.name if decision.format is not None else None,
        granularity=decision.granularity.name if decision.granularity is not None else "per_tensor",
        bytes_per_token_after=_bytes_after(decision),
        refusal=storage.refusal if storage is not None and storage.stored else refusal,
        float16_attention=decision.adaptation is not None,
        storage=storage,
    )


def _storage_preview(request: Request) -> StoragePreview | None:
    """``storage="qdq"``'s decision for the request's model (None: no cache it keeps)."""
    model = request.model
    caches = find_qdq_caches(model.graph)
    if not caches:
        return None
    decision = decide(dataclasses.replace(request, storage=QDQ))
    fmt = decision.format.name if decision.format is not None and not decision.refusals else None
    return StoragePreview(
        caches=len(caches),
        stored=stored_format(model),
        format=fmt,
        bytes_per_token=storage_bytes_per_token(model),
        bytes_per_token_after=storage_bytes_per_token(model, fmt) if fmt is not None else None,
        refusal=decision.message if decision.refusals else None,
    )
