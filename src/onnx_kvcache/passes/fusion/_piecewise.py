"""Equality and sign of symbolic lengths with maxima, decided for every value of their symbols.

An :class:`~onnx_kvcache.passes.fusion._symbolic_values.Affine` form over ``max(0, e)``
symbols (:attr:`SymbolKind.MAX`, nested or not: what ``Max``, ``Min``, ``Clip`` and the
clamps of ``Slice`` compute) is a piecewise affine function. Two such forms can be equal for
every value of their symbols without being written alike: ``past + seq - max(0, past - 3)``
and ``seq + max(0, past - max(0, past - 3))`` are (both ``seq + min(past, 3)``).

The rules:

- every maximum ``m = max(0, e)`` is split into its two cases, inner maxima first:
  ``e >= 0`` and ``m = e``, or ``e <= -1`` and ``m = 0`` (the forms are integer-valued);
- in each case every form is affine in the remaining symbols; dimensions (named or fresh)
  are ``>= 0``, every other symbol (indices, an input's entries) may take any integer;
- ``a == b`` holds when, in every case, both ``a - b >= 1`` and ``a - b <= -1`` are
  infeasible; ``e >= 0`` when ``e <= -1`` is infeasible in every case;
- feasibility is Fourier-Motzkin elimination over integer coefficients, each derived
  inequality divided by the gcd of its coefficients with its constant rounded down (valid
  for integer points). A contradiction proves that no integer point satisfies the case, so
  the rules only prove what holds for every integer value; what they cannot decide within
  their limits (:data:`MAX_CASES` cases, :data:`MAX_INEQUALITIES` inequalities) is not
  proven (``False``), never proven wrongly.
"""

from __future__ import annotations

__all__ = ["MAX_CASES", "MAX_INEQUALITIES", "always_nonnegative", "equal", "same_dims"]

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# The evaluator's forms and symbols (onnx_kvcache.passes.fusion._symbolic_values, which imports
# this module): a form has ``terms`` ((symbol, coefficient), ...), ``const``, ``subs``, ``scale``
# and integer arithmetic; a symbol has ``kind`` (its ``name``: DIM, FRESH, MAX, ...) and, for a
# maximum ``max(0, form)``, ``form``. Only those are read here.
Affine = Any
Symbol = Any

MAX_CASES = 4096
"""Feasible cases examined at most; a form with more is not decided."""
MAX_INEQUALITIES = 400
"""Inequalities one elimination step may hold; past this a case counts as feasible."""

_LENGTHS = frozenset({"DIM", "FRESH", "PRODUCT"})
"""The kinds of symbol that are lengths (``>= 0``); ``MAX`` is a maximum ``max(0, form)``."""

# An inequality ``sum(c * x) + const >= 0``: ((symbol, coefficient), ...) sorted, const.
_Ineq = tuple[tuple[tuple[Symbol, int], ...], int]
# Each case of the maxima: (its constraints ``c >= 0``, each maximum as an affine form).
_Cases = Iterator[tuple[list[Affine], dict[Symbol, Affine]]]


def equal(a: Affine, b: Affine) -> bool:
    """``a == b`` for every value of their symbols (proven; ``False`` when not proven)."""
    return a == b or _zero(a - b)


def same_dims(a: Sequence[Affine], b: Sequence[Affine]) -> bool:
    """Two shapes of the same rank whose dimensions are :func:`equal`."""
    return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))


def always_nonnegative(form: Affine) -> bool:
    """``form >= 0`` for every value of its symbols (proven; ``False`` when not proven)."""
    return _nonnegative(form)


@functools.lru_cache(maxsize=4096)
def _zero(diff: Affine) -> bool:
    if not _maxima(diff):
        return not diff.terms and diff.const == 0  # an affine form other than 0 is not 0 somewhere
    return _holds(diff, lambda d: [d - 1]) and _holds(diff, lambda d: [-d - 1])


@functools.lru_cache(maxsize=4096)
def _nonnegative(form: Affine) -> bool:
    return _holds(form, lambda e: [-e - 1])


def _holds(form: Affine, refutations: Callable[[Affine], list[Affine]]) -> bool:
    """Every case of ``form``'s maxima makes the inequalities ``refutations(case form) >= 0``
    infeasible (so their negation holds everywhere)."""
    for count, (constraints, mapping) in enumerate(_cases(_maxima(form))):
        case = form.subs(mapping)
        if count >= MAX_CASES or _feasible([*constraints, *refutations(case)]):
            return False
    return True


def _maxima(form: Affine) -> list[Symbol]:
    """The maxima ``form`` holds, inner ones before the ones that hold them."""
    order: dict[Symbol, None] = {}

    def visit(f: Affine) -> None:
        for symbol, _ in f.terms:
            if symbol.kind.name == "MAX" and symbol not in order:
                assert symbol.form is not None
                visit(symbol.form)
                order[symbol] = None

    visit(form)
    return list(order)


def _cases(maxima: list[Symbol]) -> _Cases:
    """``(constraints >= 0, maxima as affine forms)`` of each feasible case."""

    def split(k: int, constraints: list[Affine], mapping: dict[Symbol, Affine]) -> _Cases:
        if k == len(maxima):
            yield constraints, mapping
            return
        symbol = maxima[k]
        assert symbol.form is not None
        e = symbol.form.subs(mapping)
        for condition, value in ((e, e), (-e - 1, e.scale(0))):
            branch = [*constraints, condition]
            if _feasible(branch):
                yield from split(k + 1, branch, {**mapping, symbol: value})

    yield from split(0, [], {})


def _feasible(constraints: list[Affine]) -> bool:
    """Some point (lengths >= 0) may satisfy every ``c >= 0`` (``False``: proven none does)."""
    system: set[_Ineq] = set()
    symbols: set[Symbol] = set()
    for form in constraints:
        symbols |= form.symbols
        system.add(_tight(dict(form.terms), form.const))
    system |= {(((s, 1),), 0) for s in symbols if s.kind.name in _LENGTHS}
    return _eliminate(system, sorted(symbols))


def _tight(terms: dict[Symbol, int], const: int) -> _Ineq:
    """``sum(c * x) + const >= 0`` divided by the gcd of its coefficients (integer points)."""
    kept = tuple(sorted((s, c) for s, c in terms.items() if c))
    g = math.gcd(*(c for _, c in kept)) if kept else 1
    if g > 1:
        kept = tuple((s, c // g) for s, c in kept)
        const = const // g  # floor: sum(c * x) is a multiple of g at every integer point
    return kept, const


def _eliminate(system: set[_Ineq], symbols: list[Symbol]) -> bool:
    for symbol in symbols:
        upper: list[_Ineq] = []
        lower: list[_Ineq] = []
        rest: set[_Ineq] = set()
        for ineq in system:
            c = dict(ineq[0]).get(symbol, 0)
            if c > 0:
                lower.append(ineq)
            elif c < 0:
                upper.append(ineq)
            else:
                rest.add(ineq)
        for lo_terms, lo_const in lower:
            a = dict(lo_terms)[symbol]
            for up_terms, up_const in upper:
                b = -dict(up_terms)[symbol]
                combined: dict[Symbol, int] = {}
                for s, c in lo_terms:
                    combined[s] = combined.get(s, 0) + b * c
                for s, c in up_terms:
                    combined[s] = combined.get(s, 0) + a * c
                combined.pop(symbol, None)
                rest.add(_tight(combined, b * lo_const + a * up_const))
                if len(rest) > MAX_INEQUALITIES:
                    return True
        system = rest
        if any(not terms and const < 0 for terms, const in system):
            return False
    return not any(not terms and const < 0 for terms, const in system)
