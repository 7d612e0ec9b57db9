"""Decode speed of KvCacheRunner per cache format and kernel rule, side by side on CPU.

    python benchmarks/evaluate.py [--context 1024] [--steps 128] [--rounds 5]

Prefills ``context`` tokens into every runner, then times ``steps`` single-token decode
steps per runner, round-robin over ``rounds`` rounds in one process (so machine noise hits
every row alike), and reports the median decode tokens per second, its ratio to float32,
and the bytes the caches take in their stored format. Rows: the float32 original; int8
and int4 on onnxruntime's CPU kernel; int8, int4 and fp8 under CUDA's rule, emulated
(float caches holding dequantized values); fp8 emulated with stored-format cache I/O (the
whole cache converted every step). Target (issue 11): fp8, and int8/int4 under CUDA's rule,
emulated at >= 0.8x float32; one verdict line each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from onnx_kvcache import KvCacheQuantizationPass, KvCacheRunner, build_decoder, calibrate_kv_cache
from onnx_kvcache.scales.data import corpus_byte_ids

#: Decode speed the TARGETED rows must reach, as a fraction of float32's.
TARGET = 0.8

#: (label, format, kernel rule, stored-format cache I/O)
ROWS = (
    ("float32", None, None, False),
    ("int8, cpu kernel", "int8", "cpu", False),
    ("int4, cpu kernel", "int4", "cpu", False),
    ("int8, cuda rule (emulated)", "int8", "cuda", False),
    ("int4, cuda rule (emulated)", "int4", "cuda", False),
    ("fp8, cuda rule (emulated)", "fp8", "cuda", False),
    ("fp8, stored-format I/O", "fp8", "cuda", True),
)

#: The rows held to TARGET: every format emulated with CUDA's rule (float cache I/O).
TARGETED = ("int8, cuda rule (emulated)", "int4, cuda rule (emulated)", "fp8, cuda rule (emulated)")


def _runner(fmt: str | None, semantics: str | None, quantized_io: bool) -> KvCacheRunner:
    model = build_decoder()
    if fmt is not None:
        scales = calibrate_kv_cache(
            model, [corpus_byte_ids()], format=fmt, granularity="per_channel", progress=False
        )
        KvCacheQuantizationPass(fmt, "per_channel", scales)(model)
    return KvCacheRunner(model, semantics=semantics, quantized_io=quantized_io)


def _decode(runner: KvCacheRunner, prompt: np.ndarray, steps: int) -> float:
    runner.prefill(prompt)
    token = 1
    start = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(runner.step(token)[0]))
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    prompt = np.random.default_rng(0).integers(0, 256, args.context)
    runners = [_runner(fmt, semantics, io) for _, fmt, semantics, io in ROWS]
    rates: list[list[float]] = [[] for _ in ROWS]
    for _ in range(args.rounds):
        for i, runner in enumerate(runners):
            rates[i].append(_decode(runner, prompt, args.steps))
    medians = [statistics.median(r) for r in rates]
    print(
        f"bundled decoder, {args.context}-token context, {args.steps} decode steps, "
        f"median of {args.rounds} rounds, CPU:"
    )
    print(f"{'cache':<30}{'decode tok/s':>14}{'vs float32':>12}{'cache bytes':>14}")
    for (label, *_), runner, rate in zip(ROWS, runners, medians):
        print(f"{label:<30}{rate:>14.0f}{rate / medians[0]:>11.2f}x{runner.cache_nbytes():>14,}")
    labels = [label for label, *_ in ROWS]
    for label in TARGETED:
        ratio = medians[labels.index(label)] / medians[0]
        verdict = "met" if ratio >= TARGET else "NOT met"
        print(f"target {label} >= {TARGET:.2f}x float32: {verdict} ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
