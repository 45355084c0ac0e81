"""The training loop: data -> model (-> parallelism) -> AdamW steps, with metrics and checkpoints.

One step trains on training.global_batch sequences whatever the number of ranks: each data-parallel
rank takes its contiguous share, splits it into micro-batches, and FSDP averages the gradients.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from moeflow.config import JobConfig, to_toml
from moeflow.models.transformer import Transformer
from moeflow.parallel.dims import ParallelDims
from moeflow.parallel.parallelize import all_reduce_gradients, clip_grad_norm_, parallelize
from moeflow.parallel.tensor import tp_loss
from moeflow.train.checkpoint import CheckpointManager
from moeflow.train.data import BatchSampler, load_tokens, split_tokens, val_batches
from moeflow.train.distributed import DistInfo, all_reduce_sum, init_distributed
from moeflow.train.metrics import MetricsLogger, peak_flops_per_device, peak_memory_mb
from moeflow.train.optim import build_optimizer as make_optimizer
from moeflow.train.optim import build_scheduler
from moeflow.train.tokenizer import load_tokenizer


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class Setup:
    """What one rank trains with, built before the first step."""

    info: DistInfo
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    sampler: BatchSampler
    val: list
    micro_batch: int
    accum: int
    layout: str


def check_layout(cfg: JobConfig, world: int) -> tuple[ParallelDims, int]:
    """(dims, micro-batch) after validating the parallel sizes against the world size and the batch."""
    p = cfg.parallel
    dims = ParallelDims(world, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, ep=p.ep)
    dims.check_model(cfg.model)
    t, dp = cfg.training, dims.dp
    if t.global_batch % dp:
        raise ValueError(
            f"training.global_batch ({t.global_batch}) must be divisible by the data-parallel size ({dp}); "
            f"use a multiple of {dp}"
        )
    per_rank = t.global_batch // dp
    micro = t.micro_batch or (1 if dims.pp > 1 else per_rank)
    if per_rank % micro:
        raise ValueError(
            f"training.micro_batch ({micro}) must divide the per-rank batch ({per_rank} = global_batch / {dp})"
        )
    if p.zero == 1 and (dims.dp < world or dims.ep > 1):
        raise ValueError(f"parallel.zero = 1 with {dims.describe()} is not supported yet: ZeRO-1 runs pure data "
                         f"parallelism only; use --parallel.zero=3 (or 2) with tp, pp or ep")
    if dims.tp > 1:
        from moeflow.parallel.tensor import check_tp

        check_tp(cfg.model, dims.tp)
    if dims.pp > 1:
        from moeflow.parallel.pipeline import resolve_schedule, validate_microbatches

        resolve_schedule(p.pp_schedule)
        if cfg.model.tie_embeddings:
            raise ValueError("model.tie_embeddings = true with parallel.pp > 1: the embedding and the output head "
                             "live on different stages; set --model.tie_embeddings=false or parallel.pp = 1")
        validate_microbatches(per_rank, pp_microbatches(cfg, per_rank, micro), p.pp_schedule, dims.pp)
    return dims, micro


def pp_microbatches(cfg: JobConfig, per_rank: int, micro: int) -> int:
    return cfg.parallel.pp_microbatches or per_rank // micro


def build_model(cfg: JobConfig, device: torch.device, build_optimizer: bool = True):
    """(model, optimizer): the model built identically on every rank, then parallelized by cfg.parallel.
    On the meta device (dry runs) nothing is allocated or initialised."""
    t, p = cfg.training, cfg.parallel
    world = dist.get_world_size() if dist.is_initialized() else 1
    # Under any layout, Hugging Face weights go straight into each rank's shards (moeflow/train/hf_sharded.py).
    owned_read = bool(cfg.model.hf_path) and device.type != "meta" and world > 1
    if device.type == "meta" or owned_read:
        with torch.device("meta"):
            model = Transformer(cfg.model)
    elif cfg.model.hf_path:  # Hugging Face weights, read whole on every rank, then sharded
        from moeflow.models.hf import load_for_training

        model, _ = load_for_training(cfg.model)
        model.to(device)
    else:
        model = Transformer(cfg.model)
        model.init_weights(seed=t.seed)  # identical on every rank before sharding
        model.to(device)
    dims, micro = check_layout(cfg, world)
    n_mb = pp_microbatches(cfg, t.global_batch // dims.dp, micro)
    mb_shape = (t.global_batch // dims.dp // n_mb, cfg.data.seq_len,
                torch.bfloat16 if t.dtype == "bf16" else torch.float32)
    parallelize(model, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, ep=p.ep, zero=p.zero,
                activation_checkpointing=t.activation_checkpointing, ep_backend=p.ep_backend,
                pp_schedule=p.pp_schedule, pp_microbatches=n_mb, pp_microbatch_shape=mb_shape,
                loss_fn=tp_loss, compile=t.compile, device_type="cpu" if device.type == "meta" else device.type)
    if owned_read:
        from moeflow.train.hf_sharded import load_owned

        model.to_empty(device=device)
        model.hf_bytes_read = load_owned(model, cfg.model)
    optimizer = make_optimizer(model, t.lr, t.weight_decay, (t.beta1, t.beta2)) if build_optimizer else None
    return model, optimizer


def build(cfg: JobConfig, info: DistInfo) -> Setup:
    t, d = cfg.training, cfg.data
    dims, micro = check_layout(cfg, info.world_size)
    dp = dims.dp
    torch.manual_seed(t.seed)

    spec = d.tokenizer
    if spec == "auto" and cfg.model.hf_path and (Path(cfg.model.hf_path) / "tokenizer.json").is_file():
        spec = cfg.model.hf_path  # the checkpoint's own tokenizer
    pretokenized = d.source.endswith(".bin")  # ids already; load_tokens checks them against the vocabulary
    tokenizer = None if pretokenized else load_tokenizer(spec, None if d.source == "stdlib" else d.source)
    if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {cfg.model.vocab_size}; "
            f"set --model.vocab_size={tokenizer.vocab_size} or more"
        )
    tokens = load_tokens(d.source, tokenizer, token_dtype=d.token_dtype, vocab_size=cfg.model.vocab_size,
                         max_bytes=d.max_bytes)
    train_tokens, val_tokens = split_tokens(tokens, d.val_fraction, d.seq_len)
    model, optimizer = build_model(cfg, info.device)
    mesh = model.device_mesh
    dp_rank = ParallelDims.submesh(mesh, "dp").get_local_rank() if mesh is not None else 0
    sampler = BatchSampler(train_tokens, d.seq_len, t.global_batch, dp_rank, dp, t.seed)
    val = val_batches(val_tokens, d.seq_len, t.global_batch, cfg.eval.batches)
    if dims.pp > 1 and val and any(x.shape[0] != t.global_batch for x, _ in val):
        # a pipeline evaluates in the training step's micro-batch shape (its receive buffers are sized for it)
        val = [(x, y) for x, y in val if x.shape[0] == t.global_batch]
        if not val and info.is_main:
            print(f"note: the validation split has fewer than training.global_batch ({t.global_batch}) windows, "
                  f"which a pipeline-parallel run cannot evaluate; raise data.val_fraction to get val_loss")
    layout = "1 process"
    if info.world_size > 1 and dims.pp > 1:
        layout = (f"{dims.describe()} ({info.world_size} ranks, {cfg.parallel.pp_schedule} with "
                  f"{model.pp_runner.n_microbatches} micro-batches, FSDP2 ZeRO-{cfg.parallel.zero})")
    elif info.world_size > 1:
        p = cfg.parallel
        dp_kind = "ZeroRedundancyOptimizer" if p.zero == 1 else "FSDP2"
        layout = f"{dims.describe()} ({info.world_size} ranks, {dp_kind} ZeRO-{p.zero})"
    accum = t.global_batch // dp // micro
    for _, router in model.moe_routers():
        # The aux loss is per micro-batch, like the main loss; a pipeline schedule scales the gradients
        # by 1 / micro-batches itself.
        router.aux_loss_scale = 1.0 if dims.pp > 1 else 1.0 / accum
    scheduler = build_scheduler(optimizer, t.warmup_steps, t.steps, t.min_lr_ratio)
    return Setup(info, model, optimizer, scheduler, sampler, val, micro, accum, layout)


def _autocast(cfg: JobConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.training.dtype == "bf16")


def _set_grad_sync(model, enabled: bool) -> None:
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: skip the reduce-scatter between micro-batches
        model.set_requires_gradient_sync(enabled)


def _moe_layers(cfg: JobConfig) -> list[int]:
    """Global indices of the MoE layers: router statistics are packed by these on every rank, so the
    one all-reduce has the same size whichever layers (pipeline stage) a rank holds."""
    return [i for i in range(cfg.model.n_layers) if cfg.model.is_moe_layer(i)]


def _local_routers(model) -> dict[int, object]:
    return {int(name.split(".")[1]): r for name, r in model.moe_routers()}  # "layers.<i>.feed_forward.router"


def _forward_backward(cfg: JobConfig, s: Setup, inputs, targets, loads, dropped, row_of) -> torch.Tensor:
    """Forward and backward of this rank's batch; adds router loads into `loads` / `dropped` (rows by
    global layer). Returns the mean loss (0 on pipeline ranks without the last stage, broadcast after)."""
    model, routers = s.model, _local_routers(s.model)
    runner = getattr(model, "pp_runner", None)
    if runner is not None:
        with _autocast(cfg, s.info.device):
            loss = runner.step(inputs, targets)
        for layer, (load_E, drop) in runner.router_loads().items():
            loads[row_of[layer]] += load_E
            dropped[row_of[layer]] += drop
        return runner.broadcast_loss(loss, s.info.device)
    loss_sum = torch.zeros((), device=s.info.device)
    for m in range(s.accum):
        rows = slice(m * s.micro_batch, (m + 1) * s.micro_batch)
        _set_grad_sync(model, m == s.accum - 1)
        with _autocast(cfg, s.info.device):
            logits = model(inputs[rows])
        loss = tp_loss(logits, targets[rows])
        (loss / s.accum).backward()
        loss_sum += loss.detach() / s.accum
        for layer, r in routers.items():  # read right after forward: recomputation rewrites it
            loads[row_of[layer]] += r.last_load
            dropped[row_of[layer]] += r.last_dropped
    return loss_sum


def _local_bytes(tensors) -> int:
    """Bytes this rank stores for `tensors` (the local shard of a DTensor)."""
    locals_ = (t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None)
    return sum(t.numel() * t.element_size() for t in locals_)


def state_bytes(s: Setup, grad_bytes: int) -> dict[str, int]:
    """The largest rank's bytes of parameters, gradients (as measured after the last backward) and
    optimizer state (AdamW moments; ZeRO-1 keeps only its partition's)."""
    local_opt = getattr(s.optimizer, "optim", s.optimizer)
    sizes = torch.tensor([
        _local_bytes(s.model.parameters()), grad_bytes,
        _local_bytes(v for st in local_opt.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0),
    ], dtype=torch.float64, device=s.info.device)
    if dist.is_initialized():
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    return dict(zip(("params", "grads", "optimizer"), (int(x) for x in sizes.tolist())))


def train_step(cfg: JobConfig, s: Setup, with_moe_stats: bool = True, measure: bool = False) -> dict:
    """One optimizer step. Returns plain numbers (after one all-reduce of loss and expert load); the
    per-layer expert statistics only when `with_moe_stats`, since they copy every layer to the host;
    the gradient bytes this rank held only when `measure` (the last step, for the summary)."""
    model = s.model
    model.train()
    inputs, targets = s.sampler.next_batch()
    inputs, targets = inputs.to(s.info.device), targets.to(s.info.device)
    layers = _moe_layers(cfg)
    row_of = {layer: i for i, layer in enumerate(layers)}
    E = cfg.model.moe.num_experts
    loads = torch.zeros(len(layers), E, device=s.info.device)
    dropped = torch.zeros(max(1, len(layers)), device=s.info.device)
    loss_sum = _forward_backward(cfg, s, inputs, targets, loads, dropped, row_of)
    all_reduce_gradients(model)
    clip = cfg.training.grad_clip if cfg.training.grad_clip > 0 else float("inf")
    grad_norm = clip_grad_norm_(model, clip)
    # One all-reduce for everything logged; its .tolist() is the step's one host sync, needed anyway
    # for the non-finite check (every rank must take the same decision) and the progress bar.
    packed = all_reduce_sum(torch.cat([loss_sum.view(1), dropped, loads.flatten()]))
    # Every tp rank routes all of its dp rank's tokens, and every rank holds the loss: divide the copies out.
    tp = model.parallel_dims.tp
    numbers = packed.tolist()
    loss_value = numbers[0] / s.info.world_size
    gn = float(grad_norm)
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
    out = {"loss": loss_value, "lr": lr, "grad_norm": gn, "skipped": not finite, "grad_bytes": grad_bytes}
    if layers:
        global_loads = packed[1 + len(dropped):].view(len(layers), E) / tp
        for layer, r in _local_routers(model).items():
            r.update_bias(global_loads[row_of[layer]])
        if with_moe_stats:
            out["moe"] = _moe_stats(cfg, model, layers, global_loads, [d / tp for d in numbers[1:1 + len(layers)]])
    return out


def _moe_stats(cfg: JobConfig, model, layers, loads_LE, dropped) -> dict:
    assignments = cfg.training.global_batch * cfg.data.seq_len * cfg.model.moe.top_k
    routers = _local_routers(model)
    stats = {}
    for layer, load_E, drop in zip(layers, loads_LE, dropped):
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
    one replica see the same rows) and the sums are all-reduced (copies cancel in the ratio)."""
    if not s.val:
        return None
    s.model.eval()
    mesh, dims = s.model.device_mesh, s.model.parallel_dims
    dp_rank = ParallelDims.submesh(mesh, "dp").get_local_rank() if mesh is not None else 0
    runner = getattr(s.model, "pp_runner", None)
    total = torch.zeros(2, device=s.info.device)
    for inputs, targets in s.val:
        n = inputs.shape[0]
        lo, hi = dp_rank * n // dims.dp, (dp_rank + 1) * n // dims.dp
        x, y = inputs[lo:hi].to(s.info.device), targets[lo:hi].to(s.info.device)
        with _autocast(cfg, s.info.device):
            if runner is not None:
                loss = runner.broadcast_loss(runner.forward_eval(x, y), s.info.device) * y.numel()
            else:
                loss = tp_loss(s.model(x), y, reduction="sum")
        total += torch.stack([loss.float(), torch.tensor(float(y.numel()), device=s.info.device)])
    total = all_reduce_sum(total)
    return float(total[0] / total[1])


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop metrics lines logged after the checkpoint (they will be logged again)."""
    if path.is_file():
        lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= last_step]
        path.write_text("".join(ln + "\n" for ln in lines))


def train(cfg: JobConfig, resume: bool = False, fresh: bool = False, progress: bool = True) -> dict:
    """Train; resume from the newest complete checkpoint in run_dir unless `fresh`.
    `resume=True` makes a missing checkpoint an error. Returns the summary (also in summary.json)."""
    info = init_distributed(cfg.training.device)
    s = build(cfg, info)
    run_dir = Path(cfg.run_dir)
    ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep, info.rank)
    start = 0
    resume_from = None if fresh else ckpt.find_resume()
    if resume and resume_from is None:
        raise ValueError(f"--resume: no complete checkpoint under {run_dir}/checkpoints; drop --resume to start")
    if resume_from is not None:
        extra = ckpt.load(resume_from, s.model, s.optimizer)
    if resume_from is not None and "sampler" not in extra:
        # weights only (moeflow convert hf-to-moeflow): fresh optimizer, schedule and data order
        if info.is_main:
            print(f"starting from the weights in {resume_from} (no optimizer or data state in it)")
    elif resume_from is not None:
        start = extra["step"]
        s.scheduler.load_state_dict(extra["scheduler"])
        # Checkpoints keep no optimizer hyper-parameters (they come from the config), so the learning rate
        # of the next step is restored from the schedule.
        for group, lr in zip(s.optimizer.param_groups, s.scheduler.get_last_lr()):
            group["lr"] = lr
        s.sampler.load_state_dict(extra["sampler"])
    if info.is_main:  # drop lines the resumed (or fresh) run will log again
        _truncate_metrics(run_dir / "metrics.jsonl", start)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))
    logger = MetricsLogger(run_dir, info.is_main, cfg.metrics.tensorboard)

    t = cfg.training
    stop = min(t.steps, t.stop_at) if t.stop_at > 0 else t.steps
    tokens_per_step = t.global_batch * cfg.data.seq_len
    flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)
    peak = peak_flops_per_device(info.device, t.dtype)
    first_loss = last_loss = val_loss = None
    last_ckpt = resume_from
    bar = tqdm(total=t.steps, initial=start, desc="train", unit="step", disable=not (info.is_main and progress),
               dynamic_ncols=True, mininterval=0.5)
    t_start = time.perf_counter()
    t_window, steps_window = t_start, 0
    tokens_per_s = 0.0
    for step in range(start + 1, stop + 1):
        out = train_step(cfg, s, with_moe_stats=step % cfg.metrics.log_every == 0 or step == stop,
                         measure=step == stop)
        steps_window += 1
        first_loss = out["loss"] if first_loss is None else first_loss
        last_loss = out["loss"]
        is_last = step == stop
        if cfg.eval.every and step % cfg.eval.every == 0 or is_last:
            val_loss = evaluate(cfg, s)
        if step % cfg.metrics.log_every == 0 or is_last:
            now = time.perf_counter()
            tokens_per_s = steps_window * tokens_per_step / (now - t_window)
            t_window, steps_window = now, 0
            record = {
                "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
                "tokens_per_s": tokens_per_s,
                "mfu": tokens_per_s * flops_per_token / (peak * info.world_size) if peak else "unknown",
                "peak_memory_mb": peak_memory_mb(info.device),
            }
            if out["skipped"]:
                record["skipped"] = True
            if val_loss is not None and (cfg.eval.every and step % cfg.eval.every == 0 or is_last):
                record["val_loss"] = val_loss
            if "moe" in out:
                record["moe"] = out["moe"]
            logger.log(step, record)
        if cfg.checkpoint.enabled and (cfg.checkpoint.every and step % cfg.checkpoint.every == 0 or is_last):
            extra = {"step": step, "scheduler": s.scheduler.state_dict(), "sampler": s.sampler.state_dict(),
                     "layout": s.layout}
            last_ckpt = ckpt.save(step, s.model, s.optimizer, extra)
        bar.set_postfix(loss=f"{out['loss']:.3f}", lr=f"{out['lr']:.1e}", tok_s=f"{tokens_per_s:,.0f}")
        bar.update(1)
    bar.close()
    held = state_bytes(s, out["grad_bytes"]) if stop > start else None
    logger.close()
    elapsed = time.perf_counter() - t_start
    summary = {
        "model": cfg.model.name, "params": cfg.model.num_params(), "active_params": cfg.model.num_active_params(),
        "layout": s.layout, "steps": stop, "start_step": start, "first_loss": first_loss,
        "final_loss": last_loss, "val_loss": val_loss,
        "tokens_per_s": (stop - start) * tokens_per_step / elapsed if stop > start else 0.0,
        "elapsed_s": elapsed, "checkpoint": str(last_ckpt) if last_ckpt else None,
        "metrics": str(run_dir / "metrics.jsonl"), "tensorboard": str(run_dir / "tb"),
        "mfu": "unknown" if not peak else None,
        "state_bytes_per_rank": held,
        "hf_bytes_read_rank0": getattr(s.model, "hf_bytes_read", None),  # set when each rank read its shards
    }
    if info.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
