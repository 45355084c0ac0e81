"""Decoder-only transformer written for one device: RMSNorm, RoPE, GQA (or MLA), SwiGLU or MoE FFN.

Blocks live in a ModuleDict keyed by layer index, and the embedding, final norm and output head are
optional, so a pipeline stage can keep a slice of the blocks and drop the rest (docs/design.md, principle 1).
Packed sequences pass `positions` (RoPE restarts per document) and `document_ids` (attention stays inside a
document); generation passes a KVCache (moeflow.models.kv_cache).
Shape suffixes: B batch, S sequence, T cached + new positions, D width, H heads, Hk kv heads, Dh head width,
V vocab.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeflow.core import phases
from moeflow.core.model_config import ModelConfig
from moeflow.models.attention import cached_causal_mask, document_causal_mask, max_logits
from moeflow.models.kv_cache import KVCache, LayerCache
from moeflow.models.layers import AttentionCore, RMSNorm, apply_rope, rope_tables
from moeflow.models.mla import MultiHeadLatentAttention
from moeflow.models.moe import FeedForward, GroupedExperts, MoE, Router
from moeflow.models.mtp import MultiTokenPrediction
from moeflow.models.phase_range import phase_range


class Attention(AttentionCore, nn.Module):
    """Grouped-query attention through scaled_dot_product_attention (causal)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.hd
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        bias = cfg.attention_bias
        self.wq = nn.Linear(cfg.dim, q_width, bias=bias)
        self.wk = nn.Linear(cfg.dim, kv_width, bias=bias)
        self.wv = nn.Linear(cfg.dim, kv_width, bias=bias)
        self.wo = nn.Linear(q_width, cfg.dim, bias=bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "per_head":  # Qwen3: one RMSNorm over each head's width
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps), RMSNorm(self.head_dim, cfg.norm_eps)
        elif cfg.qk_norm == "full":  # OLMoE: over all heads' widths together, before the head split
            self.q_norm, self.k_norm = RMSNorm(q_width, cfg.norm_eps), RMSNorm(kv_width, cfg.norm_eps)

    def forward(self, x_BSD: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor, *,
                mask: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """mask: None (causal) or a boolean mask (moeflow.models.attention); cos/sin [S, Dh] or, with positions
        per row, [B, 1, S, Dh]."""
        B, S, _ = x_BSD.shape
        q, k, v = self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 rather than the configured head count: under tensor parallelism each rank holds a slice.
        q_BHSDh = q.view(B, S, -1, self.head_dim).transpose(1, 2)
        k_BHSDh = k.view(B, S, -1, self.head_dim).transpose(1, 2)
        v_BHSDh = v.view(B, S, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm == "per_head":
            q_BHSDh, k_BHSDh = self.q_norm(q_BHSDh), self.k_norm(k_BHSDh)
        q_BHSDh, k_BHSDh = apply_rope(q_BHSDh, cos_SDh, sin_SDh), apply_rope(k_BHSDh, cos_SDh, sin_SDh)
        if cache is not None:
            k_BHSDh, v_BHSDh = cache.append(k_BHSDh, v_BHSDh)  # now [B, Hk, T, Dh]
        if hasattr(self, "max_logits") and self.training and torch.is_grad_enabled():  # MuonClip is on
            with torch.no_grad():
                best_H = max_logits(q_BHSDh, k_BHSDh, mask)
            self.max_logits = best_H if self.max_logits is None else torch.maximum(self.max_logits, best_H)
        o_BHSDh = self.core(q_BHSDh, k_BHSDh, v_BHSDh, mask)
        return self.wo(o_BHSDh.transpose(1, 2).reshape(B, S, -1))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = build_attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.is_moe_layer(layer) else FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x_BSD, cos_SDh, sin_SDh, mask=None, cache=None):
        with phase_range(phases.ATTENTION):
            h = x_BSD + self.attention(self.attention_norm(x_BSD), cos_SDh, sin_SDh, mask=mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


def build_attention(cfg: ModelConfig) -> nn.Module:
    if cfg.attention == "mla":
        return MultiHeadLatentAttention(cfg)
    return Attention(cfg)


class Transformer(nn.Module):
    """tokens [B, S] -> logits [B, S, V]. Without an embedding it takes hidden states [B, S, D];
    without an output head it returns hidden states (pipeline stages).

    With model.mtp_depth = D, the head's stage also holds the MTP modules (`mtp`, moeflow.models.mtp) and, in
    training mode, returns the main logits followed by each depth's along the sequence: [B, S + (S-1) + ... +
    (S-D), V]; in eval mode (and so at generation) only the main logits. The MTP modules need the token
    embeddings, so a stage without the head returns (hidden, embeddings) and one without the embedding takes both.
    """

    def __init__(self, cfg: ModelConfig, *, embed: bool = True, head: bool = True, layers: list[int] | None = None):
        super().__init__()
        self.cfg = cfg.validate()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if embed else None
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(cfg, i) for i in (range(cfg.n_layers) if layers is None else layers)}
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps) if head else None
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if head else None
        # MTP depth k's block is numbered after the decoder layers, as in Hugging Face DeepSeek-V3 checkpoints.
        self.mtp = nn.ModuleDict({
            str(k): MultiTokenPrediction(cfg, TransformerBlock(cfg, cfg.n_layers + k)) for k in range(cfg.mtp_depth)
        }) if head and cfg.mtp_depth else None
        if cfg.tie_embeddings and embed and head:
            self.output.weight = self.tok_embeddings.weight
        rope_dim = cfg.qk_rope_head_dim if cfg.attention == "mla" else cfg.hd
        cos, sin = rope_tables(rope_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if self.rope_cos.device.type != "meta":  # a meta model (dry runs) has no values to initialise
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2 * n_layers)
        (GPT-2, Radford et al. 2019, sec. 2.3); norms to one; linear and router biases to zero."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            residual_out = name.endswith((".wo", ".w2"))
            if isinstance(module, (nn.Linear, nn.Embedding)):
                _normal_(module.weight, out_std if residual_out else std, gen)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, GroupedExperts):
                _normal_(module.w1, std, gen)
                _normal_(module.w3, std, gen)
                _normal_(module.w2, out_std, gen)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, Router):
                module.expert_bias.zero_()
        self.reset_rope()

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Recompute the RoPE tables (non-persistent buffers: not in checkpoints, garbage after `to_empty`)."""
        cfg = self.cfg
        cos, sin = rope_tables(self.rope_cos.shape[-1], cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def check_length(self, S: int) -> None:
        """The sequence's whole length against the RoPE tables (model.max_seq_len)."""
        if S > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {S} exceeds model.max_seq_len ({self.cfg.max_seq_len}); "
                f"raise model.max_seq_len or shorten data.seq_len"
            )

    def forward(self, tokens: torch.Tensor, embeddings: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                cache: KVCache | None = None):
        """tokens [B, S] (or hidden states [B, S, D] on a later pipeline stage); embeddings: the token embeddings
        MTP modules read, which a later pipeline stage receives (default: this stage's own).
        positions: the position in its sequence of each of the S tokens given ([S], or [B, S] per row), for
        RoPE; default 0 .. S-1 (or after the cached ones). A caller holding part of a sequence (context
        parallelism) passes its tokens' positions and checks the whole length itself.
        document_ids [B, S]: attention only between positions of the same id (packed documents)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if embeddings is None:
            embeddings = h
        S = h.shape[1]
        start = cache.length if cache is not None else 0
        if positions is None:
            self.check_length(start + S)
            cos, sin = self.rope_cos[start:start + S].to(h.dtype), self.rope_sin[start:start + S].to(h.dtype)
        else:
            cos, sin = self.rope_cos[positions].to(h.dtype), self.rope_sin[positions].to(h.dtype)
            if positions.dim() == 2:  # [B, S, Dh] -> [B, 1, S, Dh]: broadcast over the heads
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if document_ids is not None:
            mask = document_causal_mask(document_ids)
        else:
            mask = cached_causal_mask(S, start, h.device) if cache is not None else None
        for key, block in self.layers.items():
            h = block(h, cos, sin, mask, cache.layer(key) if cache is not None else None)
        if cache is not None:
            cache.length += S
        if self.output is None:
            return (h, embeddings) if self.cfg.mtp_depth else h
        h = self.norm(h)
        logits = self.output(h)
        if self.mtp is None or not self.training:
            return logits
        parts = [logits]
        for k, module in enumerate(self.mtp.values(), start=1):  # depth k predicts positions 0 .. S-1-k
            h = module(h[:, :S - k], embeddings[:, k:], cos[..., :S - k, :], sin[..., :S - k, :])
            parts.append(self.output(h))
        return torch.cat(parts, dim=1)

    def moe_routers(self) -> list[tuple[str, Router]]:
        return [(n, m) for n, m in self.named_modules() if isinstance(m, Router)]


def router_layer_index(name: str, n_layers: int) -> int:
    """Global layer index of a router by its module name: 'layers.<i>....' is layer i, 'mtp.<k>....' is
    n_layers + k (the numbering of Hugging Face DeepSeek-V3 checkpoints)."""
    kind, index = name.split(".")[:2]
    return int(index) + (n_layers if kind == "mtp" else 0)


def _normal_(t: torch.Tensor, std: float, gen: torch.Generator | None) -> None:
    # Draw in fp32 on the CPU so the same seed gives the same weights on every device and dtype.
    t.copy_(torch.randn(t.shape, generator=gen) * std)
