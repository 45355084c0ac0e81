"""Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value projections, and a
decoupled RoPE part of the key shared by all heads (DeepSeek-V2 report, arXiv:2405.04434, sec. 2.1).

Shape suffixes: B batch, S sequence, D width, H heads, L latent rank, Dn no-RoPE width, Dr RoPE width,
Dv value width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.models.config import ModelConfig


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from moeflow.models.transformer import RMSNorm

        self.n_heads = cfg.n_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk_width = self.n_heads * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, qk_width, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, qk_width, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, cfg.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos_SDr: torch.Tensor, sin_SDr: torch.Tensor) -> torch.Tensor:
        from moeflow.models.transformer import apply_rope

        B, S, _ = x_BSD.shape
        q = self.wq_b(self.q_norm(self.wq_a(x_BSD))) if hasattr(self, "wq_a") else self.wq(x_BSD)
        q_BHSd = q.view(B, S, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_pe = q_BHSd.split([self.nope, self.rope], dim=-1)

        latent_BSL, k_pe_BSDr = self.wkv_a(x_BSD).split([self.kv_rank, self.rope], dim=-1)
        kv_BHSd = self.wkv_b(self.kv_norm(latent_BSL)).view(B, S, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v_BHSDv = kv_BHSd.split([self.nope, self.v_dim], dim=-1)

        q_pe = apply_rope(q_pe, cos_SDr, sin_SDr)
        k_pe_B1SDr = apply_rope(k_pe_BSDr.unsqueeze(1), cos_SDr, sin_SDr)
        q_full = torch.cat([q_nope, q_pe], dim=-1)
        k_full = torch.cat([k_nope, k_pe_B1SDr.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        o_BHSDv = F.scaled_dot_product_attention(q_full, k_full, v_BHSDv, is_causal=True)
        return self.wo(o_BHSDv.transpose(1, 2).reshape(B, S, -1))
