"""The evaluator's operator rules as one table: :data:`RULES`, one frozen :class:`Rule` per operator.

A row says what the operator computes (the words a refusal uses), the rules that follow its
values (:mod:`~onnx_kvcache.passes.fusion._symbolic_index`,
:mod:`~onnx_kvcache.passes.fusion._symbolic_lookup` and the exporters' idioms of
:mod:`~onnx_kvcache.passes.fusion._symbolic_ops`), tried in order, and the rule that gives its
output's shape when no value rule applies. An operator with no row, or whose row has no shape
rule, is shaped by the export's value_info, else by ONNX's own shape inference of that node
(:class:`~onnx_kvcache.passes.fusion._symbolic.SymbolicEvaluator`); its values are then
unknown, which refuses a proof only where the proof needs them.

tests/passes/fusion/test_symbolic_rules.py checks every row against onnxruntime on random
inputs: what a rule says of a tensor's shape and elements is what onnxruntime computes;
``benchmarks/symbolic_fuzz.py`` does so on random graphs of every row at opsets 12 to 24.
"""

from __future__ import annotations

__all__ = ["RULES", "Rule", "rule_for"]

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import onnx_ir as ir

from onnx_kvcache.passes.fusion import _symbolic_index as index
from onnx_kvcache.passes.fusion import _symbolic_lookup as lookup
from onnx_kvcache.passes.fusion import _symbolic_ops as ops
from onnx_kvcache.passes.fusion._symbolic_values import SymTensor

if TYPE_CHECKING:
    from onnx_kvcache.passes.fusion._symbolic_values import Evaluator

ValueRule = Callable[["Evaluator", ir.Node], "SymTensor | None"]
"""The node's (first) output, or None where the rule does not apply; raises Unprovable with why
it cannot follow the values."""
ShapeRule = Callable[["Evaluator", ir.Node, int], "SymTensor | None"]
"""Output ``index`` of the node by its shape (its values unknown), or None: not this rule's."""

MICROSOFT = "com.microsoft"


@dataclasses.dataclass(frozen=True)
class Rule:
    """What the evaluator knows of one operator."""

    computes: str
    """What the operator computes, as a refusal names it."""
    values: tuple[ValueRule, ...] = ()
    """Rules for the values of output 0, tried in order."""
    shape: ShapeRule | None = None
    """The shape of an output when no value rule gives it (None: value_info, else ONNX's inference)."""


def _first(rule: Callable[[Evaluator, ir.Node], SymTensor]) -> ShapeRule:
    """A shape rule of output 0 only."""

    def shape(ev: Evaluator, node: ir.Node, output: int) -> SymTensor | None:
        return rule(ev, node) if output == 0 else None

    return shape


_SAME = _first(ops._same)
_BROADCAST = _first(ops._elementwise)
_UNARY = "an elementwise function of one tensor"

#: One row per (domain, operator); the default domain is "".
RULES: dict[tuple[str, str], Rule] = {
    ("", "Identity"): Rule("its input", (index._identity,)),
    ("", "Shape"): Rule("the shape of a tensor", (index._shape,)),
    ("", "Size"): Rule("the element count of a tensor", (lookup._size,)),
    ("", "Squeeze"): Rule("a tensor without unit axes", (index._squeeze,)),
    ("", "Unsqueeze"): Rule("a tensor with unit axes inserted", (index._squeeze,)),
    ("", "Add"): Rule("a sum", (index._arith,), _BROADCAST),
    ("", "Sub"): Rule("a difference", (index._arith,), _BROADCAST),
    ("", "Mul"): Rule("a product", (lookup._mask_product, index._arith), _BROADCAST),
    ("", "Div"): Rule("a quotient", (ops._int_div,), _BROADCAST),
    ("", "Pow"): Rule("a power", (), _BROADCAST),
    ("", "Mod"): Rule("a remainder", (), _BROADCAST),
    ("", "Neg"): Rule("a negation", (index._neg,), _SAME),
    ("", "Range"): Rule("a sequence of integers", (index._range,)),
    ("", "Equal"): Rule(
        "a comparison", (ops._compare_vectors, lookup._masked_sum_is_zero, index._compare), _BROADCAST
    ),
    ("", "Less"): Rule("a comparison", (ops._compare_vectors, index._compare), _BROADCAST),
    ("", "LessOrEqual"): Rule("a comparison", (ops._compare_vectors, index._compare), _BROADCAST),
    ("", "Greater"): Rule("a comparison", (ops._compare_vectors, index._compare), _BROADCAST),
    ("", "GreaterOrEqual"): Rule("a comparison", (ops._compare_vectors, index._compare), _BROADCAST),
    ("", "And"): Rule("a conjunction", (index._logic,), _BROADCAST),
    ("", "Or"): Rule("a disjunction", (index._logic,), _BROADCAST),
    ("", "Xor"): Rule("an exclusive or", (), _BROADCAST),
    ("", "Not"): Rule("a negation", (index._not,), _SAME),
    ("", "Cast"): Rule("a type conversion", (ops._cast_to_float, index._cast), _SAME),
    ("", "CastLike"): Rule("a type conversion", (ops._cast_like_int,), _SAME),
    ("", "Where"): Rule("an elementwise choice", (ops._where_vectors, index._where), _BROADCAST),
    ("", "Expand"): Rule("a broadcast to a shape", (index._expand,)),
    ("", "Max"): Rule("an elementwise maximum", (index._extremum,), _BROADCAST),
    ("", "Min"): Rule("an elementwise minimum", (index._extremum,), _BROADCAST),
    ("", "Concat"): Rule("a concatenation", (index._concat,), _first(ops._concat)),
    ("", "Transpose"): Rule("a permutation of axes", (index._transpose,)),
    ("", "Reshape"): Rule("a reshape", (ops._reshape_vector, ops._unit_reshape, index._reshape)),
    ("", "Slice"): Rule("a slice", (index._slice, ops._slice_any)),
    ("", "ConstantOfShape"): Rule("a constant of a shape", (ops._constant_of_shape,)),
    ("", "Gather"): Rule(
        "elements picked by index",
        (ops._flat_lookup, lookup._gather, lookup._gather_elements),
        _first(ops._gather_data),
    ),
    ("", "GatherND"): Rule("elements picked by index tuples", (lookup._gather_nd,), lookup._gather_nd_shape),
    ("", "ScatterND"): Rule("a tensor with elements written at index tuples", (lookup._scatter_nd,), _SAME),
    ("", "ScatterElements"): Rule("a tensor with elements written along an axis", (), _SAME),
    ("", "Trilu"): Rule("a triangle of a matrix", (lookup._trilu,), _SAME),
    ("", "Tile"): Rule("a tensor repeated along its axes", (lookup._tile,)),
    ("", "NonZero"): Rule("the indices of nonzero elements", (lookup._nonzero,)),
    ("", "CumSum"): Rule("a running sum", (lookup._cumsum,), _SAME),
    ("", "Split"): Rule("parts of a tensor", (), ops._split),
    ("", "MatMul"): Rule("a matrix product", (), _first(ops._matmul)),
    ("", "MatMulInteger"): Rule("an integer matrix product", (), _first(ops._matmul)),
    ("", "Softmax"): Rule("a softmax", (), _SAME),
    ("", "LogSoftmax"): Rule("a log-softmax", (), _SAME),
    ("", "Flatten"): Rule("a tensor flattened to 2-D", (), _first(ops._flatten)),
    ("", "Dropout"): Rule("a dropout (the identity in inference)", (), ops._first_output_same),
    ("", "DynamicQuantizeLinear"): Rule("a tensor quantized to uint8", (), ops._dynamic_quantize),
    ("", "LayerNormalization"): Rule("a layer normalization", (), _SAME),
    ("", "RMSNormalization"): Rule("an RMS normalization", (), _SAME),
    ("", "SimplifiedLayerNormalization"): Rule("an RMS normalization", (), _SAME),
    ("", "RotaryEmbedding"): Rule("a rotary embedding", (), _SAME),
    (MICROSOFT, "MatMulNBits"): Rule("a matrix product with block-quantized weights", (), ops._matmul_nbits),
    (MICROSOFT, "SkipSimplifiedLayerNormalization"): Rule(
        "a residual sum and its RMS normalization", (), ops._skip_norm
    ),
    (MICROSOFT, "RotaryEmbedding"): Rule("a rotary embedding", (), _SAME),
}
_UNARY_OPS = (
    "Sqrt", "Reciprocal", "Sigmoid", "Tanh", "Cos", "Sin", "Exp", "Erf", "Relu", "Abs", "IsNaN",
    "IsInf", "Gelu", "Softplus", "Log", "Floor", "Ceil", "Round", "Sign",
)  # fmt: skip
RULES |= {("", op): Rule(_UNARY, (), _SAME) for op in _UNARY_OPS}
RULES |= {
    ("", op): Rule("a reduction", (), _first(ops._reduce)) for op in ("ReduceMean", "ReduceProd", "ReduceL2")
}
RULES |= {
    ("", op): Rule("a reduction", (lookup._reduce_values,), _first(ops._reduce))
    for op in ("ReduceSum", "ReduceMax", "ReduceMin")
}


def rule_for(node: ir.Node) -> Rule | None:
    """The row of ``node``'s operator (None: the evaluator has none)."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    return RULES.get((domain, node.op_type))
