"""Fuse and convert a SmolLM2-135M-shaped export: wall time and peak RSS per step.

30 layers, hidden 576, 9 query / 3 KV heads, head size 64, SwiGLU 1536, vocab 49152,
float32 weights inline (622 MiB), in the TorchScript form (optimum / onnx-community:
no value_info) and the dynamo form (transformers 5.x, opset 23). Each step runs in a
fresh process: ``fuse`` loads the file and runs GqaFusionPass; ``convert`` is the CLI's
``convert --format int8 --ep cpu`` with per-layer scales, with ``--no-verify`` and with
``--verify`` (the export and its fusion run side by side on onnxruntime first: the cost of
translation validation, on by default up to 1 GiB of weights). ``--refuse`` also runs a
TorchScript export whose attention cannot be proven (the NaN guard fills 0.5), to time
a refusal. Target: under 10 s per step on a 2-core machine, fused or refused (a verified convert
loads the weights twice more: measured beside it, docs/exporting.md).

    python benchmarks/fusion_speed.py [--layers 30] [--refuse]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx_ir as ir

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # tests/builders
from builders.exported import EXPORT_PRESETS, ExportedConfig, build_decoder

FORMS = {"torchscript": "optimum-llama", "dynamo": "llama"}


def smollm2(preset: str, layers: int) -> ExportedConfig:
    _, style = EXPORT_PRESETS[preset]
    return ExportedConfig(
        num_layers=layers,
        hidden_size=576,
        num_heads=9,
        kv_num_heads=3,
        head_size=64,
        intermediate_size=1536,
        vocab_size=49152,
        outlier_channels=0,
        exported=style,
    )


def write(folder: pathlib.Path, form: str, layers: int, refuse: bool) -> pathlib.Path:
    def weights(name: str, shape: tuple[int, ...], dtype: ir.DataType) -> ir.TensorProtocol:
        return ir.tensor(np.full(shape, 0.01, dtype.numpy()), name=name)

    model = build_decoder(smollm2(FORMS[form], layers), weight_factory=weights)
    if refuse:  # each NaN guard fills 0.5: not provably GroupQueryAttention
        for node in model.graph:
            if node.op_type == "Where" and node.inputs[0] is not None:
                guard = node.inputs[0].producer()
                if guard is not None and guard.op_type == "IsNaN":
                    node.replace_input_with(1, ir.Value(name=f"{node.name}_fill"))
                    fill = node.inputs[1]
                    fill.const_value = ir.tensor(np.array([0.5], np.float32))
                    fill.dtype, fill.shape = ir.DataType.FLOAT, ir.Shape([1])
                    model.graph.register_initializer(fill)
    path = folder / f"{form}{'-refused' if refuse else ''}.onnx"
    ir.save(model, path)
    return path


PEAK = """
def peak_mib():  # VmHWM: this process's own peak (ru_maxrss would include the parent's)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
"""

FUSE = (
    PEAK
    + """
import sys, time, warnings
import onnx_ir as ir
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass
model = ir.load(sys.argv[1])
start = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fusion = GqaFusionPass()
    fusion(model)
seconds = time.perf_counter() - start
print(fusion.fused, len(fusion.refused), seconds, peak_mib())
"""
)

CONVERT = (
    PEAK
    + """
import sys, time
from onnx_kvcache.cli.commands import main
start = time.perf_counter()
argv = ["convert", sys.argv[1], sys.argv[2], "--format", "int8", "--ep", "cpu", "--scales", sys.argv[3]]
code = main(argv + sys.argv[4:])
seconds = time.perf_counter() - start
print(code, 0, seconds, peak_mib())
"""
)


def run(script: str, *args: str) -> tuple[str, str, float, float]:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True)
    a, b, seconds, rss = done.stdout.strip().splitlines()[-1].split()
    return a, b, float(seconds), float(rss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--refuse", action="store_true", help="also time a refused TorchScript export")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        scales = folder / "scales.json"
        scales.write_text(
            json.dumps(
                {"scales": {"k_scales": [0.1] * args.layers, "v_scales": [0.1] * args.layers}, "qmax": 128}
            )
        )
        cases = [(form, False) for form in FORMS] + ([("torchscript", True)] if args.refuse else [])
        print(f"{args.layers} layers, SmolLM2-135M shape, float32 weights inline; one process per step")
        for form, refuse in cases:
            start = time.perf_counter()
            path = write(folder, form, args.layers, refuse)  # the model is freed before timing
            built = time.perf_counter() - start
            name = form + (" (refused)" if refuse else "")
            size = path.stat().st_size / 2**20
            print(f"{name:22s} built in {built:5.1f} s ({size:.0f} MiB)")
            fused, refused, seconds, rss = run(FUSE, str(path))
            print(f"  fuse     {seconds:6.2f} s  peak RSS {rss:6.0f} MiB  ({fused} fused, {refused} refused)")
            if not refuse:  # the export and its fusion run side by side first, unless --no-verify
                for flag, label in (
                    ("--no-verify", "convert, not verified"),
                    ("--verify", "convert, verified"),
                ):
                    out = str(folder / f"{form}-int8{flag}.onnx")
                    code, _, seconds, rss = run(CONVERT, str(path), out, str(scales), flag)
                    print(f"  {label:22s} {seconds:6.2f} s  peak RSS {rss:6.0f} MiB  (exit {code})")


if __name__ == "__main__":
    main()
