"""How ``evaluate`` runs its windows: the fewest model calls that give token-by-token decoding's logits.

Teacher-forced scoring needs, at every position of a window, the logits a decode step
computes there (prompt positions: the prompt's own call). Which calls give them depends on
the kernel that computes the runner's attention, one row of :data:`CALL_PATTERNS` each
(measured: tests/runtime/test_scoring.py on the bundled decoders, and
``benchmarks/evaluate_speed.py --check`` on SmolLM2-135M):

* **A window in one call** where a chunk's logits equal a decode step's, whatever the split:
  onnxruntime's CPU int8/int4 kernel and the PagedAttention CPU reference quantize the new
  tokens before attending in every phase, and their logits do not depend on how positions
  are split into calls (bit for bit, onnxruntime 1.32), unless the model routes its
  multi-token calls through the float kernel (:mod:`~onnx_kvcache.cache.prompt_path`, what
  ``convert`` writes for the CPU); a float cache computed in float32
  agrees to float rounding (~1e-6 of the logit range). Windows of one length run batched
  from an empty cache (GroupQueryAttention takes several tokens a row with a past only
  for a batch of one, so a window too long for one call runs alone, in chunks).
* **The prompt in one call, then a token a call**, windows batched, everywhere else: a CPU
  cache whose prompt attends in float (the steps are the quantized kernel's, the prompt what
  the user's prompt gets); the
  emulation (fp8; int8/int4 under CUDA's rule) attends with the float kernel, whose rounding
  differs between a chunk and a step by ~1e-7; the quantizer turns that into whole steps of
  a cached value, and after 30 layers a chunk's logits differ from the steps' by 1e-2 to
  1e-1 of the logit range on SmolLM2 (1e-4 is the bar). Float16 compute differs by ~2e-4
  without any quantization; CUDA's native kernel is not measured here. A batch's rows equal
  single rows bit for bit (every kernel above), so windows still share each call.

Greedy generation is batched the same way: the prompts in one call, then one token a call
for every window at once; a row past its end-of-sequence token is fed on and ignored.

Memory is bounded whatever the data, by the one estimate of a run's memory
(:func:`~onnx_kvcache.runtime._memory.run_parts`: both models' caches, a call's attention
scores and logits): a batch takes the most windows whose run holds at most
:data:`RUN_BUDGET`, and a window whose single call would hold more runs alone, in chunks
that fit. Evaluation's refusal past the machine's memory checks the batch that will run.
"""

from __future__ import annotations

__all__ = [
    "CALL_PATTERNS",
    "RUN_BUDGET",
    "CallPattern",
    "Limits",
    "aligned",
    "call_pattern",
    "greedy",
    "teacher_forced",
]

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.sites import find_attention_sites
from onnx_kvcache.runtime._memory import run_parts
from onnx_kvcache.runtime.runner import KvCacheRunner

#: Bytes one batch may hold while it runs: both models' caches, a call's attention scores and
#: logits (:func:`~onnx_kvcache.runtime._memory.run_parts`).
RUN_BUDGET = 1024 * 2**20


@dataclasses.dataclass(frozen=True)
class CallPattern:
    """How one kernel's teacher-forced logits are computed with the fewest calls."""

    kernel: str
    whole_window: bool
    """A window's positions in one call equal token-by-token decoding (else: a token a call)."""
    note: str
    """What runs, and why, as the report says it."""


_ONE_CALL = "each window in one call, windows batched"
_STEPS = "the prompt in one call, then a token a call, windows batched"

#: The call pattern of each kernel (see the module docstring for the measurements).
CALL_PATTERNS: dict[str, CallPattern] = {
    row.kernel: row
    for row in (
        CallPattern(
            "float cache",
            True,
            f"{_ONE_CALL} (a float32 float cache: a chunk equals token-by-token decoding)",
        ),
        CallPattern(
            "float16 float cache",
            False,
            f"{_STEPS} (float16 rounds a chunk differently from a step by ~2e-4 of the logit range)",
        ),
        CallPattern(
            "cpu kernel",
            True,
            f"{_ONE_CALL} (the CPU kernel quantizes new tokens before attending in every phase: "
            "a chunk equals token-by-token decoding)",
        ),
        CallPattern(
            "cpu kernel, float prompt",
            False,
            f"{_STEPS} (the model's multi-token calls attend in float through the float kernel, "
            "as its prompt does: a token a call goes through the quantized kernel)",
        ),
        CallPattern(
            "paged reference",
            True,
            f"{_ONE_CALL} (every paged kernel quantizes new tokens before attending: "
            "a chunk equals token-by-token decoding)",
        ),
        CallPattern(
            "emulation",
            False,
            f"{_STEPS} (the emulation's float attention rounds a chunk differently, which "
            "quantization turns into whole steps: only steps equal token-by-token decoding)",
        ),
        CallPattern("native kernel", False, f"{_STEPS} (a GPU kernel: chunks not measured)"),
        CallPattern(
            "qdq storage",
            False,
            f"{_STEPS} (a cache stored through QuantizeLinear/DequantizeLinear around the model's own "
            "attention: chunks not measured against steps)",
        ),
    )
}

GREEDY_NOTE = "the prompts in one call, then a token a call, windows batched"


def _kernel(runner: KvCacheRunner) -> str:
    """The :data:`CALL_PATTERNS` row of the kernel computing ``runner``'s attention."""
    if runner.device != "cpu":
        return "native kernel"
    quantized = runner.quantized
    if runner.paged:  # float32 whatever the model's type
        return "paged reference" if quantized else "float cache"
    if quantized and not runner.sites:  # static buffers, an export's own caches
        return "qdq storage"
    if quantized and runner.emulated:
        return "emulation"
    if quantized:
        return "cpu kernel, float prompt" if runner.prompt_in_float else "cpu kernel"
    sites = find_attention_sites(runner.model)
    float32 = all(s.query_dtype in (None, ir.DataType.FLOAT) for s in sites)
    return "float cache" if float32 else "float16 float cache"


def call_pattern(runner: KvCacheRunner) -> CallPattern:
    """How ``runner``'s teacher-forced logits are computed (its kernel's row)."""
    return CALL_PATTERNS[_kernel(runner)]


@dataclasses.dataclass(frozen=True)
class Limits:
    """How many windows one batch takes and how many tokens one call, for a model pair."""

    windows: int
    """Windows a batch takes: their run within :data:`RUN_BUDGET` (at least one)."""
    tokens_per_call: int
    """Tokens a lone window's call takes within :data:`RUN_BUDGET` (at least one)."""
    positions: int
    """The most positions a window's caches hold (its tokens, or its prompt and greedy tokens)."""
    queries: int
    """Tokens a batch's largest call feeds a window (the whole window, else the prompt)."""

    @classmethod
    def of(
        cls, runners: Sequence[KvCacheRunner], length: int, prompt: int, positions: int, whole_window: bool
    ) -> Limits:
        """The limits for windows of ``length`` tokens (prompt ``prompt``) whose caches grow to
        ``positions``, over both runners, from :func:`run_parts`."""
        queries = max(1, length - 1) if whole_window else prompt

        def held(tokens: int) -> int:  # one window's run, fed ``tokens`` in one call
            return sum(
                size for r in runners for _, size in run_parts(r, 1, positions, queries=tokens, logits=tokens)
            )

        fixed, per_token = held(0), held(1) - held(0)
        tokens = (RUN_BUDGET - fixed) // max(1, per_token)
        return cls(max(1, RUN_BUDGET // held(queries)), max(1, tokens), positions, queries)

    def parts(self, runners: Sequence[KvCacheRunner], windows: int) -> list[tuple[str, int]]:
        """What a batch of ``windows`` (at most :attr:`windows`) holds while it runs, model by model."""
        batch = min(windows, self.windows)
        queries = self.queries if batch > 1 else min(self.queries, self.tokens_per_call)
        return [
            (f"{name}: {what}", size)
            for name, r in zip(("baseline", "candidate"), runners)
            for what, size in run_parts(r, batch, self.positions, queries=queries, logits=queries)
        ]


def teacher_forced(
    runner: KvCacheRunner, ids: np.ndarray, prompt: int, limits: Limits
) -> Iterator[np.ndarray]:
    """The logits at every position of ``ids`` (``[B, T]``, the tokens fed), in position
    order, as blocks ``[B, n, V]``: by :func:`call_pattern`'s rule, each equal to
    token-by-token decoding's (the first ``prompt`` positions: the prompt's call)."""
    batch, length = ids.shape
    if call_pattern(runner).whole_window:
        chunk = length if batch > 1 else limits.tokens_per_call  # several rows: no call after a past
        for start in range(0, length, chunk):
            call = runner.prefill if start == 0 else runner.forward
            yield call(ids[:, start : start + chunk])
        return
    yield runner.prefill(ids[:, :prompt])
    for position in range(prompt, length):
        yield runner.step(ids[:, position])[:, None]


def aligned(a: Iterator[np.ndarray], b: Iterator[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Pairs of blocks of the same positions from two streams of ``[B, n, V]`` blocks (each
    stream's next block computed only when the other has caught up)."""
    left = right = None
    while True:
        if left is None or not left.shape[1]:
            left = next(a, None)
        if right is None or not right.shape[1]:
            right = next(b, None)
        if left is None or right is None:
            return
        n = min(left.shape[1], right.shape[1])
        yield left[:, :n], right[:, :n]
        left, right = left[:, n:], right[:, n:]


def greedy(runner: KvCacheRunner, prompts: np.ndarray, max_new_tokens: int) -> Iterator[list[list[int]]]:
    """Greedy decoding of every row of ``prompts`` (``[B, p]``) at once, as
    :meth:`KvCacheRunner.generate` decodes one: each row stops after ``max_new_tokens``
    tokens or an end-of-sequence token of the model's. Yields every row's tokens so far after
    each call (the last: the result; no call for ``max_new_tokens=0``)."""
    rows = len(prompts)
    out: list[list[int]] = [[] for _ in range(rows)]
    if max_new_tokens == 0:
        yield out
        return
    done = [False] * rows
    logits = runner.prefill(prompts)[:, -1]
    while True:
        tokens = np.argmax(logits, axis=-1)
        for row, token in enumerate(tokens.tolist()):
            if not done[row]:
                out[row].append(token)
                done[row] = len(out[row]) == max_new_tokens or token in runner.eos_token_ids
        yield out
        if all(done):
            return
        logits = runner.step(tokens)  # finished rows are fed on; their tokens are not kept
