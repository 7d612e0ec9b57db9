"""onnxruntime-genai folders: everything the library knows about them in one place.

A genai folder holds ``genai_config.json`` (:data:`GENAI_CONFIG`), the decoder it names
(``model.decoder.filename``), its data files and tokenizer files. This module reads the
config and the rules we apply to it: which file is the decoder, which end-of-sequence
tokens and execution providers it names, a paged model's block size, and the
``search.past_present_share_buffer`` a quantized cache needs on a provider.
"""

from __future__ import annotations

__all__ = [
    "GENAI_CONFIG",
    "block_size",
    "decoder_filename",
    "eos_token_ids",
    "pad_token_id",
    "provider_names",
    "read_genai_config",
    "resolve_model_path",
    "share_buffer",
    "with_share_buffer",
]

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from onnx_kvcache.errors import KvCacheError, require_type
from onnx_kvcache.model_io._atomic import check_relative
from onnx_kvcache.model_io._inputs import check_input_file, input_kind, load_json

GENAI_CONFIG = "genai_config.json"
_MAX_CONFIG_BYTES = 64 * 2**20


def read_genai_config(path: pathlib.Path) -> dict[str, Any]:
    """The config as a dict; one clear error for a folder, a FIFO or device, bad encoding
    or bad JSON (:func:`~onnx_kvcache.model_io._inputs.load_json`'s bounds)."""
    config = load_json(path, "onnxruntime-genai config", max_bytes=_MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise KvCacheError(f"{path} is not a JSON object.")
    return config


def decoder_filename(config: dict[str, Any], config_path: pathlib.Path) -> str:
    """``model.decoder.filename``, after checking the parts of the config we read or write."""
    try:
        filename = config["model"]["decoder"]["filename"]
    except (KeyError, TypeError):
        raise KvCacheError(f"{config_path}: cannot read model.decoder.filename.") from None
    for key, value in [
        ("model.decoder", config["model"]["decoder"]),
        ("model.decoder.session_options", config["model"]["decoder"].get("session_options", {})),
        ("search", config.get("search", {})),
    ]:
        if not isinstance(value, dict):
            raise KvCacheError(f"{config_path}: {key} is not a JSON object, as onnxruntime-genai needs.")
    folder = config_path.parent
    check_relative(filename, f"{config_path}'s model.decoder.filename", folder)
    for key, section in config["model"].items():  # vision, speech, embedding models
        if isinstance(section, dict) and "filename" in section:
            check_relative(section["filename"], f"{config_path}'s model.{key}.filename", folder)
    return str(filename)


def _names(files: list[pathlib.Path]) -> str:
    return ", ".join(f.name for f in files[:6]) + (", ..." if len(files) > 6 else "")


def _found_hint(folder: pathlib.Path, files: list[pathlib.Path]) -> str:
    """The model files the folder holds, or those of its ``onnx/`` subfolder (the
    onnx-community layout: config.json at the root, the models in ``onnx/``)."""
    if files:
        return f" ({_names(files)})"
    sub = folder / "onnx"
    found = (
        sorted(f for f in sub.glob("*.onnx") if input_kind(f) is None)
        if input_kind(sub) == "a folder"
        else []
    )
    if not found:
        return ""
    example = sub / found[0].name
    return f"; its onnx/ subfolder (the onnx-community layout) holds {_names(found)} (e.g. {example})"


def resolve_model_path(path: str | os.PathLike) -> tuple[pathlib.Path, dict[str, Any] | None]:
    """The ``.onnx`` file for a file or onnxruntime-genai folder, and the genai config."""
    require_type(path, (str, os.PathLike), "The model", "a path (str or os.PathLike) here")
    if not os.fspath(path):  # pathlib reads "" as "."
        raise KvCacheError("The model's path is empty: name a .onnx file or an onnxruntime-genai folder.")
    p = pathlib.Path(path)
    kind = input_kind(p)
    if kind == "a folder":
        config_path = p / GENAI_CONFIG
        if not os.path.lexists(config_path):
            onnx_files = sorted(f for f in p.glob("*.onnx") if input_kind(f) is None)
            if len(onnx_files) == 1:
                return onnx_files[0], None
            raise KvCacheError(
                f"{p} is a folder without {GENAI_CONFIG} and with {len(onnx_files)} .onnx "
                f"files{_found_hint(p, onnx_files)}; pass the .onnx file itself."
            )
        config = read_genai_config(config_path)
        filename = decoder_filename(config, config_path)
        model_file = p / filename
        decoder = input_kind(model_file)
        if decoder is not None:
            raise KvCacheError(f"{config_path} names {filename!r} as the decoder, which is {decoder} in {p}.")
        return model_file, config
    return check_input_file(p, "Model", expected="an ONNX model file", missing="does not exist"), None


def eos_token_ids(config: dict[str, Any] | None) -> frozenset[int]:
    """``model.eos_token_id``: one id or a list of them (Llama 3 lists several)."""
    eos = (config or {}).get("model", {}).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    return frozenset(int(t) for t in ids if isinstance(t, int) and not isinstance(t, bool))


def pad_token_id(config: dict[str, Any] | None) -> int | None:
    """``model.pad_token_id``, when the config gives one."""
    pad = (config or {}).get("model", {}).get("pad_token_id")
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else None


def provider_names(config: Mapping[str, Any] | None) -> list[str]:
    """The execution providers ``model.decoder.session_options.provider_options`` names, in
    order; empty means onnxruntime-genai's default, the CPU."""
    decoder = (config or {}).get("model", {}).get("decoder", {})
    options = (
        decoder.get("session_options", {}).get("provider_options", []) if isinstance(decoder, dict) else []
    )
    names: list[str] = []
    for entry in options if isinstance(options, list) else []:
        names += [str(name) for name in (entry if isinstance(entry, dict) else ())]
    return names


def block_size(config: dict[str, Any] | None) -> int | None:
    """A paged model's ``engine.dynamic_batching.block_size``, when the config sets one."""
    engine = (config or {}).get("engine", {}).get("dynamic_batching", {})
    return engine.get("block_size") if isinstance(engine, dict) else None


def share_buffer(config: Mapping[str, Any] | None) -> bool | None:
    """``search.past_present_share_buffer``: whether past and present caches share one
    buffer; None when there is no config or it does not say."""
    search = (config or {}).get("search", {})
    value = search.get("past_present_share_buffer") if isinstance(search, dict) else None
    return value if isinstance(value, bool) else None


def with_share_buffer(config: dict[str, Any], share: bool) -> dict[str, Any]:
    """A copy of ``config`` whose ``search.past_present_share_buffer`` is ``share`` (the model
    builder shares quantized caches' past and present on CUDA only)."""
    config = json.loads(json.dumps(config))
    config.setdefault("search", {})["past_present_share_buffer"] = share
    return config
