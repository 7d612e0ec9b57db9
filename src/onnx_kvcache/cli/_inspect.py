"""``onnx-kvcache inspect``: the KV cache of a model, per layer and per token (and at a
context); with ``--ep cuda``, whether CUDA's quantized decode fast path runs each layer. A
model without attention nodes (an export) shows the cache of a copy fused in memory and what
``convert`` would do; the file is never written.

Imports the standard library and the package's light modules at import time; the model's
readers and the tables are imported when the command runs.
"""

from __future__ import annotations

__all__ = ["run"]

import argparse
import json
from collections.abc import Callable
from typing import Any

from onnx_kvcache.cli._output import _print
from onnx_kvcache.model_io.genai_folder import resolve_model_path


def run(args: argparse.Namespace, words: Callable[[object], str]) -> int:
    """``inspect``: the cache table (or JSON), and the fast path's verdict per layer for cuda."""
    from onnx_kvcache.cache.layout import format_cache_table, inspect_kv_cache
    from onnx_kvcache.capabilities.table import fast_path_diagnostics
    from onnx_kvcache.model_io.genai_folder import share_buffer
    from onnx_kvcache.model_io.reading import load_model

    model = load_model(args.model)
    info = inspect_kv_cache(model)
    _, config = resolve_model_path(args.model)
    kernel = any(layer.storage == "auto" for layer in info.layers)  # else a preview: nothing fused yet
    if not kernel and not args.json:
        return _inspect_preview(args, model, config, words)
    cuda = args.ep == "cuda" and kernel  # an export's fast path: once converted
    diagnostics = fast_path_diagnostics(model, share_buffer=share_buffer(config)) if cuda else None
    if args.json:
        doc = info.to_json(args.context, args.batch or 1)
        if not kernel:
            doc = _preview_json(args, model, config, words)
        else:
            doc["cost"] = _cost_lines(args, model, info, config, words)
        if diagnostics is not None:
            doc["fast_path"] = [
                {"node": d.node, "layer_id": d.layer_id, "eligible": d.eligible, "reasons": list(d.reasons)}
                for d in diagnostics
            ]
        _print(json.dumps(doc, indent=2))
        return 0
    _print(format_cache_table(info, args.context, args.batch or 1))
    for line in _cost_lines(args, model, info, config, words):
        _print(line)
    if diagnostics is not None:
        _print("CUDA quantized decode fast path (XQA):")
        for d in diagnostics:
            verdict = "eligible" if d.eligible else "not eligible: " + "; ".join(map(words, d.reasons))
            _print(f"  layer {d.layer_id}: {verdict}")
    return 0


def _cost_lines(
    args: argparse.Namespace, model: Any, info: Any, config: Any, words: Callable[[object], str]
) -> list[str]:
    """What the cache costs at the model's context and in time: for a float cache, what
    ``convert`` would make of it; for a quantized one, its own."""
    from onnx_kvcache.capabilities.table import get_capabilities, infer_target
    from onnx_kvcache.model_io import format_bytes
    from onnx_kvcache.passes import PromptFloatAttentionPass
    from onnx_kvcache.pipeline.preview import preview_conversion, speed_line
    from onnx_kvcache.runtime import max_positions

    if info.layers and _own(model):  # static buffers or an export's own caches: storage-quantized
        return _storage_lines(preview_conversion(model, args.ep, config).storage, words)
    context = max_positions(model) or 0
    at = f"at the model's context ({context} tokens), batch 1" if context else None
    before, now = info.bytes_per_token, format_bytes(info.cache_bytes(context), "MiB")
    if any(layer.k_quant_type != "NONE" for layer in info.layers):
        target = args.ep or infer_target(model, config)[0]
        fmt = _format_of(model)
        wrapped = any(layer.prompt_in_float for layer in info.layers)
        lines = [f"cache {at}: {now}"] if at and args.context is None else []
        line = speed_line(target, fmt, wrapped, info.original_bytes_per_token / before)
        if line and not wrapped and PromptFloatAttentionPass.wrappable(model):
            line += f"; converting it again for {target} routes the prompt through the float kernel"
        return lines + ([line] if line else [])
    preview = preview_conversion(model, args.ep, config)
    lines = [_preview_line(preview, words)]
    after = preview.bytes_per_token_after
    if after and at:
        lines.append(f"cache {at}: {now} now, {format_bytes(after * context, 'MiB')} converted")
    support = get_capabilities(preview.target).formats.get(preview.format or "") if preview.target else None
    line = speed_line(
        preview.target, preview.format, bool(support and support.prompt_in_float), before / (after or before)
    )
    return lines + ([line] if line and after else [])


def _own(model: Any) -> bool:
    """No attention node of ours reads the model's caches (its I/O names them)."""
    from onnx_kvcache.cache.sites import find_attention_sites

    return not find_attention_sites(model)


def _format_of(model: Any) -> str | None:
    from onnx_kvcache.cache.sites import find_attention_sites

    fmt = next((s.cache_format for s in find_attention_sites(model) if s.cache_format), None)
    return fmt.name if fmt is not None else None


def _preview_json(
    args: argparse.Namespace, model: Any, config: Any, words: Callable[[object], str]
) -> dict[str, Any]:
    """``inspect --json`` of a model without attention nodes: its fused copy's cache and what
    ``convert`` would do (``preview``)."""
    from onnx_kvcache.cache.layout import inspect_kv_cache
    from onnx_kvcache.pipeline.preview import preview_conversion

    preview = preview_conversion(model, args.ep, config)
    cache = preview.cache if preview.cache.layers else inspect_kv_cache(model, exported=True)  # MLA's own
    return cache.to_json(args.context, args.batch or 1) | {"preview": preview.to_json(words)}


def _inspect_preview(
    args: argparse.Namespace, model: Any, config: Any, words: Callable[[object], str]
) -> int:
    """``inspect`` of a model without attention nodes (an export): the cache of a copy fused in
    memory, and what ``convert`` would do (the file is never written)."""
    from onnx_kvcache.cache.layout import format_cache_table, inspect_kv_cache
    from onnx_kvcache.pipeline.preview import preview_conversion

    preview = preview_conversion(model, args.ep, config)
    if not any(layer.storage == "auto" for layer in preview.cache.layers):
        from onnx_kvcache.cache.storage import stored_format

        exported = inspect_kv_cache(model, exported=True)  # an export's own caches (MLA)
        if exported.layers:
            _print(format_cache_table(exported, args.context, args.batch or 1))
        else:
            _print("no GroupQueryAttention or PagedAttention node with a KV cache")
        if preview.refusal is not None and stored_format(model) is None:  # stored: nothing to refuse
            _print(f"convert would refuse: {words(preview.refusal)}")
        for line in _storage_lines(preview.storage, words):
            _print(line)
        return 0
    _print(
        f"no GroupQueryAttention node yet: convert fuses {preview.fused} attention layer(s) into "
        "GroupQueryAttention; the cache below is that of a copy fused in memory (the file is unchanged)"
    )
    _print(format_cache_table(preview.cache, args.context, args.batch or 1))
    _print(_preview_line(preview, words))
    return 0


def _preview_line(preview: Any, words: Callable[[object], str]) -> str:
    """What ``convert`` would do: the target, format and bytes per token, or its refusal."""
    source = (
        "--ep" if preview.target_source == "given" else f"assumed: {preview.target_source}; --ep to choose"
    )
    where = f"{preview.target} ({source})" if preview.target else "no target"  # as convert says it
    if preview.refusal is not None:
        return f"convert for {where} would refuse: {words(preview.refusal)}"
    before, after = preview.cache.bytes_per_token, preview.bytes_per_token_after
    ratio = f", {before / after:.2f}x smaller" if after else ""
    half = "; the attention computes in float16" if preview.float16_attention else ""
    return (
        f"convert for {where}: {preview.format} {preview.granularity}, cache bytes per token "
        f"{after:g} (now {before:g}{ratio}){half}"
    )


def _storage_lines(storage: Any, words: Callable[[object], str]) -> list[str]:
    """The caches ``convert --storage qdq`` keeps (QuantizeLinear/DequantizeLinear around the
    model's own attention): stored already, in which format, or their bytes per token once stored
    (or that storage's refusal for the target)."""
    if storage is None:
        return []
    now, fmt, after = storage.bytes_per_token, storage.stored, storage.bytes_per_token_after
    per_token = f"cache bytes per token {now:g}" if now is not None else "cache bytes per token unknown"
    if fmt is not None:
        return [
            f"{storage.caches} cache(s) stored {fmt} through QuantizeLinear/DequantizeLinear; {per_token}"
        ]
    head = f"{storage.caches} cache(s) that --storage qdq stores around the model's attention: {per_token}"
    if storage.refusal is not None:
        return [f"{head}; convert --storage qdq would refuse: {words(storage.refusal)}"]
    smaller = f" now, {after:g} as {storage.format} ({now / after:.2f}x smaller)" if now and after else ""
    return [head + smaller]
