"""Dispatch layout and byte accounting for a routing: pure tensor functions, no torch.distributed.

Shape legend: T tokens, K top-k, E experts, R ranks, M nodes, G ranks per node.

Expert e lives on rank e // (E // R); rank r lives on node r // G with local rank r % G.
The byte counts follow docs/ep-bytes.md exactly (the simulator in moeflow.sim uses the same definition).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

STRATEGIES = ("pair", "rank", "node", "allgather")


class DispatchLayout(NamedTuple):
    num_tokens_per_rank: torch.Tensor  # [R] int32: tokens with at least one expert on rank r
    num_tokens_per_rdma_rank: torch.Tensor | None  # [M] int32 per node; None when there is one node
    num_tokens_per_expert: torch.Tensor  # [E] int32: valid (token, expert) entries per expert
    is_token_in_rank: torch.Tensor  # [T, R] bool


def check_topk_idx(topk_idx_TK: torch.Tensor, num_experts: int, setting: str = "topk_idx",
                   check_values: bool = True) -> None:
    """ValueError unless topk_idx is a 2-D int64 tensor with values in [-1, num_experts) (the values only with
    check_values: reading them is a host sync)."""
    if not isinstance(topk_idx_TK, torch.Tensor):
        raise ValueError(f"{setting} must be a torch.Tensor of shape [T, K], got {type(topk_idx_TK).__name__}")
    if topk_idx_TK.dtype != torch.int64:
        raise ValueError(f"{setting} must be int64 (got {topk_idx_TK.dtype}); pass topk_idx.long()")
    if topk_idx_TK.dim() != 2:
        raise ValueError(
            f"{setting} must be 2-D [T, K] (got shape {tuple(topk_idx_TK.shape)}); reshape to [-1, top_k]"
        )
    if check_values and topk_idx_TK.numel():
        # host sync (one): reading the values is the only way to reject bad ids before a collective can hang
        lo, hi = torch.stack(torch.aminmax(topk_idx_TK)).tolist()
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            raise ValueError(
                f"{setting} holds expert id {bad}, outside [-1, num_experts={num_experts}); "
                f"use -1 for 'no expert' and ids 0..{num_experts - 1}"
            )


def rank_of_expert(topk_idx_TK: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """[T, K] owning rank of each entry, -1 where topk_idx is -1."""
    per_rank = num_experts // num_ranks
    return torch.where(topk_idx_TK >= 0, topk_idx_TK // per_rank, torch.full_like(topk_idx_TK, -1))


def token_rank_mask(topk_idx_TK: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """is_token_in_rank [T, R] bool: rank r owns at least one of token t's experts."""
    T = topk_idx_TK.shape[0]
    rank_TK = rank_of_expert(topk_idx_TK, num_experts, num_ranks)
    # Column R collects the -1 entries and is dropped.
    mask_TR1 = torch.zeros(T, num_ranks + 1, dtype=torch.bool, device=topk_idx_TK.device)
    mask_TR1.scatter_(1, torch.where(rank_TK >= 0, rank_TK, num_ranks), True)
    return mask_TR1[:, :num_ranks]


def node_mask(is_token_in_rank_TR: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """[T, M] bool: at least one rank of node n needs token t."""
    T, R = is_token_in_rank_TR.shape
    return is_token_in_rank_TR.view(T, R // ranks_per_node, ranks_per_node).any(dim=2)


def get_dispatch_layout(
    topk_idx_TK: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int | None = None
) -> DispatchLayout:
    """Per-rank, per-node and per-expert token counts and the token-to-rank mask (rank and node dedup)."""
    G = num_ranks if ranks_per_node is None else ranks_per_node
    mask_TR = token_rank_mask(topk_idx_TK, num_experts, num_ranks)
    per_rank_R = mask_TR.sum(0, dtype=torch.int32)
    per_node_M = None
    if num_ranks // G > 1:
        per_node_M = node_mask(mask_TR, G).sum(0, dtype=torch.int32)
    per_expert_E = tokens_per_expert(topk_idx_TK, num_experts, torch.int32)
    return DispatchLayout(per_rank_R, per_node_M, per_expert_E, mask_TR)


def tokens_per_expert(topk_idx_TK: torch.Tensor, num_experts: int, dtype=torch.int64,
                      keep_dropped: bool = False) -> torch.Tensor:
    """[E] valid entries per expert ([E + 1] with keep_dropped: the -1 entries in the last bin). A scatter-add:
    bincount's output size depends on the largest id, which a GPU reads back to the host."""
    key = torch.where(topk_idx_TK >= 0, topk_idx_TK, num_experts).reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=dtype, device=key.device).scatter_add_(
        0, key, torch.ones_like(key, dtype=dtype))
    return counts if keep_dropped else counts[:num_experts]


# ---- byte accounting ---------------------------------------------------------------------------------


def dispatch_row_bytes(
    hidden: int, element_size: int, fp8: bool = False, num_topk: int = 0,
    with_topk_idx: bool = False, with_topk_weights: bool = False,
) -> int:
    """Bytes of one dispatched copy of one token (docs/ep-bytes.md)."""
    row = hidden * element_size
    if fp8:
        row += hidden // 128 * 4
    if with_topk_idx:
        row += num_topk * 8
    if with_topk_weights:
        row += num_topk * 4
    return row


def combine_row_bytes(hidden: int, element_size: int, num_topk: int = 0, with_topk_weights: bool = False) -> int:
    """Bytes of one combined copy of one token (docs/ep-bytes.md)."""
    return hidden * element_size + (num_topk * 4 if with_topk_weights else 0)


@dataclass
class TrafficBytes:
    """Bytes sent to other ranks, inside a node and across nodes, for dispatch and combine."""

    dispatch_bytes_intra: int = 0
    dispatch_bytes_inter: int = 0
    combine_bytes_intra: int = 0
    combine_bytes_inter: int = 0

    def __add__(self, other: TrafficBytes) -> TrafficBytes:
        return TrafficBytes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def copies(
    topk_idx_TK: torch.Tensor, src_rank: int, num_experts: int, num_ranks: int, ranks_per_node: int,
    strategy: str,
) -> tuple[int, int]:
    """(intra, inter) copies that rank `src_rank` sends for its tokens under a strategy of docs/ep-bytes.md."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy = {strategy!r} is not one of {STRATEGIES}")
    G, R = ranks_per_node, num_ranks
    T = topk_idx_TK.shape[0]
    my_node, my_local = src_rank // G, src_rank % G
    node_of_R = torch.arange(R) // G
    if strategy == "allgather":
        return T * (G - 1), T * (R - G)
    if strategy == "pair":
        rank_TK = rank_of_expert(topk_idx_TK.cpu(), num_experts, R)
        sent = (rank_TK >= 0) & (rank_TK != src_rank)
        same_node = (rank_TK // G) == my_node
        return int((sent & same_node).sum()), int((sent & ~same_node).sum())
    mask_TR = token_rank_mask(topk_idx_TK.cpu(), num_experts, R)
    if strategy == "rank":
        mask_TR[:, src_rank] = False
        same_node_R = node_of_R == my_node
        return int(mask_TR[:, same_node_R].sum()), int(mask_TR[:, ~same_node_R].sum())
    # node: one inter copy per destination node other than ours; then, on every destination node, the
    # forwarding peer (local rank == ours) sends one intra copy to each other destination rank there.
    nodes_TM = node_mask(mask_TR, G)
    inter = int(nodes_TM.sum() - nodes_TM[:, my_node].sum())
    not_forwarder_R = (torch.arange(R) % G) != my_local
    intra = int(mask_TR[:, not_forwarder_R].sum())
    return intra, inter


def traffic_bytes(
    topk_idx_per_rank: list[torch.Tensor], num_experts: int, ranks_per_node: int, strategy: str,
    dispatch_row: int, combine_row: int,
) -> TrafficBytes:
    """Total bytes over all ranks for one dispatch + one combine of a routing (one topk_idx per rank).

    `strategy` is one of 'pair' (no dedup), 'rank' (the rank-level lower bound, backend alltoall),
    'node' (the node-level lower bound across nodes, backend hierarchical), 'allgather'.
    Combine sends the same copies back, so its counts equal dispatch's with the combine row size.
    """
    R = len(topk_idx_per_rank)
    if R % ranks_per_node:
        raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide the number of ranks ({R})")
    if num_experts % R:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks ({R})")
    intra = inter = 0
    for s, topk_idx_TK in enumerate(topk_idx_per_rank):
        a, b = copies(topk_idx_TK, s, num_experts, R, ranks_per_node, strategy)
        intra, inter = intra + a, inter + b
    return TrafficBytes(intra * dispatch_row, inter * dispatch_row, intra * combine_row, inter * combine_row)


def lower_bound_bytes(
    topk_idx_per_rank: list[torch.Tensor], num_experts: int, ranks_per_node: int,
    dispatch_row: int, combine_row: int, level: str = "rank",
) -> TrafficBytes:
    """Lower bounds: every token sent once to each destination rank ('rank') or node ('node', two phases)."""
    if level not in ("rank", "node"):
        raise ValueError(f"level = {level!r}; choose 'rank' or 'node'")
    return traffic_bytes(topk_idx_per_rank, num_experts, ranks_per_node, level, dispatch_row, combine_row)
