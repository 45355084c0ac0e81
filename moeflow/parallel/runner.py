"""Step runners: one interface for a training step and an evaluation, with or without pipeline parallelism.

    runner.train_step(inputs, targets, loss_scale, **model_kwargs) -> summed loss x loss_scale (every rank);
                                                                     gradients accumulated in .grad
    runner.eval_loss(inputs, targets, **model_kwargs)  -> mean loss over the trained targets, no gradients
    runner.router_loads()              -> {global layer: (tokens per expert [E], dropped)} of the last train_step
    runner.extra_losses()              -> {"mtp_loss": scalar} of the last train_step (empty without MTP)

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
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from moeflow.core import phases
from moeflow.models.moe import Router
from moeflow.models.phase_range import phase_range
from moeflow.models.transformer import router_layer_index


def router_layers(modules) -> dict[int, Router]:
    """{global layer index: Router} of the given modules (names 'layers.<i>.feed_forward.router'; an MTP block's
    router 'mtp.<k>....' is layer n_layers + k)."""
    from moeflow.parallel.hf_experts import hf_routing

    routers = {}
    for module in modules:
        if hasattr(module, "layers"):  # moeflow's model, or a stage of it (names 'layers.<i>...', 'mtp.<k>...')
            n_layers = module.cfg.n_layers if hasattr(module, "cfg") else 0
            for name, sub in module.named_modules():
                if isinstance(sub, Router):
                    routers[router_layer_index(name, n_layers)] = sub
        routers.update(hf_routing(module))  # transformers' MoE blocks: their routing read as a Router's
    return dict(sorted(routers.items()))


def local_token_scale(targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """1 / the trained targets in `targets` (a tensor: no host sync), at least one so an all-masked batch gives 0."""
    return 1.0 / (targets != ignore_index).sum().clamp(min=1).float()


def global_batch_routers(routers: dict[int, Router]) -> dict[int, Router]:
    return {i: r for i, r in routers.items()
            if isinstance(r, Router) and r.cfg.aux_loss_type == "global_batch" and r.cfg.aux_loss_coef > 0}


def pipeline_counts_first(cfg) -> bool:
    """Whether a pipeline's steps start with the global-batch balance loss's counting pass (a forward-only pass of
    the whole pipeline). Decided from the model config (a `ModelConfig`), so that every pp rank agrees: a rank whose
    stages hold no MoE layer still has to run the forward-only pass its peers run."""
    moe = cfg.moe
    return (cfg.is_moe and (cfg.num_moe_layers > 0 or cfg.mtp_depth > 0) and moe.aux_loss_type == "global_batch"
            and moe.aux_loss_coef > 0)


def supply_global_selections(routers: dict[int, Router], counts: dict[int, torch.Tensor], groups=()) -> None:
    """Sum each router's selection counts over the process `groups` of the ranks that route other tokens (none:
    one rank; moeflow.parallel.parallelize._balance_groups) in one all-reduce per group and hand them over
    (Router.global_selected). Every rank of a group holds the same routers (the same stage)."""
    if not routers:
        return
    layers = sorted(routers)
    packed = torch.stack([counts[i] for i in layers])
    for group in groups:
        dist.all_reduce(packed, group=group)
    for i, row in zip(layers, packed):
        routers[i].global_selected = row


def set_router_loss_scale(routers, per_forward: float, folded_tp: int = 1) -> None:
    """The one writer of Router.aux_loss_scale, called by a runner when it is built: the weight of one forward's
    balance and z losses in the step's gradient (1 / micro-batches under gradient accumulation, 1 under a pipeline
    schedule, which divides every gradient itself). With the MoE folded over tp (`folded_tp` ranks), each tp rank's
    losses average its own tokens and the router's gradient is summed over the tp ranks: 1/tp each makes the sum
    their mean (as over data-parallel ranks; with the global-batch loss, exactly one process's gradient)."""
    for router in routers:
        if isinstance(router, Router):  # (transformers' MoE blocks weigh their own auxiliary losses)
            router.aux_loss_scale = per_forward / folded_tp


def clear_global_selections(routers: dict[int, Router]) -> None:
    for router in routers.values():
        router.global_selected = None


class StepRunner(Protocol):
    """What the trainer steps through (the module doc): LocalRunner here, PipelineRunner in moeflow.parallel.pipeline.
    Both are built whole by parallelize (autocast, loss scale and router loss weights given at construction)."""

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_scale=None,
                   **model_kwargs) -> torch.Tensor: ...

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor, **model_kwargs) -> torch.Tensor: ...

    def router_loads(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]: ...

    def extra_losses(self) -> dict[str, torch.Tensor]: ...


class LocalRunner:
    """`microbatches` forwards and backwards per step (gradient accumulation), with FSDP's reduction only after
    the last; each micro-batch's summed loss is multiplied by the step's loss scale. `balance_groups`: the
    process groups the global-batch balance loss sums expert loads over (none: one rank); `count_first`: always
    run the counting pass for it (compiled blocks cannot defer reading the counts)."""

    def __init__(self, model: nn.Module, loss_fn: Callable, microbatches: int = 1,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 keep_gathered: bool = False, balance_groups=(), count_first: bool = False,
                 token_scale: Callable[[torch.Tensor], torch.Tensor] = local_token_scale, folded_tp: int = 1,
                 forward: Callable[..., torch.Tensor] | None = None):
        self.model, self.loss_fn, self.microbatches, self.autocast = model, loss_fn, microbatches, autocast
        # model, inputs, **model_kwargs -> logits (the adapter's: a transformers model returns an output object)
        self.forward = forward or (lambda model, inputs, **kwargs: model(inputs, **kwargs))
        self.keep_gathered = keep_gathered  # ZeRO-1: FSDP2 reshards only after the last micro-batch
        self.token_scale = token_scale  # the loss scale when the caller passes none
        self.routers = router_layers([model])
        # The aux loss rides on the routing weights' gradient, per micro-batch like the main loss.
        set_router_loss_scale(self.routers.values(), 1.0 / microbatches, folded_tp)
        self.balanced = global_batch_routers(self.routers)
        self.balance_groups, self.count_first = list(balance_groups), count_first or microbatches > 1
        self._loads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._extra: dict[str, torch.Tensor] = {}

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
        objective = self.loss_fn if isinstance(self.loss_fn, MTPObjective) else None
        clear_global_selections(self.balanced)
        try:
            if self.balanced and self.count_first:
                counts = self._count_selections(inputs, rows_per, model_kwargs)
                supply_global_selections(self.balanced, counts, self.balance_groups)
            if objective is not None:
                objective.reset()
            for m in range(n):
                rows = slice(m * rows_per, (m + 1) * rows_per)
                self._set_grad_sync(m == n - 1)
                with self.autocast():
                    logits = self.forward(self.model, inputs[rows], **{k: v[rows] for k, v in model_kwargs.items()})
                loss = self.loss_fn(logits, targets[rows], reduction="sum") * scale
                if self.balanced and not self.count_first:  # between this forward and its backward
                    supply_global_selections(self.balanced, {i: r.last_selected for i, r in self.balanced.items()},
                                             self.balance_groups)
                with phase_range(phases.BACKWARD):
                    loss.backward()
                loss_sum += loss.detach()
                for layer, r in self.routers.items():  # read right after forward: recomputation rewrites it
                    load, dropped = self._loads.get(layer, (0.0, 0.0))
                    self._loads[layer] = (load + r.last_load, dropped + r.last_dropped)
        finally:
            clear_global_selections(self.balanced)
        if objective is not None:  # report the main cross-entropy as the loss, the MTP loss beside it
            loss_sum, self._extra = objective.scaled(scale)
        return loss_sum

    @torch.no_grad()
    def _count_selections(self, inputs: torch.Tensor, rows_per: int, model_kwargs) -> dict[int, torch.Tensor]:
        """Each global-batch router's top-k selections over all of this rank's micro-batches (forward only)."""
        counts = {i: 0.0 for i in self.balanced}
        for m in range(self.microbatches):
            rows = slice(m * rows_per, (m + 1) * rows_per)
            with self.autocast():
                self.forward(self.model, inputs[rows], **{k: v[rows] for k, v in model_kwargs.items()})
            counts = {i: counts[i] + r.last_selected for i, r in self.balanced.items()}
        return counts

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor, **model_kwargs) -> torch.Tensor:
        with self.autocast():
            logits = self.forward(self.model, inputs, **model_kwargs)
        return (self.loss_fn(logits, targets, reduction="sum") * self.token_scale(targets)).float()

    def router_loads(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return dict(self._loads)

    def extra_losses(self) -> dict[str, torch.Tensor]:
        return dict(self._extra)


class MTPObjective:
    """The loss function of a model with multi-token prediction: the summed cross-entropy of the main logits plus
    mtp_loss_coef / D * sum_k L^k (DeepSeek-V3 report, eq. 25; moeflow.models.mtp), where L^k sums depth k's
    cross-entropy over its positions, so that the runner's scale (1 / the trained main targets) gives the report's
    1/T normalisation (eq. 24). Logits with only the main positions (eval mode) give the main loss alone. Each
    call's main and MTP sums are kept (detached), so a runner can report them apart: `reset()` before a step,
    `scaled(loss_scale)` after it."""

    def __init__(self, loss_fn: Callable, depth: int, coef: float):
        self.loss_fn, self.depth, self.coef = loss_fn, depth, coef
        self.reset()

    def reset(self) -> None:
        self._main, self._mtp, self._mtp_calls = 0.0, 0.0, 0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        from moeflow.models.mtp import mtp_loss_terms, split_mtp_logits

        S = targets.shape[1]
        if logits.shape[1] == S:
            main = self.loss_fn(logits, targets, reduction=reduction)
            self._main = self._main + main.detach().float()
            return main
        if reduction != "sum":
            raise ValueError(f"the MTP objective sums its terms (the runner scales them); got reduction={reduction!r}")
        parts = split_mtp_logits(logits, S, self.depth)
        main = self.loss_fn(parts[0], targets, reduction="sum")
        mtp = torch.stack(mtp_loss_terms(parts, targets, self.loss_fn)).mean()
        self._main = self._main + main.detach().float()
        self._mtp, self._mtp_calls = self._mtp + mtp.detach().float(), self._mtp_calls + 1
        return main + self.coef * mtp

    def scaled(self, loss_scale) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(main cross-entropy, {"mtp_loss": (1/D) sum_k L^k}) summed since reset, times the step's loss scale."""
        # (tensors: a runner calls this after at least one call with logits)
        extra = {"mtp_loss": self._mtp * loss_scale} if self._mtp_calls else {}
        return self._main * loss_scale, extra
