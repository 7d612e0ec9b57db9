"""What the library makes today of each file the producers wrote (not run by CI).

Run with the project venv (the library installed):
    python tools/exports/status.py [PRODUCERS_DIR] [--only REGEX] [--out STATUS.md]

Writes ``PRODUCERS_DIR/STATUS.md`` (default ``/work/producers``): one line per file of its
manifest: path, producer and versions, the class of what surrounds its attention, whether
onnxruntime CPU ran it, its logits against transformers', and the outcome of
``tests/passes/fusion/producers.py``'s :func:`outcome` (``converts`` or the refusal's one line:
what a row of ``EXPECTED`` holds; a file with a row there shows the row, unless --recompute).
Outcomes are cached in ``STATUS.json`` beside it by the file's size and time, so a rerun only
decides the new files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent

#: family -> what surrounds its attention (the classes of issue 35's table)
CLASS = {
    "starcoder2": "LayerNorm",
    "stablelm": "LayerNorm, partial rotary (Trilu mask in transformers 4.57 dynamo)",
    "stablelm_qknorm": "LayerNorm, q/k LayerNorm",
    "cohere": "LayerNorm, interleaved rotary",
    "cohere2": "LayerNorm, interleaved rotary, alternating windows (NoPE full layers)",
    "helium": "interleaved rotary",
    "glm4": "interleaved partial rotary",
    "qwen3_moe": "MoE",
    "qwen2_moe": "MoE (shared expert)",
    "mixtral": "MoE",
    "olmoe": "MoE, q/k norm",
    "granitemoe": "MoE, multipliers",
    "phimoe": "MoE, LayerNorm",
    "llama4_text": "MoE, chunked attention, NoPE layers",
    "gpt_oss": "attention sinks, alternating windows, MoE",
    "llama_rope_llama3": "rope llama3",
    "llama_rope_linear": "rope linear",
    "llama_rope_dynamic": "rope dynamic",
    "qwen2_rope_yarn": "rope yarn",
    "phi3_longrope": "rope longrope",
    "qwen2_window": "window (one layer)",
    "mistral": "window",
    "mistral_window6": "window 6",
    "ministral": "alternating windows",
    "olmo3": "alternating windows, q/k norm",
    "exaone4": "alternating windows, q/k norm",
    "gemma2": "alternating windows, softcap",
    "gemma3": "alternating windows, q/k norm",
    "deepseek_v3": "MLA",
    "jetmoe": "K/V heads repeated by Tile, attention experts (MoA)",
    "gptj": "q/k cast to float32 in attention, partial interleaved rotary, MHA",
}


def _producers_module():
    spec = importlib.util.spec_from_file_location("producers", REPO / "tests/passes/fusion/producers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _class(entry: dict) -> str:
    base = CLASS.get(entry["family"], "plain")
    if entry["form"].endswith("rollingcache"):
        return base + ", rolling window cache"
    if entry["config"].get("window") and entry["producer"] == "torch.onnx.export":
        return base + ", full-length cache"
    return base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", nargs="?", default="/work/producers")
    ap.add_argument("--only", default=None)
    ap.add_argument("--recompute", action="store_true", help="decide the files with an EXPECTED row too")
    a = ap.parse_args()
    folder = pathlib.Path(a.folder)
    producers = _producers_module()
    producers.FOLDER = folder
    man = json.loads((folder / "manifest.json").read_text())
    cache_file = folder / "STATUS.json"
    cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    lines = [
        f"# What the library makes of each file in {folder} (tools/exports/status.py)",
        "",
        "| path | producer | transformers | class | ort CPU runs | logits vs transformers | decode | today |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in man["models"]:
        if a.only and not re.search(a.only, entry["path"]):
            continue
        if "error" in entry:
            today, runs, diff, steps = "producer failed: " + entry["error"][:200], "", "", ""
        else:
            graph = producers.model_path(entry)
            stamp = f"{graph.stat().st_size}:{graph.stat().st_mtime_ns}"
            hit = cache.get(entry["path"])
            if entry["path"] in producers.EXPECTED and not a.recompute:  # test_producers.py checks it
                today = producers.EXPECTED[entry["path"]]
            elif hit and hit[0] == stamp:
                today = hit[1]
            else:
                try:
                    today = producers.outcome(entry)[0]
                except Exception as e:  # a traceback of the library is itself a finding
                    today = f"TRACEBACK {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                cache[entry["path"]] = [stamp, today]
                cache_file.write_text(json.dumps(cache, indent=1))
                print(f"{entry['path']}: {today[:200]}", file=sys.stderr, flush=True)
            runs = "yes" if entry.get("ran_on_cpu") else "no"
            d = entry.get("logits_vs_transformers")
            diff = f"{d:.1e}" if d is not None else "did not run"
            d = entry.get("decode_vs_transformers")
            steps = f"{d:.1e}" if d is not None else (entry.get("decode_run") or "not checked")[:120]
        version = f"{entry['producer']} {entry.get('producer_version')}"
        cell = today.replace("|", "\\|")
        lines.append(
            f"| {entry['path']} | {version} | {entry.get('transformers')} | {_class(entry)} | {runs} "
            f"| {diff} | {steps.replace('|', '/')} | {cell} |"
        )
    head, rows = lines[:4], lines[4:]
    known = [r for r in rows if r.split(" | ")[0][2:] in producers.EXPECTED]
    failed = [r for r in rows if "| producer failed: " in r]
    new = [r for r in rows if r not in known and r not in failed]
    text = [*head[:2], "Files without a row in tests/passes/fusion/producers.py's EXPECTED (new):", ""]
    text += head[2:] + new + ["", "Files with a row there (what it holds):", ""] + head[2:] + known
    text += ["", "Jobs whose producer failed (no file):", "", *head[2:], *failed]
    (folder / "STATUS.md").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
