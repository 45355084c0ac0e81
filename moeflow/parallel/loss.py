"""Cross-entropy for every layout: plain logits, or logits whose vocabulary is split over tensor-parallel ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of logits whose vocab is split over a tp group (Megatron-LM's vocab-parallel CE).

    The gradient softmax - onehot is local to each shard, so the backward needs no communication.
    """

    @staticmethod
    def forward(ctx, logits_NVl, targets_N, vocab_start: int, group, ignore_index: int):
        x_NVl = logits_NVl.float()
        max_N = x_NVl.amax(-1)
        dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=group)
        exp_NVl = (x_NVl - max_N.unsqueeze(-1)).exp()
        sumexp_N = exp_NVl.sum(-1)
        dist.all_reduce(sumexp_N, group=group)
        local_target_N = targets_N - vocab_start
        here_N = (local_target_N >= 0) & (local_target_N < x_NVl.shape[-1])
        safe_target_N = torch.where(here_N, local_target_N, 0)
        target_logit_N = x_NVl.gather(-1, safe_target_N.unsqueeze(-1)).squeeze(-1) * here_N
        dist.all_reduce(target_logit_N, group=group)
        valid_N = targets_N != ignore_index
        loss_N = (sumexp_N.log() + max_N - target_logit_N) * valid_N
        ctx.save_for_backward(exp_NVl, sumexp_N, safe_target_N, here_N, valid_N)
        ctx.logits_dtype = logits_NVl.dtype
        return loss_N

    @staticmethod
    def backward(ctx, grad_N):
        exp_NVl, sumexp_N, safe_target_N, here_N, valid_N = ctx.saved_tensors
        grad_N = grad_N * valid_N
        grad_NVl = exp_NVl / sumexp_N.unsqueeze(-1) * grad_N.unsqueeze(-1)
        rows = torch.arange(grad_NVl.shape[0], device=grad_NVl.device)
        grad_NVl[rows, safe_target_N] -= grad_N * here_N
        return grad_NVl.to(ctx.logits_dtype), None, None, None, None


def tp_loss(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
            reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits [..., V] against targets [...]; a plain tensor, equal on every tp rank.

    With plain logits this is F.cross_entropy (in fp32). With vocab-sharded DTensor logits (the head of a
    tp_plan with loss_parallel) each rank keeps its [..., V/tp] shard; no context manager is needed around
    backward, unlike torch's loss_parallel().
    """
    if not isinstance(logits, DTensor):
        loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index,
                               reduction=reduction)
        return loss.view(targets.shape) if reduction == "none" else loss
    placement = logits.placements[0]
    if logits.device_mesh.ndim != 1 or not placement.is_shard(logits.ndim - 1):
        raise ValueError(f"tp_loss expects logits sharded on the vocab dim over a 1-D tp mesh, got "
                         f"{logits.placements} on a {logits.device_mesh.ndim}-D mesh")
    mesh = logits.device_mesh
    vocab = logits.shape[-1]
    # DTensor shards like torch.chunk: ceil(V / tp) columns per rank, the last ones possibly fewer.
    vocab_start = min(mesh.get_local_rank() * math.ceil(vocab / mesh.size()), vocab)
    local_NVl = logits.to_local().flatten(0, -2)
    loss_N = _VocabParallelCrossEntropy.apply(local_NVl, targets.flatten(), vocab_start, mesh.get_group(),
                                              ignore_index)
    if reduction == "none":
        return loss_N.view(targets.shape)
    if reduction == "sum":
        return loss_N.sum()
    if reduction == "mean":
        return loss_N.sum() / (targets != ignore_index).sum()
    raise ValueError(f"tp_loss: reduction = {reduction!r}; choose 'mean', 'sum' or 'none'")
