"""The real producers' files (``tests/data/producers/``): what each is expected to become, how
that is found, and the support table of docs/exporting.md made from it.

:data:`EXPECTED` has one row per file of ``tests/data/producers/manifest.json``: ``converts``
(every layer fuses, and the model computes as the export does; test_producers.py checks it),
or the one line that refuses it. test_producers.py fails when a file's outcome is not its row,
when a file has no row or a row no file; :func:`render_support_table` makes the table from the
manifest and these rows (``python docs/render.py`` writes it into docs/exporting.md).
"""

# ruff: noqa: E501  (one row per file, each reason on one line)
from __future__ import annotations

import json
import pathlib
import warnings
from typing import Any

ROOT = pathlib.Path(__file__).parents[3]
FOLDER = ROOT / "tests" / "data" / "producers"
MANIFEST = FOLDER / "manifest.json"
CONVERTS = "converts"

#: One row per file (its manifest path): ``converts`` or the refusal's one line.
EXPECTED: dict[str, str] = {
    "genai-builder/genai-builder-cpu-fp32/gemma2": CONVERTS,
    "genai-builder/genai-builder-cpu-fp32/gpt_oss": CONVERTS,
    "genai-builder/genai-builder-cpu-fp32/granite": CONVERTS,
    "genai-builder/genai-builder-cpu-fp32/llama": CONVERTS,
    "genai-builder/genai-builder-cpu-fp32/llama_rope_llama3": CONVERTS,
    "genai-builder/genai-builder-cpu-fp32/mistral": CONVERTS,
    "genai-builder/genai-builder-cpu-fp32/phi3": CONVERTS,
    "genai-builder/genai-builder-cpu-fp32/qwen2": CONVERTS,
    "genai-builder/genai-builder-cpu-fp32/qwen3": CONVERTS,
    "mobius/mobius-cpu-gqa/llama": CONVERTS,
    "mobius/mobius-cpu-gqa/mistral": CONVERTS,
    "mobius/mobius-cpu-gqa/phi3": CONVERTS,
    "mobius/mobius-cpu-gqa/qwen3": CONVERTS,
    "mobius/mobius-cuda-f16/granite": CONVERTS,
    "mobius/mobius-cuda-f16/llama": CONVERTS,
    "mobius/mobius-cuda-f16/phi3": CONVERTS,
    "mobius/mobius-cuda-f16/qwen3": CONVERTS,
    "mobius/mobius-default/cohere": CONVERTS,
    "mobius/mobius-default/gemma3": CONVERTS,
    "mobius/mobius-default/gpt_oss": CONVERTS,
    "mobius/mobius-default/granite": CONVERTS,
    "mobius/mobius-default/llama": CONVERTS,
    "mobius/mobius-default/mistral": CONVERTS,
    "mobius/mobius-default/olmo2": CONVERTS,
    "mobius/mobius-default/phi3": CONVERTS,
    "mobius/mobius-default/qwen2": CONVERTS,
    "mobius/mobius-default/qwen3": CONVERTS,
    "mobius/mobius-default/qwen3_moe": CONVERTS,
    "mobius/mobius-default/smollm3": CONVERTS,
    "mobius/mobius-default/starcoder2": CONVERTS,
    "mobius/mobius-ort-genai/gemma3": CONVERTS,
    "mobius/mobius-ort-genai/llama": CONVERTS,
    "mobius/mobius-ort-genai/qwen2": CONVERTS,
    "mobius/mobius-ort-genai/qwen3": CONVERTS,
    "mobius/mobius-static/llama": (
        "attention fusion fused nothing: 2 attention node(s) not provably GroupQueryAttention with a KV cache: static cache written by TensorScatter at write_indices: attention reads the whole fixed buffer key_cache.0 [batch, 64, 32], each row's length in nonpad_kv_seqlen; GroupQueryAttention keeps its cache as [batch, kv_heads, length, head_size] with past and present as separate inputs and outputs, so fusing would change the model's cache interface (export with a growing cache: mobius without --features static-cache) (2; first model/layers.0/self_attn/Attention_node_14); nothing to convert (-v lists each node). Its caches can be stored quantized around its own attention: storage='qdq'."
    ),
    "mobius/mobius-static/mistral": (
        "attention fusion fused nothing: 2 attention node(s) not provably GroupQueryAttention with a KV cache: static cache written by TensorScatter at write_indices: attention reads the whole fixed buffer key_cache.0 [batch, 64, 32], each row's length in nonpad_kv_seqlen; GroupQueryAttention keeps its cache as [batch, kv_heads, length, head_size] with past and present as separate inputs and outputs, so fusing would change the model's cache interface (export with a growing cache: mobius without --features static-cache) (2; first model/layers.0/self_attn/Attention_node_14); nothing to convert (-v lists each node). Its caches can be stored quantized around its own attention: storage='qdq'."
    ),
    "mobius/mobius-static/phi3": (
        "attention fusion fused nothing: 2 attention node(s) not provably GroupQueryAttention with a KV cache: static cache written by TensorScatter at write_indices: attention reads the whole fixed buffer key_cache.0 [batch, 64, 32], each row's length in nonpad_kv_seqlen; GroupQueryAttention keeps its cache as [batch, kv_heads, length, head_size] with past and present as separate inputs and outputs, so fusing would change the model's cache interface (export with a growing cache: mobius without --features static-cache) (2; first model/layers.0/self_attn/Attention_node_14); nothing to convert (-v lists each node). Its caches can be stored quantized around its own attention: storage='qdq'."
    ),
    "mobius/mobius-static/qwen2": (
        "attention fusion fused nothing: 2 attention node(s) not provably GroupQueryAttention with a KV cache: static cache written by TensorScatter at write_indices: attention reads the whole fixed buffer key_cache.0 [batch, 64, 32], each row's length in nonpad_kv_seqlen; GroupQueryAttention keeps its cache as [batch, kv_heads, length, head_size] with past and present as separate inputs and outputs, so fusing would change the model's cache interface (export with a growing cache: mobius without --features static-cache) (2; first model/layers.0/self_attn/Attention_node_17); nothing to convert (-v lists each node). Its caches can be stored quantized around its own attention: storage='qdq'."
    ),
    "mobius/mobius-static/qwen3": (
        "attention fusion fused nothing: 2 attention node(s) not provably GroupQueryAttention with a KV cache: static cache written by TensorScatter at write_indices: attention reads the whole fixed buffer key_cache.0 [batch, 64, 32], each row's length in nonpad_kv_seqlen; GroupQueryAttention keeps its cache as [batch, kv_heads, length, head_size] with past and present as separate inputs and outputs, so fusing would change the model's cache interface (export with a growing cache: mobius without --features static-cache) (2; first model/layers.0/self_attn/Attention_node_20); nothing to convert (-v lists each node). Its caches can be stored quantized around its own attention: storage='qdq'."
    ),
    "optimum/optimum-cli/cohere": (CONVERTS),
    "optimum/optimum-cli/deepseek_v3": (
        "attention fusion fused nothing: 2 attention node(s) not provably GroupQueryAttention with a KV cache: keys of head size 32 and values of head size 16: multi-head latent attention (MLA, as DeepSeek-V2/V3 write it) or another attention whose K and V widths differ, which GroupQueryAttention (one head size) does not compute (2; first /model/layers.0/self_attn/MatMul_1); nothing to convert (-v lists each node). Its caches can be stored quantized around its own attention: storage='qdq'."
    ),
    "optimum/optimum-cli/gemma2": CONVERTS,
    "optimum/optimum-cli/gemma3": CONVERTS,
    "optimum/optimum-cli/gptj": CONVERTS,
    "optimum/optimum-cli/gpt_oss": (CONVERTS),
    "optimum/optimum-cli/helium": (CONVERTS),
    "optimum/optimum-cli/llama": CONVERTS,
    "optimum/optimum-cli/mistral": CONVERTS,
    "optimum/optimum-cli/olmo2": CONVERTS,
    "optimum/optimum-cli/phi3": CONVERTS,
    "optimum/optimum-cli/qwen2": CONVERTS,
    "optimum/optimum-cli/qwen3": CONVERTS,
    "optimum/optimum-cli/qwen3_moe": (CONVERTS),
    "optimum/optimum-cli/smollm3": CONVERTS,
    "optimum/optimum-cli/stablelm": (CONVERTS),
    "torch-tf4.57/dynamo-opset18-nooptimize/llama": CONVERTS,
    "torch-tf4.57/dynamo-opset18-optimize-f16/llama": CONVERTS,
    "torch-tf4.57/dynamo-opset18-optimize/jetmoe": CONVERTS,
    "torch-tf4.57/dynamo-opset18-optimize/llama": CONVERTS,
    "torch-tf4.57/dynamo-opset18-optimize/qwen3": CONVERTS,
    "torch-tf4.57/dynamo-opset20-optimize/llama": CONVERTS,
    "torch-tf4.57/dynamo-opset23-optimize/gemma2": CONVERTS,
    "torch-tf4.57/dynamo-opset23-optimize/jetmoe": CONVERTS,
    "torch-tf4.57/dynamo-opset23-optimize/llama": CONVERTS,
    "torch-tf4.57/dynamo-opset23-optimize/qwen3": CONVERTS,
    "torch-tf4.57/dynamo-opset23-optimize/stablelm": (CONVERTS),
    "torch-tf4.57/torchscript-opset18/gemma2": CONVERTS,
    "torch-tf4.57/torchscript-opset18/gptj": CONVERTS,
    "torch-tf4.57/torchscript-opset18/llama": CONVERTS,
    "torch-tf4.57/torchscript-opset18/phi3": CONVERTS,
    "torch-tf4.57/torchscript-opset18/starcoder2": (CONVERTS),
    "torch-tf5/dynamo-opset18-optimize/llama": CONVERTS,
    "torch-tf5/dynamo-opset23-nooptimize/llama": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize-f16-eager/gptj": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize-f16/llama": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize-rollingcache/cohere2": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize-rollingcache/gemma2": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize-rollingcache/mistral": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize-rollingcache/qwen2_window": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/cohere2": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/deepseek_v3": (
        "attention fusion fused nothing: 2 attention node(s) not provably GroupQueryAttention with a KV cache: keys of head size 32 and values of head size 16: multi-head latent attention (MLA, as DeepSeek-V2/V3 write it) or another attention whose K and V widths differ, which GroupQueryAttention (one head size) does not compute (2; first node_scaled_dot_product_attention); nothing to convert (-v lists each node). Its caches can be stored quantized around its own attention: storage='qdq'."
    ),
    "torch-tf5/dynamo-opset23-optimize/gemma2": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/gemma3": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/gpt_oss": (CONVERTS),
    "torch-tf5/dynamo-opset23-optimize/llama": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/llama_rope_llama3": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/mistral": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/olmo2": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/phi3": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/phi3_longrope": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/qwen2_rope_yarn": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/qwen2_window": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/qwen3": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/qwen3_moe": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/smollm3": CONVERTS,
    "torch-tf5/dynamo-opset23-optimize/starcoder2": CONVERTS,
    "torch-tf5/torchscript-opset18/gptj": CONVERTS,
    "torch-tf5/torchscript-opset18/llama": CONVERTS,
    "torch2.15-tf5.25/dynamo-opset23-optimize-rollingcache/gemma2": CONVERTS,
    "torch2.15-tf5.25/dynamo-opset23-optimize/gemma2": CONVERTS,
    "torch2.15-tf5.25/dynamo-opset23-optimize/gemma3": CONVERTS,
    "torch2.15-tf5.25/dynamo-opset23-optimize/gpt_oss": (CONVERTS),
    "torch2.15-tf5.25/dynamo-opset23-optimize/llama": CONVERTS,
    "torch2.15-tf5.25/torchscript-opset18/llama": CONVERTS,
}


def entries() -> list[dict[str, Any]]:
    """The manifest's models (none when the folder is missing: test_producers.py says so)."""
    if not MANIFEST.exists():
        return []
    models = json.loads(MANIFEST.read_text(encoding="utf-8"))["models"]
    return [m for m in models if _graph_name(m)]  # an export that failed wrote no graph


def _graph_name(entry: dict[str, Any]) -> str | None:
    names = sorted(n for n in entry.get("files", {}) if n.endswith(".onnx"))
    return "model.onnx" if "model.onnx" in names else (names[0] if names else None)


def model_path(entry: dict[str, Any]) -> pathlib.Path:
    return FOLDER / entry["path"] / str(_graph_name(entry))


def outcome(entry: dict[str, Any]) -> tuple[str, Any]:
    """``(converts or the refusal's line, the decision)`` of converting the file to int8 for
    onnxruntime's CPU (fp16 files: for CUDA, fp8): fusion, then every cache converted."""
    from onnx_kvcache.model_io.reading import load_model
    from onnx_kvcache.pipeline.decision import Entry, Request, decide

    model = load_model(model_path(entry))
    fp16 = any(v.dtype is not None and v.dtype.name == "FLOAT16" for v in model.graph.inputs)
    target, fmt = ("cuda", "fp8") if fp16 else ("cpu", "int8")
    layers = entry["config"]["layers"]
    scales = {i: (0.05, 0.05) for i in range(layers)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decision = decide(Request(model, Entry.CONVERT, fmt, scales=_scales(scales), target=target))
    if decision.refusals:
        return " ".join(str(r) for r in decision.refusals), decision
    return CONVERTS, decision


def _scales(scales: dict[int, tuple[float, float]]) -> Any:
    from onnx_kvcache.scales.files import as_kv_cache_scales

    return as_kv_cache_scales(scales)


def _version(entry: dict[str, Any]) -> str:
    producer = entry["producer"]
    version = entry.get("producer_version", "")
    if producer == "torch.onnx.export" and entry.get("transformers"):
        return f"torch {version}, transformers {entry['transformers']}"
    if entry.get("transformers"):
        return f"{version} (transformers {entry['transformers']})"
    return str(version)


def render_support_table(models: list[dict[str, Any]] | None = None) -> str:
    """The Markdown support table: producer, version, form, family, and converts or why not."""
    rows = ["| producer | version | form | family | converts |", "|---|---|---|---|---|"]
    for entry in sorted(models if models is not None else entries(), key=_order):
        result = EXPECTED.get(entry["path"], "no expectation recorded")
        cell = "yes" if result == CONVERTS else f"no: {result}"
        cell = cell.replace("|", "\\|")
        rows.append(
            f"| {entry['producer']} | {_version(entry)} | {entry['form']} | {entry['family']} | {cell} |"
        )
    return "\n".join(rows)


def _order(entry: dict[str, Any]) -> tuple[str, str, str, str]:
    return entry["producer"], _version(entry), entry["form"], entry["family"]


if __name__ == "__main__":  # each file's outcome now, to update EXPECTED (run with the source on the path)
    for _entry in entries():
        print(f"{_entry['path']!r}: {outcome(_entry)[0]!r},")
