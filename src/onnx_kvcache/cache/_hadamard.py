"""Hadamard matrices (``+-1`` entries, ``H H^T = n I``) this library builds, for rotated caches.

Rules:

* Order ``n = 2^j * c`` with ``c`` a core order below, the largest ``j`` first:
  ``kron(S_(2^j), P_c)``, ``S`` Sylvester's doubling (``S_1 = [1]``).
* Core orders: ``1``; Paley I, ``q + 1`` for ``q`` a prime ``= 3 mod 4`` (12, 20, 44, 60, ...);
  Paley II, ``2 (q + 1)`` for ``q`` a prime or a prime's square ``= 1 mod 4`` (28, 36, 52, 76,
  100, ...); both over GF(q) with its quadratic character.
* Not built: orders that are not 1, 2 or a multiple of 4 (none exists), and the multiples of
  4 no rule reaches (92, 116, 156, 172, 184, 188, 232, 236 up to 256).
"""

from __future__ import annotations

__all__ = ["hadamard", "sylvester"]

import functools

import numpy as np


def sylvester(n: int) -> np.ndarray:
    """Sylvester's ``+-1`` Hadamard matrix of order ``n``, a power of two (int64)."""
    h = np.ones((1, 1), np.int64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _prime(p: int) -> bool:
    return p > 2 and all(p % f for f in range(2, int(p**0.5) + 1))


def _field(q: int) -> tuple[int, int] | None:
    """``(p, k)`` with ``q = p^k``, ``p`` an odd prime and ``k`` 1 or 2; None otherwise."""
    if _prime(q):
        return q, 1
    root = round(q**0.5)
    return (root, 2) if root * root == q and _prime(root) else None


def _jacobsthal(p: int, k: int) -> np.ndarray:
    """``Q[x, y] = chi(y - x)`` over GF(p^k), ``chi`` its quadratic character. An element
    ``a + b t`` (``t^2 = r``, ``r`` a non-square mod ``p``) is indexed ``a + p b``; its character
    is the Legendre symbol of ``a`` (GF(p)) or of its norm ``a^2 - r b^2`` (GF(p^2))."""
    squares = np.zeros(p, bool)
    squares[np.arange(1, p) ** 2 % p] = True
    legendre = np.where(squares, 1, -1)
    legendre[0] = 0
    r = int(np.flatnonzero(~squares)[1])  # the least non-square (index 0 is 0)
    index = np.arange(p**k)
    a, b = index % p, index // p
    da, db = (a[None, :] - a[:, None]) % p, (b[None, :] - b[:, None]) % p
    return legendre[da if k == 1 else (da * da - r * db * db) % p]


def _paley(p: int, k: int) -> np.ndarray:
    """Paley I (``q = p^k = 3 mod 4``, order ``q + 1``) or II (``q = 1 mod 4``, order ``2 (q + 1)``)."""
    q = p**k
    n = q + 1
    c = np.zeros((n, n), np.int64)
    c[0, 1:] = 1
    c[1:, 0] = -1 if q % 4 == 3 else 1
    c[1:, 1:] = _jacobsthal(p, k)
    if q % 4 == 3:
        return np.eye(n, dtype=np.int64) + c
    return np.kron(c, np.array([[1, -1], [-1, -1]])) + np.kron(np.eye(n, dtype=np.int64), [[1, 1], [1, -1]])


def _core(n: int) -> tuple[np.ndarray, str] | None:
    """The core matrix of order ``n`` (rules) and its name; None when no rule builds one."""
    if n == 1:
        return np.ones((1, 1), np.int64), ""
    for q, kind in ((n - 1, "I"), (n // 2 - 1, "II")):
        field = _field(q) if n % 4 == 0 and q % 4 == (3 if kind == "I" else 1) else None
        if field is not None:
            return _paley(*field), f"Paley {kind} {n}x{n} (q = {q})"
    return None


@functools.cache
def hadamard(n: int) -> tuple[np.ndarray, str] | None:
    """The Hadamard matrix of order ``n`` (int64, unnormalized; the rules) and how it is built,
    in words; None when none is built."""
    power = n & -n
    while power >= 1:
        core = _core(n // power)
        if core is not None:
            matrix = np.kron(sylvester(power), core[0]) if power > 1 else core[0]
            words = " x ".join(w for w in (f"Walsh-Hadamard {power}x{power}" * (power > 1), core[1]) if w)
            matrix.setflags(write=False)
            return matrix, words
        power //= 2
    return None
