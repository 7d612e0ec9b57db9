"""evaluate_kv_cache: the metrics on hand-made logits, and on real model pairs."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from onnx_kvcache import KvCacheError, KvCacheQuantizationPass, KvCacheRunner, KvCacheWarning
from onnx_kvcache.cache.formats import get_format
from onnx_kvcache.cli.commands import main
from onnx_kvcache.models.decoder import build_decoder
from onnx_kvcache.runtime.evaluation import evaluate_kv_cache, greedy_agreement, kl_divergence, top1_agreement

DATA = [list(np.random.default_rng(1).integers(0, 300, 24))]


def test_kl_divergence_by_hand():
    p = np.log(np.array([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]))
    q = np.log(np.array([[0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]]))
    want = 0.5 * np.log(2) + 0.25 * np.log(0.5)
    np.testing.assert_allclose(kl_divergence(p, q), [want, 0.0], atol=1e-12)
    np.testing.assert_allclose(kl_divergence(p + 7.0, q - 3.0), kl_divergence(p, q), atol=1e-12)  # shift-free
    a, b = np.log([[0.9, 0.1]]), np.log([[0.5, 0.5]])
    assert kl_divergence(a, b)[0] == pytest.approx(0.9 * np.log(1.8) + 0.1 * np.log(0.2))
    assert kl_divergence(b, a)[0] == pytest.approx(0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(5.0))


def test_top1_and_greedy_agreement_by_hand():
    a = np.array([[0.1, 0.9], [0.8, 0.2], [0.4, 0.6]])
    b = np.array([[0.2, 0.7], [0.1, 0.9], [0.3, 0.5]])
    assert top1_agreement(a, b).tolist() == [True, False, True]
    assert greedy_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (2, 0.75)
    assert greedy_agreement([1, 2], [1, 2]) == (2, 1.0)
    assert greedy_agreement([5], [6]) == (0, 0.0)


def quantized(fmt, granularity="per_tensor", scale=(0.05, 0.02)):
    model = build_decoder(num_layers=2, vocab_size=300)
    n = 1 if granularity == "per_tensor" else 64
    KvCacheQuantizationPass(
        fmt, granularity, {i: (np.full(n, scale[0]), np.full(n, scale[1])) for i in range(2)}
    )(model)
    return model


def test_a_model_against_itself_is_perfect():
    base = build_decoder(num_layers=2, vocab_size=300)
    report = evaluate_kv_cache(
        base, build_decoder(num_layers=2, vocab_size=300), DATA, max_new_tokens=6, prompt_len=8
    )
    assert report.kl_max == 0.0 and report.top1_agreement == 1.0
    assert report.greedy_match_share == 1.0 and report.greedy_match_prefix == 6
    assert all(k == 0 and v == 0 for k, v in report.layer_errors.values())
    assert report.positions == 24 - 8 - 1 and report.kl_prompt_mean == 0.0  # decode steps only
    assert report.baseline_bytes_per_token == report.candidate_bytes_per_token == 1024


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_a_quantized_model_against_itself_is_perfect_and_warns(fmt):
    """Both run under one rule; a quantized baseline is almost surely a mistake."""
    model = build_decoder(num_layers=2, vocab_size=300, dtype="float16")  # targets CUDA: its rule
    KvCacheQuantizationPass(fmt, scales={0: (0.05, 0.02), 1: (0.05, 0.02)})(model)
    with pytest.warns(KvCacheWarning, match="baseline's KV cache is quantized"):
        report = evaluate_kv_cache(model, model, DATA, max_new_tokens=2, prompt_len=8)
    assert report.kl_max == 0.0 and report.kernel_rule == "cuda (emulated on CPU)"


def test_decode_steps_are_scored_apart_from_cudas_unquantized_prompt():
    base = build_decoder(num_layers=2, vocab_size=300)
    report = evaluate_kv_cache(
        base, quantized("fp8", scale=(0.01, 0.01)), DATA, max_new_tokens=0, prompt_len=8
    )
    assert report.kernel_rule == "cuda (emulated on CPU)"
    assert report.kl_prompt_mean == 0.0 < report.kl_mean and len(report.kl_per_position) == 15
    assert all(k > 0 for k in report.kl_per_position)


def test_models_with_another_vocabulary_or_too_short_data_are_refused():
    base = build_decoder(num_layers=2, vocab_size=300)
    with pytest.raises(KvCacheError, match="or vocabulary"):
        evaluate_kv_cache(base, build_decoder(num_layers=2, vocab_size=512), DATA, max_new_tokens=0)
    with pytest.raises(KvCacheError, match="leave no decode step"):
        evaluate_kv_cache(base, base, [[1, 2]], max_new_tokens=0)


def test_json_has_null_for_what_was_not_measured():
    import json

    base = build_decoder(num_layers=2, vocab_size=300)
    doc = evaluate_kv_cache(base, base, DATA, max_new_tokens=0, prompt_len=8).to_json()
    assert doc["greedy_match_share"] is None and "NaN" not in json.dumps(doc)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_cache_error_equals_a_manual_dequantization(fmt):
    base, cand = build_decoder(num_layers=2, vocab_size=300), quantized(fmt)
    report = evaluate_kv_cache(base, cand, DATA, max_new_tokens=0, prompt_len=8)
    b, c = KvCacheRunner(base), KvCacheRunner(cand)
    b.prefill(DATA[0][:8])
    c.prefill(DATA[0][:8])
    for token in DATA[0][8:-1]:
        b.step(token)
        c.step(token)
    row = get_format(fmt)
    ref = b.present(1, "key")
    test = row.dequantize(c.present(1, "key"), np.float32(0.05), 32)
    want = np.linalg.norm(test - ref) / np.linalg.norm(ref)
    assert report.layer_errors[1][0] == pytest.approx(want, rel=1e-6)
    assert report.candidate_format == f"{fmt} per_tensor" and report.emulated == (fmt == "fp8")
    assert report.candidate_bytes_per_token == 2 * 2 * 2 * 32 * (0.5 if fmt == "int4" else 1)
    assert 0 < report.kl_mean < 5


def test_coarser_scales_give_larger_error():
    from onnx_kvcache import calibrate_kv_cache

    base = build_decoder(num_layers=2, vocab_size=300)
    calibrated = calibrate_kv_cache(base, DATA, format="int8", progress=False, min_tokens=0)
    reports = []
    for factor in (1.0, 8.0):
        cand = build_decoder(num_layers=2, vocab_size=300)
        scales = {i: (calibrated.k[i] * factor, calibrated.v[i] * factor) for i in calibrated.layer_ids}
        KvCacheQuantizationPass("int8", scales=scales)(cand)
        reports.append(evaluate_kv_cache(base, cand, DATA, max_new_tokens=0))
    good, coarse = reports
    assert good.kl_mean < coarse.kl_mean
    for layer in (0, 1):
        assert good.layer_errors[layer][0] < coarse.layer_errors[layer][0]
        assert good.layer_errors[layer][1] < coarse.layer_errors[layer][1]


def test_data_notes(tmp_path):
    base = build_decoder(num_layers=2, vocab_size=300)
    report = evaluate_kv_cache(base, quantized("int8"), num_seqs=2, seq_len=16, max_new_tokens=2)
    assert "random token ids" in report.data_note and report.num_sequences == 2
    pytest.importorskip("tokenizers")
    from onnx_kvcache import calibrate_kv_cache, convert_model
    from onnx_kvcache.models.decoder import save_genai_folder

    folder = save_genai_folder(tmp_path / "demo", num_layers=2)
    scales = calibrate_kv_cache(folder, format="int8", progress=False)
    convert_model(folder, tmp_path / "int8", format="int8", scales=scales)
    report = evaluate_kv_cache(folder, tmp_path / "int8", num_seqs=1, seq_len=32, max_new_tokens=2)
    assert report.data_note == "built-in corpus, evaluation part, model tokenizer"
    assert report.held_out_from_calibration and report.tokens == 32
    assert report.kernel_rule_reason == "target cpu: converted for cpu (its onnx_kvcache.converted metadata)"
    assert f"({report.kernel_rule_reason})" in report.format_table()
    text = tmp_path / "elsewhere" / "text.txt"  # text away from the model: the baseline's tokenizer reads it
    text.parent.mkdir()
    text.write_text("The cache holds keys and values for every past token. " * 8)
    report = evaluate_kv_cache(folder, tmp_path / "int8", text, num_seqs=1, seq_len=32, max_new_tokens=2)
    assert report.data_note == "text from text.txt" and not report.held_out_from_calibration
    assert "held out" not in report.format_table()


def test_models_with_different_caches_are_refused():
    with pytest.raises(KvCacheError, match="differ in their KV caches"):
        evaluate_kv_cache(build_decoder(num_layers=2), build_decoder(num_layers=3), DATA)


def test_cli_evaluate_with_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    base, cand = tmp_path / "base.onnx", tmp_path / "cand.onnx"
    ir.save(build_decoder(num_layers=2, vocab_size=300), base)
    ir.save(quantized("int8"), cand)
    (tmp_path / "ids.json").write_text(json.dumps([[int(x) for x in DATA[0]]]))
    argv = [
        "evaluate",
        str(base),
        str(cand),
        "--token-ids",
        str(tmp_path / "ids.json"),
        "--json",
        str(tmp_path / "r.json"),
        "--plot",
        str(tmp_path / "r.png"),
        "--max-new-tokens",
        "4",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "KL mean / max" in out and "layer   1" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert set(doc["layer_errors"]) == {"0", "1"} and doc["candidate_format"] == "int8 per_tensor"
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_evaluate_says_what_it_scored(tmp_path, capsys):
    """Default data: the report names the corpus part, windows and tokens, and that it is
    held out from calibrate's default data, in text and in --json."""
    pytest.importorskip("tokenizers")
    from onnx_kvcache.models.decoder import save_genai_folder

    folder = save_genai_folder(tmp_path / "model", num_layers=2)
    argv = ["calibrate", str(folder), "--out", str(tmp_path / "s.json"), "--format", "int8", "--no-progress"]
    assert main(argv) == 0
    assert main(["convert", str(folder), str(tmp_path / "int8"), "--scales", str(tmp_path / "s.json")]) == 0
    capsys.readouterr()
    argv = ["evaluate", str(folder), str(tmp_path / "int8"), "--num-seqs", "2", "--seq-len", "48"]
    assert main([*argv, "--max-new-tokens", "2", "--json", str(tmp_path / "r.json"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert (
        "built-in corpus, evaluation part, model tokenizer (held out: disjoint from calibrate's default "
        "data); 2 windows, 96 tokens, " in out
    )
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["held_out_from_calibration"] is True and doc["tokens"] == 96 and doc["num_sequences"] == 2
    calibrated = json.loads((tmp_path / "s.json").read_text())
    assert calibrated["data"] == "built-in corpus, model tokenizer"  # the calibration part


def test_plot_of_a_perfect_match(tmp_path):
    pytest.importorskip("matplotlib")
    from onnx_kvcache.runtime._plots import plot_evaluation

    base = build_decoder(num_layers=2, vocab_size=300)
    report = evaluate_kv_cache(base, build_decoder(num_layers=2, vocab_size=300), DATA, max_new_tokens=0)
    plot_evaluation(report, tmp_path / "same.png")  # all-zero KL: no log axis
    assert (tmp_path / "same.png").stat().st_size > 1000


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_paged_models_evaluate_on_cpu(fmt):
    base = build_decoder(num_layers=2, vocab_size=300, paged=True, dtype="float16")
    cand = build_decoder(num_layers=2, vocab_size=300, paged=True, dtype="float16")
    from onnx_kvcache import calibrate_kv_cache

    scales = calibrate_kv_cache(base, DATA * 4, format=fmt, progress=False, min_tokens=0)
    KvCacheQuantizationPass(fmt, scales=scales)(cand)
    report = evaluate_kv_cache(base, cand, DATA, max_new_tokens=4, prompt_len=8, progress=False)
    assert report.kernel_rule.startswith("PagedAttention CPU reference")
    assert report.emulated and report.candidate_format == f"{fmt} per_tensor"
    assert report.baseline_bytes_per_token / report.candidate_bytes_per_token == (4 if fmt == "int4" else 2)
    assert 0 < report.kl_mean < 1 and set(report.layer_errors) == {0, 1}
    assert all(0 < k < 0.5 and 0 < v < 0.5 for k, v in report.layer_errors.values())


def _calibrated_paged_pair(fmt, granularity, **config):
    from onnx_kvcache import calibrate_kv_cache

    base, cand = (build_decoder(num_layers=2, vocab_size=300, paged=True, **config) for _ in range(2))
    scales = calibrate_kv_cache(
        base, DATA * 4, format=fmt, granularity=granularity, progress=False, min_tokens=0
    )
    KvCacheQuantizationPass(fmt, granularity, scales)(cand)
    return base, cand


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_bfloat16_paged_models_evaluate_on_cpu(fmt, granularity):
    """bf16 weights and caches (no CPU kernels for either): computed in float32, the cache
    bytes counted as the model stores them (bf16: 2 a value)."""
    base, cand = _calibrated_paged_pair(fmt, granularity, dtype="bfloat16")
    report = evaluate_kv_cache(base, cand, DATA, max_new_tokens=4, prompt_len=8, progress=False)
    assert report.kernel_rule.startswith("PagedAttention CPU reference") and report.emulated
    assert report.candidate_format == f"{fmt} {granularity}"
    assert report.baseline_bytes_per_token == 2 * 2 * 2 * 32 * 2  # layers, K and V, heads, head, bf16
    assert report.baseline_bytes_per_token / report.candidate_bytes_per_token == (4 if fmt == "int4" else 2)
    assert np.isfinite(report.kl_mean) and 0 < report.kl_mean < 2 and set(report.layer_errors) == {0, 1}
    bound = 0.5 if fmt == "int4" else 0.1  # relative L2 of the calibrated cache (measured: 0.35, 0.04)
    assert all(0 < k < bound and 0 < v < bound for k, v in report.layer_errors.values())


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_latent_paged_models_evaluate_on_cpu(fmt, granularity):
    """LATENT (MLA) layers keep one cache, which serves K and V: one error a layer, the bytes
    of one cache."""
    base, cand = _calibrated_paged_pair(fmt, granularity, latent=True, head_size=32, dtype="float16")
    report = evaluate_kv_cache(base, cand, DATA, max_new_tokens=4, prompt_len=8, progress=False)
    assert report.kernel_rule.startswith("PagedAttention CPU reference") and report.emulated
    assert report.candidate_format == f"{fmt} {granularity}"
    assert report.baseline_bytes_per_token == 2 * 1 * 32 * 2  # layers, one kv head, head, fp16
    assert report.baseline_bytes_per_token / report.candidate_bytes_per_token == (4 if fmt == "int4" else 2)
    assert np.isfinite(report.kl_mean) and 0 < report.kl_mean < 2 and set(report.layer_errors) == {0, 1}
    bound = 0.5 if fmt == "int4" else 0.1
    assert all(0 < k == v < bound for k, v in report.layer_errors.values())
    assert "layer   1" in report.format_table()


def test_the_default_lengths_fit_a_context_shorter_than_them():
    """evaluate's defaults (256 tokens a window, 64 greedy tokens) were refused by a model of a
    shorter context; they now shorten to it, and a given length is still checked."""
    short = build_decoder(num_layers=2, vocab_size=300, max_position=40)
    ids = [list(np.random.default_rng(5).integers(0, 300, 200))]
    report = evaluate_kv_cache(short, short, ids, num_seqs=2, progress=False)
    assert report.tokens == 2 * 41  # windows of 41 tokens feed 40 positions
    assert report.greedy_match_prefix == 40 - 20 + 1  # after a prompt of 20: the rest of the context
    with pytest.raises(KvCacheError, match=r"^seq_len=100 feeds 99 positions, .* give at most seq_len=41\.$"):
        evaluate_kv_cache(short, short, ids, seq_len=100, progress=False)


@pytest.mark.parametrize("rotation", ["keys", "keys_and_values"])
def test_a_rotated_cache_is_compared_turned_back(rotation):
    """A rotated cache stores ``k H`` (and ``v H``): its error is taken after ``H^T``, so the
    float model rotated alone has none, and a rotated int8 cache a rounding error (the stored
    values themselves differ from the float cache's by about sqrt(2))."""
    from onnx_kvcache import KvCacheRotationPass, calibrate_kv_cache

    base = build_decoder(num_layers=2, vocab_size=300)
    turned = build_decoder(num_layers=2, vocab_size=300)
    KvCacheRotationPass(rotation)(turned)
    exact = evaluate_kv_cache(base, turned, DATA, max_new_tokens=0)
    assert all(k < 1e-5 and v < 1e-5 for k, v in exact.layer_errors.values()), exact.layer_errors
    scales = calibrate_kv_cache(
        base, DATA, format="int8", granularity="per_channel", rotation=rotation, progress=False, min_tokens=0
    )
    cand = build_decoder(num_layers=2, vocab_size=300)
    KvCacheRotationPass(rotation)(cand)
    KvCacheQuantizationPass("int8", "per_channel", scales)(cand)
    report = evaluate_kv_cache(base, cand, DATA, max_new_tokens=0)
    assert all(0 < k < 0.5 and 0 < v < 0.5 for k, v in report.layer_errors.values()), report.layer_errors


@pytest.mark.parametrize(
    ("rotation", "head", "matrix"),
    [("keys", 32, "hadamard"), ("keys_and_values", 32, "hadamard"), ("keys_and_values", 48, "walsh_dct")],
)
def test_each_models_cache_is_turned_back_by_its_own_rotation(rotation, head, matrix):
    """Issue 45 row 1: a rotated model against itself, and against its original in either
    order, has no cache error (each side turned back by its own ``H^T``, the old walsh_dct's too)."""
    from onnx_kvcache import KvCacheRotationPass

    base = build_decoder(num_layers=2, vocab_size=300, head_size=head)
    turned = build_decoder(num_layers=2, vocab_size=300, head_size=head)
    KvCacheRotationPass(rotation, matrix)(turned)
    for pair in ((turned, turned), (turned, base), (base, turned)):
        report = evaluate_kv_cache(*pair, DATA, max_new_tokens=0)
        assert all(k < 1e-5 and v < 1e-5 for k, v in report.layer_errors.values()), report.layer_errors


def test_a_rotated_models_position_limit_is_read_where_rope_stands():
    """Issue 45 row 2: rotation moves RoPE out of the attention node into a RotaryEmbedding;
    the limit of its cos table is still the model's, and evaluate's defaults fit it."""
    from onnx_kvcache import KvCacheRotationPass

    short = build_decoder(num_layers=2, vocab_size=300, max_position=48)
    KvCacheRotationPass("keys_and_values")(short)
    assert not any(
        n.op_type == "GroupQueryAttention" and n.attributes.get_int("do_rotary") for n in short.graph
    )
    runner = KvCacheRunner(short)
    assert runner.max_positions == 48
    with pytest.raises(
        KvCacheError, match=r"the model.s rotary tables cover 48: give at most max_new_tokens=9"
    ):
        runner.generate(list(range(40)), 20)
    ids = [list(np.random.default_rng(5).integers(0, 300, 200))]
    report = evaluate_kv_cache(short, short, ids, num_seqs=1, progress=False)
    assert report.tokens == 49 and report.greedy_match_prefix == 48 - 24 + 1


def test_a_model_without_a_cache_is_refused():
    """Issue 45 row 10: nothing to compare."""
    model = build_decoder(num_layers=2, vocab_size=300, no_cache_layers=(0, 1))
    with pytest.raises(KvCacheError, match=r"^The candidate has no KV cache .*: nothing to compare\."):
        evaluate_kv_cache(model, model, DATA)


def test_a_float_paged_cache_is_said_to_be_one():
    """Issue 45 row 11: the rule line of a float paged cache says what is there."""
    model = build_decoder(num_layers=2, vocab_size=300, paged=True)
    report = evaluate_kv_cache(model, model, DATA, max_new_tokens=2, progress=False)
    assert report.kernel_rule == "PagedAttention CPU reference (a float cache, float32)"
    assert "quantized" not in report.calls["candidate"]
    quantized = KvCacheRunner(_calibrated_paged_pair("int8", "per_tensor")[1])
    assert quantized.kernel_rule.startswith("PagedAttention CPU reference (quantized before attending")


def test_perplexity_is_the_exp_of_the_next_tokens_mean_nll():
    from onnx_kvcache.runtime.evaluation import token_nll

    logits = np.log(np.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    np.testing.assert_allclose(token_nll(logits + 3.0, np.array([[0, 2]])), [[np.log(2), -np.log(0.8)]])
    model = build_decoder(num_layers=2, vocab_size=300)
    report = evaluate_kv_cache(model, model, DATA, max_new_tokens=0, prompt_len=8)
    runner = KvCacheRunner(model)
    logits = runner.prefill(DATA[0][:-1])[0]
    want = float(np.exp(token_nll(logits[8:], np.array(DATA[0][9:])).mean()))
    assert report.perplexity_baseline == report.perplexity_candidate == pytest.approx(want, rel=1e-6)
    assert report.perplexity_change == 0.0


@pytest.mark.parametrize(
    "change, top1, words",
    [
        (0.0, 1.0, "no measurable loss"),
        (-0.001, 0.9699, "no measurable loss"),  # SmolLM2's int8 per channel
        (0.008, 0.955, "a small loss"),  # its fp8
        (0.004, 0.93, "a small loss"),  # top-1 is the second bound
        (0.05, 0.85, "a clear loss"),
        (0.14, 0.77, "a large loss"),  # its rotated int4
        (0.01, 0.5, "a large loss"),
    ],
)
def test_the_verdict_is_the_first_row_whose_bounds_hold(change, top1, words):
    import dataclasses

    model = build_decoder(num_layers=2, vocab_size=300)
    report = evaluate_kv_cache(model, model, DATA, max_new_tokens=0)
    report = dataclasses.replace(
        report,
        perplexity_baseline=10.0,
        perplexity_candidate=10.0 * (1 + change),
        top1_agreement=top1,
        perplexity_change_margin=0.0,  # one short window has no margin of its own: inf
    )
    assert report.verdict.words == words
    line = report.verdict_line
    assert line.startswith(f"{words} (perplexity {change:+.2%} ± 0.00%, top-1 {top1:.1%}): ")
    assert report.to_json()["verdict"] == words and report.to_json()["verdict_line"] == line
    assert (
        line.endswith("; on random token ids: give text (a tokenizer) for a verdict about language") is False
    )
    assert f"verdict               {line}" in report.format_table()


def test_a_change_whose_interval_spans_two_rows_gets_no_verdict():
    """Few decode steps: the 95% interval of the perplexity change decides, not its middle."""
    import dataclasses

    model = build_decoder(num_layers=2, vocab_size=300)
    report = evaluate_kv_cache(model, model, DATA, max_new_tokens=0)
    noisy = dataclasses.replace(
        report, perplexity_baseline=10.0, perplexity_candidate=10.04, perplexity_change_margin=0.01
    )
    assert noisy.verdict is None and noisy.to_json()["verdict"] is None
    assert noisy.verdict_line.startswith(
        "between no measurable loss and a small loss (perplexity +0.40% ± 1.00%, top-1 100.0% over "
    )
    assert dataclasses.replace(noisy, perplexity_change_margin=0.0005).verdict.words == "no measurable loss"


#: Figures that fall in each verdict row, with no margin.
ROW_FIGURES = {
    "no measurable loss": (0.0, 1.0),
    "a small loss": (0.01, 0.93),
    "a clear loss": (0.05, 0.85),
    "a large loss": (0.2, 0.5),
}


def _advice(report, words: str) -> str:
    """The advice of ``report``'s verdict line once its figures fall in the row ``words``."""
    import dataclasses

    change, top1 = ROW_FIGURES[words]
    judged = dataclasses.replace(
        report,
        perplexity_baseline=10.0,
        perplexity_candidate=10.0 * (1 + change),
        top1_agreement=top1,
        perplexity_change_margin=0.0,
    )
    assert judged.verdict.words == words
    return judged.verdict_line.split("): ", 1)[1]


def _rotated_float():
    from onnx_kvcache import KvCacheRotationPass

    model = build_decoder(num_layers=2, vocab_size=300)
    KvCacheRotationPass("keys_and_values")(model)
    return model


@pytest.mark.parametrize(
    ("make", "granularity", "saves"),
    [
        (lambda: quantized("int4"), "per_tensor", True),
        (lambda: quantized("int4", "per_channel"), "per_channel", True),
        (_rotated_float, None, False),
    ],
    ids=["int4-per-tensor", "int4-per-channel", "rotated-float"],
)
def test_the_advice_follows_the_candidate(make, granularity, saves):
    """Hostile user: a per-channel candidate was told to try per-channel scales, and a float one
    (rotated, nothing quantized) that its cache's bytes are saved for free."""
    report = evaluate_kv_cache(build_decoder(num_layers=2, vocab_size=300), make(), DATA, max_new_tokens=0)
    assert report.candidate_granularity == granularity and report.candidate.saves is saves
    assert report.to_json()["candidate_granularity"] == granularity
    free = _advice(report, "no measurable loss")
    assert ("saved for free" in free) is saves and ("nothing is saved" in free) is not saves
    for words in ("a small loss", "a clear loss", "a large loss"):
        assert ("nothing is saved" in _advice(report, words)) is not saves
    assert ("try per-channel scales" in _advice(report, "a clear loss")) is (granularity == "per_tensor")


def test_every_verdict_advises_every_candidate():
    """The last advice of each row fits any candidate; a row's advices differ."""
    from onnx_kvcache.runtime._verdicts import VERDICTS, Candidate

    candidates = [Candidate(s, g) for s in (True, False) for g in (None, "per_tensor", "per_channel")]
    for verdict in VERDICTS:
        last = verdict.advice[-1]
        assert last.saves is None and last.per_channel is None
        assert all(verdict.advice_for(c) for c in candidates)
        assert len({a.words for a in verdict.advice}) == len(verdict.advice)


def test_a_per_channel_static_build_stored_around_its_attention_is_not_told_to_go_per_channel(tmp_path):
    """Hostile user: ``evaluate FLOAT INT4PC`` of mobius's static build converted with
    ``--storage qdq --format int4 --granularity per_channel``: its granularity is read from the
    scales of the caches stored around its own attention."""
    import pathlib

    from onnx_kvcache import calibrate_kv_cache, convert_model

    source = pathlib.Path(__file__).parents[1] / "data/producers/mobius/mobius-static/llama/model.onnx"
    data = [list(np.random.default_rng(3).integers(0, 128, 40)) for _ in range(4)]
    scales = calibrate_kv_cache(
        source, data, format="int4", granularity="per_channel", progress=False, min_tokens=0
    )
    scales.save(tmp_path / "s.json")
    convert_model(source, tmp_path / "q.onnx", storage="qdq", scales=tmp_path / "s.json")
    report = evaluate_kv_cache(source, tmp_path / "q.onnx", data, max_new_tokens=0, progress=False)
    assert report.candidate_granularity == "per_channel" and report.candidate.saves
    assert "try per-channel scales" not in _advice(report, "a clear loss")


def test_the_margin_is_infinite_below_two_blocks_and_shrinks_with_more():
    from onnx_kvcache.runtime._verdicts import NLL_BLOCK, change_margin

    rng = np.random.default_rng(0)
    base = [rng.normal(2.0, 0.5, NLL_BLOCK)]
    assert change_margin((base, [b + 0.01 for b in base]), 0.01) == float("inf")
    few = [rng.normal(2.0, 0.5, 8 * NLL_BLOCK)]
    many = [rng.normal(2.0, 0.5, 512 * NLL_BLOCK)]
    noise = np.random.default_rng(1)
    margin_few = change_margin((few, [b + noise.normal(0, 0.1, b.shape) for b in few]), 0.0)
    margin_many = change_margin((many, [b + noise.normal(0, 0.1, b.shape) for b in many]), 0.0)
    assert 0 < margin_many < margin_few < 1


def test_a_baseline_without_a_cache_is_named_as_such():
    """Hostile user of issue 45, finding 12."""
    model = build_decoder(num_layers=2, vocab_size=300)
    nocache = build_decoder(num_layers=2, vocab_size=300, no_cache_layers=(0, 1))
    with pytest.raises(KvCacheError, match=r"^The baseline has no KV cache"):
        evaluate_kv_cache(nocache, model, DATA)


def test_no_perplexity_is_no_verdict():
    import dataclasses

    model = build_decoder(num_layers=2, vocab_size=300)
    report = dataclasses.replace(
        evaluate_kv_cache(model, model, DATA, max_new_tokens=0), perplexity_candidate=float("nan")
    )
    assert report.verdict is None and report.verdict_line.startswith("not measured")


def test_both_models_are_timed_at_the_context_asked_for_within_theirs():
    """evaluate's speed lines: the context asked (default 1,024) within the models' context less
    the decode steps timed; the caches' bytes at it from the graph; 0 asks for none."""
    from onnx_kvcache.runtime._speed import DECODE_STEPS, DEFAULT_CONTEXT

    short = build_decoder(num_layers=2, vocab_size=300, max_position=300)
    report = evaluate_kv_cache(short, short, DATA, max_new_tokens=2, prompt_len=8, progress=False)
    assert report.speed is not None and report.speed.context == 300 - DECODE_STEPS
    base, cand = build_decoder(num_layers=2, vocab_size=300), quantized("int8")
    report = evaluate_kv_cache(base, cand, DATA, max_new_tokens=2, prompt_len=8, speed_context=40)
    speed = report.speed
    assert speed is not None and speed.context == 40 and speed.steps == DECODE_STEPS
    assert speed.cache_bytes == (40 * report.baseline_bytes_per_token, 40 * report.candidate_bytes_per_token)
    assert all(t > 0 for t in (*speed.prefill_seconds, *speed.decode_tokens_per_second))
    table = report.format_table()
    assert "prefill, 40 tokens" in table and "cache at 40 tokens" in table
    assert report.to_json()["speed"]["context"] == 40
    none = evaluate_kv_cache(base, base, DATA, max_new_tokens=2, prompt_len=8, speed_context=0)
    assert none.speed is None and "prefill" not in none.format_table()
    with pytest.raises(KvCacheError):
        evaluate_kv_cache(base, base, DATA, speed_context=-1)
    assert DEFAULT_CONTEXT == 1024


def test_the_cli_passes_the_prompt_length_and_the_speed_context(tmp_path, capsys):
    base, cand = tmp_path / "base.onnx", tmp_path / "cand.onnx"
    ir.save(build_decoder(num_layers=2, vocab_size=300), base)
    ir.save(quantized("int8"), cand)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([int(i) for i in DATA[0]]))
    argv = ["evaluate", str(base), str(cand), "--token-ids", str(ids), "--num-seqs", "1", "--seq-len", "24"]
    assert main([*argv, "--prompt-len", "4", "--speed-context", "32", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "prefill, 32 tokens" in out
    assert "prompts of 4 token(s), 19 decode steps scored" in out  # a window of 24 after a prompt of 4
