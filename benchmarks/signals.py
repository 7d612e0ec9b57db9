"""Signals at random moments: every run ends with exit 0, 130 or 143 and at most one line.

Runs ``onnx-kvcache inspect`` on a small model and ``onnx-kvcache convert`` of it (a new
file beside it) ``--runs`` times each, sending SIGINT or SIGTERM (chosen at random) at a
random delay from 0 to ``--max-delay`` seconds after launch: during interpreter start,
the imports (onnx's and ml_dtypes' C extensions), the work, the commit or the exit. Checks:

* the exit code is 0 (it finished first), 130 (SIGINT) or 143 (SIGTERM);
* stderr is empty (exit 0) or one line ``onnx-kvcache: stopped by SIG...`` (any other
  exit, a traceback, an abort's ``terminate called ...`` or a segfault is a failure);
* every input file is byte-identical afterwards (SHA-256 of the whole input folder);
* a conversion left either nothing or a complete output (it loads), and no temporary entry.

    python benchmarks/signals.py [--runs 300] [--max-delay 2] [--jobs 2] [--seed 0]

Prints the counts of (command, signal, exit code) and every failure.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import hashlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

import onnx_ir as ir

from onnx_kvcache.models.decoder import build_decoder

EXECUTABLE = pathlib.Path(sys.executable).with_name("onnx-kvcache")
EXITS = {0: "finished", 130: "SIGINT", 143: "SIGTERM"}


def tree_hashes(folder: pathlib.Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def make_inputs(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    folder.mkdir()
    model = build_decoder(num_layers=2, vocab_size=300)
    ir.save(model, folder / "model.onnx", external_data="model.onnx.data")
    scales = folder / "scales.json"
    scales.write_text(json.dumps({"scales": {"k_scales": [0.1, 0.1], "v_scales": [0.05, 0.05]}, "qmax": 128}))
    return folder / "model.onnx", scales


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a SIGTERM handler (onnx-kvcache installs its three at once, in
    its first line): False while the interpreter starts, before any line of onnx-kvcache ran."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:  # exited, or no /proc: count it as handled
        return True
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields["State"].split()[0] == "Z":  # it has exited (the signal will change nothing)
        return True
    return bool(int(fields["SigCgt"], 16) >> (signal.SIGTERM - 1) & 1)


def one_run(
    command: str, index: int, signum: int, delay: float, model: pathlib.Path, scales: pathlib.Path
) -> tuple[str, int, int, str, float, bool]:
    """(command, signal, exit code, problem or "", delay, sent before the handlers)."""
    out = model.parent.parent / "outputs" / f"{command}-{index}" / "m.onnx"
    if command == "inspect":
        argv = ["inspect", str(model)]
    else:
        out.parent.mkdir(parents=True)
        argv = ["convert", str(model), str(out), "--scales", str(scales), "--format", "int8", "--no-progress"]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a crash prints where it happened
    proc = subprocess.Popen(
        [str(EXECUTABLE), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    time.sleep(delay)
    early = not catches_sigterm(proc.pid)
    with contextlib.suppress(ProcessLookupError):  # it finished first
        proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    code = proc.returncode
    lines = err.splitlines()
    problem = ""
    if code not in EXITS:
        problem = f"exit {code}"
    elif code == 0 and lines:
        problem = "exit 0 with stderr"
    elif code and (len(lines) != 1 or not lines[0].startswith(f"onnx-kvcache: stopped by {EXITS[code]}")):
        problem = "not one 'stopped by' line"
    if command == "convert":
        leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(".onnx-kvcache-tmp")]
        if leftovers:
            problem = problem or f"temporary entries left: {leftovers}"
        if code == 0 and not out.exists():
            problem = problem or "exit 0 without an output"
        if out.exists():
            try:
                ir.load(out)
            except Exception as error:  # any failure to load is the finding
                problem = problem or f"an incomplete output: {error}"
    if problem:
        problem += f" after {delay:.3f} s: {err.strip()[-1500:]!r}"
    return command, signum, code, problem, delay, early


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=300, help="runs of each command")
    parser.add_argument("--max-delay", type=float, default=2.0)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commands", nargs="+", default=["inspect", "convert"])
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model, scales = make_inputs(pathlib.Path(tmp) / "in")
        before = tree_hashes(model.parent)
        plan = [
            (command, i, rng.choice([signal.SIGINT, signal.SIGTERM]), rng.uniform(0, args.max_delay))
            for i in range(args.runs)
            for command in args.commands
        ]
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda p: one_run(*p, model, scales), plan))
        changed = before != tree_hashes(model.parent)
    counts = collections.Counter(
        (c, signal.Signals(s).name, code, early) for c, s, code, _, _, early in results
    )
    print(
        f"{len(results)} runs in {time.perf_counter() - start:.0f} s ({args.jobs} at once, "
        f"delays 0-{args.max_delay} s, seed {args.seed}, load average {os.getloadavg()[0]:.1f}):"
    )
    for (command, name, code, early), n in sorted(counts.items()):
        when = "  before its first line (interpreter start)" if early else ""
        print(f"  {command:8} {name:8} exit {code:>4} ({EXITS.get(code, 'FAILURE')}): {n}{when}")
    failures = [r for r in results if r[3] and not r[5]]
    for command, signum, _, problem, _, _ in failures:
        print(f"  FAILED {command} {signal.Signals(signum).name}: {problem}")
    early = [r for r in results if r[5]]
    if early:
        print(
            f"  {len(early)} signal(s) reached the process before onnx-kvcache's first line ran (the "
            f"interpreter's start, up to {max(r[4] for r in early):.3f} s after launch at this load): "
            f"{sum(1 for r in early if r[3])} of them did not end as exit 130/143 with one line"
        )
    print(f"inputs byte-identical: {'yes' if not changed else 'NO'}")
    print("result: " + ("every run ended cleanly" if not failures and not changed else "FAILURES"))
    sys.exit(1 if failures or changed else 0)


if __name__ == "__main__":
    main()
