"""Pipeline parallelism: split a moeflow Transformer into stages, run them with torch.distributed.pipelining.

Stage layout
------------
The blocks are split into `num_stages` contiguous runs of layers (`split_layers`). A split is data: per
stage, the global indices of its blocks, i.e. the names `layers.<i>` (DESIGN.md, principle 2), which
`pipeline_layout` turns into one `StageSpec` per stage (its index, its pp rank, its layers). Stage 0
also keeps `tok_embeddings`; the last stage keeps `norm` and `output`; every stage is a `Transformer`
whose other parts are None and whose `layers` ModuleDict keeps only its own blocks, still keyed by
the global layer index. Parameter names (FQNs) are therefore the full model's, so checkpoints saved
under any pipeline layout line up with the single-device model's.

How stages map to pp ranks depends on the schedule (pp = 2, 8 layers shown):

  single (GPipe, 1F1B)          1 stage per rank; rank r holds stage r
      rank 0: stage 0 = embed + layers 0-3          rank 1: stage 1 = layers 4-7 + norm + output
  looped (Interleaved1F1B,      `stages_per_rank` stages (default 2); rank r holds r, r + pp, r + 2pp, ...
          LoopedBFS,              rank 0: stage 0 = embed + layers 0-1, stage 2 = layers 4-5
          InterleavedZeroBubble)  rank 1: stage 1 = layers 2-3, stage 3 = layers 6-7 + norm + output
  V      (ZBVZeroBubble,        exactly 2 stages per rank; rank r holds r and 2pp - 1 - r, so rank 0
          DualPipeV)              holds the first and the last stage (torch 2.13 requires this "V" order)
      rank 0: stage 0 = embed + layers 0-1, stage 3 = layers 6-7 + norm + output
      rank 1: stage 1 = layers 2-3, stage 2 = layers 4-5

Gradients: the last stage's loss is the mean cross-entropy of one micro-batch, and torch's schedules
(scale_grads=True) divide the summed micro-batch gradients by n_microbatches, which equals the gradient
of the full per-rank batch's mean loss when the micro-batches have equal size (validated). FSDP over
the data-parallel ranks then averages over them, as without pipelining. The MoE aux loss rides on the
routing weights' gradient (moe._AttachAuxLoss), so it is divided by n_microbatches too: under
pipelining, Router.aux_loss_scale should stay 1.0 (not 1 / micro-batches, as with plain accumulation).

Router loads: the trainer updates the aux-loss-free bias from each router's `last_load`, which a
forward overwrites. Inside one schedule step every stage runs n_microbatches forwards, so the stage
class used here (`_RouterLoadStage`) adds each router's `last_load` into a per-step sum right after
each micro-batch forward (`forward_one_chunk`). That point excludes both other forwards torch runs:
the metadata-inference pass on dummy inputs (first step, and after switching between eval and train)
and activation recomputation (inside backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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

from moeflow.models.moe import Router
from moeflow.models.transformer import Transformer


@dataclass(frozen=True)
class _ScheduleInfo:
    cls: type
    placement: str  # "single" | "loop" | "v"
    splits_backward: bool = False  # zero-bubble: backward for inputs (I) and for weights (W) run apart
    min_microbatches: str = ""  # "pp" | "stages": the least n_microbatches torch 2.13 accepts


SCHEDULES: dict[str, _ScheduleInfo] = {
    "GPipe": _ScheduleInfo(ScheduleGPipe, "single"),
    "1F1B": _ScheduleInfo(Schedule1F1B, "single", min_microbatches="pp"),
    "Interleaved1F1B": _ScheduleInfo(ScheduleInterleaved1F1B, "loop"),
    "LoopedBFS": _ScheduleInfo(ScheduleLoopedBFS, "loop"),
    "InterleavedZeroBubble": _ScheduleInfo(ScheduleInterleavedZeroBubble, "loop", splits_backward=True),
    "ZBVZeroBubble": _ScheduleInfo(ScheduleZBVZeroBubble, "v", splits_backward=True),
    "DualPipeV": _ScheduleInfo(ScheduleDualPipeV, "v", splits_backward=True, min_microbatches="stages"),
}

# Schedules that do not give correct results with this model here, with the reason. Empty: all seven of
# torch 2.13's schedules match the single-device model on CPU/gloo (tests/test_pp.py), with the two
# workarounds below (V-schedule evaluation; FSDP parameters kept unsharded under zero-bubble schedules).
UNSUPPORTED: dict[str, str] = {}


def resolve_schedule(name: str) -> str:
    """The canonical name of a schedule, matched case-insensitively; ValueError listing the valid ones."""
    by_lower = {key.lower(): key for key in SCHEDULES}
    canonical = by_lower.get(str(name).lower())
    if canonical is None:
        raise ValueError(
            f"parallel.pp_schedule = {name!r} is not a pipeline schedule; choose one of {list(SCHEDULES)} "
            f"(case-insensitive)"
        )
    if canonical in UNSUPPORTED:
        supported = [key for key in SCHEDULES if key not in UNSUPPORTED]
        raise ValueError(
            f"parallel.pp_schedule = {canonical!r} does not work here: {UNSUPPORTED[canonical]}; "
            f"choose one of {supported}"
        )
    return canonical


def default_stages_per_rank(schedule_name: str) -> int:
    return 1 if SCHEDULES[resolve_schedule(schedule_name)].placement == "single" else 2


# ---- the split, as data ---------------------------------------------------------------------------------


def _layer_index(item: int | str, n_layers: int) -> int:
    """3, "3" or "layers.3" -> 3."""
    text = str(item)
    text = text[len("layers."):] if text.startswith("layers.") else text
    if not text.isdigit() or int(text) >= n_layers:
        raise ValueError(
            f"parallel.pp_boundaries names layer {item!r}, which is not a layer of the model "
            f"(layers 0..{n_layers - 1}, or 'layers.<i>')"
        )
    return int(text)


def split_layers(
    n_layers: int, num_stages: int, boundaries: Sequence[int] | Sequence[Sequence[int | str]] | None = None
) -> list[list[int]]:
    """The layer indices of each stage, in order; every layer exactly once, every stage at least one.

    boundaries=None: an even split; when n_layers % num_stages = r > 0 the first r stages take one layer
    more (the last stage already runs the output head and the loss, the largest matmul of a step, and
    the first stage's embedding is a lookup; e.g. 10 layers / 4 stages -> 3, 3, 2, 2).
    boundaries=[0, 3, 5, ...]: the first layer of each stage (num_stages entries, starting at 0).
    boundaries=[[0, 1, 2], [3, 4], ...] (ints or 'layers.<i>' names): each stage's layers.
    """
    if num_stages < 1:
        raise ValueError(f"the number of pipeline stages must be at least 1, got {num_stages}")
    if num_stages > n_layers:
        raise ValueError(
            f"{num_stages} pipeline stages for model.n_layers = {n_layers}: each stage needs at least one layer; "
            f"lower parallel.pp (or the stages per rank) to at most {n_layers} stages in all, or add layers"
        )
    if boundaries is None:
        base, extra = divmod(n_layers, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
        starts = [sum(sizes[:s]) for s in range(num_stages)]
        return [list(range(start, start + size)) for start, size in zip(starts, sizes)]

    boundaries = list(boundaries)
    if len(boundaries) != num_stages:
        raise ValueError(
            f"parallel.pp_boundaries has {len(boundaries)} entries but the pipeline has {num_stages} stages; "
            f"give one entry per stage (its first layer, or its list of layers)"
        )
    if all(isinstance(b, (list, tuple)) for b in boundaries):
        stages = [[_layer_index(item, n_layers) for item in stage] for stage in boundaries]
        if any(not stage for stage in stages):
            raise ValueError(f"parallel.pp_boundaries = {boundaries}: every stage needs at least one layer")
        flat = [i for stage in stages for i in stage]
        if flat != list(range(n_layers)):
            raise ValueError(
                f"parallel.pp_boundaries = {boundaries} must list layers 0..{n_layers - 1} in order, each once "
                f"(stage k's output feeds stage k + 1); got {flat}"
            )
        return stages
    if any(isinstance(b, (list, tuple)) for b in boundaries):
        raise ValueError(
            f"parallel.pp_boundaries = {boundaries} mixes layer lists and first-layer indices; use one form"
        )
    starts = [_layer_index(b, n_layers) for b in boundaries]
    if starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])):
        raise ValueError(
            f"parallel.pp_boundaries = {boundaries} must be the first layer of each stage: start at 0 and "
            f"strictly increase (each stage needs at least one layer), all below model.n_layers = {n_layers}"
        )
    ends = starts[1:] + [n_layers]
    return [list(range(a, b)) for a, b in zip(starts, ends)]


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index, the pp rank that runs it, and what it holds."""

    index: int
    rank: int
    layers: tuple[int, ...]
    embed: bool  # holds tok_embeddings (the first stage)
    head: bool  # holds norm + output (the last stage)

    @property
    def layer_names(self) -> list[str]:
        return [f"layers.{i}" for i in self.layers]


def stage_rank(stage_index: int, pp_size: int, num_stages: int, placement: str) -> int:
    if placement == "v":  # 0, 1, ..., pp-1, pp-1, ..., 1, 0
        return stage_index if stage_index < pp_size else num_stages - 1 - stage_index
    return stage_index % pp_size


def pipeline_layout(
    n_layers: int,
    pp_size: int,
    schedule_name: str,
    boundaries=None,
    stages_per_rank: int | None = None,
) -> list[StageSpec]:
    """Every stage of the pipeline (all ranks), in stage order. Pure data: the planner can print it."""
    name = resolve_schedule(schedule_name)
    placement = SCHEDULES[name].placement
    per_rank = default_stages_per_rank(name) if stages_per_rank is None else stages_per_rank
    if pp_size < 1 or per_rank < 1:
        raise ValueError(f"parallel.pp ({pp_size}) and the stages per rank ({per_rank}) must be at least 1")
    if placement == "single" and per_rank != 1:
        raise ValueError(
            f"parallel.pp_schedule = {name!r} runs one stage per rank, got stages_per_rank = {per_rank}; "
            f"use an interleaved schedule (e.g. 'Interleaved1F1B') for more"
        )
    if placement == "v" and per_rank != 2:
        raise ValueError(f"parallel.pp_schedule = {name!r} needs exactly 2 stages per rank, got {per_rank}")
    num_stages = pp_size * per_rank
    stages = split_layers(n_layers, num_stages, boundaries)
    return [
        StageSpec(s, stage_rank(s, pp_size, num_stages, placement), tuple(layers), s == 0, s == num_stages - 1)
        for s, layers in enumerate(stages)
    ]


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
    At pp_size 1 this returns [model] untouched (DESIGN.md, principle 8).
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
        model.norm = model.output = None
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
        stage.norm, stage.output = model.norm, model.output
    stage.rope_cos, stage.rope_sin = model.rope_cos, model.rope_sin
    return stage


def stage_router_layers(stage_modules: Sequence[nn.Module]) -> dict[int, Router]:
    """{global layer index: Router} over this rank's stages (for packing router loads by layer)."""
    routers = {}
    for module in stage_modules:
        for name, sub in module.named_modules():
            if isinstance(sub, Router):
                routers[int(name.split(".")[1])] = sub  # "layers.<i>.feed_forward.router"
    return dict(sorted(routers.items()))


# ---- schedule and runner --------------------------------------------------------------------------------


def mean_cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """The last stage's loss on one micro-batch (in fp32, like the trainer's)."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())


def validate_microbatches(batch: int, n_microbatches: int, schedule_name: str, pp_size: int,
                          stages_per_rank: int | None = None) -> None:
    """ValueError unless `n_microbatches` splits `batch` (rows per pp rank) into equal micro-batches that
    the schedule accepts. Call it before training, where the per-rank batch is known."""
    if n_microbatches < 1 or batch % n_microbatches:
        raise ValueError(
            f"pipeline micro-batches ({n_microbatches}) must divide the per-rank batch ({batch}) so that all "
            f"micro-batches have equal size (the loss is their mean); choose one of "
            f"{[d for d in range(1, batch + 1) if batch % d == 0]}"
        )
    _check_schedule_microbatches(n_microbatches, schedule_name, pp_size, stages_per_rank)


def _check_schedule_microbatches(n_microbatches: int, schedule_name: str, pp_size: int,
                                 stages_per_rank: int | None) -> None:
    """torch 2.13's own limits on n_microbatches, checked up front with a message that says what to change."""
    name = resolve_schedule(schedule_name)
    info = SCHEDULES[name]
    num_stages = pp_size * (default_stages_per_rank(name) if stages_per_rank is None else stages_per_rank)
    if n_microbatches < 1:
        raise ValueError(f"pipeline micro-batches must be at least 1, got {n_microbatches}")
    need = {"pp": pp_size, "stages": num_stages}.get(info.min_microbatches, 1)
    if n_microbatches < need:
        raise ValueError(
            f"parallel.pp_schedule = {name!r} with {num_stages} stages needs at least {need} micro-batches, "
            f"got {n_microbatches}; use more micro-batches (a smaller micro-batch) or another schedule"
        )
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            raise ValueError(
                f"parallel.pp_schedule = {name!r} needs the micro-batches ({n_microbatches}) to be a multiple of "
                f"their rounds (max(1, micro-batches // pp) = {rounds}); use a multiple of parallel.pp ({pp_size})"
            )


class _RouterLoadStage(PipelineStage):
    """A PipelineStage that sums each router's `last_load` over the micro-batch forwards of a step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.routers = stage_router_layers([self.submod])
        self.count_router_loads = False
        self.router_loads: dict[int, torch.Tensor] = {}
        self.router_dropped: dict[int, torch.Tensor] = {}

    def reset_router_loads(self) -> None:
        self.router_loads = {i: torch.zeros(r.cfg.num_experts, device=self.device) for i, r in self.routers.items()}
        self.router_dropped = {i: torch.zeros((), device=self.device) for i in self.routers}

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if self.count_router_loads:  # read right after the forward: recomputation would overwrite it
            for i, router in self.routers.items():
                self.router_loads[i] += router.last_load
                self.router_dropped[i] += router.last_dropped
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
                 pp_group, last_stage_rank: int):
        self.schedule, self.stages, self.schedule_name = schedule, stages, schedule_name
        self.n_microbatches, self.pp_group, self.last_stage_rank = n_microbatches, pp_group, last_stage_rank
        self.has_first_stage = any(s.is_first for s in stages)
        self.has_last_stage = any(s.is_last for s in stages)
        for stage in stages:
            stage.reset_router_loads()

    def _check_batch(self, inputs: torch.Tensor | None) -> None:
        if inputs is not None and inputs.shape[0] % self.n_microbatches:
            raise ValueError(
                f"pipeline micro-batches ({self.n_microbatches}) must divide the per-rank batch ({inputs.shape[0]}) "
                f"so that all micro-batches have equal size (the loss is their mean)"
            )

    def _run(self, run, inputs, targets) -> torch.Tensor | None:
        self._check_batch(inputs)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first_stage else ()
        target = targets if self.has_last_stage else None
        run(*args, target=target, losses=losses if self.has_last_stage else None, return_outputs=False)
        return torch.stack(losses).detach().mean() if self.has_last_stage else None

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward + backward of this rank's batch in n_microbatches; gradients accumulate in .grad
        (scaled to the batch mean). Returns the mean loss on the rank holding the last stage, else None."""
        for stage in self.stages:
            stage.reset_router_loads()
            stage.count_router_loads = True
        try:
            return self._run(self.schedule.step, inputs, targets)
        finally:
            for stage in self.stages:
                stage.count_router_loads = False

    @torch.no_grad()
    def forward_eval(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Mean loss without backward (the schedule's forward-only mode); None off the last stage.
        Use batches of the training step's shape: the stages' receive buffers are sized for it."""
        return self._run(self.schedule.eval, inputs, targets)

    def broadcast_loss(self, loss: torch.Tensor | None, device: torch.device | None = None) -> torch.Tensor:
        """The last stage's loss on every rank of the pp group (a scalar tensor)."""
        device = device or self.stages[0].device
        value = loss.detach().reshape(()).float().clone() if loss is not None else torch.zeros((), device=device)
        dist.broadcast(value, group=self.pp_group, group_src=self.last_stage_rank)
        return value

    def router_loads(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{global layer index: (tokens per expert [E], dropped assignments)} of this rank's routers,
        summed over the micro-batches of the last `step` (this rank's data only)."""
        out = {}
        for stage in self.stages:
            for i in stage.routers:
                out[i] = (stage.router_loads[i], stage.router_dropped[i])
        return dict(sorted(out.items()))


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
    (garbage routes tokens differently) and deadlocked on gloo (captured with tests/layout_worker.py FH=).
    Only for plain tensors: with tensor parallelism the last stage returns DTensor logits, whose gradient
    metadata torch must infer itself (microbatch_shape None).
    """
    if microbatch_shape is None:
        return {}
    B, S, *rest = microbatch_shape
    logits_dtype = rest[0] if rest else torch.float32  # bf16 under autocast; the residual stream stays fp32
    cfg = module.cfg
    first, last = index == 0, index == num_stages - 1
    hidden_in = torch.empty(B, S, cfg.dim, device=device, requires_grad=True)  # gradients flow back
    inputs = torch.zeros(B, S, dtype=torch.long, device=device) if first else hidden_in
    outputs = (torch.empty(B, S, cfg.vocab_size, device=device, dtype=logits_dtype, requires_grad=True) if last
               else torch.empty(B, S, cfg.dim, device=device, requires_grad=True))
    return {"input_args": (inputs,), "output_args": (outputs,)}


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
) -> PipelineRunner:
    """Wrap this rank's stage modules (as `build_stage_modules` returned them, after any FSDP / EP
    wrapping) in PipelineStages and the named schedule. `loss_fn` must average over the micro-batch.

    With FSDP2, shard each block and then each stage module (its root): torch's PipelineStage
    recognises an FSDP root and reduce-scatters the gradients once per step, after the last
    micro-batch. Under the zero-bubble schedules this sets reshard_after_forward=False on every FSDP
    module of the stages (see _keep_fsdp_unsharded_in_step). `microbatch_shape` (rows, seq) of fp32 plain
    activations lets the stages skip torch's shape inference (see _static_shapes)."""
    name = resolve_schedule(schedule_name)
    info = SCHEDULES[name]
    per_rank = len(stage_modules)
    _check_schedule_microbatches(n_microbatches, name, pp_size, per_rank)
    if info.splits_backward:
        _keep_fsdp_unsharded_in_step(stage_modules)
    num_stages = pp_size * per_rank
    indices = sorted(s for s in range(num_stages) if stage_rank(s, pp_size, num_stages, info.placement) == pp_rank)
    stages = [
        _RouterLoadStage(module, index, num_stages, device, group=pp_group,
                         **_static_shapes(module, index, num_stages, device, microbatch_shape))
        for module, index in zip(stage_modules, indices)
    ]
    if info.placement == "single":
        schedule = info.cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    else:
        schedule = info.cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    last_stage_rank = stage_rank(num_stages - 1, pp_size, num_stages, info.placement)
    return PipelineRunner(schedule, stages, name, n_microbatches, pp_group, last_stage_rank)
