"""A small GQA decoder built from numpy weights: the demo model and test fixture.

The graph is laid out as onnxruntime-genai writes decoders: inputs ``input_ids``,
``attention_mask`` and ``past_key_values.{i}.key/value`` (BNSH), outputs ``logits``
and ``present.{i}.key/value``; rotary inside GroupQueryAttention; seqlens_k and
total_sequence_length computed from the attention mask. K projections carry a few
outlier channels, as real LLMs' do. Nothing is downloaded: weights come from a seed.
"""

from __future__ import annotations

__all__ = [
    "DecoderConfig",
    "GenaiTokenizer",
    "bpe_tokenizer",
    "build_decoder",
    "byte_level_tokenizer",
    "save_genai_folder",
]

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from onnx_kvcache.cache.operators import GQA, AttentionOp, GqaInput
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.models._paged import build_paged_decoder, paged_genai_config
from onnx_kvcache.models.config import DecoderConfig, WeightFactory


class _Builder:
    def __init__(self, config: DecoderConfig, weight_factory: WeightFactory | None = None) -> None:
        self.config = config
        self.weight_factory = weight_factory
        self.rng = np.random.default_rng(config.seed)
        self.graph = ir.Graph([], [], nodes=[], opset_imports={"": 21, GQA.domain: 1})
        self.tape = ir.tape.Tape(self.graph)

    def weight(self, name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> ir.Value:
        if self.weight_factory is not None:
            tensor = self.weight_factory(name, shape, self.config.ir_dtype)
        else:
            tensor = ir.tensor(make().astype(self.config.np_dtype), name=name)
        return self.tape.initializer(tensor, name=name)

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        return self.tape.initializer(ir.tensor(array, name=name))

    def op(self, op_type: str, inputs: list, name: str, **attributes) -> ir.Value:
        return self.tape.op(op_type, inputs, attributes or None, name=name)

    def rope_tables(self, rope_dim: int) -> tuple[ir.Value, ir.Value]:
        """The ``cos_cache`` and ``sin_cache`` initializers ``[max_position, rope_dim / 2]``."""
        c = self.config
        inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, rope_dim, 2) / rope_dim))
        angles = np.outer(np.arange(c.max_position), inv_freq)
        cos = self.tape.initializer(ir.tensor(np.cos(angles).astype(c.np_dtype), name="cos_cache"))
        sin = self.tape.initializer(ir.tensor(np.sin(angles).astype(c.np_dtype), name="sin_cache"))
        return cos, sin

    def embed(self, ids: ir.Value) -> ir.Value:
        """The token embedding of ``ids``."""
        c = self.config
        table = self.weight(
            "model.embed_tokens.weight",
            (c.vocab_size, c.hidden_size),
            lambda: self.rng.standard_normal((c.vocab_size, c.hidden_size)),
        )
        return self.op("Gather", [table, ids], "/model/embed_tokens/Gather", axis=0)

    def linear(self, x: ir.Value, name: str, fan_in: int, fan_out: int, gain: float = 1.0):
        def make() -> np.ndarray:
            return self.rng.standard_normal((fan_in, fan_out)) * gain / np.sqrt(fan_in)

        w = self.weight(f"{name}.weight", (fan_in, fan_out), make)
        return self.op("MatMul", [x, w], f"{name}/MatMul")

    def attention(
        self,
        op: AttentionOp,
        slots: dict[int, ir.Value | None],
        attributes: dict,
        outputs: list[ir.Value],
        prefix: str,
    ) -> ir.Value:
        """One ``op`` node, ``{prefix}/attn/<op_type>``; its present caches become graph outputs."""
        attn, *presents = self.tape.op_multi_out(
            op.op_type,
            op.input_list(slots),
            attributes,
            domain=op.domain,
            outputs=outputs,
            name=f"{prefix}/attn/{op.op_type}",
        )
        self.graph.outputs.extend(presents)
        return attn

    def logits(self, x: ir.Value, norm: tuple, rows: list[str]) -> None:
        """The final RMS norm and lm_head: ``logits`` ``[*rows, vocab]``, the first graph output."""
        c = self.config
        logits = self.linear(
            self.rms_norm(x, "model.norm", *norm), "lm_head", c.hidden_size, c.vocab_size, gain=4.0
        )
        logits.name, logits.dtype = "logits", c.ir_dtype
        logits.shape = ir.Shape([*rows, c.vocab_size])
        self.graph.outputs.insert(0, logits)

    def residual_mlp(self, x: ir.Value, attn: ir.Value, layer: int, attn_width: int, norm: tuple) -> ir.Value:
        """The rest of layer ``layer`` after attention: o_proj and residual, post-attention
        RMS norm, SwiGLU MLP (as Llama-family decoders) and residual. ``norm``: (axes, eps)."""
        c, p = self.config, f"/model/layers.{layer}"
        o = self.linear(attn, f"model.layers.{layer}.attn.o_proj", attn_width, c.hidden_size)
        x = self.op("Add", [x, o], f"{p}/attn/residual")
        xn = self.rms_norm(x, f"model.layers.{layer}.post_attention_layernorm", *norm)
        g = self.linear(xn, f"model.layers.{layer}.mlp.gate_proj", c.hidden_size, c.intermediate_size)
        u = self.linear(xn, f"model.layers.{layer}.mlp.up_proj", c.hidden_size, c.intermediate_size)
        g = self.op("Mul", [g, self.op("Sigmoid", [g], f"{p}/mlp/Sigmoid")], f"{p}/mlp/SiLU")
        h = self.op("Mul", [g, u], f"{p}/mlp/gate")
        h = self.linear(h, f"model.layers.{layer}.mlp.down_proj", c.intermediate_size, c.hidden_size)
        return self.op("Add", [x, h], f"{p}/mlp/residual")

    def qk_norm(
        self,
        slots: dict[int, ir.Value | None],
        op: AttentionOp,
        layer: int,
        kv_heads: int,
        norm: Callable[[ir.Value, ir.Value, int, str], ir.Value] | None = None,
    ) -> None:
        """Layer ``layer``'s per-head q/k RMS norm: its weights as ``op``'s inputs
        (``qk_norm_fused``), else ``norm`` ops on the query and key ``slots`` feed the node."""
        c = self.config
        q_weight, k_weight = (
            self.weight(
                f"model.layers.{layer}.attn.{name}_norm.weight",
                (c.head_size,),
                lambda: 1 + 0.1 * self.rng.standard_normal(c.head_size),
            )
            for name in ("q", "k")
        )
        if c.qk_norm_fused:
            slots[op.slot("q_norm_weight")], slots[op.slot("k_norm_weight")] = q_weight, k_weight
            return
        norm = norm or self.head_rms_norm
        prefix = f"/model/layers.{layer}/attn"
        query, key = slots[op.slot("query")], slots[op.slot("key")]
        assert query is not None and key is not None
        slots[op.slot("query")] = norm(query, q_weight, c.num_heads, f"{prefix}/q_norm")
        slots[op.slot("key")] = norm(key, k_weight, kv_heads, f"{prefix}/k_norm")

    def head_rms_norm(self, x: ir.Value, weight: ir.Value, heads: int, name: str) -> ir.Value:
        """RMS norm of each head of ``x`` ``[B, S, heads * D]`` (GQA's qk_norm_epsilon, 1e-6)."""
        c = self.config
        split = self.const(f"{name}.split_shape", np.array([0, 0, heads, c.head_size], np.int64))
        merge = self.const(f"{name}.merge_shape", np.array([0, 0, heads * c.head_size], np.int64))
        axes = self.const(f"{name}.axes", np.array([-1], np.int64))
        eps = self.const(f"{name}.eps", np.array(1e-6, c.np_dtype))
        heads_x = self.op("Reshape", [x, split], f"{name}/Reshape")
        mean = self.op(
            "ReduceMean", [self.op("Mul", [heads_x, heads_x], f"{name}/Square"), axes], f"{name}/Mean"
        )
        rms = self.op("Sqrt", [self.op("Add", [mean, eps], f"{name}/Add")], f"{name}/Sqrt")
        normed = self.op("Mul", [self.op("Div", [heads_x, rms], f"{name}/Div"), weight], f"{name}/Scale")
        out = self.op("Reshape", [normed, merge], f"{name}/Merge")
        out.type, out.shape = x.type, x.shape
        return out

    def rms_norm(self, x: ir.Value, name: str, axes: ir.Value, eps: ir.Value) -> ir.Value:
        size = self.config.hidden_size
        w = self.weight(f"{name}.weight", (size,), lambda: 1.0 + 0.1 * self.rng.standard_normal(size))
        sq = self.op("Mul", [x, x], f"{name}/Mul")
        mean = self.op("ReduceMean", [sq, axes], f"{name}/ReduceMean", keepdims=1)
        rms = self.op("Sqrt", [self.op("Add", [mean, eps], f"{name}/Add")], f"{name}/Sqrt")
        normed = self.op("Div", [x, rms], f"{name}/Div")
        return self.op("Mul", [normed, w], f"{name}/Scale")


def build_decoder(
    config: DecoderConfig | None = None, *, weight_factory: WeightFactory | None = None, **overrides
) -> ir.Model:
    """Build the demo decoder; keyword overrides replace :class:`DecoderConfig` fields.

    ``weight_factory`` makes the weight tensors (e.g. external tensors of a benchmark's
    sparse file) instead of seeded random values.
    """
    config = dataclasses.replace(config or DecoderConfig(), **overrides)
    b = _Builder(config, weight_factory)
    if config.paged:
        return build_paged_decoder(b)
    return _build_gqa_decoder(b)


@dataclasses.dataclass(frozen=True)
class _Shared:
    """What every GQA layer reads: the mask's sizes, the RoPE tables, the RMS norms' (axes, eps)."""

    seqlens_k: ir.Value
    total_len: ir.Value
    cos_cache: ir.Value
    sin_cache: ir.Value
    norm: tuple[ir.Value, ir.Value]


def _build_gqa_decoder(b: _Builder) -> ir.Model:
    """The GQA decoder: token inputs, the mask's sizes, the layers, the head."""
    c = b.config
    input_ids = ir.val("input_ids", ir.DataType.INT64, ["batch_size", "sequence_length"])
    mask = ir.val("attention_mask", ir.DataType.INT64, ["batch_size", "total_sequence_length"])
    b.graph.inputs.extend([input_ids, mask])

    axes_last = b.const("const_axes_last", np.array([-1], np.int64))
    axes_1 = b.const("const_axes_1", np.array([1], np.int64))
    eps = b.const("const_eps", np.array(1e-5, c.np_dtype))
    one = b.const("const_one_i64", np.array(1, np.int64))
    seqlens_k, total_len = _mask_sizes(b, mask, axes_1, one)
    cos_cache, sin_cache = b.rope_tables(c.head_size)
    shared = _Shared(seqlens_k, total_len, cos_cache, sin_cache, (axes_last, eps))
    x = b.embed(input_ids)
    for i in range(c.num_layers):
        x = _gqa_layer(b, i, x, shared)
    b.logits(x, (axes_last, eps), ["batch_size", "sequence_length"])
    b.graph.name = "onnx_kvcache_demo_decoder"
    return ir.Model(b.graph, ir_version=10, producer_name="onnx-kvcache")


def _mask_sizes(b: _Builder, mask: ir.Value, axes_1: ir.Value, one: ir.Value) -> tuple[ir.Value, ir.Value]:
    """GQA's ``seqlens_k`` (tokens per row minus one) and ``total_sequence_length`` (int32),
    from the attention mask."""
    seqlens = b.op("ReduceSum", [mask, axes_1], "/model/attn_mask/ReduceSum", keepdims=0)
    seqlens = b.op("Sub", [seqlens, one], "/model/attn_mask/Sub")
    seqlens_k = b.op("Cast", [seqlens], "/model/attn_mask/Cast_seqlens", to=ir.DataType.INT32)
    shape = b.op("Shape", [mask], "/model/attn_mask/Shape")
    total = b.op("Gather", [shape, one], "/model/attn_mask/Gather", axis=0)
    total_len = b.op("Cast", [total], "/model/attn_mask/Cast_total", to=ir.DataType.INT32)
    return seqlens_k, total_len


def _gqa_layer(b: _Builder, i: int, x: ir.Value, shared: _Shared) -> ir.Value:
    """Layer ``i``: input norm, q/k/v, its caches (unless a no-cache layer), the optional q/k
    norm, the GroupQueryAttention node, then o_proj, MLP and residuals."""
    c, p = b.config, f"/model/layers.{i}"
    xn = b.rms_norm(x, f"model.layers.{i}.input_layernorm", *shared.norm)
    q, k, v = _gqa_projections(b, i, xn)
    slots: dict[int, ir.Value | None] = {
        GqaInput.QUERY: q,
        GqaInput.KEY: k,
        GqaInput.VALUE: v,
        GqaInput.SEQLENS_K: shared.seqlens_k,
        GqaInput.TOTAL_SEQUENCE_LENGTH: shared.total_len,
        GqaInput.COS_CACHE: shared.cos_cache,
        GqaInput.SIN_CACHE: shared.sin_cache,
    }
    window = c.sliding_window if i in c.sliding_window_layers else 0
    outputs = [ir.Value(name=f"{p}/attn/GroupQueryAttention/output_0")]
    if i not in c.no_cache_layers:
        slots[GqaInput.PAST_KEY], slots[GqaInput.PAST_VALUE], presents = _gqa_cache_io(b, i, window)
        outputs += presents
    if c.qk_norm:
        b.qk_norm(slots, GQA, i, c.kv_num_heads)
    attn = b.attention(GQA, slots, _gqa_attributes(c, window), outputs, p)
    return b.residual_mlp(x, attn, i, c.num_heads * c.head_size, shared.norm)


def _gqa_projections(b: _Builder, i: int, xn: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Layer ``i``'s q, k, v ``[batch, seq, width]``; K's weight carries the outlier channels."""
    c, p = b.config, f"/model/layers.{i}"
    kv_dim = c.kv_num_heads * c.head_size
    q = b.linear(xn, f"model.layers.{i}.attn.q_proj", c.hidden_size, c.num_heads * c.head_size)

    def make_wk() -> np.ndarray:
        wk = b.rng.standard_normal((c.hidden_size, kv_dim)) / np.sqrt(c.hidden_size)
        outliers = b.rng.choice(kv_dim, size=min(c.outlier_channels, kv_dim), replace=False)
        wk[:, outliers] *= c.outlier_scale
        return wk

    wk = b.weight(f"model.layers.{i}.attn.k_proj.weight", (c.hidden_size, kv_dim), make_wk)
    k = b.op("MatMul", [xn, wk], f"{p}/k")
    v = b.linear(xn, f"model.layers.{i}.attn.v_proj", c.hidden_size, kv_dim)
    for value, width in ((q, c.num_heads * c.head_size), (k, kv_dim), (v, kv_dim)):
        value.dtype = c.ir_dtype
        value.shape = ir.Shape(["batch_size", "sequence_length", width])
    return q, k, v


def _gqa_cache_io(b: _Builder, i: int, window: int) -> tuple[ir.Value, ir.Value, list[ir.Value]]:
    """Layer ``i``'s past K/V, added to the graph inputs, and its present K/V (BNSH; a
    window-sized past with ``sliding_window_cache``, ``kv_cache_dim`` with ``symbolic_cache_dim``)."""
    c, dtype = b.config, b.config.ir_dtype
    past_len = "sliding_window" if window and c.sliding_window_cache else "past_sequence_length"
    head_dim: int | str = "kv_cache_dim" if c.symbolic_cache_dim else c.head_size
    cache_shape: list[int | str | None] = ["batch_size", c.kv_num_heads, past_len, head_dim]
    past_k = ir.val(f"past_key_values.{i}.key", dtype, cache_shape)
    past_v = ir.val(f"past_key_values.{i}.value", dtype, cache_shape)
    b.graph.inputs.extend([past_k, past_v])
    cache_out: list[int | str | None] = ["batch_size", c.kv_num_heads, "total_sequence_length", head_dim]
    presents = [ir.val(f"present.{i}.key", dtype, cache_out), ir.val(f"present.{i}.value", dtype, cache_out)]
    return past_k, past_v, presents


def _gqa_attributes(c: DecoderConfig, window: int) -> dict:
    """The GroupQueryAttention node's attributes (RoPE inside; a local window when set)."""
    attributes: dict = {
        "num_heads": c.num_heads,
        "kv_num_heads": c.kv_num_heads,
        "do_rotary": 1,
        "rotary_interleaved": int(c.rotary_interleaved),
    }
    if window:
        attributes["local_window_size"] = window
        if c.sliding_window_cache:
            attributes["sliding_window_cache"] = 1
    return attributes


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def byte_level_tokenizer() -> dict:
    """A byte-level BPE ``tokenizer.json`` without merges: token id = UTF-8 byte value.

    Ids 256/257 are ``<s>``/``</s>``. Matches how the library reads text for a model
    without a tokenizer, so both paths see the same ids.
    """
    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)} | {"<s>": 256, "</s>": 257}
    return bpe_tokenizer(vocab, [], {256: "<s>", 257: "</s>"})


def bpe_tokenizer(
    vocab: dict[str, int], merges: list[str], special: dict[int, str], *, split_digits: bool = False
) -> dict:
    """A byte-level (GPT-2 style) BPE ``tokenizer.json`` document; ``special`` tokens are
    matched whole; ``split_digits`` splits digits apart first (StarCoder, SmolLM)."""
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    pre: dict = byte_level
    if split_digits:
        pre = {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, **flags} for i, t in sorted(special.items())],
        "normalizer": None,
        "pre_tokenizer": pre,
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
            "merges": merges,
        },
    }


@dataclasses.dataclass(frozen=True)
class GenaiTokenizer:
    """A genai folder's tokenizer: its ``tokenizer.json`` document and special token ids."""

    document: dict
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    bos_token: str
    eos_token: str


def save_genai_folder(
    folder: str | os.PathLike,
    config: DecoderConfig | None = None,
    *,
    provider: str = "cpu",
    weight_factory: WeightFactory | None = None,
    tokenizer: GenaiTokenizer | None = None,
    **overrides,
) -> pathlib.Path:
    """Write the demo decoder as an onnxruntime-genai folder (model, config, tokenizer).

    ``provider`` is the execution provider the genai config names, as the model builder
    writes it: ``cpu`` names none (genai's default), ``cuda`` a ``{"cuda": {}}`` entry.
    ``weight_factory`` gives the weights (a trained model's, see :func:`build_decoder`) and
    ``tokenizer`` its tokenizer; by default seeded weights and the byte-level tokenizer.
    """
    config = dataclasses.replace(config or DecoderConfig(), **overrides)
    if tokenizer is None:
        if config.vocab_size < 258:
            raise KvCacheError("A genai folder needs vocab_size >= 258 (256 bytes and two special tokens).")
        tokenizer = GenaiTokenizer(byte_level_tokenizer(), 256, 257, 257, "<s>", "</s>")
    path = pathlib.Path(folder)
    if path.is_symlink() or (path.exists() and (not path.is_dir() or any(path.iterdir()))):
        raise KvCacheError(
            f"{path} exists and is not an empty folder: save_genai_folder writes a new model "
            "folder and replaces nothing. Name a new or empty folder."
        )
    path.mkdir(parents=True, exist_ok=True)
    ir.save(
        build_decoder(config, weight_factory=weight_factory),
        path / "model.onnx",
        external_data="model.onnx.data",
    )
    genai = {
        "model": {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "context_length": config.max_position,
            "type": "llama",
            "vocab_size": config.vocab_size,
            "decoder": {
                "session_options": {
                    "log_id": "onnxruntime-genai",
                    "provider_options": [] if provider == "cpu" else [{provider: {}}],
                },
                "filename": "model.onnx",
                "head_size": config.head_size,
                "hidden_size": config.hidden_size,
                "num_attention_heads": config.num_heads,
                "num_hidden_layers": config.num_layers,
                "num_key_value_heads": config.kv_num_heads,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "do_sample": False,
            "early_stopping": True,
            "max_length": min(config.max_position, 1024),
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }
    if config.paged:
        genai = paged_genai_config(genai, config.paged_block_size)
    (path / "genai_config.json").write_text(json.dumps(genai, indent=4) + "\n")
    (path / "tokenizer.json").write_text(json.dumps(tokenizer.document, ensure_ascii=False) + "\n")
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": False,
        "model_max_length": config.max_position,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=4) + "\n")
    return path
