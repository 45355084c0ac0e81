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
from moeflow.ep.event import EventOverlap
from moeflow.ep.inflight import InFlight
from moeflow.models.moe import Dispatched, FeedForward, GroupedExperts, MoE, sort_by_expert, weighted_sum_back


class ExpertParallelDispatcher:
    """A TokenDispatcher (moeflow/models/moe.py) over a Buffer. dispatch: send each token once to every rank owning
    one of its experts (Buffer.dispatch), then sort the received rows by local expert; combine: sum each received
    row's weighted expert outputs, then send the rows back and sum a token's copies (Buffer.combine).

    chunks: the layer's tokens travel in this many chunks, so that one chunk's communication is in flight while
    another's experts compute (MoE.forward's loop). overlap: start each dispatch / combine asynchronously and
    wait as late as the loop allows, in forward and in backward (moeflow/ep/autograd.py); off, the same
    operations run in the same order, synchronously, with equal results bit for bit. None: on for CUDA tensors
    or more than one chunk; off for one chunk of CPU tensors, where gloo's transfers run on the cores the experts
    use, so asynchrony hides nothing and costs its thread hand-offs (`make train`'s job, 120 steps, two runs
    each: 9,743 and 9,686 tokens/s off, 9,050 and 9,316 on; the losses equal). num_worst_tokens: 0 for
    exact receive sizes (one host sync per dispatch, for the counts), -1 for the static size that never drops
    a token (ranks x tokens per chunk; every rank must send the same number of tokens, as training's fixed
    micro-batch shapes do), or a number of rows (copies beyond a peer's share are dropped and counted in
    Buffer.static_overflow). With a static size nothing in the layer reads a value back to the host.
    """

    def __init__(self, buffer: Buffer, num_experts: int, chunks: int = 1, overlap: bool | None = None,
                 num_worst_tokens: int = 0):
        self.buffer, self.num_experts = buffer, num_experts
        self.num_local_experts = num_experts // buffer.group_size
        self.num_chunks, self.overlap, self.num_worst_tokens = chunks, overlap, num_worst_tokens

    def chunks(self, num_tokens: int) -> list[slice]:
        n = self.num_chunks
        bounds = [num_tokens * i // n for i in range(n + 1)]
        return [slice(bounds[i], bounds[i + 1]) for i in range(n)]

    def _rows(self, num_tokens: int) -> int:
        W = self.num_worst_tokens
        return self.buffer.group_size * max(num_tokens, 1) if W == -1 else W

    # torch.compile (training.compile) runs the token mover eagerly: its byte packing and collectives are not
    # traceable, and there is nothing in them for the compiler to fuse
    @torch.compiler.disable
    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> InFlight:
        """-> InFlight of the Dispatched rows for this rank's experts: waiting finishes the Buffer's dispatch and
        sorts the received rows by local expert."""
        W = self._rows(x_TD.shape[0])
        if W and not self.buffer.is_external:
            # Static sizes: the layout tensors are computed inside dispatch, without checking the ids' values
            # (get_dispatch_layout reads them back to the host to refuse bad ids).
            layout = {"num_experts": self.num_experts}
        else:
            # DeepEP's call sequence (its README): the layout first, then dispatch with every layout tensor, so
            # the same code drives moeflow's backends and deep_ep / uccl.
            per_rank, per_node, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx_TK,
                                                                                          self.num_experts)
            layout = {"num_tokens_per_rank": per_rank, "num_tokens_per_rdma_rank": per_node,
                      "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert}
        # Buffer takes float32 weights (DeepEP's format); they go back to the router's dtype on arrival (exactly, for
        # a router in another dtype) so the experts weight rows as the single-process MoE does.
        recv_x_ND, recv_idx_NK, recv_w_NK, _, handle, event = self.buffer.dispatch(
            x_TD, topk_idx=topk_idx_TK, topk_weights=topk_weights_TK.float(), num_worst_tokens=W,
            async_finish=self._async(x_TD.device), **layout)
        weight_dtype = topk_weights_TK.dtype

        def arrived(_) -> Dispatched:
            recv_x, recv_w = arrived_tensors(event, recv_x_ND, recv_w_NK)
            local = sort_by_expert(recv_x, recv_idx_NK, recv_w.to(weight_dtype), self.num_local_experts, bool(W))
            local.handle = handle
            return local

        # Nothing to wait for of its own: the rows travel in the Buffer's call (event), which arrived() waits on.
        return InFlight().then(arrived)

    def _async(self, device: torch.device) -> bool:
        return overlaps(self.buffer, self.overlap, self.num_chunks, device)

    @torch.compiler.disable  # communication: a graph break (see dispatch)
    def combine(self, y_PD: torch.Tensor, d: Dispatched, x_TD: torch.Tensor) -> InFlight:
        """-> InFlight of this chunk's output [T, D] in x's dtype (MoE.forward waits on it after the last chunk's
        experts)."""
        # This rank's experts summed per received row in x's dtype (fp32 under autocast), then sent in the experts'
        # dtype (bf16 under autocast, as DeepEP combines): half the bytes; the Buffer sums the ranks in fp32.
        out_ND = weighted_sum_back(y_PD, d, x_TD).to(y_PD.dtype)
        out_TD, _, event = self.buffer.combine(out_ND, d.handle, async_finish=self._async(out_ND.device))
        dtype = x_TD.dtype  # cast after the wait: out_TD is filled when the combine arrives
        return InFlight().then(lambda _: arrived_tensors(event, out_TD)[0].to(dtype))


def overlaps(buffer: Buffer, overlap: bool | None, chunks: int, device: torch.device) -> bool:
    """Whether a token mover starts its dispatches and combines asynchronously (ExpertParallelDispatcher's
    `overlap`; None: on for CUDA or more than one chunk)."""
    # The deep_ep adapter's backward is synchronous and its events are the library's: overlap is moeflow's.
    if buffer.is_external:
        return False
    return device.type == "cuda" or chunks > 1 if overlap is None else overlap


def arrived_tensors(event, *tensors) -> tuple:
    """moeflow's EventOverlap.wait (an autograd node: backward overlaps too). deep_ep's calls are made
    synchronously here (its event holds nothing to wait for)."""
    return event.wait(*tensors) if isinstance(event, EventOverlap) else tensors


def local_experts(full: GroupedExperts, rank: int, num_ranks: int) -> GroupedExperts:
    """Experts [rank * L, (rank + 1) * L) of `full` as their own module (a copy; meta stays meta)."""
    L = full.num_experts // num_ranks
    with torch.device(full.w1.device):
        local = GroupedExperts(L, full.dim, full.hidden, impl=full.impl, expert_offset=rank * L)
    weights = [n for n, _ in full.named_parameters()]  # w1, w3, w2 and a LoRA adapter's factors, all [E, ...]
    for name in weights:
        whole = getattr(full, name)
        if not hasattr(local, name):
            setattr(local, name, nn.Parameter(whole.new_empty(L, *whole.shape[1:]), whole.requires_grad))
        getattr(local, name).requires_grad_(whole.requires_grad)
    local.lora_scale = full.lora_scale
    if full.w1.device.type != "meta":
        with torch.no_grad():
            for name in weights:
                getattr(local, name).copy_(getattr(full, name)[rank * L:(rank + 1) * L])
    return local


def apply_expert_parallel(module: nn.Module, group=None, backend: str = "auto",
                          ranks_per_node: int | None = None, timeout_s: float = 300.0, chunks: int = 1,
                          overlap: bool | None = None, num_worst_tokens: int = 0) -> int:
    """Every moeflow MoE inside `module` (or `module` itself) keeps its EP rank's experts and moves tokens over
    `group` (default: the whole world); chunks / overlap / num_worst_tokens as ExpertParallelDispatcher's.
    Returns how many MoE layers were converted."""
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
        moe.dispatcher = ExpertParallelDispatcher(buffer, moe.num_experts, chunks, overlap, num_worst_tokens)
        count += 1
    return count


class _InputsHiddenFromFSDP:
    """Positional inputs in a container FSDP2's pytree walk does not open."""

    def __init__(self, args: tuple):
        self.args = args


class _DeferredSync:
    """A module whose inputs FSDP2 cannot see, so its pre-forward hook registers no mid-backward reduction for
    its parameters: the root's final callback reduces them after backward, at the same point on every rank.
    Needed on gloo, whose collectives block: FSDP's reduce-scatter / replica all-reduce and EP's all-to-alls
    (another group) otherwise come out in different orders on different ranks and deadlock. Installed by swapping
    the class (no attribute is added), before fully_shard; mixed in before the module's own class."""

    def __call__(self, *args):
        if len(args) == 1 and isinstance(args[0], _InputsHiddenFromFSDP):
            return super().__call__(*args)
        return super().__call__(_InputsHiddenFromFSDP(args))

    def forward(self, hidden: _InputsHiddenFromFSDP) -> torch.Tensor:
        return super().forward(*hidden.args)


_DEFERRED_SYNC: dict[type, type] = {}


def deferred_sync_class(cls: type) -> type:
    """`cls` reduced after backward (see _DeferredSync), for an experts module of another family (transformers')."""
    if cls not in _DEFERRED_SYNC:
        _DEFERRED_SYNC[cls] = type(f"DeferredSync{cls.__name__}", (_DeferredSync, cls), {})
    return _DEFERRED_SYNC[cls]


class DeferredSyncExperts(_DeferredSync, GroupedExperts):
    """GroupedExperts reduced after backward (see _DeferredSync): the routed experts, whose backward runs between
    EP's all-to-alls."""


class DeferredSyncSharedExperts(_DeferredSync, FeedForward):
    """A folded MoE's shared experts reduced after backward (see _DeferredSync): FSDP shards them over the
    dp x cp x tp ranks, a group that overlaps the ep x tp group whose all-to-alls the routed branch's backward
    issues; the two branches are independent, so where autograd reaches the shared experts' input gradient among
    those all-to-alls is the engine's choice, not moeflow's. After backward, the order is fixed."""
