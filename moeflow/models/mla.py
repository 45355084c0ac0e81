"""Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value projections, and a
decoupled RoPE part of the key shared by all heads (DeepSeek-V2 report, arXiv:2405.04434, sec. 2.1).

With a KV cache (generation) only the normalised latent and the RoPE key are cached, and attention runs in the
latent space: the key up-projection is folded into the query and the value up-projection applied after the
weighted sum (the "absorbed" form of sec. 2.1.4), which gives the same result as expanding every cached latent.

Shape suffixes: B batch, S sequence, T cached + new positions, D width, H heads, L latent rank, Dn no-RoPE
width, Dr RoPE width, Dv value width.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.core.model_config import ModelConfig
from moeflow.models.attention import attend
from moeflow.models.kv_cache import LayerCache
from moeflow.models.layers import AttentionCore, RMSNorm, apply_rope, yarn_mscale


class MultiHeadLatentAttention(AttentionCore, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.rope_interleave = cfg.rope_interleave
        # YaRN lengthens the context by flattening attention; DeepSeek-V3 compensates in the softmax scale
        # (its reference code multiplies it by mscale(factor, mscale_all_dim) squared).
        self.softmax_scale = None  # scaled_dot_product_attention's default, 1 / sqrt(nope + rope)
        if cfg.rope_scaling.type == "yarn" and cfg.rope_scaling.mscale_all_dim:
            mscale = yarn_mscale(cfg.rope_scaling.factor, cfg.rope_scaling.mscale_all_dim)
            self.softmax_scale = (self.nope + self.rope) ** -0.5 * mscale**2
        latent_eps = cfg.latent_norm_eps or cfg.norm_eps
        qk_width = self.n_heads * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, latent_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, qk_width, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, qk_width, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, latent_eps)
        self.wkv_b = nn.Linear(self.kv_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, cfg.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos_SDr: torch.Tensor, sin_SDr: torch.Tensor, *,
                mask: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq_b(self.q_norm(self.wq_a(x_BSD))) if hasattr(self, "wq_a") else self.wq(x_BSD)
        q_BHSd = q.view(B, S, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_pe = q_BHSd.split([self.nope, self.rope], dim=-1)

        latent_BSL, k_pe_BSDr = self.wkv_a(x_BSD).split([self.kv_rank, self.rope], dim=-1)
        latent_BSL = self.kv_norm(latent_BSL)

        k_pe_B1SDr = k_pe_BSDr.unsqueeze(1)
        if self.rope_interleave:
            # Pairs (x0, x1), (x2, x3), ... rotate together: gather evens then odds, and rotate-half applies.
            # Queries and keys come out in the same (de-interleaved) order, so their dot products are unchanged.
            q_pe, k_pe_B1SDr = _deinterleave(q_pe), _deinterleave(k_pe_B1SDr)
        q_pe = apply_rope(q_pe, cos_SDr, sin_SDr)
        k_pe_B1SDr = apply_rope(k_pe_B1SDr, cos_SDr, sin_SDr)
        if cache is not None:
            latent_BTL, k_pe_BTDr = cache.append(latent_BSL, k_pe_B1SDr.squeeze(1))
            o_BHSDv = self._absorbed(q_nope, q_pe, latent_BTL, k_pe_BTDr, mask)
            return self.wo(o_BHSDv.transpose(1, 2).reshape(B, S, -1))
        kv_BHSd = self.wkv_b(latent_BSL).view(B, S, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v_BHSDv = kv_BHSd.split([self.nope, self.v_dim], dim=-1)
        q_full = torch.cat([q_nope, q_pe], dim=-1)
        k_full = torch.cat([k_nope, k_pe_B1SDr.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        o_BHSDv = self.core(q_full, k_full, v_BHSDv, mask, scale=self.softmax_scale)
        return self.wo(o_BHSDv.transpose(1, 2).reshape(B, S, -1))

    def _absorbed(self, q_nope_BHSDn, q_pe_BHSDr, latent_BTL, k_pe_BTDr, mask) -> torch.Tensor:
        """Attention over cached latents: q_nope . (W_uk c) = (W_uk^T q_nope) . c, and the values W_uv c summed
        with the attention weights = W_uv (sum of weighted c). One key 'head' of width L + Dr serves all heads."""
        w_HdL = self.wkv_b.weight.view(-1, self.nope + self.v_dim, self.kv_rank)
        w_uk_HDnL, w_uv_HDvL = w_HdL.split([self.nope, self.v_dim], dim=1)
        q_lat_BHSL = torch.einsum("bhsn,hnl->bhsl", q_nope_BHSDn, w_uk_HDnL)
        q_BHSd = torch.cat([q_lat_BHSL, q_pe_BHSDr], dim=-1)
        k_B1Td = torch.cat([latent_BTL, k_pe_BTDr], dim=-1).unsqueeze(1)
        # the default scale belongs to the uncompressed head width (Dn + Dr), not to L + Dr
        scale = self.softmax_scale or (self.nope + self.rope) ** -0.5
        o_lat_BHSL = attend(q_BHSd, k_B1Td, latent_BTL.unsqueeze(1), mask, scale=scale)
        return torch.einsum("bhsl,hvl->bhsv", o_lat_BHSL, w_uv_HDvL)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
