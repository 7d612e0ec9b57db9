"""Decode speed of KvCacheRunner on the bundled decoder, per cache format, on CPU.

    python benchmarks/evaluate.py [--context 1024] [--steps 128]

Prefills ``context`` tokens, then times ``steps`` single-token decode steps, for the
float32 original, int8, int4 and fp8 (emulated on CPU) caches; reports decode tokens per
second and the bytes held by the cache buffers at the end.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from onnx_kvcache import KvCacheQuantizationPass, KvCacheRunner, build_decoder, calibrate_kv_cache
from onnx_kvcache.data import corpus_byte_ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=128)
    args = parser.parse_args()
    prompt = np.random.default_rng(0).integers(0, 256, args.context)
    rows = []
    for fmt in (None, "int8", "int4", "fp8"):
        model = build_decoder()
        if fmt is not None:
            scales = calibrate_kv_cache(
                model, [corpus_byte_ids()], format=fmt, granularity="per_channel", progress=False
            )
            KvCacheQuantizationPass(fmt, "per_channel", scales)(model)
        runner = KvCacheRunner(model)
        runner.prefill(prompt)
        token = 1
        start = time.perf_counter()
        for _ in range(args.steps):
            token = int(np.argmax(runner.step(token)[0]))
        wall = time.perf_counter() - start
        name = "float32" if fmt is None else fmt + (" (emulated)" if runner.emulated else "")
        rows.append((name, args.steps / wall, runner.cache_nbytes()))
    print(f"bundled decoder, {args.context}-token context, {args.steps} decode steps, CPU:")
    print(f"{'cache':<16}{'decode tok/s':>14}{'cache bytes':>14}")
    for name, rate, nbytes in rows:
        print(f"{name:<16}{rate:>14.0f}{nbytes:>14,}")


if __name__ == "__main__":
    main()
