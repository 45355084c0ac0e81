"""Step runners: one interface for a training step and an evaluation, with or without pipeline parallelism.

    runner.train_step(inputs, targets) -> mean loss (every rank); gradients accumulated in .grad
    runner.eval_loss(inputs, targets)  -> mean loss (every rank), no gradients
    runner.router_loads()              -> {global layer: (tokens per expert [E], dropped)} of the last train_step
    runner.extra_losses()              -> {"mtp_loss": scalar} of the last train_step (empty without MTP)

`LocalRunner` (here) runs the model's forward and backward per micro-batch; moeflow.parallel.pipeline's
`PipelineRunner` runs a pipeline schedule over the stages. `parallelize` returns the right one in its
ParallelState, so the trainer never asks which kind of run it is.

Global-batch balance loss (model.moe.aux_loss_type = 'global_batch'): its f_e counts the top-k selections of
every token of the optimizer step, on every data-parallel rank (expert-parallel ranks are data-parallel ranks
here), but models never communicate (docs/design.md, principle 1). So the runner hands the counts to each
Router (`Router.global_selected`) before the backward that needs them, at one of two points:
- one forward per step (LocalRunner without gradient accumulation): right after that forward, one all-reduce of
  the routers' counts over the data-parallel group, then backward. Free: the loss's backward reads the counts.
- several forwards per step (gradient accumulation, every pipeline schedule, or compiled blocks): a forward-only
  counting pass over the step's micro-batches first (for a pipeline, the schedule's forward-only mode), the same
  all-reduce, then the training forwards and backwards with the counts already known. Exact for every schedule
  (1F1B runs backwards before the last forwards, so no single point between them sees all loads) at the price of
  one extra forward, where Megatron-Core instead uses the loads of the micro-batches seen so far.
Either way the loss and its gradients equal one process's on the whole global batch, for every layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from moeflow.models.moe import Router
from moeflow.models.transformer import router_layer_index


def router_layers(modules) -> dict[int, Router]:
    """{global layer index: Router} of the given modules (names 'layers.<i>.feed_forward.router'; an MTP block's
    router 'mtp.<k>....' is layer n_layers + k)."""
    routers = {}
    for module in modules:
        n_layers = module.cfg.n_layers if hasattr(module, "cfg") else 0
        for name, sub in module.named_modules():
            if isinstance(sub, Router):
                routers[router_layer_index(name, n_layers)] = sub
    return dict(sorted(routers.items()))


def global_batch_routers(routers: dict[int, Router]) -> dict[int, Router]:
    return {i: r for i, r in routers.items() if r.cfg.aux_loss_type == "global_batch" and r.cfg.aux_loss_coef > 0}


def supply_global_selections(routers: dict[int, Router], counts: dict[int, torch.Tensor], group) -> None:
    """Sum each router's selection counts over the data-parallel `group` (None: one rank) in one all-reduce and
    hand them over (Router.global_selected). Every rank of the group holds the same routers (the same stage)."""
    if not routers:
        return
    layers = sorted(routers)
    packed = torch.stack([counts[i] for i in layers])
    if group is not None:
        dist.all_reduce(packed, group=group)
    for i, row in zip(layers, packed):
        routers[i].global_selected = row


def clear_global_selections(routers: dict[int, Router]) -> None:
    for router in routers.values():
        router.global_selected = None


class LocalRunner:
    """`microbatches` forwards and backwards per step (gradient accumulation), with FSDP's reduction only after
    the last; the loss of each is `loss_fn`'s mean, divided by the number of micro-batches. `balance_group`: the
    data-parallel process group the global-batch balance loss sums expert loads over (None: one rank);
    `count_first`: always run the counting pass for it (compiled blocks cannot defer reading the counts)."""

    def __init__(self, model: nn.Module, loss_fn: Callable, microbatches: int = 1,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 balance_group=None, count_first: bool = False):
        self.model, self.loss_fn, self.microbatches, self.autocast = model, loss_fn, microbatches, autocast
        self.routers = router_layers([model]) if hasattr(model, "layers") else {}
        for router in self.routers.values():
            # The aux loss rides on the routing weights' gradient, per micro-batch like the main loss.
            router.aux_loss_scale = 1.0 / microbatches
        self.balanced = global_batch_routers(self.routers)
        self.balance_group, self.count_first = balance_group, count_first or microbatches > 1
        self._loads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._extra: dict[str, torch.Tensor] = {}

    def _set_grad_sync(self, enabled: bool) -> None:
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2: no reduce-scatter between micro-batches
            self.model.set_requires_gradient_sync(enabled)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n = self.microbatches
        if inputs.shape[0] % n:
            raise ValueError(f"{n} micro-batches must divide the per-rank batch ({inputs.shape[0]} sequences)")
        rows_per = inputs.shape[0] // n
        loss_sum = torch.zeros((), device=inputs.device)
        self._loads = {}
        objective = self.loss_fn if isinstance(self.loss_fn, MTPObjective) else None
        clear_global_selections(self.balanced)
        try:
            if self.balanced and self.count_first:
                supply_global_selections(self.balanced, self._count_selections(inputs, rows_per), self.balance_group)
            if objective is not None:
                objective.reset()
            for m in range(n):
                rows = slice(m * rows_per, (m + 1) * rows_per)
                self._set_grad_sync(m == n - 1)
                with self.autocast():
                    logits = self.model(inputs[rows])
                loss = self.loss_fn(logits, targets[rows])
                if self.balanced and not self.count_first:  # between this forward and its backward
                    supply_global_selections(self.balanced, {i: r.last_selected for i, r in self.balanced.items()},
                                             self.balance_group)
                (loss / n).backward()
                loss_sum += loss.detach() / n
                for layer, r in self.routers.items():  # read right after forward: recomputation rewrites it
                    load, dropped = self._loads.get(layer, (0.0, 0.0))
                    self._loads[layer] = (load + r.last_load, dropped + r.last_dropped)
        finally:
            clear_global_selections(self.balanced)
        if objective is not None:  # report the main cross-entropy as the loss, the MTP loss beside it
            loss_sum, self._extra = objective.means()
        return loss_sum

    @torch.no_grad()
    def _count_selections(self, inputs: torch.Tensor, rows_per: int) -> dict[int, torch.Tensor]:
        """Each global-batch router's top-k selections over all of this rank's micro-batches (forward only)."""
        counts = {i: 0.0 for i in self.balanced}
        for m in range(self.microbatches):
            with self.autocast():
                self.model(inputs[m * rows_per:(m + 1) * rows_per])
            counts = {i: counts[i] + r.last_selected for i, r in self.balanced.items()}
        return counts

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            logits = self.model(inputs)
        return self.loss_fn(logits, targets).float()

    def router_loads(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return dict(self._loads)

    def extra_losses(self) -> dict[str, torch.Tensor]:
        return dict(self._extra)


class MTPObjective:
    """The loss function of a model with multi-token prediction: cross-entropy of the main logits plus
    mtp_loss_coef / D * sum_k L^k (DeepSeek-V3 report, eq. 25; moeflow.models.mtp). Logits with only the main
    positions (eval mode) give the main cross-entropy alone. Each call's main and MTP losses are summed (detached),
    so a runner can report them apart: `reset()` before a step, `means()` after it."""

    def __init__(self, loss_fn: Callable, depth: int, coef: float):
        self.loss_fn, self.depth, self.coef = loss_fn, depth, coef
        self.reset()

    def reset(self) -> None:
        self._main, self._mtp, self._calls, self._mtp_calls = 0.0, 0.0, 0, 0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from moeflow.models.mtp import mtp_loss_terms, split_mtp_logits

        S = targets.shape[1]
        if logits.shape[1] == S:
            main = self.loss_fn(logits, targets)
            self._main, self._calls = self._main + main.detach().float(), self._calls + 1
            return main
        parts = split_mtp_logits(logits, S, self.depth)
        main = self.loss_fn(parts[0], targets)
        mtp = torch.stack(mtp_loss_terms(parts, targets, self.loss_fn)).mean()
        self._main, self._calls = self._main + main.detach().float(), self._calls + 1
        self._mtp, self._mtp_calls = self._mtp + mtp.detach().float(), self._mtp_calls + 1
        return main + self.coef * mtp

    def means(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(mean main cross-entropy, {"mtp_loss": mean of (1/D) sum_k L^k}) over the calls since reset."""
        main = self._main / max(1, self._calls)
        extra = {"mtp_loss": torch.as_tensor(self._mtp / self._mtp_calls)} if self._mtp_calls else {}
        return torch.as_tensor(main), extra
