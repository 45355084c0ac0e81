"""parallelize(model, ...): apply the parallel layout to a single-device model, in a fixed order.

Order (each step sees the modules the previous one left): validate every size -> build the mesh
(pp, dp_replicate, efsdp, ep, tp) -> pipeline split (this rank keeps its stages' layers; parameter
names stay those of the full model) -> expert parallelism (each rank keeps E/ep experts; tokens travel
through moeflow.ep) -> tensor + sequence parallelism by a plan that is data (moeflow.parallel.tensor)
-> activation checkpointing -> FSDP2: experts over what remains of the data-parallel ranks, then every
block, then each stage root -> the pipeline schedule. At world size 1 nothing is wrapped (DESIGN.md,
principle 8). The same order as TorchTitan's parallelize functions, for the same reasons: TP must see
plain modules, FSDP must see the TP-sharded parameters, and the schedule the FSDP-wrapped stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.parallel.checkpointing import apply_activation_checkpointing
from moeflow.parallel.dims import ParallelDims


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
    tp_plan: dict | None = None,
    pp_schedule: str = "1F1B",
    pp_microbatches: int | None = None,
    pp_boundaries: list | None = None,
    loss_fn=None,
    pp_microbatch_shape: tuple | None = None,
    compile: bool = False,
    device_type: str | None = None,
) -> nn.Module:
    """Parallelize `model` (a moeflow Transformer) in place over the default process group; returns it.

    Sizes: dp_replicate x dp_shard x tp x pp = world size (dp_shard=-1: the rest); ep borrows its ranks
    from dp_shard. zero: 1 (replicated weights, sharded AdamW state), 2 (FSDP2, weights kept gathered
    from forward to backward), 3 (FSDP2). tp_plan: {module-name pattern: ParallelStyle}, default
    moeflow.parallel.tensor.tp_plan(model). pp_schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; pp_microbatches: micro-batches per step (required
    with pp > 1); pp_boundaries: the first layer of each stage (default: an even split);
    pp_microbatch_shape: (rows, seq, logits dtype) of one micro-batch, to skip torch's shape inference.

    Attached: `model.parallel_dims`, `model.device_mesh` (None at world size 1), and with pp > 1
    `model.pp_runner` (moeflow.parallel.pipeline.PipelineRunner: step(inputs, targets) -> loss).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims(world, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, ep=ep)
    if hasattr(model, "cfg"):
        dims.check_model(model.cfg)
    elif dims.pp > 1:
        raise ValueError(f"parallel.pp = {dims.pp} for a {type(model).__name__}: pipeline parallelism is supported "
                         f"for moeflow models only yet (load the checkpoint with moeflow.models.hf.from_pretrained "
                         f"to get one); use tp, ep and data parallelism, or pp = 1")
    elif dims.ep > 1 and not any(isinstance(m, _moe_type()) for m in model.modules()):
        raise ValueError(f"parallel.ep = {dims.ep} but {type(model).__name__} has no moeflow MoE layer; for a "
                         f"Hugging Face MoE model call moeflow.models.hf_live.replace_sparse_moe_blocks(model) first")
    if dims.tp > 1:
        from moeflow.parallel.tensor import check_tp

        check_tp(model, dims.tp)
    if dims.pp > 1:
        from moeflow.parallel.pipeline import resolve_schedule

        pp_schedule = resolve_schedule(pp_schedule)
        if not pp_microbatches:
            raise ValueError(f"parallel.pp = {dims.pp} needs pp_microbatches (micro-batches per step); "
                             f"set --parallel.pp_microbatches to a divisor of the per-rank batch")
    if zero not in (1, 2, 3):
        raise ValueError(f"parallel.zero = {zero}; use 1 (replicated parameters, sharded optimizer state), "
                         f"2 (FSDP2, parameters kept gathered between forward and backward) or 3 (FSDP2)")
    if zero == 1 and (dims.dp < world or dims.ep > 1):
        raise ValueError(f"parallel.zero = 1 with {dims.describe()} is not supported yet: ZeRO-1 runs pure data "
                         f"parallelism only; use --parallel.zero=3 (or 2) with tp, pp or ep")
    model.parallel_dims, model.device_mesh, model.zero = dims, None, zero
    if world == 1:
        apply_activation_checkpointing(blocks(model), activation_checkpointing)
        _compile_blocks(model, compile)
        return model

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = dims.build_mesh(device_type)
    model.device_mesh = mesh
    sub = ParallelDims.submesh
    if zero == 1:
        # ZeRO-1 (Rajbhandari et al. 2020, stage 1): every rank keeps all parameters and gradients; the
        # trainer averages gradients with all_reduce_gradients and the optimizer (ZeroRedundancyOptimizer)
        # keeps 1/dp of the state on each rank.
        apply_activation_checkpointing(blocks(model), activation_checkpointing)
        _compile_blocks(model, compile)
        model.grad_group = dist.group.WORLD  # ZeRO-1 is pure data parallelism (checked above)
        return model

    stages = [model]
    if dims.pp > 1:
        from moeflow.parallel.pipeline import build_stage_modules

        stages = build_stage_modules(model, sub(mesh, "pp").get_local_rank(), dims.pp, pp_schedule, pp_boundaries)
    if dims.ep > 1:
        _apply_expert_parallel(model, sub(mesh, "ep").get_group(), ep_backend)
    if dims.tp > 1:
        from moeflow.parallel.tensor import apply_tensor_parallel

        for stage in stages:
            apply_tensor_parallel(stage, sub(mesh, "tp"), plan=tp_plan)
        model.tp_mesh = sub(mesh, "tp")
    apply_activation_checkpointing(blocks(model), activation_checkpointing)
    _compile_blocks(model, compile)
    _apply_fsdp(model, stages, dims, mesh, zero, mixed_precision, device_type)
    if dims.pp > 1:
        from moeflow.parallel.pipeline import build_schedule, mean_cross_entropy

        device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type,
                                                                                       torch.cuda.current_device())
        model.pp_runner = build_schedule(stages, sub(mesh, "pp").get_local_rank(), dims.pp,
                                         sub(mesh, "pp").get_group(), device, pp_schedule, pp_microbatches,
                                         loss_fn=loss_fn or mean_cross_entropy,
                                         microbatch_shape=pp_microbatch_shape if dims.tp == 1 else None)
    return model


def _moe_type():
    from moeflow.models.moe import MoE

    return MoE


def blocks(model: nn.Module) -> dict[str, nn.Module]:
    """{layer key: transformer block}: moeflow's `layers` ModuleDict, or a Hugging Face model's
    `model.layers` ModuleList (the decoder layers FSDP wraps one by one)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return dict(layers.items())
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return {str(i): block for i, block in enumerate(inner.layers)}
    raise ValueError(f"parallelize: cannot find the transformer blocks of {type(model).__name__} (expected a "
                     f"moeflow Transformer's .layers or a Hugging Face model's .model.layers)")


def _compile_blocks(model: nn.Module, enabled: bool) -> None:
    if not enabled:
        return
    from moeflow.models.moe import GroupedExperts

    for block in blocks(model).values():
        for experts in (m for m in block.modules() if isinstance(m, GroupedExperts)):
            if experts.resolve_impl(experts.w1) == "grouped_mm" and experts.w1.dtype == torch.float32:
                # torch 2.13 traces _grouped_mm only for bf16 (its fake-tensor rule), though the eager CPU
                # kernel takes fp32: compiled fp32 experts use the padded-bmm path instead.
                experts.impl = "bmm"
        block.compile()


def _apply_expert_parallel(model: nn.Module, ep_group, backend: str) -> None:
    """Every moeflow MoE module (moeflow's blocks, or HF sparse blocks swapped for it) becomes an
    ExpertParallelMoE holding E/ep of the experts."""
    from moeflow.ep.moe_layer import ExpertParallelMoE

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _moe_type()):
                setattr(parent, name, ExpertParallelMoE(child, ep_group, backend=backend))


def _apply_fsdp(model, stages, dims: ParallelDims, mesh, zero: int, mixed_precision, device_type: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from moeflow.ep.moe_layer import ExpertParallelMoE

    sub = ParallelDims.submesh
    fsdp = {"reshard_after_forward": zero == 3}
    if mixed_precision is not None:
        fsdp["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    dp_mesh = sub(mesh, "dp_replicate", "dp_shard") if dims.dp_replicate > 1 else sub(mesh, "dp_shard")
    expert_mesh = sub(mesh, "dp_replicate", "efsdp") if dims.dp_replicate > 1 else sub(mesh, "efsdp")
    for block in blocks(model).values():
        for moe in (m for m in block.modules() if isinstance(m, ExpertParallelMoE)):
            experts = moe.experts
            fully_shard(experts, mesh=expert_mesh, shard_placement_fn=balanced_shard(expert_mesh.size()), **fsdp)
            # FSDP averages over the expert mesh (dp / ep ranks), but each expert's gradient sums
            # the tokens of all dp ranks (they arrive through the EP group): divide by dp instead.
            experts.set_gradient_divide_factor(float(dims.dp))
            if device_type == "cpu" and dims.efsdp > 1:
                # gloo has no PREMUL_SUM: sum, then divide locally. Not when the reduce-scatter group has
                # one rank: torch 2.13 then divides in its local copy and again after (found by
                # tests/test_layouts.py: expert gradients came out 1/dp of the right ones).
                experts.set_force_sum_reduction_for_comms(True)
            if device_type == "cpu" and (dims.efsdp > 1 or dims.dp_replicate > 1):
                # gloo collectives block, so every rank must issue them in the same order; FSDP's mid-backward
                # expert reduce-scatter / replica all-reduce and EP's all-to-all (ep group) came out in
                # different orders on different ranks and deadlocked. Reduce the experts after backward.
                moe.defer_expert_grad_sync = True
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=balanced_shard(dp_mesh.size()), **fsdp)
    # Each stage root gathers its embedding / norm / head; the container of several stages is not run.
    for stage in stages:
        fully_shard(stage, mesh=dp_mesh, shard_placement_fn=balanced_shard(dp_mesh.size()), **fsdp)


def balanced_shard(ranks: int):
    """FSDP2 shards dim 0 by default; a tensor with fewer rows than ranks (the local experts [E/ep, D, F]
    when E/ep < the expert-sharding group, or a small matrix on a large mesh) would then sit whole on
    the first ranks and nothing on the rest. Shard such tensors on their largest dim instead."""
    from torch.distributed.tensor import Shard

    def place(param: torch.Tensor):
        shape = param.to_local().shape if hasattr(param, "to_local") else param.shape  # FSDP shards the TP shard
        if param.ndim == 0 or shape[0] >= ranks:
            return Shard(0)
        # FSDP2 shards dims other than 0 only evenly
        even = [d for d in range(1, param.ndim) if shape[d] % ranks == 0]
        return Shard(max(even, key=lambda d: shape[d])) if even else Shard(0)

    return place


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of a parallelized model; returns the norm before clipping.

    Gradients are DTensors on different meshes (experts on the expert mesh, the rest on the data
    mesh, 2-D with tp), which torch's clip_grad_norm_ cannot stack, so each rank sums the squares of
    the elements it is the one to count (moeflow.parallel.tensor.grad_norm_sq_local: replicated copies
    once) and the sums are added over all ranks. ZeRO-1 ranks all hold the whole averaged gradient.
    """
    from moeflow.parallel.tensor import grad_norm_sq_local

    dims = getattr(model, "parallel_dims", None)
    replicated = getattr(model, "grad_group", None) is not None
    distributed = dist.is_initialized() and dims is not None and dims.world_size > 1 and not replicated
    if distributed:
        sq = grad_norm_sq_local(model)  # may replace partial gradients by reduced ones: read grads after
        dist.all_reduce(sq)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if not distributed:
        sq = torch.stack([g.float().pow(2).sum() for g in local]).sum() if local else torch.zeros(())
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
