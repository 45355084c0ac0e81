"""Gradients of a parallelized model: the global norm and clipping.

Gradients are DTensors on different meshes (experts on the expert mesh, the rest on the data mesh, 2-D with
tp), which torch's clip_grad_norm_ cannot stack, so each rank sums the squares of the elements it is the one to
count and the sums are added over all ranks.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from moeflow.parallel.state import ParallelState


def _spans_tp(mesh, tp_ranks: list[int], cache: dict) -> bool:
    """Whether one of the mesh's dims covers the tp ranks (by ranks rather than by names): the tp dim itself, or a
    flattened dim that holds it (a folded MoE's shared experts are sharded over dp_shard_cp_tp). Its placement then
    says which of the tp ranks count an element: all of them when sharded, coordinate 0 when replicated."""
    key = id(mesh)
    if key not in cache:
        cache[key] = any(set(tp_ranks) <= set(dist.get_process_group_ranks(mesh.get_group(d)))
                         for d in range(mesh.ndim))
    return cache[key]


def reduce_tp_partial_grads(state: ParallelState) -> None:
    """Sum over the tp ranks the gradients that are partial there (the folded MoE's router and the per-token parts
    beside a layer's mixer, each tp rank's from its own tokens; FSDP's reduce-scatter sums the shared experts'),
    and average those of the token mixers that run whole on every tp rank (the same gradient on each, up to the
    summation order of a GPU kernel's backward: averaged, their copies cannot drift apart), in one flat
    all-reduce; a no-op otherwise. Once per step: a gradient already reduced (same tensor, same version) is not
    reduced again, so calling it twice is safe."""
    done = state.tp_reduced

    def reduced(p) -> bool:  # this very gradient tensor, unchanged since it was reduced (an id could be reused)
        ref, version = done.get(id(p), (None, None))
        return ref is not None and ref() is p.grad and version == p.grad._version

    if state.tp_mesh is None:
        return
    tp = state.tp_mesh.size()
    per_token = [p for part in state.tp_per_token.values() for p in part.parameters()]
    scaled = [(p, 1.0) for p in [*state.tp_partial, *per_token]]
    scaled += [(p, 1.0 / tp) for mixer in state.tp_whole.values() for p in mixer.parameters()]
    pending = [(p, scale) for p, scale in scaled if p.grad is not None and not reduced(p)]
    if not pending:
        return
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p, _ in pending]
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, group=state.tp_mesh.get_group())
    offset = 0
    for (_, scale), g in zip(pending, local):
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        if scale != 1.0:
            g.mul_(scale)
        offset += g.numel()
    for p, _ in pending:
        done[id(p)] = (weakref.ref(p.grad), p.grad._version)


def grad_norm_sq_local(model: nn.Module, tp_mesh=None, distinct_over_tp: set[int] | None = None) -> torch.Tensor:
    """This rank's share of the squared gradient norm: summed over ALL ranks it is the exact ||g||^2.

    A gradient element held by several ranks is counted on one of them: for a DTensor, only the ranks at
    coordinate 0 of each mesh dim whose placement is Replicate count it (tp for SequenceParallel norms,
    dp_replicate under HSDP; a mesh dim that contains the tp ranks, as a folded MoE's shared experts' does, places
    them too); a parameter that tensor parallelism left unsharded (plain, or a DTensor on a mesh without such a
    dim, e.g. the MoE router after FSDP) is replicated over tp and counted on tp rank 0 only, unless it is in
    `distinct_over_tp` (a folded MoE's experts: other ones on each tp rank).
    Partial gradients (SequenceParallel norm weights when no FSDP reduces them) are all-reduced first and
    replaced by the reduced ones, so every rank must call this, in the same order of parameters.
    """
    tp_ranks = dist.get_process_group_ranks(tp_mesh.get_group()) if tp_mesh is not None else []
    tp_rank = tp_mesh.get_local_rank() if tp_mesh is not None else 0
    spans_tp_cache: dict = {}
    device = next(model.parameters()).device
    total = torch.zeros((), device=device, dtype=torch.float32)
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                # Reduce once, in place: the optimizer would otherwise all-reduce it again in each of its ops.
                grad = param.grad = grad.redistribute(
                    placements=[Replicate() if p.is_partial() else p for p in grad.placements])
            mesh = grad.device_mesh
            counted_here = all(mesh.get_local_rank(d) == 0 for d, p in enumerate(grad.placements)
                               if p.is_replicate())
            replicated_over_tp = tp_mesh is not None and not _spans_tp(mesh, tp_ranks, spans_tp_cache)
            local = grad.to_local()
        else:
            counted_here, local = True, grad
            replicated_over_tp = tp_mesh is not None
        if replicated_over_tp and tp_rank != 0 and id(param) not in (distinct_over_tp or ()):
            counted_here = False
        if counted_here:
            total = total + local.float().pow(2).sum()
    return total


def clip_grad_norm_(model: nn.Module, max_norm: float, state: ParallelState | None = None) -> torch.Tensor:
    """Clip the global gradient norm of a model parallelized as `state` describes (None: not parallelized);
    returns the norm before clipping. Finishes the gradients first (reduce_tp_partial_grads): call it, with
    max_norm = inf if no clipping is wanted, between backward and the optimizer step."""
    if state is not None:
        reduce_tp_partial_grads(state)
    distributed = state is not None and state.dims.world_size > 1 and dist.is_initialized()
    if distributed:
        # may replace partial gradients by reduced ones: read the gradients after
        sq = grad_norm_sq_local(model, state.tp_mesh, {id(p) for p in state.tp_distinct})
        dist.all_reduce(sq)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if not distributed:
        device = next(model.parameters()).device
        sq = torch.stack([g.float().pow(2).sum() for g in local]).sum() if local else torch.zeros((), device=device)
    norm = sq.sqrt()
    if max_norm < float("inf"):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(local, coef)
    return norm
