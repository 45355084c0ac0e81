"""Everything one rank trains with, built before the first step: data, model, parallelism, optimizer, schedule.

The job's layout arrives validated (JobConfig.layout -> ParallelDims, BatchSplit) and goes to parallelize as
is; nothing here re-checks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeflow.config import JobConfig
from moeflow.core.parallel_dims import BatchSplit, ParallelDims
from moeflow.data.stream import BatchSampler
from moeflow.models.transformer import Transformer
from moeflow.parallel.loss import tp_loss
from moeflow.parallel.options import ParallelOptions
from moeflow.parallel.parallelize import parallelize
from moeflow.parallel.state import ParallelState
from moeflow.train.data_setup import build_data
from moeflow.train.distributed import DistInfo
from moeflow.train.optim import build_optimizer, build_scheduler


@dataclass
class Setup:
    """What one rank trains with."""

    info: DistInfo
    model: torch.nn.Module
    par: ParallelState
    optimizer: torch.optim.Optimizer
    scheduler: object
    sampler: BatchSampler
    val: list
    batch: BatchSplit
    layout: str  # one line for the summary
    hf_bytes_read: int | None = None  # bytes of Hugging Face weights this rank read, when each read its shards
    data_summary: dict = field(default_factory=dict)  # records, truncated conversations, ... (token cache path)


def parallel_options(cfg: JobConfig, batch: BatchSplit, dims: ParallelDims, device: torch.device) -> ParallelOptions:
    """How this job applies its layout: the job config's choices, once."""
    t, p = cfg.training, cfg.parallel
    dtype = torch.bfloat16 if t.dtype == "bf16" else None
    return ParallelOptions(
        ep_backend=p.ep_backend, ep_overlap=p.ep_overlap, ep_chunks=p.ep_overlap_chunks,
        ep_num_worst_tokens=p.ep_num_worst_tokens, activation_checkpointing=t.activation_checkpointing,
        compile=t.compile, fp8=t.fp8, autocast_dtype=dtype, microbatches=batch.microbatches, loss_fn=tp_loss,
        pp_microbatch_shape=(batch.micro_batch, cfg.data.seq_len // dims.cp, dtype or torch.float32),
        pp_boundaries=cfg.pipeline_boundaries(),
        device_type="cpu" if device.type == "meta" else device.type, offload=p.offload)


def build_model(cfg: JobConfig, device: torch.device, dims: ParallelDims, batch: BatchSplit,
                with_optimizer: bool = True) -> tuple[ParallelState, torch.optim.Optimizer | None, int | None]:
    """(parallel state, optimizer, Hugging Face bytes read by this rank): the model built identically on every
    rank, then parallelized. On the meta device (dry runs) nothing is allocated or initialised."""
    t = cfg.training
    # Under any layout, Hugging Face weights go straight into each rank's shards (moeflow/train/hf_sharded.py).
    owned_read = bool(cfg.model.hf_path) and device.type != "meta" and dims.world_size > 1
    if cfg.model.runs_transformers:  # transformers' own modules (moeflow/train/hf_sharded_transformers.py)
        from moeflow.models import hf_transformers

        model = (hf_transformers.load_empty(cfg.model.hf_path) if owned_read
                 else hf_transformers.load(cfg.model.hf_path, device))
    elif device.type == "meta" or owned_read:
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
    if cfg.peft.method == "lora":  # before parallelize, which places the factors with the weights they adapt
        add_lora(model, cfg.peft)
    par = parallelize(model, dims, parallel_options(cfg, batch, dims, device))
    bytes_read = None
    if owned_read and cfg.model.runs_transformers:
        from moeflow.train import hf_sharded_transformers

        bytes_read = hf_sharded_transformers.load_owned(model, cfg.model.hf_path, device)
    elif owned_read:
        from moeflow.train.hf_sharded import load_owned

        model.to_empty(device=device)
        bytes_read = load_owned(model, cfg.model)
    if cfg.peft.method == "lora" and device.type != "meta":
        init_lora(par.model, cfg)
    if cfg.model.runs_transformers and cfg.model.moe.load_balance == "aux_free":
        # transformers' selection biases move as moeflow's aux-loss-free routers' do (model.moe.bias_update_rate)
        from moeflow.parallel.hf_experts import hf_routing

        for routing in hf_routing(model).values():
            routing.bias_update_rate = cfg.model.moe.bias_update_rate
    optimizer = _optimizer(model, t, cfg.parallel.offload == "optimizer") if with_optimizer else None
    return par, optimizer, bytes_read


def _optimizer(model: torch.nn.Module, t, on_host: bool) -> torch.optim.Optimizer:
    if t.optimizer == "muon":
        from moeflow.train.muon import Muon, muon_parameters

        return Muon(*muon_parameters(model), lr=t.lr, adamw_lr=t.muon_adamw_lr or t.lr, weight_decay=t.weight_decay,
                    betas=(t.beta1, t.beta2), momentum=t.muon_momentum, nesterov=t.muon_nesterov,
                    ns_steps=t.muon_ns_steps, adjust_lr=t.muon_adjust_lr, on_host=on_host)
    return build_optimizer(model, t.lr, t.weight_decay, (t.beta1, t.beta2), on_host)


def add_lora(model: torch.nn.Module, peft) -> None:
    from moeflow.models import lora

    lora.add(model, peft.rank, peft.alpha, peft.dropout, peft.modules, peft.experts)


def init_lora(model: torch.nn.Module, cfg: JobConfig) -> None:
    """The adapters' one-process initial values, each rank's part of them (moeflow/models/lora.py)."""
    from moeflow.models import lora
    from moeflow.parallel.hf_experts import global_num_experts, is_hf_experts
    from moeflow.train.state_dict import expert_slices

    slices = expert_slices([model])
    # the experts of each layer over all ranks: the config's, or a transformers experts module's own count
    hf = {name: global_num_experts(m) for name, m in model.named_modules() if is_hf_experts(m)}
    totals = {fqn: hf.get(fqn.rsplit(".", 1)[0], cfg.model.moe.num_experts) for fqn in slices}
    lora.init([model], cfg.training.seed, slices, totals)


def describe_layout(cfg: JobConfig, dims: ParallelDims, par: ParallelState) -> str:
    if dims.world_size == 1:
        return "1 process"
    if dims.pp > 1:
        return (f"{dims.describe()} ({dims.world_size} ranks, {dims.pp_schedule} with "
                f"{par.runner.n_microbatches} micro-batches, FSDP2 ZeRO-{dims.zero})")
    return f"{dims.describe()} ({dims.world_size} ranks, FSDP2 ZeRO-{dims.zero})"


def build(cfg: JobConfig, info: DistInfo, dims: ParallelDims, batch: BatchSplit) -> Setup:
    t = cfg.training
    torch.manual_seed(t.seed)
    data = build_data(cfg, info.is_main)  # before the model: bad input is reported before anything large exists
    par, optimizer, bytes_read = build_model(cfg, info.device, dims, batch)
    sampler, val = data.sampler(cfg, par.dp_rank, dims.dp), data.val
    where = " of the first pipeline stage" if dims.pp > 1 else ""
    if par.tp_whole and info.is_main:
        kinds = ", ".join(sorted({type(m).__name__ for m in par.tp_whole.values()}))
        print(f"note: parallel.tp = {dims.tp}: {len(par.tp_whole)} token mixer(s){where} ({kinds}) have no "
              f"tensor-parallel plan and run whole on every tp rank; the rest of their layers is tensor-parallel")
    if par.cp_whole and info.is_main:
        kinds = ", ".join(sorted({type(m).__name__ for m in par.cp_whole.values()}))
        print(f"note: parallel.cp = {dims.cp}: {len(par.cp_whole)} sequence mixer(s){where} ({kinds}) are not "
              f"attention context parallelism splits and run whole on every cp rank (the sequence gathered into "
              f"them); the other layers' attention is split")
    if dims.pp > 1 and val and any(b.inputs.shape[0] != t.global_batch for b in val):
        # a pipeline evaluates in the training step's micro-batch shape (its receive buffers are sized for it)
        val = [b for b in val if b.inputs.shape[0] == t.global_batch]
        if not val and info.is_main:
            print(f"note: the validation split has fewer than training.global_batch ({t.global_batch}) windows, "
                  f"which a pipeline-parallel run cannot evaluate; raise data.val_fraction to get val_loss")
    if dims.dp > 1 and any(b.inputs.shape[0] < dims.dp for b in val):
        # every data-parallel rank scores its rows of each batch (and under ep takes part in every forward)
        short = sum(b.inputs.shape[0] < dims.dp for b in val)
        val = [b for b in val if b.inputs.shape[0] >= dims.dp]
        if info.is_main:
            print(f"note: {short} validation batch(es) hold fewer sequences than the {dims.dp} data-parallel ranks "
                  f"and are not scored (a source's validation split is that small); raise data.val_fraction")
    scheduler = build_scheduler(optimizer, t.warmup_steps, t.steps, t.min_lr_ratio)
    return Setup(info, par.model, par, optimizer, scheduler, sampler, val, batch, describe_layout(cfg, dims, par),
                 bytes_read, data.summary)
