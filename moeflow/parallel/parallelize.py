"""parallelize(model, dims, options): apply a parallel layout to a single-device model, step by step.

The order is data: `STEPS`, a list of functions each of which sees the modules the previous ones left and is a
no-op where its size is 1 (at world size 1 only fp8, activation checkpointing and compile can apply). Why each
step sits where it does is in its docstring and in docs/design.md ("the order of parallelize"); the same order as
TorchTitan's parallelize functions, for the same reasons: TP must see plain modules, FSDP the TP-sharded
parameters, and the schedule the FSDP-wrapped stages.

What one family of models needs (its blocks, module names, supported dimensions) comes from its adapter
(moeflow.parallel.adapter). The model gains no attributes: what the run needs later (mesh, runner, gradient groups)
comes back in a ParallelState.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moeflow.core.parallel_dims import ParallelDims
from moeflow.core.schedules import SCHEDULES
from moeflow.models.moe import GroupedExperts, MoE
from moeflow.parallel.adapter import ModelAdapter, adapter_for
from moeflow.parallel.fp8 import apply_fp8
from moeflow.parallel.hf_experts import is_expert_parallel_hf
from moeflow.parallel.loss import tp_loss
from moeflow.parallel.module_names import attentions_of, beside_moe, experts_in_layer, ffn_of
from moeflow.parallel.options import ParallelOptions
from moeflow.parallel.recompute import apply_activation_checkpointing
from moeflow.parallel.runner import LocalRunner, MTPObjective, local_token_scale
from moeflow.parallel.state import ParallelState
from moeflow.parallel.tensor import shared_by_heads


def parallelize(model: nn.Module, dims: ParallelDims, options: ParallelOptions | None = None) -> ParallelState:
    """Parallelize `model` (a moeflow Transformer, or a Hugging Face decoder) in place over the default process
    group by `dims` (a validated moeflow.core.parallel_dims.ParallelDims for this world size) and `options`; returns its
    ParallelState, whose runner steps the model. With cp > 1 feed each rank its part of every sequence, inputs,
    targets and positions alike: `state.local_sequence(x_BS)`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dims.world_size != world:
        raise ValueError(f"ParallelDims is for {dims.world_size} ranks but the process group has {world}")
    adapter = adapter_for(model)
    options = options or ParallelOptions()
    adapter.check(dims, options.pp_boundaries, options.pp_microbatch_shape)
    if options.ep_num_worst_tokens and adapter.has_hf_experts and not adapter.has_moe and dims.expert_parallel > 1:
        raise ValueError(HF_STATIC_SIZES.format(options.ep_num_worst_tokens))
    build = _Build(model, adapter, dims, options, ParallelState(model, dims))
    for step in STEPS:
        step(build)
    return build.state


# (transformers' experts run on the received (row, slot) pairs, counted on the host from each dispatch)
HF_STATIC_SIZES = ("parallel.ep_num_worst_tokens = {} on transformers' own experts modules: they run on the pairs "
                   "each dispatch counts, not on static receive buffers; use 0 (moeflow's own modules take -1)")


@dataclass
class _Build:
    """What the steps share while they run."""

    model: nn.Module
    adapter: ModelAdapter
    dims: ParallelDims
    options: ParallelOptions
    state: ParallelState
    stages: list[nn.Module] = field(default_factory=list)  # this rank's pipeline stages ([model] without pp)
    token_scale: Callable = local_token_scale  # the runner's loss scale when the trainer gives none

    @property
    def device_type(self) -> str:
        return self.options.resolved_device_type()

    def blocks(self) -> dict[str, nn.Module]:
        return self.adapter.blocks()


def build_mesh(b: _Build) -> None:
    """The device mesh (pp, dp_replicate, efsdp, ep, tp) with its flattened views, at world size > 1."""
    b.stages = [b.model]
    if b.dims.world_size > 1:
        from moeflow.parallel.mesh import build_mesh as mesh_of

        b.state.mesh = mesh_of(b.dims, b.device_type)


def split_pipeline(b: _Build) -> None:
    """This rank keeps its stages' layers (parameter names stay those of the full model). First: every later step
    wraps or shards only what this rank holds."""
    if b.dims.pp > 1:
        from moeflow.parallel.hf_pipeline import build_hf_stage_modules
        from moeflow.parallel.mesh import submesh
        from moeflow.parallel.pipeline import build_stage_modules

        where = (b.model, submesh(b.state.mesh, "pp").get_local_rank(), b.dims.pp, b.dims.pp_schedule,
                 b.options.pp_boundaries)
        if b.adapter.family == "huggingface":
            b.stages = build_hf_stage_modules(*where, microbatch_shape=_microbatch_shape(b))
        else:
            b.stages = build_stage_modules(*where)


def _microbatch_shape(b: _Build) -> tuple | None:
    """(rows, seq, logits dtype) the pipeline stages are built for; None under tensor parallelism, whose DTensor
    logits' gradient metadata torch infers itself (moeflow.parallel.pipeline._static_shapes)."""
    return b.options.pp_microbatch_shape if b.dims.tp == 1 else None


def expert_parallel(b: _Build) -> None:
    """Each MoE keeps E/ep experts and swaps its dispatcher for a token mover. Before TP, whose plan hooks the MoE
    module itself, and before FSDP, which shards the local experts over what EP leaves of the data-parallel ranks."""
    if b.dims.expert_parallel > 1:
        from moeflow.parallel.expert import apply_expert_parallel
        from moeflow.parallel.hf_experts import apply_hf_expert_parallel
        from moeflow.parallel.mesh import expert_mesh

        o, group = b.options, expert_mesh(b.state.mesh, b.dims).get_group()
        if b.adapter.has_moe:
            apply_expert_parallel(b.model, group, backend=o.ep_backend, chunks=o.ep_chunks, overlap=o.ep_overlap,
                                  num_worst_tokens=o.ep_num_worst_tokens)
        elif b.adapter.has_hf_experts:  # transformers' own experts modules (moeflow/parallel/hf_experts.py)
            apply_hf_expert_parallel(b.model, group, backend=o.ep_backend, chunks=o.ep_chunks, overlap=o.ep_overlap)


def tensor_parallel(b: _Build) -> None:
    """Tensor and sequence parallelism by a plan that is data (moeflow.parallel.tensor), on plain modules."""
    if b.dims.tp > 1:
        from moeflow.parallel.mesh import submesh
        from moeflow.parallel.tensor import PerTokenPart, WholeMixer, apply_tensor_parallel, styled_modules, tp_plan

        b.state.tp_mesh = submesh(b.state.mesh, "tp")
        for stage in b.stages:
            plan = (b.options.tp_plan if b.options.tp_plan is not None else
                    tp_plan(stage, fold_experts=b.dims.fold_experts))
            b.state.tp_whole.update(styled_modules(stage, plan, WholeMixer))
            b.state.tp_per_token.update(styled_modules(stage, plan, PerTokenPart))
            apply_tensor_parallel(stage, b.state.tp_mesh, plan=plan, fold_experts=b.dims.fold_experts)


def context_parallel(b: _Build) -> None:
    """Class swaps of the stage roots and attention modules (moeflow.parallel.context). After the pipeline split
    (the stages must exist); before activation checkpointing, compile and FSDP, which wrap or trace the forwards and
    swap classes themselves (FSDP's class must be the outermost). It changes no parameter, so EP and TP do not
    care. Its loss scale counts the targets of the whole sequences."""
    if b.dims.cp > 1:
        from moeflow.parallel.context import apply_context_parallel
        from moeflow.parallel.hf_context import apply_hf_context_parallel, whole_sequence_mixers
        from moeflow.parallel.mesh import cp_mesh

        b.state.cp_mesh = cp_mesh(b.state.mesh, b.dims)
        if b.adapter.family == "huggingface":  # transformers' attention modules: through its attention interface
            (stage,) = b.stages
            b.token_scale = apply_hf_context_parallel(stage, b.state.cp_mesh)
            b.state.cp_whole.update(whole_sequence_mixers(stage))
            tp_whole = {id(m) for m in b.state.tp_whole.values()}
            split = [fqn for fqn, m in b.state.cp_whole.items() if b.dims.tp > 1 and id(m) not in tp_whole]
            if split:  # its cp hooks would gather a tp rank's head shards as if they were the sequence's
                raise ValueError(f"parallel.cp = {b.dims.cp} with parallel.tp = {b.dims.tp}: {split[0]} runs whole "
                                 f"under cp but is sharded by tp; use one of the two")
        else:
            b.token_scale = apply_context_parallel(b.stages, b.state.cp_mesh)


def fp8(b: _Build) -> None:
    """FP8 compute (moeflow.parallel.fp8): after EP, so only this rank's experts are wrapped, and before FSDP,
    which shards the wrapped weights."""
    apply_fp8(b.model, b.options.fp8, b.device_type)


def activation_checkpointing(b: _Build) -> None:
    apply_activation_checkpointing(b.blocks(), b.options.activation_checkpointing)


def compile_blocks(b: _Build) -> None:
    """torch.compile per block, inside the FSDP units that come next."""
    if not b.options.compile:
        return
    for block in b.blocks().values():
        for experts in (m for m in block.modules() if isinstance(m, GroupedExperts)):
            # the experts' input: autocast's dtype (MoE.forward casts it), else the weights', on the device the
            # model runs on (the weights may still be on the meta device)
            compute = torch.empty(0, dtype=b.options.autocast_dtype or experts.w1.dtype, device=b.device_type)
            if experts.resolve_impl(compute) == "grouped_mm" and compute.dtype != torch.bfloat16:
                # torch traces _grouped_mm only for bf16 (its fake-tensor rule), though the eager CPU kernel
                # takes fp32: compiled fp32 or fp16 experts use the padded-bmm path instead.
                experts.impl = "bmm"
        block.compile()


def fsdp(b: _Build) -> None:
    """FSDP2 at world size > 1: experts over what remains of the data-parallel ranks, then every block, then each
    stage root (moeflow.parallel.fsdp). Matmul weights are gathered in autocast's dtype, except where a weight's
    gradient would add up in bf16 before FSDP reduces it (zero-bubble schedules run weight-gradient passes back to
    back) or the nested units would split each compiled block's graph (more graph breaks, other fusions)."""
    dims = b.dims
    if dims.world_size == 1:
        return
    from moeflow.parallel.fsdp import apply_fsdp

    splits_backward = dims.pp > 1 and SCHEDULES[dims.pp_schedule].splits_backward
    keep_fp32 = b.options.compile or splits_backward
    apply_fsdp(b.blocks(), b.stages, dims, b.state.mesh, None if keep_fp32 else b.options.autocast_dtype,
               offload=b.options.offload == "params")
    if dims.tp > 1:  # latent attention's down-projections and norms: whole on each tp rank, gradients partial
        whole = {id(m) for m in b.state.tp_whole.values()}  # (not in an attention that runs whole itself)
        b.state.tp_partial += [p for block in b.blocks().values()
                               for attention in attentions_of(block, b.adapter.names).values()
                               if id(attention) not in whole
                               for m in shared_by_heads(attention) for p in m.parameters()]
    if dims.fold_experts:
        # With the MoE folded over tp, each tp rank's router sees only its own tokens (its gradient is summed over
        # tp after backward), and each tp rank holds other experts (their gradients are distinct, not copies). The
        # shared experts are neither: FSDP shards them over dp x cp x tp and its reduce-scatter sums them.
        # Recorded after FSDP, whose parameters they are by then.
        for moe in (m for m in b.model.modules() if isinstance(m, MoE)):
            b.state.tp_distinct += list(moe.experts.parameters())
            b.state.tp_partial += [p for name, p in moe.named_parameters()
                                   if not name.startswith(("experts.", "shared_experts."))]
        # transformers' sparse MoE blocks: their experts are spread over ep x tp like moeflow's; everything else
        # in the block (router, shared experts and their gate) sees only this tp rank's tokens and stays
        # replicated over tp, so its gradient is summed over tp after backward.
        # A shared expert beside the block (Granite-MoE's shared_mlp) runs on the same tokens: the same.
        for block in b.blocks().values():
            _, ffn = ffn_of(block, b.adapter.names) or (None, nn.Module())
            experts = [p for m in ffn.modules() if is_expert_parallel_hf(m) for p in m.parameters()]
            if experts:
                b.state.tp_distinct += experts
                spread = {id(p) for p in experts}
                b.state.tp_partial += [p for p in ffn.parameters() if id(p) not in spread]
                b.state.tp_partial += [p for name in beside_moe(block, b.adapter.names)
                                       for p in block.get_submodule(name).parameters()]
            # an MoE the layer's own forward computes (Gemma 4's): the layer runs on this tp rank's tokens, its
            # router and norms are PerTokenParts (summed through tp_per_token), its experts spread over ep x tp
            b.state.tp_distinct += [p for name in experts_in_layer(block)
                                    for p in block.get_submodule(name).parameters()]


def runner(b: _Build) -> None:
    """The step runner, last: a pipeline schedule over the FSDP-wrapped stages, or plain micro-batches."""
    dims, o = b.dims, b.options
    loss_fn = o.loss_fn or tp_loss
    cfg = b.adapter.config
    if cfg is not None and cfg.mtp_depth:
        loss_fn = MTPObjective(loss_fn, cfg.mtp_depth, cfg.mtp_loss_coef)
    # The global-batch balance loss needs its counting pass even with one forward per step under compiled blocks
    # (which cannot read the loads late) or recomputed ones (which would see them already there).
    count_first = o.compile or o.activation_checkpointing != "none"
    folded_tp = dims.tp if dims.fold_experts else 1
    if dims.pp == 1:
        # ZeRO-1 keeps the parameters gathered across the step's micro-batches (one all-gather per step); the
        # pipeline stages do the same by themselves (torch's PipelineStage).
        b.state.runner = LocalRunner(b.model, loss_fn, o.microbatches, o.autocast(), keep_gathered=dims.zero == 1,
                                     balance_groups=_balance_groups(b), count_first=count_first,
                                     token_scale=b.token_scale, folded_tp=folded_tp, forward=b.adapter.logits)
        return
    from moeflow.parallel.mesh import submesh
    from moeflow.parallel.pipeline import build_schedule

    pp_mesh = submesh(b.state.mesh, "pp")
    device = torch.device("cpu") if b.device_type == "cpu" else torch.device(b.device_type,
                                                                             torch.cuda.current_device())
    b.state.runner = build_schedule(
        b.stages, pp_mesh.get_local_rank(), dims.pp, pp_mesh.get_group(), device, dims.pp_schedule, o.microbatches,
        loss_fn=loss_fn, microbatch_shape=_microbatch_shape(b),
        balance_groups=_balance_groups(b), token_scale=b.token_scale, autocast=o.autocast(), folded_tp=folded_tp)


def _balance_groups(b: _Build) -> list:
    """The process groups the global-batch balance loss sums expert loads over: the ranks of this stage that
    route different tokens (data-parallel and context-parallel ranks; the tp ranks too when the MoE is folded over
    them, each routing its slice of the sequence). None at world size 1."""
    from moeflow.parallel.mesh import submesh

    dims, mesh = b.dims, b.state.mesh
    groups = [submesh(mesh, "dp_cp").get_group()] if dims.dp * dims.cp > 1 else []
    if dims.fold_experts:
        groups.append(submesh(mesh, "tp").get_group())
    return groups


# The order (module doc). Each step reads and extends the _Build; each is a no-op where its size is 1.
STEPS: tuple[Callable[[_Build], None], ...] = (
    build_mesh, split_pipeline, expert_parallel, tensor_parallel, context_parallel, fp8, activation_checkpointing,
    compile_blocks, fsdp, runner,
)


def blocks(model: nn.Module) -> dict[str, nn.Module]:
    """{layer key: transformer block} of a model parallelize takes (its adapter's)."""
    return adapter_for(model).blocks()
