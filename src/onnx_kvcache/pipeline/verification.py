"""Translation validation of a fusion: the export and its fused model run side by side.

The fusion proves each layer equivalent for unpadded and left-padded rows (docs/exporting.md,
"What is proven"). :func:`verify_fusion` checks the proof on the model itself: onnxruntime's CPU
runs the export and the fused model (before any quantization) on the same inputs, and their
logits must agree at every valid position.

Rules:

* Cases: one row, a 7-token prompt then 3 one-token steps; two rows, the second left-padded by 3,
  the same. Token ids are seeded random ids below the vocabulary; ``attention_mask`` marks the
  valid tokens, ``position_ids`` (when an input) counts them; every past starts empty and is the
  model's own present afterwards (the export's and the fused model's each their own). Each call
  gets the mask's columns of its cache's tokens and its new ones (the last ``past + new``: the
  whole mask for a full-length cache, a rolling window cache's own columns, which its export
  reads as its cache's; docs/exporting.md, "Rolling window caches"). A model that mixes rolling and
  full-length caches gets the whole mask (its full layers' columns); its export runs with the
  window layers' pasts declared apart (:func:`~onnx_kvcache.cache.rolling.split_window_lengths`:
  declared shapes only, what the fused model declares), and a padded row is compared at its prompt
  only (while its pasts' lengths differ, the export's window layers read the mask's first columns,
  no mask serves both its kinds of layers).
* Agreement: the largest absolute difference of the logits at valid positions is at most
  :data:`TOLERANCE` of the export's largest logit there (float32 computes both; the orders of
  summation differ); float16 attention within 1e-2 (:data:`TOLERANCES`). A position where the
  export's own logits are not finite is not compared (below opset 23 an export's softmax turns a
  fully masked row into NaN).
* Not verified, with the reason: by default a model whose weights exceed :data:`MAX_BYTES`
  (loading the weights twice is the cost), a bfloat16 model (no bfloat16
  GroupQueryAttention kernel on the CPU), a window-sized cache (``sliding_window_cache=1``: its
  first past is not the export's empty one), a layer left unfused, an input other than ids,
  mask, positions and caches, an export onnxruntime does not load or run on these inputs, logits
  not ``[batch, tokens, vocab]``. An export that quantizes its activations over the whole batch
  (``DynamicQuantizeLinear``) is compared on one row (its padded rows move every row's scale).
  Logits of a call's last tokens alone (an export that slices them) are compared at those.
* A difference, or a fused model onnxruntime refuses or fails where the export runs, is
  :attr:`Verification.differs`: the decision refuses the conversion with it.
"""

from __future__ import annotations

__all__ = ["MAX_BYTES", "TOLERANCE", "TOLERANCES", "Verification", "too_large", "verify_fusion"]

import dataclasses
import time
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.rolling import present_output, split_window_lengths
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites, unread_caches
from onnx_kvcache.errors import MissingRuntimeError
from onnx_kvcache.model_io import create_session, ort_error_text
from onnx_kvcache.model_io.reading import logits_output

#: Weights (bytes) up to which a fusion is verified by default: both models are loaded once each,
#: about 8 s and 1 GiB of memory more for 622 MiB of weights (``benchmarks/fusion_speed.py``: the
#: 7 s conversion of a SmolLM2-135M-shaped export took 11.5 s to 15.6 s verified).
MAX_BYTES = 2**30
#: The largest logit difference allowed, relative to the export's largest logit, by the attention's
#: element type: float16 rounds every product and sum to 11 bits, in each model's own order
#: (6.7e-4 on the oracle's float16 llama, 0 on its gptj; a wrong fusion differs by tenths).
TOLERANCES = {ir.DataType.FLOAT: 1e-4, ir.DataType.FLOAT16: 1e-2}
TOLERANCE = TOLERANCES[ir.DataType.FLOAT]
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
    """Why it was not verified (empty when it was, or when the two differ)."""
    differs: str = ""
    """How the fused model computes otherwise than the export (empty: it does not, as far as run)."""

    @property
    def line(self) -> str:
        """What happened, in one line (for the log and the summary)."""
        if self.differs:
            return f"fusion refused: {self.differs}"
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
    others = [v for v in original.graph.inputs if v.name not in (*_FEEDS, *pasts)]
    other = [str(v.name) for v in others]
    unfused = [str(v.name) for v in unread_caches(original, sites)]
    dtypes = {s.query_dtype for s in sites}
    checks = (
        (not sites, "no attention node to compare"),
        (bool(dtypes - set(TOLERANCES)), "a bfloat16 attention (no such CPU kernel)"),
        (any(s.int_attr("sliding_window_cache") for s in sites), "a window-sized cache (its first past)"),
        (bool(unfused), f"a layer left unfused (its cache {', '.join(unfused[:2])})"),
        (bool(other), f"an input it does not feed ({', '.join(map(str, other))})"),
        ("input_ids" not in {v.name for v in original.graph.inputs}, "no input_ids input"),
    )
    return next((why for failed, why in checks if failed), "")


def _logits(model: ir.Model, presents: set[str]) -> tuple[str, int]:
    """The logits output (:func:`~onnx_kvcache.model_io.reading.logits_output`, the presents
    aside) and the vocabulary its last dimension says (2 when symbolic: ids 0 and 1)."""
    found = logits_output(model, frozenset(presents))
    if found is None:
        raise _Unverifiable("no output besides the caches")
    return found[0], found[1] or 2


def _empty(site: CacheSite, batch: int) -> np.ndarray:
    """An empty past of ``batch`` rows for ``site``'s caches, of its queries' type (float32, float16)."""
    dtype = np.float16 if site.query_dtype == ir.DataType.FLOAT16 else np.float32
    return np.zeros((batch, site.kv_num_heads, 0, site.head_size()), dtype)


Call = tuple[np.ndarray, np.ndarray]
"""One call's logits ``[B, n, V]`` and the mask of the positions they are for ``[B, n]``."""


def _run(session: Any, pair: _Pair, mask: np.ndarray, ids: np.ndarray, export: bool) -> list[Call]:
    """Every call's logits (prompt, then each step) with their positions' mask (the last ``n``
    of the call's tokens: an export may give the last token's alone)."""
    out, state = [], {past: _empty(site, len(mask)) for past, site in pair.pasts.items()}
    fetch = [pair.logits, *pair.names]
    for start, stop in [(0, _PROMPT), *((k, k + 1) for k in range(_PROMPT, _LENGTH))]:
        feeds = {"input_ids": ids[:, start:stop], **state}
        if "attention_mask" in pair.inputs:
            held = max(v.shape[2] for v in state.values()) if state else start
            feeds["attention_mask"] = mask[:, stop - held - (stop - start) : stop]
        if "position_ids" in pair.inputs:
            feeds["position_ids"] = np.maximum(np.cumsum(mask[:, :stop], axis=1) - 1, 0)[:, start:stop]
        try:
            results = dict(zip(fetch, session.run(fetch, feeds), strict=True))
        except Exception as error:  # onnxruntime raises several unrelated types
            said = ort_error_text(error)
            if export:
                raise _Unverifiable(f"the export does not run on these inputs ({said})") from None
            raise _Differs(f"the fused model fails where the export runs: {said}") from None
        logits = results[pair.logits]
        if logits.ndim != 3 or logits.shape[1] > stop - start:
            raise _Unverifiable(f"logits of shape {list(logits.shape)}, not [batch, tokens, vocab]")
        valid = mask[:, start:stop][:, stop - start - logits.shape[1] :]
        if len({v.shape[2] for v in state.values()}) > 1:  # rolling and full caches: unpadded rows
            valid = valid * mask[:, :stop].all(axis=1, keepdims=True)
        out.append((logits, valid))
        state = {pair.names[name]: value for name, value in results.items() if name in pair.names}
    return out


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


class _Unverifiable(Exception):
    """Not verifiable here: the export does not load or run on these inputs (the message says why)."""


class _Differs(Exception):
    """The fused model computes otherwise, or fails where the export runs (the message says how)."""


def _session(model: ir.Model, export: bool) -> Any:
    """A CPU session; a model onnxruntime refuses raises :class:`_Unverifiable` (the export) or
    :class:`_Differs` (the fused model, where the export loads)."""
    try:
        return create_session(model)
    except MissingRuntimeError:
        raise
    except Exception as error:  # onnxruntime raises several unrelated types
        if export:
            raise _Unverifiable(
                f"the export does not load in onnxruntime ({ort_error_text(error)})"
            ) from None
        raise _Differs(
            f"onnxruntime refuses the fused model where it loads the export: {ort_error_text(error)}"
        ) from None


def _as_declared(original: ir.Model, fused: ir.Model) -> ir.Model:
    """``original``, or where the fused model declares its rolling window caches' pasts apart from
    full-length ones a copy declared so (declared shapes only: onnxruntime otherwise takes the
    export's one past length for both and fails on the export's own presents)."""
    declared = {v.name: v.shape for v in fused.graph.inputs}
    if all(declared.get(v.name, v.shape) == v.shape for v in original.graph.inputs):
        return original
    copy = original.clone()
    split_window_lengths(copy.graph)
    return copy


class _Pair:
    """The export's and the fused model's sessions, and what a run feeds and reads."""

    def __init__(self, original: ir.Model, fused: ir.Model, sites: list[CacheSite]) -> None:
        self.names = {
            str(present_output(s.present(side)).name): str(s.past(side).name)  # type: ignore[union-attr]
            for s in sites
            for side in s.sides
        }
        self.logits, self.vocab = _logits(original, set(self.names))
        self.inputs = {v.name for v in original.graph.inputs if v.name}
        self.pasts = {str(s.past(side).name): s for s in sites for side in s.sides}  # type: ignore[union-attr]
        self.sessions = [_session(_as_declared(original, fused), True), _session(fused, False)]

    def difference(self, mask: np.ndarray, rng: np.random.Generator) -> float | None:
        """The largest logit difference at valid positions where the export's are finite, relative
        to the export's largest there (None: no such position), for the case ``mask``."""
        ids = rng.integers(0, self.vocab, mask.shape, dtype=np.int64)
        want, got = (_run(session, self, mask, ids, k == 0) for k, session in enumerate(self.sessions))
        worst, top = 0.0, 0.0
        for (a, valid), (b, _) in zip(want, got, strict=True):
            if a.shape != b.shape:
                raise _Differs(f"the fused model's logits are {list(b.shape)}, the export's {list(a.shape)}")
            keep = (valid[:, :, None] != 0) & np.isfinite(a)
            if keep.any():
                worst, top = (
                    max(worst, float(np.abs(a - b)[keep].max())),
                    max(top, float(np.abs(a[keep]).max())),
                )
        return worst / max(top, 1e-6) if top else None


#: What a refusal adds: nothing written, and where to report it.
_REPORT = ". Nothing was converted; please report the model (docs/exporting.md, What is proven)."


def verify_fusion(original: ir.Model, fused: ir.Model, *, forced: bool = False) -> Verification:
    """Run ``original`` (an export) and ``fused`` (its attention fused, not yet quantized) side
    by side (module rules): what was verified, why not, or how the two differ
    (:attr:`Verification.differs`); ``forced``: whatever the weights' size."""
    sites = find_attention_sites(fused)
    why = "" if forced else (too_large(original) or Verification(True)).skipped
    why = why or _why_not(original, fused, sites)
    if why:
        return Verification(False, skipped=why)
    started, rng, error, cases = time.perf_counter(), np.random.default_rng(0), 0.0, list[str]()
    coupled = any(node.op_type in _BATCH_WIDE for node in original.graph)
    try:
        pair = _Pair(original, fused, sites)
        for case, mask in list(_CASES.items())[: 1 if coupled else None]:
            difference = pair.difference(mask, rng)
            if difference is not None:
                error, cases = max(error, difference), [*cases, case]
    except MissingRuntimeError:
        return Verification(False, skipped="onnxruntime is not installed (the cpu extra)")
    except _Unverifiable as reason:
        return Verification(False, skipped=str(reason))
    except _Differs as reason:
        return Verification(False, differs=f"{reason}{_REPORT}")
    tolerance = max(TOLERANCES[s.query_dtype] for s in sites)  # type: ignore[index]
    if error > tolerance:
        differs = (
            f"the fused model's logits differ from the export's by {error:.1e} of the largest (more than "
            f"{tolerance:g}; {', '.join(cases)}): the fusion is wrong for this model{_REPORT}"
        )
        return Verification(False, error, tuple(cases), time.perf_counter() - started, differs=differs)
    return Verification(True, error, tuple(cases), time.perf_counter() - started)
