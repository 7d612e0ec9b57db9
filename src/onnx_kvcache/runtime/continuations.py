"""Both models' greedy continuations of one prompt, side by side, the first divergence marked.

What ``evaluate``'s figures mean in words: a candidate whose KL and perplexity moved little
still continues a prompt as its original does for a while, and the place where the two first
part shows what the format costs in text. Each model decodes one token a call from the prompt
(as a user's loop does), the candidate under its target's kernel rule and the baseline under
the same rule (:func:`~onnx_kvcache.runtime.evaluation.evaluate_kv_cache` does the same).
"""

from __future__ import annotations

__all__ = ["Continuations", "compare_continuations"]

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import onnx_ir as ir

from onnx_kvcache.errors import INTEGER, KvCacheError, require_type
from onnx_kvcache.runtime.evaluation import _runners, greedy_agreement
from onnx_kvcache.scales.data import find_tokenizer, load_tokenizer

#: The prompt :func:`compare_continuations` continues when none is given.
DEFAULT_PROMPT = "The capital of France is"

#: Greedy tokens each model adds when not told.
DEFAULT_NEW_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class Continuations:
    """The prompt and each model's greedy continuation (token ids and, with a tokenizer, text)."""

    prompt: str
    baseline: list[int]
    candidate: list[int]
    kernel_rule: str
    """The rule the candidate's quantized cache followed (``cpu (onnxruntime CPU kernel)``, ...)."""
    tokenizer: Any = dataclasses.field(default=None, repr=False, compare=False)
    max_new_tokens: int = 0
    """Tokens each model was allowed: one that generated fewer stopped at an end-of-sequence token."""

    @property
    def shared(self) -> int:
        """Tokens both generated before the first that differs."""
        return greedy_agreement(self.baseline, self.candidate)[0]

    def _text(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return str(self.tokenizer.decode(list(ids)))

    def _tails(self) -> tuple[str, str, str]:
        """What both generated and each one's rest, as text: each whole continuation decoded
        (a character split across byte tokens is whole there) and cut where the texts part;
        token ids where the two texts read the same though the tokens differ."""
        n = self.shared
        ids = " ".join(map(str, self.baseline[n:])), " ".join(map(str, self.candidate[n:]))
        if self.tokenizer is None:
            return self._text(self.baseline[:n]), repr(ids[0]), repr(ids[1])
        base, cand = self._text(self.baseline), self._text(self.candidate)
        if base == cand:
            return base, f"token ids {ids[0]}", f"token ids {ids[1]}"
        cut = next((i for i, (a, b) in enumerate(zip(base, cand)) if a != b), min(len(base), len(cand)))
        return base[:cut], repr(base[cut:]), repr(cand[cut:])

    def format_side_by_side(self) -> str:
        """The prompt, what both generated, then each model's text from the first divergence
        (marked ``|``), one labelled line each, and which model stopped at end-of-sequence."""
        n, total = self.shared, max(len(self.baseline), len(self.candidate))
        if self.baseline == self.candidate:
            rows = [("prompt", repr(self.prompt)), ("both", repr(self._text(self.baseline)))]
            rows.append(("first divergence", f"none: all {total} generated tokens identical"))
        else:
            common, base, cand = self._tails()
            rows = [("prompt", repr(self.prompt)), ("both", repr(common))]
            rows += [
                ("baseline", f"| {base}"),
                ("candidate", f"| {cand}"),
                ("first divergence", f"at generated token {n + 1} of {total} ({n} identical before it)"),
            ]
        for who, ids in (("baseline", self.baseline), ("candidate", self.candidate)):
            if self.max_new_tokens and len(ids) < self.max_new_tokens:
                rows.append((f"{who} stopped", f"at end of sequence after {len(ids)} token(s)"))
        rows.append(("candidate's rule", self.kernel_rule))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def compare_continuations(
    baseline: ir.Model | str | os.PathLike,
    candidate: ir.Model | str | os.PathLike,
    prompt: str | Sequence[int] = DEFAULT_PROMPT,
    *,
    tokenizer: str | os.PathLike | None = None,
    max_new_tokens: int = DEFAULT_NEW_TOKENS,
    semantics: str | None = None,
) -> Continuations:
    """Greedy continuations of ``prompt`` (text, read with ``tokenizer`` or the one beside
    ``baseline``; or token ids) by both models, one token a call, up to ``max_new_tokens``
    each (an end-of-sequence token stops a model early). Both models need a KV cache and one
    vocabulary; the prompt and the tokens fit the shorter context (checked before any run)."""
    require_type(prompt, (str, list, tuple), "prompt", "a text or a list of token ids")
    require_type(max_new_tokens, INTEGER, "max_new_tokens", "an integer")
    if max_new_tokens < 1:
        raise KvCacheError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    words = None
    if isinstance(prompt, str):
        words = load_tokenizer(
            find_tokenizer(baseline if not isinstance(baseline, ir.Model) else None, tokenizer)
        )
        ids = list(words.encode(prompt).ids)
        if not ids:
            raise KvCacheError("The prompt is empty once tokenized: give some text.")
    else:
        ids = list(prompt)
    base, cand = _runners(baseline, candidate, None, semantics)  # evaluate's checks: one cache layout
    shown = prompt if isinstance(prompt, str) else " ".join(map(str, ids))
    return Continuations(
        shown,
        base.generate(ids, max_new_tokens),  # each checks the length before it runs
        cand.generate(ids, max_new_tokens),
        f"{cand.kernel_rule} ({cand.semantics_reason})",
        words,
        max_new_tokens,
    )
