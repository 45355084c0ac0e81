"""Named model configs: tiny ones that train on a CPU, and the real shapes used for planning.

The real shapes come from each model's published Hugging Face `config.json`; PUBLISHED holds the total
and active parameter counts their authors report (cited per entry), which tests compare with
`num_params()` / `num_active_params()` (within 2%). No torch import here.
"""

from __future__ import annotations

import copy

from moeflow.core.errors import closest
from moeflow.core.model_config import ModelConfig, MoEConfig

PRESETS: dict[str, ModelConfig] = {
    # ---- tiny, for CPU ---------------------------------------------------------------------
    "tiny-moe": ModelConfig(
        name="tiny-moe", vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256,
        max_seq_len=4096,
        # DeepSeek-V3's routing (sigmoid scores, a learnt selection bias, a shared expert, a dense first layer)
        # under grouped-query attention: what Glm4MoeForCausalLM computes, so a trained tiny-moe exports as it
        moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=128, num_shared_experts=1, first_k_dense=1,
                      score_func="sigmoid"),
    ),
    "tiny-dense": ModelConfig(
        name="tiny-dense", vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384,
        max_seq_len=4096,
    ),
    # ---- real shapes -----------------------------------------------------------------------
    "deepseek-v3": ModelConfig(
        name="deepseek-v3", vocab_size=129280, dim=7168, n_layers=61, n_heads=128, ffn_dim=18432,
        max_seq_len=4096, attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
        moe=MoEConfig(num_experts=256, top_k=8, ffn_dim=2048, num_shared_experts=1, first_k_dense=3,
                      score_func="sigmoid", norm_topk_prob=True, route_scale=2.5, n_group=8, topk_group=4,
                      aux_loss_type="sequence", aux_loss_coef=1e-4),
    ),
    "qwen3-moe-30b-a3b": ModelConfig(
        name="qwen3-moe-30b-a3b", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
        head_dim=128, ffn_dim=6144, rope_theta=1e6, max_seq_len=4096, qk_norm="per_head",
        moe=MoEConfig(num_experts=128, top_k=8, ffn_dim=768, load_balance="none", aux_loss_coef=1e-3,
                      aux_loss_type="global_batch"),
    ),
    "qwen3-moe-235b-a22b": ModelConfig(
        name="qwen3-moe-235b-a22b", vocab_size=151936, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4,
        head_dim=128, ffn_dim=12288, rope_theta=1e6, max_seq_len=4096, qk_norm="per_head",
        moe=MoEConfig(num_experts=128, top_k=8, ffn_dim=1536, load_balance="none", aux_loss_coef=1e-3,
                      aux_loss_type="global_batch"),
    ),
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        ffn_dim=14336, rope_theta=1e6, max_seq_len=4096,
        moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=14336, norm_topk_prob=True, load_balance="none",
                      aux_loss_coef=2e-2),
    ),
    "olmoe-1b-7b": ModelConfig(
        name="olmoe-1b-7b", vocab_size=50304, dim=2048, n_layers=16, n_heads=16, ffn_dim=1024,
        max_seq_len=4096, qk_norm="full",
        moe=MoEConfig(num_experts=64, top_k=8, ffn_dim=1024, norm_topk_prob=False, load_balance="none",
                      aux_loss_coef=1e-2, z_loss_coef=1e-3),
    ),
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        ffn_dim=14336, rope_theta=5e5, max_seq_len=8192, norm_eps=1e-5,
    ),
    "llama3-70b": ModelConfig(
        name="llama3-70b", vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
        ffn_dim=28672, rope_theta=5e5, max_seq_len=8192, norm_eps=1e-5,
    ),
}

# Balance losses as their authors trained them: DeepSeek-V3 report sec. 2.1.2 and 4.2 (aux-loss-free bias plus the
# sequence-wise loss, alpha 0.0001; its MTP module, model.mtp_depth = 1, is left out here so that the counts compare
# with the 671B main model); Qwen3 report (arXiv:2505.09388) sec. 2: global-batch load balancing.
# (total, active) as published. Sources:
#  deepseek-v3: DeepSeek-V3 Technical Report (arXiv:2412.19437), abstract: 671B total, 37B activated.
#  qwen3-moe-*: Qwen3 Technical Report (arXiv:2505.09388), Table 2: 30.5B/3.3B and 235B/22B.
#  mixtral-8x7b: Mixtral of Experts (arXiv:2401.04088), sec. 2: 47B total, 13B active (46.7B/12.9B on the
#    model card).
#  olmoe-1b-7b: OLMoE (arXiv:2409.02060), Table 1: 6.9B total, 1.3B active.
#  llama3-*: The Llama 3 Herd of Models (arXiv:2407.21783) / model cards: 8.03B and 70.6B.
PUBLISHED: dict[str, tuple[float, float]] = {
    "deepseek-v3": (671e9, 37e9),
    "qwen3-moe-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-moe-235b-a22b": (235e9, 22e9),
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "olmoe-1b-7b": (6.9e9, 1.3e9),
    "llama3-8b": (8.03e9, 8.03e9),
    "llama3-70b": (70.6e9, 70.6e9),
}


def get_preset(name: str) -> ModelConfig:
    """A fresh copy of a named preset; ValueError listing the names (and the closest) otherwise."""
    if name not in PRESETS:
        raise ValueError(
            f"model.name = {name!r} is not a preset.{closest(name, PRESETS)} Presets: {', '.join(PRESETS)}"
        )
    return copy.deepcopy(PRESETS[name])
