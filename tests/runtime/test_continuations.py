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
    assert out.startswith("prompt            The capital of France is\n")
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
