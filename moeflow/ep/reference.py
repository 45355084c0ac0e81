"""Single-process oracle: given every rank's inputs, return every rank's expected outputs.

Shape legend: T tokens (of one source rank), K top-k, E experts, L local experts (E // R), D hidden,
R ranks, G ranks per node, N received rows, Tm num_max_dispatch_tokens_per_rank.

Plain indexing and index_add, differentiable with autograd, so tests compare values and gradients.
Received rows are ordered by (source rank, token). Combine sums the copies of a token in the order all
backends use (see moeflow/ep/backends/base.py): over nodes ascending of (over that node's ranks
ascending), each sum from zero in float32, so fp32 results match the backends bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.ep.counts import token_rank_mask


@dataclass
class RankRecv:
    """What one rank receives from a dispatch."""

    x: torch.Tensor  # [N, D]
    topk_idx: torch.Tensor | None  # [N, K] local expert ids, -1 elsewhere
    topk_weights: torch.Tensor | None  # [N, K], 0 where topk_idx is -1
    num_tokens_per_expert: list[int]  # [L], not aligned
    src_rank: torch.Tensor  # [N] the source rank of each row
    src_token: torch.Tensor  # [N] the token index at the source


def _rows_for(topk_idx_per_rank, num_experts: int, r: int):
    """(source rank, token) pairs that rank r receives, in (source, token) order."""
    R = len(topk_idx_per_rank)
    src, tok = [], []
    for s, idx in enumerate(topk_idx_per_rank):
        t = token_rank_mask(idx, num_experts, R)[:, r].nonzero()[:, 0]
        src.append(torch.full_like(t, s))
        tok.append(t)
    return torch.cat(src), torch.cat(tok)


def dispatch(xs: list[torch.Tensor], topk_idx_per_rank: list[torch.Tensor], num_experts: int,
             topk_weights_per_rank: list[torch.Tensor] | None = None) -> list[RankRecv]:
    """Every rank's received rows for one dispatch of every rank's x ([T_s, D]) and routing ([T_s, K])."""
    R = len(xs)
    L = num_experts // R
    out = []
    for r in range(R):
        src, tok = _rows_for(topk_idx_per_rank, num_experts, r)
        x = torch.cat([xs[s][tok[src == s]] for s in range(R)])
        gidx = torch.cat([topk_idx_per_rank[s][tok[src == s]] for s in range(R)])
        local = torch.where((gidx >= r * L) & (gidx < (r + 1) * L), gidx - r * L, torch.full_like(gidx, -1))
        w = None
        if topk_weights_per_rank is not None:
            w = torch.cat([topk_weights_per_rank[s][tok[src == s]] for s in range(R)])
            w = torch.where(local >= 0, w, torch.zeros_like(w))
        counts = torch.bincount(local[local >= 0], minlength=L).tolist()
        out.append(RankRecv(x, local, w, counts, src, tok))
    return out


def combine(ys: list[torch.Tensor], topk_idx_per_rank: list[torch.Tensor], num_experts: int,
            ranks_per_node: int, weights: list[torch.Tensor] | None = None):
    """Every source rank's combined rows: the sum over the copies each rank returns ([N_r, D] each).

    -> list of [T_s, D] (and, with `weights` ([N_r, K] per rank), a second list of [T_s, K]).
    """
    R = len(ys)
    recv = [_rows_for(topk_idx_per_rank, num_experts, r) for r in range(R)]

    def reduce(vals):
        outs = []
        for s, idx in enumerate(topk_idx_per_rank):
            T, C = idx.shape[0], vals[0].shape[1]
            dev = vals[0].device
            out = torch.zeros(T, C, dtype=torch.float32, device=dev)
            for first in range(0, R, ranks_per_node):
                partial = torch.zeros(T, C, dtype=torch.float32, device=dev)
                for r in range(first, first + ranks_per_node):
                    src, tok = recv[r]
                    rows = (src == s).nonzero()[:, 0]
                    partial = partial.index_add(0, tok[rows], vals[r][rows].float())
                out = out + partial
            outs.append(out.to(vals[0].dtype))
        return outs

    out_x = reduce(ys)
    return out_x if weights is None else (out_x, reduce(weights))


def low_latency_dispatch(xs: list[torch.Tensor], topk_idx_per_rank: list[torch.Tensor], num_max_tokens: int,
                         num_experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rank: (recv_x [L, R * Tm, D] with expert l's rows first in (source, token) order, counts [L])."""
    R = len(xs)
    L, D = num_experts // R, xs[0].shape[1]
    out = []
    for r in range(R):
        recv = xs[0].new_zeros(L, R * num_max_tokens, D)
        counts = torch.zeros(L, dtype=torch.int32, device=xs[0].device)
        for l_ in range(L):
            e = r * L + l_
            rows = [xs[s][(idx == e).any(dim=1)] for s, idx in enumerate(topk_idx_per_rank)]
            rows = torch.cat(rows)
            recv[l_, :rows.shape[0]] = rows
            counts[l_] = rows.shape[0]
        out.append((recv, counts))
    return out


def low_latency_combine(ys: list[torch.Tensor], topk_idx_per_rank: list[torch.Tensor],
                        topk_weights_per_rank: list[torch.Tensor], num_experts: int) -> list[torch.Tensor]:
    """Per source rank: sum over k (ascending) of topk_weights[:, k] * the row expert topk_idx[:, k] returned."""
    R = len(ys)
    L = num_experts // R
    outs = []
    for s, idx in enumerate(topk_idx_per_rank):
        T, K = idx.shape
        D = ys[0].shape[2]
        out = torch.zeros(T, D, dtype=torch.float32, device=ys[0].device)
        for k in range(K):
            y_TD = torch.zeros(T, D, dtype=torch.float32, device=ys[0].device)
            for t in range(T):
                e = int(idx[t, k])
                if e < 0:
                    continue
                r, l_ = divmod(e, L)
                # Position of (s, t) among expert e's rows: rows of earlier sources, then earlier tokens.
                before = sum(int((topk_idx_per_rank[q] == e).any(dim=1).sum()) for q in range(s))
                before += int((idx[:t] == e).any(dim=1).sum())
                y_TD[t] = ys[r][l_, before].float()
            w = topk_weights_per_rank[s][:, k:k + 1].float().masked_fill(idx[:, k:k + 1] < 0, 0.0)
            out += w * y_TD
        outs.append(out.to(ys[0].dtype))
    return outs
