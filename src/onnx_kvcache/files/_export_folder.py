"""Export folders (optimum-cli's, transformers' ``save_pretrained`` beside an ``.onnx``): what
the library reads from them, and the ``genai_config.json`` a converted one gets.

An export folder holds the model file, transformers' ``config.json`` (:data:`MODEL_CONFIG`),
often ``generation_config.json`` (:data:`GENERATION_CONFIG`) and tokenizer files. The rules:

* **Special tokens**, as transformers' ``generate`` takes them: ``eos_token_id`` (one id or a
  list) and ``pad_token_id`` from ``generation_config.json``, else from ``config.json``;
  ``bos_token_id`` likewise. Neither naming an end-of-sequence id, the tokenizer's is taken:
  ``tokenizer_config.json``'s ``eos_token`` (else ``special_tokens_map.json``'s), its id in
  ``tokenizer.json`` (an added token, else the vocabulary) or ``added_tokens_decoder``.
* **A genai config** (:func:`genai_config_for_export`) is written from what the converted
  graph shows (its inputs and outputs by name, the cache names as ``%d`` patterns, head
  counts and head size from its GroupQueryAttention nodes, the vocabulary from the logits)
  and what ``config.json`` says (model type, ``context_length`` from
  ``max_position_embeddings``, hidden size, the token ids), and search options as
  ``generation_config.json`` gives them (transformers' defaults for the others). Every
  graph input must be one onnxruntime-genai feeds (:data:`GENAI_INPUTS` and the caches): it
  runs a graph with an input it does not know without feeding it, so such a graph gets no
  config, and the reason says which input.
"""

from __future__ import annotations

__all__ = [
    "GENAI_INPUTS",
    "GENAI_MODEL_TYPES",
    "GENERATION_CONFIG",
    "MODEL_CONFIG",
    "ExportConfig",
    "NoGenaiConfig",
    "genai_config_for_export",
    "read_export_config",
    "written_genai_config",
]

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import onnx_ir as ir

from onnx_kvcache.cache.operators import GQA
from onnx_kvcache.cache.sites import CacheSite, find_attention_sites
from onnx_kvcache.errors import GenaiConfigWarning, KvCacheError, warn
from onnx_kvcache.model_io import load_json
from onnx_kvcache.model_io.genai_folder import GENAI_CONFIG

MODEL_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
_MAX_CONFIG_BYTES = 16 * 2**20
#: The tokenizer files an end-of-sequence token is named in, in the order they are tried, and
#: the one that gives its id (tokenizer.json of a large vocabulary is tens of MiB).
_TOKENIZER_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")
_TOKENIZER = "tokenizer.json"
_MAX_TOKENIZER_BYTES = 256 * 2**20

#: The graph inputs onnxruntime-genai 0.18 feeds a decoder besides its caches: its config's
#: ``model.decoder.inputs`` key -> the name exporters (torch.onnx.export, optimum) give it.
GENAI_INPUTS: Mapping[str, str] = {
    "input_ids": "input_ids",
    "attention_mask": "attention_mask",
    "position_ids": "position_ids",
}
#: The logits output, likewise (``model.decoder.outputs.logits``).
_LOGITS = "logits"

#: ``model.type`` values onnxruntime-genai 0.18 runs as a decoder-only LLM
#: (``src/models/model_type.h``); another transformers ``model_type`` is written as its
#: generic ``decoder``.
GENAI_MODEL_TYPES = frozenset(
    {
        "chatglm", "decoder", "ernie4_5", "gemma", "gemma2", "gemma3_text", "gpt2", "granite", "llama",
        "mistral", "nemotron", "olmo", "phi", "phimoe", "phi3", "phi3small", "qwen2", "qwen3", "smollm3",
    }
)  # fmt: skip

#: ``config.json`` keys that give the context length, in the order they are tried.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")

#: The search options, as transformers' ``GenerationConfig`` defaults them (what ``generate``
#: does with the export); ``generation_config.json`` values of the same name and type replace
#: them. ``max_length`` is the context length, as onnxruntime-genai's model builder writes it.
_SEARCH_DEFAULTS: Mapping[str, bool | int | float] = {
    "diversity_penalty": 0.0,
    "do_sample": False,
    "early_stopping": False,
    "length_penalty": 1.0,
    "min_length": 0,
    "no_repeat_ngram_size": 0,
    "num_beams": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
}


class NoGenaiConfig(Exception):
    """Why no genai config can be written for a graph (its text is the reason)."""


def _is_id(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """An export folder's ``config.json`` and ``generation_config.json`` (each ``{}`` when absent)."""

    model: Mapping[str, Any]
    generation: Mapping[str, Any]
    tokenizer_eos: tuple[int, ...] = ()
    """The tokenizer's end-of-sequence id, read when neither config names one."""

    def _token(self, key: str) -> Any:
        value = self.generation.get(key)
        return value if value is not None else self.model.get(key)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids, in the order given (Llama 3 lists several)."""
        eos = self._token("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos]
        return tuple(dict.fromkeys(t for t in ids if _is_id(t))) or self.tokenizer_eos

    @property
    def pad_token_id(self) -> int | None:
        pad = self._token("pad_token_id")
        return pad if _is_id(pad) else None

    @property
    def bos_token_id(self) -> int | None:
        bos = self._token("bos_token_id")
        return bos if _is_id(bos) else None

    @property
    def context_length(self) -> int | None:
        for key in _CONTEXT_KEYS:
            value = self.model.get(key)
            if _is_id(value) and value > 0:
                return int(value)
        return None


def read_export_config(folder: str | os.PathLike) -> ExportConfig | None:
    """``folder``'s ``config.json`` and ``generation_config.json``; None when it has neither.
    One error naming the file for one that is not a JSON object (bounded reads)."""
    found: dict[str, Mapping[str, Any]] = {}
    for name in (MODEL_CONFIG, GENERATION_CONFIG):
        path = pathlib.Path(folder) / name
        if os.path.lexists(path):
            doc = load_json(path, "transformers config", max_bytes=_MAX_CONFIG_BYTES)
            if not isinstance(doc, dict):
                raise KvCacheError(f"{path} is not a JSON object, as transformers writes it.")
            found[name] = doc
    if not found:
        return None
    export = ExportConfig(found.get(MODEL_CONFIG, {}), found.get(GENERATION_CONFIG, {}))
    if export.eos_token_ids:
        return export
    return dataclasses.replace(export, tokenizer_eos=_tokenizer_eos(pathlib.Path(folder)))


def _tokenizer_eos(folder: pathlib.Path) -> tuple[int, ...]:
    """The end-of-sequence id the tokenizer files beside the model name, or ``()``."""
    token, config = None, {}
    for name in _TOKENIZER_CONFIGS:
        path = folder / name
        if not path.is_file():
            continue
        doc = load_json(path, "tokenizer config", max_bytes=_MAX_CONFIG_BYTES)
        eos = doc.get("eos_token") if isinstance(doc, dict) else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            token, config = eos, doc
            break
    if token is None:
        return ()
    decoder = config.get("added_tokens_decoder")
    for key, entry in decoder.items() if isinstance(decoder, dict) else ():
        if isinstance(entry, dict) and entry.get("content") == token and key.isdigit():
            return (int(key),)
    path = folder / _TOKENIZER
    if not path.is_file():
        return ()
    doc = load_json(path, "tokenizer", max_bytes=_MAX_TOKENIZER_BYTES)
    doc = doc if isinstance(doc, dict) else {}
    added = doc.get("added_tokens")
    for entry in added if isinstance(added, list) else ():
        if isinstance(entry, dict) and entry.get("content") == token and _is_id(entry.get("id")):
            return (int(entry["id"]),)
    model = doc.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    found = vocab.get(token) if isinstance(vocab, dict) else None
    return (int(found),) if _is_id(found) else ()


def _pattern(names: Sequence[str], what: str) -> str:
    """The ``%d`` pattern whose layer ``i`` is ``names[i]`` (onnxruntime-genai's cache names)."""
    first = names[0]
    if any("%" in n for n in names):
        raise NoGenaiConfig(f"the {what} {first!r} holds a %, which onnxruntime-genai's name patterns cannot")
    for run in re.finditer(r"\d+", first):
        pattern = first[: run.start()] + "%d" + first[run.end() :]
        if all(pattern % i == name for i, name in enumerate(names)):
            return pattern
    shown = ", ".join(repr(n) for n in names[:3])
    raise NoGenaiConfig(f"the {what}s ({shown}, ...) are not numbered 0, 1, 2, ... by layer")


def _layer_order(sites: list[CacheSite]) -> list[CacheSite]:
    """The sites by the number in their past key's name (the layer genai counts)."""

    def number(site: CacheSite) -> tuple[int, ...]:
        name = site.past_key.name if site.past_key is not None else ""
        return tuple(int(d) for d in re.findall(r"\d+", name or ""))

    return sorted(sites, key=number)


def _one(values: set[int], what: str) -> int:
    if len(values) != 1:
        raise NoGenaiConfig(f"its layers differ in {what} ({sorted(values)}), which genai_config cannot say")
    return values.pop()


def _decoder(model: ir.Model, filename: str) -> dict[str, Any]:
    """``model.decoder`` as the graph shows it; :class:`NoGenaiConfig` when genai cannot drive it."""
    sites = [s for s in find_attention_sites(model) if s.op is GQA]
    if not sites or len(sites) != len(find_attention_sites(model)):
        raise NoGenaiConfig("it has no GroupQueryAttention caches (or other attention operators)")
    graph_inputs = {v.name for v in model.graph.inputs if v.name}
    graph_outputs = {v.name for v in model.graph.outputs if v.name}
    sites = _layer_order(sites)
    names: dict[str, list[str]] = {}
    for key, where in _CACHE_KEYS.items():
        values = [_cache_value(s, key) for s in sites]
        missing = [
            i for i, v in enumerate(values) if v is None or v.name not in (graph_inputs, graph_outputs)[where]
        ]
        if missing:
            raise NoGenaiConfig(
                f"a cache of {sites[missing[0]].label} is no graph {('input', 'output')[where]}"
            )
        names[key] = [str(v.name) for v in values if v is not None]
    patterns = {
        key: _pattern(values, key.removesuffix("s").replace("_", " ")) for key, values in names.items()
    }
    caches = {n for values in names.values() for n in values}
    unknown = sorted(graph_inputs - caches - set(GENAI_INPUTS.values()))
    if unknown:
        raise NoGenaiConfig(
            f"its input {unknown[0]!r} is not one onnxruntime-genai feeds (it feeds "
            f"{', '.join(GENAI_INPUTS.values())} and the caches)"
        )
    if "input_ids" not in graph_inputs:
        raise NoGenaiConfig("it has no input_ids input (onnxruntime-genai feeds token ids)")
    if _LOGITS not in graph_outputs:
        raise NoGenaiConfig(f"it has no {_LOGITS!r} output, which onnxruntime-genai reads")
    inputs = {key: name for key, name in GENAI_INPUTS.items() if name in graph_inputs}
    window = _sliding_window(sites)
    return {
        **({"sliding_window": window} if window else {}),
        "filename": filename,
        "head_size": _one({s.head_size() for s in sites}, "head size"),
        "num_attention_heads": _one({s.num_heads for s in sites}, "query head counts"),
        "num_key_value_heads": _one({s.kv_num_heads for s in sites}, "KV head counts"),
        "num_hidden_layers": len(sites),
        "inputs": inputs | {k: patterns[k] for k in ("past_key_names", "past_value_names")},
        "outputs": {"logits": _LOGITS}
        | {k: patterns[k] for k in ("present_key_names", "present_value_names")},
    }


def _sliding_window(sites: list[CacheSite]) -> dict[str, Any] | None:
    """``decoder.sliding_window`` for window-sized caches (``sliding_window_cache=1``, a fused
    rolling window cache), as onnxruntime-genai's builder writes it for Gemma-2: the window, the
    layers (genai allocates their caches window-sized: the window plus its slack), no sliding
    of the cache or of the inputs by genai itself (the kernel evicts)."""
    layers = [i for i, s in enumerate(sites) if s.int_attr("sliding_window_cache", 0)]
    if not layers:
        return None
    window = _one(
        {sites[i].int_attr("local_window_size", -1) for i in layers}, "window of its window-sized caches"
    )
    return {
        "cache_slack": 0,
        "layers": layers,
        "slide_inputs": False,
        "slide_key_value_cache": False,
        "window_size": window,
    }


#: The cache names genai_config gives as patterns: key -> 0 for a graph input, 1 for an output.
_CACHE_KEYS: Mapping[str, int] = {
    "past_key_names": 0,
    "past_value_names": 0,
    "present_key_names": 1,
    "present_value_names": 1,
}


def _cache_value(site: CacheSite, key: str) -> ir.Value | None:
    return {
        "past_key_names": site.past_key,
        "past_value_names": site.past_value,
        "present_key_names": site.present_key,
        "present_value_names": site.present_value,
    }[key]


def _vocab_size(model: ir.Model, export: ExportConfig) -> int:
    logits = next(v for v in model.graph.outputs if v.name == _LOGITS)
    last = logits.shape[-1] if logits.shape is not None and len(logits.shape) else None
    size = last if isinstance(last, int) else export.model.get("vocab_size")
    if not _is_id(size):
        raise NoGenaiConfig(f"neither its logits nor {MODEL_CONFIG} give the vocabulary size")
    return int(size)


def _same_kind(given: Any, default: bool | int | float) -> bool:
    """``given`` can stand for ``default``: a bool for a bool, an int for an int, a number for a float."""
    if isinstance(default, bool) or isinstance(given, bool):
        return isinstance(default, bool) and isinstance(given, bool)
    return isinstance(given, int) if isinstance(default, int) else isinstance(given, (int, float))


def _search(export: ExportConfig, context: int, share_buffer: bool) -> dict[str, Any]:
    search: dict[str, Any] = {
        key: given if _same_kind(given := export.generation.get(key), default) else default
        for key, default in _SEARCH_DEFAULTS.items()
    }
    search["max_length"] = context
    search["past_present_share_buffer"] = share_buffer
    return dict(sorted(search.items()))


def genai_config_for_export(
    model: ir.Model,
    filename: str,
    export: ExportConfig,
    *,
    share_buffer: bool,
    provider_options: list[dict[str, Any]],
) -> dict[str, Any]:
    """The ``genai_config.json`` of a converted export whose graph is ``filename`` in its folder.

    Raises :class:`NoGenaiConfig` (its text the reason) when onnxruntime-genai cannot drive the
    graph or the configs lack what the file needs (the context length, an end-of-sequence id).
    """
    decoder = _decoder(model, filename)
    context = export.context_length
    if context is None:
        raise NoGenaiConfig(f"{MODEL_CONFIG} gives no context length ({_CONTEXT_KEYS[0]})")
    eos = export.eos_token_ids
    if not eos:
        raise NoGenaiConfig(
            f"neither {GENERATION_CONFIG}, {MODEL_CONFIG} nor the tokenizer ({_TOKENIZER_CONFIGS[0]}'s "
            "eos_token) gives an end-of-sequence id"
        )
    hidden = export.model.get("hidden_size")
    decoder["hidden_size"] = (
        hidden if _is_id(hidden) else decoder["num_attention_heads"] * decoder["head_size"]
    )
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": provider_options},
        **dict(sorted(decoder.items())),
    }
    model_type = export.model.get("model_type")
    pad = export.pad_token_id
    genai_model: dict[str, Any] = {
        "bos_token_id": export.bos_token_id,
        "context_length": context,
        "decoder": decoder,
        "eos_token_id": list(eos) if len(eos) > 1 else eos[0],
        "pad_token_id": pad if pad is not None else eos[0],  # the model builder's default
        "type": model_type if model_type in GENAI_MODEL_TYPES else "decoder",
        "vocab_size": _vocab_size(model, export),
    }
    if genai_model["bos_token_id"] is None:
        del genai_model["bos_token_id"]
    return {"model": genai_model, "search": _search(export, context, share_buffer)}


def written_genai_config(
    folder: pathlib.Path,
    graph: pathlib.Path,
    model: ir.Model,
    out_name: str,
    *,
    target: str,
    share_buffer: bool,
    provider_options: list[dict[str, Any]] | None,
) -> tuple[dict[str, Any] | None, str | None]:
    """The ``genai_config.json`` an export ``folder`` converted into the folder ``out_name``
    gets, and the summary's note saying so; for a folder without ``config.json``, no config and
    a note saying onnxruntime-genai cannot run the folder. When there is none to write (see
    :func:`genai_config_for_export`; or ``provider_options`` None: genai's config cannot name the
    ``target``), one :class:`~onnx_kvcache.errors.GenaiConfigWarning` says why, and the conversion
    goes on."""
    try:
        export = read_export_config(folder)
        if export is None or not export.model:
            return None, (
                f"no {GENAI_CONFIG} written: {folder.name} has no {MODEL_CONFIG} (transformers' model "
                f"config) to write it from, so onnxruntime-genai cannot run {out_name}; to have one, "
                f"put the model's {MODEL_CONFIG} beside the input and convert again."
            )
        if provider_options is None:
            raise NoGenaiConfig(f"onnxruntime-genai's config cannot name {target}, the target")
        config = genai_config_for_export(
            model,
            graph.relative_to(folder).as_posix(),
            export,
            share_buffer=share_buffer,
            provider_options=json.loads(json.dumps(provider_options)),
        )
    except (NoGenaiConfig, KvCacheError) as e:
        warn(
            f"no {GENAI_CONFIG} written in {out_name}: {str(e).rstrip('.')}; the model is converted, "
            "but onnxruntime-genai cannot run the folder.",
            GenaiConfigWarning,
        )
        return None, None
    layers, context = config["model"]["decoder"]["num_hidden_layers"], config["model"]["context_length"]
    return config, (
        f"{GENAI_CONFIG} written from {MODEL_CONFIG}: onnxruntime-genai runs the folder "
        f"({layers} layers, context {context})."
    )
