"""Make the tiny producer files and their manifest (not run by CI; see README.md here).

Run with a Python that has onnx and onnxruntime (the project venv):
    /work/venv/bin/python tools/exports/generate.py [--only REGEX] [--force] [--publish]

Each job runs a real producer in its own side virtual environment (setup_venvs.sh), writes
/work/producers/<producer>/<form>/<family>/, checks the file with onnx.checker and
onnxruntime CPU, and records it (or the producer's one-line error) in
/work/producers/manifest.json. --publish copies the tree to tests/data/producers/.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
from families import COMMON, FAMILIES, WINDOW, config_summary  # noqa: E402

VENVS = pathlib.Path(os.environ.get("SIDEVENVS", "/work/sidevenvs"))
OUT = pathlib.Path(os.environ.get("PRODUCERS", "/work/producers"))
MOBIUS_SRC = VENVS / "mobius-src"
MANIFEST = OUT / "manifest.json"
# transformers 5.25's from_pretrained kernelizes layers with the `kernels` package by default and
# refuses to load without it (the registry here has none recent enough): off, for every producer
os.environ.setdefault("USE_HUB_KERNELS", "0")

#: venv -> the venv that saves its HF models (the transformers they are saved with)
VENV_TF = {"t457": "t457", "t5": "t5", "genai": "t5", "t515": "t515", "t514": "t514"}
#: venv -> the producer dir of its torch.onnx.export files
TORCH_DIR = {
    "t457": "torch-tf4.57",
    "t5": "torch-tf5",
    "t515": "torch2.15-tf5.25",
    "t514": "torch2.14-tf5.22",
}

ALL = list(FAMILIES)
PRIORITY = ["llama", "qwen3", "qwen2", "mistral", "phi3", "gemma2", "gemma3"]


def torch_form(
    exporter: str,
    opset: int | None,
    optimize: bool,
    f16: bool = False,
    rolling: bool = False,
    eager: bool = False,
) -> str:
    tail = ("-f16" if f16 else "") + ("-rollingcache" if rolling else "") + ("-eager" if eager else "")
    if exporter == "torchscript":
        return f"torchscript-opset{opset}" + tail
    return f"dynamo-opset{opset or 'default'}-{'optimize' if optimize else 'nooptimize'}" + tail


def torch_job(
    venv: str,
    exporter: str,
    opset: int | None,
    optimize: bool,
    family: str,
    f16: bool = False,
    rolling: bool = False,
    eager: bool = False,
) -> dict:
    """``rolling``: the cache transformers 5.x builds from the config (``--cache config``: a
    window layer keeps its last window - 1 tokens) instead of docs/exporting.md's full-length one;
    ``eager``: the model loaded with ``attn_implementation="eager"`` (transformers' own attention
    code, not torch's sdpa)."""
    args = (
        ["--exporter", exporter]
        + (["--opset", str(opset)] if opset else [])
        + ([] if optimize else ["--no-optimize"])
        + (["--dtype", "float16"] if f16 else [])
        # a rolling cache's traced path holds for pasts up to window - 1 (what it feeds back):
        # traced with a longer past, the export fails on any shorter one ("GatherND: invalid index")
        + (["--cache", "config", "--past", str(WINDOW - 2)] if rolling else [])
        + (["--attn", "eager"] if eager else [])
    )
    return {
        "producer": "torch.onnx.export",
        "dir": TORCH_DIR[venv],
        "venv": venv,
        "form": torch_form(exporter, opset, optimize, f16, rolling, eager),
        "family": family,
        "cmd": ["{py}", str(HERE / "export_torch.py"), "{hf}", "{out}", *args],
        **(
            {
                "note": "transformers 4.57's torch.vmap mask does not trace under TorchScript "
                "(RuntimeError: unordered_map::at); export_torch.py registers optimum's "
                "sdpa_mask_without_vmap, as optimum-cli does"
            }
            if exporter == "torchscript" and venv == "t457"
            else {}
        ),
    }


def optimum_job(family: str) -> dict:
    return {
        "producer": "optimum-onnx",
        "dir": "optimum",
        "venv": "t457",
        "form": "optimum-cli",
        "family": family,
        "cmd": [
            "{bin}/optimum-cli",
            "export",
            "onnx",
            "--model",
            "{hf}",
            "--task",
            "text-generation-with-past",
            "{out}",
        ],
    }


MOBIUS_FORMS = {
    "mobius-default": [],
    "mobius-static": ["--features", "static-cache", "--max-seq-len", "64"],
    "mobius-cpu-gqa": ["--ep", "cpu"],
    "mobius-cuda-f16": ["--ep", "cuda", "--dtype", "f16"],
    "mobius-ort-genai": ["--ep", "cpu", "--runtime", "ort-genai"],
}


def mobius_job(form: str, family: str) -> dict:
    return {
        "producer": "mobius",
        "dir": "mobius",
        "venv": "t5",
        "form": form,
        "family": family,
        "cmd": ["{bin}/mobius", "build", "--config", "{hf}", "{out}", *MOBIUS_FORMS[form]],
    }


def genai_job(family: str) -> dict:
    return {
        "producer": "onnxruntime-genai builder",
        "dir": "genai-builder",
        "venv": "genai",
        "form": "genai-builder-cpu-fp32",
        "family": family,
        "cmd": [
            "{py}",
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            "{hf}",
            "-o",
            "{out}",
            "-e",
            "cpu",
            "-p",
            "fp32",
            "-c",
            "{tmp}/cache",
        ],
    }


def jobs_issue28() -> list[dict]:
    out: list[dict] = []
    # priority 1: the forms that fail today (issue 28)
    for fam in ("llama", "qwen3"):
        out += [torch_job("t457", "dynamo", o, True, fam) for o in (18, 20, 23)]  # 20 is torch 2.13's default
    for fam in ("mistral", "gemma2"):
        out.append(torch_job("t5", "dynamo", 23, True, fam))
    out += [optimum_job("phi3"), optimum_job("gemma2")]
    for form in ("mobius-default", "mobius-static"):
        out += [mobius_job(form, fam) for fam in ("qwen2", "gemma2", "phi3")]
    # priority 2: widen, breadth first (every producer x form once, then more families)
    wide = [
        ("genai", "llama"),
        ("mobius-cpu-gqa", "llama"),
        ("mobius-cuda-f16", "llama"),
        ("mobius-ort-genai", "llama"),
        ("mobius-default", "llama"),
        ("mobius-static", "llama"),
        ("optimum", "llama"),
        ("t5-d23", "llama"),
        ("t457-ts18", "llama"),
        ("t457-d18-noopt", "llama"),
        ("t5-d23-noopt", "llama"),
        ("genai", "qwen3"),
        ("genai", "gemma2"),
        ("genai", "granite"),
        ("genai", "smollm3"),
        ("genai", "olmo2"),
        ("mobius-default", "qwen3"),
        ("mobius-default", "mistral"),
        ("mobius-default", "gemma3"),
        ("mobius-default", "granite"),
        ("mobius-default", "olmo2"),
        ("mobius-default", "smollm3"),
        ("t5-d23", "qwen3"),
        ("t5-d23", "gemma3"),
        ("t5-d23", "phi3"),
        ("t5-d23", "granite"),
        ("optimum", "qwen3"),
        ("optimum", "mistral"),
        ("optimum", "granite"),
        ("optimum", "olmo2"),
        ("mobius-cpu-gqa", "gemma2"),
        ("mobius-cpu-gqa", "phi3"),
        ("mobius-cuda-f16", "gemma2"),
        ("mobius-static", "gemma3"),
        ("mobius-ort-genai", "qwen2"),
        ("genai", "qwen2"),
        ("genai", "mistral"),
        ("genai", "phi3"),
        ("genai", "gemma3"),
        ("t457-d23", "mistral"),
        ("t457-d23", "gemma2"),
        ("t457-ts18", "gemma2"),
        ("t5-d18", "llama"),
        ("optimum", "qwen2"),
        ("optimum", "gemma3"),
        ("optimum", "smollm3"),
        ("t457-d23", "qwen2"),
        ("t457-d23", "phi3"),
        ("t457-d23", "gemma3"),
        ("t457-d23", "granite"),
        ("t5-d23", "qwen2"),
        ("t5-d23", "olmo2"),
        ("t5-d23", "smollm3"),
        ("t457-d18-noopt", "gemma2"),
        ("mobius-static", "mistral"),
        ("mobius-static", "granite"),
        ("mobius-cpu-gqa", "qwen3"),
        ("mobius-cuda-f16", "qwen3"),
        ("mobius-ort-genai", "gemma2"),
        ("t5-ts18", "llama"),
        *(("mobius-cpu-gqa", f) for f in ("qwen2", "granite", "olmo2", "smollm3", "mistral")),
        *(("mobius-static", f) for f in ("qwen3", "olmo2", "smollm3")),
        *(("mobius-ort-genai", f) for f in ("qwen3", "gemma3")),
        *(("mobius-cuda-f16", f) for f in ("phi3", "granite")),
        ("t457-d18-f16", "llama"),
        ("t5-d23-f16", "llama"),
        ("t457-ts18", "phi3"),
        ("t457-ts18", "mistral"),
    ]
    return out + expand(wide)


def expand(cells: list[tuple[str, str]]) -> list[dict]:
    """Jobs of ``(what, family)`` cells: ``genai``, ``optimum``, a mobius form, or
    ``<venv>-<d|ts><opset>[-noopt][-f16][-rolling][-eager]`` for torch.onnx.export."""
    out: list[dict] = []
    for what, fam in cells:
        if what == "genai":
            out.append(genai_job(fam))
        elif what == "optimum":
            out.append(optimum_job(fam))
        elif what.startswith("mobius"):
            out.append(mobius_job(what, fam))
        else:
            venv, kind, *rest = what.split("-")
            opset = int(kind[-2:])
            exporter = "torchscript" if kind.startswith("ts") else "dynamo"
            out.append(
                torch_job(
                    venv,
                    exporter,
                    opset,
                    "noopt" not in rest,
                    fam,
                    "f16" in rest,
                    "rolling" in rest,
                    "eager" in rest,
                )
            )
    return out


#: issue 35: each class of attention's surroundings through the producers that export it, and
#: the newer producers (torch 2.15 + transformers 5.25); first one file per refused class
ISSUE35: list[tuple[str, str]] = [
    # first batch: one file per class that a limit of the fusion refuses today
    ("optimum", "stablelm"),  # LayerNormalization before attention
    ("optimum", "cohere"),  # interleaved rotary as NonZero/Tile
    ("optimum", "qwen3_moe"),  # MoE block
    ("t457-d23", "stablelm"),  # Trilu mask
    ("optimum", "gpt_oss"),  # attention sinks
    ("t5-d23-rolling", "mistral"),  # rolling window cache
    ("t5-d23", "deepseek_v3"),  # MLA
    ("t515-d23", "gpt_oss"),
    ("t515-d23-rolling", "gemma2"),
    ("t515-d23", "gemma2"),
    ("t515-d23", "llama"),
    ("t515-ts18", "llama"),
    # second: each class through the other producers (in order of what they add)
    ("t5-d23", "qwen3_moe"),
    ("t5-d23", "gpt_oss"),
    ("t457-ts18", "starcoder2"),
    ("t5-d23", "starcoder2"),
    ("optimum", "helium"),
    ("t5-d23-rolling", "gemma2"),
    ("t5-d23", "llama_rope_llama3"),
    ("t5-d23", "phi3_longrope"),
    ("t5-d23-rolling", "qwen2_window"),
    ("t5-d23", "qwen2_window"),
    ("t5-d23-rolling", "cohere2"),
    ("t5-d23", "cohere2"),
    ("t5-d23", "qwen2_rope_yarn"),
    ("mobius-default", "gpt_oss"),
    ("mobius-default", "qwen3_moe"),
    ("mobius-default", "cohere"),
    ("mobius-default", "deepseek_v3"),
    ("mobius-default", "starcoder2"),
    ("genai", "gpt_oss"),
    ("genai", "llama_rope_llama3"),
    ("genai", "qwen3_moe"),
    ("optimum", "deepseek_v3"),
    ("t515-d18", "llama"),
    ("t515-d23", "qwen3_moe"),
    ("optimum", "llama_rope_llama3"),
    ("optimum", "phi3_longrope"),
    ("t457-ts18", "stablelm"),
    ("t5-d23", "cohere"),
    ("t5-d23", "helium"),
    ("t5-d23", "mixtral"),
    ("t5-d23", "llama_rope_linear"),
    ("t5-d23", "llama_rope_dynamic"),
    ("optimum", "qwen2_rope_yarn"),
    ("genai", "phi3_longrope"),
    ("mobius-cpu-gqa", "gpt_oss"),
    # producers without the family (their failure recorded): optimum-onnx 0.1.0
    ("optimum", "starcoder2"),
    ("optimum", "mixtral"),
    ("optimum", "cohere2"),
    # the rest, if time allows
    ("t515-d23", "gemma3"),
    ("t515-d23", "starcoder2"),
    ("t515-d23", "helium"),
    ("t515-d23", "llama_rope_llama3"),
    ("t515-d23-rolling", "mistral"),
    ("t515-d23", "mistral"),
    ("t515-d23", "deepseek_v3"),
    ("t457-d18", "stablelm"),
    ("t457-d23", "qwen3_moe"),
    ("t457-d23", "gpt_oss"),
    ("t515-d23-noopt", "llama"),
    ("optimum", "olmoe"),
    ("t5-d23", "olmoe"),
]


#: issue 46: K/V heads repeated by Tile (jetmoe: ``.repeat(1, top_k, 1, 1)``) and query/key cast to
#: float32 inside attention (gptj: ``.to(torch.float32)``, which only TorchScript writes as a Cast in
#: a float32 model; dynamo drops it, and writes it in a float16 one)
ISSUE46: list[tuple[str, str]] = [
    ("t457-d18", "jetmoe"),
    ("t457-d23", "jetmoe"),
    ("t457-ts18", "jetmoe"),
    ("optimum", "jetmoe"),
    ("t457-ts18", "gptj"),
    ("optimum", "gptj"),
    ("t457-d18", "gptj"),
    ("t457-d18-f16", "gptj"),
    ("t5-ts18", "gptj"),
    ("t5-ts18-f16", "gptj"),  # V widened to float32 for the value product: refused by name
    # transformers 5's eager attention in float16: Q and K widened to float32 for the scores, the
    # probabilities cast back for V (what GroupQueryAttention computes)
    ("t5-d23-f16-eager", "gptj"),
]


def jobs() -> list[dict]:
    """The committed set's jobs (issue 28's, then issue 35's classes and newer producers, then
    issue 46's)."""
    return _unique(jobs_issue28() + expand(ISSUE35) + expand(ISSUE46))


#: the held-out set: other families and versions through the same producers (issue 35's
#: acceptance check), never committed
HOLDOUT_JOBS: list[tuple[str, str]] = [
    # optimum-onnx 0.1.0 has arcee, glm and stablelm (granitemoe: "unsupported architecture")
    ("optimum", "granitemoe"),
    ("optimum", "arcee"),
    ("optimum", "glm4"),
    ("optimum", "stablelm_qknorm"),
    ("t514-d23", "granitemoe"),
    ("t514-d23", "qwen2_moe"),
    ("t514-d23", "olmo3"),
    ("t514-d23-rolling", "ministral"),
    ("t514-d23", "exaone4"),
    ("t514-d23", "glm4"),
    ("t514-d23", "ministral"),
    ("t514-d23", "seed_oss"),
    ("t514-d23", "phimoe"),
    ("t514-d23", "arcee"),
    ("t514-d23", "gemma3"),
    ("t514-d23", "smollm3"),
    ("t514-d23", "llama4_text"),
    ("t514-d18", "stablelm"),
    ("t514-ts18", "glm4"),
    ("t514-d23-rolling", "mistral_window6"),
    ("t514-d23-rolling", "olmo3"),
    ("mobius-default", "exaone4"),
    ("mobius-default", "arcee"),
    ("mobius-default", "olmo3"),
    ("mobius-cpu-gqa", "granitemoe"),
    ("genai", "glm4"),
    ("genai", "ministral"),
    ("t515-d23", "olmo3"),
    ("t515-d23", "exaone4"),
    ("t515-d23", "seed_oss"),
    ("t515-d23", "qwen2_moe"),
    ("t515-d20", "granitemoe"),
    ("t457-d23", "granitemoe"),
    ("t457-d23", "qwen2_moe"),
    ("t457-d23", "glm4"),
    ("t457-ts18", "arcee"),
    ("optimum", "qwen2_moe"),
    ("optimum", "olmo3"),
]


def jobs_holdout() -> list[dict]:
    return _unique(expand(HOLDOUT_JOBS))


def _unique(out: list[dict]) -> list[dict]:
    seen, uniq = set(), []
    for j in out:
        key = (j["dir"], j["form"], j["family"])
        if key not in seen:
            seen.add(key)
            uniq.append(j)
    return uniq


# --- checking ------------------------------------------------------------------------------------


def io_of(model: onnx.ModelProto) -> dict:
    def one(v):
        t = v.type.tensor_type
        return {
            "name": v.name,
            "type": onnx.TensorProto.DataType.Name(t.elem_type).lower(),
            "shape": [d.dim_param or d.dim_value for d in t.shape.dim],
        }

    return {"inputs": [one(v) for v in model.graph.input], "outputs": [one(v) for v in model.graph.output]}


_NP = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


def feed_for(sess: ort.InferenceSession, past: int = 2, seq: int = 3, ids: np.ndarray | None = None) -> dict:
    rng = np.random.default_rng(0)
    feed: dict[str, np.ndarray] = {}
    for i in sess.get_inputs():
        dt = _NP.get(i.type, np.float32)
        name = i.name
        if name == "input_ids":
            feed[name] = (rng.integers(3, 128, (1, seq)) if ids is None else ids).astype(dt)
        elif name == "attention_mask":
            feed[name] = np.ones((1, past + seq), dt)
        elif name == "position_ids":
            feed[name] = np.arange(past, past + seq, dtype=dt)[None]
        elif name == "write_indices":
            feed[name] = np.array([past], dt)
        elif name == "nonpad_kv_seqlen":
            feed[name] = np.array([past + seq], dt)
        else:
            # batch 1, a symbolic head dimension (genai's kv_cache_dim) the head size, others the past
            symbolic = [1, past, past, COMMON["head_dim"]]
            shape = [d if isinstance(d, int) and k else symbolic[min(k, 3)] for k, d in enumerate(i.shape)]
            if len(i.shape) > 2 and "sliding" in str(i.shape[2]):  # genai's window-sized buffer
                shape[2] = WINDOW
            floating = np.issubdtype(dt, np.floating)
            if floating and past == 0:  # a prefill: an empty cache (a fixed-size buffer of zeros)
                feed[name] = np.zeros(shape, dt)
            else:
                feed[name] = (rng.standard_normal(shape) if floating else np.ones(shape)).astype(dt)
    return feed


GENAI_CHECK = """
import sys, onnxruntime_genai as og
model = og.Model(sys.argv[1])
params = og.GeneratorParams(model)
params.set_search_options(max_length=12, do_sample=False)
gen = og.Generator(model, params)
gen.append_tokens([[1, 72, 105, 33]])
while not gen.is_done():
    gen.generate_next_token()
print([int(t) for t in gen.get_sequence(0)])
"""


def genai_check(folder: pathlib.Path) -> str:
    """Whether onnxruntime-genai (of the checking Python) loads the folder and generates."""
    p = subprocess.run([sys.executable, "-c", GENAI_CHECK, str(folder)], capture_output=True, text=True)
    return "ok: " + p.stdout.strip() if p.returncode == 0 else error_line(p.stderr)


def reference_diff(sess: ort.InferenceSession, ref: dict) -> float:
    """Largest |logit - transformers' logit| over a 7-token prefill from an empty cache."""
    ids = ref["input_ids"]
    outs = sess.run(None, feed_for(sess, past=0, seq=ids.shape[1], ids=ids))
    names = [o.name for o in sess.get_outputs()]
    logits = outs[names.index("logits")].astype(np.float32)
    return float(np.abs(logits - ref["logits"]).max())


def decode_diff(sess: ort.InferenceSession, ref: dict) -> float | None:
    """Largest |logit - transformers' logit| over 3 decode steps after the 7-token prefill, each
    step fed the file's own presents (``present.X`` back into ``past_key_values.X``); None when
    the file's cache inputs are not its outputs renamed (a static cache)."""
    outputs = [o.name for o in sess.get_outputs()]
    pasts = [i.name for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    back = {p: "present." + p[len("past_key_values.") :] for p in pasts}
    if "decode_ids" not in ref or not pasts or not all(v in outputs for v in back.values()):
        return None
    ids, want = ref["decode_ids"], ref["decode_logits"]
    prompt = ref["input_ids"].shape[1]
    feed = feed_for(sess, past=0, seq=prompt, ids=ids[:, :prompt])
    worst = 0.0
    for step in range(prompt, ids.shape[1] + 1):
        outs = dict(zip(outputs, sess.run(None, feed)))
        if step > prompt:
            got = outs["logits"][:, -1].astype(np.float32)
            worst = max(worst, float(np.abs(got - want[:, step - 1]).max()))
        if step == ids.shape[1]:
            break
        feed = dict(feed)
        feed["input_ids"] = ids[:, step : step + 1].astype(feed["input_ids"].dtype)
        if "attention_mask" in feed:
            feed["attention_mask"] = np.ones((1, step + 1), feed["attention_mask"].dtype)
        if "position_ids" in feed:
            feed["position_ids"] = np.array([[step]], feed["position_ids"].dtype)
        for p, o in back.items():
            feed[p] = outs[o]
    return worst


def check(folder: pathlib.Path, ref: dict | None = None) -> dict:
    path = folder / "model.onnx"
    res: dict = {}
    if (folder / "genai_config.json").exists():
        res["genai_cpu_generate"] = genai_check(folder)
    try:
        onnx.checker.check_model(str(path))
        res["checker"] = "ok"
    except Exception as e:
        res["checker"] = one_line(e)
    model = onnx.load(str(path), load_external_data=False)
    res["opsets"] = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
    res["ops"] = sorted({(n.domain + "::" if n.domain else "") + n.op_type for n in model.graph.node})
    res.update(io_of(model))
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        res["ort_cpu_session"] = "ok"
    except Exception as e:
        res["ort_cpu_session"] = one_line(e)
        res["ran_on_cpu"] = False
        return res
    try:
        outs = sess.run(None, feed_for(sess))
        res["ran_on_cpu"] = bool(
            all(np.isfinite(o.astype(np.float32)).all() for o in outs if o.dtype.kind == "f")
        )
    except Exception as e:
        res["ran_on_cpu"] = False
        res["ort_cpu_run"] = one_line(e)
    if ref is not None:
        try:
            res["logits_vs_transformers"] = reference_diff(sess, ref)
            res["logits_scale"] = float(np.abs(ref["logits"]).max())
        except Exception as e:
            res["logits_vs_transformers"] = None
            res["reference_run"] = one_line(e)
        try:
            diff = decode_diff(sess, ref)
            if diff is not None:
                res["decode_vs_transformers"] = diff
        except Exception as e:
            res["decode_vs_transformers"] = None
            res["decode_run"] = one_line(e)
    return res


def one_line(e: object) -> str:
    text = str(e).strip().splitlines()
    lines = [t.strip() for t in text if t.strip()]
    return (lines[-1] if lines else type(e).__name__)[:400]


def error_line(stderr: str) -> str:
    """The exception line of a producer's output; with the root cause when it was chained."""
    lines = [ln.rstrip() for ln in stderr.splitlines() if ln.strip()]
    exc = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b[^ ]*:? ", ln + " ")]
    if not exc:
        exc = [ln.strip() for ln in lines if re.search(r"[Ee]rror:", ln)]
    if not exc:
        return (lines[-1].strip() if lines else "no output")[:400]
    last, first = exc[-1].strip(), exc[0].strip()
    text = last if first == last else f"{last[:240]} (caused by {first[:200]})"
    return text[:480]


# --- versions ------------------------------------------------------------------------------------


def venv_versions(venv: str) -> dict:
    py = VENVS / venv / "bin" / "python"
    code = (
        "import importlib.metadata as m, json, platform\n"
        "out={'python': platform.python_version()}\n"
        "for p in ['torch','transformers','optimum-onnx','optimum','onnxscript','onnx','onnx-ir',"
        "'onnxruntime','onnxruntime-genai','mobius-onnx']:\n"
        "    try: out[p]=m.version(p)\n"
        "    except Exception: pass\n"
        "print(json.dumps(out))"
    )
    return json.loads(
        subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout
    )


def mobius_commit() -> str | None:
    f = MOBIUS_SRC / "COMMIT"
    return f.read_text().strip() if f.exists() else None


# --- running -------------------------------------------------------------------------------------


def hf_dir(venv: str, family: str) -> pathlib.Path:
    tf = VENV_TF[venv]
    d = VENVS / "hf" / tf / family
    if not (d / "model.safetensors").exists():
        py = VENVS / tf / "bin" / "python"
        subprocess.run([str(py), str(HERE / "make_hf.py"), family, str(d)], check=True, capture_output=True)
    if not (d / "reference.npz").exists() or "decode_ids" not in np.load(d / "reference.npz").files:
        py = VENVS / tf / "bin" / "python"
        subprocess.run([str(py), str(HERE / "reference.py"), str(d)], check=True, capture_output=True)
    return d


def reference_of(entry: dict) -> dict | None:
    """transformers' logits for the entry's HF model (made by hf_dir)."""
    try:
        f = hf_dir(entry["venv"], entry["family"]) / "reference.npz"
    except subprocess.CalledProcessError:
        return None
    with np.load(f) as z:
        return {k: z[k] for k in z.files}


def producer_version(job: dict, versions: dict) -> str | None:
    v = versions[job["venv"]]
    commit = mobius_commit()
    return {
        "torch.onnx.export": v.get("torch"),
        "optimum-onnx": v.get("optimum-onnx"),
        "mobius": (v.get("mobius-onnx") or "") + (f"+{commit[:12]}" if commit else ""),
        "onnxruntime-genai builder": v.get("onnxruntime-genai"),
    }[job["producer"]]


def run_job(job: dict, versions: dict, execute: bool = True) -> dict:
    """Run one producer job (or, with ``execute=False``, only record the folder it wrote)."""
    rel = f"{job['dir']}/{job['form']}/{job['family']}"
    dest = OUT / rel
    bindir = VENVS / job["venv"] / "bin"
    entry = {
        "path": rel,
        "producer": job["producer"],
        "producer_version": producer_version(job, versions),
        "form": job["form"],
        "family": job["family"],
        "transformers": versions[job["venv"]].get("transformers"),
        "venv": job["venv"],
        "config": config_summary(job["family"]),
        **({"note": job["note"]} if "note" in job else {}),
    }
    with tempfile.TemporaryDirectory(prefix="prod-") as tmp:
        try:
            hf = hf_dir(job["venv"], job["family"])
        except subprocess.CalledProcessError as e:
            entry["error"] = "making the HF model failed: " + error_line(
                e.stderr.decode() if e.stderr else ""
            )
            return entry
        out = pathlib.Path(tmp) / "out"
        subs = {"{py}": str(bindir / "python"), "{hf}": str(hf), "{out}": str(out), "{tmp}": tmp}
        cmd = []
        for a in job["cmd"]:
            for k, v in subs.items():
                a = a.replace(k, v)
            a = a.replace("{bin}", str(bindir))
            cmd.append(a)
        entry["command"] = " ".join(
            c.replace(str(hf), f"<hf:{VENV_TF[job['venv']]}/{job['family']}>")
            .replace(str(out), "OUT")
            .replace(tmp, "TMP")
            .replace(str(VENVS), "$SIDEVENVS")
            .replace(str(HERE), "tools/exports")
            for c in cmd
        )
        env = dict(
            os.environ,
            PATH=f"{bindir}:{os.environ['PATH']}",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONWARNINGS="ignore",
            CUDA_VISIBLE_DEVICES="",
        )
        if not execute:
            cmd = []
        t0 = time.time()
        p = subprocess.run(cmd or ["true"], capture_output=True, text=True, env=env, cwd=tmp)
        if execute:
            entry["seconds"] = round(time.time() - t0, 1)
        if execute and (p.returncode != 0 or not (out / "model.onnx").exists()):
            entry["error"] = error_line(p.stderr + p.stdout) if p.returncode else "no model.onnx written"
            (OUT / "logs").mkdir(parents=True, exist_ok=True)
            (OUT / "logs" / (rel.replace("/", "__") + ".log")).write_text(p.stdout + "\n" + p.stderr)
            if dest.exists():
                shutil.rmtree(dest)
            return entry
        if execute:
            (OUT / "logs" / (rel.replace("/", "__") + ".log")).unlink(missing_ok=True)  # stale failure
            if dest.exists():
                shutil.rmtree(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(out, dest)
    entry["files"] = {
        str(f.relative_to(dest)): f.stat().st_size for f in sorted(dest.rglob("*")) if f.is_file()
    }
    entry.update(check(dest, reference_of(entry)))
    return entry


ENTRIES = OUT / "logs" / "entries"  # one JSON per job, so that several workers can run at once


def load_manifest() -> dict:
    if MANIFEST.exists():
        return json.loads(MANIFEST.read_text())
    return {"versions": {}, "models": []}


def save_entry(entry: dict) -> None:
    ENTRIES.mkdir(parents=True, exist_ok=True)
    text = json.dumps(entry, indent=1).replace(str(VENVS), "$SIDEVENVS")  # no machine paths
    text = re.sub(r"/tmp/prod-[a-z0-9_]+/out", "OUT", text)
    (ENTRIES / (entry["path"].replace("/", "__") + ".json")).write_text(text)


def save_manifest(man: dict) -> None:
    models = {e["path"]: e for e in man["models"]}
    for f in ENTRIES.glob("*.json") if ENTRIES.exists() else []:
        e = json.loads(f.read_text())
        models[e["path"]] = e
    man["models"] = [models[k] for k in sorted(models)]
    tmp = MANIFEST.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(man, indent=1) + "\n")
    tmp.replace(MANIFEST)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="regex over <dir>/<form>/<family>")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--recheck", action="store_true", help="only re-run the checks of the files there")
    ap.add_argument("--worker", default="0/1", help="K/N: run every Nth job starting at K")
    ap.add_argument("--publish", action="store_true", help="copy the tree into tests/data/producers")
    ap.add_argument(
        "--holdout",
        action="store_true",
        help="the held-out set (HOLDOUT_JOBS) into $PRODUCERS_HOLDOUT (default /work/producers-holdout)",
    )
    ap.add_argument("--issue35", action="store_true", help="only issue 35's jobs (ISSUE35)")
    a = ap.parse_args()
    table = (lambda: _unique(expand(ISSUE35))) if a.issue35 else jobs
    if a.holdout:
        if a.publish:
            sys.exit("the held-out set is not committed: no --publish with --holdout")
        global OUT, MANIFEST, ENTRIES
        OUT = pathlib.Path(os.environ.get("PRODUCERS_HOLDOUT", "/work/producers-holdout"))
        MANIFEST, ENTRIES = OUT / "manifest.json", OUT / "logs" / "entries"
        table = jobs_holdout
    OUT.mkdir(parents=True, exist_ok=True)
    man = load_manifest()
    todo = [j for j in table() if not a.only or re.search(a.only, f"{j['dir']}/{j['form']}/{j['family']}")]
    k, n = (int(x) for x in a.worker.split("/"))
    todo = todo[k::n]
    if a.list:
        for j in todo:
            print(f"{j['dir']}/{j['form']}/{j['family']}")
        return
    versions = {}
    for v in VENV_TF:
        if (VENVS / v / "bin" / "python").exists():
            versions[v] = venv_versions(v)
    recorded = man.get("versions", {})  # a venv absent here keeps what its files were made with
    man["versions"] = {
        "generator_python": platform.python_version(),
        "checked_with": {"onnx": onnx.__version__, "onnxruntime": ort.__version__},
        "mobius_commit": mobius_commit() or recorded.get("mobius_commit"),
        # (a package this venv lacks here, e.g. mobius when only transformers was installed, keeps
        # the version the committed files were made with)
        "venvs": {**recorded.get("venvs", {})}
        | {v: {**recorded.get("venvs", {}).get(v, {}), **found} for v, found in versions.items()},
    }
    save_manifest(man)
    if a.recheck:
        known = {e["path"] for e in man["models"]}
        for j in table():  # folders written by a worker whose entry was lost: record them
            rel = f"{j['dir']}/{j['form']}/{j['family']}"
            if rel not in known and j["venv"] in versions and (OUT / rel / "model.onnx").exists():
                save_entry(run_job(j, versions, execute=False))
        save_manifest(man)
        for e in man["models"]:
            log = OUT / "logs" / (e["path"].replace("/", "__") + ".log")
            if "error" in e and log.exists():
                e["error"] = error_line(log.read_text())
                save_entry(e)
            if "error" not in e and (OUT / e["path"] / "model.onnx").exists():
                e.update(check(OUT / e["path"], reference_of(e)))
                save_entry(e)
        save_manifest(man)
    done = {e["path"] for e in man["models"]}
    for j in todo:
        rel = f"{j['dir']}/{j['form']}/{j['family']}"
        if a.recheck or j["venv"] not in versions or (rel in done and not a.force):
            continue
        entry = run_job(j, versions)
        save_entry(entry)
        save_manifest(man)
        status = (
            entry.get("error") or f"ok cpu={entry.get('ran_on_cpu')} {entry.get('ort_cpu_session')}"[:160]
        )
        print(f"{rel}: {status}", flush=True)
    save_manifest(man)
    if a.publish:
        publish()


README_HEAD = """# Producer files: the real exporters' output (the test oracle)

Tiny random-weight decoders written by the real producers (torch.onnx.export: torch 2.13 with
transformers 4.57 and 5.24, torch 2.15 with transformers 5.25; optimum-cli, mobius,
onnxruntime-genai's builder), made by `tools/exports/generate.py` (see
`tools/exports/README.md` for how to regenerate; not run by CI). Every family has 2 layers,
hidden 64, 4 query heads over 2 KV heads (GQA), head size 16, intermediate 64, vocab 128,
float32 (the `mobius-cuda-f16` and `*-f16` torch forms are float16); mistral, qwen2_window,
gemma2, gemma3, cohere2 and gpt_oss have a sliding window of 4 tokens (all but mistral
alternate sliding and full layers), so a 7-token prefill is longer than the window.

Issue 35's classes (what surrounds a plain attention): LayerNormalization before attention
(starcoder2, stablelm, cohere), interleaved rotary (cohere, cohere2, helium), MoE blocks
(qwen3_moe, mixtral, gpt_oss, deepseek_v3: 4 experts, 2 per token; transformers 5's experts
exported as `experts_implementation="batched_mm"`), attention sinks (gpt_oss), rope scaling
(`llama_rope_llama3`, `llama_rope_linear`, `llama_rope_dynamic`, `qwen2_rope_yarn`,
`phi3_longrope`), Trilu masks (stablelm through transformers 4.57's dynamo), MLA (deepseek_v3:
key head 32, value head 16, 4 KV heads). The `-rollingcache` torch forms keep transformers 5.x's
own cache (`DynamicCache(config=...)`): a window layer's present is its last window - 1 = 3
tokens, and the export is traced with a 2-token past, so it runs for any past up to 3 (what it
feeds back); the other torch forms keep full-length caches (docs/exporting.md section 1). In a
model whose window layers alternate with full ones (gemma2, cohere2) the rolling form's pasts
share one `past` dimension, so its own presents fed back (3 rows for a window layer, all the
rows for a full one) do not run: `decode_run` records onnxruntime's error.

Issue 46's classes: K/V heads repeated by `Tile` (jetmoe: `.repeat(1, top_k, 1, 1)`, query head
h reads KV head h mod kv_heads; 2 KV heads x top-k 2 = 4 query heads from 2 attention experts,
both chosen for every token) and query/key cast to float32 inside attention (gptj:
`.to(torch.float32)`, 4 heads, rotary on 8 of 16 channels; TorchScript and optimum write the
Casts in a float32 model, dynamo drops them; the `-f16-eager` form, transformers 5's eager
attention in float16, widens Q and K to float32 and casts the probabilities back for V). jetmoe's TorchScript export traces its experts' token counts as constants and runs only
on the traced 6 tokens, and optimum-onnx 0.1.0 has no jetmoe: neither is here.

Layout: `<producer dir>/<form>/<family>/` holds what the producer wrote (`model.onnx`, its
`model.onnx.data` when the producer writes external data, and the `config.json`,
`generation_config.json`, tokenizer files and `genai_config.json` that the producer writes
beside it). `manifest.json` lists every job: `path` (relative to this folder), `producer`,
`producer_version`, `form`, `family`, `transformers`, `config` (layers, heads, kv heads, head
size, window, layer types, soft-caps), `command`, `files` with sizes, the graph `inputs` and
`outputs` (name, element type, shape), `opsets`, `ops`, the checks (`checker`: onnx.checker;
`ort_cpu_session`: onnxruntime CPU session creation; `ran_on_cpu`: one run of a 3-token
step over a 2-token past gave finite outputs; `ort_cpu_run`: why a run failed), or, when the
producer could not export the family, `"error"`: its one-line reason and no folder.
`versions` records python, torch, transformers, optimum-onnx, onnxscript, onnx, onnx-ir,
onnxruntime, onnxruntime-genai and mobius (package version and source commit) of each side
environment, and the onnx/onnxruntime the checks ran with.

`logits_vs_transformers` is the largest |logit - transformers' logit| over a 7-token prefill
(`<s>Hello!`, ids 1 72 101 108 108 111 33) from an empty cache, transformers' logits computed
by `tools/exports/reference.py` from the same saved model (`logits_scale`: their largest |logit|);
`decode_vs_transformers` the same over 3 decode steps after it (ids 32 72 105), each fed the
file's own presents (`decode_run`: why that did not run; absent for a static cache).
About 1e-6 means the file computes as transformers does; float16 files are near 4e-3. What
the figures show (transformers 5.24's mistral with `sliding_window=4`): onnxruntime-genai's
builder (0.18.0) and mobius's default and static-cache builds ignore mistral's window (their
logits equal transformers' with the window removed, within 2e-6), while mobius's `--ep cpu`
build and every torch/optimum export keep it; genai's builder's phi3 and mobius's
`--runtime ort-genai` gemma3 differ from transformers too (not investigated). A model whose
file does not compute as transformers does is still what that producer writes. A few cells the generator makes
are left out of this folder to keep it near 25 MB (`NOT_COMMITTED` in generate.py; each of
those forms is here for other families).

| producer dir | form | family | producer version | transformers | result | logits vs transformers | decode |
|---|---|---|---|---|---|---|---|
"""


def table_rows(man: dict) -> str:
    rows = []
    for e in man["models"]:
        d, form, fam = e["path"].split("/")
        if "error" in e:
            res = "error: " + e["error"].replace("|", "\\|")[:160]
        else:
            res = (
                "ok, ran on CPU"
                if e.get("ran_on_cpu")
                else "ok, " + (e.get("ort_cpu_run") or e.get("ort_cpu_session", ""))[:120]
            )
        diff = e.get("logits_vs_transformers")
        diff_text = "" if "error" in e else (f"{diff:.1e}" if diff is not None else "did not run")
        step = e.get("decode_vs_transformers")
        step_text = f"{step:.1e}" if step is not None else ("did not run" if "decode_run" in e else "")
        rows.append(
            f"| {d} | {form} | {fam} | {e.get('producer_version')} | {e.get('transformers')} | {res} "
            f"| {diff_text} | {step_text} |"
        )
    return "\n".join(rows) + "\n"


#: made in /work/producers but left out of tests/data/producers (the form is there for other
#: families) to keep the committed tree near 25 MB: dynamo files carry ~400 KB of node metadata
NOT_COMMITTED = frozenset(
    {
        "torch-tf4.57/dynamo-opset18-nooptimize/gemma2",
        *(
            f"torch-tf4.57/dynamo-opset23-optimize/{f}"
            for f in ("qwen2", "granite", "gemma3", "phi3", "mistral")
        ),
        "torch-tf4.57/dynamo-opset20-optimize/qwen3",
        "torch-tf5/dynamo-opset23-optimize/qwen2",
        "torch-tf5/dynamo-opset23-optimize/granite",
        "torch-tf4.57/torchscript-opset18/mistral",
        "optimum/optimum-cli/granite",
        *(f"mobius/mobius-cpu-gqa/{f}" for f in ("qwen2", "granite", "olmo2", "smollm3")),
        # jetmoe's TorchScript export traces its attention experts' token counts as constants
        # (``expert_size.tolist()``): it runs only on the traced 6 tokens
        "torch-tf4.57/torchscript-opset18/jetmoe",
        # gptj's dynamo export in float32 drops ``.to(torch.float32)`` (no Cast to read); the
        # float16 one keeps the Casts but is refused in its mask (a finite fill plus integers)
        "torch-tf4.57/dynamo-opset18-optimize/gptj",
        "torch-tf4.57/dynamo-opset18-optimize-f16/gptj",
        # transformers 5.24's TorchScript gptj in float16 computes its presents in float32 from
        # float16 pasts: onnxruntime does not load it ("Type Error")
        "torch-tf5/torchscript-opset18-f16/gptj",
    }
)


def publish() -> None:
    dest = REPO / "tests" / "data" / "producers"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(OUT, dest, ignore=shutil.ignore_patterns("logs", "*.tmp", "STATUS.*"))
    man = json.loads(MANIFEST.read_text())
    man["models"] = [e for e in man["models"] if e["path"] not in NOT_COMMITTED]
    for rel in NOT_COMMITTED:
        if (dest / rel).exists():
            shutil.rmtree(dest / rel)
    for d in sorted(dest.rglob("*"), reverse=True):  # folders left empty
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    (dest / "manifest.json").write_text(json.dumps(man, indent=1) + "\n")
    (dest / "README.md").write_text(README_HEAD + table_rows(man))


if __name__ == "__main__":
    main()
