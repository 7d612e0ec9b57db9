"""Token data for calibration and evaluation: id files, text, the built-in corpus.

Text is tokenized with the ``tokenizers`` library from a ``tokenizer.json`` (the
``text`` extra): one given explicitly, or the one beside the model. Without data the
built-in corpus is used when a tokenizer is found, else seeded random token ids within
the model's vocabulary, and the caller is told which.

The defaults are disjoint by purpose (:data:`DEFAULT_DATA`, one row each): calibration
reads the corpus's calibration part and random ids of seed 0, evaluation its evaluation
part (held out: text calibration never reads) and random ids of seed 1, so a default
evaluation never scores the windows a default calibration measured.
"""

from __future__ import annotations

__all__ = [
    "CORPUS_PARTS",
    "RANDOM_WINDOWS",
    "DEFAULT_DATA",
    "DefaultData",
    "TokenData",
    "TokenWindows",
    "builtin_corpus",
    "corpus_byte_ids",
    "find_tokenizer",
    "load_token_windows",
    "load_tokenizer",
    "tokenize_text",
    "tokenize_text_file",
]

import codecs
import dataclasses
import importlib.resources
import logging
import os
import pathlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_kvcache.errors import (
    INTEGER,
    KvCacheError,
    KvCacheTypeError,
    Param,
    missing_dependency,
    require_type,
)
from onnx_kvcache.model_io import (
    check_input_file,
    format_bytes,
    load_json,
    load_npy_integers,
    read_input_bytes,
    read_input_chunks,
    shown_shape,
    tokenizer_file,
)

logger = logging.getLogger(__name__)

TokenData = Sequence[Sequence[int]] | str | os.PathLike | None

MAX_TOKEN_ID = 2**31 - 1
"""Token ids are int32 or int64 model inputs; every vocabulary fits int32."""

RANDOM_WINDOWS = 8
"""Windows of random ids generated when no data, no tokenizer and no ``num_seqs`` are given."""


CORPUS_PARTS = ("calibration", "evaluation")
"""The parts of ``corpus.txt``, in file order: the first runs from the top, each other one
from a line ``=== NAME ===``."""

_PART_LINE = re.compile(r"\n=== (\w+) ===\n")


@dataclasses.dataclass(frozen=True)
class DefaultData:
    """What one purpose reads when it is given no data."""

    purpose: str
    corpus_part: str
    """The part of the built-in corpus it tokenizes (:data:`CORPUS_PARTS`)."""
    seed: int
    """The seed of its random token ids (no tokenizer found)."""
    corpus_source: str
    random_source: str
    held_out: bool
    """Disjoint from calibration's default data: another corpus part and another seed."""


DEFAULT_DATA: Mapping[str, DefaultData] = {
    row.purpose: row
    for row in (
        DefaultData(
            "calibration",
            "calibration",
            0,
            "built-in corpus",
            "seeded random token ids (no tokenizer)",
            False,
        ),
        DefaultData(
            "evaluation",
            "evaluation",
            1,
            "built-in corpus, evaluation part",
            "seeded random token ids (no tokenizer, evaluation seed)",
            True,
        ),
    )
}


def builtin_corpus(part: str = "calibration") -> str:
    """A part of the multi-domain English corpus written for this project (prose, code,
    dialogue, law, medicine, maths, SQL): ``calibration`` (calibration's default data) or
    ``evaluation`` (evaluation's default, held out from calibration)."""
    if part not in CORPUS_PARTS:
        raise KvCacheError(f"Unknown corpus part {part!r}; choose one of {', '.join(CORPUS_PARTS)}.")
    text = importlib.resources.files("onnx_kvcache.scales").joinpath("corpus.txt").read_text("utf-8")
    pieces = _PART_LINE.split(text)
    parts = dict(zip([CORPUS_PARTS[0], *pieces[1::2]], pieces[0::2]))
    return parts[part]


def corpus_byte_ids(part: str = "calibration") -> list[int]:
    """A part of the built-in corpus as byte-level token ids (the demo decoder's own tokenizer)."""
    return list(builtin_corpus(part).encode("utf-8"))


def find_tokenizer(model: Any = None, tokenizer: str | os.PathLike | None = None) -> pathlib.Path | None:
    """``tokenizer.json`` given explicitly, or beside a model folder/file."""
    if tokenizer is not None:
        require_type(tokenizer, (str, os.PathLike), "tokenizer", "a path")
        return tokenizer_file(tokenizer)
    if isinstance(model, (str, os.PathLike)):
        p = pathlib.Path(model)
        folder = p if p.is_dir() else p.parent
        beside = folder / "tokenizer.json"
        if os.path.lexists(beside):  # there but not a regular file: said, not taken as no tokenizer
            return check_input_file(beside, "Tokenizer", expected="a tokenizer.json file")
    return None


def load_tokenizer(tokenizer: pathlib.Path | None) -> Any:
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json``; an error without one."""
    if tokenizer is None:
        raise KvCacheError(
            "Text data needs a tokenizer: pass ",
            Param("tokenizer", placeholder="PATH"),
            " (a tokenizer.json), use a model folder that has one, or give token ids instead.",
        )
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise missing_dependency(
            e, "Tokenizing text needs the tokenizers library: pip install 'onnx-kvcache[text]'."
        ) from e
    raw = read_input_bytes(tokenizer, "Tokenizer", expected="a tokenizer.json file")
    try:
        return Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises its own untyped Exception
        raise KvCacheError(f"{tokenizer} is not a tokenizers tokenizer.json ({e}).") from None


def tokenize_text(text: str, tokenizer: pathlib.Path | None) -> list[int]:
    """Token ids of ``text`` with a ``tokenizer.json``; an error without one."""
    return list(load_tokenizer(tokenizer).encode(text).ids)


#: Characters of text tokenized at once: ``tokenizers`` holds ~300 bytes per character of the
#: text it encodes (tokens, offsets, masks), so a file is encoded a piece at a time.
TEXT_PIECE_CHARS = 1 << 16


def _piece_end(text: str) -> int:
    """Where a piece of ``text`` can end: after its last newline between two characters that
    are not whitespace (a pre-tokenizer splits there anyway), else 0."""
    end = len(text) - 1
    while (at := text.rfind("\n", 1, end)) > 0:
        if not (text[at - 1].isspace() or text[at + 1].isspace()):
            return at + 1
        end = at
    return 0


def _text_pieces(path: pathlib.Path, piece_chars: int) -> Iterator[str]:
    """The text of a UTF-8 file in pieces of about ``piece_chars`` or more, each ending as
    :func:`_piece_end` says (a text without such a newline: every ``4 * piece_chars``)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending, offset = "", 0
    for chunk in read_input_chunks(path, "Text file", expected="a text file"):
        try:
            pending += decoder.decode(chunk)
        except UnicodeDecodeError as e:
            raise KvCacheError(
                f"{path}: not UTF-8 text (byte {offset + e.start}); give a UTF-8 text file."
            ) from None
        offset += len(chunk)
        while len(pending) >= piece_chars:
            cut = _piece_end(pending) or (len(pending) if len(pending) >= 4 * piece_chars else 0)
            if not cut:
                break
            yield pending[:cut]
            pending = pending[cut:]
    try:
        pending += decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise KvCacheError(
            f"{path}: not UTF-8 text (it ends inside a character); give a UTF-8 text file."
        ) from None
    if pending:
        yield pending


def tokenize_text_file(
    path: pathlib.Path, tokenizer: pathlib.Path | None, *, limit: int | None = None
) -> np.ndarray:
    """Token ids of a UTF-8 text file, read and encoded a piece at a time
    (:data:`TEXT_PIECE_CHARS`) and only until ``limit`` ids are found: memory holds the ids
    (8 bytes each), never the whole text's encoding. The tokenizer's special tokens (a BOS)
    are added to the first piece only, as one encoding of the whole text adds them; a piece
    ends between words at a line break, so the ids are those of one encoding, but for a
    tokenizer that marks the start of a text (SentencePiece's ``▁``) on each piece's first word."""
    loaded = load_tokenizer(tokenizer)
    found: list[np.ndarray] = []
    count = 0
    for i, piece in enumerate(_text_pieces(path, TEXT_PIECE_CHARS)):
        ids = np.asarray(loaded.encode(piece, add_special_tokens=i == 0).ids, np.int64)
        found.append(ids)
        count += ids.size
        if limit is not None and count >= limit:
            break
    ids = np.concatenate(found) if found else np.zeros(0, np.int64)
    return ids if limit is None else ids[:limit]


def _out_of_range(where: str, bad: int, i: int) -> KvCacheError:
    return KvCacheError(
        f"{where}: token id {bad} (sequence {i}) is outside 0..{MAX_TOKEN_ID}, the ids a model takes."
    )


def _checked_ids(sequences: list[np.ndarray], where: str) -> list[np.ndarray]:
    """Each sequence as int64, after checking every id is in [0, MAX_TOKEN_ID]."""
    for i, ids in enumerate(sequences):
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > MAX_TOKEN_ID):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise _out_of_range(where, bad, i)
    return [ids.astype(np.int64) for ids in sequences]


def _as_id_sequence(seq: Any, i: int, where: str) -> np.ndarray:
    """One sequence of given token ids as a 1-D integer array; floats, bools, nested lists
    and huge numbers refused (never truncated or wrapped)."""
    if isinstance(seq, np.ndarray):
        array = seq
    elif isinstance(seq, (str, bytes, Mapping)) or not isinstance(seq, Sequence):
        raise KvCacheTypeError(
            f"{where}: sequence {i} is a {type(seq).__name__}; give a list of integer token ids per sequence."
        )
    else:
        for x in seq:
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                kind = "a list" if isinstance(x, (list, tuple, np.ndarray)) else f"{x!r:.40}"
                raise KvCacheTypeError(
                    f"{where}: sequence {i} holds {kind}; token ids are integers, one list of them per "
                    "sequence (floats are not truncated)."
                )
            if not 0 <= int(x) <= MAX_TOKEN_ID:
                raise _out_of_range(where, int(x), i)
        array = np.asarray(seq, np.int64)
    if array.dtype.kind not in "iu":
        raise KvCacheTypeError(f"{where}: sequence {i} is a {array.dtype} array; token ids are integers.")
    if array.ndim != 1:
        raise KvCacheError(
            f"{where}: sequence {i} is {array.ndim}-D (shape {shown_shape(array.shape)}); each "
            "sequence is a 1-D list of "
            "token ids (the data: a list of such lists, or a 2-D array)."
        )
    return array


#: The largest JSON token-id file read (some 8M ids): parsing one holds ~45 bytes a byte of it
#: (1.8 GB for 40 MB); a .npy file of any size is read as the array it is.
MAX_JSON_IDS_BYTES = 32 << 20


def _read_ids_file(path: pathlib.Path) -> list[np.ndarray]:
    where = f"Token-id file {path}"
    if path.suffix == ".npy":
        array = load_npy_integers(path, "Token-id file")
        return _checked_ids(list(np.atleast_2d(array)), where)
    size = check_input_file(path, "Token-id file", missing="does not exist").stat().st_size
    if size > MAX_JSON_IDS_BYTES:
        raise KvCacheError(
            f"{where} is {format_bytes(size)} of JSON, more than the {format_bytes(MAX_JSON_IDS_BYTES)} "
            "read as JSON (parsing holds some 45 bytes a byte of it): save the ids as .npy (numpy.save), "
            "read without parsing."
        )
    doc = load_json(path, "Token-id file")
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
    return [_as_id_sequence(s, i, where) for i, s in enumerate(doc)]


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Token windows and where they came from."""

    windows: list[np.ndarray]
    source: str
    """``given token ids``, ``text file NAME``, ``built-in corpus, model tokenizer`` or
    ``seeded random token ids (no tokenizer)`` (a :data:`DEFAULT_DATA` row's words)."""
    random: bool = False
    """The ids are random (no tokenizer was found): fine for a smoke test only."""
    held_out: bool = False
    """The windows are evaluation's default data, disjoint from calibration's default."""

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
    seed: int | None = None,
    purpose: str = "calibration",
) -> TokenWindows:
    """Token windows of at most ``seq_len`` ids from sequences, files or, without data, the
    ``purpose``'s default (:data:`DEFAULT_DATA`: its corpus part, or random ids of its seed
    unless ``seed`` is given)."""
    if purpose not in DEFAULT_DATA:
        raise KvCacheError(f"Unknown data purpose {purpose!r}; choose one of {', '.join(DEFAULT_DATA)}.")
    default = DEFAULT_DATA[purpose]
    require_type(seq_len, INTEGER, "seq_len", "an integer")
    require_type(num_seqs, (*INTEGER, type(None)), "num_seqs", "an integer or None")
    if seq_len < 1:
        raise KvCacheError(f"seq_len must be >= 1, got {seq_len}.")
    if num_seqs is not None and num_seqs < 1:
        raise KvCacheError(f"num_seqs must be >= 1 (or None for all), got {num_seqs}.")
    random = False
    sequences: list[np.ndarray]
    if data is None or isinstance(data, (str, os.PathLike)):
        tok = find_tokenizer(model, tokenizer)
        if data is None:
            if tok is None:
                if vocab_size is None:
                    raise KvCacheError("No data, no tokenizer and no known vocabulary size: give token ids.")
                rng = np.random.default_rng(default.seed if seed is None else seed)
                sequences = [rng.integers(0, vocab_size, seq_len) for _ in range(num_seqs or RANDOM_WINDOWS)]
                source, random = default.random_source, True
            else:
                sequences = [np.asarray(tokenize_text(builtin_corpus(default.corpus_part), tok), np.int64)]
                source = f"{default.corpus_source}, " + (
                    "model tokenizer" if tokenizer is None else f"tokenizer {tok}"
                )
        else:
            path = check_input_file(data, "Data file", missing="does not exist")
            if path.suffix in (".json", ".npy"):
                sequences, source = _read_ids_file(path), f"token ids from {path.name}"
            else:
                limit = None if num_seqs is None else num_seqs * seq_len
                sequences = [tokenize_text_file(path, tok, limit=limit)]
                source = f"text from {path.name}"
                if tokenizer is not None:
                    source += f", tokenizer {tok}"
            if not any(s.size for s in sequences):
                raise KvCacheError(f"{path} holds no tokens; give a file with text or token ids.")
    else:
        if isinstance(data, np.ndarray):
            if data.ndim not in (1, 2):
                raise KvCacheError(
                    f"Token data is a {data.ndim}-D array (shape {shown_shape(data.shape)}); give a 2-D "
                    "array of "
                    "sequences or a list of id lists."
                )
            data = np.atleast_2d(data)
        elif isinstance(data, (bytes, Mapping)) or not isinstance(data, Sequence):
            raise KvCacheTypeError(
                "Token data must be a list of token-id lists, a file path or None, got "
                f"{type(data).__name__}."
            )
        where = "Token data"
        sequences = _checked_ids([_as_id_sequence(s, i, where) for i, s in enumerate(data)], where)
        if not sequences or not all(s.size for s in sequences):
            raise KvCacheError("Token data must be a non-empty list of non-empty id sequences.")
        source = "given token ids"
    windows = []
    for ids in sequences:
        if not ids.size:
            continue
        if vocab_size is not None and (ids.min() < 0 or ids.max() >= vocab_size):
            raise KvCacheError(
                f"Token ids must be in [0, {vocab_size}) (the model's vocabulary), found "
                f"{ids.min()}..{ids.max()} ({source}): give ids of this model's tokenizer."
            )
        windows += [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    held_out = data is None and default.held_out
    return TokenWindows(windows[:num_seqs] if num_seqs else windows, source, random, held_out)
