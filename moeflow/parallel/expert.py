"""Expert parallelism: each rank of an EP group keeps E / R experts and tokens travel through moeflow.ep.

Shape legend: T tokens (this rank's), K top-k, E experts, L local experts (E // R), D hidden, R ranks,
N rows received by this rank, P valid (row, local expert) pairs sorted by expert.

EP swaps two things of a moeflow MoE and leaves its forward alone: the experts (this rank's slice
[rank * L, (rank + 1) * L), still named `experts`) and the dispatcher (a `Buffer`-backed token mover instead of
the local sort). The router and the shared experts stay replicated (their gradients are this rank's tokens'
share; data parallelism sums them). Output and gradients equal the single-process MoE's on the concatenation
of all ranks' tokens, up to the order of float additions, except for what depends on all tokens in one process
and on this rank's tokens here: the capacity limit (capacity_factor) and the aux/z balance losses.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.ep.buffer import Buffer
from moeflow.models.moe import Dispatched, GroupedExperts, MoE, sort_by_expert, weighted_sum_back


class ExpertParallelDispatcher:
    """dispatch: send each token once to every rank owning one of its experts (Buffer.dispatch), then sort the
    received rows by local expert; combine: sum each received row's weighted expert outputs, then send the
    rows back and sum a token's copies (Buffer.combine)."""

    def __init__(self, buffer: Buffer, num_experts: int):
        self.buffer, self.num_experts = buffer, num_experts
        self.num_local_experts = num_experts // buffer.group_size

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> Dispatched:
        # DeepEP's call sequence (its README): the layout first, then dispatch with every layout tensor, so the
        # same code drives moeflow's backends and deep_ep / uccl.
        per_rank, per_node, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx_TK, self.num_experts)
        recv_x_ND, recv_idx_NK, recv_w_NK, _, handle, _ = self.buffer.dispatch(
            x_TD, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx_TK, topk_weights=topk_weights_TK)
        local = sort_by_expert(recv_x_ND, recv_idx_NK, recv_w_NK, self.num_local_experts)
        local.handle = handle
        return local

    def combine(self, y_PD: torch.Tensor, d: Dispatched, x_TD: torch.Tensor) -> torch.Tensor:
        out_ND = weighted_sum_back(y_PD, d, x_TD)
        out_TD, _, _ = self.buffer.combine(out_ND, d.handle)
        return out_TD


def local_experts(full: GroupedExperts, rank: int, num_ranks: int) -> GroupedExperts:
    """Experts [rank * L, (rank + 1) * L) of `full` as their own module (a copy; meta stays meta)."""
    L = full.num_experts // num_ranks
    with torch.device(full.w1.device):
        local = GroupedExperts(L, full.dim, full.hidden, impl=full.impl, expert_offset=rank * L)
    if full.w1.device.type != "meta":
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                getattr(local, name).copy_(getattr(full, name)[rank * L:(rank + 1) * L])
    return local


def apply_expert_parallel(module: nn.Module, group=None, backend: str = "auto",
                          ranks_per_node: int | None = None, timeout_s: float = 300.0) -> int:
    """Every moeflow MoE inside `module` (or `module` itself) keeps its EP rank's experts and moves tokens over
    `group` (default: the whole world). Returns how many MoE layers were converted."""
    count = 0
    for moe in [m for m in module.modules() if isinstance(m, MoE)]:
        if isinstance(moe.dispatcher, ExpertParallelDispatcher):
            raise ValueError("apply_expert_parallel: this MoE already moves tokens over an EP group; apply it once")
        if moe.pad_to_capacity:
            raise ValueError("apply_expert_parallel: model.moe.pad_to_capacity pads one process's experts and is not "
                             "supported with expert parallelism yet; turn it off")
        buffer = Buffer(group, backend=backend, ranks_per_node=ranks_per_node, timeout_s=timeout_s)
        buffer.check_num_experts(moe.num_experts)
        moe.experts = local_experts(moe.experts, buffer.rank, buffer.group_size)
        moe.dispatcher = ExpertParallelDispatcher(buffer, moe.num_experts)
        count += 1
    return count


class _InputsHiddenFromFSDP:
    """(x, counts) in a container FSDP2's pytree walk does not open."""

    def __init__(self, x_ND: torch.Tensor, counts_E: torch.Tensor):
        self.x_ND, self.counts_E = x_ND, counts_E


class DeferredSyncExperts(GroupedExperts):
    """GroupedExperts whose inputs FSDP2 cannot see, so its pre-forward hook registers no mid-backward
    reduce-scatter for them: the root's final callback reduces these experts after backward, at the same point
    on every rank. Needed on gloo, whose collectives block: FSDP's expert reduce-scatter / replica all-reduce
    and EP's all-to-alls (another group) otherwise come out in different orders on different ranks and
    deadlock. Installed by swapping the class (no attribute is added), before fully_shard."""

    def __call__(self, x_ND, counts_E=None):
        if isinstance(x_ND, _InputsHiddenFromFSDP):
            return super().__call__(x_ND)
        return super().__call__(_InputsHiddenFromFSDP(x_ND, counts_E))

    def forward(self, hidden: _InputsHiddenFromFSDP) -> torch.Tensor:
        return super().forward(hidden.x_ND, hidden.counts_E)
