"""Which ``H`` spreads a head's channels best, for a rotated int4 cache: the candidates, measured.

    python benchmarks/rotation_matrices.py [--sizes 48 80 96 112] [--tokens 4096] [--seeds 3]

The criterion is what a rotated int4 cache is for: one head's keys whose few channels carry
outliers (seeded Gaussian tokens, 4 of the ``d`` channels scaled by 12, as the demo decoder's
K weights are) turned by ``H``, rounded to the int4 cache's levels (``scale = absmax / qmax``)
and turned back. Printed: the relative error ``||x - x'|| / ||x||`` with one scale for the whole
tensor (what an outlier channel costs most) and one per channel, the mean over ``--seeds``
draws of ``--tokens`` tokens; the largest and the smallest ``|entry| * sqrt(d)`` (both 1 for a
Hadamard matrix; 0: a channel is not spread to some other); the largest ``|H H^T - I|`` with
``H`` rounded to bfloat16, all of it and off the diagonal (a Hadamard matrix's rounding is one
scale, ``d r^2`` with ``r`` the rounded ``1/sqrt(d)``: nothing off the diagonal).

1. Head sizes with a Hadamard matrix (``--sizes``): ``hadamard`` (this library's default) and
   ``walsh_dct`` (the ``H`` before it: Walsh-Hadamard x DCT-II).
2. The fallback: every even head size from 6 to 256 without one (``d`` not a multiple of 4, or
   92, 116, 156, ...), with the candidates ``walsh_dct``, ``hadamard`` (there ``kron(H_n,
   DCT-II)``, ``n`` the largest order of a built Hadamard matrix dividing ``d``), ``kron(H_n,
   Hartley)`` and a seeded random orthogonal matrix: each one's mean per-tensor error over those sizes, at how
   many it is the least (ties count for each), and the sizes where the first two differ. Not
   part of CI.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from onnx_kvcache.cache._hadamard import hadamard
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cache.rotation import rotation_matrix

INT4 = get_format("int4")


def _hartley(m: int) -> np.ndarray:
    k, n = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
    angle = 2 * np.pi * k * n / m
    return (np.cos(angle) + np.sin(angle)) / np.sqrt(m)


def _random(d: int, seed: int = 0) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def _largest_hadamard(d: int) -> np.ndarray:
    """The normalized built Hadamard matrix of the largest order dividing ``d``."""
    n = max(n for n in range(1, d + 1) if d % n == 0 and hadamard(n) is not None)
    return hadamard(n)[0] / np.sqrt(n)  # type: ignore[index]


def fallback_candidates(d: int) -> dict[str, np.ndarray]:
    h = _largest_hadamard(d)
    m = d // h.shape[0]
    return {
        "walsh_dct": rotation_matrix(d, "walsh_dct"),
        "hadamard": rotation_matrix(d, "hadamard"),  # kron(H_n, DCT-II)
        "hadamard x Hartley": np.kron(h, _hartley(m)),
        "random (seed 0)": _random(d),
    }


def int4_errors(h: np.ndarray, tokens: int, seeds: int) -> tuple[float, float]:
    """Mean relative int4 error (per tensor, per channel) of outlier keys turned by ``h``."""
    d, found = h.shape[0], []
    for seed in range(seeds):
        rng = np.random.default_rng(100 + seed)
        x = rng.standard_normal((tokens, d))
        x[:, rng.choice(d, min(4, d), replace=False)] *= 12.0
        y = x @ h
        norm = np.linalg.norm(x)
        tensor = INT4.round_trip(y, np.abs(y).max() / INT4.qmax) @ h.T
        channel = INT4.round_trip(y, np.abs(y).max(axis=0) / INT4.qmax) @ h.T
        found.append((np.linalg.norm(x - tensor) / norm, np.linalg.norm(x - channel) / norm))
    tensor_error, channel_error = np.mean(found, axis=0)
    return float(tensor_error), float(channel_error)


def bfloat16_deviation(h: np.ndarray) -> tuple[float, float]:
    """Largest ``|H H^T - I|`` with ``H`` in bfloat16: all of it, off the diagonal."""
    b = h.astype(ml_dtypes.bfloat16).astype(np.float64)
    error = np.abs(b @ b.T - np.eye(h.shape[0]))
    return float(error.max()), float((error - np.diag(np.diag(error))).max())


def row(d: int, name: str, h: np.ndarray, tokens: int, seeds: int) -> tuple[str, float]:
    tensor, channel = int4_errors(h, tokens, seeds)
    whole, off = bfloat16_deviation(h)
    entries = np.abs(h) * np.sqrt(d)
    line = (
        f"{d:5d}  {name:20s} {entries.max():6.3f} {entries.min():6.3f}   {tensor:.4f}  {channel:.4f}"
        f"   {whole:.1e}  {off:.1e}"
    )
    return line, tensor


HEADER = "    d  H                    max|e|  min|e|   int4/tensor  int4/channel  bf16 HH^T-I (off-diagonal)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[48, 80, 96, 112])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print("Head sizes with a Hadamard matrix (|e|: an entry times sqrt(d))")
    print(HEADER)
    for d in args.sizes:
        for name in ("hadamard", "walsh_dct"):
            print(row(d, name, rotation_matrix(d, name), args.tokens, args.seeds)[0])
    sizes = [d for d in range(6, 257, 2) if hadamard(d) is None]
    print(f"\nThe fallback: {len(sizes)} even head sizes from 6 to 256 without one")
    totals: dict[str, list[float]] = {}
    for d in sizes:
        errors = {
            name: int4_errors(h, args.tokens, args.seeds)[0] for name, h in fallback_candidates(d).items()
        }
        for name, error in errors.items():
            totals.setdefault(name, []).append(error)
    least = {name: 0 for name in totals}  # ties count for each (the same matrix)
    for i in range(len(sizes)):
        low = min(errors[i] for errors in totals.values())
        for name, errors in totals.items():
            least[name] += bool(np.isclose(errors[i], low, rtol=1e-9))
    for name, errors in totals.items():
        print(f"  {name:20s} mean int4/tensor {np.mean(errors):.4f}, the least (or tied) at {least[name]}")
    differ = [d for i, d in enumerate(sizes) if totals["hadamard"][i] != totals["walsh_dct"][i]]
    for d in differ:
        i = sizes.index(d)
        print(f"  d = {d}: hadamard {totals['hadamard'][i]:.4f}, walsh_dct {totals['walsh_dct'][i]:.4f}")


if __name__ == "__main__":
    main()
