"""FSDP2 over the data- and context-parallel ranks: experts over what EP leaves of them, then every block, then each
stage root.

ZeRO-3 reshards parameters after forward; ZeRO-2 keeps them gathered until backward (`reshard_after_forward`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from moeflow.layout import ParallelDims
from moeflow.models.moe import MoE
from moeflow.parallel.expert import DeferredSyncExperts, ExpertParallelDispatcher
from moeflow.parallel.mesh import submesh


def apply_fsdp(blocks: dict[str, nn.Module], stages: list[nn.Module], dims: ParallelDims, mesh,
               mixed_precision) -> None:
    fsdp = {"reshard_after_forward": dims.zero == 3}
    if mixed_precision is not None:
        fsdp["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    # the data-parallel ranks and the context-parallel ones: both hold replicas of the dense weights
    dp_mesh = (submesh(mesh, "dp_replicate", "dp_shard_cp") if dims.dp_replicate > 1 else
               submesh(mesh, "dp_shard_cp"))
    expert_mesh = submesh(mesh, "dp_replicate", "efsdp") if dims.dp_replicate > 1 else submesh(mesh, "efsdp")
    for block in blocks.values():
        for moe in (m for m in block.modules() if isinstance(m, MoE)):
            if not isinstance(moe.dispatcher, ExpertParallelDispatcher):
                continue  # experts without EP are sharded with their block
            experts = moe.experts
            if dims.efsdp > 1 or dims.dp_replicate > 1 or moe.dispatcher.num_chunks > 1:
                # Reduce the experts after backward, at the same point on every rank, instead of mid-backward
                # (see DeferredSyncExperts): FSDP's expert reduce-scatter / replica all-reduce and EP's all-to-alls
                # run on different groups, and ranks that issue them in different orders deadlock (seen on gloo,
                # whose collectives block; NCCL kernels of different communicators wait on each other the same
                # way). On every device, so the path the tests run is the one GPUs run. Chunked layers call the
                # experts once per chunk: one reduction after backward rather than one per call.
                experts.__class__ = DeferredSyncExperts
            fully_shard(experts, mesh=expert_mesh, shard_placement_fn=balanced_shard(expert_mesh.size()), **fsdp)
            # FSDP averages over the expert mesh (dp x cp / ep ranks), but each expert's gradient sums the tokens
            # of all dp x cp ranks (they arrive through the EP group): divide by dp x cp instead.
            experts.set_gradient_divide_factor(float(dims.dp * dims.cp))
            if dims.efsdp > 1:
                # Sum, then divide locally (gloo has no PREMUL_SUM; on NCCL the same result in fp32), on every
                # device so the tested path is the one GPUs run. Not when the reduce-scatter group has one rank:
                # torch 2.13 then divides in its local copy and again after (found by tests/test_layouts.py:
                # expert gradients came out 1/dp of the right ones).
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=balanced_shard(dp_mesh.size()), **fsdp)
    # Each stage root gathers its embedding / norm / head; the container of several stages is not run.
    for stage in stages:
        fully_shard(stage, mesh=dp_mesh, shard_placement_fn=balanced_shard(dp_mesh.size()), **fsdp)


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
