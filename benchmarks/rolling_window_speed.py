"""Decode speed of a rolling window cache in its two fused forms, on onnxruntime's CPU.

A transformers 5.x export with rolling window caches (Mistral-shaped: every layer a window
layer, ``DynamicCache(config=...)``), fused as a model file keeps (GroupQueryAttention over the
export's past, its present gathered to each row's last ``W - 1`` tokens: the export's calling
convention) and as an onnxruntime-genai folder keeps (window-sized, ``sliding_window_cache=1``,
past and present separate buffers here), beside the export itself. Each step decodes one token
with the window full (the model file's past ``W - 1`` rows, the window-sized buffer ``W + 16``
rows, onnxruntime-genai's CPU slack), each present fed back; prints the median per step.

    python benchmarks/rolling_window_speed.py [--window 1024] [--layers 8] [--steps 40]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # tests/builders
from onnx_kvcache import optimize_model
from onnx_kvcache.model_io import create_session
from onnx_kvcache.passes.fusion.window_sized import make_window_sized

from builders.exported import ExportStyle, build_decoder, exported_config


def _model(window: int, layers: int, sized: bool | None):
    config = exported_config(
        "mistral",
        num_layers=layers,
        hidden_size=512,
        num_heads=8,
        kv_num_heads=2,
        head_size=64,
        intermediate_size=1024,
        vocab_size=1024,
        sliding_window=window,
        sliding_window_layers=tuple(range(layers)),
        exported=ExportStyle(window_cache="cropped"),
    )
    model = build_decoder(config)
    if sized is None:
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = optimize_model(model, verify=False)
    if sized:
        make_window_sized(model)
    return model


def _median_step(model, rows: int, total: int, steps: int) -> float:
    """Median seconds of a one-token step over a past of ``rows`` rows, ``total`` tokens so far."""
    session = create_session(model)
    names = [o.name for o in session.get_outputs()]
    pasts = [v for v in model.graph.inputs if v.name.startswith("past_key_values")]
    feeds = {v.name: np.zeros((1, v.shape[1], rows, 64), np.float32) for v in pasts}
    times = []
    for step in range(steps):
        feeds |= {
            "input_ids": np.array([[step % 1000]], np.int64),
            "attention_mask": np.ones((1, total + step + 1), np.int64),
            "position_ids": np.array([[total + step]], np.int64),
        }
        start = time.perf_counter()
        out = dict(zip(names, session.run(None, feeds)))
        times.append(time.perf_counter() - start)
        feeds |= {v.name: out[v.name.replace("past_key_values", "present")] for v in pasts}
    return statistics.median(times[steps // 4 :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    w, total = args.window, 4 * args.window
    forms = {
        "export (unfused)": (None, w - 1),
        "model file (the export's caches, row gather)": (False, w - 1),
        "genai folder (window-sized, W + 16 rows)": (True, w + 16),
    }
    print(f"Mistral-shaped, {args.layers} layers, hidden 512, 8/2 heads, head 64, window {w}, CPU")
    for name, (sized, rows) in forms.items():
        seconds = _median_step(_model(w, args.layers, sized), rows, total, args.steps)
        print(f"{name:48s} {seconds * 1e3:7.2f} ms a decode step")


if __name__ == "__main__":
    main()
