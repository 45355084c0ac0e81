"""The expert-parallel MoE layer: moeflow.models.moe.MoE with its routed experts spread over an EP group.

Shape legend: T tokens (this rank's), K top-k, E experts, L local experts (E // R), D hidden, R ranks,
N rows received by this rank, P valid (row, local expert) pairs sorted by expert.

Each rank keeps experts [rank * L, (rank + 1) * L); the router and the shared experts stay replicated
(their gradients are this rank's tokens' share: sum them over the group, as data parallelism does).
Output and gradients equal the single-process MoE's on the concatenation of all ranks' tokens, up to
the order of float additions. Two things depend on all tokens in the single-process MoE and on this
rank's tokens here: the capacity limit (capacity_factor) and the aux/z balance losses.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.ep.buffer import Buffer
from moeflow.models.moe import GroupedExperts, MoE, permute_by_expert


def _group_rank_size(group) -> tuple[int, int]:
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_moe_experts(moe: MoE, group=None) -> MoE:
    """Replace moe.experts (E experts) by this rank's E / R of them, in place; returns moe."""
    if getattr(moe, "ep_sharded", False):
        return moe
    rank, R = _group_rank_size(group)
    E = moe.num_experts
    if E % R:
        raise ValueError(
            f"model.moe.num_experts ({E}) must be divisible by the EP group size ({R}); choose ep in "
            f"{[d for d in range(1, E + 1) if E % d == 0]}"
        )
    L = E // R
    full = moe.experts
    with torch.device(full.w1.device):  # meta stays meta (dry runs): nothing to copy
        local = GroupedExperts(L, full.dim, full.hidden, impl=full.impl)
    if full.w1.device.type != "meta":
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                getattr(local, name).copy_(getattr(full, name)[rank * L:(rank + 1) * L])
    local.expert_offset = rank * L  # global id of local expert 0 (checkpoints store experts by global id)
    moe.experts = local
    moe.ep_sharded, moe.ep_rank, moe.ep_size = True, rank, R
    return moe


class _HiddenFromFSDP:
    """(x, counts) for GroupedExperts.forward, in a container FSDP2's pytree walk does not open."""

    def __init__(self, x_ND: torch.Tensor, counts_E: torch.Tensor):
        self.x_ND, self.counts_E = x_ND, counts_E


class ExpertParallelMoE(nn.Module):
    """forward(x[..., D]) like MoE's, with dispatch/combine through a moeflow.ep.Buffer.

    The submodule names (router, experts, shared_experts) are MoE's, so state dicts line up except
    that `experts` holds the local slice.
    """

    def __init__(self, moe: MoE, group=None, backend: str = "auto", ranks_per_node: int | None = None,
                 buffer: Buffer | None = None):
        super().__init__()
        shard_moe_experts(moe, group)
        self.buffer = buffer if buffer is not None else Buffer(group, backend=backend,
                                                               ranks_per_node=ranks_per_node)
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.num_local_experts = moe.experts.num_experts
        self.router = moe.router
        self.experts = moe.experts
        self.shared_experts = moe.shared_experts
        self.defer_expert_grad_sync = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = x.reshape(-1, x.shape[-1])
        routed = self.router(x_TD)
        recv_x_ND, recv_idx_NK, recv_w_NK, _, handle, _ = self.buffer.dispatch(
            x_TD, topk_idx=routed.topk_idx, topk_weights=routed.topk_weights, num_experts=self.num_experts
        )
        order_P, counts_L = permute_by_expert(recv_idx_NK, self.num_local_experts)
        row_P = order_P // self.top_k
        if self.defer_expert_grad_sync:
            # Tensors inside a plain object are invisible to FSDP2's pre-forward hook, which therefore
            # registers no mid-backward reduce-scatter: the root's final callback reduces these experts
            # after backward, at the same point on every rank (see parallelize).
            y_PD = self.experts(_HiddenFromFSDP(recv_x_ND[row_P], counts_L))
        else:
            y_PD = self.experts(recv_x_ND[row_P], counts_L)
        y_PD = y_PD * recv_w_NK.reshape(-1)[order_P].unsqueeze(-1).to(y_PD.dtype)
        out_ND = torch.zeros_like(recv_x_ND).index_add(0, row_P, y_PD.to(recv_x_ND.dtype))
        out_TD, _, _ = self.buffer.combine(out_ND, handle)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view_as(x)
