"""Storage-quantized caches (``storage="qdq"``) on the producers' oracle: KL and bytes.

For every file the storage keeps (the five mobius static builds, DeepSeek-V3's MLA exports, an
export whose attention does not fuse, ONNX Attention holding its cache) and every format and
granularity its opset runs: scales calibrated on the file's own 7-token prompt and 3 decode steps
(each cache's absolute maximum over qmax), the next-token KL mean against the float model over
those 10 positions, and the cache bytes per token before and after. Prints a Markdown table.

    python benchmarks/qdq_storage.py
"""

from __future__ import annotations

import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # tests/qdq_models.py

import qdq_models
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cache.storage import QDQ_TYPES, storage_bytes_per_token
from onnx_kvcache.passes import QdqKvCachePass

CELLS = [("int8", "per_tensor"), ("int8", "per_channel"), ("fp8", "per_tensor"), ("int4", "per_channel")]


def main() -> None:
    print("| file | format | KL mean | bytes/token before | after |")
    print("|---|---|---|---|---|")
    models = qdq_models.STATIC + qdq_models.MLA + qdq_models.CONCAT + qdq_models.OWN_CACHE
    for path in models:
        float_model = qdq_models.load(path)
        want, _ = qdq_models.run(float_model)
        before = storage_bytes_per_token(float_model)
        for fmt, granularity in CELLS:
            if float_model.opset_imports[""] < QDQ_TYPES[fmt].opset:
                opset = float_model.opset_imports[""]
                print(f"| {path} | {fmt} {granularity} | refused: opset {opset} | | |")
                continue
            model = qdq_models.load(path)
            scales = qdq_models.calibrate(model, fmt, granularity, get_format(fmt).qmax)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                QdqKvCachePass(fmt, granularity, scales)(model)
            got, _ = qdq_models.run(model)
            kl = qdq_models.kl_mean(want, got)
            after = storage_bytes_per_token(model)
            print(f"| {path} | {fmt} {granularity} | {kl:.2e} | {before:g} | {after:g} |")


if __name__ == "__main__":
    main()
