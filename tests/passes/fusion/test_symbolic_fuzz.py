"""A short run of benchmarks/symbolic_fuzz.py, the evaluator's differential fuzz: no claim of the
evaluator differs from onnxruntime, every operator of the rule table is generated, and a rule
made wrong on purpose is found (the comparison can fail)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmark_scripts import load
from onnx_kvcache.passes.fusion import _symbolic_index as index
from onnx_kvcache.passes.fusion._symbolic_rules import RULES, Rule
from onnx_kvcache.passes.fusion._symbolic_values import ZERO, Affine, Conj, Le, Symbol, SymTensor, axis

fuzz = load("symbolic_fuzz")
CASES = 300


@pytest.fixture(scope="module")
def tally():
    return fuzz.fuzz(CASES, seed=0, quiet=True)


def test_a_short_run_finds_no_disagreement(tally):
    assert tally.disagreements == 0
    assert tally.loaded > 0.9 * CASES  # the graphs are mostly valid ones
    assert tally.runs > 2 * CASES  # and run at several sizes each
    assert tally.elements > 10 * CASES and tally.shapes > 10 * CASES


def test_every_operator_of_the_rule_table_is_generated(tally):
    assert sorted(set(RULES) - set(tally.ops)) == []


def test_every_operator_has_a_builder():
    assert sorted(fuzz.graphs.BUILDERS) == sorted(RULES)


def _off_by_one(ev, node) -> SymTensor:
    """Range's rule with a length one too long."""
    found = index._range(ev, node)
    return SymTensor((found.shape[0] + 1,), "int", found.elem)


def _less_as_less_or_equal(ev, node) -> SymTensor:
    found = index._compare(ev, node)
    assert isinstance(found.elem, Conj)
    return SymTensor(found.shape, "bool", Conj.of(*(Le(a.lhs - 1) for a in found.elem.atoms)))


def _negation_forgotten(ev, node) -> SymTensor:
    return ev.eval(node.inputs[0])


@pytest.mark.parametrize(
    ("op", "wrong"), [("Range", _off_by_one), ("Less", _less_as_less_or_equal), ("Neg", _negation_forgotten)]
)
def test_a_wrong_rule_is_a_disagreement(monkeypatch, capsys, op, wrong):
    monkeypatch.setitem(RULES, ("", op), Rule("a rule made wrong", (wrong,)))
    assert fuzz.main(["--cases", "12", "--seed", "0", "--op", op]) == 1
    out = capsys.readouterr().out
    assert "disagreement: case" in out and f"of {op} node" in out
    last = out.strip().splitlines()[-1]
    cases, _, disagreements = last.partition(" cases, ")
    assert cases == "12" and int(disagreements.split()[0]) > 0


def test_a_disagreement_is_reproduced_by_its_case(monkeypatch, capsys):
    monkeypatch.setitem(RULES, ("", "Neg"), Rule("a rule made wrong", (_negation_forgotten,)))
    fuzz.main(["--cases", "12", "--seed", "0", "--op", "Neg"])
    first = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("disagreement"))
    only = int(first.split("--only ")[1].split()[0])
    assert fuzz.main(["--seed", "0", "--only", str(only), "--op", "Neg"]) == 1
    assert first in capsys.readouterr().out


def test_processes_share_the_same_cases(monkeypatch):
    monkeypatch.setattr(fuzz, "_CHUNK", 5)
    alone = fuzz.fuzz(24, seed=2, quiet=True)
    shared = fuzz.fuzz(24, seed=2, quiet=True, jobs=2)
    assert shared == alone and alone.cases == 24


def test_the_last_line_counts_cases_and_disagreements(capsys):
    assert (
        fuzz.main(["--cases", "20", "--seed", "1", "--quiet", "--op", "com.microsoft.RotaryEmbedding"]) == 0
    )
    assert capsys.readouterr().out.strip().splitlines()[-1] == "20 cases, 0 disagreements"


def test_a_run_that_overflows_is_not_compared():
    """onnxruntime's int64 Add wraps; the evaluator's integers do not: such a run is set apart."""
    g = fuzz.graphs.Case(np.random.default_rng(0), 18)
    top = g.ints(np.iinfo(np.int64).max)
    out = g.op("Add", [g.m, top])
    model = g.model()
    values = {"m": np.array([[1]], np.int64), top.name: np.array(np.iinfo(np.int64).max)}
    values[out.name] = np.array([[np.iinfo(np.int64).min]], np.int64)  # wrapped
    assert fuzz.overflowed(model, values)
    values["m"] = np.array([[0]], np.int64)
    values[out.name] = np.array([[np.iinfo(np.int64).max]], np.int64)
    assert not fuzz.overflowed(model, values)


def test_a_claim_is_made_concrete_at_the_sizes_of_a_run():
    run = fuzz.Run({"K": 3}, {"m": np.array([[5, 6, 7]], np.int64)}, exact=False)
    tensor = SymTensor((Affine(const=1), Affine.of(Symbol.dim("K"))), "int", Affine.of(axis(1)) + 5)
    fuzz.check_shape(tensor, np.zeros((1, 3), np.int64), run)
    assert fuzz.check_elements(tensor, np.array([[5, 6, 7]], np.int64), run) == 1
    with pytest.raises(fuzz.Mismatch):
        fuzz.check_elements(tensor, np.array([[5, 6, 8]], np.int64), run)
    with pytest.raises(fuzz.Mismatch):
        fuzz.check_shape(tensor, np.zeros((1, 4), np.int64), run)
    entry = SymTensor(
        (Affine(const=1), Affine(const=3)), "int", Affine.of(Symbol.entry("m", ZERO, Affine.of(axis(1))))
    )
    assert fuzz.check_elements(entry, np.array([[5, 6, 7]], np.int64), run) == 1
