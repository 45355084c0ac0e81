"""Step runners: one interface for a training step and an evaluation, with or without pipeline parallelism.

    runner.train_step(inputs, targets) -> mean loss (every rank); gradients accumulated in .grad
    runner.eval_loss(inputs, targets)  -> mean loss (every rank), no gradients
    runner.router_loads()              -> {global layer: (tokens per expert [E], dropped)} of the last train_step

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


class LocalRunner:
    """`microbatches` forwards and backwards per step (gradient accumulation), with FSDP's reduction only after
    the last; the loss of each is `loss_fn`'s mean, divided by the number of micro-batches."""

    def __init__(self, model: nn.Module, loss_fn: Callable, microbatches: int = 1,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 keep_gathered: bool = False):
        self.model, self.loss_fn, self.microbatches, self.autocast = model, loss_fn, microbatches, autocast
        self.keep_gathered = keep_gathered  # ZeRO-1: FSDP2 reshards only after the last micro-batch
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

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n = self.microbatches
        if inputs.shape[0] % n:
            raise ValueError(f"{n} micro-batches must divide the per-rank batch ({inputs.shape[0]} sequences)")
        rows_per = inputs.shape[0] // n
        loss_sum = torch.zeros((), device=inputs.device)
        self._loads = {}
        for m in range(n):
            rows = slice(m * rows_per, (m + 1) * rows_per)
            self._set_grad_sync(m == n - 1)
            with self.autocast():
                logits = self.model(inputs[rows])
            loss = self.loss_fn(logits, targets[rows])
            (loss / n).backward()
            loss_sum += loss.detach() / n
            for layer, r in self.routers.items():  # read right after forward: recomputation rewrites it
                load, dropped = self._loads.get(layer, (0.0, 0.0))
                self._loads[layer] = (load + r.last_load, dropped + r.last_dropped)
        return loss_sum

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            logits = self.model(inputs)
        return self.loss_fn(logits, targets).float()

    def router_loads(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return dict(self._loads)
