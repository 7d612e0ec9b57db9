"""Calibration speed and memory on the bundled decoder, and what the RoPE envelope buys.

    python benchmarks/calibrate.py

1. Tokens per second and peak RSS of calibrate_kv_cache at seq-len 512 on the built-in
   corpus (byte-level ids, the bundled decoder's tokenizer).
2. Scales calibrated on short windows (64 tokens), then K read at long positions (up to
   4096): the fraction of K values the int8 cache clips (beyond level 127 or -128 by more
   than half a step), with raw K thresholds and with the rotation-invariant envelope.
"""

from __future__ import annotations

import resource
import time

import numpy as np

from onnx_kvcache import KvCacheRunner, build_decoder, calibrate_kv_cache, get_format
from onnx_kvcache.data import builtin_corpus, corpus_byte_ids


def main() -> None:
    model = build_decoder()
    tokens = len(builtin_corpus().encode("utf-8"))
    warm_up = [corpus_byte_ids()[:64]]  # imports, first session: not timed
    calibrate_kv_cache(model, warm_up, progress=False, min_tokens=0)
    for method in ("minmax", "percentile", "mse"):
        start = time.perf_counter()
        calibrate_kv_cache(
            model, [corpus_byte_ids()], format="int8", method=method, seq_len=512, progress=False
        )
        wall = time.perf_counter() - start
        print(
            f"calibrate {method:<10} seq-len 512: {tokens / wall:8.0f} tokens/s "
            f"({tokens} tokens, {wall:.2f} s)"
        )
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")

    long_model = build_decoder(rope_theta=500000.0)
    short = [
        list(np.frombuffer(builtin_corpus().encode()[:2048], np.uint8)[i : i + 64])
        for i in range(0, 2048, 64)
    ]
    runner = KvCacheRunner(long_model)
    ids = np.frombuffer((builtin_corpus() * 2).encode()[:4096], np.uint8).astype(np.int64)
    runner.prefill(ids)
    int8 = get_format("int8")
    print("int8 per-channel K scales from 64-token windows, K read over 4096 positions:")
    for envelope in (False, True):
        scales = calibrate_kv_cache(
            long_model,
            short,
            format="int8",
            granularity="per_channel",
            rope_envelope=envelope,
            progress=False,
        )
        clipped, late = [], []
        for layer in scales.layer_ids:
            k = runner.present(layer, "key")[0]  # [kv, T, hd]
            level = k * int8.reciprocal(scales.k[layer].reshape(k.shape[0], 1, k.shape[2]))
            beyond = (level > int8.qmax_stored + 0.5) | (level < int8.qmin_stored - 0.5)
            clipped.append(np.mean(beyond))
            late.append(np.mean(beyond[:, 2048:]))
        name = "envelope" if envelope else "raw K"
        print(
            f"  {name:<9} clipped: {np.mean(clipped):.3%} of all K values, "
            f"{np.mean(late):.3%} past position 2048"
        )


if __name__ == "__main__":
    main()
