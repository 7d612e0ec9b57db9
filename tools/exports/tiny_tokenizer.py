"""A tiny byte-level BPE tokenizer (no merges) for vocab 128: ids 0/1/2 are <pad>/<s>/</s>,
id b (3 <= b < 128) is ASCII byte b. Written as tokenizer.json + tokenizer_config.json +
special_tokens_map.json, which transformers, optimum and onnxruntime-genai all read."""

from __future__ import annotations

import json
import pathlib

SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>"}


def _bytes_to_unicode() -> dict[int, str]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_json() -> dict:
    alphabet = _bytes_to_unicode()
    vocab = {t: i for i, t in SPECIAL.items()} | {alphabet[b]: b for b in range(3, 128)}
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, **flags} for i, t in SPECIAL.items()],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def write(folder: str | pathlib.Path) -> None:
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "</s>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=1))
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "model_max_length": 256,
        "clean_up_tokenization_spaces": False,
        **special,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in SPECIAL.items()
        },
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
