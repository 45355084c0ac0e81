"""`moeflow train --dry-run --world-size N`: apply a layout to a meta model in one process.

PyTorch's fake process group (torch.testing._internal.distributed.fake_pg; collectives return at once)
lets one process play any rank of an N-rank job, so the mesh is built and the parallel plan applied
exactly as training would - and the same validation errors are raised - with no rank started and no
memory allocated (the model lives on the meta device). What comes out is what each rank would hold at
its peak: parameter counts and parameter / gradient / optimizer bytes (fp32 weights and gradients, AdamW's two
fp32 moments, Muon's one momentum), for the first rank of every pipeline stage, split into device and host bytes:
under parallel.offload = 'params' the shards live on the host (as FSDP2's offload policy placed them) and the
device holds the gathered weights alone; under 'optimizer' the optimizer's state, a gradient buffer and (for
AdamW's parameters) an fp32 master copy of the weights live on the host (moeflow/train/offload.py) and the device
keeps weights and gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moeflow.config import JobConfig
from moeflow.core.schedules import SCHEDULES

BYTES = {"params": 4, "grads": 4, "optimizer": 8}  # fp32 master weights and grads; AdamW exp_avg + exp_avg_sq
MUON_BYTES = 4  # Muon's momentum_buffer


def _local_numel(t: torch.Tensor) -> int:
    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def _gathered_numel(t: torch.Tensor) -> int:
    """Elements of `t` once FSDP has gathered it: the global size divided by its tensor-parallel sharding."""
    if not isinstance(t, DTensor):
        return t.numel()
    names = t.device_mesh.mesh_dim_names or ()
    tp_split = 1
    for dim, placement in enumerate(t.placements):
        if dim < len(names) and names[dim] == "tp" and placement.is_shard():
            tp_split *= t.device_mesh.size(dim)
    return t.numel() // tp_split


def rank_state(cfg: JobConfig, world_size: int, rank: int) -> dict:
    """Build and parallelize the model as `rank` of `world_size` would; count what it holds."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moeflow.train.build import build_model

    dims, batch = cfg.layout(world_size)  # the same checks as a real run, before any group exists
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        par, optimizer, _ = build_model(cfg, torch.device("meta"), dims, batch)
        params = list(par.model.parameters())
        expert = sum(_local_numel(p) for n, p in par.model.named_parameters() if ".experts." in n)
        sharded = sum(_local_numel(p) for p in params)
        # ZeRO-1 and ZeRO-2 (FSDP2 without resharding after forward) hold every layer's gathered weights from
        # its forward to its backward: at the peak, the whole (tp/ep-local) model. So does ZeRO-3 under a
        # zero-bubble pipeline schedule, which keeps the parameters gathered for the whole step
        # (moeflow.parallel.pipeline._keep_fsdp_unsharded_in_step).
        zero_bubble = dims.pp > 1 and SCHEDULES[dims.pp_schedule].splits_backward
        held = sum(_gathered_numel(p) for p in params) if dims.zero in (1, 2) or zero_bubble else sharded
        opt_params = sum(_local_numel(p) for g in optimizer.param_groups for p in g["params"])
        opt_bytes = sum(_local_numel(p) * (MUON_BYTES if g.get("muon") else BYTES["optimizer"])
                        for g in optimizer.param_groups for p in g["params"])
        grads = sharded  # every stage reduce-scatters gradients into shards
        state = {"params": held * BYTES["params"], "grads": grads * BYTES["grads"], "optimizer": opt_bytes}
        offloaded = _offloaded(par.model, optimizer)
        if offloaded == "params":  # the shards, their gradients and the optimizer state on the host; gathered weights
            gathered = (held if held != sharded else _largest_gathered(par.model)) * BYTES["params"]
            device, host = {"params": gathered, "grads": 0, "optimizer": 0}, {
                "params": sharded * BYTES["params"], "grads": state["grads"], "optimizer": opt_bytes}
        elif offloaded == "optimizer":  # the optimizer state and a gradient buffer on the host, AdamW's fp32 masters
            device = {**state, "optimizer": 0}
            masters = sum(_local_numel(p) for g in optimizer.param_groups if not g.get("muon") for p in g["params"])
            host = {"params": masters * BYTES["params"], "grads": opt_params * BYTES["grads"],
                    "optimizer": opt_bytes}
        else:
            device, host = state, dict.fromkeys(state, 0)
        return {"rank": rank, "params": held, "expert_params": expert, "optimizer_params": opt_params,
                "bytes": state, "device_bytes": device, "host_bytes": host, "offload": offloaded,
                "dims": dims.sizes}
    finally:
        dist.destroy_process_group()


def _param_groups(model: torch.nn.Module) -> list:
    """FSDP2's parameter groups (one per fully_shard call that got parameters)."""
    from torch.distributed.fsdp import FSDPModule

    groups = (m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule))
    return [g for g in groups if g is not None]


def _offloaded(model: torch.nn.Module, optimizer) -> str:
    """'params' where FSDP2 keeps this model's shards on the host (its offload policy, as fully_shard applied it),
    'optimizer' where the optimizer keeps its state there, else 'none'."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if any(isinstance(g.offload_policy, CPUOffloadPolicy) for g in _param_groups(model)):
        return "params"
    return "optimizer" if getattr(optimizer, "host", None) is not None else "none"


def _largest_gathered(model: torch.nn.Module) -> int:
    """Elements on the device under ZeRO-3 with offload: the largest FSDP unit once gathered, twice (the next one
    is prefetched)."""
    units = [sum(_gathered_numel(p.sharded_param) for p in g.fsdp_params) for g in _param_groups(model)]
    return 2 * max(units, default=0)


def dry_run(cfg: JobConfig, world_size: int) -> dict:
    """The first rank of every pipeline stage (ranks differ only by stage in what they hold)."""
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    pp = cfg.parallel.pp
    stage_ranks = [s * (world_size // pp) for s in range(pp)] if world_size % pp == 0 else [0]
    ranks = [rank_state(cfg, world_size, r) for r in stage_ranks]
    total = cfg.model.num_params()
    from moeflow.models.hf_transformers import model_label

    return {"world_size": world_size, "model": model_label(cfg.model), "total_params": total,
            "ideal_params_per_rank": total / world_size, "ranks": ranks}


def format_dry_run(out: dict) -> str:
    gib = 1 << 30
    dims = out["ranks"][0]["dims"]
    offload = out["ranks"][0]["offload"]
    lines = [f"dry run: {out['model']} ({out['total_params']:,} parameters) on {out['world_size']} ranks",
             "  " + "  ".join(f"{k}={v}" for k, v in dims.items()),
             f"  {'rank':>6} {'params':>14} {'of total':>9} {'experts':>14} {'param GiB':>10} {'grad GiB':>9} "
             f"{'optim GiB':>10}" + (f" {'device GiB':>11} {'host GiB':>9}" if offload != "none" else "")]
    for r in out["ranks"]:
        b = r["bytes"]
        line = (f"  {r['rank']:>6} {r['params']:>14,} {r['params'] / out['total_params']:>9.2%} "
                f"{r['expert_params']:>14,} {b['params'] / gib:>10.3f} {b['grads'] / gib:>9.3f} "
                f"{b['optimizer'] / gib:>10.3f}")
        if offload != "none":
            line += (f" {sum(r['device_bytes'].values()) / gib:>11.3f} "
                     f"{sum(r['host_bytes'].values()) / gib:>9.3f}")
        lines.append(line)
    lines.append(f"  ideal 1/N: {out['ideal_params_per_rank']:,.0f} parameters per rank")
    if offload == "params":
        lines.append("  parallel.offload = 'params': the shards, their gradients and the optimizer state in host "
                     "memory; the device holds the gathered weights")
    elif offload == "optimizer":
        lines.append("  parallel.offload = 'optimizer': the optimizer's state, a gradient buffer and AdamW's fp32 "
                     "master weights in host memory;\n  the device holds the weights and gradients")
    return "\n".join(lines)
