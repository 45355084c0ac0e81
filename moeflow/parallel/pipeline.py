"""Pipeline parallelism: split a moeflow Transformer into stages, run them with torch.distributed.pipelining.

The split is data (moeflow.core.schedules: `split_layers`, `pipeline_layout`, and the table of schedules
with where their stages sit). Here each rank keeps its stages as modules: stage 0 also keeps `tok_embeddings`,
the last stage `norm` and `output`; every stage is a `Transformer` whose other parts are None and whose
`layers` ModuleDict keeps only its own blocks, still keyed by the global layer index. Parameter names (FQNs)
are therefore the full model's, so checkpoints saved under any pipeline layout line up with the
single-device model's.

Gradients: the last stage's loss is one micro-batch's summed cross-entropy times the step's loss scale (as in
moeflow.parallel.runner) times n_microbatches, because torch's schedules (scale_grads=True) divide the summed
micro-batch gradients by n_microbatches; the result is the gradient of the scaled sum over the per-rank batch.
FSDP over the data-parallel ranks then averages over them, as without pipelining. The MoE aux loss rides on the
routing weights' gradient (moe._AttachAuxLoss), so it is divided by n_microbatches too: under
pipelining, Router.aux_loss_scale should stay 1.0 (not 1 / micro-batches, as with plain accumulation).

Router loads: the trainer updates the aux-loss-free bias from each router's `last_load`, which a
forward overwrites. Inside one schedule step every stage runs n_microbatches forwards, so the stage
class used here (`_RouterLoadStage`) adds each router's `last_load` into a per-step sum right after
each micro-batch forward (`forward_one_chunk`). That point excludes both other forwards torch runs:
the metadata-inference pass on dummy inputs (first step, and after switching between eval and train)
and activation recomputation (inside backward).

Multi-token prediction: the MTP modules sit on the last stage with the output head (they share it), and read the
token embeddings, which only the first stage computes; so with model.mtp_depth > 0 every stage but the last
passes (hidden, embeddings) on, and the embeddings' gradient flows back along the pipeline to the first stage.
Global-batch balance loss: the counting pass (moeflow.parallel.runner) is the schedule's forward-only mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from moeflow.core.schedules import (
    SCHEDULES,
    StageSpec,
    check_schedule_microbatches,
    pipeline_layout,
    resolve_schedule,
    stage_rank,
)
from moeflow.models.transformer import Transformer
from moeflow.parallel.hf_pipeline import stage_boundary, stage_reads_ids
from moeflow.parallel.runner import (
    MTPObjective,
    clear_global_selections,
    global_batch_routers,
    local_token_scale,
    pipeline_counts_first,
    router_layers,
    set_router_loss_scale,
    supply_global_selections,
)
from moeflow.parallel.torch_compat import pipeline_refusal

# The torch class that runs each schedule of moeflow.core.schedules.SCHEDULES (all seven of torch 2.13's
# schedules match the single-device model on CPU/gloo, tests/parallel/test_pp.py, with two workarounds below: V-schedule
# evaluation, and FSDP parameters kept unsharded under the zero-bubble schedules).
SCHEDULE_CLASSES: dict[str, type] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}


# ---- stage modules --------------------------------------------------------------------------------------


def build_stage_modules(
    model: Transformer,
    pp_rank: int,
    pp_size: int,
    schedule_name: str,
    boundaries=None,
    stages_per_rank: int | None = None,
) -> list[nn.Module]:
    """This rank's stage modules, in stage order, from a full Transformer (identical on every rank).

    `model` itself is trimmed in place to what this rank holds (the union of its stages), so it stays
    the container for the optimizer, gradient clipping and checkpoints, with the full model's FQNs.
    With one stage per rank the only stage module is `model`; with several, each is a Transformer
    that shares its blocks (and embedding / head) with `model`. Move the model to its device before
    splitting: the stage modules hold references to its RoPE tables.
    At pp_size 1 this returns [model] untouched (docs/design.md: one process runs plain modules).
    """
    if pp_size == 1:
        return [model]
    if model.cfg.tie_embeddings:
        raise ValueError(
            "model.tie_embeddings = true with parallel.pp > 1: the embedding (first stage) and the output head "
            "(last stage) live on different stages; untie them or set parallel.pp = 1"
        )
    n_layers = model.cfg.n_layers
    if list(model.layers) != [str(i) for i in range(n_layers)]:
        raise ValueError(f"build_stage_modules needs the full model (layers 0..{n_layers - 1}); this one holds "
                         f"layers {list(model.layers)}: split a freshly built model")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank ({pp_rank}) must be in [0, parallel.pp = {pp_size})")
    layout = pipeline_layout(n_layers, pp_size, schedule_name, boundaries, stages_per_rank)
    specs = [s for s in layout if s.rank == pp_rank]
    kept = {i for s in specs for i in s.layers}
    for key in list(model.layers.keys()):
        if int(key) not in kept:
            del model.layers[key]
    if not any(s.embed for s in specs):
        model.tok_embeddings = None
    if not any(s.head for s in specs):
        model.norm = model.output = model.mtp = None
    if len(specs) == 1:
        return [model]
    return [_stage_view(model, spec) for spec in specs]


def _stage_view(model: Transformer, spec: StageSpec) -> Transformer:
    """A Transformer holding `spec`'s parts of `model` (the same module objects, so parameters are shared)."""
    stage = Transformer(model.cfg, embed=False, head=False, layers=[])
    stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in spec.layers})
    if spec.embed:
        stage.tok_embeddings = model.tok_embeddings
    if spec.head:
        stage.norm, stage.output, stage.mtp = model.norm, model.output, model.mtp
    stage.rope_cos, stage.rope_sin = model.rope_cos, model.rope_sin
    return stage


def mean_cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The last stage's loss on one micro-batch (in fp32, like the trainer's)."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten(), reduction=reduction)


class _ScaledLoss:
    """The loss the schedule calls per micro-batch: loss_fn's sum x the step's scale x n_microbatches (which
    cancels the schedule's division of the gradients by n_microbatches)."""

    def __init__(self, loss_fn: Callable, n_microbatches: int):
        self.loss_fn, self.n_microbatches = loss_fn, n_microbatches
        self.scale: torch.Tensor | float = 1.0

    def __call__(self, logits, targets):
        return self.loss_fn(logits, targets, reduction="sum") * (self.scale * self.n_microbatches)


class _RouterLoadStage(PipelineStage):
    """A PipelineStage that sums each router's `last_load` over the micro-batch forwards of a step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.routers = router_layers([self.submod])
        self.count_router_loads = False
        self.router_loads: dict[int, torch.Tensor] = {}
        self.router_dropped: dict[int, torch.Tensor] = {}
        self.router_selected: dict[int, torch.Tensor] = {}  # top-k selections before drops (global-batch loss)

    def reset_router_loads(self) -> None:
        zeros = lambda *shape: torch.zeros(*shape, device=self.device)  # noqa: E731
        self.router_loads = {i: zeros(r.num_experts) for i, r in self.routers.items()}
        self.router_dropped = {i: zeros(()) for i in self.routers}
        self.router_selected = {i: zeros(r.num_experts) for i, r in self.routers.items()}

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if self.count_router_loads:  # read right after the forward: recomputation would overwrite it
            for i, router in self.routers.items():
                self.router_loads[i] += router.last_load
                self.router_dropped[i] += router.last_dropped
                self.router_selected[i] += router.last_selected
        return output

    # torch 2.13's schedule.eval() of the V schedules (ZBVZeroBubble, DualPipeV) still walks the backward
    # actions, and between two stages on the same rank it hands the (absent) input gradient over with
    # these two calls, which assert when there is no backward. Without backward there is nothing to hand.
    def get_local_bwd_output(self, mb_index):
        return () if not self.has_backward else super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


class PipelineRunner:
    """One training or evaluation step of this rank's stages; built by `build_schedule`."""

    def __init__(self, schedule, stages: list[_RouterLoadStage], schedule_name: str, n_microbatches: int,
                 pp_group, last_stage_rank: int, scaled_loss: _ScaledLoss, balance_groups=(),
                 token_scale: Callable = local_token_scale, autocast: Callable = contextlib.nullcontext,
                 folded_tp: int = 1):
        self.schedule, self.stages, self.schedule_name = schedule, stages, schedule_name
        self.scaled_loss = scaled_loss
        self.token_scale = token_scale  # the loss scale when the caller passes none (moeflow.parallel.runner)
        self.n_microbatches, self.pp_group, self.last_stage_rank = n_microbatches, pp_group, last_stage_rank
        self.has_first_stage = any(s.is_first for s in stages)
        self.has_last_stage = any(s.is_last for s in stages)
        self.sends_ids = any(stage_reads_ids(s.submod) for s in stages)  # its layers take the token ids
        self.autocast = autocast  # covers the whole schedule step
        self.objective = scaled_loss.loss_fn if isinstance(scaled_loss.loss_fn, MTPObjective) else None
        self.balanced = global_batch_routers({i: r for s in stages for i, r in s.routers.items()})
        cfg = getattr(stages[0].submod, "cfg", None)  # a transformers model balances with its own losses
        self.counts_first = cfg is not None and pipeline_counts_first(cfg)  # the same on every pp rank
        why = pipeline_refusal(schedule_name, SCHEDULES[schedule_name].placement == "v", dist.get_backend(pp_group),
                               self.objective.depth if self.objective else 0, self.counts_first)
        if why:
            raise ValueError(why)
        self.balance_groups = list(balance_groups)
        self._extra: dict[str, torch.Tensor] = {}
        for stage in stages:
            stage.reset_router_loads()
            # the schedule divides every gradient by n_microbatches itself
            set_router_loss_scale(stage.routers.values(), 1.0, folded_tp)

    def _check_batch(self, inputs: torch.Tensor | None) -> None:
        if inputs is not None and inputs.shape[0] % self.n_microbatches:
            raise ValueError(
                f"pipeline micro-batches ({self.n_microbatches}) must divide the per-rank batch ({inputs.shape[0]}) "
                f"so that all micro-batches have equal size (the loss is their mean)"
            )

    def _run(self, run, inputs, targets, loss_scale, model_kwargs) -> torch.Tensor | None:
        self._check_batch(inputs)
        self.scaled_loss.scale = self.token_scale(targets) if loss_scale is None else loss_scale
        losses: list[torch.Tensor] = []
        # torch before 2.13 checks each micro-batch's strides against the contiguous ones it inferred, and the
        # inputs are a view (tokens[:, :-1])
        args = (inputs.contiguous(),) if self.has_first_stage else ()
        target = targets if self.has_last_stage else None
        if self.objective is not None:
            self.objective.reset()
        # model_kwargs (positions, document ids) are cut into micro-batches like the inputs and reach every stage
        if self.sends_ids:
            model_kwargs = {**model_kwargs, "ids": inputs.contiguous()}
        run(*args, target=target, losses=losses if self.has_last_stage else None, return_outputs=False,
            **model_kwargs)
        if not self.has_last_stage:
            return None
        if self.objective is not None:  # the main cross-entropy; the MTP loss is reported beside it
            main, self._extra = self.objective.scaled(self.scaled_loss.scale)
            return main
        return torch.stack(losses).detach().mean()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_scale=None, **model_kwargs) -> torch.Tensor | None:
        """Forward + backward of this rank's batch in n_microbatches; gradients accumulate in .grad (of the
        summed loss x loss_scale). Returns that scaled loss on the rank holding the last stage, else None."""
        clear_global_selections(self.balanced)
        try:
            if self.counts_first:  # the counting pass: forward only, then one all-reduce per balance group
                self._count(self.schedule.eval, inputs, targets, loss_scale, model_kwargs)
                counts = {i: s.router_selected[i] for s in self.stages for i in s.routers if i in self.balanced}
                supply_global_selections(self.balanced, counts, self.balance_groups)
            return self._count(self.schedule.step, inputs, targets, loss_scale, model_kwargs)
        finally:
            clear_global_selections(self.balanced)

    def _count(self, run, inputs, targets, loss_scale, model_kwargs) -> torch.Tensor | None:
        """`run` with this rank's router loads summed over its micro-batch forwards."""
        for stage in self.stages:
            stage.reset_router_loads()
            stage.count_router_loads = True
        try:
            with torch.no_grad() if run == self.schedule.eval else contextlib.nullcontext():
                return self._run(run, inputs, targets, loss_scale, model_kwargs)
        finally:
            for stage in self.stages:
                stage.count_router_loads = False

    @torch.no_grad()
    def forward_eval(self, inputs: torch.Tensor, targets: torch.Tensor, **model_kwargs) -> torch.Tensor | None:
        """Mean loss over the trained targets without backward (the schedule's forward-only mode); None off the
        last stage. Use batches of the training step's shape: the stages' receive buffers are sized for it."""
        return self._run(self.schedule.eval, inputs, targets, None, model_kwargs)

    def broadcast_loss(self, loss: torch.Tensor | None, device: torch.device | None = None) -> torch.Tensor:
        """The last stage's loss on every rank of the pp group (a scalar tensor)."""
        device = device or self.stages[0].device
        value = loss.detach().reshape(()).float().clone() if loss is not None else torch.zeros((), device=device)
        dist.broadcast(value, group=self.pp_group, group_src=self.last_stage_rank)
        return value

    # ---- the step-runner interface (moeflow.parallel.runner) --------------------------------------------
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_scale=None, **model_kwargs) -> torch.Tensor:
        """`step`, then the last stage's scaled loss (and MTP loss) on every rank of the pp group."""
        self._extra = {}
        with self.autocast():
            loss = self.step(inputs, targets, loss_scale, **model_kwargs)
        if self.objective is not None:
            extra = self._extra.get("mtp_loss") if self.has_last_stage else None
            self._extra = {"mtp_loss": self.broadcast_loss(extra, inputs.device)}
        return self.broadcast_loss(loss, inputs.device)

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor, **model_kwargs) -> torch.Tensor:
        with self.autocast():
            loss = self.forward_eval(inputs, targets, **model_kwargs)
        return self.broadcast_loss(loss, inputs.device)

    def router_loads(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{global layer index: (tokens per expert [E], dropped assignments)} of this rank's routers,
        summed over the micro-batches of the last `step` (this rank's data only)."""
        out = {}
        for stage in self.stages:
            for i in stage.routers:
                out[i] = (stage.router_loads[i], stage.router_dropped[i])
        return dict(sorted(out.items()))

    def extra_losses(self) -> dict[str, torch.Tensor]:
        return dict(self._extra)


def _keep_fsdp_unsharded_in_step(stage_modules: Sequence[nn.Module]) -> None:
    """FSDP2 with reshard_after_forward=True swaps each module's parameters back to the sharded ones after
    every forward; the weight-gradient half (W) of a zero-bubble backward looks the parameters up by
    `module.parameters()` and then finds the sharded ones, which the autograd graph never used, so
    their gradients come out missing or wrong (found on CPU/gloo, torch 2.13). Keeping the parameters
    unsharded from the first forward to the end of the step (ZeRO-2 within a step; the schedule reshards
    after the last backward) avoids that and saves n_microbatches - 1 all-gathers per stage."""
    from torch.distributed.fsdp import FSDPModule

    for module in stage_modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_reshard_after_forward(False, recurse=False)


def _static_shapes(module, index: int, num_stages: int, device, microbatch_shape) -> dict:
    """input_args / output_args of one stage for a micro-batch of (rows, seq[, logits dtype]) token ids.

    Given these, torch's stages skip their shape-inference forward and backward, which run every stage
    once on uninitialised memory (torch.empty) before the first step: through the routers, FSDP's
    all-gathers and moeflow.ep's all-to-alls, whose order then differed between the ranks of an EP group
    (garbage routes tokens differently) and deadlocked on gloo (captured with tests/parallel/layout_worker.py FH=).
    Only for plain tensors: with tensor parallelism the last stage returns DTensor logits, whose gradient
    metadata torch must infer itself (microbatch_shape None).
    """
    boundary = stage_boundary(module)  # a transformers stage's, where more than the hidden states
    if microbatch_shape is None or boundary is None:
        return {}
    B, S, *rest = microbatch_shape
    logits_dtype = rest[0] if rest else torch.float32  # bf16 under autocast; the residual stream stays fp32
    dim, vocab, mtp_depth = _stage_sizes(module)
    first, last = index == 0, index == num_stages - 1
    hidden = lambda: torch.empty(B, S, dim, device=device, requires_grad=True)  # noqa: E731 (gradients flow back)
    # with MTP every boundary carries (hidden, token embeddings), and the head's stage appends the MTP logits
    carried = (hidden(), hidden()) if mtp_depth else (hidden(),)
    received, sent = boundary
    inputs = (torch.zeros(B, S, dtype=torch.long, device=device),) if first else _examples(received, device) or carried
    positions = sum(S - k for k in range(mtp_depth + 1))
    outputs = ((torch.empty(B, positions, vocab, device=device, dtype=logits_dtype, requires_grad=True),)
               if last else _examples(sent, device) or carried)
    return {"input_args": inputs, "output_args": outputs}


def _examples(metas: tuple | None, device) -> tuple:
    """Empty tensors of ((shape, dtype), ...); the floating ones take gradients (an index selection does not)."""
    return tuple(torch.empty(shape, dtype=dtype, device=device, requires_grad=dtype.is_floating_point)
                 for shape, dtype in metas or ())


def _stage_sizes(module: nn.Module) -> tuple[int, int, int]:
    """(hidden width, vocabulary, MTP depth) of a stage: a moeflow Transformer's config, or a transformers model's
    (moeflow.parallel.hf_pipeline)."""
    cfg = getattr(module, "cfg", None)
    if cfg is not None:
        return cfg.dim, cfg.vocab_size, cfg.mtp_depth
    text = module.config.get_text_config()
    return text.hidden_size, text.vocab_size, 0


def build_schedule(
    stage_modules: Sequence[nn.Module],
    pp_rank: int,
    pp_size: int,
    pp_group,
    device: torch.device,
    schedule_name: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mean_cross_entropy,
    microbatch_shape: tuple | None = None,
    balance_groups=(),
    token_scale: Callable = local_token_scale,
    autocast: Callable = contextlib.nullcontext,
    folded_tp: int = 1,
) -> PipelineRunner:
    """Wrap this rank's stage modules (as `build_stage_modules` returned them, after any FSDP / EP
    wrapping) in PipelineStages and the named schedule. `loss_fn(logits, targets, reduction='sum')` sums over
    the micro-batch; the runner scales it by the step's loss scale.

    With FSDP2, shard each block and then each stage module (its root): torch's PipelineStage
    recognises an FSDP root and reduce-scatters the gradients once per step, after the last
    micro-batch. Under the zero-bubble schedules this sets reshard_after_forward=False on every FSDP
    module of the stages (see _keep_fsdp_unsharded_in_step). `microbatch_shape` (rows, seq) of fp32 plain
    activations lets the stages skip torch's shape inference (see _static_shapes)."""
    name = resolve_schedule(schedule_name)
    info = SCHEDULES[name]
    per_rank = len(stage_modules)
    check_schedule_microbatches(n_microbatches, name, pp_size, per_rank)
    if info.splits_backward:
        _keep_fsdp_unsharded_in_step(stage_modules)
    num_stages = pp_size * per_rank
    indices = sorted(s for s in range(num_stages) if stage_rank(s, pp_size, num_stages, info.placement) == pp_rank)
    stages = [
        _RouterLoadStage(module, index, num_stages, device, group=pp_group,
                         **_static_shapes(module, index, num_stages, device, microbatch_shape))
        for module, index in zip(stage_modules, indices)
    ]
    cls = SCHEDULE_CLASSES[name]
    scaled_loss = _ScaledLoss(loss_fn, n_microbatches)
    if info.placement == "single":
        schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=scaled_loss, scale_grads=True)
    else:
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=scaled_loss, scale_grads=True)
    last_stage_rank = stage_rank(num_stages - 1, pp_size, num_stages, info.placement)
    return PipelineRunner(schedule, stages, name, n_microbatches, pp_group, last_stage_rank, scaled_loss,
                          balance_groups, token_scale, autocast, folded_tp)
