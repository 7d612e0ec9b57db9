"""Convert a 70B-shaped decoder (weights in a sparse file) and report time, RSS, bytes.

80 layers, hidden 8192, 64 heads, 8 KV heads, head size 128, fp16: ~130 GiB of weights
that cost no disk (a sparse file). Targets on a 2-core machine: the whole CLI run under
3 s and peak RSS under 300 MiB, zero weight bytes written. A small model is also
converted the naive way (load everything, convert, save) for comparison.

    python benchmarks/convert_large.py [--layers 80]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx_ir as ir

from onnx_kvcache.demo_model import DecoderConfig, build_decoder

LLAMA_70B = DecoderConfig(
    num_layers=80,
    hidden_size=8192,
    num_heads=64,
    kv_num_heads=8,
    head_size=128,
    intermediate_size=28672,
    vocab_size=128256,
    max_position=8192,
    dtype="float16",
)


def write_sparse_model(folder: pathlib.Path, config: DecoderConfig) -> tuple[pathlib.Path, int]:
    """The decoder graph, every weight an external tensor of one sparse data file."""
    offset = 0

    def factory(name: str, shape: tuple[int, ...], dtype: ir.DataType) -> ir.TensorProtocol:
        nonlocal offset
        length = int(np.prod(shape) * dtype.itemsize)
        tensor = ir.ExternalTensor(
            "model.onnx.data", offset, length, dtype, shape=ir.Shape(shape), name=name, base_dir=folder
        )
        offset += length
        return tensor

    model = build_decoder(config, weight_factory=factory)
    with open(folder / "model.onnx.data", "wb") as f:
        f.truncate(offset)
    path = folder / "model.onnx"
    path.write_bytes(ir.to_proto(model).SerializeToString())
    return path, offset


def run_cli(args: list[str]) -> tuple[float, float]:
    """Wall seconds and the child's peak RSS in MiB."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "onnx_kvcache", *args], check=True, capture_output=True)
    wall = time.perf_counter() - start
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def naive_convert(src: pathlib.Path, dst: pathlib.Path) -> float:
    import onnx

    from onnx_kvcache import Fp8KvCachePass

    start = time.perf_counter()
    proto = onnx.load(src, load_external_data=True)
    model = ir.from_proto(proto)
    Fp8KvCachePass({i: (1.0, 1.0) for i in range(2)})(model)
    ir.save(model, dst, external_data="naive.onnx.data")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=80)
    args = parser.parse_args()
    config = DecoderConfig(**{**LLAMA_70B.__dict__, "num_layers": args.layers})
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        src, weight_bytes = write_sparse_model(folder, config)
        scales = folder / "scales.json"
        ones = [0.01] * args.layers
        scales.write_text(json.dumps({"scales": {"k_scales": ones, "v_scales": ones}}))
        out = folder / "model.fp8.onnx"
        wall, rss = run_cli(["convert", str(src), str(out), "--format", "fp8", "--scales", str(scales)])
        written = out.stat().st_size
        print(
            f"{args.layers}-layer 70B-shaped decoder, {weight_bytes / 2**30:.1f} GiB of fp16 weights (sparse)"
        )
        print(
            f"  onnx-kvcache convert -> fp8: {wall:.2f} s wall, peak RSS {rss:.0f} MiB, "
            f"{written / 2**10:.0f} KiB written (graph only), weight bytes written: 0"
        )
        data_size = (folder / "model.onnx.data").stat().st_size
        assert data_size == weight_bytes
        met = wall < 3.0 and rss < 300 and written < 64 * 2**20
        print(f"  targets (CLI < 3 s, RSS < 300 MiB, no weight bytes written): {'met' if met else 'MISSED'}")

    small = DecoderConfig(
        **{**LLAMA_70B.__dict__, "num_layers": 2, "intermediate_size": 8192, "vocab_size": 32000}
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        rng = np.random.default_rng(0)
        model = build_decoder(
            small,
            weight_factory=lambda n, s, d: ir.tensor(
                rng.standard_normal(s, np.float32).astype(np.float16), name=n
            ),
        )
        src = folder / "model.onnx"
        ir.save(model, src, external_data="model.onnx.data")
        size = (folder / "model.onnx.data").stat().st_size
        wall, _ = run_cli(["convert", str(src), str(folder / "fast.onnx"), "--format", "fp8"])
        naive = naive_convert(src, folder / "naive.onnx")
        print(f"2-layer model, {size / 2**20:.0f} MiB of weights:")
        print(f"  onnx-kvcache convert: {wall:.2f} s (CLI, including interpreter start)")
        print(f"  load everything, convert, save: {naive:.2f} s, {size / 2**20:.0f} MiB rewritten")


if __name__ == "__main__":
    main()
