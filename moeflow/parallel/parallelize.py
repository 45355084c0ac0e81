"""parallelize(model, ...): apply the parallel layout to a single-device model, in a fixed order.

Order: validate sizes -> activation checkpointing -> expert parallelism (each rank keeps E/ep experts,
tokens travel through moeflow.ep) -> FSDP2 on the experts over what remains of the data-parallel ranks
-> FSDP2 on every block, then the root. At world size 1 nothing is wrapped (DESIGN.md, principle 8).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.parallel.checkpointing import apply_activation_checkpointing
from moeflow.parallel.dims import ParallelDims

NOT_YET = {
    "tp": "tensor parallelism",
    "pp": "pipeline parallelism",
}


def parallelize(
    model: nn.Module,
    *,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    zero: int = 3,
    activation_checkpointing: str = "none",
    mixed_precision: torch.dtype | None = None,
    ep_backend: str = "auto",
    device_type: str | None = None,
) -> nn.Module:
    """Parallelize `model` (a moeflow Transformer) in place over the default process group; returns it.

    The resolved ParallelDims and DeviceMesh are attached as `model.parallel_dims` / `model.device_mesh`.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims(world, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, ep=ep)
    if hasattr(model, "cfg"):
        dims.check_model(model.cfg)
    for key, what in NOT_YET.items():
        if getattr(dims, key) > 1:
            raise ValueError(f"parallel.{key} = {getattr(dims, key)}: {what} is not supported yet; "
                             f"set --parallel.{key}=1 (data and expert parallelism are)")
    if zero not in (1, 2, 3):
        raise ValueError(f"parallel.zero = {zero}; use 1 (replicated parameters, sharded optimizer state), "
                         f"2 (FSDP2, parameters kept gathered between forward and backward) or 3 (FSDP2)")
    if zero == 1 and dims.dp < world:
        raise ValueError(f"parallel.zero = 1 with {dims.describe()} is not supported yet: ZeRO-1 runs pure data "
                         f"parallelism only; use --parallel.zero=3 (or 2) with tp, pp or ep")
    apply_activation_checkpointing(model.layers, activation_checkpointing)
    model.parallel_dims, model.device_mesh, model.zero = dims, None, zero
    if world == 1:
        return model

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = dims.build_mesh(device_type)
    model.device_mesh = mesh
    if zero == 1:
        # ZeRO-1 (Rajbhandari et al. 2020, stage 1): every rank keeps all parameters and gradients; the
        # trainer averages gradients with all_reduce_gradients and the optimizer (ZeroRedundancyOptimizer)
        # keeps 1/dp of the state on each rank.
        model.grad_group = dist.group.WORLD  # ZeRO-1 is pure data parallelism (checked above)
        return model
    fsdp = {"reshard_after_forward": zero == 3}
    if mixed_precision is not None:
        fsdp["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    sub = ParallelDims.submesh
    dp_mesh = sub(mesh, "dp_replicate", "dp_shard") if dims.dp_replicate > 1 else sub(mesh, "dp_shard")
    expert_mesh = sub(mesh, "dp_replicate", "efsdp") if dims.dp_replicate > 1 else sub(mesh, "efsdp")

    if dims.ep > 1:
        from moeflow.ep.moe_layer import ExpertParallelMoE
        from moeflow.models.moe import MoE

        ep_group = sub(mesh, "ep").get_group()
        for block in model.layers.values():
            if isinstance(block.feed_forward, MoE):
                block.feed_forward = ExpertParallelMoE(block.feed_forward, ep_group, backend=ep_backend)
                experts = block.feed_forward.experts
                fully_shard(experts, mesh=expert_mesh, shard_placement_fn=balanced_shard(expert_mesh.size()),
                            **fsdp)
                # FSDP averages over the expert mesh (dp / ep ranks), but each expert's gradient sums
                # the tokens of all dp ranks (they arrive through the EP group): divide by dp instead.
                experts.set_gradient_divide_factor(float(dims.dp))
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=balanced_shard(dp_mesh.size()), **fsdp)
    fully_shard(model, mesh=dp_mesh, shard_placement_fn=balanced_shard(dp_mesh.size()), **fsdp)
    return model


def balanced_shard(ranks: int):
    """FSDP2 shards dim 0 by default; a tensor with fewer rows than ranks (the local experts [E/ep, D, F]
    when E/ep < the expert-sharding group, or a small matrix on a large mesh) would then sit whole on
    the first ranks and nothing on the rest. Shard such tensors on their largest dim instead."""
    from torch.distributed.tensor import Shard

    def place(param: torch.Tensor):
        if param.ndim == 0 or param.shape[0] >= ranks:
            return Shard(0)
        # FSDP2 shards dims other than 0 only evenly
        even = [d for d in range(1, param.ndim) if param.shape[d] % ranks == 0]
        return Shard(max(even, key=lambda d: param.shape[d])) if even else Shard(0)

    return place


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of a parallelized model; returns the norm before clipping.

    Gradients are DTensors on different meshes (experts on the expert mesh, the rest on the data
    mesh), which torch's clip_grad_norm_ cannot stack, so: sum the squares of the local shards, add
    them up over all ranks, and divide out the copies the replicate dimension holds.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    sq = torch.stack([g.float().pow(2).sum() for g in local]).sum() if local else torch.zeros(())
    dims = getattr(model, "parallel_dims", None)
    replicated = getattr(model, "grad_group", None) is not None  # ZeRO-1: every rank has the whole gradient
    if dist.is_initialized() and dims is not None and dims.world_size > 1 and not replicated:
        dist.all_reduce(sq)
        sq = sq / dims.dp_replicate
    norm = sq.sqrt()
    if max_norm < float("inf"):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(local, coef)
    return norm


def all_reduce_gradients(model: nn.Module) -> None:
    """ZeRO-1: average the gradients over the data-parallel ranks, in one flat buffer (one collective
    instead of one per tensor, as DDP's buckets do). No-op for layouts whose wrappers reduce themselves."""
    group = getattr(model, "grad_group", None)
    if group is None:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
