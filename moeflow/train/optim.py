"""AdamW with decay only on matrices, and a linear warm-up + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                    on_host: bool = False):
    """AdamW over the model's parameters (under FSDP2 the sharded ones: every ZeRO stage shards the state); with
    `on_host`, its state and step in host memory (parallel.offload = 'optimizer', moeflow/train/offload.py)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # Norm weights and biases (1-D) are not decayed (Loshchilov & Hutter 2019 practice, as in GPT-2/3).
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if on_host:
        from moeflow.train.offload import HostOffloadAdamW

        return HostOffloadAdamW(groups, lr=lr, betas=betas, eps=1e-8)
    # fused: one kernel per tensor for the whole update (the foreach path runs ~8 passes over each state tensor)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, fused=True)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warm-up, then cosine to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer, warmup: int, total: int, min_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup, total, min_ratio))
