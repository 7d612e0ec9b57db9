"""`evaluate` against its floor, a bare onnxruntime loop with the fewest calls, on SmolLM2-135M.

    pip install gguf            # reads the GGUF (numpy only); for this benchmark, not the library
    python benchmarks/evaluate_speed.py [--cache DIR] [--reps 2] [--before SRC] [--check]

Builds the float32 SmolLM2-135M-Instruct twice (``benchmarks/four_commands.py``): an
onnxruntime-genai folder and the same weights as a dynamo export; converts each to int8 per
channel for the CPU with ``calibrate`` and ``convert`` (their defaults otherwise). Then times,
in one run, each in its own process, alternating (the order reversed every repetition):

1. ``onnx-kvcache evaluate BASELINE CANDIDATE --no-progress`` with its defaults (4 windows x
   256 tokens, prompts of 64, 64 greedy tokens);
2. the floor: a bare onnxruntime loop that makes the fewest calls giving the same figures and
   computes nothing else: per model, the 4 windows in one batched call (onnxruntime's CPU
   kernel quantizes new tokens before attending in every phase, so a window's positions in
   one call equal token-by-token decoding's), then the 4 prompts in one call and 63 decode
   steps of 4 rows; sessions created from the files (the export's as exported: no fusion);
3. with ``--before SRC``: ``evaluate`` from another source tree (``PYTHONPATH=SRC``), e.g.
   ``git archive 8c9e96f src | tar -x -C /tmp/before`` for the token-by-token version.

Prints each one's wall and CPU time (the child's user + system), the ratio of evaluate to the
floor (median of the per-repetition ratios), and the load average before and after: the
machine is shared, so compare within one run. Target (issue 36): evaluate within 2x of the
floor. The figures of ``evaluate`` and of the ``--before`` tree (their ``--json``) are
compared: KL, top-1, greedy and cache errors.

``--check``: on the genai folder, per kernel (float, int8/int4 on onnxruntime's CPU kernel,
int8/int4/fp8 emulated under CUDA's rule), the largest logit difference (as a share of each
row's logit range) against token-by-token decoding of one 256-token window, of that window
in one call, of the prompt then the rest in one chunk, and of two windows decoded token by
token in one batch: what ``onnx_kvcache.runtime._scoring.CALL_PATTERNS`` rests on (1e-4 is
the bar). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import four_commands
import real_model

WINDOWS, WINDOW, PROMPT, NEW_TOKENS = 4, 256, 64, 64  # evaluate's defaults
CALIBRATE_OPTIONS = ("--granularity", "per_channel", "--no-progress", "--overwrite")


def convert(cache: pathlib.Path, label: str, model: pathlib.Path, fmt: str, ep: str) -> pathlib.Path:
    """The model converted to ``fmt`` per channel (calibrated with calibrate's defaults), once."""
    work = cache / "evaluate-speed"
    folder = work / f"{label}-{fmt}"
    out = folder if label == "genai" else folder / "model.onnx"
    if (folder / "model.onnx").is_file():
        return out
    (folder if label != "genai" else work).mkdir(parents=True, exist_ok=True)
    scales = work / f"{label}-{fmt}.json"
    cli = [sys.executable, "-m", "onnx_kvcache"]
    subprocess.run(
        [*cli, "calibrate", str(model), "--out", str(scales), "--format", fmt, *CALIBRATE_OPTIONS],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        [*cli, "convert", str(model), str(out), "--scales", str(scales), "--ep", ep, "--overwrite"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out


def _feeds(session: Any, ids: np.ndarray, past: dict[str, np.ndarray], length: int) -> dict[str, Any]:
    """A call's inputs: ids, mask, positions, and the past caches (empty at first)."""
    batch, seq = ids.shape
    feeds: dict[str, Any] = {}
    for meta in session.get_inputs():
        if meta.name == "input_ids":
            feeds[meta.name] = ids
        elif meta.name == "attention_mask":
            feeds[meta.name] = np.ones((batch, length + seq), np.int64)
        elif meta.name == "position_ids":
            feeds[meta.name] = np.tile(np.arange(length, length + seq, dtype=np.int64), (batch, 1))
        elif meta.name in past:
            feeds[meta.name] = past[meta.name]
        else:
            dtype = {"tensor(float)": np.float32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8}[
                meta.type
            ]
            feeds[meta.name] = np.zeros((batch, meta.shape[1], 0, meta.shape[3]), dtype)
    return feeds


def _call(session: Any, ids: np.ndarray, past: dict[str, np.ndarray], length: int) -> Any:
    """One run: the logits, and the presents as the next call's pasts."""
    names = [o.name for o in session.get_outputs()]
    results = session.run(None, _feeds(session, ids, past, length))
    presents = {n.replace("present", "past_key_values"): r for n, r in zip(names[1:], results[1:])}
    return results[0], presents


def bare_loop(baseline: str, candidate: str, windows_file: str) -> None:
    """The floor (see the module docstring): sessions, then the fewest calls, nothing else."""
    import onnxruntime as ort

    windows = np.load(windows_file)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    for model in (pathlib.Path(baseline), pathlib.Path(candidate)):
        file = model / "model.onnx" if model.is_dir() else model
        session = ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
        _call(session, windows[:, :-1], {}, 0)  # every window's positions, one call
        logits, past = _call(session, windows[:, :PROMPT], {}, 0)
        for step in range(NEW_TOKENS - 1):  # greedy: the prompts' call gave the first token
            tokens = np.argmax(logits[:, -1], axis=-1)[:, None]
            logits, past = _call(session, tokens, past, PROMPT + step)


def _timed(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall and CPU seconds (the child's user + system) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _figures(path: pathlib.Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    keys = ("kl_mean", "kl_max", "kl_prompt_mean", "top1_agreement", "greedy_match_share")
    return {**{k: doc[k] for k in keys}, "layer_errors": doc["layer_errors"]}


def _compare(ours: dict[str, Any], before: dict[str, Any]) -> str:
    """The largest relative change of each figure."""
    parts = []
    for key in ("kl_mean", "kl_max", "kl_prompt_mean", "top1_agreement", "greedy_match_share"):
        a, b = ours[key], before[key]
        parts.append(f"{key} {abs(a - b) / max(abs(b), 1e-30):.1e}")
    errs = [
        abs(ours["layer_errors"][layer][kv] - e[kv]) / e[kv]
        for layer, e in before["layer_errors"].items()
        for kv in ("k", "v")
    ]
    return ", ".join(parts) + f", cache errors {max(errs):.1e}"


def time_pairs(
    pairs: dict[str, tuple[pathlib.Path, pathlib.Path]], work: pathlib.Path, reps: int, before: str | None
) -> None:
    from onnx_kvcache.scales.data import load_token_windows

    rows = ["bare onnxruntime loop (floor)", "onnx-kvcache evaluate"] + (
        ["evaluate, --before"] if before else []
    )
    load = [os.getloadavg()[0]]
    print(f"load average {load[0]:.1f} on {os.cpu_count()} cores at the start", flush=True)
    for label, (base, cand) in pairs.items():
        windows = load_token_windows(
            None, model=base, seq_len=WINDOW, num_seqs=WINDOWS, purpose="evaluation"
        ).windows
        name = label.split()[0]
        windows_file = work / f"{name}-windows.npy"
        np.save(windows_file, np.stack(windows))
        reports = {row: work / f"{name}-{i}.json" for i, row in enumerate(rows[1:])}
        evaluate = [sys.executable, "-m", "onnx_kvcache", "evaluate", str(base), str(cand), "--no-progress"]
        commands = {
            rows[0]: ([sys.executable, __file__, "--bare", str(base), str(cand), str(windows_file)], None),
            rows[1]: ([*evaluate, "--json", str(reports[rows[1]]), "--overwrite"], None),
        }
        if before:
            env = {**os.environ, "PYTHONPATH": before, "PYTHONDONTWRITEBYTECODE": "1"}
            commands[rows[2]] = ([*evaluate, "--json", str(reports[rows[2]]), "--overwrite"], env)
        times: dict[str, list[tuple[float, float]]] = {row: [] for row in commands}
        for rep in range(reps):
            for row in commands if rep % 2 == 0 else reversed(commands):
                times[row].append(_timed(*commands[row]))
                print(f"  {label}: {row}: {times[row][-1][0]:.1f} s", flush=True)
        load.append(os.getloadavg()[0])
        print(f"\n{label}: {base.name} against {cand.parent.name}/{cand.name} (int8 per channel, CPU kernel)")
        floor = times[rows[0]]
        for row, measured in times.items():
            wall = statistics.median(t[0] for t in measured)
            cpu = statistics.median(t[1] for t in measured)
            ratio = statistics.median(t[0] / f[0] for t, f in zip(measured, floor))
            cpu_ratio = statistics.median(t[1] / f[1] for t, f in zip(measured, floor))
            print(
                f"  {row:<32} wall {wall:7.1f} s ({min(t[0] for t in measured):.1f}-"
                f"{max(t[0] for t in measured):.1f})  cpu {cpu:7.1f} s   {ratio:5.2f}x floor "
                f"(cpu {cpu_ratio:4.2f}x)"
            )
        if before:
            change = _compare(_figures(reports[rows[1]]), _figures(reports[rows[2]]))
            print(f"  figures, evaluate against --before (largest relative change): {change}")
        ratio = statistics.median(t[0] / f[0] for t, f in zip(times[rows[1]], floor))
        print(
            f"  target evaluate within 2x of the floor: {'met' if ratio <= 2 else 'NOT met'} ({ratio:.2f}x)"
        )
    print(f"load average {', '.join(f'{x:.1f}' for x in load)} (start, after each model)")


def _off(test: np.ndarray, ref: np.ndarray) -> float:
    span = ref.max(axis=-1, keepdims=True) - ref.min(axis=-1, keepdims=True)
    return float((np.abs(test - ref) / span).max())


def check(genai: pathlib.Path, converted: dict[str, pathlib.Path]) -> None:
    """Chunks and batches against token-by-token decoding, per kernel (module docstring)."""
    import warnings

    from onnx_kvcache import KvCacheRunner, KvCacheWarning
    from onnx_kvcache.runtime._scoring import call_pattern
    from onnx_kvcache.scales.data import load_token_windows

    windows = np.stack(
        load_token_windows(None, model=genai, seq_len=WINDOW, num_seqs=2, purpose="evaluation").windows
    )
    print(f"load average {os.getloadavg()[0]:.1f}; logit differences as a share of each row's range")
    print(f"{'model':<10} {'kernel':<16} {'one call':>9} {'chunk':>9} {'batch':>9}  pattern")
    for label, path, rule in (
        ("float", genai, "cpu"),
        ("int8", converted["int8"], "cpu"),
        ("int4", converted["int4"], "cpu"),
        ("int8", converted["int8"], "cuda"),
        ("int4", converted["int4"], "cuda"),
        ("fp8", converted["fp8"], "cuda"),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KvCacheWarning)
            runner = KvCacheRunner(path, semantics=rule)
        refs = []
        for window in windows:
            steps = [runner.prefill(window[:PROMPT])[0]]
            steps += [runner.step(int(t)) for t in window[PROMPT:-1]]
            refs.append(np.concatenate(steps))
        one = runner.prefill(windows[:1, :-1])[0]
        chunk = np.concatenate(
            [runner.prefill(windows[:1, :PROMPT])[0], runner.forward(windows[:1, PROMPT:-1])[0]]
        )
        batch = [runner.prefill(windows[:, :PROMPT])]
        batch += [runner.step(windows[:, i])[:, None] for i in range(PROMPT, WINDOW - 1)]
        pattern = call_pattern(runner)
        print(
            f"{label:<10} {pattern.kernel:<16} {_off(one, refs[0]):9.1e} {_off(chunk, refs[0]):9.1e} "
            f"{_off(np.concatenate(batch, axis=1), np.stack(refs)):9.1e}  "
            f"{'a window a call' if pattern.whole_window else 'a token a call'}  ({runner.kernel_rule})",
            flush=True,
        )


def main() -> None:
    if sys.argv[1:2] == ["--bare"]:
        bare_loop(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "onnx-kvcache-bench"
    )
    parser.add_argument("--reps", type=int, default=2, help="alternating repetitions")
    parser.add_argument("--before", help="a source tree whose evaluate to time too (PYTHONPATH)")
    parser.add_argument("--check", action="store_true", help="instead: chunks and batches against steps")
    parser.add_argument("--only", choices=("genai", "export"), help="time one model pair only")
    args = parser.parse_args()
    cache = args.cache.expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    genai = real_model.build_model(cache)
    if args.check:
        converted = {f: convert(cache, "genai", genai, f, "cuda" if f == "fp8" else "cpu") for f in FORMATS}
        check(genai, converted)
        return
    export = four_commands.build_export(cache, genai) / "model.onnx"
    pairs = {
        "genai folder": (genai, convert(cache, "genai", genai, "int8", "cpu")),
        "export": (export, convert(cache, "export", export, "int8", "cpu")),
    }
    if args.only:
        pairs = {k: v for k, v in pairs.items() if k.startswith(args.only)}
    time_pairs(pairs, cache / "evaluate-speed", args.reps, args.before)


FORMATS = ("int8", "int4", "fp8")

if __name__ == "__main__":
    main()
