"""One optimizer step and one evaluation, through the step runner parallelize chose (pipeline or not)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from moeflow.config import JobConfig
from moeflow.core import phases
from moeflow.data.stream import IGNORE_INDEX
from moeflow.models.phase_range import phase_range
from moeflow.parallel.grads import clip_grad_norm_
from moeflow.parallel.runner import router_layers
from moeflow.train import qk_clip
from moeflow.train.build import Setup
from moeflow.train.distributed import DistInfo, SumPacker, Sums, all_reduce_sum


class NonFiniteLossError(RuntimeError):
    pass


def moe_layers(cfg: JobConfig) -> list[int]:
    """Global indices of the MoE layers (MTP blocks after the decoder layers): router statistics are packed by
    these on every rank, so the one all-reduce has the same size whichever layers (pipeline stage) a rank holds."""
    m = cfg.model
    if m.runs_transformers:  # transformers' MoE blocks, read from its modules (moeflow.parallel.hf_experts.HFRouting)
        return _hf_moe_layers(m.hf_path)
    return [i for i in range(m.n_layers + m.mtp_depth) if m.is_moe_layer(i)]


@functools.cache
def _hf_moe_layers(folder: str) -> list[int]:
    from moeflow.models import hf_transformers
    from moeflow.parallel.hf_experts import hf_moe_layers

    return hf_moe_layers(hf_transformers.load(folder, "meta"))


def _local_bytes(tensors) -> int:
    """Bytes this rank stores for `tensors` (the local shard of a DTensor)."""
    locals_ = (t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None)
    return sum(t.numel() * t.element_size() for t in locals_)


def state_bytes(s: Setup, grad_bytes: int) -> dict[str, int]:
    """The largest rank's bytes of parameters, gradients (as measured after the last backward) and
    optimizer state (AdamW moments, of this rank's shards)."""
    sizes = torch.tensor([
        _local_bytes(s.model.parameters()), grad_bytes,
        _local_bytes(v for st in s.optimizer.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0),
    ], dtype=torch.float64, device=s.info.device)
    if dist.is_initialized():
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    return dict(zip(("params", "grads", "optimizer"), (int(x) for x in sizes.tolist())))


@dataclass
class LayerStats:
    """One MoE layer's routing in one step, over the global batch."""

    tokens_per_expert: list[int]
    max_over_mean: float  # the busiest expert's load over the mean load
    dropped_fraction: float  # of the layer's token-to-expert assignments
    router_bias: list[float] | None  # None where this rank holds no router of the layer (another pipeline stage)

    def record(self) -> dict:
        """The layer's entry in metrics.jsonl's "moe"."""
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass
class StepResult:
    """One optimizer step, as every rank saw it after the step's one all-reduce."""

    loss: float  # the global token mean
    lr: float  # the learning rate the step used
    grad_norm: float  # before clipping
    skipped: bool  # the loss or the gradient norm was not finite and training.on_nonfinite = "skip"
    grad_bytes: int | None  # the gradient bytes this rank held (only with `measure`)
    per_rank: dict[str, list[float]]  # every rank's value of each name `per_rank` returned, indexed by rank
    losses: dict[str, float]  # the extra losses ({"mtp_loss": ...}), global means like `loss`
    moe: dict[int, LayerStats] | None  # by global layer index (only with `with_moe_stats` and MoE layers)
    max_logits: dict[int, float] | None = None  # training.muon_clip: each layer's largest attention logit


def train_step(cfg: JobConfig, s: Setup, with_moe_stats: bool = True, measure: bool = False,
               per_rank: Callable[[], dict[str, float]] | None = None) -> StepResult:
    """One optimizer step, read back after one all-reduce of everything it reports. The per-layer expert statistics
    only when `with_moe_stats`, since they copy every layer to the host; the gradient bytes this rank held only when
    `measure` (the last step, for the summary).
    per_rank: a function returning a few named numbers of this rank (its stop flag, busy time, peak memory), called
    after backward; every rank's values ride in the same all-reduce and come back as StepResult.per_rank."""
    layers = moe_layers(cfg)
    if cfg.training.muon_clip:
        qk_clip.track([s.model])  # the step's forwards record each head's largest logit
    packer = _forward_backward(cfg, s, layers)
    for name, value in (per_rank() if per_rank else {}).items():
        packer.add(f"rank/{name}", _one_hot(value, s.info))
    # Reading the sums back is the trainer's one host sync per step, needed anyway for the non-finite check (every
    # rank must take the same decision) and the progress bar.
    sums = packer.all_reduce_sum()
    world = s.info.world_size  # every rank holds the same loss, extra losses and norm: divide the copies out
    loss, grad_norm = sums["loss"] / world, sums["grad_norm"] / world
    skipped, lr = _optimizer_step(cfg, s, loss, grad_norm)
    max_logits = None
    if cfg.training.muon_clip:  # after the update, as K2: the step's logits bound the next step's weights
        tp_rank = s.par.tp_mesh.get_local_rank() if s.par.tp_mesh is not None else 0
        max_logits = qk_clip.clip([s.model], cfg.training.muon_clip if not skipped else float("inf"),
                                  cfg.model.n_layers, cfg.model.n_heads, tp_rank)
    grad_bytes = _local_bytes(p.grad for p in s.model.parameters()) if measure else None  # sizes only, no sync
    s.optimizer.zero_grad(set_to_none=True)
    s.scheduler.step()
    moe = _route_next_step(cfg, s, layers, sums, with_moe_stats) if layers else None
    return StepResult(loss, lr, grad_norm, skipped, grad_bytes, per_rank=sums.group("rank/"),
                      losses={name: v / world for name, v in sums.group("extra/").items()}, moe=moe,
                      max_logits=max_logits)


def _forward_backward(cfg: JobConfig, s: Setup, layers: list[int]) -> SumPacker:
    """Forward, backward and gradient clipping of one global batch; returns what the step reports, packed."""
    par = s.par
    s.model.train()
    batch = s.sampler.next_batch().map(par.local_sequence).to(s.info.device)
    # The global token mean: dp x cp x (this rank's summed loss) / (trained targets of the whole global batch),
    # which the gradient average over the dp x cp ranks (FSDP's) turns into the same gradient under any layout
    # and accumulation (cp ranks hold parts of the same sequences).
    loss_scale = par.dims.dp * par.dims.cp / max(1, batch.global_tokens)
    packer = SumPacker(s.info.device)
    packer.add("loss", par.runner.train_step(batch.inputs, batch.targets, loss_scale, **batch.model_kwargs()))
    for name, value in par.runner.extra_losses().items():  # {"mtp_loss": ...}: like the loss, the same on every rank
        packer.add(f"extra/{name}", value)
    if layers:
        loads_LE, dropped_L = _router_loads(cfg, s, layers)
        packer.add("loads", loads_LE)
        packer.add("dropped", dropped_L)
    clip = cfg.training.grad_clip if cfg.training.grad_clip > 0 else float("inf")
    with phase_range(phases.GRAD_NORM):
        packer.add("grad_norm", clip_grad_norm_(s.model, clip, par))
    return packer


def _router_loads(cfg: JobConfig, s: Setup, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens per expert [L, E], dropped assignments [L]) of every MoE layer, zero for the layers another pipeline
    stage holds: the same size on every rank, so the sum over the ranks is the global count (times the copies)."""
    row_of = {layer: i for i, layer in enumerate(layers)}
    loads_LE = torch.zeros(len(layers), cfg.model.moe.num_experts, device=s.info.device)
    dropped_L = torch.zeros(len(layers), device=s.info.device)
    for layer, (load_E, drop) in s.par.runner.router_loads().items():
        loads_LE[row_of[layer]] += load_E
        dropped_L[row_of[layer]] += drop
    return loads_LE, dropped_L


def _one_hot(value: float, info: DistInfo) -> torch.Tensor:
    """[world_size] zeros with this rank's `value` at its index: summed over the ranks, every rank's value."""
    column_R = torch.zeros(info.world_size, device=info.device)
    column_R[info.rank] = value
    return column_R


def _optimizer_step(cfg: JobConfig, s: Setup, loss: float, grad_norm: float) -> tuple[bool, float]:
    """(skipped, learning rate): the update unless the loss or the norm is not finite (every rank decides alike,
    from the same sums); NonFiniteLossError instead of a skip unless training.on_nonfinite = "skip"."""
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if not finite and cfg.training.on_nonfinite == "stop":
        raise NonFiniteLossError(
            f"loss is {loss} (grad norm {grad_norm}) at step {s.scheduler.last_epoch + 1}; lower training.lr, "
            f"enable training.grad_clip, or set --training.on_nonfinite=skip to drop such steps"
        )
    lr = s.scheduler.get_last_lr()[0]
    if finite:
        with phase_range(phases.OPTIMIZER):
            s.optimizer.step()
    return not finite, lr


def _route_next_step(cfg: JobConfig, s: Setup, layers: list[int], sums: Sums,
                     with_moe_stats: bool) -> dict[int, LayerStats] | None:
    """Updates the routers' load-balancing bias from the global loads; their statistics when `with_moe_stats`."""
    # With the MoE replicated over tp every tp rank routes all of its dp rank's tokens: divide the copies out.
    copies = s.par.dims.moe_token_copies
    routers = router_layers([s.model])
    loads_LE = sums.on_device("loads") / copies
    if cfg.peft.method == "none":  # a LoRA run keeps the base, the routers' selection biases included, frozen
        for layer, router in routers.items():
            router.update_bias(loads_LE[layers.index(layer)])
    if not with_moe_stats:
        return None
    host_loads_LE = torch.tensor(sums["loads"], device="cpu") / copies  # from the host copy (no device read)
    dropped = [d / copies for d in sums["dropped"]]
    return {layer: _layer_stats(cfg, layer, routers.get(layer), load_E, drop)
            for layer, load_E, drop in zip(layers, host_loads_LE, dropped)}


def _layer_stats(cfg: JobConfig, layer: int, router, load_E: torch.Tensor, dropped: float) -> LayerStats:
    depth = max(0, layer - cfg.model.n_layers + 1)  # MTP depth k routes the S - k positions it predicts from
    assignments = cfg.training.global_batch * (cfg.data.seq_len - depth) * cfg.model.moe.top_k
    return LayerStats(
        tokens_per_expert=[int(x) for x in load_E.tolist()],
        max_over_mean=float(load_E.max() / load_E.mean().clamp(min=1e-9)),
        dropped_fraction=dropped / assignments,
        # under pipeline parallelism rank 0 holds only its stage's routers
        router_bias=None if router is None or router.expert_bias is None else [
            round(b, 5) for b in router.expert_bias.tolist()],
    )


@torch.no_grad()
def evaluate(cfg: JobConfig, s: Setup) -> float | None:
    """Mean validation loss; each data-parallel rank scores its rows of every batch (tp and pp ranks of
    one replica see the same rows, cp ranks their chunks of them) and the sums are all-reduced (copies cancel
    in the ratio)."""
    if not s.val:
        return None
    s.model.eval()
    dp, dp_rank = s.par.dims.dp, s.par.dp_rank
    total = torch.zeros(2, device=s.info.device)
    for batch in s.val:
        n = batch.inputs.shape[0]
        part = batch.rows(dp_rank * n // dp, (dp_rank + 1) * n // dp)
        # this rank's share of the rows' trained targets: under context parallelism eval_loss is scaled by the
        # whole sequences' count x cp (moeflow.parallel.context), so this weight turns it into the local sum
        trained = (part.targets != IGNORE_INDEX).sum().float().to(s.info.device) / s.par.dims.cp
        part = part.map(s.par.local_sequence).to(s.info.device)
        loss_sum = s.par.runner.eval_loss(part.inputs, part.targets, **part.model_kwargs()) * trained
        total += torch.stack([loss_sum.float(), trained])
    total = all_reduce_sum(total)
    return float(total[0] / total[1])
