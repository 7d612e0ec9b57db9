"""Equality of symbolic lengths with maxima (passes/fusion/_piecewise.py), as a property test:
random forms over ``past`` and ``seq``, written two ways that are equal for every value, are
proven equal; a proof of equality or of a sign always holds at random values; forms that
differ at some value are never proven equal."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_kvcache.passes.fusion._piecewise import always_nonnegative, equal, same_dims
from onnx_kvcache.passes.fusion._symbolic_values import ONE, ZERO, Affine, Symbol, SymbolKind, max_of, min_of

PAST, SEQ = Affine.of(Symbol.dim("past")), Affine.of(Symbol.dim("seq"))
POINTS = [(p, s) for p in range(0, 13) for s in range(0, 9)]


def value(form: Affine, past: int, seq: int) -> int:
    """``form`` at ``past`` and ``seq`` (maxima evaluated)."""
    total = form.const
    for symbol, c in form.terms:
        if symbol.kind is SymbolKind.MAX:
            assert symbol.form is not None
            total += c * max(0, value(symbol.form, past, seq))
        else:
            total += c * {"past": past, "seq": seq}[symbol.name]
    return total


def agree(a: Affine, b: Affine) -> bool:
    return all(value(a, p, s) == value(b, p, s) for p, s in POINTS)


def clip(x: Affine, lo: Affine, hi: Affine) -> Affine:
    return min_of(max_of(x, lo), hi)


def leaf(rng: np.random.Generator) -> Affine:
    """``a * past + b * seq + c`` with small coefficients."""
    a, b = (int(x) for x in rng.integers(-1, 3, 2))
    return PAST.scale(a) + SEQ.scale(b) + int(rng.integers(-4, 5))


def form(rng: np.random.Generator, depth: int = 2) -> Affine:
    """A random length expression: sums, maxima, minima and clips of smaller ones."""
    if depth == 0 or rng.random() < 0.3:
        return leaf(rng)
    x, y = form(rng, depth - 1), form(rng, depth - 1)
    kind = rng.integers(0, 4)
    if kind == 0:
        return x + y
    if kind == 1:
        return max_of(x, y)
    if kind == 2:
        return min_of(x, y)
    lo = Affine(const=int(rng.integers(-2, 3)))
    return clip(x, lo, lo + int(rng.integers(0, 6)))


def rewritten(rng: np.random.Generator, depth: int = 2) -> tuple[Affine, Affine]:
    """One expression written two ways, by identities that hold for every value."""
    if depth == 0 or rng.random() < 0.3:
        x = leaf(rng)
        return x, x
    (x1, x2), (y1, y2) = rewritten(rng, depth - 1), rewritten(rng, depth - 1)
    kind = rng.integers(0, 6)
    if kind == 0:
        return x1 + y1, y2 + x2
    if kind == 1:  # max(x, y) = max(y, x) = x + max(0, y - x)
        return max_of(x1, y1), x2 + max_of(y2 - x2, ZERO)
    if kind == 2:  # min(x, y) = x + y - max(x, y)
        return min_of(x1, y1), x2 + y2 - max_of(y2, x2)
    if kind == 3:  # x - max(0, x - c) = min(x, c)
        c = int(rng.integers(0, 5))
        return x1 - max_of(x1 - c, ZERO), min_of(x2, Affine(const=c))
    if kind == 4:  # max(max(x, y), z) = max(x, max(y, z))
        z = leaf(rng)
        return max_of(max_of(x1, y1), z), max_of(x2, max_of(y2, z))
    lo, width = int(rng.integers(-2, 3)), int(rng.integers(0, 6))  # clip = max(min(x, hi), lo)
    low, high = Affine(const=lo), Affine(const=lo + width)
    return clip(x1, low, high), max_of(min_of(x2, high), low)


def test_the_window_crop_is_proven_equal():
    """The refusal of issue 35: the repeat's Expand of a rolling window cache."""
    crop = max_of(PAST - 3, ZERO)
    concatenated, expanded = PAST + SEQ - crop, SEQ + max_of(PAST - crop, ZERO)
    assert equal(concatenated, expanded)
    assert concatenated == expanded  # max(0, past - max(0, past - 3)) has no case below 0


@pytest.mark.parametrize("seed", range(2))
def test_forms_written_two_ways_are_proven_equal(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        a, b = rewritten(rng, depth=3)
        assert agree(a, b), (a, b)
        assert equal(a, b), f"{a}  vs  {b}"


@pytest.mark.parametrize("seed", range(2))
def test_a_proof_holds_at_every_value_and_a_difference_is_never_proven_equal(seed):
    rng = np.random.default_rng(100 + seed)
    proven = differ = 0
    for _ in range(150):
        a, b = form(rng), form(rng)
        if rng.random() < 0.3:
            b = a + (leaf(rng) if rng.random() < 0.5 else ZERO)
        if equal(a, b):
            proven += 1
            assert agree(a, b), f"proven equal, but {a} and {b} differ"
        else:
            differ += not agree(a, b)
        if always_nonnegative(a):
            assert all(value(a, p, s) >= 0 for p, s in POINTS), a
    assert proven and differ  # both kinds of pair were drawn


def test_a_sign_and_shapes():
    assert always_nonnegative(PAST - min_of(PAST, Affine(const=3)))
    assert not always_nonnegative(PAST - 3)
    assert same_dims((PAST, ONE), (PAST, ONE)) and not same_dims((PAST,), (PAST, ONE))
    assert not equal(max_of(PAST, SEQ), PAST)
