"""evaluate's call patterns: a chunk's logits against token-by-token decoding's, per kernel,
and evaluate's figures against the token-by-token procedure it replaced (same inputs)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import onnx_kvcache.runtime._scoring as scoring
from onnx_kvcache import KvCacheQuantizationPass, KvCacheRunner, KvCacheWarning
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.runtime._memory import run_parts
from onnx_kvcache.runtime.evaluation import evaluate_kv_cache, greedy_agreement, kl_divergence, top1_agreement

#: A chunk "equals" token-by-token decoding within this share of each row's logit range.
TOLERANCE = 1e-4
PROMPT = 8
WINDOWS = np.random.default_rng(3).integers(0, 300, (3, 40))
SCALES = {"fp8": (0.05, 0.03), "int8": (0.05, 0.03), "int4": (0.4, 0.25)}
#: case -> (format, kernel rule asked for, build options, the CALL_PATTERNS row that runs it)
CASES = {
    "float32 float cache": (None, None, {}, "float cache"),
    "float16 float cache": (None, None, {"dtype": "float16"}, "float16 float cache"),
    "int8 cpu kernel": ("int8", "cpu", {}, "cpu kernel"),
    "int4 cpu kernel": ("int4", "cpu", {}, "cpu kernel"),
    "int8 cpu kernel, float16": ("int8", "cpu", {"dtype": "float16"}, "cpu kernel"),
    "int8 cpu kernel, sliding window cache": (
        "int8",
        "cpu",
        {"sliding_window_layers": (1,), "sliding_window": 16, "sliding_window_cache": True},
        "cpu kernel",
    ),
    "fp8 emulation, cuda rule": ("fp8", "cuda", {}, "emulation"),
    "int8 emulation, cuda rule": ("int8", "cuda", {}, "emulation"),
    "int4 emulation, cuda rule": ("int4", "cuda", {}, "emulation"),
    "int8 emulation, cpu rule (q/k norm)": ("int8", "cpu", {"qk_norm": True}, "emulation"),
    "fp8 paged reference": ("fp8", None, {"paged": True, "dtype": "float16"}, "paged reference"),
    "int4 paged reference": ("int4", None, {"paged": True, "dtype": "float16"}, "paged reference"),
}


def _model(fmt, **options):
    model = build_decoder(num_layers=2, vocab_size=300, **options)
    if fmt is not None:
        k, v = SCALES[fmt]
        KvCacheQuantizationPass(fmt, "per_tensor", {i: (k, v) for i in range(2)})(model)
    return model


def _runner(case: str) -> KvCacheRunner:
    fmt, rule, options, _ = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCacheWarning)
        return KvCacheRunner(_model(fmt, **options), semantics=rule)


def _token_by_token(runner: KvCacheRunner, window: np.ndarray) -> np.ndarray:
    """Logits at positions 0..L-2: the prompt prefilled, then one token a step."""
    logits = [runner.prefill(window[:PROMPT])[0]]
    logits += [runner.step(int(t)) for t in window[PROMPT:-1]]
    return np.concatenate(logits)


def _off(test: np.ndarray, ref: np.ndarray) -> float:
    """The largest difference, as a share of each row's logit range."""
    span = ref.max(axis=-1, keepdims=True) - ref.min(axis=-1, keepdims=True)
    return float((np.abs(test - ref) / span).max())


@pytest.mark.parametrize("case", CASES)
def test_each_kernels_call_pattern_gives_token_by_token_logits(case):
    """The proof behind CALL_PATTERNS: the calls a kernel's pattern makes (windows batched,
    and a lone window in chunks) give token-by-token decoding's logits within 1e-4 of the
    logit range; a batch's rows give single rows' logits."""
    runner = _runner(case)
    pattern = scoring.call_pattern(runner)
    assert pattern.kernel == CASES[case][3]
    ref = np.stack([_token_by_token(runner, w) for w in WINDOWS])
    ids = WINDOWS[:, :-1]
    limits = scoring.Limits(windows=3, tokens_per_call=10**6, positions=40, queries=39)
    batched = np.concatenate(list(scoring.teacher_forced(runner, ids, PROMPT, limits)), axis=1)
    assert batched.shape == ref.shape and _off(batched, ref) <= TOLERANCE
    if pattern.whole_window:  # one window too long for one call: chunks of 11 after a past
        small = scoring.Limits(windows=1, tokens_per_call=11, positions=40, queries=39)
        chunks = list(scoring.teacher_forced(runner, ids[:1], PROMPT, small))
        assert [c.shape[1] for c in chunks] == [11, 11, 11, 6]
        assert _off(np.concatenate(chunks, axis=1), ref[:1]) <= TOLERANCE


def test_emulated_chunks_are_not_steps():
    """Why the emulation runs a token a call: on this decoder (interleaved RoPE, fp8 under
    CUDA's rule) the prompt and then the rest in one chunk moves the logits by more than
    1e-4 of their range (1.1e-3): the float attention's rounding in a chunk, turned into
    whole fp8 steps. On SmolLM2-135M (benchmarks/evaluate_speed.py --check) 1e-2 to 1e-1."""
    runner = KvCacheRunner(_model("fp8", rotary_interleaved=True), semantics="cuda")
    assert scoring.call_pattern(runner).kernel == "emulation"
    window = np.random.default_rng(1).integers(0, 300, 48)
    ref = _token_by_token(runner, window)
    chunk = np.concatenate([runner.prefill(window[:PROMPT])[0], runner.forward(window[None, PROMPT:-1])[0]])
    assert _off(chunk, ref) > TOLERANCE


def _figures_token_by_token(base_model, cand_model, windows, max_new_tokens):
    """evaluate_kv_cache's figures as it computed them before the call patterns: each window
    alone, the prompt prefilled, one token a step, greedy generation window by window."""
    cand = KvCacheRunner(cand_model)
    base = KvCacheRunner(base_model, semantics=cand.semantics)
    kls, prompt_kls, agree, errors, shares, prefixes = [], [], [], {}, [], []
    for window in windows:
        b, c = _token_by_token(base, window), _token_by_token(cand, window)
        kl = kl_divergence(b, c)
        prompt_kls.append(kl[:PROMPT])
        kls.append(kl[PROMPT:])
        agree.append(top1_agreement(b[PROMPT:], c[PROMPT:]))
        for bb in base.bindings:
            ref, test = base.cache_values(bb.layer_id, bb.kind), cand.cache_values(bb.layer_id, bb.kind)
            error = float(np.linalg.norm(test - ref) / np.linalg.norm(ref))
            errors.setdefault((bb.layer_id, bb.kind), []).append(error)
        gb = base.generate(window[:PROMPT].tolist(), max_new_tokens)
        gc = cand.generate(window[:PROMPT].tolist(), max_new_tokens)
        prefix, share = greedy_agreement(gb, gc)
        prefixes.append(prefix)
        shares.append(share)
    return {
        "kl_mean": float(np.concatenate(kls).mean()),
        "kl_max": float(np.concatenate(kls).max()),
        "kl_prompt_mean": float(np.concatenate(prompt_kls).mean()),
        "top1_agreement": float(np.concatenate(agree).mean()),
        "greedy_match_share": float(np.mean(shares)),
        "greedy_match_prefix": float(np.mean(prefixes)),
        "kl_per_position": np.mean(kls, axis=0),
        "layer_errors": {key: float(np.mean(e)) for key, e in errors.items()},
    }


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        ("int8", {}),  # the CPU kernel: a window a call
        ("fp8", {}),  # the emulation under CUDA's rule: a token a call
        ("int4", {"paged": True, "dtype": "float16"}),  # the paged reference: a window a call
    ],
)
@pytest.mark.parametrize("tokens_per_call", [None, 13])
def test_figures_equal_the_token_by_token_procedure(fmt, options, tokens_per_call, monkeypatch):
    """Same inputs, same figures: evaluate's batched calls against each window alone, one
    token a step; also when memory allows only 13 tokens a call (a window at a time, in
    chunks; the prompt and greedy decoding still one call each)."""
    base, cand = build_decoder(num_layers=2, vocab_size=300, **options), _model(fmt, **options)
    if tokens_per_call:
        runners = (KvCacheRunner(base), KvCacheRunner(cand))
        monkeypatch.setattr(scoring, "RUN_BUDGET", _budget(runners, 40, tokens_per_call))
        assert scoring.Limits.of(runners, 40, PROMPT, 40, True).tokens_per_call == tokens_per_call
    want = _figures_token_by_token(base, cand, WINDOWS, max_new_tokens=6)
    report = evaluate_kv_cache(base, cand, [list(w) for w in WINDOWS], max_new_tokens=6, prompt_len=PROMPT)
    assert report.positions == 3 * (40 - PROMPT - 1) and report.num_sequences == 3
    for name in ("kl_mean", "kl_max", "kl_prompt_mean"):
        assert getattr(report, name) == pytest.approx(want[name], rel=1e-4, abs=1e-9), name
    np.testing.assert_allclose(report.kl_per_position, want["kl_per_position"], rtol=1e-4, atol=1e-9)
    for name in ("top1_agreement", "greedy_match_share", "greedy_match_prefix"):
        assert getattr(report, name) == want[name], name
    errors = want["layer_errors"]
    for layer, (k, v) in report.layer_errors.items():
        assert (k, v) == pytest.approx((errors[layer, "key"], errors[layer, "value"]))
    assert set(report.calls) == {"candidate", "baseline", "greedy"}
    assert report.calls["candidate"] == scoring.call_pattern(KvCacheRunner(cand)).note


def _held(runners, positions: int, tokens: int) -> int:
    """What one window's run holds, fed ``tokens`` in one call (runtime/_memory.py's estimate)."""
    return sum(s for r in runners for _, s in run_parts(r, 1, positions, queries=tokens, logits=tokens))


def _budget(runners, positions: int, tokens: int) -> int:
    """The run budget that lets one call take exactly ``tokens`` tokens."""
    return _held(runners, positions, tokens + 1) - 1


def test_batches_stay_within_the_memory_bounds(monkeypatch):
    """Windows batch up to the run budget by the one memory estimate (run_parts), which
    evaluation's refusal checks; a lone window too long for one call runs in chunks."""
    runner = _runner("int8 cpu kernel")
    runners = (runner, runner)
    limits = scoring.Limits.of(runners, 40, PROMPT, 46, whole_window=True)
    assert limits.windows == scoring.RUN_BUDGET // _held(runners, 46, 39) > 3
    assert sum(size for _, size in limits.parts(runners, 3)) == 3 * _held(runners, 46, 39)
    steps = scoring.Limits.of(runners, 40, PROMPT, 46, whole_window=False)  # the prompt's call
    assert steps.windows == scoring.RUN_BUDGET // _held(runners, 46, PROMPT)
    monkeypatch.setattr(scoring, "RUN_BUDGET", _budget(runners, 46, 10))
    small = scoring.Limits.of(runners, 40, PROMPT, 46, whole_window=True)
    assert (small.windows, small.tokens_per_call) == (1, 10)
    assert sum(size for _, size in small.parts(runners, 3)) == _held(runners, 46, 10) <= scoring.RUN_BUDGET


def test_progress_counts_every_token_scored(monkeypatch):
    """The bar's total is the teacher-forced positions and greedy tokens of every window, and
    the updates reach it exactly (tqdm shows the time left from them)."""
    import sys

    import tqdm

    bars = []

    class Recorder:
        def __init__(self, total, **options):
            self.total, self.n, self.options = total, 0, options
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(tqdm, "tqdm", Recorder)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    windows = [list(w) for w in WINDOWS] + [list(WINDOWS[0][:20])]  # a shorter last window
    evaluate_kv_cache(_model(None), _model("int8"), windows, max_new_tokens=3, prompt_len=PROMPT)
    (bar,) = bars
    assert bar.total == 3 * (39 + 3) + (19 + 3) and bar.n == bar.total
    assert bar.options["unit"] == "token"


def test_batched_greedy_stops_each_row_at_its_end_of_sequence():
    """Rows decoded together give each row's generate(): a row stops after its
    end-of-sequence token while the others go on."""
    runner = _runner("int8 cpu kernel")
    prompts = WINDOWS[:, :PROMPT]
    free = [runner.generate(p.tolist(), 8, eos_token_id=None) for p in prompts]
    runner.eos_token_ids = frozenset({free[0][2]})  # row 0 stops at its third token
    want = [runner.generate(p.tolist(), 8) for p in prompts]
    assert len(want[0]) == 3 and want != free
    (*_, got) = scoring.greedy(runner, prompts, 8)
    assert got == want
