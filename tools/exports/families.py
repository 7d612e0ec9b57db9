"""The tiny random-weight decoders every producer is given (one table, no torch needed).

Each family is a transformers config class and the keyword arguments that make it tiny:
2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), head size 16, intermediate 64,
vocab 128 (ids 0-2 are <pad>/<s>/</s>, ids 3-127 the ASCII bytes of the tiny tokenizer),
float32. Sliding windows are 4 tokens, so a 7-token prefill is longer than the window.
"""

from __future__ import annotations

from typing import Any

WINDOW = 4

COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}

#: family -> (transformers config class name, model class name, overrides of COMMON)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"original_max_position_embeddings": 256, "sliding_window": None, "tie_word_embeddings": False},
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 16,
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.0625,
            "logits_scaling": 8.0,
        },
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        {"no_rope_layers": [1, 0], "use_sliding_window": False},
    ),
}


def config_summary(family: str) -> dict[str, Any]:
    """What the manifest records of a family's config."""
    _, _, over = FAMILIES[family]
    cfg = {**COMMON, **over}
    out: dict[str, Any] = {
        "layers": cfg["num_hidden_layers"],
        "heads": cfg["num_attention_heads"],
        "kv_heads": cfg["num_key_value_heads"],
        "head_size": cfg["head_dim"],
        "hidden": cfg["hidden_size"],
        "vocab": cfg["vocab_size"],
        "window": cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
    }
    if "layer_types" in cfg:
        out["layer_types"] = cfg["layer_types"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "no_rope_layers"):
        if key in cfg:
            out[key] = cfg[key]
    return out
