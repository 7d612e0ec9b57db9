"""Where int4 scales lose, layer by layer, on the real model of ``benchmarks/real_model.py``.

    python benchmarks/attention_error.py [--cache DIR] [--granularity per_channel] [--method attention]
        [--scales FILE]

Calibrates SmolLM2-135M-Instruct (built and cached by ``real_model.py``) on its 8 x 512
calibration windows (or loads ``--scales``), then, on the first ``--windows`` held-out windows
(the scoring text), captures every layer's query and float K/V and prints per layer, for 128
query positions per window, the attention-output error of the int4 cache as a share of the
output's energy (every row quantized, as onnxruntime's CPU kernel does; see
``onnx_kvcache.calibrate._attention_error``): K and V together, K alone, V alone, V with the first row
(the attention sink) kept exact, and the attention share the sink receives. Not part of CI.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import real_model

from onnx_kvcache import KvCacheRunner, calibrate_kv_cache
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.calibrate._attention_error import attention_error
from onnx_kvcache.calibrate._attention_error import rope as _rope
from onnx_kvcache.calibrate.calibration import ATTENTION_QUERIES, _rope_tables
from onnx_kvcache.scales.files import load_kv_cache_scale_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "onnx-kvcache-bench"
    )
    parser.add_argument("--granularity", default="per_channel", choices=("per_channel", "per_tensor"))
    parser.add_argument("--method", default="attention", help="calibration method (int4)")
    parser.add_argument("--scales", type=pathlib.Path, help="an int4 scale file instead of calibrating")
    parser.add_argument("--windows", type=int, default=2, help="held-out windows to measure on")
    args = parser.parse_args()
    cache = args.cache.expanduser()
    folder = real_model.build_model(cache)
    calib, held = real_model.token_windows(folder, cache)
    if args.scales:
        scales = load_kv_cache_scale_file(args.scales, format="int4")
        what = str(args.scales)
    else:
        scales = calibrate_kv_cache(
            folder, calib, format="int4", granularity=args.granularity, method=args.method, progress=False
        )
        what = f"int4 {args.granularity} {args.method}"
    fmt = get_format("int4")
    runner = KvCacheRunner(folder, caches_only=True, capture_queries=True)
    sites = {s.layer_id: s for s in find_attention_sites(runner.source_model)}
    length = real_model.SEQ_LEN
    picks = np.unique(np.linspace(0, length - 1, ATTENTION_QUERIES).round().astype(np.int64))
    totals: dict[int, np.ndarray] = {}
    for window in held[: args.windows]:
        runner.reset(1, min_capacity=length)
        runner.fill(np.asarray([window], np.int64))
        for layer, site in sites.items():
            q = _rope(runner.query(layer)[0][0], *_rope_tables(site, length), False)[picks]
            k, v = runner.cache_values(layer, "key")[0], runner.cache_values(layer, "value")[0]
            ks, vs = scales.for_layer(layer)
            kw = dict(scale=site.float_attr("scale") or q.shape[-1] ** -0.5, picks=picks)
            err = attention_error(q, k, v, ks, vs, fmt, **kw)  # type: ignore[arg-type]
            sink = attention_error(q, k, v, ks, vs, fmt, exact_rows=[0], **kw)  # type: ignore[arg-type]
            row = np.array([err.both, err.key, err.value, sink.value, err.norm, err.sink_share])
            totals[layer] = totals.get(layer, 0) + row
    print(f"scales: {what}; measured on {args.windows} held-out window(s) x {len(picks)} queries")
    print(f"{'layer':>5} {'K+V':>7} {'K':>7} {'V':>7} {'V,sink exact':>12} {'sink p':>7}")
    shares = []
    for layer, t in sorted(totals.items()):
        rel = t[:4] / t[4]
        shares.append(rel)
        print(
            f"{layer:>5} {rel[0]:7.4f} {rel[1]:7.4f} {rel[2]:7.4f} {rel[3]:12.4f} {t[5] / args.windows:7.2f}"
        )
    mean = np.mean(shares, axis=0)
    print(f" mean {mean[0]:7.4f} {mean[1]:7.4f} {mean[2]:7.4f} {mean[3]:12.4f}")


if __name__ == "__main__":
    main()
