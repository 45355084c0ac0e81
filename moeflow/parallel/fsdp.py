"""FSDP2 over the data- and context-parallel ranks: experts over what EP leaves of them, a folded MoE's shared experts
over them times tp, then every block, then each stage root.

ZeRO-3 reshards parameters after forward; ZeRO-2 keeps them gathered until backward (`reshard_after_forward`).

Under bf16 autocast each block's matmul weights (every nn.Linear but the router's gate, and the grouped experts)
are gathered in bf16 (FSDP2's MixedPrecisionPolicy, gradients reduced in fp32): half the bytes of the fp32 master
weights, and no bf16 copy of a gathered fp32 weight kept for backward. Autocast would round them to bf16 anyway, so
the gradients are those of autocast over fp32 weights as long as each weight's gradient is produced once before FSDP
reduces it (FSDP accumulates micro-batches in fp32): experts called once per chunk keep fp32 gathers, and so does
everything under zero-bubble schedules or torch.compile (parallelize decides). Norms, router gates and the stage
roots (embedding, final norm, head: the root stays gathered from forward to backward) are gathered in fp32.
A matmul module in a block is expected to run in every forward (one that never runs keeps its unit gathered to
the end of the forward).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from moeflow.core.parallel_dims import ParallelDims
from moeflow.models.moe import GroupedExperts, MoE, Router
from moeflow.parallel.expert import (
    DeferredSyncExperts,
    DeferredSyncSharedExperts,
    ExpertParallelDispatcher,
    deferred_sync_class,
)
from moeflow.parallel.hf_experts import is_expert_parallel_hf
from moeflow.parallel.mesh import folded_moe_mesh, submesh


def apply_fsdp(blocks: dict[str, nn.Module], stages: list[nn.Module], dims: ParallelDims, mesh,
               matmul_dtype: torch.dtype | None = None, offload: bool = False) -> None:
    """matmul_dtype: the dtype the blocks' matmul weights are gathered in (autocast's; see the module doc), or None.
    offload: every shard (weights, gradients, and so the optimizer state) in host memory (parallel.offload)."""
    fsdp = {"reshard_after_forward": dims.zero == 3}
    if offload:
        # pinned host memory makes the copies asynchronous; only a CUDA build can pin
        fsdp["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    # Inputs are not cast: the residual stream stays fp32 between blocks, as under autocast alone.
    matmul = fsdp if matmul_dtype is None else {**fsdp, "mp_policy": MixedPrecisionPolicy(
        param_dtype=matmul_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)}
    # the data-parallel ranks and the context-parallel ones: both hold replicas of the dense weights
    dp_mesh = (submesh(mesh, "dp_replicate", "dp_shard_cp") if dims.dp_replicate > 1 else
               submesh(mesh, "dp_shard_cp"))
    place = balanced_shard(dp_mesh.size())
    for block in blocks.values():
        for moe in (m for m in block.modules() if isinstance(m, MoE)):
            if dims.fold_experts and moe.shared_experts is not None:
                _shard_folded_shared_experts(moe, dims, mesh, matmul)
            if isinstance(moe.dispatcher, ExpertParallelDispatcher):  # else sharded with their block
                # called once per chunk: in bf16 their gradient would add up in bf16 across the chunks
                chunks = moe.dispatcher.num_chunks
                _shard_experts(moe.experts, DeferredSyncExperts, chunks, dims, mesh, matmul if chunks == 1 else fsdp)
        for experts in (m for m in block.modules() if is_expert_parallel_hf(m)):
            # transformers' experts modules, expert-parallel through moeflow/parallel/hf_experts.py: gathered in
            # fp32 (their grouped matmuls take the input's dtype)
            _shard_experts(experts, deferred_sync_class(type(experts)), 1, dims, mesh, fsdp)
        _shard_matmul_weights(block, dp_mesh, place, matmul, matmul_dtype)
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=place, **fsdp)
    # Each stage root gathers its embedding / norm / head; the container of several stages is not run.
    for stage in stages:
        fully_shard(stage, mesh=dp_mesh, shard_placement_fn=place, **fsdp)


def _shard_matmul_weights(block: nn.Module, mesh, place, matmul: dict, matmul_dtype) -> None:
    """Under autocast, the matmul modules of `block` not yet sharded become one FSDP unit gathered in
    `matmul_dtype` (module doc). Blocks share no weights (tied embeddings live in the stage roots)."""
    modules = list(_autocast_matmuls(block)) if matmul_dtype is not None else []
    if modules:
        fully_shard(modules, mesh=mesh, shard_placement_fn=place, **matmul)


def _autocast_matmuls(module: nn.Module):
    """The nn.Linear and GroupedExperts modules under `module` whose weights autocast casts to its dtype: not in
    an FSDP unit already, and not a moeflow Router's gate (which computes in fp32: models.moe.fp32_linear)."""
    for child in module.children():
        if isinstance(child, (FSDPModule, Router)):
            continue
        if isinstance(child, (nn.Linear, GroupedExperts)):
            yield child
        else:
            yield from _autocast_matmuls(child)


def _shard_experts(experts: nn.Module, deferred_class: type, chunks: int, dims: ParallelDims, mesh,
                   fsdp: dict) -> None:
    """The routed experts of an expert-parallel MoE, over what EP leaves of the data-parallel ranks."""
    expert_mesh = submesh(mesh, "dp_replicate", "efsdp") if dims.dp_replicate > 1 else submesh(mesh, "efsdp")
    if dims.efsdp > 1 or dims.dp_replicate > 1 or chunks > 1:
        # Reduce the experts after backward, at the same point on every rank, instead of mid-backward
        # (see DeferredSyncExperts): FSDP's expert reduce-scatter / replica all-reduce and EP's all-to-alls
        # run on different groups, and ranks that issue them in different orders deadlock (seen on gloo,
        # whose collectives block; NCCL kernels of different communicators wait on each other the same
        # way). On every device, so the path the tests run is the one GPUs run. Chunked layers call the
        # experts once per chunk: one reduction after backward rather than one per call.
        experts.__class__ = deferred_class
    fully_shard(experts, mesh=expert_mesh, shard_placement_fn=balanced_shard(expert_mesh.size()), **fsdp)
    # FSDP averages over the expert mesh (dp x cp / ep ranks), but each expert's gradient sums the tokens
    # of all dp x cp ranks (they arrive through the EP group): divide by dp x cp instead.
    experts.set_gradient_divide_factor(float(dims.dp * dims.cp))
    if dims.efsdp > 1:
        # Sum, then divide locally (gloo has no PREMUL_SUM; on NCCL the same result in fp32), on every
        # device so the tested path is the one GPUs run. Not when the reduce-scatter group has one rank:
        # torch 2.13 then divides in its local copy and again after (found by tests/parallel/test_layouts.py:
        # expert gradients came out 1/dp of the right ones).
        experts.set_force_sum_reduction_for_comms(True)


def _shard_folded_shared_experts(moe: MoE, dims: ParallelDims, mesh, fsdp: dict) -> None:
    """The shared experts of an MoE folded over tp, over the dp x cp x tp ranks (folded_moe_mesh) rather than
    replicated on every tp rank: each tp rank runs them whole on its own sequence slice, so over tp they are
    data-parallel like over dp x cp, and ZeRO can shard them there too (Megatron's MoE parallel folding)."""
    shared = moe.shared_experts
    # Reduced after backward, at a fixed point (DeferredSyncSharedExperts): the reduce-scatter's group holds the
    # tp ranks, whose EP all-to-alls the routed branch's backward issues on another group meanwhile.
    shared.__class__ = DeferredSyncSharedExperts
    shared_mesh = folded_moe_mesh(mesh, dims)
    fully_shard(shared, mesh=shared_mesh, shard_placement_fn=balanced_shard(shared_mesh.size()), **fsdp)
    # Each tp rank's gradient covers its own tokens: summed over tp, averaged over the dp x cp ranks, as the
    # router's and the dense weights' are. Summed and divided locally, as the experts' (gloo has no PREMUL_SUM);
    # the reduce-scatter group has tp > 1 ranks, so torch divides once.
    shared.set_gradient_divide_factor(float(dims.dp * dims.cp))
    shared.set_force_sum_reduction_for_comms(True)


def balanced_shard(ranks: int):
    """FSDP2 shards dim 0 by default; a tensor with fewer rows than ranks (the local experts [E/ep, D, F]
    when E/ep < the expert-sharding group, or a small matrix on a large mesh) would then sit whole on
    the first ranks and nothing on the rest. Shard such tensors on their largest dim instead."""

    def place(param: torch.Tensor):
        shape = param.to_local().shape if hasattr(param, "to_local") else param.shape  # FSDP shards the TP shard
        if param.ndim == 0 or shape[0] >= ranks:
            return Shard(0)
        # FSDP2 shards dims other than 0 only evenly
        even = [d for d in range(1, param.ndim) if shape[d] % ranks == 0]
        return Shard(max(even, key=lambda d: shape[d])) if even else Shard(0)

    return place
