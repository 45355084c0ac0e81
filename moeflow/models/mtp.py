"""Multi-token prediction (DeepSeek-V3 report, arXiv:2412.19437, sec. 2.2): D sequential modules, module k
predicting the token k + 1 positions ahead of each position.

Module k (1-based) at position i takes h^{k-1}_i, the hidden state the output head read at depth k - 1 (depth 0:
the main model's, after its final norm), and the embedding of token t_{i+k}:

    h'_i = eh_proj(cat[enorm(emb(t_{i+k})), hnorm(h^{k-1}_i)])       embedding first, as the released weights
    h^k  = norm_k(block_k(h'))                                          and vLLM's and transformers' loaders
    logits^k_i = head(h^k_i)        predicting t_{i+k+1}; i = 0 .. S-1-k

The embedding and the output head are the main model's (shared); each module has its own norms, projection and
one transformer block (an MoE block in an MoE model). The loss is lambda / D * sum_k L^k with
L^k = -1/S * sum_i log p^k_i(t_{i+k+1}) (eqs. 24-25). transformers' MtpModel and vLLM feed the head-normed
hidden state (not the raw residual) to the next depth; so does this module, which keeps released checkpoints'
outputs unchanged.

During training the Transformer appends the MTP logits to the main ones along the sequence dimension
(`split_mtp_logits` takes them apart), so a pipeline stage and a loss function still exchange one tensor.
Shape suffixes: B batch, S sequence, D width, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.core.model_config import ModelConfig
from moeflow.models.layers import RMSNorm


class MultiTokenPrediction(nn.Module):
    """One MTP depth: two input norms, the [2D -> D] projection, one transformer block, the output norm."""

    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block  # TransformerBlock(cfg, n_layers + k): built by the Transformer (no import cycle)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, prev_BSD: torch.Tensor, emb_BSD: torch.Tensor, cos, sin) -> torch.Tensor:
        """h^k [B, S', D] (normed, what the head reads) from h^{k-1} and the embeddings k tokens ahead, both
        already cut to the S' positions this depth predicts."""
        h = self.eh_proj(torch.cat([self.enorm(emb_BSD), self.hnorm(prev_BSD)], dim=-1))
        return self.norm(self.block(h, cos, sin))


def mtp_lengths(seq_len: int, depth: int) -> list[int]:
    """Positions of the main logits and of each MTP depth's: [S, S-1, ..., S-D]."""
    return [seq_len - k for k in range(depth + 1)]


def split_mtp_logits(logits_BLV: torch.Tensor, seq_len: int, depth: int) -> list[torch.Tensor]:
    """[main [B, S, V], depth 1 [B, S-1, V], ..., depth D [B, S-D, V]] from the concatenation forward returns."""
    return list(torch.split(logits_BLV, mtp_lengths(seq_len, depth), dim=1))


def mtp_loss_terms(parts: list[torch.Tensor], targets_BS: torch.Tensor, loss_fn) -> list[torch.Tensor]:
    """L^k for k = 1..D, summed: depth k's logits at positions 0..S-1-k against targets[:, k:] (the tokens k + 1
    ahead of the inputs). `loss_fn(logits, targets, reduction='sum')` sums the cross-entropy over trained targets;
    divided by the trained main targets (the runner's scale) it is the report's eq. 24 (a sum over the S-k
    predicted positions over S)."""
    return [loss_fn(part, targets_BS[:, k:], reduction="sum") for k, part in enumerate(parts[1:], start=1)]
