"""Swap the sparse MoE blocks of a live Hugging Face `transformers` model for moeflow's MoE (same math, same weights).

This is how parallelize() reaches a transformers model: once its MoE blocks are moeflow.models.moe.MoE, moeflow's
expert parallelism and grouped GEMMs apply without rewriting the rest of the model. In transformers 5 a sparse
block takes hidden states [B, S, D] and returns one tensor [B, S, D] (router logits are captured by hooks on the
router module, not returned), and the decoder layer calls `hidden = self.mlp(hidden)` - the contract of
moeflow's MoE, so the module drops in without a wrapper. (transformers 4 returned (hidden, router_logits);
it is refused below rather than wrapped.)
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.core.hf_arch import arch_of, config_from_hf, moe_block_rules
from moeflow.models.hf import copy_into
from moeflow.models.moe import MoE

SPARSE_BLOCKS = ("Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock", "OlmoeSparseMoeBlock", "DeepseekV3MoE",
                 "Glm4MoeMoE")


def moe_from_hf_block(hf_sparse_block: nn.Module, hf_config) -> MoE:
    """moeflow's MoE computing what `hf_sparse_block` computes, with its weights (same device and dtypes)."""
    hf = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    cfg, arch = config_from_hf(hf), arch_of(hf)
    rules = moe_block_rules(cfg, arch, fused=True, block="")
    source = hf_sparse_block.state_dict()
    missing, extra = {r.hf for r in rules} - set(source), set(source) - {r.hf for r in rules}
    if missing or extra:
        raise ValueError(
            f"{type(hf_sparse_block).__name__} does not match its config ({arch.class_name}): "
            f"missing {sorted(missing)}, unexpected {sorted(extra)}"
        )
    with torch.device("meta"):
        moe = MoE(cfg)
    experts = source["experts.down_proj"]  # the block's device and dtype
    moe.to_empty(device=experts.device).to(experts.dtype)
    # The router keeps the dtype HF gives it (DeepSeek-V3 holds its gate in fp32), and the selection bias is fp32.
    moe.router.gate.to(source["gate.weight"].dtype)
    moe.router.expert_bias = torch.zeros(cfg.moe.num_experts, dtype=torch.float32, device=experts.device)
    state = moe.state_dict()
    with torch.no_grad():
        for r in rules:
            copy_into(state[r.mf], source[r.hf], r)
    return moe


def replace_sparse_moe_blocks(hf_model: nn.Module) -> int:
    """Replace every Qwen3-MoE / Mixtral / OLMoE / DeepSeek-V3 / GLM-4.5 sparse block of `hf_model` in place with
    moeflow's MoE; returns how many were replaced. Logits are unchanged (tested to 1e-5 in fp32)."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise ValueError(
            f"replace_sparse_moe_blocks needs transformers >= 5 (fused expert tensors, blocks that return one "
            f"tensor); this is {transformers.__version__}: pip install -U transformers"
        )
    config = hf_model.config
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            "the model has output_router_logits = True, but moeflow's MoE records no HF router logits (so HF's "
            "aux loss would fail); set model.config.output_router_logits = False and use moeflow's balance "
            "loss (MoEConfig.aux_loss_coef) instead"
        )
    replaced = 0
    for parent in list(hf_model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in SPARSE_BLOCKS:
                setattr(parent, name, moe_from_hf_block(child, config))
                replaced += 1
    return replaced
