"""Translation validation of a fusion: the export and its fused model run side by side.

The fusion proves each layer equivalent for unpadded and left-padded rows (docs/exporting.md,
"What is proven"). :func:`verify_fusion` checks the proof on the model itself: onnxruntime's CPU
runs the export and the fused model (before any quantization) on the same inputs, and their
logits must agree at every valid position.

Rules:

* Cases: one row, a 7-token prompt then 3 one-token steps; two rows, the second left-padded by 3,
  the same. Token ids are seeded random ids below the vocabulary; ``attention_mask`` marks the
  valid tokens, ``position_ids`` (when an input) counts them; every past starts empty and is the
  model's own present afterwards (the export's and the fused model's each their own).
* Agreement: the largest absolute difference of the logits at valid positions is at most
  :data:`TOLERANCE` of the export's largest logit there (float32 computes both; the orders of
  summation differ). A position where the export's own logits are not finite is not compared
  (below opset 23 an export's softmax turns a fully masked row into NaN).
* Not verified, with the reason: by default a model whose weights exceed :data:`MAX_BYTES`
  (loading the weights twice is the cost), a float16 or bfloat16 model (no float16
  GroupQueryAttention kernel on the CPU), a window-sized cache (``sliding_window_cache=1``: its
  first past is not the export's empty one), an input other than ids, mask, positions and caches.
"""

from __future__ import annotations

__all__ = ["MAX_BYTES", "TOLERANCE", "Verification", "too_large", "verify_fusion"]

import dataclasses
import time
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.errors import KvCacheError, MissingRuntimeError
from onnx_kvcache.model_io import create_session, ort_error_text

#: Weights (bytes) up to which a fusion is verified by default: both models are loaded once each,
#: about 8 s and 1 GiB of memory more for 622 MiB of weights (``benchmarks/fusion_speed.py``: the
#: 7 s conversion of a SmolLM2-135M-shaped export took 11.5 s to 15.6 s verified).
MAX_BYTES = 2**30
#: The largest logit difference allowed, relative to the export's largest logit.
TOLERANCE = 1e-4
_PROMPT, _STEPS, _PAD = 7, 3, 3
_FEEDS = ("input_ids", "attention_mask", "position_ids")


@dataclasses.dataclass(frozen=True)
class Verification:
    """What :func:`verify_fusion` ran and found."""

    verified: bool
    error: float = 0.0
    """The largest logit difference at valid positions, relative to the export's largest logit."""
    cases: tuple[str, ...] = ()
    seconds: float = 0.0
    skipped: str = ""
    """Why it was not verified (empty when it was)."""

    @property
    def line(self) -> str:
        """What happened, in one line (for the log and the summary)."""
        if not self.verified:
            return f"fusion not verified: {self.skipped}"
        return (
            f"fusion verified: the export's and the fused model's logits agree within {self.error:.1e} "
            f"of the largest ({', '.join(self.cases)}; {self.seconds:.1f} s)"
        )


def _weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def too_large(model: ir.Model) -> Verification | None:
    """Not verified by default: weights over :data:`MAX_BYTES` (None: within them)."""
    weights = _weight_bytes(model)
    if weights <= MAX_BYTES:
        return None
    return Verification(
        False, skipped=f"{weights / 2**30:.1f} GiB of weights (by default up to {MAX_BYTES / 2**30:g} GiB)"
    )


def _why_not(original: ir.Model, fused: ir.Model, sites: list[CacheSite]) -> str:
    """Why the pair cannot be verified here ("" when it can)."""
    pasts = {s.past(side).name for s in sites for side in s.sides if s.past(side) is not None}  # type: ignore[union-attr]
    other = [v.name for v in original.graph.inputs if v.name not in (*_FEEDS, *pasts)]
    unfused = [name for name in other if name and ("past" in name or "cache" in name)]
    dtypes = {s.query_dtype for s in sites}
    checks = (
        (not sites, "no attention node to compare"),
        (bool(dtypes - {ir.DataType.FLOAT}), "a float16 or bfloat16 attention (no such CPU kernel)"),
        (any(s.int_attr("sliding_window_cache") for s in sites), "a window-sized cache (its first past)"),
        (bool(unfused), f"a layer left unfused (its cache {', '.join(unfused[:2])})"),
        (bool(other), f"an input it does not feed ({', '.join(map(str, other))})"),
        ("input_ids" not in {v.name for v in original.graph.inputs}, "no input_ids input"),
    )
    return next((why for failed, why in checks if failed), "")


def _vocab(model: ir.Model) -> tuple[str, int]:
    logits = next((o for o in model.graph.outputs if "logits" in (o.name or "")), model.graph.outputs[0])
    last = logits.shape[-1] if logits.shape is not None and len(logits.shape) else None
    return logits.name or "", last if isinstance(last, int) else 2


def _empty(site: CacheSite, batch: int) -> np.ndarray:
    """An empty float32 past of ``batch`` rows for ``site``'s caches."""
    return np.zeros((batch, site.kv_num_heads, 0, site.head_size()), np.float32)


def _run(
    session: Any,
    names: dict[str, str],
    inputs: set[str],
    mask: np.ndarray,
    ids: np.ndarray,
    pasts: dict[str, np.ndarray],
    logits: str,
) -> np.ndarray:
    """The logits of every call (prompt, then each step), each ``[B, n, V]``, concatenated."""
    out, total, state = [], 0, dict(pasts)
    for start, stop in [(0, _PROMPT), *((k, k + 1) for k in range(_PROMPT, _PROMPT + _STEPS))]:
        total = stop
        feeds = {"input_ids": ids[:, start:stop], **state}
        if "attention_mask" in inputs:
            feeds["attention_mask"] = mask[:, :total]
        if "position_ids" in inputs:
            positions = np.maximum(np.cumsum(mask[:, :total], axis=1) - 1, 0)
            feeds["position_ids"] = positions[:, start:stop]
        results = dict(zip([logits, *names], session.run([logits, *names], feeds), strict=True))
        out.append(results[logits])
        state = {names[present]: value for present, value in results.items() if present in names}
    return np.concatenate(out, axis=1)


#: The cases run: each a name and its attention_mask (prompt and steps; 0 marks padding).
_LENGTH = _PROMPT + _STEPS
_CASES = {
    "one row": np.ones((1, _LENGTH), np.int64),
    "a left-padded batch of 2": np.array([[1] * _LENGTH, [0] * _PAD + [1] * (_LENGTH - _PAD)]),
}


#: Operators whose output at one row depends on every row (activation quantization over the whole
#: tensor): the padded positions, which the fusion does not compute as the export does, then move
#: the valid ones, so such a model is compared on one row only.
_BATCH_WIDE = frozenset({"DynamicQuantizeLinear"})


class _Pair:
    """The export's and the fused model's sessions, and what a run feeds and reads."""

    def __init__(self, original: ir.Model, fused: ir.Model, sites: list[CacheSite]) -> None:
        self.sites = sites
        self.logits, self.vocab = _vocab(original)
        self.names = {str(s.present(side).name): str(s.past(side).name) for s in sites for side in s.sides}  # type: ignore[union-attr]
        self.inputs = {v.name for v in original.graph.inputs if v.name}
        self.pasts = {str(s.past(side).name): s for s in sites for side in s.sides}  # type: ignore[union-attr]
        self.sessions = [_session(original, "the export does not load"), _session(fused, "")]

    def case(self, mask: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray] | str:
        """Both models' logits for ``mask``, or why the export does not run on these inputs."""
        ids = rng.integers(0, self.vocab, mask.shape, dtype=np.int64)
        pasts = {past: _empty(site, len(mask)) for past, site in self.pasts.items()}
        run = (self.names, self.inputs, mask, ids, pasts, self.logits)
        try:
            want = _run(self.sessions[0], *run)
        except Exception as error:  # onnxruntime raises several unrelated types
            return f"the export does not run on these inputs ({ort_error_text(error)})"
        try:
            return want, _run(self.sessions[1], *run)
        except Exception as error:
            raise KvCacheError(
                f"The fused model fails where the export runs: {ort_error_text(error)}. Nothing was "
                "converted; please report the model (docs/exporting.md, What is proven)."
            ) from None


class _Unverifiable(Exception):
    """The export does not run here: nothing to compare with (its message says why)."""


def _session(model: ir.Model, refused: str) -> Any:
    """A CPU session; a model onnxruntime refuses raises :class:`_Unverifiable` (``refused``: the
    export) or :class:`~onnx_kvcache.errors.KvCacheError` (the fused model, where the export loads)."""
    try:
        return create_session(model)
    except MissingRuntimeError:
        raise
    except Exception as error:  # onnxruntime raises several unrelated types
        if refused:
            raise _Unverifiable(f"{refused} in onnxruntime ({ort_error_text(error)})") from None
        raise KvCacheError(
            f"onnxruntime refuses the fused model where it loads the export: {ort_error_text(error)}. "
            "Nothing was converted; please report the model (docs/exporting.md, What is proven)."
        ) from None


def _difference(want: np.ndarray, got: np.ndarray, mask: np.ndarray) -> float | None:
    """The largest logit difference at valid positions where the export's are finite, relative to
    the export's largest there (None: no such position)."""
    valid = (mask[:, :, None] != 0) & np.isfinite(want)
    if not valid.any():
        return None
    return float(np.abs(want - got)[valid].max()) / max(float(np.abs(want[valid]).max()), 1e-6)


def verify_fusion(original: ir.Model, fused: ir.Model, *, forced: bool = False) -> Verification:
    """Run ``original`` (an export) and ``fused`` (its attention fused, not yet quantized) side
    by side (module rules); raise :class:`~onnx_kvcache.errors.KvCacheError` when their logits
    differ, else say what was verified or why not (``forced``: whatever the weights' size)."""
    sites = find_attention_sites(fused)
    why = "" if forced else (too_large(original) or Verification(True)).skipped
    why = why or _why_not(original, fused, sites)
    if why:
        return Verification(False, skipped=why)
    started = time.perf_counter()
    try:
        pair = _Pair(original, fused, sites)
    except MissingRuntimeError:
        return Verification(False, skipped="onnxruntime is not installed (the cpu extra)")
    except _Unverifiable as why_not:
        return Verification(False, skipped=str(why_not))
    rng, error, cases = np.random.default_rng(0), 0.0, list[str]()
    coupled = any(node.op_type in _BATCH_WIDE for node in original.graph)
    for case, mask in _CASES.items() if not coupled else list(_CASES.items())[:1]:
        outcome = pair.case(mask, rng)
        if isinstance(outcome, str):
            return Verification(False, skipped=outcome)
        difference = _difference(*outcome, mask)
        if difference is not None:
            error, cases = max(error, difference), [*cases, case]
    if error > TOLERANCE:
        raise KvCacheError(
            f"The fused model's logits differ from the export's by {error:.1e} of the largest (more than "
            f"{TOLERANCE:g}; {', '.join(cases)}): the fusion is wrong for this model, so nothing was "
            "converted. Please report the model (docs/exporting.md, What is proven)."
        )
    return Verification(True, error, tuple(cases), time.perf_counter() - started)
