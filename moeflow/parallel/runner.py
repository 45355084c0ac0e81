"""Step runners: one interface for a training step and an evaluation, with or without pipeline parallelism.

    runner.train_step(inputs, targets, loss_scale, **model_kwargs) -> summed loss x loss_scale (every rank);
                                                                     gradients accumulated in .grad
    runner.eval_loss(inputs, targets, **model_kwargs)  -> mean loss over the trained targets, no gradients
    runner.router_loads()              -> {global layer: (tokens per expert [E], dropped)} of the last train_step

The loss is a sum over trained targets (targets equal to the ignore index are skipped) times `loss_scale`. The
trainer passes dp x cp / (trained targets in the whole global batch): the gradient average over the dp x cp ranks
then gives the gradient of the global token mean, whatever the micro-batches and ranks hold (so accumulation 4 x 1
equals 1 x 4 with uneven loss masks). Without it the scale is `runner.token_scale(targets)`: 1 / (this rank's
trained targets), or under context parallelism cp / (the trained targets of the whole sequences,
moeflow.parallel.context). `model_kwargs` (positions, document_ids of packed rows, [B, S] each) are cut into
micro-batches with the rows.

`LocalRunner` (here) runs the model's forward and backward per micro-batch; moeflow.parallel.pipeline's
`PipelineRunner` runs a pipeline schedule over the stages. `parallelize` returns the right one in its
ParallelState, so the trainer never asks which kind of run it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from moeflow.models.moe import Router


def router_layers(modules) -> dict[int, Router]:
    """{global layer index: Router} of the given modules (names 'layers.<i>.feed_forward.router')."""
    routers = {}
    for module in modules:
        for name, sub in module.named_modules():
            if isinstance(sub, Router):
                routers[int(name.split(".")[1])] = sub
    return dict(sorted(routers.items()))


def local_token_scale(targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """1 / the trained targets in `targets` (a tensor: no host sync), at least one so an all-masked batch gives 0."""
    return 1.0 / (targets != ignore_index).sum().clamp(min=1).float()


class LocalRunner:
    """`microbatches` forwards and backwards per step (gradient accumulation), with FSDP's reduction only after
    the last; each micro-batch's summed loss is multiplied by the step's loss scale."""

    def __init__(self, model: nn.Module, loss_fn: Callable, microbatches: int = 1,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 keep_gathered: bool = False):
        self.model, self.loss_fn, self.microbatches, self.autocast = model, loss_fn, microbatches, autocast
        self.keep_gathered = keep_gathered  # ZeRO-1: FSDP2 reshards only after the last micro-batch
        self.token_scale: Callable[[torch.Tensor], torch.Tensor] = local_token_scale  # the default loss scale
        self.routers = router_layers([model]) if hasattr(model, "layers") else {}
        for router in self.routers.values():
            # The aux loss rides on the routing weights' gradient, per micro-batch like the main loss.
            router.aux_loss_scale = 1.0 / microbatches
        self._loads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _set_grad_sync(self, last: bool) -> None:
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2: no reduce-scatter between micro-batches
            self.model.set_requires_gradient_sync(last)
            if self.keep_gathered:
                self.model.set_reshard_after_backward(last)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_scale=None, **model_kwargs) -> torch.Tensor:
        n = self.microbatches
        if inputs.shape[0] % n:
            raise ValueError(f"{n} micro-batches must divide the per-rank batch ({inputs.shape[0]} sequences)")
        rows_per = inputs.shape[0] // n
        scale = self.token_scale(targets) if loss_scale is None else loss_scale
        loss_sum = torch.zeros((), device=inputs.device)
        self._loads = {}
        for m in range(n):
            rows = slice(m * rows_per, (m + 1) * rows_per)
            self._set_grad_sync(m == n - 1)
            with self.autocast():
                logits = self.model(inputs[rows], **{k: v[rows] for k, v in model_kwargs.items()})
            loss = self.loss_fn(logits, targets[rows], reduction="sum") * scale
            loss.backward()
            loss_sum += loss.detach()
            for layer, r in self.routers.items():  # read right after forward: recomputation rewrites it
                load, dropped = self._loads.get(layer, (0.0, 0.0))
                self._loads[layer] = (load + r.last_load, dropped + r.last_dropped)
        return loss_sum

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor, **model_kwargs) -> torch.Tensor:
        with self.autocast():
            logits = self.model(inputs, **model_kwargs)
        return (self.loss_fn(logits, targets, reduction="sum") * self.token_scale(targets)).float()

    def router_loads(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return dict(self._loads)
