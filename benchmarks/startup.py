"""Whole-process start-up of the ``onnx-kvcache`` command, and where its imports spend the time.

Runs each command ``--runs`` times as its own process (the installed ``onnx-kvcache``
executable, as a user types it) and prints the median wall time, the median user+sys CPU
time (which the machine's other load distorts less) and the peak RSS:

* ``--help``, ``--version`` and a mistyped flag (targets: median under 0.3 s each);
* ``inspect`` on a small 2-layer model;
* ``convert`` of the 80-layer 70B-shaped decoder of ``benchmarks/convert_large.py`` (131 GiB
  of fp16 weights in a sparse file) to fp8 beside its input (target: under 1.5 s, under
  300 MiB peak RSS, no weight byte written).

Then the import breakdown of ``inspect`` and ``--help`` (``python -X importtime``): the
seconds of each top-level package and the slowest single modules.

    python benchmarks/startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import os
import pathlib
import statistics
import sys
import tempfile

import onnx_ir as ir

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from convert_large import LLAMA_70B, Run, run_process, write_sparse_model

from onnx_kvcache.models.decoder import build_decoder

EXECUTABLE = pathlib.Path(sys.executable).with_name("onnx-kvcache")


def run(argv: list[str], *, python_flags: tuple[str, ...] = ()) -> Run:
    """One whole process of the command (the executable, or ``python FLAGS -m onnx_kvcache``)."""
    command = [sys.executable, *python_flags, "-m", "onnx_kvcache"] if python_flags else [str(EXECUTABLE)]
    return run_process([*command, *argv])


def import_breakdown(argv: list[str]) -> tuple[float, list[tuple[str, float]], list[tuple[str, float]]]:
    """(total import s, s per top-level package, slowest modules by their own time)."""
    own: dict[str, float] = {}
    for line in run(argv, python_flags=("-X", "importtime")).stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        fields = line.removeprefix("import time:").split("|")
        self_us, name = int(fields[0]), fields[2].strip()
        own[name] = own.get(name, 0) + self_us / 1e6
    packages: collections.Counter[str] = collections.Counter()
    for name, seconds in own.items():
        packages[name.split(".")[0]] += seconds
    return sum(own.values()), packages.most_common(8), sorted(own.items(), key=lambda kv: -kv[1])[:5]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    versions = ", ".join(
        f"{d} {importlib.metadata.version(d)}"
        for d in ("ml_dtypes", "numpy", "onnx", "onnx-ir", "onnxruntime")
    )
    print(f"{versions}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        small = folder / "small" / "model.onnx"
        small.parent.mkdir()
        ir.save(build_decoder(num_layers=2), small, external_data="model.onnx.data")
        (folder / "70b").mkdir()
        large, _ = write_sparse_model(folder / "70b", LLAMA_70B)
        scales = folder / "scales.json"
        ones = [0.01] * LLAMA_70B.num_layers
        scales.write_text(json.dumps({"scales": {"k_scales": ones, "v_scales": ones}}))
        data = large.with_name("model.onnx.data")
        data_mtime = data.stat().st_mtime_ns

        def convert(i: int) -> list[str]:
            out = large.with_name(f"model.fp8.{i}.onnx")
            return ["convert", str(large), str(out), "--format", "fp8", "--scales", str(scales)]

        cases = [  # (name, argv for run i, exit code, wall target s)
            ("--help", lambda i: ["--help"], 0, 0.3),
            ("--version", lambda i: ["--version"], 0, 0.3),
            ("a bad flag (--bogus)", lambda i: ["--bogus"], 2, 0.3),
            ("inspect, 2-layer model", lambda i: ["inspect", str(small)], 0, None),
            ("convert, 70B-shaped, beside", convert, 0, 1.5),
        ]
        print(f"whole process, median of {args.runs} (wall | user+sys CPU | peak RSS):")
        for name, argv, expected, target in cases:
            runs = [run(argv(i)) for i in range(args.runs)]
            bad = [r for r in runs if r.code != expected]
            if bad:
                raise SystemExit(f"{name}: exit {bad[0].code}: {bad[0].stderr}")
            wall = statistics.median(r.wall for r in runs)
            cpu = statistics.median(r.cpu for r in runs)
            rss = max(r.rss for r in runs)
            verdict = (  # wall is the target; CPU is the figure load does not inflate
                ""
                if target is None
                else f"  target < {target} s: wall {'met' if wall < target else 'MISSED'}, "
                f"CPU {'met' if cpu < target else 'MISSED'}"
            )
            if name.startswith("convert"):
                verdict += f", RSS < 300 MiB: {'met' if rss < 300 else 'MISSED'}"
            print(f"  {name:28} {wall:6.3f} s | {cpu:6.3f} s | {rss:4.0f} MiB{verdict}")
        written = {p.name: p.stat().st_size for p in large.parent.glob("model.fp8.*.onnx")}
        untouched = data.stat().st_mtime_ns == data_mtime and not list(large.parent.glob("*.data.*"))
        print(
            f"  convert wrote only its graph ({max(written.values()) / 2**20:.1f} MiB each), no weight byte: "
            f"{'yes' if untouched and len(written) == args.runs else 'NO'}"
        )
        for name, argv in [("inspect", ["inspect", str(small)]), ("--help", ["--help"])]:
            total, packages, slowest = import_breakdown(argv)
            print(f"imports of {name} (python -X importtime): {total:.3f} s")
            print("  by package: " + ", ".join(f"{p} {s:.3f}" for p, s in packages))
            print("  slowest modules (own time): " + ", ".join(f"{m} {s:.3f}" for m, s in slowest))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
