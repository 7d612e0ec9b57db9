"""Where int4 loses on SmolLM2-135M: K or V, which layers, short or long contexts.

    python benchmarks/int4_sensitivity.py [--cache DIR] [--granularity per_channel]
    python benchmarks/int4_sensitivity.py --scales A.json B.json ...

Reuses ``benchmarks/real_model.py``'s cached model and windows. The model is converted to int4
with the int4 default's scales (``attention``), then emulated under the CPU kernel's rule (new
tokens quantized before attending) with every layer's scales and, per layer and side, a switch
``en.{layer}.{k|v}`` as graph inputs: 0 keeps that side float, 1 quantizes it. One session
serves every row. Without ``--scales`` it prints the KL to the float cache (calibration windows
7 and 8, positions 64..510) with everything quantized, K only, V only, and each side of five
layers at a time. With ``--scales`` it prints, per scale file, the KL on two held-out windows
(positions 64..510) and on the six held-out windows as one 3072-token context (positions
2048..3070): what scales fitted to short contexts do further out. Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import pathlib

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from real_model import build_model, token_windows

import onnx_kvcache.passes.kv_cache_emulation as emulation
from onnx_kvcache.cache.operators import GqaInput
from onnx_kvcache.cache.sites import find_gqa_sites
from onnx_kvcache.calibrate.calibration import calibrate_kv_cache
from onnx_kvcache.model_io.reading import load_model
from onnx_kvcache.passes.kv_cache_quantization import KvCacheQuantizationPass
from onnx_kvcache.scales.files import KvCacheScales, load_kv_cache_scale_file

SIDES = (("k", "key"), ("v", "value"))


def emulated(folder: pathlib.Path, out: pathlib.Path, granularity: str, scales: KvCacheScales) -> int:
    """Write the switchable emulated int4 model to ``out``; the number of layers."""
    model = load_model(folder)
    KvCacheQuantizationPass("int4", granularity, scales)(model)
    graph = model.graph
    sites = find_gqa_sites(model)
    for site in sites:
        for slot in (GqaInput.K_SCALE, GqaInput.V_SCALE):  # graph inputs
            value = site.node.inputs[slot]
            if value is not None and value.name in graph.initializers:
                graph.initializers.pop(value.name)
                value.const_value = None
                graph.inputs.append(value)
    switches: list[ir.Value] = []
    rewrite = emulation._Rewrite
    round_trip, init = rewrite._round_trip_new, rewrite.__init__

    def cpu_rule(self, site, semantics, quantized_io, steps):  # type: ignore[no-untyped-def]
        init(self, site, "cpu", quantized_io, steps)

    def switched(self, x, codec, split):  # type: ignore[no-untyped-def]
        y = round_trip(self, x, codec, split)
        side = getattr(self, "_side", 0)
        self._side = side + 1
        on = ir.Value(
            name=f"en.{self.site.layer_id}.{'kv'[side]}",
            type=ir.TensorType(ir.DataType.FLOAT),
            shape=ir.Shape([]),
        )
        switches.append(on)
        b = self.b
        return b.op("Add", [x, b.op("Mul", [b.op("Sub", [y, x]), on])], dtype=self.dtype)

    rewrite._round_trip_new, rewrite.__init__ = switched, cpu_rule  # type: ignore[method-assign]
    try:
        emu = emulation.emulate_kv_cache(model, "cuda")  # "cuda" asks for the rewrite; the rule is cpu
    finally:
        rewrite._round_trip_new, rewrite.__init__ = round_trip, init  # type: ignore[method-assign]
    emu.graph.inputs.extend(switches)
    ir.save(emu, out, external_data=out.name + ".data")
    return len(sites)


class Switchable:
    def __init__(self, path: pathlib.Path, layers: int) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = min(2, os.cpu_count() or 1)
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.layers = layers
        self.base: dict[str, np.ndarray] = {}

    def logp(self, windows: list[list[int]], scales: KvCacheScales, on: set, lo: int) -> np.ndarray:
        ids = np.asarray(windows, np.int64)
        feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for layer in range(self.layers):
            for (side, kind), scale in zip(SIDES, scales.for_layer(layer)):
                feeds[f"past_key_values.{layer}.{kind}"] = np.zeros((len(ids), 3, 0, 64), np.float32)
                feeds[f"past_key_values.{layer}.{kind}_scale"] = np.asarray(scale, np.float32).reshape(-1)
                feeds[f"en.{layer}.{side}"] = np.asarray(float((layer, side) in on), np.float32)
        x = self.session.run(["logits"], feeds)[0][:, lo:-1].astype(np.float32)
        x -= x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    def kl(self, key: str, windows: list[list[int]], scales: KvCacheScales, on: set, lo: int = 64) -> float:
        if key not in self.base:
            self.base[key] = self.logp(windows, scales, set(), lo)
        b = self.base[key]
        return float((np.exp(b) * (b - self.logp(windows, scales, on, lo))).sum(-1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "onnx-kvcache-bench"
    )
    parser.add_argument("--granularity", default="per_channel", choices=["per_channel", "per_tensor"])
    parser.add_argument("--scales", nargs="*", type=pathlib.Path, help="int4 scale files to score")
    args = parser.parse_args()
    cache = args.cache.expanduser()
    folder = build_model(cache)
    calib, held = token_windows(folder, cache)
    start_file = cache / f"int4-{args.granularity}-attention.json"
    if start_file.is_file():
        start = load_kv_cache_scale_file(start_file, format="int4")
    else:
        start = calibrate_kv_cache(
            folder, calib, format="int4", granularity=args.granularity, method="attention", progress=False
        )
        start.save(start_file)
    path = cache / f"int4-{args.granularity}-switchable.onnx"
    layers = emulated(folder, path, args.granularity, start)
    model = Switchable(path, layers)
    every = {(layer, side) for layer in range(layers) for side in "kv"}
    if args.scales:
        for file in args.scales:
            scales = load_kv_cache_scale_file(file, format="int4")
            short = model.kl("held", held[:2], scales, every)
            far = model.kl("long", [[t for w in held for t in w]], scales, every, lo=2048)
            print(
                f"{file.name}: KL held-out 2 x 512 (positions 64..510) {short:.4f}, one 3072-token "
                f"context (positions 2048..3070) {far:.4f}",
                flush=True,
            )
        return
    windows = calib[-2:]
    print(f"int4 {args.granularity} attention scales, KL to the float cache, calibration windows 7-8")
    print(f"  everything quantized {model.kl('c', windows, start, every):.4f}")
    for side in "kv":
        print(
            f"  {side.upper()} only ({'V' if side == 'k' else 'K'} float) "
            f"{model.kl('c', windows, start, {(i, side) for i in range(layers)}):.4f}",
            flush=True,
        )
    for first in range(0, layers, 5):
        group = range(first, min(first + 5, layers))
        k, v = (model.kl("c", windows, start, {(i, side) for i in group}) for side in "kv")
        print(f"  layers {first}-{group[-1]}: K only {k:.4f}  V only {v:.4f}", flush=True)


if __name__ == "__main__":
    main()
