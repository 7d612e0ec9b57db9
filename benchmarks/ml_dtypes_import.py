"""What importing ml_dtypes costs in this environment (fresh processes, after numpy).

ml_dtypes 0.7.0's extension takes 0.5 to 1.3 s of CPU to initialize, 0.6.0's 0.005 s:
``benchmarks/ml_dtypes.md`` has the cause and the figures. Run it with the interpreter of
the environment to judge (it needs only numpy and ml_dtypes):

    python benchmarks/ml_dtypes_import.py [--runs 5]

Prints the versions and the medians of the wall and user+sys CPU seconds of ``import
ml_dtypes`` alone (numpy is imported first and not counted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = """
import json, resource, time
import numpy
t, r = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
import ml_dtypes
u = resource.getrusage(resource.RUSAGE_SELF)
cpu = u.ru_utime - r.ru_utime + u.ru_stime - r.ru_stime
print(json.dumps([ml_dtypes.__version__, numpy.__version__, time.perf_counter() - t, cpu]))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    runs = [
        json.loads(subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, check=True).stdout)
        for _ in range(args.runs)
    ]
    wall = statistics.median(r[2] for r in runs)
    cpu = statistics.median(r[3] for r in runs)
    print(
        f"ml_dtypes {runs[0][0]} (numpy {runs[0][1]}): import ml_dtypes {wall:.3f} s wall, "
        f"{cpu:.3f} s user+sys CPU (median of {args.runs})"
    )


if __name__ == "__main__":
    main()
