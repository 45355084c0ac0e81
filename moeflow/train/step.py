"""One optimizer step and one evaluation, through the step runner parallelize chose (pipeline or not)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moeflow.config import JobConfig
from moeflow.parallel.grads import clip_grad_norm_
from moeflow.parallel.runner import router_layers
from moeflow.train.build import Setup
from moeflow.train.data import IGNORE_INDEX
from moeflow.train.distributed import all_reduce_sum, read_after_collective


class NonFiniteLossError(RuntimeError):
    pass


def moe_layers(cfg: JobConfig) -> list[int]:
    """Global indices of the MoE layers (MTP blocks after the decoder layers): router statistics are packed by
    these on every rank, so the one all-reduce has the same size whichever layers (pipeline stage) a rank holds."""
    m = cfg.model
    return [i for i in range(m.n_layers + m.mtp_depth) if m.is_moe_layer(i)]


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


def train_step(cfg: JobConfig, s: Setup, with_moe_stats: bool = True, measure: bool = False,
               rank_row=None) -> dict:
    """One optimizer step. Returns plain numbers (after one all-reduce of loss and expert load); the
    per-layer expert statistics only when `with_moe_stats`, since they copy every layer to the host;
    the gradient bytes this rank held only when `measure` (the last step, for the summary).
    rank_row: a function returning a few numbers of this rank (its stop flag, busy time, peak memory), called after
    backward; every rank's row rides in the same all-reduce and comes back as out["rank_rows"]."""
    model, par = s.model, s.par
    model.train()
    batch = s.sampler.next_batch().map(par.local_sequence).to(s.info.device)
    layers = moe_layers(cfg)
    row_of = {layer: i for i, layer in enumerate(layers)}
    E = cfg.model.moe.num_experts
    loads = torch.zeros(len(layers), E, device=s.info.device)
    dropped = torch.zeros(max(1, len(layers)), device=s.info.device)
    # The global token mean: dp x cp x (this rank's summed loss) / (trained targets of the whole global batch),
    # which the gradient average over the dp x cp ranks (FSDP's) turns into the same gradient under any layout
    # and accumulation (cp ranks hold parts of the same sequences).
    loss_scale = par.dims.dp * par.dims.cp / max(1, batch.global_tokens)
    loss = par.runner.train_step(batch.inputs, batch.targets, loss_scale, **batch.model_kwargs())
    extra = par.runner.extra_losses()  # {"mtp_loss": ...}: like the loss, the same on every rank
    for layer, (load_E, drop) in par.runner.router_loads().items():
        loads[row_of[layer]] += load_E
        dropped[row_of[layer]] += drop
    clip = cfg.training.grad_clip if cfg.training.grad_clip > 0 else float("inf")
    grad_norm = clip_grad_norm_(model, clip, par)
    mine = rank_row() if rank_row else ()
    rows_RC = loss.new_zeros(s.info.world_size if mine else 0, len(mine))  # each rank fills its own row: a gather
    for column, value in enumerate(mine):
        rows_RC[s.info.rank, column] = value
    # One all-reduce for everything logged; its .tolist() is the trainer's one host sync per step, needed anyway
    # for the non-finite check (every rank must take the same decision) and the progress bar.
    # (the gradient norm rides along last: every rank holds the same global norm, so the sum is world_size of it)
    packed = all_reduce_sum(torch.cat([loss.view(1), dropped, loads.flatten(),
                                       *(v.float().view(1).to(loss.device) for v in extra.values()),
                                       rows_RC.flatten(), grad_norm.detach().float().view(1).to(loss.device)]))
    # Every rank holds the loss, and with the MoE replicated over tp every tp rank routes all of its dp rank's
    # tokens: divide the copies out.
    tp = par.dims.moe_token_copies
    numbers = read_after_collective(packed)
    loss_value = numbers[0] / s.info.world_size
    gn = numbers.pop() / s.info.world_size
    rows = numbers[len(numbers) - rows_RC.numel():]
    del numbers[len(numbers) - rows_RC.numel():]
    finite = math.isfinite(loss_value) and math.isfinite(gn)
    step = s.scheduler.last_epoch + 1
    if not finite and cfg.training.on_nonfinite == "stop":
        raise NonFiniteLossError(
            f"loss is {loss_value} (grad norm {gn}) at step {step}; lower training.lr, enable "
            f"training.grad_clip, or set --training.on_nonfinite=skip to drop such steps"
        )
    lr = s.scheduler.get_last_lr()[0]
    if finite:
        s.optimizer.step()
    grad_bytes = _local_bytes(p.grad for p in model.parameters()) if measure else None  # sizes only, no sync
    s.optimizer.zero_grad(set_to_none=True)
    s.scheduler.step()
    out = {"loss": loss_value, "lr": lr, "grad_norm": gn, "skipped": not finite, "grad_bytes": grad_bytes,
           "rank_rows": [rows[i:i + len(mine)] for i in range(0, len(rows), len(mine) or 1)]}
    out["losses"] = {k: v / s.info.world_size for k, v in zip(extra, numbers[len(numbers) - len(extra):])}
    if layers:
        global_loads = packed[1 + len(dropped):1 + len(dropped) + len(layers) * E].view(len(layers), E) / tp
        routers = router_layers([model])
        for layer, r in routers.items():
            r.update_bias(global_loads[row_of[layer]])
        if with_moe_stats:  # from the host copy of the loads (no device read)
            host_loads = torch.tensor(numbers[1 + len(dropped):1 + len(dropped) + len(layers) * E], device="cpu") / tp
            out["moe"] = _moe_stats(cfg, routers, layers, host_loads.view(len(layers), E),
                                    [d / tp for d in numbers[1:1 + len(layers)]])
    return out


def _moe_stats(cfg: JobConfig, routers, layers, loads_LE, dropped) -> dict:
    stats = {}
    for layer, load_E, drop in zip(layers, loads_LE, dropped):
        depth = max(0, layer - cfg.model.n_layers + 1)  # MTP depth k routes the S - k positions it predicts from
        assignments = cfg.training.global_batch * (cfg.data.seq_len - depth) * cfg.model.moe.top_k
        stats[str(layer)] = {
            "tokens_per_expert": [int(x) for x in load_E.tolist()],
            "max_over_mean": float(load_E.max() / load_E.mean().clamp(min=1e-9)),
            "dropped_fraction": drop / assignments,
        }
        if layer in routers:  # under pipeline parallelism rank 0 holds only its stage's routers
            stats[str(layer)]["router_bias"] = [round(b, 5) for b in routers[layer].expert_bias.tolist()]
    return stats


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
