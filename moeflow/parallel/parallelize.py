"""parallelize(model, dims): apply a parallel layout to a single-device model, in a fixed order.

Order (each step sees the modules the previous one left): build the mesh (pp, dp_replicate, efsdp, ep, tp)
-> pipeline split (this rank keeps its stages' layers; parameter names stay those of the full model) ->
expert parallelism (each MoE keeps E/ep experts and swaps its dispatcher for a token mover) -> tensor +
sequence parallelism by a plan that is data (moeflow.parallel.tensor) -> context parallelism (class swaps of
the stage roots and attention modules, moeflow.parallel.context) -> FP8 compute (moeflow.parallel.fp8: after EP,
so only this rank's experts are wrapped, and before FSDP, which shards the wrapped weights) ->
activation checkpointing ->
torch.compile per block -> FSDP2: experts over what remains of the data-parallel ranks, then every block,
then each stage root -> the step runner (a pipeline schedule, or plain micro-batches). At world size 1
nothing is wrapped. The same order as TorchTitan's parallelize functions, for the same reasons: TP must see
plain modules, FSDP must see the TP-sharded parameters, and the schedule the FSDP-wrapped stages
(docs/design.md, "the order of parallelize").

The sizes are a ParallelDims, validated before this runs; the model gains no attributes: what the run needs
later (mesh, runner, gradient group) comes back in a ParallelState.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

from moeflow.layout import ParallelDims
from moeflow.layout.schedules import SCHEDULES
from moeflow.models.moe import GroupedExperts, MoE
from moeflow.parallel.checkpointing import apply_activation_checkpointing
from moeflow.parallel.fp8 import apply_fp8
from moeflow.parallel.loss import tp_loss
from moeflow.parallel.runner import LocalRunner, MTPObjective
from moeflow.parallel.state import ParallelState


def parallelize(
    model: nn.Module,
    dims: ParallelDims | None = None,
    *,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    zero: int = 3,
    pp_schedule: str = "1F1B",
    microbatches: int = 1,
    activation_checkpointing: str = "none",
    autocast_dtype: torch.dtype | None = None,
    ep_backend: str = "auto",
    ep_overlap: bool | None = None,
    ep_chunks: int = 1,
    ep_num_worst_tokens: int = 0,
    tp_plan: dict | None = None,
    pp_boundaries: list | None = None,
    loss_fn=None,
    pp_microbatch_shape: tuple | None = None,
    compile: bool = False,
    device_type: str | None = None,
    fp8: str = "none",
) -> ParallelState:
    """Parallelize `model` (a moeflow Transformer, or a Hugging Face decoder) in place over the default process
    group; returns its ParallelState.

    Sizes: pass `dims` (a validated moeflow.layout.ParallelDims), or the keywords dp_replicate x dp_shard x cp x tp
    x pp = world size (dp_shard=-1: the rest), ep (borrowed from dp_shard x cp; with tp > 1 the experts are also
    spread over the tp ranks unless ep_over_tp=False), zero (all FSDP2, sharding gradients and AdamW state with fp32
    master weights: 1 gathers the parameters once per step and keeps them through its micro-batches, 2 from each
    forward to its backward, 3 per layer) and pp_schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble, DualPipeV).
    microbatches: forwards per step (pipeline micro-batches, or gradient accumulation). ep_overlap, ep_chunks,
    ep_num_worst_tokens: how the MoE layers move tokens (moeflow.parallel.expert.ExpertParallelDispatcher).
    tp_plan: {module-name pattern: ParallelStyle}, default moeflow.parallel.tensor.tp_plan(model).
    pp_boundaries: the first layer of each stage (default: an even split). pp_microbatch_shape: (rows, seq,
    logits dtype) of one micro-batch, to skip torch's shape inference. loss_fn(logits, targets, reduction='sum') ->
    the summed loss over targets that are not -100 (default: moeflow.parallel.loss.tp_loss); the runner scales it
    (moeflow.parallel.runner). With cp > 1 feed each rank its part of every sequence, inputs, targets and positions
    alike: `state.local_sequence(x_BS)`. With model.mtp_depth > 0 loss_fn is wrapped to add the MTP loss.
    fp8: 'none', 'tensorwise', 'rowwise' or 'mxfp8' (moeflow.parallel.fp8).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dims is None:
        dims = ParallelDims(world, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, ep=ep, zero=zero,
                            pp_schedule=pp_schedule, cp=cp)
        if hasattr(model, "cfg"):
            dims.check_model(model.cfg)
    elif dims.world_size != world:
        raise ValueError(f"ParallelDims is for {dims.world_size} ranks but the process group has {world}")
    _check_model_object(model, dims)
    loss_fn = loss_fn or tp_loss
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.mtp_depth:
        loss_fn = MTPObjective(loss_fn, cfg.mtp_depth, cfg.mtp_loss_coef)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    autocast = (functools.partial(torch.autocast, device_type, dtype=autocast_dtype) if autocast_dtype
                else contextlib.nullcontext)
    state = ParallelState(model, dims)
    if world == 1:
        apply_fp8(model, fp8, device_type)
        apply_activation_checkpointing(blocks(model), activation_checkpointing)
        _compile_blocks(model, compile)
        state.runner = LocalRunner(model, loss_fn, microbatches, autocast,
                                   count_first=_count_first(compile, activation_checkpointing))
        return state

    from moeflow.parallel.fsdp import apply_fsdp
    from moeflow.parallel.mesh import build_mesh, submesh

    mesh = state.mesh = build_mesh(dims, device_type)
    stages = [model]
    if dims.pp > 1:
        from moeflow.parallel.pipeline import build_stage_modules

        stages = build_stage_modules(model, submesh(mesh, "pp").get_local_rank(), dims.pp, dims.pp_schedule,
                                     pp_boundaries)
    if dims.expert_parallel > 1 and any(isinstance(m, MoE) for m in model.modules()):
        from moeflow.parallel.expert import apply_expert_parallel
        from moeflow.parallel.mesh import expert_mesh

        apply_expert_parallel(model, expert_mesh(mesh, dims).get_group(), backend=ep_backend, chunks=ep_chunks,
                              overlap=ep_overlap, num_worst_tokens=ep_num_worst_tokens)
    if dims.tp > 1:
        from moeflow.parallel.tensor import apply_tensor_parallel

        state.tp_mesh = submesh(mesh, "tp")
        for stage in stages:
            apply_tensor_parallel(stage, state.tp_mesh, plan=tp_plan, fold_experts=dims.fold_experts)
    if dims.cp > 1:
        # After the pipeline split (it swaps the class of each stage root, so the stages must exist); before
        # activation checkpointing, compile and FSDP, which wrap or trace the forwards and swap classes themselves
        # (FSDP's class must be the outermost). It changes no parameter, so EP and TP do not care.
        from moeflow.parallel.context import apply_context_parallel
        from moeflow.parallel.mesh import cp_mesh

        state.cp_mesh = cp_mesh(mesh, dims)
        token_scale = apply_context_parallel(stages, state.cp_mesh)
    apply_fp8(model, fp8, device_type)
    apply_activation_checkpointing(blocks(model), activation_checkpointing)
    _compile_blocks(model, compile)
    # Matmul weights gathered in autocast's dtype (parallel/fsdp.py), except where a weight's gradient would add up
    # in bf16 before FSDP reduces it (zero-bubble schedules run weight-gradient passes back to back) or the nested
    # FSDP units would split each compiled block's graph (torch.compile: more graph breaks, other fusions).
    splits_backward = dims.pp > 1 and SCHEDULES[dims.pp_schedule].splits_backward
    apply_fsdp(blocks(model), stages, dims, mesh, None if compile or splits_backward else autocast_dtype)
    if dims.fold_experts:
        _record_folded_moe_params(model, state)
    state.runner = _build_runner(model, stages, mesh, dims, microbatches, loss_fn, autocast, device_type,
                                 pp_microbatch_shape, count_first=_count_first(compile, activation_checkpointing))
    if dims.cp > 1:
        state.runner.token_scale = token_scale
    if dims.fold_experts:
        _scale_folded_router_losses(stages, dims.tp)
    return state


def _scale_folded_router_losses(stages: list[nn.Module], tp: int) -> None:
    """With the MoE folded over tp, each tp rank's balance and z losses average its own tokens, and the router's
    gradients are summed over the tp ranks: weight them 1/tp, so the sum is their mean (as over data-parallel
    ranks; with the global-batch loss, exactly one process's gradient). After the runner, which sets the scale."""
    seen: set[int] = set()
    for stage in stages:
        for moe in (m for m in stage.modules() if isinstance(m, MoE) and id(m) not in seen):
            seen.add(id(moe))
            moe.router.aux_loss_scale /= tp


def _build_runner(model, stages, mesh, dims: ParallelDims, microbatches: int, loss_fn, autocast, device_type: str,
                  pp_microbatch_shape, count_first: bool):
    """The step runner: a pipeline schedule over the (FSDP-wrapped) stages, or plain micro-batches."""
    from moeflow.parallel.mesh import submesh

    balance_groups = _balance_groups(mesh, dims)
    if dims.pp == 1:
        # ZeRO-1 keeps the parameters gathered across the step's micro-batches (one all-gather per step); the
        # pipeline stages do the same by themselves (torch's PipelineStage).
        return LocalRunner(model, loss_fn, microbatches, autocast, keep_gathered=dims.zero == 1,
                           balance_groups=balance_groups, count_first=count_first)
    from moeflow.parallel.pipeline import build_schedule

    device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type,
                                                                                   torch.cuda.current_device())
    runner = build_schedule(stages, submesh(mesh, "pp").get_local_rank(), dims.pp, submesh(mesh, "pp").get_group(),
                            device, dims.pp_schedule, microbatches, loss_fn=loss_fn,
                            microbatch_shape=pp_microbatch_shape if dims.tp == 1 else None,
                            balance_groups=balance_groups)
    runner.autocast = autocast
    return runner


def _balance_groups(mesh, dims: ParallelDims) -> list:
    """The process groups the global-batch balance loss sums expert loads over: the ranks of this stage that
    route different tokens (data-parallel and context-parallel ranks; the tp ranks too when the MoE is folded over
    them, each routing its slice of the sequence)."""
    from moeflow.parallel.mesh import submesh

    groups = [submesh(mesh, "dp_cp").get_group()] if dims.dp * dims.cp > 1 else []
    if dims.fold_experts:
        groups.append(submesh(mesh, "tp").get_group())
    return groups


def _count_first(compile: bool, activation_checkpointing: str) -> bool:
    """Whether the global-batch balance loss needs its counting pass even with one forward per step: a compiled
    block cannot read the loads late, and a recomputed one would see them already there and build another graph."""
    return compile or activation_checkpointing != "none"


def _record_folded_moe_params(model: nn.Module, state: ParallelState) -> None:
    """With the MoE folded over tp, each tp rank's router sees only its own tokens (its gradient is summed over tp
    after backward), and each tp rank holds other experts (their gradients are distinct, not copies). The shared
    experts are neither: FSDP shards them over dp x cp x tp and its reduce-scatter sums them (moeflow.parallel.fsdp).
    Recorded after FSDP, whose parameters they are by then."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        state.tp_distinct += list(moe.experts.parameters())
        state.tp_partial += [p for name, p in moe.named_parameters()
                             if not name.startswith(("experts.", "shared_experts."))]


def _check_model_object(model: nn.Module, dims: ParallelDims) -> None:
    """What the sizes need of a model object beyond its config (Hugging Face models have no moeflow config)."""
    if hasattr(model, "cfg"):
        return
    if dims.pp > 1:
        raise ValueError(f"parallel.pp = {dims.pp} for a {type(model).__name__}: pipeline parallelism is supported "
                         f"for moeflow models only yet (load the checkpoint with moeflow.models.hf.from_pretrained "
                         f"to get one); use tp, ep and data parallelism, or pp = 1")
    if dims.ep > 1 and not any(isinstance(m, MoE) for m in model.modules()):
        raise ValueError(f"parallel.ep = {dims.ep} but {type(model).__name__} has no moeflow MoE layer; for a "
                         f"Hugging Face MoE model call moeflow.models.hf_live.replace_sparse_moe_blocks(model) first")
    if dims.cp > 1:
        raise ValueError(f"parallel.cp = {dims.cp} for a {type(model).__name__}: context parallelism swaps the core "
                         f"of moeflow's attention modules and is supported for moeflow models only yet (load the "
                         f"checkpoint with moeflow.models.hf.from_pretrained to get one); use cp = 1")
    if dims.tp > 1:
        from moeflow.parallel.tensor import check_hf_tp

        check_hf_tp(model, dims.tp)


def blocks(model: nn.Module) -> dict[str, nn.Module]:
    """{layer key: transformer block}: moeflow's `layers` ModuleDict (and its MTP modules, keyed 'mtp.<k>'), or
    a Hugging Face model's `model.layers` ModuleList (the decoder layers FSDP wraps one by one)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        mtp = getattr(model, "mtp", None) or {}
        return {**dict(layers.items()), **{f"mtp.{k}": module for k, module in mtp.items()}}
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return {str(i): block for i, block in enumerate(inner.layers)}
    raise ValueError(f"parallelize: cannot find the transformer blocks of {type(model).__name__} (expected a "
                     f"moeflow Transformer's .layers or a Hugging Face model's .model.layers)")


def _compile_blocks(model: nn.Module, enabled: bool) -> None:
    if not enabled:
        return
    for block in blocks(model).values():
        for experts in (m for m in block.modules() if isinstance(m, GroupedExperts)):
            if experts.resolve_impl(experts.w1) == "grouped_mm" and experts.w1.dtype == torch.float32:
                # torch 2.13 traces _grouped_mm only for bf16 (its fake-tensor rule), though the eager CPU
                # kernel takes fp32: compiled fp32 experts use the padded-bmm path instead.
                experts.impl = "bmm"
        block.compile()
