"""Fuse exported attention into GroupQueryAttention.

In order: :class:`CachedAttentionFusionPass` (the ONNX ``Attention`` operator holding its
own cache, as mobius's default build writes it), :class:`AttentionFusionPass` (the ONNX
``Attention`` operator that ``torch.onnx.export(..., opset_version=23)`` writes),
:class:`DecomposedAttentionFusionPass` (the same exports below opset 23, and TorchScript
exports). Each fuses only what it proves (docs/exporting.md, "What is proven"); nothing
else rewrites attention. The attentions that none of them fuses are reported in one
:class:`KvCacheWarning` (:func:`summarize_refusals`: reasons grouped, with counts; each
node is logged at INFO), and so is what a fused padding mask assumes
(:data:`PADDING_WARNING`). Chains before :class:`KvCacheQuantizationPass` in an
``ir.passes.PassManager``. Whether an export fuses depends on the exporter; count the
GQA nodes afterwards.
"""

from __future__ import annotations

__all__ = [
    "FUSIONS",
    "PADDING_WARNING",
    "ROLLING_WINDOW_WARNING",
    "WINDOW_PADDING_WARNING",
    "GqaFusionPass",
    "fusion_candidates",
    "summarize_refusals",
    "unfused_refusal",
]

import logging
import warnings
from collections.abc import Sequence

import onnx_ir as ir

from onnx_kvcache.cache.rolling import rolling_attention, split_window_lengths
from onnx_kvcache.errors import FusionSkippedWarning, KvCacheError, PaddingAssumptionWarning, warn
from onnx_kvcache.passes._base import InPlacePass
from onnx_kvcache.passes.fusion._base import (
    FusionPass,
    FusionRefusal,
    FusionReport,
    FusionResult,
    summarize_refusals,
)
from onnx_kvcache.passes.fusion._match import remove_dead
from onnx_kvcache.passes.fusion._unknown_attention import unknown_attentions
from onnx_kvcache.passes.fusion.attention_fusion import AttentionFusionPass
from onnx_kvcache.passes.fusion.cached_attention_fusion import CachedAttentionFusionPass
from onnx_kvcache.passes.fusion.sdpa_fusion import DecomposedAttentionFusionPass
from onnx_kvcache.passes.fusion.window_sized import make_window_sized

logger = logging.getLogger(__name__)

#: Said once when a fused attention reads the export's attention_mask.
PADDING_WARNING = (
    "fused attention: a prompt padded anywhere computes as the export does at valid positions; every "
    "later step needs a nonzero attention_mask entry per row (a paused row computes wrong results; "
    "docs/exporting.md)."
)
#: Added when a fused attention with a padding mask also has a sliding window.
WINDOW_PADDING_WARNING = (
    "Sliding-window layers differ from the export for rows with padding after their first token "
    "(right padding, padding inside a prompt): the export counts that padding inside the window, "
    "the fused attention does not. Left-pad batches for those."
)

#: Added when a fused attention with a padding mask had a rolling window cache.
ROLLING_WINDOW_WARNING = (
    "Layers whose export keeps only its last window - 1 tokens (a rolling window cache, transformers "
    "5.x) keep the export's caches (an empty past first, each row's last window - 1 tokens in its "
    "present) and count each row's tokens over the whole attention_mask, so a padded row attends to its "
    "own last window tokens, as transformers does; the export reads its mask's first past + seq columns, "
    "and computes the same for a padded row only when given its cache's columns (the mask's last "
    "past + seq; docs/exporting.md, Rolling window caches)."
)


#: Our fusions, in the order :class:`GqaFusionPass` runs them: the one list the pass, its
#: :func:`fusion_candidates` and the quantization passes' ``UnfusedAttentionWarning`` read.
FUSIONS: tuple[type[FusionPass], ...] = (
    CachedAttentionFusionPass,
    AttentionFusionPass,
    DecomposedAttentionFusionPass,
)


def _has_window_caches(model: ir.Model) -> bool:
    return any(rolling_attention(node) for node in model.graph)


def _attr(node: ir.Node, name: str) -> int:
    attr = node.attributes.get(name)
    return attr.as_int() if attr is not None else 0


class GqaFusionPass(InPlacePass):
    """Fuse ONNX Attention (holding its own cache or not), then decomposed attention."""

    def __init__(self) -> None:
        super().__init__()
        self.report = FusionReport()
        """What our fusions did in the last call, merged. ``call`` returns it too, as its
        :class:`~onnx_kvcache.passes.fusion._base.FusionResult`'s ``report``."""

    @property
    def fused(self) -> int:
        """Attention nodes our passes fused in the last call."""
        return self.report.fused

    @property
    def refused(self) -> list[str]:
        """``"node: reason"`` for each attention our passes left as it was."""
        return self.report.refused

    def call(self, model: ir.Model) -> FusionResult:
        if _may_keep_rolling_windows(model.graph):
            _refuse_unsettled_windows(model)  # decided on a copy: raises before the model changes
        declared = _declared_shapes(model.graph)
        split_window_lengths(model.graph)  # rolling and full caches: two lengths
        counting = logger.isEnabledFor(logging.INFO)  # the counts are only logged
        before = _gqa_count(model.graph) if counting else 0
        *first, decomposed = [_report(fusion()(model)) for fusion in FUSIONS]
        attention = sum(first, FusionReport())
        modified = bool(attention.fused or decomposed.fused)
        if modified:
            _settle_window_caches(model.graph)
        else:  # nothing fused: the model as it was, its declared shapes too
            for value, shape in declared:
                value.shape = shape
        report = attention + decomposed
        unknown = unknown_attentions(model, report.refusals)  # attention no fusion took for one
        left = (decomposed + FusionReport(refusals=tuple(unknown))).refusals
        self.report = report = report + FusionReport(refusals=tuple(unknown))
        after = _gqa_count(model.graph) if counting else 0
        logger.info("GroupQueryAttention nodes %d -> %d.", before, after)
        if left:
            warn(
                f"{summarize_refusals(left, 'decomposed attention(s) left as they are')}.",
                FusionSkippedWarning,
            )
        if report.padded:
            windows = report.padded_windows
            rolling = _has_window_caches(model)
            warn(
                PADDING_WARNING
                + (" " + WINDOW_PADDING_WARNING if windows else "")
                + (" " + ROLLING_WINDOW_WARNING if rolling else ""),
                PaddingAssumptionWarning,
            )
        return FusionResult(model, modified=modified, report=report)


def _declared_shapes(graph: ir.Graph) -> list[tuple[ir.Value, ir.Shape | None]]:
    """Each graph input's and node output's declared shape (what a split of window caches'
    lengths changes), to put back when nothing fuses."""
    values = [*graph.inputs, *(out for node in graph for out in node.outputs)]
    return [(value, value.shape) for value in values]


def _gqa_count(graph: ir.Graph) -> int:
    """The main graph's GroupQueryAttention nodes (what the log line counts)."""
    return sum(1 for node in graph if node.op_type == "GroupQueryAttention")


def _window_pasts(graph: ir.Graph) -> list[ir.Value]:
    """The past inputs of rolling window caches (:func:`~onnx_kvcache.cache.rolling.rolling_attention`)
    the graph's GQA nodes read."""
    return [
        value
        for node in graph
        if rolling_attention(node)
        for value in node.inputs[3:5]
        if value is not None and value.is_graph_input()
    ]


def _settle_window_caches(graph: ir.Graph) -> None:
    """After rolling window caches were fused: remove the nodes nothing reads (an export's unused
    mask computations; in an onnxruntime-genai folder the caches become window-sized, ``W`` rows and
    more, and those would index the attention mask by the new length). What else reads such a past
    was refused before the model changed (:func:`_refuse_unsettled_windows`)."""
    if _window_pasts(graph):
        remove_dead(graph, [n for n in graph if not any(o.uses() or o.is_graph_output() for o in n.outputs)])


def _unsettled_window_reader(model: ir.Model) -> str | None:
    """Why a fused model must not stand (None: it may): made window-sized (what an onnxruntime-genai
    folder gets: :func:`~onnx_kvcache.passes.fusion.window_sized.make_window_sized`), a node other
    than attention still reads the length of its past (a position computed from it), once what nothing
    reads is gone."""
    make_window_sized(model)
    graph = model.graph
    _settle_window_caches(graph)
    for past in _window_pasts(graph):
        for user, _ in past.uses():
            if user.op_type != "GroupQueryAttention" and not _reads_other_dims(user):
                return (
                    f"{user.op_type} node {user.name!r} reads the length of {past.name}, a rolling window "
                    "cache that an onnxruntime-genai folder keeps window-sized (W rows where the export's "
                    "held at most W - 1): it would compute from the new length. Export with a full-length "
                    "cache (DynamicCache(), docs/exporting.md section 1)."
                )
    return None


def _may_keep_rolling_windows(graph: ir.Graph) -> bool:
    """A graph output that is a Slice of a Concat: the present of a rolling window cache (what
    :func:`~onnx_kvcache.passes.fusion._attention_facts.cache_link` makes window-sized) may be one."""
    for value in graph.outputs:
        node = value.producer()
        if node is not None and node.op_type == "Slice" and node.inputs:
            source = node.inputs[0].producer() if node.inputs[0] is not None else None
            if source is not None and source.op_type == "Concat":
                return True
    return False


def _refuse_unsettled_windows(model: ir.Model) -> None:
    """Raise :class:`KvCacheError` when fusing would leave a window-sized past read by more than
    attention, deciding on a copy of the model (its tensors shared, not copied) so that the model
    is left as it was: the fusions on the copy (its window caches' lengths declared apart as the
    model's will be: :func:`~onnx_kvcache.cache.rolling.split_window_lengths`), then
    :func:`_unsettled_window_reader`."""
    trial = model.clone()
    split_window_lengths(trial.graph)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = sum(_report(fusion(quiet=True)(trial)).fused for fusion in FUSIONS)
    reason = _unsettled_window_reader(trial) if fused else None
    if reason is not None:
        raise KvCacheError(reason)


def _reads_other_dims(node: ir.Node) -> bool:
    """A Shape of a 4-D cache that leaves out its length (axis 2): the batch, heads, head size."""
    if node.op_type != "Shape" or node.domain not in ("", "ai.onnx"):
        return False
    start, end = _attr(node, "start"), node.attributes.get("end")
    stop = end.as_int() if end is not None else 4
    start, stop = (x + 4 if x < 0 else x for x in (start, stop))
    return not start <= 2 < stop


def _report(result: ir.passes.PassResult) -> FusionReport:
    assert isinstance(result, FusionResult)
    return result.report


def fusion_candidates(model: ir.Model) -> list[ir.Node]:
    """The main graph's nodes :class:`GqaFusionPass`'s own fusions (:data:`FUSIONS`) would try
    (ONNX ``Attention``, with its own cache or not; decomposed attention's last MatMul): their
    own candidate rules, a cheap look, nothing proven or changed."""
    fusions = [fusion() for fusion in FUSIONS]
    return [node for node in model.graph if any(f.is_candidate(node) for f in fusions)]


def unfused_refusal(fused: int, refused: Sequence[FusionRefusal]) -> str | None:
    """Why a conversion after fusing must not go on (``None``: it may): a layer was left unfused.

    Running, calibrating and evaluating need every cache in GroupQueryAttention, and a model
    with some caches converted and others not is neither the user's model nor a converted one.
    """
    if not refused:
        return None
    left = summarize_refusals(refused)
    if fused:
        return (
            f"attention fusion fused {fused} layer(s) but left {len(refused)} unfused ({left}); running, "
            "calibrating and evaluating need every cache in GroupQueryAttention, so nothing was "
            "converted (-v lists each node)."
        )
    return f"attention fusion fused nothing: {left}; nothing to convert (-v lists each node)."
