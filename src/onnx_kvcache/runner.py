"""Run a decoder with its KV cache: prefill, decode steps, greedy generation.

:class:`KvCacheRunner` discovers the decoder's I/O (onnxruntime-genai names and common
variants), allocates empty caches of the model's cache dtype and shape (int4 packed,
fp8 as its bits, sliding-window layers window-sized) and feeds each step's present
caches back as the next step's past. An fp8 cache on CPU runs through emulation.
"""

from __future__ import annotations

__all__ = ["CacheBinding", "KvCacheRunner", "discover_cache_bindings"]

import dataclasses
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.gqa import find_gqa_sites, resident_rows
from onnx_kvcache.runtime import create_session, to_ort_value

logger = logging.getLogger(__name__)

_PAST = re.compile(r"^(past|cache|kv_cache|past_key_values)", re.IGNORECASE)
_KIND = re.compile(r"(?:^|[._\-])(key|value|k|v)(?:[._\-]|$)|(key|value)", re.IGNORECASE)


def _cache_kind(name: str) -> str | None:
    match = _KIND.search(name.split("/")[-1])
    if not match:
        return None
    word = (match.group(1) or match.group(2)).lower()
    return "key" if word in ("key", "k") else "value"


@dataclasses.dataclass(frozen=True)
class CacheBinding:
    """One cache tensor: its past input, present output, layout and dtype."""

    layer_id: int
    kind: str
    past: str
    present: str
    dtype: ir.DataType
    kv_num_heads: int
    last_dim: int
    capacity: int | None
    """Sequence capacity of a window-sized cache (sliding_window_cache=1), else None."""
    static_capacity: bool = False
    """The model fixes that capacity in the cache's shape (it cannot be enlarged)."""
    window: int | None = None
    """``local_window_size`` of a window-sized cache, else None."""

    def resident_rows(self, total: int, capacity: int) -> int:
        """Rows of this cache, ``capacity`` rows long, that hold tokens after ``total``."""
        return resident_rows(total, capacity, self.window)

    def empty(self, batch: int, min_capacity: int = 0) -> np.ndarray:
        length = self.capacity or 0
        if self.capacity and not self.static_capacity:
            length = max(length, min_capacity)
        shape = (batch, self.kv_num_heads, length, self.last_dim)
        if self.dtype == ir.DataType.FLOAT8E4M3FN:
            return np.zeros(shape, np.uint8)
        return np.zeros(shape, self.dtype.numpy())


def discover_cache_bindings(model: ir.Model) -> list[CacheBinding]:
    """Pair each past cache graph input with its present output, using the GQA nodes."""
    bindings: list[CacheBinding] = []
    inputs = {v.name for v in model.graph.inputs}
    outputs = {v.name for v in model.graph.outputs}
    for site in find_gqa_sites(model):
        capacity = None
        if site.int_attr("sliding_window_cache", 0) and site.int_attr("local_window_size", -1) > 0:
            capacity = site.int_attr("local_window_size", -1)
        pairs = (("key", site.past_key, site.present_key), ("value", site.past_value, site.present_value))
        for kind, past, present in pairs:
            if past is None or present is None or past.name not in inputs or present.name not in outputs:
                continue
            assert past.name is not None and present.name is not None and past.dtype is not None
            shape = past.shape
            static = False
            if capacity and shape is not None and len(shape) == 4 and isinstance(shape[2], int):
                capacity, static = shape[2], True
            last = shape[3] if shape is not None and len(shape) == 4 else None
            if not isinstance(last, int):
                head = site.head_size(cache_is_packed=past.dtype == ir.DataType.UINT8)
                last = (head + 1) // 2 if past.dtype == ir.DataType.UINT8 else head
            bindings.append(
                CacheBinding(
                    site.layer_id,
                    kind,
                    past.name,
                    present.name,
                    past.dtype,
                    site.kv_num_heads,
                    last,
                    capacity,
                    static,
                    site.int_attr("local_window_size", -1) if capacity else None,
                )
            )
    if not bindings:
        for value in model.graph.inputs:
            if _PAST.match(value.name or "") and _cache_kind(value.name or ""):
                raise KvCacheError(
                    f"Input {value.name!r} looks like a KV cache but no GroupQueryAttention "
                    "node reads it; the runner needs a GQA decoder. Fuse an exported model's "
                    "attention first: optimize_model(model) (docs/exporting.md)."
                )
    return bindings


def _fused(model: ir.Model) -> ir.Model:
    """A decoder read from disk without GQA nodes (a PyTorch export), fused in memory."""
    from onnx_kvcache.passes.gqa_fusion import GqaFusionPass

    if GqaFusionPass()(model).modified:
        logger.info("Fused the model's attention into GroupQueryAttention (in memory, file unchanged).")
    return model


class KvCacheRunner:
    """An onnxruntime session wrapper that owns the decoder's KV cache.

    Args:
        model_or_path: ``ir.Model``, ``.onnx`` file or onnxruntime-genai folder. A file
            without GroupQueryAttention (a PyTorch export) has its attention fused in
            memory (docs/exporting.md); the file is not changed.
        providers: onnxruntime providers (CPU by default).
        io_binding: Keep caches as OrtValues on the session's device and bind them
            (default: on for CUDA, where caches then never leave the GPU).
    """

    def __init__(
        self,
        model_or_path: ir.Model | str | os.PathLike,
        providers: Sequence[Any] | None = None,
        *,
        io_binding: bool | None = None,
    ) -> None:
        from onnx_kvcache.model_files import load_model, resolve_model_path

        base_dir = None
        self.eos_token_id: int | None = None
        """End-of-sequence token; read from genai_config.json for a genai folder."""
        if isinstance(model_or_path, ir.Model):
            model = model_or_path
        else:
            model_file, config = resolve_model_path(model_or_path)
            model = load_model(model_file)
            if not find_gqa_sites(model, with_cache_only=False):
                model = _fused(model)
            base_dir = model_file.parent
            eos = (config or {}).get("model", {}).get("eos_token_id")
            self.eos_token_id = eos[0] if isinstance(eos, list) and eos else eos
        self.providers = list(providers or ["CPUExecutionProvider"])
        self.source_model = model
        """The model as given (before any emulation rewrite)."""
        self.bindings = discover_cache_bindings(model)
        self.emulated = False
        on_cuda = any("CUDA" in str(p) for p in self.providers)
        if not on_cuda and any(s.query_dtype == ir.DataType.BFLOAT16 for s in find_gqa_sites(model)):
            raise KvCacheError(
                "A bfloat16 model does not run on onnxruntime's CPU provider (no bfloat16 MatMul). "
                "Run it on CUDA (providers=['CUDAExecutionProvider']), or use a float16 or float32 "
                "export of the same model on CPU."
            )
        if not on_cuda and any(b.dtype == ir.DataType.FLOAT8E4M3FN for b in self.bindings):
            from onnx_kvcache.passes.fp8_emulation import emulate_fp8_kv_cache

            logger.info("fp8 KV cache has no CPU kernel: running it through CPU emulation.")
            model = emulate_fp8_kv_cache(model)
            self.emulated = True
        self.model = model
        self.session = create_session(model, self.providers, base_dir)
        names = [i.name for i in self.session.get_inputs()]
        self.input_names = names
        ids_name = next((n for n in names if n in ("input_ids", "ids", "tokens")), None)
        if ids_name is None:
            raise KvCacheError(f"The decoder has no input_ids input (inputs: {names}).")
        self.ids_name: str = ids_name
        outputs = [o.name for o in self.session.get_outputs()]
        self.logits_name = next((n for n in outputs if "logits" in n), outputs[0])
        self.device = "cuda" if on_cuda else "cpu"
        self.io_binding = on_cuda if io_binding is None else io_binding
        self.reset()

    @property
    def cache_dtype(self) -> ir.DataType | None:
        return self.bindings[0].dtype if self.bindings else None

    def reset(self, batch: int = 1, *, min_capacity: int = 0) -> None:
        """Forget the context: empty caches for ``batch`` sequences.

        ``min_capacity`` enlarges window-sized caches (when the model's shape allows) so
        that ``min_capacity`` tokens stay resident: onnxruntime accepts any capacity at
        least the window, and calibration must see every row the kernel will quantize.
        """
        self.batch = batch
        self.length = 0
        self.caches: dict[str, Any] = {}
        for b in self.bindings:
            empty = b.empty(batch, min_capacity)
            if self.io_binding:
                self.caches[b.past] = to_ort_value(empty, b.dtype, self.device)
            else:
                self.caches[b.past] = empty

    def cache_nbytes(self) -> int:
        """Bytes held by the cache buffers."""
        total = 0
        for b in self.bindings:
            cache = self.caches[b.past]
            shape = cache.shape() if callable(getattr(cache, "shape", None)) else cache.shape
            total += int(np.prod(shape) * b.dtype.itemsize)
        return total

    def _inputs(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        batch, seq = ids.shape
        total = self.length + seq
        feeds: dict[str, np.ndarray] = {self.ids_name: ids.astype(np.int64)}
        if "attention_mask" in self.input_names:
            feeds["attention_mask"] = np.ones((batch, total), np.int64)
        if "position_ids" in self.input_names:
            feeds["position_ids"] = np.tile(np.arange(self.length, total, dtype=np.int64), (batch, 1))
        return feeds

    def _run_plain(self, ids: np.ndarray) -> np.ndarray:
        feeds: dict[str, Any] = self._inputs(ids)
        for b in self.bindings:
            cache = self.caches[b.past]
            fp8 = b.dtype == ir.DataType.FLOAT8E4M3FN
            feeds[b.past] = to_ort_value(cache, b.dtype) if fp8 else cache
        names = [self.logits_name] + [b.present for b in self.bindings]
        results = self.session.run(names, feeds)
        for b, present in zip(self.bindings, results[1:]):
            self.caches[b.past] = present
        return results[0]

    def _run_bound(self, ids: np.ndarray) -> np.ndarray:
        binding = self.session.io_binding()
        for name, array in self._inputs(ids).items():
            binding.bind_cpu_input(name, array)
        for b in self.bindings:
            binding.bind_ortvalue_input(b.past, self.caches[b.past])
        binding.bind_output(self.logits_name, "cpu")
        for b in self.bindings:
            binding.bind_output(b.present, self.device)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        for b, present in zip(self.bindings, outputs[1:]):
            self.caches[b.past] = present
        return outputs[0].numpy()

    def forward(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Run new tokens through the model; returns their float32 logits ``[B, S, V]``."""
        ids = np.asarray(ids, np.int64)
        if ids.ndim == 1:
            ids = ids[None, :]
        if ids.shape[0] != self.batch:
            self.reset(ids.shape[0])
        raw = self._run_bound(ids) if self.io_binding else self._run_plain(ids)
        self.length += ids.shape[1]
        logits = np.asarray(raw, np.float32)
        if not np.all(np.isfinite(logits)):
            raise KvCacheError("The model produced non-finite logits.")
        return logits

    def prefill(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Start a new context with ``ids``; returns their logits."""
        self.reset(np.asarray(ids).reshape(-1, np.asarray(ids).shape[-1]).shape[0])
        return self.forward(ids)

    def step(self, token: int | Sequence[int]) -> np.ndarray:
        """Append one token (per batch row); returns its logits ``[B, V]``."""
        ids = np.asarray(token, np.int64).reshape(-1, 1)
        return self.forward(ids)[:, -1]

    def generate(
        self, ids: Sequence[int], max_new_tokens: int, *, eos_token_id: int | None = -1
    ) -> list[int]:
        """Greedy decoding: up to ``max_new_tokens`` tokens after ``ids``.

        Stops after ``eos_token_id`` (default: the model's, when its genai config names
        one; ``None`` never stops early).
        """
        eos = self.eos_token_id if eos_token_id == -1 else eos_token_id
        logits = self.prefill(ids)[0, -1]
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(np.argmax(logits))
            out.append(token)
            if len(out) == max_new_tokens or token == eos:
                break
            logits = self.step(token)[0]
        return out

    def cache_array(self, past_name: str) -> np.ndarray:
        """A cache as a host numpy array (fp8 as its uint8 bits), wherever it lives."""
        cache = self.caches[past_name]
        return cache.numpy() if hasattr(cache, "numpy") and not isinstance(cache, np.ndarray) else cache

    def present(self, layer_id: int, kind: str) -> np.ndarray:
        """The current cache tensor of a layer (``kind`` is ``key`` or ``value``)."""
        for b in self.bindings:
            if b.layer_id == layer_id and b.kind == kind:
                return self.cache_array(b.past)
        raise KvCacheError(f"No {kind} cache for layer {layer_id}.")
