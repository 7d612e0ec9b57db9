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
    # --- issue 35: the classes around a plain GQA attention ------------------------------------
    # LayerNormalization (not RMSNorm) before attention
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        {"sliding_window": None, "norm_epsilon": 1e-5},
    ),
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        {"partial_rotary_factor": 0.25, "use_qkv_bias": True},
    ),
    # interleaved rotary (optimum writes it with NonZero/Tile); cohere: LayerNorm, parallel block
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.25, "use_qk_norm": False}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {}),
    # MoE blocks (TopK routers) between the attentions. Every expert is chosen for every token
    # (top-k = number of experts, the router's weights still softmaxed): a random router's top-2
    # flips under a quantized cache's noise (logits 0.64 apart where the spread is 2.4), which
    # would make the int8 check of test_producers.py measure the routing, not the cache
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "use_sliding_window": False,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 4, "sliding_window": None},
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 4}),
    # attention sinks (a learned per-head logit beside the scores), alternating windows, MoE
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 4,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "tie_word_embeddings": False,
        },
    ),
    # rope scaling variants
    "llama_rope_llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama_rope_linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "llama_rope_dynamic": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ),
    "qwen2_rope_yarn": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            "use_sliding_window": False,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        },
    ),
    "phi3_longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "original_max_position_embeddings": 64,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0, 2.5],
                "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
            },
        },
    ),
    # sliding windows (the rolling-cache form crops them to WINDOW - 1 tokens)
    "qwen2_window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
            "layer_types": ["full_attention", "sliding_attention"],
        },
    ),
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        {
            "logit_scale": 0.25,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # MLA: a compressed latent projection, key and value head sizes differ (must be refused by name)
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "num_key_value_heads": 4,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "n_routed_experts": 4,
            "num_experts_per_tok": 4,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "rope_scaling": None,
        },
    ),
    # issue 46: KV heads repeated by Tile (``.repeat(1, top_k, 1, 1)``: query head h reads KV head
    # h mod kv_heads); 4 query heads = 2 KV heads x top-k 2, every expert chosen for every token
    "jetmoe": (
        "JetMoeConfig",
        "JetMoeForCausalLM",
        {"num_local_experts": 2, "num_experts_per_tok": 2, "kv_channels": 16},
    ),
    # issue 46: query and key cast to float32 inside attention (``.to(torch.float32)``, an identity
    # in a float32 model); multi-head (4 KV heads), partial rotary
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        {"num_key_value_heads": 4, "rotary_dim": 8, "n_inner": 64, "tie_word_embeddings": False},
    ),
}

#: the held-out set (issue 35's acceptance check; made into /work/producers-holdout, not committed)
HOLDOUT: dict[str, tuple[str, str, dict[str, Any]]] = {
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 4,
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.0625,
            "logits_scaling": 8.0,
        },
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "use_sliding_window": False,
        },
    ),
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 4,
            "sliding_window": None,
            "tie_word_embeddings": False,
        },
    ),
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "exaone4": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"partial_rotary_factor": 0.5}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    "ministral": (
        "MinistralConfig",
        "MinistralForCausalLM",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {}),
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {
            "num_local_experts": 2,
            "num_experts_per_tok": 2,
            "intermediate_size_mlp": 64,
            "attention_chunk_size": 8,
            "no_rope_layers": [1, 0],
            "interleave_moe_layer_step": 1,
        },
    ),
    "stablelm_qknorm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        {"partial_rotary_factor": 0.5, "qk_layernorm": True},
    ),
    "mistral_window6": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
}


def family_table(family: str) -> tuple[str, str, dict[str, Any]]:
    """The committed set's or the held-out set's row of a family."""
    return FAMILIES[family] if family in FAMILIES else HOLDOUT[family]


def config_summary(family: str) -> dict[str, Any]:
    """What the manifest records of a family's config."""
    _, _, over = family_table(family)
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
    for key in (
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "no_rope_layers",
        "partial_rotary_factor",
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "num_experts_per_tok",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
    ):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    if cfg.get("rope_scaling"):
        out["rope_type"] = cfg["rope_scaling"].get("rope_type") or cfg["rope_scaling"].get("type")
    if family == "gpt_oss":
        out["attention_sinks"] = True
    return out
