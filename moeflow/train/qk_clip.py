"""MuonClip's qk-clip (`training.muon_clip = TAU`): Kimi K2's guard against attention logits that grow without bound
under Muon ("Kimi K2: Open Agentic Intelligence", Kimi Team, 2025, section 2.1).

Each training forward records, per attention head, the largest pre-softmax logit q.k / sqrt(d) it computed
(over the step's micro-batches and every rank's rows: one all-reduce of a [layers, heads] max after the step).
After the optimizer step, a head whose maximum exceeded TAU has its query projection's rows (and bias) scaled by
gamma = TAU / max, so the same inputs would give logits of at most TAU; heads below TAU are untouched. K2 splits
gamma between the query and key projections of its MLA heads (sqrt(gamma) each); under grouped-query attention one
key head serves several query heads, so here the query head takes all of gamma: the same bound, and no other
head changes. Under FSDP2 and tensor parallelism each rank scales the rows of the query projection it holds.

The logits are computed beside scaled_dot_product_attention (which does not return them), a block of queries at a
time, under no_grad (moeflow.models.attention.max_logits): an extra Q K^T per step, the price of the bound.
Attention whose logits a per-head query scale cannot bound (per-head q/k RMSNorm renormalises the query; MLA splits
each head in parts) and context parallelism (which splits the keys) are refused in one line by the config.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moeflow.models.transformer import Attention

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.attention$")


def attention_modules(parts: list[nn.Module]) -> dict[int, Attention]:
    """{global layer index: its attention module} of the model parts this rank holds (pipeline stages keep the
    layers' names)."""
    out = {}
    for part in parts:
        for name, module in part.named_modules():
            m = _LAYER.search(name)
            if m and isinstance(module, Attention):
                out[int(m.group(1))] = module
    return out


def track(parts: list[nn.Module]) -> None:
    for module in attention_modules(parts).values():
        module.max_logits = None  # [local heads] once a training forward ran: Attention.forward records it


@torch.no_grad()
def clip(parts: list[nn.Module], tau: float, num_layers: int, num_heads: int, tp_rank: int = 0) -> dict[int, float]:
    """Scale the query heads whose step maximum exceeded `tau`; {layer: its largest logit this step} (every rank the
    same: collective over the default group when it exists)."""
    modules = attention_modules(parts)
    device = next(iter(parts[0].parameters())).device
    best_LH = torch.full((num_layers, num_heads), -torch.inf, device=device)
    for layer, module in modules.items():
        if module.max_logits is not None:
            local = module.max_logits.numel()  # the heads this rank computes: its tensor-parallel share
            best_LH[layer, tp_rank * local:(tp_rank + 1) * local] = module.max_logits
            module.max_logits = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(best_LH, op=dist.ReduceOp.MAX)
    gamma_LH = torch.where(best_LH > tau, tau / best_LH, torch.ones_like(best_LH))
    clipped_L = (gamma_LH < 1).any(dim=1).tolist()  # with the maxima below: the clip's two reads on the host
    for layer, module in modules.items():
        if clipped_L[layer]:
            rows = gamma_LH[layer].repeat_interleave(module.head_dim)  # one scale per row of wq, head after head
            for p in (module.wq.weight, module.wq.bias):
                if p is not None:
                    _scale_rows(p, rows)
    return dict(enumerate(best_LH.amax(dim=1).tolist()))


def _scale_rows(p: torch.Tensor, rows: torch.Tensor) -> None:
    """p[i] *= rows[i] for the rows of p this rank holds (a DTensor's global rows: FSDP2's and tp's shards)."""
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()
        rows = rows[offset[0]:offset[0] + shape[0]]
    else:
        local = p
    local.mul_(rows.view(-1, *[1] * (local.dim() - 1)).to(local.dtype))
