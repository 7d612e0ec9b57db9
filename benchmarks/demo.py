"""How long ``onnx-kvcache demo`` takes: the whole command, run as a user runs it.

    python benchmarks/demo.py [RUNS]

Runs ``onnx-kvcache demo --no-progress`` RUNS times (default 3) one after another, each a
new process (imports included), and prints each run's wall time and the ``done in`` figure
the demo prints itself, then the minimum, median and maximum. The figures depend on the
machine and its load: README.md quotes them with the load they were measured under.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description="Time `onnx-kvcache demo`, run as a user runs it.")
    parser.add_argument("runs", nargs="?", type=int, default=3, help="runs, one after another")
    runs = parser.parse_args().runs
    walls, reported = [], []
    for i in range(runs):
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "onnx_kvcache", "demo", "--no-progress"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        walls.append(time.perf_counter() - start)
        match = re.search(r"done in ([0-9.]+)s", out)
        reported.append(float(match[1]) if match else float("nan"))
        print(f"run {i + 1}: {walls[-1]:.1f} s wall, demo says done in {reported[-1]:.1f}s", flush=True)
    for name, values in (("wall", walls), ("done in", reported)):
        print(
            f"{name}: min {min(values):.1f} s, median {statistics.median(values):.1f} s, "
            f"max {max(values):.1f} s over {runs} runs"
        )


if __name__ == "__main__":
    main()
