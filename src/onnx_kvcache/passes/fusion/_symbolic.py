"""Symbolic evaluation of what exporters compute around attention, for the fusions' proofs.

Exporters build attention masks, positions and shape vectors from ``Shape``, ``Range``,
``Unsqueeze``, comparisons, ``Trilu``, ``Gather``/``GatherND`` and more.
:class:`SymbolicEvaluator` evaluates such a subgraph for *every* input at once, so a fusion can
prove what a mask computes rather than match one exporter's op sequence:

- a dimension is an integer affine form (:class:`Affine`) over the graph's symbolic
  dimension names. Two values that name a dimension alike (``batch``, ``past``) are the
  same length: that is the model's declared interface. An unnamed dimension is a fresh
  symbol, equal to nothing else;
- an integer tensor's element is an affine form over its axis indices (``@0``, ``@1``,
  ...); a boolean tensor's element is a conjunction (:class:`Conj`) of ``form <= 0``
  atoms (:class:`Le`) and lookups into a 2-D graph input (:class:`MaskAt`); a float
  mask is :class:`Additive` (0 where a condition holds, a value that zeroes softmax
  elsewhere);
- float data (Q, K, V, activations) is followed by shape only;
- ``Max``/``Min`` of lengths (transformers 5.x's sliding-window sizes) are one opaque
  symbol ``max(0, e)`` per normalized ``e``, compared only for identity;
- a constant-folded integer tensor that is an affine function of its indices (a folded
  ``Range``, a ``GatherND`` index grid) is read as that function;
- a 2-D integer graph input's element is its entry symbol ``m[@0, @1]``; ``Cast`` of one
  entry to bool is the lookup ``m[r, c] != 0`` (:class:`MaskAt`), a ``CumSum`` along its
  columns the running sum ``cumsum(m)[r, c]``;
- ``ties`` (:class:`SymbolicEvaluator`) state equations between the dimensions the graph
  names, applied to every declared shape (a caller that knows two lengths are equal
  whenever the graph runs says so).

**Proofs are local.** A value is evaluated when a proof reads it, and only what it reads
upstream is evaluated. Each operator's rules are one row of
:data:`~onnx_kvcache.passes.fusion._symbolic_rules.RULES` (what it computes, the rules that
follow its values, the rule of its shape). Where no rule follows a value's elements (an
operator without a row: a LayerNorm, an MoE router's TopK, OneHot and ScatterElements; or a
rule that does not apply to these inputs) the value is *opaque*: its shape and element type
are known, its values are not, and :class:`SymTensor` keeps where they were lost
(:class:`Origin`). A proof that needs those values is refused naming that operator, its node
and what it computes (or the first reason its rule gave); a proof that needs only the shape
goes on. Shapes come, in this order, from the export's value_info and the graph inputs (a
float value fully declared so is not evaluated further: nothing upstream of it is read),
from the operator's shape rule, and from ONNX's own shape inference of that one node
(``onnx.shape_inference.infer_node_outputs``, given its inputs' shapes as dimension names and
its small constant inputs as data); a value none of them shapes stops a proof that reads its
rank, naming the operator where the shape was lost. Evaluation runs its inputs first,
iteratively (a deep graph without value_info is followed from its inputs without recursion),
and never reads a weight: initializers above 64 elements are shapes only.

Every rule is exact: what it says of a value is what onnxruntime computes, for every input
whose int64 ``Add``/``Sub``/``Mul`` and sums do not overflow (onnxruntime wraps; the
evaluator's integers are exact), and ``benchmarks/symbolic_fuzz.py`` compares every claim with
onnxruntime on random graphs. What the evaluator cannot follow raises :class:`Unprovable` with the
reason (and, when the evaluator knows it, its kind: an operator, a shape, a malformed node);
a reason raised again keeps its first kind, text and place. The value types are
:mod:`onnx_kvcache.passes.fusion._symbolic_values`; this module is the evaluator and
re-exports those types.

Symbols (:class:`Symbol`, of a :class:`SymbolKind`; how messages print them):

- ``past``, ``batch``, ``past + seq`` (:attr:`SymbolKind.DIM`): a dimension the graph names;
  a name that is no sum (``(past + seq)``) is one symbol;
- ``?3`` (:attr:`SymbolKind.FRESH`): an unnamed dimension, equal only to itself;
- ``@0``, ``@1`` (:attr:`SymbolKind.AXIS`): the index along a tensor's axis 0, 1, ... in
  the element expression of that tensor;
- ``batch``, ``head``, ``query``, ``key`` (:attr:`SymbolKind.INDEX`): attention's indices
  (:mod:`onnx_kvcache.passes.fusion._match` names a mask's axes so: batch ``b``, head,
  query row ``i``, key column ``j``);
- ``max(0, e)`` (:attr:`SymbolKind.MAX`): the opaque maximum of :func:`max_of`;
- ``m[r, c]`` (:attr:`SymbolKind.ENTRY`): the entry of a 2-D integer graph input ``m`` at
  row ``r``, column ``c`` (affine forms, substituted into like any other);
- ``cumsum(m)[r, c]`` (:attr:`SymbolKind.COUNT`): ``m[r, 0] + ... + m[r, c]``, a ``CumSum``
  of such an input along its columns (mobius's token positions counted from
  ``attention_mask``); ``0`` at ``c = -1``.

Dimensions in the fusions' rules: ``B`` batch, ``N`` query heads (``num_heads``), ``N_kv``
KV heads (``kv_num_heads``), ``S`` new tokens (the query length), ``P`` the past cache's
length, ``P + S`` the present cache's (the mask's key columns), ``H`` the head size, ``W``
a sliding window.
"""

from __future__ import annotations

__all__ = [
    "Additive",
    "Affine",
    "Conj",
    "Le",
    "Lookup",
    "MaskAt",
    "Origin",
    "SymTensor",
    "Symbol",
    "SymbolKind",
    "SymbolicEvaluator",
    "Unprovable",
    "constant_array",
    "nonnegative",
]

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from onnx_kvcache.passes.fusion._refusals import FusionRefusalCode

if TYPE_CHECKING:
    from onnx_kvcache.passes.fusion._symbolic_values import Evaluator
from onnx_kvcache.passes.fusion._symbolic_index import _attr_int, _from_constant, _input
from onnx_kvcache.passes.fusion._symbolic_index import reshape_dims as reshape_dims
from onnx_kvcache.passes.fusion._symbolic_rules import Rule, rule_for
from onnx_kvcache.passes.fusion._symbolic_values import (  # noqa: F401  (re-exported: the fusions' names)
    _FLOAT_TYPES,
    _INT_TYPES,
    _MAX_CONST_ELEMENTS,
    FALSE,
    ONE,
    TRUE,
    ZERO,
    Additive,
    Affine,
    Conj,
    Contradiction,
    Le,
    Lookup,
    MaskAt,
    Origin,
    Symbol,
    SymbolKind,
    SymTensor,
    Unprovable,
    _kind,
    _kind_of,
    axis,
    check_declared,
    constant_array,
    max_of,
    min_of,
    nonnegative,
    parse_dim,
)

_MALFORMED = (IndexError, KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError)
"""What a rule raises on a node that breaks its operator's specification (an axis out of range,
ranks that do not match, an attribute of the wrong kind)."""


_FIRST_REASONS = frozenset({FusionRefusalCode.UNKNOWN_SHAPE, FusionRefusalCode.MALFORMED})
"""A rule's reasons that say more than ONNX's inference failing after it (where the shape was lost,
a node its opset does not define)."""


def _node_text(node: ir.Node) -> str:
    domain = f" ({node.domain})" if node.domain not in ("", "ai.onnx") else ""
    return f"{node.op_type}{domain} node {node.name!r}"


class SymbolicEvaluator:
    """Evaluates values of one graph (or function) symbolically, as proofs read them; results
    are cached (the module docstring states how: locally, shapes first from value_info)."""

    def __init__(self, ties: Mapping[Symbol, Affine] | None = None) -> None:
        self._cache: dict[ir.Value, SymTensor | Unprovable] = {}
        self._declared: dict[ir.Value, tuple[Affine, ...]] = {}
        self._dtypes: dict[ir.Value, ir.DataType | None] = {}
        self._busy: set[ir.Value] = set()
        self._fresh = 0
        self._constants: dict[tuple[object, ...], SymTensor] = {}
        """Small constants of this graph read before, by their stored bytes: exporters write the
        same axes and indices in every layer, each read once (for this evaluator's graph only)."""
        self.ties: Mapping[Symbol, Affine] = dict(ties or {})
        """Dimension symbols replaced in every declared shape: equations that hold whenever
        the graph runs (the caller proves them)."""

    def dtype(self, value: ir.Value | None) -> ir.DataType | None:
        """The element type of ``value``: declared, else inferred from its producer."""
        if value is None:
            return None
        if value.dtype is not None:
            return value.dtype
        if value not in self._dtypes:
            self._dtypes[value] = infer_dtype(self, value)
        return self._dtypes[value]

    def fresh(self) -> Symbol:
        self._fresh += 1
        return Symbol.fresh(self._fresh)

    def declared_shape(self, value: ir.Value) -> tuple[Affine, ...]:
        """The shape a value is annotated with; an unnamed dimension is one fresh symbol."""
        if value not in self._declared:
            if value.shape is None:
                raise Unprovable(
                    f"value {value.name!r} has no known rank", kind=FusionRefusalCode.UNKNOWN_SHAPE
                )
            dims = (d.value if isinstance(d, ir.SymbolicDim) else d for d in value.shape)
            self._declared[value] = tuple(parse_dim(d, self.fresh).subs(self.ties) for d in dims)
        return self._declared[value]

    def shape(self, value: ir.Value | None) -> tuple[Affine, ...]:
        """The symbolic shape of any value: computed where followed, else declared."""
        try:
            return self.eval(value).shape
        except Contradiction:
            raise  # the declared shape is what is in doubt
        except Unprovable:
            if value is None or value.shape is None:
                raise
            return self.declared_shape(value)

    def eval(self, value: ir.Value | None) -> SymTensor:
        """What ``value`` is for every input (its inputs evaluated first, iteratively)."""
        if value is None:
            raise Unprovable("a required input is missing", kind=FusionRefusalCode.MALFORMED)
        cached = self._cache.get(value)
        if cached is None:
            producer = value.producer()
            if producer is None or producer.op_type == "Constant":  # a leaf: nothing read first
                cached = self._cache[value] = self._compute(value)
            else:
                if value in self._busy:
                    raise Unprovable(
                        f"value {value.name!r} depends on itself", kind=FusionRefusalCode.MALFORMED
                    )
                self._settle(value)
                cached = self._cache[value]
        if isinstance(cached, Unprovable):
            raise cached.again()
        return cached

    def _settle(self, value: ir.Value) -> None:
        """Evaluate ``value`` after what it reads, depth first without recursion."""
        cache, busy = self._cache, self._busy
        stack = [value]
        expanded: set[ir.Value] = set()
        while stack:
            top = stack[-1]
            if top in cache:
                stack.pop()
                continue
            if top not in expanded:
                expanded.add(top)
                for read in self._reads(top):
                    if read is not None and read not in cache and read not in busy and read not in expanded:
                        stack.append(read)
                continue
            stack.pop()
            busy.add(top)
            try:
                cache[top] = self._compute(top)
            finally:
                busy.discard(top)

    def _reads(self, value: ir.Value) -> Sequence[ir.Value | None]:
        """The values the evaluation of ``value`` reads: its producer's inputs, none for a
        float value whose shape is declared and whose operator has no value rule."""
        node = value.producer()
        if node is None or (value.dtype in _FLOAT_TYPES and self._declared_data(value, node, rule_for(node))):
            return ()
        reads = []
        for read in node.inputs:  # leaves (inputs, initializers, Constants) are read when asked
            if read is not None and (source := read.producer()) is not None and source.op_type != "Constant":
                reads.append(read)
        return reads

    def _declared_data(self, value: ir.Value, node: ir.Node, row: Rule | None) -> bool:
        """A float value the export declares fully whose elements no rule would follow."""
        return (
            value.dtype in _FLOAT_TYPES
            and (row is None or not row.values)
            and value.shape is not None
            and all(isinstance(d, int) or d.value is not None for d in value.shape)
        )

    def _compute(self, value: ir.Value) -> SymTensor | Unprovable:
        try:
            return self._evaluate(value)
        except Unprovable as reason:
            return reason
        except _MALFORMED as error:
            producer = value.producer()
            what = _node_text(producer) if producer is not None else repr(value.name)
            return Unprovable(
                f"{what} is malformed ({type(error).__name__}: {error})",
                kind=FusionRefusalCode.MALFORMED,
                rule=f"malformed:{type(error).__name__}",
            )

    def _evaluate(self, value: ir.Value) -> SymTensor:
        producer = value.producer()
        if producer is None or (producer.op_type == "Constant" and producer.domain in ("", "ai.onnx")):
            known = self._stored_constant(producer)
            if known is not None:
                return known
            array = constant_array(value)
            if array is not None:
                return self._constant(array, value.dtype or ir.DataType.from_numpy(array.dtype))
        if producer is None:
            return self._leaf(value)
        row = rule_for(producer)
        output = value.index() or 0
        if self._declared_data(value, producer, row):
            self._cross_check(value, producer, output, row, _Shallow(self))
            return SymTensor(self.declared_shape(value), "data")
        reason = None
        if row is not None and output == 0:
            for rule in row.values:
                try:
                    found = rule(self, producer)
                except Contradiction:
                    raise
                except Unprovable as why:
                    reason = reason or why
                    continue
                if found is not None:
                    if value.shape is not None:
                        check_declared(value, self.declared_shape(value), found.shape, producer)
                    if found.origin is None and not found.known and found.kind != "float":
                        found = SymTensor(found.shape, found.kind, origin=self._lost(producer, row, reason))
                    return found
        return self._opaque(value, producer, output, row, reason)

    def _lost(self, node: ir.Node, row: Rule | None, reason: Unprovable | None) -> Origin:
        """Where values computed by ``node`` were lost: the first input that lost them, else here."""
        if reason is None:
            for v in node.inputs:
                cached = self._cache.get(v) if v is not None else None
                if isinstance(cached, SymTensor) and cached.origin is not None and cached.kind != "data":
                    return cached.origin
        return Origin(node, 0, row.computes if row is not None else "", reason)

    def _opaque(
        self, value: ir.Value, node: ir.Node, output: int, row: Rule | None, reason: Unprovable | None
    ) -> SymTensor:
        """``value`` known by its shape only, with where its values were lost."""
        shape = None
        if value.shape is not None and all(isinstance(d, int) or d.value is not None for d in value.shape):
            self._cross_check(value, node, output, row, self)
            shape = self.declared_shape(value)
        if shape is None and row is not None and row.shape is not None:
            try:
                found = row.shape(self, node, output)
            except Contradiction:
                raise
            except Unprovable as why:
                if why.kind is FusionRefusalCode.MALFORMED:
                    raise  # a node its opset does not define: no inference of it stands in
                reason, found = reason or why, None
            if found is not None:
                shape = found.shape
        if shape is None and value.shape is not None:
            shape = self.declared_shape(value)
        if shape is None:
            try:
                shape = self._inferred(node, output)
            except Unprovable as why:
                first = reason is not None and reason.kind in _FIRST_REASONS
                raise (reason.again() if first and reason is not None else why) from None
        kind = _kind_of(self.dtype(value))
        return SymTensor(
            shape, kind, origin=Origin(node, output, row.computes if row is not None else "", reason)
        )

    def _cross_check(
        self, value: ir.Value, node: ir.Node, output: int, row: Rule | None, ev: Evaluator
    ) -> None:
        """Raise :class:`Contradiction` where ``value``'s declared shape is not what its operator's
        shape rule computes (read through ``ev``); a rule that cannot compute it says nothing."""
        if row is None or row.shape is None:
            return
        try:
            computed = row.shape(ev, node, output)
        except Contradiction:
            raise
        except (Unprovable, *_MALFORMED):
            return
        if computed is not None:
            check_declared(value, self.declared_shape(value), computed.shape, node)

    def _leaf(self, value: ir.Value) -> SymTensor:
        """A graph input or an initializer too large to read: its shape; a 2-D integer input's
        entries (``m[@0, @1]``)."""
        tensor = value.const_value
        dtype = value.dtype if value.dtype is not None or tensor is None else tensor.dtype
        kind = _kind(dtype)
        if tensor is not None and value.shape is None:
            shape = tuple(Affine(const=int(d)) for d in tensor.shape.numpy())
        else:
            shape = self.declared_shape(value)
        if kind == "float":
            return SymTensor(shape, "data")
        if not value.is_graph_input():  # a large integer initializer: its shape only
            why = Unprovable(f"constant {value.name!r} is too large to follow (weights are never read)")
            return SymTensor(shape, kind, origin=Origin(None, 0, "", why))
        elem = None
        if kind == "int" and len(shape) == 2 and value.name:  # its entries, looked up
            elem = Affine.of(Symbol.entry(value.name, Affine.of(axis(0)), Affine.of(axis(1))))
        return SymTensor(shape, kind, elem, source=value.name)

    def _inferred(self, node: ir.Node, output: int) -> tuple[Affine, ...]:
        """The shape ONNX's own shape inference gives output ``output`` of ``node``, from the
        evaluator's shapes of its inputs (dimension names) and its small constant inputs."""
        from onnx_kvcache.passes.fusion._onnx_inference import infer_output

        shape, dtype = infer_output(self, node, output)
        target = node.outputs[output]
        if target.dtype is None and dtype is not None and self._dtypes.get(target) is None:
            self._dtypes[target] = dtype
        return shape

    def _constant(self, array: np.ndarray, dtype: ir.DataType | None) -> SymTensor:
        """A small constant's SymTensor, read once per graph by its bytes."""
        if array.size > _MAX_CONST_ELEMENTS:
            return _from_constant(array, dtype)
        key = ("array", array.dtype.str, array.shape, array.tobytes(), dtype)
        found = self._constants.get(key)
        if found is None:
            found = self._constants[key] = _from_constant(array, dtype)
        return found

    def _stored_constant(self, producer: ir.Node | None) -> SymTensor | None:
        """A Constant node's small tensor read before in this graph, by the bytes its proto stores
        (None: not one); read without building its array again."""
        if producer is None:
            return None
        attr = producer.attributes.data.get("value")
        proto = (
            getattr(attr.value, "raw", None)
            if attr is not None and attr.type == ir.AttributeType.TENSOR
            else None
        )
        raw = getattr(proto, "raw_data", None)
        if not raw or len(raw) > 512:
            return None
        key = ("proto", proto.data_type, tuple(proto.dims), raw)  # type: ignore[union-attr]
        found = self._constants.get(key)
        if found is None:
            array = constant_array(producer.outputs[0])
            if array is None:
                return None
            dtype = producer.outputs[0].dtype or ir.DataType.from_numpy(array.dtype)
            found = self._constants[key] = _from_constant(array, dtype)
        return found

    def values(self, value: ir.Value | None, what: str) -> tuple[Affine, ...]:
        tensor = self.eval(value)
        if tensor.values is None:
            if tensor.origin is not None:
                raise tensor.origin.unprovable().wrapped(f"{what} is not a known integer vector: ")
            raise Unprovable(f"{what} is not a known integer vector")
        return tensor.values

    def scalar(self, value: ir.Value | None, what: str) -> Affine:
        values = self.values(value, what)
        if len(values) != 1:
            raise Unprovable(f"{what} is not a scalar")
        return values[0]

    def const_ints(self, value: ir.Value | None, what: str) -> list[int] | None:
        if value is None:
            return None
        values = self.values(value, what)
        if not all(v.is_const for v in values):
            raise Unprovable(f"{what} is not constant")
        return [v.const for v in values]


class _Shallow:
    """The evaluator as a declared float value's own shape rule reads it: values evaluated already,
    leaves, and declared shapes; nothing upstream is evaluated (a value the export declares stays
    local, and a chain of them is not followed by recursion)."""

    def __init__(self, ev: SymbolicEvaluator) -> None:
        self._ev = ev

    def eval(self, value: ir.Value | None) -> SymTensor:
        ev = self._ev
        if value is None:
            raise Unprovable("a required input is missing")
        cached = ev._cache.get(value)
        if isinstance(cached, Unprovable):
            raise cached.again()
        if cached is not None:
            return cached
        producer = value.producer()
        if producer is None or producer.op_type == "Constant":
            return ev.eval(value)
        if value.shape is not None and all(isinstance(d, int) or d.value is not None for d in value.shape):
            return SymTensor(ev.declared_shape(value), _kind_of(ev.dtype(value)))
        raise Unprovable(f"value {value.name!r} is not evaluated")

    def shape(self, value: ir.Value | None) -> tuple[Affine, ...]:
        return self.eval(value).shape

    values = SymbolicEvaluator.values
    scalar = SymbolicEvaluator.scalar
    const_ints = SymbolicEvaluator.const_ints

    def dtype(self, value: ir.Value | None) -> ir.DataType | None:
        return self._ev.dtype(value)

    def declared_shape(self, value: ir.Value) -> tuple[Affine, ...]:
        return self._ev.declared_shape(value)

    def fresh(self) -> Symbol:
        return self._ev.fresh()


_BOOL_OPS = frozenset(
    {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Not", "IsNaN", "IsInf"}
)
_INT64_OPS = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})
_FIXED: dict[tuple[str, int], ir.DataType] = {
    ("MatMulInteger", 0): ir.DataType.INT32,
    ("DynamicQuantizeLinear", 0): ir.DataType.UINT8,
    ("DynamicQuantizeLinear", 1): ir.DataType.FLOAT,
    ("DynamicQuantizeLinear", 2): ir.DataType.UINT8,
    ("TopK", 1): ir.DataType.INT64,
    ("Dropout", 1): ir.DataType.BOOL,
    ("LayerNormalization", 1): ir.DataType.FLOAT,
    ("LayerNormalization", 2): ir.DataType.FLOAT,
}
_FROM_INPUT = {"Where": 1, "DequantizeLinear": 1, "CastLike": 1, "OneHot": 2, "ScatterND": 0, "Trilu": 0}


def infer_dtype(ev: SymbolicEvaluator, value: ir.Value) -> ir.DataType | None:
    """The element type of an unannotated ``value`` from its producer (None: unknown)."""
    node = value.producer()
    if node is None:
        tensor = value.const_value
        return tensor.dtype if tensor is not None else None
    op, index = node.op_type, value.index() or 0
    if (op, index) in _FIXED:
        return _FIXED[(op, index)]
    if op == "Cast":
        try:
            return ir.DataType(_attr_int(node, "to", 0))
        except ValueError:  # not an element type: the node is malformed
            return None
    if op in _BOOL_OPS:
        return ir.DataType.BOOL
    if op in _INT64_OPS:
        return ir.DataType.INT64
    if op in ("Constant", "ConstantOfShape"):
        for name, attr in node.attributes.items():
            if attr.type == ir.AttributeType.TENSOR:
                return attr.value.dtype
            if name.startswith("value_"):
                return ir.DataType.FLOAT if "float" in name else ir.DataType.INT64
        return ir.DataType.FLOAT if op == "ConstantOfShape" else None
    if op == "QuantizeLinear":
        zero_point = _input(node, 2)
        return ev.dtype(zero_point) if zero_point is not None else ir.DataType.UINT8
    first = _input(node, _FROM_INPUT.get(op, 0))
    return ev.dtype(first)
