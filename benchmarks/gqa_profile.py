"""Per-operator time of one prefill call, from onnxruntime's profiler.

    python benchmarks/gqa_profile.py FOLDER [FOLDER ...] --lengths 1024 4096 [--runs 1]

For each genai folder and prompt length, in its own process (sequentially): an
onnxruntime CPU session of the folder's decoder with ``enable_profiling``, one warm-up call of
16 tokens, then ``--runs`` prefill calls of ``length`` tokens from an empty cache (batch 1,
attention mask of ones). The profile's ``Node`` events are summed by operator type (nodes
inside an ``If`` branch count under their own type, the ``If`` node under ``If``). Prints the
wall time of the last call, the GroupQueryAttention share and the top operators, and the
load average before and after each process (the machine is shared). ``--decode N``: profile N
one-token calls on the prefill's cache instead (means per call; non-shared past and present, as
the folders' converted genai config runs them). Not part of CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

CHILD = "--child"


def child(folder: str, length: int, runs: int, decode: int = 0) -> None:
    import numpy as np
    import onnxruntime as ort

    config = json.loads((pathlib.Path(folder) / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    prefix = tempfile.mkdtemp(prefix="gqa-profile-")
    opts.profile_file_prefix = os.path.join(prefix, "p")
    sess = ort.InferenceSession(
        str(pathlib.Path(folder) / decoder["filename"]), opts, providers=["CPUExecutionProvider"]
    )
    types = {i.name: i for i in sess.get_inputs()}
    rng = np.random.default_rng(0)

    def feeds(n: int) -> dict:
        out = {
            "input_ids": rng.integers(100, 40000, (1, n), dtype=np.int64),
            "attention_mask": np.ones((1, n), np.int64),
        }
        for name, arg in types.items():
            if name.startswith("past_key_values"):
                dtype = {"tensor(float)": np.float32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8}[
                    arg.type
                ]
                out[name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), dtype)
        return out

    sess.run(["logits"], feeds(16))
    walls = []
    names = [o.name for o in sess.get_outputs()]
    for _ in range(runs):
        f = feeds(length)
        t = time.perf_counter()
        out = dict(zip(names, sess.run(None, f)))
        walls.append(time.perf_counter() - t)
    if decode:  # then ``decode`` one-token calls on that cache; the profile sums them
        walls = []
        total = length
        for _ in range(decode):
            f = {
                k.replace("present.", "past_key_values."): v
                for k, v in out.items()
                if k.startswith("present.")
            }
            total += 1
            f |= {
                "input_ids": rng.integers(100, 40000, (1, 1), dtype=np.int64),
                "attention_mask": np.ones((1, total), np.int64),
            }
            t = time.perf_counter()
            out = dict(zip(names, sess.run(None, f)))
            walls.append(time.perf_counter() - t)
    path = sess.end_profiling()
    events = json.loads(pathlib.Path(path).read_text())
    by_op: dict[str, float] = collections.defaultdict(float)
    runs_seen = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    timed = runs_seen[-(decode or 1) :]
    start, end = timed[0]["ts"], timed[-1]["ts"] + timed[-1]["dur"]
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and start <= e["ts"] <= end:
            by_op[e["args"]["op_name"]] += e["dur"] / 1e6
    wall = sum(walls) / len(walls) if decode else walls[-1]
    print(
        json.dumps({"wall": wall, "walls": walls, "by_op": {k: v / max(decode, 1) for k, v in by_op.items()}})
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    p = argparse.ArgumentParser()
    p.add_argument("folders", nargs="+")
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument(
        "--decode",
        type=int,
        default=0,
        help="profile this many one-token calls after the prefill instead (per-call means)",
    )
    args = p.parse_args()
    for length in args.lengths:
        for folder in args.folders:
            before = os.getloadavg()[0]
            out = (
                subprocess.run(
                    [sys.executable, __file__, CHILD, folder, str(length), str(args.runs), str(args.decode)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            r = json.loads(out)
            total = sum(r["by_op"].values())
            top = sorted(r["by_op"].items(), key=lambda kv: -kv[1])[:4]
            gqa = r["by_op"].get("GroupQueryAttention", 0.0)
            print(
                f"{pathlib.Path(folder).name:24s} {length:6d} tokens: wall {r['wall']:7.3f} s  "
                f"GQA {gqa:7.3f} s ({gqa / total:5.1%} of node time {total:.2f} s)  "
                + "  ".join(f"{k} {v:.3f}" for k, v in top)
                + f"  [load {before:.2f} -> {os.getloadavg()[0]:.2f}]",
                flush=True,
            )


if __name__ == "__main__":
    main()
