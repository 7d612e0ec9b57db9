"""Long-prompt speed of onnxruntime-genai folders on the CPU: prefill, decode, peak RSS.

    pip install gguf            # real_model.py's text helpers import it; not the library
    python benchmarks/cpu_context_speed.py FOLDER [FOLDER ...] --contexts 4000 8000 \\
        [--new-tokens 64] [--reps 2] [--json OUT]

For each context, repetition and folder (folders in the order given, reversed every other
repetition), in its own process, one after another: onnxruntime-genai loads the folder, a
prompt of exactly ``context`` tokens (the docstrings of real_model.py's held-out standard-library
modules, tokenized by the folder's tokenizer, repeated as needed) is appended in one call
(``append_tokens``: the prefill, timed), then ``--new-tokens`` greedy tokens are generated
(``generate_next_token``, timed together: decode tok/s). ``search.max_length`` is set to
context + new tokens for every folder (genai's buffer when the folder shares past and present).
Each time is also taken as the child's CPU time (all its threads: less sensitive to the other
users of a shared machine than wall time, not immune). The child's peak RSS is ``ru_maxrss``
(the whole process: weights, cache, logits, allocator arenas). Prints one line per run with the
load average before and after it (the machine is shared: compare figures from one invocation),
then the median per folder and context, and whether each folder's tokens equal the first
folder's. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

CHILD = "--child"
HERE = pathlib.Path(__file__).parent


def child(folder: str, context: int, new_tokens: int) -> None:
    import resource

    import numpy as np
    import onnxruntime_genai as og

    sys.path.insert(0, str(HERE))
    import real_model

    model = og.Model(folder)
    tokenizer = og.Tokenizer(model)
    text = real_model.module_text(real_model.HELD_OUT_MODULES)
    ids = np.asarray(tokenizer.encode(text), np.int32)
    ids = np.tile(ids, context // len(ids) + 1)[:context]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=context + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    t, c = time.perf_counter(), time.process_time()
    generator.append_tokens(ids)
    prefill, prefill_cpu = time.perf_counter() - t, time.process_time() - c
    first_logits = np.asarray(generator.get_logits()).ravel()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(new_tokens):
        generator.generate_next_token()
    decode, decode_cpu = time.perf_counter() - t, time.process_time() - c
    tokens = [int(x) for x in generator.get_sequence(0)[context:]]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "prefill_s": prefill,
                "prefill_cpu_s": prefill_cpu,
                "decode_tok_s": new_tokens / decode,
                "decode_cpu_ms_per_token": 1000 * decode_cpu / new_tokens,
                "peak_rss_mib": rss,
                "tokens": tokens,
                "first_argmax": int(first_logits.argmax()),
            }
        )
    )


def run(folder: str, context: int, new_tokens: int) -> dict:
    before = os.getloadavg()[0]
    proc = subprocess.run(
        [sys.executable, __file__, CHILD, folder, str(context), str(new_tokens)],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        return {
            "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}",
            "load": [before, os.getloadavg()[0]],
        }
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["load"] = [before, os.getloadavg()[0]]
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser()
    p.add_argument("folders", nargs="+")
    p.add_argument("--contexts", nargs="+", type=int, default=[4000])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    results: dict[str, dict[int, list[dict]]] = {f: {c: [] for c in args.contexts} for f in args.folders}
    for context in args.contexts:
        for rep in range(args.reps):
            order = args.folders if rep % 2 == 0 else args.folders[::-1]
            for folder in order:
                r = run(folder, context, args.new_tokens)
                results[folder][context].append(r)
                name = pathlib.Path(folder).name
                load = f"[load {r['load'][0]:.2f} -> {r['load'][1]:.2f}]"
                if "error" in r:
                    print(f"{name:28s} {context:6d}: ERROR {r['error']}  {load}", flush=True)
                    continue
                pre_cpu, dec_cpu = r.get("prefill_cpu_s", 0), r.get("decode_cpu_ms_per_token", 0)
                print(
                    f"{name:28s} {context:6d}: prefill {r['prefill_s']:7.2f} s (CPU {pre_cpu:6.1f} s)  "
                    f"decode {r['decode_tok_s']:6.2f} tok/s (CPU {dec_cpu:5.1f} ms/token)  "
                    f"peak RSS {r['peak_rss_mib']:7.0f} MiB  {load}",
                    flush=True,
                )
    print("\nmedians (ratio to the first folder); tokens: same as the first folder's run 1?")
    base = args.folders[0]
    for context in args.contexts:
        ok0 = [r for r in results[base][context] if "error" not in r]
        for folder in args.folders:
            ok = [r for r in results[folder][context] if "error" not in r]
            if not ok or not ok0:
                print(f"{pathlib.Path(folder).name:28s} {context:6d}: no result")
                continue
            pre = statistics.median(r["prefill_s"] for r in ok)
            dec = statistics.median(r["decode_tok_s"] for r in ok)
            rss = statistics.median(r["peak_rss_mib"] for r in ok)
            pre0 = statistics.median(r["prefill_s"] for r in ok0)
            cpu = statistics.median(r.get("prefill_cpu_s", 0) for r in ok)
            cpu0 = statistics.median(r.get("prefill_cpu_s", 0) for r in ok0) or 1
            dcpu = statistics.median(r.get("decode_cpu_ms_per_token", 0) for r in ok)
            dcpu0 = statistics.median(r.get("decode_cpu_ms_per_token", 0) for r in ok0) or 1
            dec0 = statistics.median(r["decode_tok_s"] for r in ok0)
            same = sum(a == b for a, b in zip(ok[0]["tokens"], ok0[0]["tokens"]))
            print(
                f"{pathlib.Path(folder).name:28s} {context:6d}: prefill {pre:7.2f} s ({pre / pre0:4.2f}x)  "
                f"CPU {cpu:6.1f} s ({cpu / cpu0:4.2f}x)  decode {dec:6.2f} tok/s ({dec / dec0:4.2f}x) "
                f"CPU {dcpu:5.1f} ms/token ({dcpu / dcpu0:4.2f}x)  peak RSS {rss:6.0f} MiB  "
                f"tokens equal to {pathlib.Path(base).name}'s: first "
                f"{_prefix(ok[0]['tokens'], ok0[0]['tokens'])}/{len(ok0[0]['tokens'])} ({same} positions)"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    main()
