"""Token data for calibration and evaluation: id files, text, the built-in corpus.

Text is tokenized with the ``tokenizers`` library from a ``tokenizer.json`` (the
``text`` extra): one given explicitly, or the one beside the model. Without data the
built-in corpus is used when a tokenizer is found, else seeded random token ids within
the model's vocabulary, and the caller is told which.
"""

from __future__ import annotations

__all__ = [
    "TokenData",
    "TokenWindows",
    "builtin_corpus",
    "corpus_byte_ids",
    "find_tokenizer",
    "load_token_windows",
    "tokenize_text",
]

import dataclasses
import importlib.resources
import json
import logging
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnx_kvcache.errors import KvCacheError, MissingRuntimeError

logger = logging.getLogger(__name__)

TokenData = Sequence[Sequence[int]] | str | os.PathLike | None


def builtin_corpus() -> str:
    """A multi-domain English corpus written for this project (prose, code, dialogue)."""
    return importlib.resources.files("onnx_kvcache").joinpath("corpus.txt").read_text("utf-8")


def corpus_byte_ids() -> list[int]:
    """The built-in corpus as byte-level token ids (the demo decoder's own tokenizer)."""
    return list(builtin_corpus().encode("utf-8"))


def find_tokenizer(model: Any = None, tokenizer: str | os.PathLike | None = None) -> pathlib.Path | None:
    """``tokenizer.json`` given explicitly, or beside a model folder/file."""
    if tokenizer is not None:
        p = pathlib.Path(tokenizer)
        p = p / "tokenizer.json" if p.is_dir() else p
        if not p.is_file():
            raise KvCacheError(f"Tokenizer {p} does not exist.")
        return p
    if isinstance(model, (str, os.PathLike)):
        p = pathlib.Path(model)
        folder = p if p.is_dir() else p.parent
        if (folder / "tokenizer.json").is_file():
            return folder / "tokenizer.json"
    return None


def tokenize_text(text: str, tokenizer: pathlib.Path | None) -> list[int]:
    """Token ids of ``text`` with a ``tokenizer.json``; an error without one."""
    if tokenizer is None:
        raise KvCacheError(
            "Text data needs a tokenizer: pass tokenizer=PATH (a tokenizer.json), use a "
            "model folder that has one, or give token ids instead."
        )
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise MissingRuntimeError(
            "Tokenizing text needs the tokenizers library: pip install 'onnx-kvcache[text]'."
        ) from e
    try:
        loaded = Tokenizer.from_file(str(tokenizer))
    except Exception as e:  # tokenizers raises its own untyped Exception
        raise KvCacheError(f"{tokenizer} is not a tokenizers tokenizer.json ({e}).") from None
    return list(loaded.encode(text).ids)


def _read_ids_file(path: pathlib.Path) -> list[list[int]]:
    if path.suffix == ".npy":
        array = np.load(path, allow_pickle=False)
        if array.dtype.kind not in "iu" or array.ndim not in (1, 2):
            raise KvCacheError(f"{path}: expected a 1-D or 2-D integer array of token ids.")
        return [list(map(int, row)) for row in np.atleast_2d(array)]
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise KvCacheError(f"{path}: not valid JSON ({e}).") from None
    if isinstance(doc, list) and doc and all(isinstance(x, int) for x in doc):
        doc = [doc]
    if not (
        isinstance(doc, list)
        and doc
        and all(
            isinstance(s, list) and s and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
            for s in doc
        )
    ):
        raise KvCacheError(f"{path}: expected a list of token ids or a list of such lists.")
    return doc


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Token windows and where they came from."""

    windows: list[np.ndarray]
    source: str
    """``given token ids``, ``text file NAME``, ``built-in corpus, model tokenizer`` or
    ``seeded random token ids (no tokenizer)``."""
    random: bool = False
    """The ids are random (no tokenizer was found): fine for a smoke test only."""

    @property
    def tokens(self) -> int:
        return sum(len(w) for w in self.windows)


def load_token_windows(
    data: TokenData,
    *,
    model: Any = None,
    seq_len: int = 512,
    num_seqs: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
) -> TokenWindows:
    """Token windows of at most ``seq_len`` ids from sequences, files or the corpus."""
    if seq_len < 1:
        raise KvCacheError(f"seq_len must be >= 1, got {seq_len}.")
    if num_seqs is not None and num_seqs < 1:
        raise KvCacheError(f"num_seqs must be >= 1 (or None for all), got {num_seqs}.")
    random = False
    if data is None or isinstance(data, (str, os.PathLike)):
        tok = find_tokenizer(model, tokenizer)
        if data is None:
            if tok is None:
                if vocab_size is None:
                    raise KvCacheError("No data, no tokenizer and no known vocabulary size: give token ids.")
                rng = np.random.default_rng(seed)
                sequences = [list(rng.integers(0, vocab_size, seq_len)) for _ in range(num_seqs or 8)]
                source, random = "seeded random token ids (no tokenizer)", True
            else:
                sequences = [tokenize_text(builtin_corpus(), tok)]
                source = "built-in corpus, " + (
                    "model tokenizer" if tokenizer is None else f"tokenizer {tok}"
                )
        else:
            path = pathlib.Path(data)
            if not path.is_file():
                raise KvCacheError(f"Data file {path} does not exist.")
            if path.suffix in (".json", ".npy"):
                sequences, source = _read_ids_file(path), f"token ids from {path.name}"
            else:
                try:
                    text = path.read_text(encoding="utf-8")
                except UnicodeDecodeError as e:
                    raise KvCacheError(f"{path}: not UTF-8 text ({e}).") from None
                sequences, source = [tokenize_text(text, tok)], f"text from {path.name}"
                if tokenizer is not None:
                    source += f", tokenizer {tok}"
            if not any(sequences):
                raise KvCacheError(f"{path} holds no tokens; give a file with text or token ids.")
    else:
        sequences = [list(s) for s in data]
        if not sequences or not all(sequences):
            raise KvCacheError("Token data must be a non-empty list of non-empty id sequences.")
        source = "given token ids"
    windows = []
    for seq in sequences:
        ids = np.asarray(seq, np.int64)
        if not ids.size:
            continue
        if vocab_size is not None and (ids.min() < 0 or ids.max() >= vocab_size):
            raise KvCacheError(f"Token ids must be in [0, {vocab_size}), found {ids.min()}..{ids.max()}.")
        windows += [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    return TokenWindows(windows[:num_seqs] if num_seqs else windows, source, random)
