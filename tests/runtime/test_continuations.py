"""compare_continuations: both models' greedy continuations, the first divergence marked."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_kvcache import KvCacheError, KvCacheQuantizationPass, KvCacheRunner
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import KvCacheTypeError
from onnx_kvcache.models.decoder import build_decoder, save_genai_folder
from onnx_kvcache.runtime.continuations import Continuations, compare_continuations

PROMPT = [5, 17, 42, 99, 3, 250, 7]


def _int4(scale: float):
    model = build_decoder(num_layers=2, vocab_size=300)
    KvCacheQuantizationPass("int4", "per_tensor", {i: (scale, scale) for i in range(2)})(model)
    return model


def test_a_model_against_itself_never_diverges():
    model = build_decoder(num_layers=2, vocab_size=300)
    shown = compare_continuations(model, model, PROMPT, max_new_tokens=6)
    assert shown.baseline == shown.candidate == KvCacheRunner(model).generate(PROMPT, 6, eos_token_id=None)
    assert shown.shared == 6
    assert "none: all 6 generated tokens identical" in shown.format_side_by_side()


def test_the_first_divergence_is_where_the_tokens_first_differ():
    base = build_decoder(num_layers=2, vocab_size=300)
    shown = compare_continuations(base, _int4(2.0), PROMPT, max_new_tokens=12)  # a coarse int4 cache
    first = next(i for i, (a, b) in enumerate(zip(shown.baseline, shown.candidate)) if a != b)
    assert shown.shared == first < 12
    text = shown.format_side_by_side()
    assert f"at generated token {first + 1} of 12 ({first} identical before it)" in text
    assert f"baseline          | '{' '.join(map(str, shown.baseline[first:]))}'" in text


def test_text_prompts_read_the_folders_tokenizer(tmp_path, capsys):
    save_genai_folder(tmp_path / "g", num_layers=2)
    assert main(["compare", str(tmp_path / "g"), str(tmp_path / "g"), "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("prompt            'The capital of France is'\n")
    assert "none: all 3 generated tokens identical" in out


def test_a_text_prompt_without_a_tokenizer_says_how():
    model = build_decoder(num_layers=2, vocab_size=300)
    with pytest.raises(KvCacheError, match="needs a tokenizer"):
        compare_continuations(model, model, "some text")


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"max_new_tokens": "3"}, KvCacheTypeError),
        ({"max_new_tokens": 0}, KvCacheError),
        ({"prompt": 3}, KvCacheTypeError),
    ],
)
def test_bad_arguments_are_one_error(kwargs, error):
    model = build_decoder(num_layers=2, vocab_size=300)
    with pytest.raises(error):
        compare_continuations(model, model, **{"prompt": PROMPT, **kwargs})


def test_continuations_of_ids_show_ids():
    shown = Continuations("1 2", [4, 5, 6], [4, 9], "float cache")
    assert shown.shared == 1
    assert np.array_equal(shown.format_side_by_side().splitlines()[1].split()[1:], ["'4'"])


class _Bytes:
    """A byte-level tokenizer: a character of several bytes is several tokens."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_texts_that_part_inside_a_character_are_cut_where_they_differ():
    """Hostile user, finding 1: each tail decoded alone showed the same replacement characters."""
    base = list("、アニ".encode())
    cand = list("、アプ".encode())
    shown = Continuations("p", base, cand, "rule", _Bytes(), len(base))
    lines = dict(line.split("  ", 1) for line in shown.format_side_by_side().splitlines())
    assert lines["both"].strip() == "'、ア'"
    assert lines["baseline"].strip() == "| 'ニ'" and lines["candidate"].strip() == "| 'プ'"
    same_text = Continuations(
        "p", [104, 105], [104, 106], "rule", type("T", (), {"decode": lambda s, i: "x"})(), 2
    )
    assert "| token ids 105" in same_text.format_side_by_side()


def test_a_model_that_stops_at_end_of_sequence_is_said_to():
    shown = Continuations("p", [4, 5, 6], [4, 2], "rule", None, 3)
    assert "candidate stopped  at end of sequence after 2 token(s)" in shown.format_side_by_side()
    assert "baseline stopped" not in shown.format_side_by_side()


def test_models_without_a_cache_or_with_another_vocabulary_are_refused():
    model = build_decoder(num_layers=2, vocab_size=300)
    with pytest.raises(KvCacheError, match=r"^The baseline has no KV cache"):
        compare_continuations(
            build_decoder(num_layers=2, vocab_size=300, no_cache_layers=(0, 1)), model, PROMPT
        )
    with pytest.raises(
        KvCacheError, match=r"differ in their KV caches \(layers, heads, windows\) or vocabulary"
    ):
        compare_continuations(build_decoder(num_layers=2), model, PROMPT)


def test_a_request_past_the_context_is_refused_before_any_run():
    short = build_decoder(num_layers=2, vocab_size=300, max_position=48)
    with pytest.raises(
        KvCacheError,
        match=r"max_new_tokens=20 after a prompt of 40 token\(s\) feeds 59 .* at most max_new_tokens=9",
    ):
        KvCacheRunner(short).generate(list(range(1, 41)), 20)
    with pytest.raises(KvCacheError, match="at most max_new_tokens=42"):
        compare_continuations(short, short, PROMPT, max_new_tokens=10**6)


def test_a_quantized_baseline_is_warned():
    from onnx_kvcache.errors import MeasurementWarning

    with pytest.warns(MeasurementWarning, match="baseline's KV cache is quantized"):
        compare_continuations(
            _int4(0.05), build_decoder(num_layers=2, vocab_size=300), PROMPT, max_new_tokens=2
        )
