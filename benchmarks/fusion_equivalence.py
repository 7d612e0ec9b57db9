"""How exactly fused exports match their originals, per architecture shape and padding.

    python benchmarks/fusion_equivalence.py [--torchscript | --cached-attention [MODEL ...]]

``--torchscript`` prints only the TorchScript (optimum / onnx-community) forms instead:
tests/data/optimum_llama and the builder's ``optimum-*`` presets (2 layers, window 64),
for one sequence, a left-padded batch of two, and a 70-token prefill (longer than the
window) with three decode steps.

``--cached-attention`` prints only the ONNX ``Attention`` holding its own cache:
tests/data/mobius_llama_default (or the MODEL files given, e.g. other mobius default
builds), for one sequence, a batch of two right- and left-padded, then the logits of an
int8 cache (onnxruntime CPU) and an fp8 cache (the CUDA rule, emulated) against the fused
float model, scales calibrated on 256 random token ids.

For the torch export in tests/data and the exported builder's shapes (opset 23, and
opset 20 decomposed), runs the original and the fused model over a 7-token prefill and
three decode steps (onnxruntime CPU, float32) and prints the largest absolute difference
of the logits (valid positions) and of the present caches (valid tokens; GQA keeps a row's
valid tokens compacted at its start) for: one sequence, a batch of two with the second
right-padded, and the same left-padded. Then the logits of int8/int4 caches (scales
calibrated on 256 random token ids, as the tests do) against the fused float model. Last,
what the padding reorder (each row's valid tokens first, see docs/exporting.md) costs a
decode step: the kernel time of its nodes in onnxruntime's profile of an 8-layer decoder with
a 512-token cache, one thread, 200 steps. Reuses the tests' runner
(tests/decoding.py).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
import warnings

import numpy as np
import onnx_ir as ir

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from decoding import PROMPTS, generate, max_differences  # noqa: E402
from onnx_kvcache import KvCacheRunner, calibrate_kv_cache, optimize_model  # noqa: E402
from onnx_kvcache.passes.fusion.gqa_fusion import GqaFusionPass  # noqa: E402

from builders.exported import (  # noqa: E402
    ExportStyle,
    build_decoder,
    exported_config,
)

FIXTURE = ROOT / "tests" / "data" / "export_llama_opset23.onnx"


def decode_difference(want: KvCacheRunner, got: KvCacheRunner, ids) -> tuple[float, float]:
    """Largest logit difference over a prefill's last position and three decode steps, and
    that as a share of the largest logit of ``want``."""
    a, b = [want.prefill(ids)[0, -1]], [got.prefill(ids)[0, -1]]
    for token in (5, 17, 99):
        a.append(want.step(token)[0])
        b.append(got.step(token)[0])
    diff = float(np.abs(np.stack(a) - np.stack(b)).max())
    return diff, diff / float(np.abs(np.stack(a)).max())


def shapes() -> dict:
    def built(arch: str, **style):
        return lambda: build_decoder(
            exported_config(arch, num_layers=2, vocab_size=300, exported=ExportStyle(**style))
            if style
            else exported_config(arch, num_layers=2, vocab_size=300)
        )

    out = {"torch export (tests/data)": lambda: ir.load(FIXTURE)}
    for arch in ("llama", "qwen3", "mistral", "gemma2"):
        out[arch] = built(arch)
    out["llama, grouped K/V"] = built("llama", kv_repeat="grouped")
    out["llama, attention probs read"] = built("llama", qk_matmul_output=3)
    for arch in ("llama", "qwen3", "mistral"):
        out[f"{arch}, opset 20"] = built(arch, opset=20)
    return out


def torchscript() -> None:
    prompts = {
        "single": PROMPTS["single"],
        "left_padded": PROMPTS["left_padded"],
        "70 tokens": np.ones((1, 70), np.int64),
    }
    makes = {
        "optimum export (tests/data)": lambda: ir.load(
            ROOT / "tests" / "data" / "optimum_llama" / "model.onnx"
        )
    }
    for name in ("llama", "qwen2", "mistral", "phi3", "gemma2", "llama-q4", "llama-quantized"):
        config = exported_config(f"optimum-{name}", num_layers=2, vocab_size=300, sliding_window=64)
        makes[name] = lambda config=config: build_decoder(config)
    print("| TorchScript form | prompt | logits | presents |")
    print("|---|---|---|---|")
    for name, make in makes.items():
        for prompt, mask in prompts.items():
            original, fused = make(), make()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                GqaFusionPass()(fused)
            worst = max_differences(generate(original, mask), generate(fused, mask))
            print(f"| {name} | {prompt} | {worst['logits']:.1e} | {worst['present']:.1e} |")


def cached_attention(paths: list[str]) -> None:
    files = [pathlib.Path(p) for p in paths] or [
        ROOT / "tests" / "data" / "mobius_llama_default" / "model.onnx"
    ]
    print("| model | prompt | logits | presents |")
    print("|---|---|---|---|")
    for path in files:
        path = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
        fused = ir.load(ROOT / path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = GqaFusionPass()(fused).report
        if report.refusals:
            print(f"| {path} | refused | {report.refused[0]} | |")
            continue
        for prompt in ("single", "right_padded", "left_padded"):
            worst = max_differences(
                generate(ir.load(ROOT / path), PROMPTS[prompt]), generate(fused, PROMPTS[prompt])
            )
            print(f"| {path} | {prompt} | {worst['logits']:.1e} | {worst['present']:.1e} |")
        vocab = next(v for v in fused.graph.outputs if v.name == "logits").shape[-1]
        calibration = [list(np.random.default_rng(7).integers(0, vocab, 128)) for _ in range(2)]
        ids = np.random.default_rng(1).integers(0, vocab, 7)
        for fmt, target in (("int8", "cpu"), ("fp8", None)):
            scales = calibrate_kv_cache(fused, calibration, format=fmt, seq_len=128, progress=False)
            model = ir.load(ROOT / path)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                optimize_model(model, ep=target, format=fmt, scales=scales)
            want, got = KvCacheRunner(fused), KvCacheRunner(model, semantics="cuda" if fmt == "fp8" else None)
            diff, rel = decode_difference(want, got, ids)
            print(f"| {path} | {fmt} ({got.kernel_rule}) vs float | {diff:.2e} | {rel:.1%} of max |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchscript", action="store_true", help="only the TorchScript (optimum) forms")
    parser.add_argument(
        "--cached-attention", nargs="*", metavar="MODEL", help="only ONNX Attention with a cache"
    )
    args = parser.parse_args()
    if args.torchscript:
        torchscript()
        return
    if args.cached_attention is not None:
        cached_attention(args.cached_attention)
        return
    print("| shape | prompt | logits | presents |")
    print("|---|---|---|---|")
    for name, make in shapes().items():
        for prompt in ("single", "right_padded", "left_padded"):
            original, fused = make(), make()
            GqaFusionPass()(fused)
            worst = max_differences(generate(original, PROMPTS[prompt]), generate(fused, PROMPTS[prompt]))
            print(f"| {name} | {prompt} | {worst['logits']:.1e} | {worst['present']:.1e} |")

    float_gqa = ir.load(FIXTURE)
    GqaFusionPass()(float_gqa)
    ids = np.random.default_rng(1).integers(0, 512, 12)
    calibration = [list(np.random.default_rng(7).integers(0, 300, 128)) for _ in range(2)]  # 256 token ids
    print("\n| cache | granularity | max abs logit difference vs float (prefill + 3 steps) | relative |")
    print("|---|---|---|---|")
    for fmt in ("int8", "int4"):
        for granularity in ("per_tensor", "per_channel"):
            start = time.perf_counter()
            scales = calibrate_kv_cache(
                float_gqa, calibration, format=fmt, granularity=granularity, seq_len=128, progress=False
            )
            model = optimize_model(
                ir.load(FIXTURE),
                ep="cpu",
                format=fmt,
                granularity=granularity,
                scales=scales,
            )
            want, got = KvCacheRunner(float_gqa), KvCacheRunner(model)
            diff, rel = decode_difference(want, got, ids)
            print(f"| {fmt} | {granularity} | {diff:.2e} | {rel:.1%} | ({time.perf_counter() - start:.1f} s)")
    reorder_cost()


def reorder_cost(layers: int = 8, context: int = 512, steps: int = 200) -> None:
    """The padding reorder's own kernel time in a decode step, from onnxruntime's profile."""
    import json
    import tempfile

    import onnxruntime as ort

    config = exported_config(
        "llama", num_layers=layers, vocab_size=1000, hidden_size=512, num_heads=8, kv_num_heads=2,
        head_size=64, intermediate_size=1408,
    )  # fmt: skip
    model = build_decoder(config)
    GqaFusionPass()(model)
    feeds = {
        "input_ids": np.zeros((1, 1), np.int64),
        "attention_mask": np.ones((1, context + 1), np.int64),
        "position_ids": np.array([[context]]),
    } | {
        v.name: np.zeros((1, v.shape[1], context, v.shape[3]), np.float32)
        for v in model.graph.inputs
        if v.name.startswith("past")
    }
    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.enable_profiling = True
        options.profile_file_prefix = str(pathlib.Path(folder) / "profile")
        proto = ir.to_proto(model).SerializeToString()
        session = ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
        for _ in range(steps):
            session.run(None, feeds)
        events = json.loads(pathlib.Path(session.end_profiling()).read_text())
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    total = sum(e["dur"] for e in kernels) / steps
    reorder = sum(e["dur"] for e in kernels if "padding_order" in e["name"]) / steps
    print(
        f"\npadding reorder, {layers}-layer 512-wide decoder, {context}-token cache, one thread: "
        f"{reorder:.0f} us of a {total:.0f} us decode step ({reorder / total:.1%}; "
        f"{reorder / layers:.0f} us a layer), onnxruntime's kernel times"
    )


if __name__ == "__main__":
    main()
