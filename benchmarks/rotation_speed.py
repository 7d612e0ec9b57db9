"""Decode speed of a rotated int4 cache against an unrotated one, on onnxruntime's CPU kernel.

    python benchmarks/rotation_speed.py [--model PATH] [--context 1024] [--steps 32] [--rounds 5]

Issue 39's target: a rotated int4 model decodes at least 0.95x as fast as an unrotated one.

The model: ``--model`` (a float32 ``.onnx`` file or genai folder, e.g. the folder
``benchmarks/real_model.py`` builds), else the bundled decoder in SmolLM2-135M's shape (30
layers, hidden 576, 9/3 heads of 64, MLP 1536, vocab 49152, RoPE inside GroupQueryAttention as
genai's builder writes it; seeded weights: speed does not depend on them). It is converted to
int4 per channel with the same scales three times (``optimize_model`` for the CPU, each rotation
the scales record): ``none``, ``keys`` and ``keys_and_values`` (calibration's default for int4).
A rotated graph applies RoPE outside the attention node (com.microsoft RotaryEmbedding) and
turns q, k (and v, and the output back) by ``H`` per head.

Each round runs every model in turn (interleaved, so the machine's load falls on each alike):
a ``--context``-token prefill, then ``--steps`` decode steps timed, each step feeding the
previous presents (a growing cache, as onnxruntime-genai runs a CPU model). One session per
model, ``--threads`` intra-op threads. Printed: per model the median over rounds of the wall and
CPU (process) milliseconds per decode step, and its decode speed as a share of the unrotated
model's (wall and CPU). Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import numpy as np
import onnx_ir as ir

from onnx_kvcache import load_model, optimize_model
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.runtime._cache import discover_cache_bindings
from onnx_kvcache.scales.files import KvCacheScales

ROTATIONS = ("none", "keys", "keys_and_values")
SMOLLM2 = dict(
    num_layers=30,
    hidden_size=576,
    num_heads=9,
    kv_num_heads=3,
    head_size=64,
    intermediate_size=1536,
    vocab_size=49152,
    max_position=8192,
)


def converted(source: ir.Model, rotation: str) -> ir.Model:
    """``source`` with an int4 per-channel cache, rotated as ``rotation``."""
    model = source.clone()
    sites = find_attention_sites(model)
    n = sites[0].kv_num_heads * sites[0].head_size()
    k = {s.layer_id: np.full(n, 0.5, np.float32) for s in sites}
    scales = KvCacheScales(k, k, format="int4", granularity="per_channel", metadata={"rotation": rotation})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optimize_model(model, ep="cpu", scales=scales, strict=True)


class Decoder:
    """One CPU session over a converted model, fed as onnxruntime-genai feeds a CPU model."""

    def __init__(self, model: ir.Model, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        self.bindings = discover_cache_bindings(model)
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.nodes = sum(1 for _ in model.graph)

    def run(self, ids: np.ndarray, steps: int) -> tuple[float, float]:
        """Prefill ``ids`` then ``steps`` decode steps: seconds (wall, CPU) per decode step."""
        caches = {
            b.past: np.zeros((1, b.kv_num_heads, 0, b.last_dim), b.dtype.numpy()) for b in self.bindings
        }
        total = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64), **caches}
        outputs = dict(zip(self.outputs, self.session.run(None, feeds)))
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            token = np.asarray([[int(outputs["logits"][0, -1].argmax())]], np.int64)
            total += 1
            feeds = {"input_ids": token, "attention_mask": np.ones((1, total), np.int64)}
            feeds |= {b.past: outputs[b.present] for b in self.bindings}
            outputs = dict(zip(self.outputs, self.session.run(None, feeds)))
        return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a float32 .onnx file or genai folder (default: SmolLM2-shaped)")
    parser.add_argument("--context", type=int, default=1024, help="prefill tokens (default: 1024)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps a round (default: 32)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default: 1)")
    args = parser.parse_args()
    source = load_model(args.model) if args.model else build_decoder(**SMOLLM2)
    decoders = {r: Decoder(converted(source, r), args.threads) for r in ROTATIONS}
    vocab = 49152 if args.model is None else 1000
    ids = np.random.default_rng(0).integers(0, vocab, (1, args.context)).astype(np.int64)
    times: dict[str, list[tuple[float, float]]] = {r: [] for r in ROTATIONS}
    load = os.getloadavg()[0]
    for round_ in range(args.rounds):
        for r in ROTATIONS if round_ % 2 == 0 else reversed(ROTATIONS):
            times[r].append(decoders[r].run(ids, args.steps))
    base_wall = statistics.median(t[0] for t in times["none"])
    base_cpu = statistics.median(t[1] for t in times["none"])
    print(
        f"int4 per channel, {args.context}-token context, {args.steps} decode steps x {args.rounds} rounds, "
        f"{args.threads} thread(s); load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'rotation':<16} {'nodes':>6} {'wall ms/step':>13} {'CPU ms/step':>12} "
        f"{'speed (wall)':>13} {'(CPU)':>7}"
    )
    for r in ROTATIONS:
        wall = statistics.median(t[0] for t in times[r])
        cpu = statistics.median(t[1] for t in times[r])
        print(
            f"{r:<16} {decoders[r].nodes:>6} {wall * 1e3:13.2f} {cpu * 1e3:12.2f} "
            f"{base_wall / wall:12.3f}x {base_cpu / cpu:6.3f}x"
        )


if __name__ == "__main__":
    main()
