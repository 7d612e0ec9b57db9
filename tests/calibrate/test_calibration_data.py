"""What calibration reads: token id files, text and tokenizers, the built-in corpus, too little data."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import onnx_ir as ir
import pytest
from calibration_cases import data, model  # noqa: F401  (fixtures)

import onnx_kvcache.calibrate.calibration as calibration_module
import onnx_kvcache.scales.data as data_module
from onnx_kvcache import (
    KvCacheError,
    KvCacheWarning,
    calibrate_kv_cache,
    load_kv_cache_scale_file,
)
from onnx_kvcache.cli.commands import main
from onnx_kvcache.models.decoder import byte_level_tokenizer, save_genai_folder
from onnx_kvcache.scales.data import builtin_corpus, load_token_windows, tokenize_text_file


def test_token_id_files_and_cli(tmp_path, model, data, capsys):
    path = tmp_path / "model.onnx"
    ir.save(model, path)
    (tmp_path / "ids.json").write_text(json.dumps([[int(x) for x in s] for s in data]))
    np.save(tmp_path / "ids.npy", np.asarray(data[0], np.int64))
    for ids in ("ids.json", "ids.npy"):
        out = tmp_path / f"{ids}.scales.json"
        assert (
            main(
                [
                    "calibrate",
                    str(path),
                    "--out",
                    str(out),
                    "--token-ids",
                    str(tmp_path / ids),
                    "--format",
                    "int8",
                    "--seq-len",
                    "16",
                ]
            )
            == 0
        )
        assert load_kv_cache_scale_file(out).layer_ids == (0, 1)
    assert "k clip" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text('{"not": "ids"}')
    assert (
        main(
            [
                "calibrate",
                str(path),
                "--out",
                str(tmp_path / "x.json"),
                "--token-ids",
                str(tmp_path / "bad.json"),
            ]
        )
        == 2
    )
    assert not (tmp_path / "x.json").exists()


def test_text_with_a_tokenizer(tmp_path, model):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(299)} | {"[UNK]": 299}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text.txt").write_text(" ".join(f"w{i % 50}" for i in range(300)))
    scales = calibrate_kv_cache(
        model, tmp_path / "text.txt", tokenizer=tmp_path / "tokenizer.json", progress=False
    )
    assert scales.metadata["tokens"] == 300
    assert scales.metadata["data"] == f"text from text.txt, tokenizer {tmp_path / 'tokenizer.json'}"


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("meta-llama/Llama-3.2-1B", "{HUB} does not exist; {WANTED} (hub ids are not downloaded)."),
        ("{tmp}", "Tokenizer {tmp}/tokenizer.json does not exist; {WANTED}."),
        ("/dev/null", "Tokenizer /dev/null is a character device, not a tokenizer.json file; {WANTED}."),
    ],
)
def test_a_tokenizer_that_is_no_local_file_says_what_is_wanted(tmp_path, model, given, said):
    """A hub id was said only not to exist; the user was not told a local tokenizer.json (or its
    folder) is wanted and nothing is downloaded."""
    from onnx_kvcache.errors import KvCacheFileNotFoundError

    words = {
        "tmp": str(tmp_path),
        "HUB": "Tokenizer meta-llama/Llama-3.2-1B",
        "WANTED": "give a local tokenizer.json or a folder holding one",
    }
    kind = KvCacheFileNotFoundError if "exist" in said else KvCacheError
    with pytest.raises(kind) as caught:
        calibrate_kv_cache(model, tokenizer=given.format(**words), progress=False)
    assert str(caught.value) == said.format(**words)


def test_builtin_corpus_through_the_folders_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from onnx_kvcache.scales.data import corpus_byte_ids

    folder = save_genai_folder(tmp_path / "demo", num_layers=2)
    scales = calibrate_kv_cache(folder, format="int8", progress=False)
    assert scales.metadata["tokens"] == len(corpus_byte_ids())  # the byte-level tokenizer's ids


def test_without_a_tokenizer_random_tokens_warn_and_are_recorded(model):
    with pytest.warns(
        KvCacheWarning, match="No tokenizer found: calibrating on seeded random token ids"
    ) as said:
        scales = calibrate_kv_cache(model, format="int8", seq_len=32, progress=False)
    assert any("Give the model's tokenizer (tokenizer=PATH: " in str(w.message) for w in said)
    assert scales.metadata["tokens"] == 8 * 32
    assert scales.metadata["data"] == "seeded random token ids (no tokenizer)"


@pytest.mark.parametrize(
    ("data", "kwargs", "message"),
    [
        ([[1, 2, 3]], {}, r"has 3 token\(s\) \(given token ids\); scales need at least 256"),
        (None, {"num_seqs": 0}, "num_seqs must be >= 1"),
        (None, {"num_seqs": -1}, "num_seqs must be >= 1"),
        ("empty.txt", {}, "holds no tokens"),
    ],
)
def test_too_little_data_is_an_error(tmp_path, model, data, kwargs, message):
    pytest.importorskip("tokenizers")
    if data == "empty.txt":
        (tmp_path / "empty.txt").write_text("")
        (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer()))
        kwargs["tokenizer"] = tmp_path / "tokenizer.json"
        data = tmp_path / "empty.txt"
    with pytest.raises(KvCacheError, match=message):
        calibrate_kv_cache(model, data, progress=False, **kwargs)


def test_text_without_a_tokenizer_is_an_error(tmp_path, model):
    (tmp_path / "t.txt").write_text("some text")
    with pytest.raises(KvCacheError, match="needs a tokenizer"):
        calibrate_kv_cache(model, tmp_path / "t.txt", progress=False)


def test_a_margin_that_breaks_the_scales_is_caught(model, data):
    with pytest.raises(KvCacheError, match=r"overflow float32.*use a margin near 1"):
        calibrate_kv_cache(model, data, format="int8", margin=1e300, progress=False)
    with pytest.warns(KvCacheWarning, match=r"clip 100.0% of layer .* beyond .* check margin=1e-50"):
        calibrate_kv_cache(model, data, format="int8", margin=1e-50, progress=False)


def test_a_tokenizer_file_that_is_not_one_is_an_error(tmp_path, model):
    pytest.importorskip("tokenizers")
    (tmp_path / "notes.txt").write_text("plain words")
    with pytest.raises(KvCacheError, match=r"is not a tokenizers tokenizer\.json"):
        calibrate_kv_cache(model, tmp_path / "notes.txt", tokenizer=tmp_path / "notes.txt", progress=False)


@pytest.mark.parametrize(("fmt", "noted"), [("fp8", False), ("int8", True), ("int4", False)])
def test_the_integer_rounding_note_is_printed_for_integer_formats_only(tmp_path, model, capsys, fmt, noted):
    """Only for minmax (int8's default; int4's is attention, tests/cli/test_commands_voice.py)."""
    ir.save(model, tmp_path / "model.onnx")
    argv = ["calibrate", str(tmp_path / "model.onnx"), "--out", str(tmp_path / "s.json"), "--format", fmt]
    assert main([*argv, "--seq-len", "64", "--num-seqs", "4", "--min-tokens", "64", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "k clip" in out and ("minmax clips int8/int4" in out) is noted


@pytest.mark.parametrize(
    ("kind", "message"),
    [("folder", "is a folder"), ("fifo", "is a FIFO"), ("dangling", "broken symbolic link")],
)
@pytest.mark.parametrize("argument", ["data", "tokenizer"])
def test_data_and_tokenizer_files_are_checked_before_the_model_loads(
    tmp_path, monkeypatch, kind, message, argument
):
    """A FIFO or folder given as the data or tokenizer cost the whole model load first."""
    path = tmp_path / "given.txt"
    if kind == "folder":
        path.mkdir()
        (path / "tokenizer.json").mkdir()  # a tokenizer folder whose tokenizer.json is a folder
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(tmp_path / "nowhere")

    def no_runner(*args, **kwargs):
        raise AssertionError("the model was loaded before the input files were checked")

    monkeypatch.setattr(calibration_module, "KvCacheRunner", no_runner)
    with pytest.raises(KvCacheError, match=message):
        calibrate_kv_cache(tmp_path / "model.onnx", **{argument: str(path)})


@pytest.mark.parametrize("margin", [float("inf"), float("nan")])
def test_a_non_finite_margin_is_refused(margin):
    with pytest.raises(KvCacheError, match="margin must be > 0 and finite"):
        calibrate_kv_cache("model.onnx", margin=margin)


def _ngrams(windows, n):
    return {tuple(w[i : i + n]) for w in windows for i in range(len(w) - n + 1)}


@pytest.mark.parametrize("tokenized", [True, False], ids=["corpus", "random ids"])
def test_evaluations_default_data_is_disjoint_from_calibrations(tmp_path, tokenized):
    """Without data, evaluation never scores what calibration measured: another part of the
    corpus (no 16-token run in common), or random ids of another seed."""
    from onnx_kvcache.scales.data import load_token_windows

    if tokenized:
        pytest.importorskip("tokenizers")
        model = save_genai_folder(tmp_path / "demo", num_layers=2)  # a byte-level tokenizer.json
    else:
        model = None
    loaded = {
        purpose: load_token_windows(None, model=model, seq_len=64, vocab_size=300, purpose=purpose)
        for purpose in ("calibration", "evaluation")
    }
    calibration, evaluation = loaded["calibration"], loaded["evaluation"]
    assert calibration.tokens >= 256 and evaluation.tokens >= 256
    assert not _ngrams([w.tolist() for w in calibration.windows], 16) & _ngrams(
        [w.tolist() for w in evaluation.windows], 16
    )
    assert evaluation.held_out and not calibration.held_out
    assert calibration.random is evaluation.random is (not tokenized)
    assert calibration.source != evaluation.source


def test_the_corpus_parts_share_no_sentence():
    from onnx_kvcache.scales.data import CORPUS_PARTS, builtin_corpus

    parts = {part: builtin_corpus(part) for part in CORPUS_PARTS}
    sentences = {
        part: {s.strip() for s in text.replace("\n", " ").split(". ") if len(s.strip()) > 20}
        for part, text in parts.items()
    }
    assert not sentences["calibration"] & sentences["evaluation"]
    assert all(len(text.encode()) > 4000 for text in parts.values())
    assert "===" not in "".join(parts.values())  # the part lines are no text of either
    assert builtin_corpus() == parts["calibration"]  # calibration's default, as before
    with pytest.raises(KvCacheError, match="Unknown corpus part 'test'; choose one of calibration, eval"):
        builtin_corpus("test")


def test_given_data_is_read_whatever_the_purpose(tmp_path):
    from onnx_kvcache.scales.data import load_token_windows

    data = [list(range(40))]
    for purpose in ("calibration", "evaluation"):
        loaded = load_token_windows(data, seq_len=16, purpose=purpose)
        assert [w.tolist() for w in loaded.windows] == [data[0][:16], data[0][16:32], data[0][32:]]
        assert not loaded.held_out and loaded.source == "given token ids"
    with pytest.raises(KvCacheError, match="Unknown data purpose 'test'; choose one of calibration, eval"):
        load_token_windows(data, purpose="test")


PRODUCER_TOKENIZERS = [
    pathlib.Path(__file__).parents[1] / "data" / "producers" / folder / "llama" / "tokenizer.json"
    for folder in ("optimum/optimum-cli", "genai-builder/genai-builder-cpu-fp32")
]


@pytest.mark.parametrize("tokenizer", PRODUCER_TOKENIZERS, ids=["optimum", "genai-builder"])
@pytest.mark.parametrize("piece_chars", [300, 5000])
def test_a_text_file_is_encoded_in_pieces_with_the_ids_of_one_encoding(
    tmp_path, monkeypatch, tokenizer, piece_chars
):
    """A 225 MB --text file held ~15 GB (one encoding of the whole text); now it is encoded a
    piece at a time, each cut at a line break between words, so the ids are the same."""
    tokenizers = pytest.importorskip("tokenizers")
    text = builtin_corpus("calibration") + " tail  \n\n  spaced\n \nend"
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    whole = tokenizers.Tokenizer.from_file(str(tokenizer)).encode(text).ids
    monkeypatch.setattr(data_module, "TEXT_PIECE_CHARS", piece_chars)
    ids = tokenize_text_file(tmp_path / "text.txt", tokenizer)
    assert ids.dtype == np.int64 and ids.tolist() == whole
    assert tokenize_text_file(tmp_path / "text.txt", tokenizer, limit=700).tolist() == whole[:700]


def test_a_text_file_is_read_only_as_far_as_the_windows_asked_for_need(tmp_path, monkeypatch):
    """num_seqs windows need num_seqs * seq_len ids: the text past them is never read (here a
    byte that is no UTF-8 near the end is an error only when everything is wanted)."""
    pytest.importorskip("tokenizers")
    monkeypatch.setattr(data_module, "TEXT_PIECE_CHARS", 4096)
    path = tmp_path / "big.txt"
    path.write_bytes(b"some words on a line\n" * 150_000 + b"\xff")  # 3.1 MB, 3 chunks of 1 MiB
    tokenizer = PRODUCER_TOKENIZERS[0]
    loaded = load_token_windows(str(path), seq_len=64, num_seqs=3, tokenizer=tokenizer)
    assert [len(w) for w in loaded.windows] == [64, 64, 64]
    with pytest.raises(
        KvCacheError, match=rf"^{path}: not UTF-8 text \(byte 3150000\); give a UTF-8 text file\.$"
    ):
        load_token_windows(str(path), seq_len=64, tokenizer=tokenizer)


def test_token_ids_past_the_vocabulary_name_their_file_and_the_fix(tmp_path, model):
    """review37: "Token ids must be in [0, 128), found 0..299." named neither the file nor a fix."""
    (tmp_path / "ids.json").write_text(json.dumps([list(range(400))]))
    with pytest.raises(KvCacheError) as caught:
        calibrate_kv_cache(model, tmp_path / "ids.json", progress=False)
    assert str(caught.value) == (
        "Token ids must be in [0, 300) (the model's vocabulary), found 0..399 (token ids from ids.json): "
        "give ids of this model's tokenizer."
    )


def test_a_json_token_id_file_past_the_bound_is_refused_before_it_is_parsed(tmp_path, model, monkeypatch):
    """review37: a 40 MB JSON id file held 1.8 GB while parsed (a 200 MB one, ~9 GB); past
    MAX_JSON_IDS_BYTES it is refused unread, the .npy of the same ids is read."""
    ids = np.random.default_rng(2).integers(0, 300, 600)
    (tmp_path / "ids.json").write_text(json.dumps([ids.tolist()]))
    np.save(tmp_path / "ids.npy", ids)
    monkeypatch.setattr(data_module, "MAX_JSON_IDS_BYTES", 1000)
    monkeypatch.setattr(data_module, "load_json", _never_parsed)
    with pytest.raises(
        KvCacheError, match=r"of JSON, more than the 1000 bytes read as JSON .*save the ids as \.npy"
    ):
        load_token_windows(str(tmp_path / "ids.json"), seq_len=64)
    assert load_token_windows(str(tmp_path / "ids.npy"), seq_len=64).tokens == 600


def _never_parsed(*args, **kwargs):
    raise AssertionError("the JSON was parsed")
