"""The kinds of refusal an attention fusion gives: one table, one code per kind.

Every candidate a fusion leaves as it was is refused with a :class:`FusionRefusalCode` (the kind)
and a text that names the graph: the node, the value or operator the rule stopped at. A proof
is a sequence of steps (the scores chain, the caches, the repeat, the shapes, the mask); a rule
that does not hold raises :class:`~onnx_kvcache.passes.fusion._symbolic_values.Unprovable`, and
the step it was raised in (:func:`proof_step`) gives its kind unless the evaluator gave a more
precise one first (an operator whose values no rule follows, a shape nothing declares, a
malformed node): a re-raised reason keeps its first kind, text and place (its ``rule``).

:data:`REFUSAL_KINDS` is the table (docs/exporting.md, "What is refused", shows it): what each
kind means, in the words a refusal uses.
"""

from __future__ import annotations

__all__ = ["REFUSAL_KINDS", "FusionRefusalCode", "KindedReason", "proof_step", "step"]

import contextlib
import enum
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


class FusionRefusalCode(enum.Enum):
    """Why a fusion left a candidate as it was (:data:`REFUSAL_KINDS` says what each means)."""

    UNPROVABLE = "unprovable"
    SCORES = "scores"
    CACHE = "cache"
    STATIC_CACHE = "static_cache"
    REPEAT = "repeat"
    SHAPES = "shapes"
    MASK = "mask"
    ATTENTION_NODE = "attention_node"
    OPERATOR = "operator"
    UNKNOWN_SHAPE = "unknown_shape"
    MALFORMED = "malformed"
    OPSET = "opset"
    UNKNOWN_ATTENTION = "unknown_attention"
    IN_SUBGRAPH = "in_subgraph"
    IN_FUNCTION = "in_function"


#: One row per kind: what a refusal of that kind says about the graph.
REFUSAL_KINDS: dict[FusionRefusalCode, str] = {
    FusionRefusalCode.UNPROVABLE: (
        "a rule outside the kinds below does not hold (this project's fusions give every rule a kind)"
    ),
    FusionRefusalCode.SCORES: (
        "the softmax's scores are not scale * Q @ K^T (+ a mask), maybe soft-capped, or its "
        "probabilities do not reach the MatMul with V as GroupQueryAttention computes them"
    ),
    FusionRefusalCode.CACHE: (
        "K or V does not come from a KV cache GroupQueryAttention keeps: Concat(past input, new) "
        "with the concatenation a present output, read by nothing else"
    ),
    FusionRefusalCode.STATIC_CACHE: (
        "a static cache (a fixed buffer written by TensorScatter): fusing would change the model's "
        "cache interface"
    ),
    FusionRefusalCode.REPEAT: (
        "K/V reach attention through a repeat that is neither repeat_kv's (Unsqueeze, Expand, Reshape) "
        "nor a Tile of the head axis"
    ),
    FusionRefusalCode.SHAPES: (
        "Q/K/V are not 4-D with static head counts that group, one head size for K and V (multi-head "
        "latent attention's differ) that is a multiple of 8, and one float element type (Q and K "
        "may be widened from it to float32)"
    ),
    FusionRefusalCode.MASK: (
        "the mask is not causal with optional padding (attention_mask[b, j]) and sliding window; the "
        "text gives the condition"
    ),
    FusionRefusalCode.ATTENTION_NODE: (
        "an ONNX Attention's inputs or attributes GroupQueryAttention reads differently "
        "(softmax precision, scores output mode, scale, nonpad_kv_seqlen)"
    ),
    FusionRefusalCode.OPERATOR: (
        "the proof needs values (a mask's, a shape's) that an operator computes whose values no rule "
        "follows; the text names the operator, its node and what it computes"
    ),
    FusionRefusalCode.UNKNOWN_SHAPE: (
        "the proof needs the rank or shape of a value that no value_info, graph input, shape rule or "
        "ONNX shape inference gives; the text names the operator where it was lost"
    ),
    FusionRefusalCode.MALFORMED: (
        "a node the proof reads breaks its operator's specification (at the model's opset), or a "
        "value_info shape contradicts the shape its operator computes"
    ),
    FusionRefusalCode.OPSET: (
        "the model's default-domain opset is below 15, which the fused graph's operators need "
        "(Shape with start and end, axes as inputs)"
    ),
    FusionRefusalCode.UNKNOWN_ATTENTION: (
        "a softmax over scores read from a KV cache input that no fusion takes for an attention: "
        "the text names the softmax, the cache and what reads the probabilities"
    ),
    FusionRefusalCode.IN_SUBGRAPH: (
        "the attention is inside a control-flow subgraph (fusions rewrite the main graph)"
    ),
    FusionRefusalCode.IN_FUNCTION: "the attention is inside a model-local function",
}


class KindedReason(Exception):
    """A reason that carries its kind (None: the proof step's); the evaluator's ``Unprovable``
    is one (defined here so that this module imports nothing of the evaluator's)."""

    kind: FusionRefusalCode | None = None


@contextlib.contextmanager
def proof_step(code: FusionRefusalCode) -> Iterator[None]:
    """Give the reasons raised inside the kind ``code``, unless they have one already."""
    try:
        yield
    except KindedReason as reason:
        if reason.kind is None:
            reason.kind = code
        raise


def step(code: FusionRefusalCode) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """A function whose reasons are of kind ``code`` (:func:`proof_step` around its body)."""

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def proved(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with proof_step(code):
                return fn(*args, **kwargs)

        return proved

    return decorate
