"""Model configs: parameter-count formulas against built models, presets against published counts, and
validation messages."""

from __future__ import annotations

import pytest
import torch

from moeflow.core.model_config import ModelConfig, MoEConfig
from moeflow.core.presets import PRESETS, PUBLISHED, get_preset
from moeflow.models.transformer import Transformer
from tests.support.model_helpers import MLA_SMALL, SMALL, small_moe

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------ parameter formulas


PARAM_CASES = {
    "dense": dict(),
    "dense-tied": dict(tie_embeddings=True),
    "dense-qk-per-head": dict(qk_norm="per_head", n_kv_heads=2),
    "dense-qk-full": dict(qk_norm="full", n_kv_heads=1),
    "gqa-kv1-headdim": dict(n_kv_heads=1, head_dim=12),
    "gqa-kv2-full-headdim": dict(n_kv_heads=2, head_dim=6, qk_norm="full"),
    "gqa-attention-bias": dict(n_kv_heads=2, attention_bias=True, qk_norm="per_head"),
    "moe": dict(moe=small_moe()),
    "moe-shared": dict(moe=small_moe(num_shared_experts=2)),
    "moe-shared-width": dict(moe=small_moe(num_shared_experts=1, shared_ffn_dim=40, first_k_dense=1)),
    "moe-tied-qk": dict(tie_embeddings=True, qk_norm="per_head", n_kv_heads=2,
                        moe=small_moe(first_k_dense=2)),
    "mla": dict(**MLA_SMALL),
    "mla-qlora": dict(**MLA_SMALL, q_lora_rank=10, moe=small_moe(num_shared_experts=1, first_k_dense=1)),
}


@pytest.mark.parametrize("case", list(PARAM_CASES))
def test_num_params_matches_built_model(case):
    cfg = ModelConfig(**SMALL).replace(**PARAM_CASES[case])
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_num_active_params_hand_count():
    cfg = ModelConfig(vocab_size=10, dim=4, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=6, max_seq_len=8,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=3, num_shared_experts=1, first_k_dense=1))
    # embeddings 2 * 10 * 4 = 80, final norm 4
    # per layer: 2 norms (8) + attention wq 16 + wk 8 + wv 8 + wo 16 = 56
    # layer 0 dense SwiGLU 3 * 4 * 6 = 72 -> 128
    # layer 1: gate 4 * 4 = 16, shared 3 * 4 * 3 = 36, each routed expert 3 * 4 * 3 = 36
    #   active: 56 + 16 + 2 * 36 + 36 = 180;  total: 56 + 16 + 4 * 36 + 36 = 252
    assert cfg.num_active_params() == 80 + 4 + 128 + 180
    assert cfg.num_params() == 80 + 4 + 128 + 252
    assert sum(p.numel() for p in Transformer(cfg).parameters()) == 464


# ------------------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_real_presets_match_published_counts(name):
    cfg = get_preset(name).validate()
    total, active = PUBLISHED[name]
    assert cfg.num_params() == pytest.approx(total, rel=0.02)
    assert cfg.num_active_params() == pytest.approx(active, rel=0.02)
    assert cfg.num_active_params() <= cfg.num_params()


def test_every_preset_validates_and_is_a_fresh_copy():
    for name in PRESETS:
        assert get_preset(name).validate().name == name
    a = get_preset("tiny-moe")
    a.moe.top_k = 7
    assert get_preset("tiny-moe").moe.top_k == 2


# -------------------------------------------------------------------------------------------- bad input


BAD = [
    (dict(moe=small_moe(num_experts=2, top_k=3)), r"model\.moe\.top_k \(3\) must be between 1 and "
     r"model\.moe\.num_experts \(2\)"),
    (dict(n_heads=5), r"model\.n_heads \(5\) must divide model\.dim \(32\); choose n_heads in \[1, 2, 4, 8, 16, 32\]"),
    (dict(n_kv_heads=3), r"model\.n_kv_heads \(3\) must divide model\.n_heads \(4\); choose n_kv_heads in \[1, 2, 4\]"),
    (dict(moe=small_moe(num_experts=8, n_group=2, topk_group=3)),
     r"model\.moe\.topk_group \(3\) must be between 1 and model\.moe\.n_group \(2\)"),
    (dict(moe=small_moe(num_experts=8, n_group=3)),
     r"model\.moe\.num_experts \(8\) must split into model\.moe\.n_group \(3\) equal groups; "
     r"choose n_group in \[1, 2, 4, 8\]"),
    (dict(moe=small_moe(num_experts=8, top_k=3, n_group=4, topk_group=1)),
     r"model\.moe\.top_k \(3\) exceeds the experts in topk_group \(1\) groups of 2"),
    (dict(moe=small_moe(score_func="softmx")), r"model\.moe\.score_func = 'softmx'.*Did you mean 'softmax'"),
    (dict(qk_norm="perhead"), r"model\.qk_norm = 'perhead'.*Did you mean 'per_head'"),
    (dict(moe=small_moe(capacity_factor=0.0)), r"capacity_factor must be positive"),
]


@pytest.mark.parametrize("changes,message", BAD)
def test_bad_config_rejected(changes, message):
    cfg = ModelConfig(**SMALL).replace(**changes)
    with pytest.raises(ValueError, match=message):
        cfg.validate()
    with pytest.raises(ValueError, match=message):
        Transformer(cfg)  # building a model validates too


def test_unknown_preset_suggests_closest():
    with pytest.raises(ValueError, match=r"'tiny-mo' is not a preset\. Did you mean 'tiny-moe'\?"):
        get_preset("tiny-mo")
    with pytest.raises(ValueError, match=r"Did you mean 'deepseek-v3'\?"):
        get_preset("deepseek-v2")
    with pytest.raises(ValueError, match=r"Presets: tiny-moe, tiny-dense"):
        get_preset("zzz")
