"""Calibration speed side by side, memory on the bundled decoder, and what the RoPE envelope buys.

    python benchmarks/calibrate.py [--reps 5] [--side-by-side-only] [--real-model CACHE]

1. Side by side in one process, alternating repetitions, medians: ``calibrate_kv_cache``
   (the graph pruned to its present outputs, windows batched), the same as before (the whole
   graph, one window a run), onnxruntime-genai's ``calibrate_kv_scales`` and a plain onnxruntime
   prefill of the whole model, on a Qwen2.5-0.5B-shaped decoder cut to 8 layers (hidden 896,
   14/2 heads, head size 64, MLP 4864, vocab 32768, float32), 8 windows x 256 tokens, int8
   per-channel minmax. Each is timed from the model file to its result, session creation
   included. Then the scales of the new and the former runs are compared for every
   method (they must be identical), and ours with genai's. ``--real-model CACHE``: the side
   by side only, on SmolLM2-135M-Instruct (``benchmarks/real_model.py`` builds it in CACHE;
   ``pip install gguf``) with ``calibrate``'s default windows (the built-in corpus's
   calibration part through the model's tokenizer, 512 tokens a window, the full ones).
2. Tokens per second and peak RSS of calibrate_kv_cache at seq-len 512 on the built-in
   corpus (byte-level ids, the bundled decoder's tokenizer).
3. Scales calibrated on short windows (64 tokens), then K read at long positions (up to
   4096): the fraction of K values the int8 cache clips (beyond level 127 or -128 by more
   than half a step), with raw K thresholds and with the rotation-invariant envelope.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator

import numpy as np

import onnx_kvcache.calibrate.calibration as calibration
from onnx_kvcache import KvCacheRunner, calibrate_kv_cache
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.models.decoder import DecoderConfig, build_decoder, save_genai_folder
from onnx_kvcache.scales.data import builtin_corpus, corpus_byte_ids

QWEN_8_LAYERS = DecoderConfig(
    num_layers=8,
    hidden_size=896,
    num_heads=14,
    kv_num_heads=2,
    head_size=64,
    intermediate_size=4864,
    vocab_size=32768,
)
WINDOWS, WINDOW = 8, 256
GENAI, PREFILL = "onnxruntime-genai calibrate_kv_scales", "onnxruntime prefill, whole model"


class _GivenIds:
    """Stands in for transformers' AutoTokenizer, which genai's calibrator imports to
    tokenize its corpus: it gets our token ids, so both calibrate the same windows."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def encode(self, text: str) -> list[int]:
        return list(self.ids)


@contextlib.contextmanager
def _transformers_shim(ids: list[int]) -> Iterator[None]:
    shim = types.ModuleType("transformers")
    shim.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda path: _GivenIds(ids))  # type: ignore[attr-defined]
    saved = sys.modules.get("transformers")
    sys.modules["transformers"] = shim
    try:
        yield
    finally:
        if saved is None:
            del sys.modules["transformers"]
        else:
            sys.modules["transformers"] = saved


def _genai(model_file: pathlib.Path, windows: list[list[int]], out: pathlib.Path) -> np.ndarray:
    from onnxruntime_genai.models.quantization.kv_cache_calibration import calibrate_kv_scales

    with _transformers_shim([t for w in windows for t in w]):
        calibrate_kv_scales(
            str(model_file),
            "unused",
            str(out),
            quant_type="int8_per_channel",
            method="minmax",
            target_seq=len(windows[0]),
            num_seqs=len(windows),
        )
    scales = json.loads(out.read_text())["scales"]
    return np.asarray([scales["k_scales"], scales["v_scales"]], np.float32)


def _real_model(cache: pathlib.Path) -> tuple[pathlib.Path, list[list[int]]]:
    """SmolLM2-135M's genai folder (benchmarks/real_model.py) and calibrate's default windows
    for it: the built-in corpus's calibration part, its tokenizer, 512 tokens a window."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import real_model

    from onnx_kvcache.scales.data import load_token_windows

    folder = real_model.build_model(cache)
    loaded = load_token_windows(None, model=folder, seq_len=512)
    return folder, [w.tolist() for w in loaded.windows if len(w) == 512]


def _prefill(model_file: pathlib.Path, windows: list[list[int]], kv: int, head: int) -> None:
    """A plain onnxruntime prefill of the whole model: every output fetched."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(model_file), options, providers=["CPUExecutionProvider"])
    pasts = {
        i.name: np.zeros((1, kv, 0, head), np.float32)
        for i in session.get_inputs()
        if i.name.startswith("past_key_values")
    }
    for window in windows:
        ids = np.asarray(window, np.int64)[None]
        session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids), **pasts})


@contextlib.contextmanager
def _whole_graph() -> Iterator[None]:
    """calibrate_kv_cache as before the caches-only run: the whole graph, a window a run."""
    real, per_run = calibration.KvCacheRunner, calibration.TOKENS_PER_RUN
    calibration.KvCacheRunner = lambda model, providers, caches_only, **more: real(model, providers, **more)  # type: ignore[assignment,misc]
    calibration.TOKENS_PER_RUN = 1
    try:
        yield
    finally:
        calibration.KvCacheRunner, calibration.TOKENS_PER_RUN = real, per_run  # type: ignore[misc]


def _ours(folder: pathlib.Path, windows: list[list[int]], method: str = "minmax") -> np.ndarray:
    scales = calibrate_kv_cache(
        folder,
        windows,
        format="int8",
        granularity="per_channel",
        method=method,
        seq_len=len(windows[0]),
        progress=False,
    )
    return np.asarray([[scales.k[i] for i in scales.layer_ids], [scales.v[i] for i in scales.layer_ids]])


def _ours_whole(folder: pathlib.Path, windows: list[list[int]], method: str = "minmax") -> np.ndarray:
    with _whole_graph():
        return _ours(folder, windows, method)


def _bar(seconds: float, longest: float, width: int = 32) -> str:
    filled = round(width * seconds / longest)
    return "#" * filled + "." * (width - filled)


def side_by_side(reps: int, real_model_cache: pathlib.Path | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="calibrate-bench-") as tmp:
        if real_model_cache is None:
            folder = save_genai_folder(pathlib.Path(tmp) / "qwen8", QWEN_8_LAYERS)
            ids = corpus_byte_ids()
            windows = [list(ids[i * WINDOW : (i + 1) * WINDOW]) for i in range(WINDOWS)]
            kv, head = QWEN_8_LAYERS.kv_num_heads, QWEN_8_LAYERS.head_size
        else:
            folder, windows = _real_model(real_model_cache)
            kv, head = 3, 64
        model_file = folder / "model.onnx"
        size = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
        genai_json = pathlib.Path(tmp) / "genai.json"
        runs: dict[str, Callable[[], object]] = {
            "onnx-kvcache calibrate_kv_cache": lambda: _ours(folder, windows),
            "  as before: whole graph, a window a run": lambda: _ours_whole(folder, windows),
            GENAI: lambda: _genai(model_file, windows, genai_json),
            PREFILL: lambda: _prefill(model_file, windows, kv, head),
        }
        for run in runs.values():  # warm-up: imports, the file in the page cache
            run()
        wall: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        for rep in range(reps):
            order = list(runs) if rep % 2 == 0 else list(reversed(runs))  # alternate, both ways
            for name in order:
                start, start_cpu = time.perf_counter(), time.process_time()
                runs[name]()
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
        model = (
            "Qwen2.5-0.5B-shaped decoder cut to 8 layers (hidden 896, 14/2 heads, head size 64, MLP 4864, "
            "vocab 32768, float32"
            if real_model_cache is None
            else "SmolLM2-135M-Instruct (benchmarks/real_model.py: 30 layers, hidden 576, 9/3 heads, head "
            "size 64, vocab 49152, float32"
        )
        print(
            f"Calibration side by side: {model}, {size:.0f} MiB), {len(windows)} windows x {len(windows[0])} "
            f"tokens, int8 per-channel minmax; from the model file to the result, session creation "
            f"included; medians of {reps} alternating repetitions; ratios: median of the per-repetition "
            "ratios; cpu: this process's CPU time, all threads (steadier than wall time on a loaded "
            f"machine); load average {os.getloadavg()[0]:.1f} at the end"
        )
        for label, times in (("wall", wall), ("cpu", cpu)):
            medians = {name: statistics.median(t) for name, t in times.items()}
            longest = max(medians.values())
            for name, t in times.items():
                genai = statistics.median(a / b for a, b in zip(t, times[GENAI]))
                prefill = statistics.median(a / b for a, b in zip(t, times[PREFILL]))
                print(
                    f"  {label:<4} {name:<40} {_bar(medians[name], longest)} {medians[name]:6.2f} s "
                    f"({min(t):.2f}-{max(t):.2f})  {genai:4.2f}x genai  {prefill:4.2f}x prefill"
                )
        ours = _ours(folder, windows)
        theirs = _genai(model_file, windows, genai_json)
        diff = float(np.max(np.abs(ours - theirs) / theirs))
        print(f"  scales, ours vs genai's (int8 per-channel minmax): largest relative difference {diff:.1e}")
        same = []
        for method in calibration.METHODS:
            pruned, whole = _ours(folder, windows, method), _ours_whole(folder, windows, method)
            same.append(f"{method} {'identical' if np.array_equal(pruned, whole) else 'DIFFERENT'}")
        print(f"  scales, calibrate_kv_cache vs as before (int8 per-channel): {', '.join(same)}")


def bundled_speed_and_envelope() -> None:
    model = build_decoder()
    tokens = len(builtin_corpus().encode("utf-8"))
    warm_up = [corpus_byte_ids()[:64]]  # imports, first session: not timed
    calibrate_kv_cache(model, warm_up, progress=False, min_tokens=0)
    for method in ("minmax", "percentile", "mse"):
        start, start_cpu = time.perf_counter(), time.process_time()
        calibrate_kv_cache(
            model, [corpus_byte_ids()], format="int8", method=method, seq_len=512, progress=False
        )
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        print(
            f"calibrate {method:<10} seq-len 512: {tokens / wall:8.0f} tokens/s "
            f"({tokens} tokens, {wall:.2f} s; {tokens / cpu:.0f} tokens per CPU second)"
        )
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")

    long_model = build_decoder(rope_theta=500000.0)
    short = [
        list(np.frombuffer(builtin_corpus().encode()[:2048], np.uint8)[i : i + 64])
        for i in range(0, 2048, 64)
    ]
    runner = KvCacheRunner(long_model, caches_only=True)  # K is read, not logits
    ids = np.frombuffer((builtin_corpus() * 2).encode()[:4096], np.uint8).astype(np.int64)
    runner.fill(ids)
    int8 = get_format("int8")
    print("int8 per-channel K scales from 64-token windows, K read over 4096 positions:")
    for envelope in (False, True):
        scales = calibrate_kv_cache(
            long_model,
            short,
            format="int8",
            granularity="per_channel",
            rope_envelope=envelope,
            progress=False,
        )
        clipped, late = [], []
        for layer in scales.layer_ids:
            k = runner.present(layer, "key")[0]  # [kv, T, hd]
            level = k * int8.reciprocal(scales.k[layer].reshape(k.shape[0], 1, k.shape[2]))
            beyond = (level > int8.qmax_stored + 0.5) | (level < int8.qmin_stored - 0.5)
            clipped.append(np.mean(beyond))
            late.append(np.mean(beyond[:, 2048:]))
        name = "envelope" if envelope else "raw K"
        print(
            f"  {name:<9} clipped: {np.mean(clipped):.3%} of all K values, "
            f"{np.mean(late):.3%} past position 2048"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions of the side by side")
    parser.add_argument("--side-by-side-only", action="store_true", help="skip the bundled decoder's figures")
    parser.add_argument(
        "--real-model",
        type=pathlib.Path,
        metavar="CACHE",
        help="side by side on SmolLM2-135M instead (built in CACHE by benchmarks/real_model.py; "
        "pip install gguf)",
    )
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    if not (args.side_by_side_only or args.real_model):
        bundled_speed_and_envelope()  # first: its peak RSS is the bundled decoder's
    side_by_side(args.reps, args.real_model)


if __name__ == "__main__":
    main()
