"""The PagedAttention CPU reference: agreement figures and decode speed, on this machine.

    python benchmarks/paged.py [--context 512] [--steps 64]

Prints three tables:

1. the reference (the ONNX rewrite, run by onnxruntime) against the numpy reference of the
   operator (``tests/paged_reference.py``): worst absolute output error over three packed
   sequences (5, 17, 33 tokens), a decode step, a mixed chunk and another decode, float32,
   per cache format x granularity x block size (the test suite asserts <= 1e-5);
2. the bundled paged decoder against its GQA twin (same weights) run by onnxruntime's own
   CPU GroupQueryAttention kernel (int8/int4: the kernel; fp8: the GQA emulation with the
   CPU rule): worst logit difference over a 37-token prefill and 4 decode steps, and whether
   every stored cache code is identical (quantized caches);
3. decode tokens per second of the paged decoder on the reference against the GQA twin
   (float32 and int8 per channel), after a ``context``-token prefill (median of 3 rounds).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
import warnings

import numpy as np

from onnx_kvcache import KvCacheQuantizationPass, KvCacheRunner
from onnx_kvcache.models.decoder import build_decoder

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"


def numpy_agreement() -> list[tuple[str, str, int, float]]:
    sys.path[:0] = [str(TESTS), str(TESTS / "passes")]
    from test_paged_attention_reference import CACHE_CASES, _scales, converted, run_case

    from conftest import paged_model

    rows = []
    for fmt, granularity in CACHE_CASES:
        for block_size in (16, 32):
            scales = _scales(fmt, granularity, 2, 16)
            model = converted(paged_model(), fmt, granularity, scales)
            rows.append(
                (
                    fmt or "float",
                    granularity if fmt else "-",
                    block_size,
                    run_case(model, block_size, fmt, scales),
                )
            )
    return rows


def twins(fmt: str | None, granularity: str) -> tuple[KvCacheRunner, KvCacheRunner]:
    models = [build_decoder(num_layers=2, vocab_size=300, paged=paged) for paged in (False, True)]
    if fmt is not None:
        n = 1 if granularity == "per_tensor" else 64
        big = 16 if fmt == "int4" else 1
        scales = {i: (np.full(n, 0.05 * big), np.full(n, 0.02 * big)) for i in range(2)}
        for model in models:
            KvCacheQuantizationPass(fmt, granularity, scales)(model)
    return KvCacheRunner(models[0], semantics="cpu"), KvCacheRunner(models[1])


def twin_agreement() -> list[tuple[str, str, float, bool, str]]:
    rows = []
    for fmt in (None, "fp8", "int8", "int4"):
        for granularity in ("per_tensor", "per_channel") if fmt else ("per_tensor",):
            gqa, paged = twins(fmt, granularity)
            ids = (np.arange(37) * 7 + 3) % 300
            worst = float(np.abs(gqa.prefill(ids) - paged.prefill(ids)).max())
            for token in (5, 6, 7, 8):
                worst = max(worst, float(np.abs(gqa.step(token) - paged.step(token)).max()))
            same = True
            for layer in range(2):
                for kind in ("key", "value"):
                    pool = paged.present(layer, kind)
                    rows_ = pool.reshape(-1, *pool.shape[2:])[paged.pool.rows(0)]
                    same &= bool(np.array_equal(rows_.transpose(1, 0, 2)[None], gqa.present(layer, kind)))
            rows.append((fmt or "float", granularity if fmt else "-", worst, same, gqa.kernel_rule))
    return rows


def speed(context: int, steps: int, rounds: int) -> list[tuple[str, float]]:
    from onnx_kvcache import calibrate_kv_cache
    from onnx_kvcache.scales.data import corpus_byte_ids

    runners = {}
    for paged in (False, True):
        base = build_decoder(paged=paged)
        runners[f"{'paged reference' if paged else 'GQA cpu kernel'}, float32"] = KvCacheRunner(base)
        model = build_decoder(paged=paged)
        scales = calibrate_kv_cache(
            model, [corpus_byte_ids()], format="int8", granularity="per_channel", progress=False
        )
        KvCacheQuantizationPass("int8", "per_channel", scales)(model)
        runners[f"{'paged reference' if paged else 'GQA cpu kernel'}, int8 per_channel"] = KvCacheRunner(
            model, semantics="cpu"
        )
    prompt = np.asarray(corpus_byte_ids()[:context], np.int64)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, runner in runners.items():
            runner.prefill(prompt)
            token = 1
            start = time.perf_counter()
            for _ in range(steps):
                token = int(np.argmax(runner.step(token)[0]))
            rates[name].append(steps / (time.perf_counter() - start))
    return [(name, statistics.median(r)) for name, r in rates.items()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("1. CPU reference vs numpy reference of the op (worst |output error|, float32)")
    print(f"   {'cache':<6} {'granularity':<12} {'block':>5}  {'worst':>9}")
    for fmt, g, block, worst in numpy_agreement():
        print(f"   {fmt:<6} {g:<12} {block:>5}  {worst:9.2e}")
    print("2. paged decoder (CPU reference) vs GQA twin (onnxruntime CPU kernel)")
    print(f"   {'cache':<6} {'granularity':<12} {'worst logit diff':>16}  {'same codes':>10}  GQA rule")
    for fmt, g, worst, same, rule in twin_agreement():
        codes = "-" if fmt == "float" else ("yes" if same else "NO")
        print(f"   {fmt:<6} {g:<12} {worst:16.2e}  {codes:>10}  {rule}")
    what = f"{args.context}-token prefill ({args.steps} steps, median of {args.rounds})"
    print(f"3. decode tokens/s after a {what}")
    for name, rate in speed(args.context, args.steps, args.rounds):
        print(f"   {name:<36} {rate:8.1f}")


if __name__ == "__main__":
    main()
