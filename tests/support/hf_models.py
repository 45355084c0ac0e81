"""Tiny random transformers models of every supported architecture (no downloads), for the Hugging Face tests."""

from __future__ import annotations

import torch
import transformers

V = 96  # vocabulary of every tiny config


def hf_configs() -> dict:
    """Tiny configs with odd corners: 3 kv heads, top-1 and top-all routing, tied embeddings, biases, dense
    first layers, shared experts, group-limited routing, llama3 and YaRN RoPE scaling."""
    t = transformers
    common = dict(vocab_size=V, max_position_embeddings=64)
    return {
        "llama": t.LlamaConfig(**common, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, attention_bias=True,
                               rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                    low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position_embeddings=64)),
        "qwen3": t.Qwen3Config(**common, hidden_size=40, num_hidden_layers=2, num_attention_heads=6,
                               num_key_value_heads=3, head_dim=8, intermediate_size=56, tie_word_embeddings=True,
                               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                    original_max_position_embeddings=16)),
        "qwen3_moe": t.Qwen3MoeConfig(**common, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=1, head_dim=12, intermediate_size=64, num_experts=6,
                                      num_experts_per_tok=1, moe_intermediate_size=24, norm_topk_prob=True,
                                      mlp_only_layers=[0]),
        "mixtral": t.MixtralConfig(**common, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
                                   num_experts_per_tok=4),
        "olmoe": t.OlmoeConfig(**common, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=4, intermediate_size=32, num_experts=5, num_experts_per_tok=2,
                               pad_token_id=0, eos_token_id=1),
        "deepseek_v3": t.DeepseekV3Config(
            **common, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
            topk_group=2, first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=2.5, q_lora_rank=16,
            kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                                 mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0)),
        # GLM-4.5's MoE under grouped-query attention: whole-head RoPE, per-head q/k norms, two groups
        "glm4_moe": t.Glm4MoeConfig(
            **common, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
            n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=1.5,
            use_qk_norm=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0)),
        # full-rank queries, RoPE in halves (rope_interleave off), one group, no renormalisation, no dense layer
        "deepseek_v3_plain": t.DeepseekV3Config(
            **common, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=0, n_shared_experts=1, routed_scaling_factor=1.0, q_lora_rank=None,
            norm_topk_prob=False, rope_interleave=False, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=6,
            v_head_dim=4, tie_word_embeddings=True),
    }


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order 1/sqrt(fan-in) (HF's init of 0.02 leaves routing near ties), norms around 1, and a
    nonzero DeepSeek selection bias, so that a swapped or transposed tensor cannot go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1 + 0.2 * noise)
        elif p.ndim == 1:  # biases
            p.copy_(0.2 * noise)
        else:
            p.copy_(noise * (1.0 if "embed" in name else p.shape[-1] ** -0.5))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
