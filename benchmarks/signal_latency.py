"""Ctrl-C latency while the command starts: how long after SIGINT ``inspect`` exits.

Runs ``onnx-kvcache inspect`` on a 1-layer model and sends SIGINT at fixed delays after
launch (0.1 to 1.2 s): a signal that arrives while onnx-ir, onnx, numpy and ml_dtypes import
is held until that import returns (their C code must not be interrupted), so the latency is
what remains of the import. Run it with the ml_dtypes to compare (0.6 vs 0.7).

    python benchmarks/signal_latency.py [--command PATH_OF_onnx-kvcache]

Prints (delay, exit code, seconds from the signal to the exit) and the max and median over the
runs the signal stopped (exit 130).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = shutil.which("onnx-kvcache") or str(pathlib.Path(sys.executable).with_name("onnx-kvcache"))
    parser.add_argument("--command", default=default)
    args = parser.parse_args()
    import onnx_ir as ir

    from onnx_kvcache.models.decoder import build_decoder

    with tempfile.TemporaryDirectory() as tmp:
        model = pathlib.Path(tmp) / "model.onnx"
        ir.save(build_decoder(num_layers=1), model)
        rows = []
        for delay in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0, 1.2):
            proc = subprocess.Popen(
                [args.command, "inspect", str(model)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            time.sleep(delay)
            sent = time.perf_counter()
            proc.send_signal(signal.SIGINT)
            proc.communicate()
            rows.append((delay, proc.returncode, time.perf_counter() - sent))
    print(f"ml_dtypes {importlib.metadata.version('ml_dtypes')} (this interpreter's), {args.command}")
    for delay, code, latency in rows:
        print(
            f"  SIGINT at {delay:.1f} s: exit {code}"
            + (f", exited {latency:.3f} s later" if code == 130 else "")
        )
    stopped = [latency for _, code, latency in rows if code == 130]
    if stopped:
        print(f"latency: max {max(stopped):.3f} s, median {statistics.median(stopped):.3f} s")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
