"""Hugging Face `config.json` -> ModelConfig, one small mapping per architecture (pure json).

Field names follow each architecture's `configuration_*.py` in transformers; only what the planner's
counts need is read. An unsupported `model_type` raises ValueError listing the supported ones.
"""

from __future__ import annotations

import json

from moeflow.models.config import ModelConfig, MoEConfig


def _common(c: dict, name: str) -> dict:
    heads = c["num_attention_heads"]
    return dict(
        name=name, vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
        n_heads=heads, n_kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or 0,
        ffn_dim=c.get("intermediate_size", 4 * c["hidden_size"]), norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(c.get("rope_theta", 10000.0)), max_seq_len=c.get("max_position_embeddings", 4096),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def _llama(c: dict, name: str) -> ModelConfig:
    return ModelConfig(**_common(c, name))


def _qwen3(c: dict, name: str) -> ModelConfig:
    return ModelConfig(**_common(c, name), qk_norm="per_head")


def _qwen3_moe(c: dict, name: str) -> ModelConfig:
    moe = MoEConfig(num_experts=c["num_experts"], top_k=c["num_experts_per_tok"],
                    ffn_dim=c["moe_intermediate_size"], norm_topk_prob=c.get("norm_topk_prob", True),
                    load_balance="none")
    return ModelConfig(**_common(c, name), qk_norm="per_head", moe=moe)


def _mixtral(c: dict, name: str) -> ModelConfig:
    moe = MoEConfig(num_experts=c["num_local_experts"], top_k=c["num_experts_per_tok"],
                    ffn_dim=c["intermediate_size"], load_balance="none")
    return ModelConfig(**_common(c, name), moe=moe)


def _olmoe(c: dict, name: str) -> ModelConfig:
    moe = MoEConfig(num_experts=c["num_experts"], top_k=c["num_experts_per_tok"],
                    ffn_dim=c["intermediate_size"], norm_topk_prob=c.get("norm_topk_prob", False),
                    load_balance="none")
    return ModelConfig(**_common(c, name), qk_norm="full", moe=moe)


def _deepseek_v3(c: dict, name: str) -> ModelConfig:
    moe = MoEConfig(
        num_experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"], ffn_dim=c["moe_intermediate_size"],
        num_shared_experts=c.get("n_shared_experts", 0), first_k_dense=c.get("first_k_dense_replace", 0),
        score_func=c.get("scoring_func", "sigmoid"), norm_topk_prob=c.get("norm_topk_prob", True),
        route_scale=c.get("routed_scaling_factor", 1.0), n_group=c.get("n_group", 1),
        topk_group=c.get("topk_group", 1),
    )
    return ModelConfig(
        **_common(c, name), attention="mla", q_lora_rank=c.get("q_lora_rank") or 0,
        kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], moe=moe,
    )


ARCHITECTURES = {
    "llama": _llama, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
}


def from_hf_dict(c: dict, name: str = "hf") -> ModelConfig:
    kind = c.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(
            f"config.json model_type = {kind!r} is not supported by the planner; supported: "
            f"{', '.join(ARCHITECTURES)}. Use a preset (--model llama3-8b, ...) or a moeflow TOML instead"
        )
    try:
        return ARCHITECTURES[kind](c, name).validate()
    except KeyError as e:
        raise ValueError(f"config.json ({kind}) lacks the field {e.args[0]!r}; is it a complete HF config?") from None


def load_hf_config(path: str) -> ModelConfig:
    with open(path) as f:
        return from_hf_dict(json.load(f), name=path)
