"""What every attention fusion shares: one loop, one typed refusal, one report.

A fusion (one a module) says three things:

1. :meth:`FusionPass.is_candidate`: a node it may fuse (``candidates`` walks the main graph's
   nodes lazily, skipping those an earlier rewrite removed);
2. :meth:`FusionPass.match`: the :class:`~onnx_kvcache.passes.fusion._match.AttentionMatch` a
   candidate is proven to be, or a refusal: :class:`Unprovable` from a rule (code
   :attr:`FusionRefusalCode.UNPROVABLE`) or :class:`Refused` with a code of its own;
3. :meth:`FusionPass.rewrite`: write the match (by default one GroupQueryAttention node).

The loop (:meth:`FusionPass.call`) lives here once. It fuses in the main graph; with
``reports_elsewhere`` the candidates of control-flow subgraphs and model-local functions are
refused (:attr:`FusionRefusalCode.IN_SUBGRAPH`, :attr:`FusionRefusalCode.IN_FUNCTION`), not fused. Every
fusion returns a :class:`FusionResult` whose ``report`` (:class:`FusionReport`: fused count,
refusals, padding facts) is also kept as the pass's ``report`` attribute; reports merge with
``+`` (:class:`~onnx_kvcache.passes.fusion.gqa_fusion.GqaFusionPass` merges its fusions').

Before matching, the loop reads a one-input ``Concat`` or an ``Identity`` of a graph input
(TorchScript's copy of layer 0's past cache, ``Concat([past_key_values.0.key])``; the unoptimized
dynamo export's ``Identity``: the tensor itself) as that input: its readers read the input, and
the copy is removed (:func:`bypass_input_copies`).
"""

from __future__ import annotations

__all__ = [
    "FusionPass",
    "FusionRefusal",
    "FusionReport",
    "FusionResult",
    "FusionRefusalCode",
    "REFUSAL_KINDS",
    "Refused",
    "bypass_input_copies",
    "summarize_refusals",
]

import abc
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import ClassVar

import onnx_ir as ir

from onnx_kvcache.cache.sites import GQA_DOMAIN
from onnx_kvcache.errors import FusionSkippedWarning, require_flags, warn
from onnx_kvcache.passes._base import InPlacePass
from onnx_kvcache.passes.fusion._attention_facts import AttentionMatch
from onnx_kvcache.passes.fusion._match import GqaWriter
from onnx_kvcache.passes.fusion._refusals import REFUSAL_KINDS, FusionRefusalCode
from onnx_kvcache.passes.fusion._symbolic import SymbolicEvaluator, Unprovable


@dataclasses.dataclass(frozen=True)
class FusionRefusal:
    """One candidate left as it was: its code, the node and the text a user reads."""

    code: FusionRefusalCode
    node: ir.Node
    text: str
    rule: str = ""
    """Where it was raised (refusals of one rule are one reason in a summary); empty: its code."""

    def __str__(self) -> str:
        """``"node: text"``, as messages list it."""
        return f"{self.node.name or '<unnamed>'}: {self.text}"


class Refused(Exception):
    """Raised by :meth:`FusionPass.match` with a refusal of a code other than UNPROVABLE."""

    def __init__(self, refusal: FusionRefusal) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


@dataclasses.dataclass(frozen=True)
class FusionReport:
    """What one fusion (or several, merged with ``+``) did to a model."""

    fused: int = 0
    """Attentions fused."""
    refusals: tuple[FusionRefusal, ...] = ()
    """Candidates left as they were, in graph order."""
    padded: int = 0
    """Of the fused, how many read a padding mask (see ``gqa_fusion.PADDING_WARNING``)."""
    padded_windows: int = 0
    """Of those, how many also have a sliding window of key indices (a window of counted
    tokens, :attr:`~onnx_kvcache.passes.fusion._match.MaskFacts.counted`, computes as the
    export under any padding)."""

    @property
    def refused(self) -> list[str]:
        """``"node: reason"`` for each refusal (what messages list)."""
        return [str(refusal) for refusal in self.refusals]

    def __add__(self, other: FusionReport) -> FusionReport:
        return FusionReport(
            self.fused + other.fused,
            self.refusals + other.refusals,
            self.padded + other.padded,
            self.padded_windows + other.padded_windows,
        )

    def with_match(self, match: AttentionMatch) -> FusionReport:
        """This report with one more fused ``match`` counted."""
        padded = match.mask.padding is not None
        return dataclasses.replace(
            self,
            fused=self.fused + 1,
            padded=self.padded + padded,
            padded_windows=self.padded_windows  # a window of counted tokens is exact under any padding
            + (padded and match.mask.window is not None and not match.mask.counted),
        )


@dataclasses.dataclass
class FusionResult(ir.passes.PassResult):
    """A pass result with the fusion's :class:`FusionReport`."""

    report: FusionReport = dataclasses.field(default_factory=FusionReport)


class FusionPass(InPlacePass, abc.ABC):
    """The loop of an attention fusion into GroupQueryAttention (see the module docstring)."""

    label: ClassVar[str]
    """What the fusion fuses, as its INFO log line names it."""
    reports_elsewhere: ClassVar[bool] = False
    """Refuse the candidates of subgraphs and functions (else they are not looked at)."""
    warns: ClassVar[str] = ""
    """What a :class:`~onnx_kvcache.errors.FusionSkippedWarning` calls the candidates it left
    (empty: no warning, the caller reports them)."""

    def __init__(self, *, quiet: bool = False) -> None:
        super().__init__()
        require_flags(quiet=quiet)
        self.report = FusionReport()
        """What the last call did."""
        self.quiet = quiet
        """Log nothing (a trial run on a copy of the model: :class:`GqaFusionPass` logs the real one)."""

    @property
    def fused(self) -> int:
        """Attentions fused by the last call."""
        return self.report.fused

    @property
    def padded(self) -> int:
        """Of those, how many read a padding mask (see ``gqa_fusion.PADDING_WARNING``)."""
        return self.report.padded

    @property
    def padded_windows(self) -> int:
        """Of those, how many also have a sliding window."""
        return self.report.padded_windows

    @abc.abstractmethod
    def is_candidate(self, node: ir.Node) -> bool:
        """A node this fusion may fuse (cheap: no proof)."""

    @property
    def logger(self) -> logging.Logger:
        """The logger of the fusion's module (what it fused and left, at INFO)."""
        return logging.getLogger(type(self).__module__)

    @abc.abstractmethod
    def match(self, ev: SymbolicEvaluator, graph: ir.Graph, node: ir.Node) -> AttentionMatch:
        """What ``node`` is proven to be; raise :class:`Unprovable` or :class:`Refused` otherwise."""

    def rewrite(self, writer: GqaWriter, match: AttentionMatch) -> ir.Node:
        """Write ``match`` into the graph; returns the new node."""
        return writer.write(match)

    def candidates(self, graph: ir.Graph) -> Iterator[ir.Node]:
        """The candidates of ``graph`` in order, each looked at when reached (after the
        rewrites before it), those already removed skipped."""
        for node in list(graph):
            if node.graph is not None and self.is_candidate(node):
                yield node

    def elsewhere(self, model: ir.Model) -> list[FusionRefusal]:
        """The candidates outside the main graph's own nodes, refused with where they are."""
        found = [
            FusionRefusal(
                FusionRefusalCode.IN_SUBGRAPH,
                node,
                f"inside a control-flow subgraph of {_owner(model.graph, node)} (not fused)",
            )
            for node in _subgraph_nodes(model.graph)
            if self.is_candidate(node)
        ]
        for function in model.functions.values():
            found += [
                FusionRefusal(
                    FusionRefusalCode.IN_FUNCTION, node, f"inside function {function.name} (not fused)"
                )
                for node in ir.traversal.RecursiveGraphIterator(function)
                if self.is_candidate(node)
            ]
        return found

    def call(self, model: ir.Model) -> FusionResult:
        report = self._fuse(model)
        if self.warns and report.refusals:
            warn(f"{summarize_refusals(report.refusals, self.warns)}.", FusionSkippedWarning)
        return FusionResult(model, modified=bool(report.fused), report=report)

    def _fuse(self, model: ir.Model) -> FusionReport:
        """Match and rewrite every candidate of the main graph; the report of what was done."""
        graph = model.graph
        copies = _bypass(graph)  # put back unless something fused: a refused pass changes nothing
        ev = SymbolicEvaluator()
        writer = GqaWriter(graph, ev)
        report, refusals = FusionReport(), []
        too_old = _writer_opset_refusal(graph)
        for node in self.candidates(graph):
            if too_old is not None:
                refusals.append(FusionRefusal(FusionRefusalCode.OPSET, node, too_old))
                continue
            try:
                found = self.match(ev, graph, node)
            except Unprovable as reason:
                code = reason.kind or FusionRefusalCode.UNPROVABLE
                refusals.append(FusionRefusal(code, node, str(reason), reason.rule))
                continue
            except Refused as refused:
                refusals.append(refused.refusal)
                continue
            gqa = self.rewrite(writer, found)
            report = report.with_match(found)
            self.logger.debug("Fused %s into %s (%s).", node.name, gqa.name, found.mask)
        if self.reports_elsewhere:
            refusals += self.elsewhere(model)
        self.report = report = dataclasses.replace(report, refusals=tuple(refusals))
        if report.fused:
            model.opset_imports.setdefault(GQA_DOMAIN, 1)
        else:
            _restore(graph, copies)
        if self.quiet:
            return report
        self.logger.info(
            "%s -> GroupQueryAttention: %d fused, %d left.", self.label, report.fused, len(refusals)
        )
        for refusal in refusals:
            self.logger.info("Left %s", refusal)
        return report


WRITER_OPSET = 15
"""The default-domain opset the fused graph's own operators need: ``Shape`` with ``start`` and
``end`` (15), ``ReduceSum`` and ``Unsqueeze`` reading their axes as inputs (13)."""


def _writer_opset_refusal(graph: ir.Graph) -> str | None:
    """Why no candidate of ``graph`` can be written (None: they can): its opset predates the
    operators :class:`~onnx_kvcache.passes.fusion._match.GqaWriter` writes."""
    imports = graph.opset_imports
    version = imports.get("", imports.get("ai.onnx"))
    if version is not None and version >= WRITER_OPSET:
        return None
    said = f"opset {version}" if version is not None else "no opset"
    return (
        f"the model imports {said} for the default domain; the fused graph computes "
        f"GroupQueryAttention's lengths with operators of opset {WRITER_OPSET} and later (Shape with "
        f"start and end): export at opset {WRITER_OPSET} or later"
    )


@dataclasses.dataclass(frozen=True)
class _Bypassed:
    """An input copy taken out of the graph, with what puts it back exactly."""

    node: ir.Node
    source: ir.Value
    successor: ir.Node | None
    """The node it stood before (None: it was the last)."""
    readers: tuple[tuple[ir.Node, int], ...]


def _bypass(graph: ir.Graph) -> list[_Bypassed]:
    """Take each one-input ``Concat`` or ``Identity`` of a graph input out of the graph (the input
    itself, exactly), its readers reading the input; one that is a graph output stays."""
    copies = {
        node: None
        for value in graph.inputs
        for node, _ in value.uses()
        if node.op_type in ("Concat", "Identity")
        and node.domain in ("", "ai.onnx")
        and node.graph is graph
        and len(node.inputs) == 1
        and not node.outputs[0].is_graph_output()
    }
    if not copies:
        return []
    order = list(graph)
    after = {node: order[k + 1] if k + 1 < len(order) else None for k, node in enumerate(order)}
    taken = []
    for node in (n for n in order if n in copies):
        source = node.inputs[0]
        assert source is not None
        readers = tuple((user, slot) for user, slot in node.outputs[0].uses())
        taken.append(_Bypassed(node, source, after[node], readers))
        node.outputs[0].replace_all_uses_with(source)
        graph.remove(node, safe=True)
    return taken


def _restore(graph: ir.Graph, taken: Sequence[_Bypassed]) -> None:
    """Put copies taken by :func:`_bypass` back where they were, read as they were (a fusion that
    fused nothing leaves the model as it found it)."""
    for copy in reversed(taken):  # the last first: a copy's successor is back before it is
        copy.node.replace_input_with(0, copy.source)
        if copy.successor is not None:
            graph.insert_before(copy.successor, copy.node)
        else:
            graph.append(copy.node)
        for user, slot in copy.readers:
            user.replace_input_with(slot, copy.node.outputs[0])


def bypass_input_copies(graph: ir.Graph) -> int:
    """Remove each one-input ``Concat`` or ``Identity`` of a graph input (the input itself, exactly), its
    readers reading the input; one that is a graph output stays. Returns how many."""
    return len(_bypass(graph))


def summarize_refusals(refused: Sequence[FusionRefusal], what: str = "attention node(s)") -> str:
    """Refusals as one line: each reason once, with its count and first node.

    Refusals of one rule (raised at one place: their texts differ only in the numbers or names
    they hold) are one reason, said as the first of them says it.
    """
    groups: dict[tuple[FusionRefusalCode, str], list[FusionRefusal]] = {}
    for refusal in refused:
        groups.setdefault((refusal.code, refusal.rule), []).append(refusal)
    parts = [
        f"{items[0].text} ({len(items)}; first {items[0].node.name or '<unnamed>'})"
        for items in groups.values()
    ]
    return f"{len(refused)} {what} not provably GroupQueryAttention with a KV cache: " + "; ".join(parts)


def _subgraph_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The nodes of ``graph``'s control-flow subgraphs, at any depth (none: no walk of them)."""
    owners = [n for n in graph if (a := n.attributes.data) and any(x.type in _GRAPHS for x in a.values())]
    return [
        node
        for owner in owners
        for attr in owner.attributes.values()
        if attr.type in _GRAPHS
        for sub in (attr.value if attr.type == ir.AttributeType.GRAPHS else [attr.value])
        for node in ir.traversal.RecursiveGraphIterator(sub)
    ]


_GRAPHS = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)


def _owner(graph: ir.Graph, node: ir.Node) -> str:
    """The main-graph node whose subgraph holds ``node``, as a refusal names it."""
    for owner in graph:
        for attr in owner.attributes.values():
            if attr.type in _GRAPHS:
                subs = attr.value if attr.type == ir.AttributeType.GRAPHS else [attr.value]
                if any(n is node for sub in subs for n in ir.traversal.RecursiveGraphIterator(sub)):
                    return f"{owner.op_type} node {owner.name!r}"
    return "a node"
